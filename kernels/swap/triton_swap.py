"""Triton swap kernels: the GPU path, same signatures as ``kernels.swap.reference``.

One kernel moves whole blocks. Because the cache is block-major, block ``i`` (every
layer's K and V) is one contiguous chunk, so a single launch covers all layers: the grid
is ``(n blocks, chunks per block)`` and each program copies one 16 KiB chunk of one block.
The kernel sees every tensor as int32 words, so one compiled kernel serves every dtype
(a pure copy needs no arithmetic, so bf16 is never computed on), and the 16-byte alignment
the checks enforce lets it move 16-byte vectors.

A run of consecutive ids needs no kernel at all: it is one slice of the cache, moved by one
copy. ``out``/``src`` may be on the cache's device or in pinned host memory, which the
kernel then reads or writes directly over the bus (mapped memory); the staging pool in
``kernels.swap.swapper`` picks between that and staging on the device, by measurement.

A second kernel moves a tensor-parallel rank's head slice (``gather_heads`` /
``scatter_heads``, kernels/swap/heads.py): a block is ``layers * 2 * block_size`` rows,
and each row's slice (``heads * head_dim`` elements) is a strided run in the staging row;
each program copies a tile of rows, again as int32 words (so one kernel per direction
serves every dtype, and a row slice must be a whole number of words).

Synchronisation is stream-ordered, as in the reference: work is enqueued on the current
stream and host memory is valid once that stream has been synchronised.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.swap.checks import (
    TRITON_ALIGNMENT,
    BlockIds,
    block_nbytes,
    check_gather,
    check_scatter,
    check_triton_operands,
    device_ids,
)
from kernels.swap.errors import SwapAlignmentError, SwapShapeError
from kernels.swap.heads import HeadSlice, check_heads
from kernels.swap.runs import copy_if_one_run

# int32 words one program copies: 16 KiB, 8 16-byte vectors per thread at 4 warps.
CHUNK_WORDS = 4096
_WORD_BYTES = 4
_VEC_WORDS = TRITON_ALIGNMENT // _WORD_BYTES
# CUDA's limit on the second grid dimension bounds the chunks of one block (1 GiB blocks).
_MAX_CHUNKS = 65535


@triton.jit
def _bases(block, row, src_stride, dst_stride, GATHER: tl.constexpr):
    """Where a row's block starts in the source and the destination: the cache is
    addressed by block id, staging by row."""
    if GATHER:
        src = block * src_stride
        dst = row * dst_stride
    else:
        src = row * src_stride
        dst = block * dst_stride
    return src, dst


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, block_vecs, GATHER: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    block = tl.load(ids_ptr + row).to(tl.int64)
    # Written as vecs * 4 so the compiler knows every block starts on a 16-byte boundary.
    block_words = block_vecs * 4
    src_base, dst_base = _bases(block, row, block_words, block_words, GATHER)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_words
    words = tl.load(src_ptr + src_base + offs, mask=mask)
    tl.store(dst_ptr + dst_base + offs, words, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, block_words]`` int32 words (same memory)."""
    return t.view(t.shape[0], -1).view(torch.int32)


def check_device(cache: torch.Tensor) -> None:
    if cache.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SwapShapeError(
            f"the Triton swap kernels need a CUDA cache (got one on {cache.device}); on the CPU "
            "use kernels.swap.reference, or set TRITON_INTERPRET=1 before importing this module"
        )


def _launch(src: torch.Tensor, dst: torch.Tensor, ids_on_device: torch.Tensor, cache: torch.Tensor, gather: bool) -> None:
    n = ids_on_device.numel()
    if n == 0:
        return
    block_vecs = block_nbytes(cache) // TRITON_ALIGNMENT
    chunks = triton.cdiv(block_vecs * _VEC_WORDS, CHUNK_WORDS)
    if chunks > _MAX_CHUNKS:
        raise SwapShapeError(f"a block of {block_nbytes(cache)} bytes is too large for the swap kernel's grid")
    # Triton launches on the current device; make it the cache's (switching costs host time).
    switch = cache.is_cuda and cache.device.index != torch.cuda.current_device()
    with torch.cuda.device(cache.device) if switch else contextlib.nullcontext():
        _copy_blocks_kernel[(n, chunks)](
            _words(src), _words(dst), ids_on_device, block_vecs, GATHER=gather, CHUNK=CHUNK_WORDS
        )


def launch_gather(cache: torch.Tensor, ids_on_device: torch.Tensor, out: torch.Tensor) -> None:
    """Unchecked kernel launch: ``out[j] = cache[ids_on_device[j]]``.

    For callers that checked their operands once (the staging pool): ``ids_on_device`` is
    int64 on the cache's device, ``out`` holds ``n`` blocks on the device or pinned.
    """
    _launch(cache, out, ids_on_device, cache, gather=True)


def launch_scatter(src: torch.Tensor, ids_on_device: torch.Tensor, cache: torch.Tensor) -> None:
    """Unchecked kernel launch: ``cache[ids_on_device[j]] = src[j]`` (ids must not repeat)."""
    _launch(src, cache, ids_on_device, cache, gather=False)


def gather_blocks(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor) -> None:
    """``out[j] = cache[block_ids[j]]`` for every j. Repeated ids are allowed."""
    _swap(cache, check_gather(cache, block_ids, out), out, out=True)


def scatter_blocks(src: torch.Tensor, block_ids: BlockIds, cache: torch.Tensor) -> None:
    """``cache[block_ids[j]] = src[j]`` for every j. Ids must not repeat."""
    _swap(cache, check_scatter(src, block_ids, cache), src, out=False)


def _swap(cache: torch.Tensor, ids: np.ndarray, staging: torch.Tensor, *, out: bool) -> None:
    check_triton_operands(cache, staging)
    check_device(cache)
    if copy_if_one_run(cache, ids, staging, out=out):
        return
    src, dst = (cache, staging) if out else (staging, cache)
    _launch(src, dst, device_ids(ids, cache.device), cache, gather=out)


# -- head slices (tensor parallelism) ---------------------------------------------------------

# int32 words one program of the head-slice kernel copies (rows x row words, padded).
_HEAD_TILE_WORDS = 4096


@triton.jit
def _copy_rows_kernel(
    src_ptr, dst_ptr, ids_ptr, rows, row_words, src_block, dst_block, src_row, dst_row, src_off, dst_off,
    GATHER: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    block = tl.load(ids_ptr + j).to(tl.int64)
    src_base, dst_base = _bases(block, j, src_block, dst_block, GATHER)
    r = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    w = tl.arange(0, WORDS)
    mask = (r[:, None] < rows) & (w[None, :] < row_words)
    words = tl.load(src_ptr + src_base + r[:, None] * src_row + src_off + w[None, :], mask=mask)
    tl.store(dst_ptr + dst_base + r[:, None] * dst_row + dst_off + w[None, :], words, mask=mask)


def _head_words(cache: torch.Tensor, heads: int) -> int:
    nbytes = heads * cache.shape[5] * cache.element_size()
    if nbytes % _WORD_BYTES:
        raise SwapAlignmentError(f"a row of {heads} heads is {nbytes} bytes, not whole {_WORD_BYTES}-byte words (use kernels.swap.reference)")
    return nbytes // _WORD_BYTES


def _launch_rows(src: torch.Tensor, dst: torch.Tensor, ids_on_device: torch.Tensor, cache: torch.Tensor, staging: torch.Tensor,
                 heads: HeadSlice, cache_first: int, staging_first: int, count: int, gather: bool) -> None:
    n = ids_on_device.numel()
    if n == 0 or count == 0:
        return
    rows = cache.shape[1] * 2 * cache.shape[3]
    cache_row, staging_row = _head_words(cache, heads.count), _head_words(cache, heads.total)
    row_words = _head_words(cache, count)
    unit = _head_words(cache, 1)
    cache_block, staging_block = rows * cache_row, rows * staging_row
    words = triton.next_power_of_2(row_words)
    tile_rows = max(1, _HEAD_TILE_WORDS // words)
    grid = (n, triton.cdiv(rows, tile_rows))
    if gather:
        args = (cache_block, staging_block, cache_row, staging_row, cache_first * unit, staging_first * unit)
    else:
        args = (staging_block, cache_block, staging_row, cache_row, staging_first * unit, cache_first * unit)
    switch = cache.is_cuda and cache.device.index != torch.cuda.current_device()
    with torch.cuda.device(cache.device) if switch else contextlib.nullcontext():
        _copy_rows_kernel[grid](
            src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), ids_on_device, rows, row_words, *args,
            GATHER=gather, ROWS=tile_rows, WORDS=words,
        )


def launch_gather_heads(cache: torch.Tensor, ids_on_device: torch.Tensor, out: torch.Tensor, heads: HeadSlice) -> None:
    """Unchecked: ``out`` rows (whole blocks, on the device or pinned) get the written heads."""
    la, lb = heads.written_local
    _launch_rows(cache, out, ids_on_device, cache, out, heads, la, heads.written[0], lb - la, gather=True)


def launch_scatter_heads(src: torch.Tensor, ids_on_device: torch.Tensor, cache: torch.Tensor, heads: HeadSlice) -> None:
    """Unchecked: every cache head of blocks ``ids_on_device`` from ``src`` rows (whole blocks)."""
    _launch_rows(src, cache, ids_on_device, cache, src, heads, 0, heads.first, heads.count, gather=False)


def gather_heads(cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor, heads: HeadSlice) -> None:
    """Same as ``kernels.swap.reference.gather_heads``: one launch for every block."""
    ids = check_heads(cache, out, block_ids, heads, unique=False, role="out")
    check_triton_operands(cache, out)
    check_device(cache)
    launch_gather_heads(cache, device_ids(ids, cache.device), out, heads)


def scatter_heads(src: torch.Tensor, block_ids: BlockIds, cache: torch.Tensor, heads: HeadSlice) -> None:
    """Same as ``kernels.swap.reference.scatter_heads``: one launch for every block."""
    ids = check_heads(cache, src, block_ids, heads, unique=True, role="src")
    check_triton_operands(cache, src)
    check_device(cache)
    launch_scatter_heads(src, device_ids(ids, cache.device), cache, heads)
