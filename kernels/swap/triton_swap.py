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
from kernels.swap.errors import SwapShapeError
from kernels.swap.runs import copy_if_one_run

# int32 words one program copies: 16 KiB, 8 16-byte vectors per thread at 4 warps.
CHUNK_WORDS = 4096
_WORD_BYTES = 4
_VEC_WORDS = TRITON_ALIGNMENT // _WORD_BYTES
# CUDA's limit on the second grid dimension bounds the chunks of one block (1 GiB blocks).
_MAX_CHUNKS = 65535


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, ids_ptr, block_vecs, GATHER: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    block = tl.load(ids_ptr + row).to(tl.int64)
    # Written as vecs * 4 so the compiler knows every block starts on a 16-byte boundary.
    block_words = block_vecs * 4
    if GATHER:
        src_base = block * block_words
        dst_base = row * block_words
    else:
        src_base = row * block_words
        dst_base = block * block_words
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
