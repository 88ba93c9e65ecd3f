"""Triton row-wise argmax: ``argmax(x)`` of ``kernels/argmax/reference.py``.

Grid ``(rows, chunks)``: each program reduces ``BLOCK`` columns of its row to a (value,
index, first NaN) triple and stores it; the last program of a row to arrive
(kernels/split_counters.py) merges the row's chunks in column order, so the first index of
the maximum wins exactly as in torch, whatever order the programs ran in. NaN compares
largest, as torch's argmax has it: a row with a NaN answers its first NaN.

No host reads: capturable in a CUDA graph once compiled by an eager call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.split_counters import split_counters

_BLOCK = 4096
_NO_INDEX = 2**31 - 1


@triton.jit
def _argmax_kernel(
    x_ptr, out_ptr, val_ptr, idx_ptr, nan_ptr, count_ptr,
    n_cols, stride_row,
    NO_INDEX: tl.constexpr, BLOCK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
    is_nan = (x != x) & inside
    first_nan = tl.min(tl.where(is_nan, cols, NO_INDEX), axis=0)
    x = tl.where(is_nan, float("-inf"), x)
    best = tl.max(x, axis=0)
    best_idx = tl.min(tl.where(inside & (x == best), cols, NO_INDEX), axis=0)
    if chunks == 1:
        tl.store(out_ptr + row, tl.where(first_nan < NO_INDEX, first_nan, best_idx).to(tl.int64))
    else:
        slot = row * chunks + chunk
        tl.store(val_ptr + slot, best)
        tl.store(idx_ptr + slot, best_idx)
        tl.store(nan_ptr + slot, first_nan)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == chunks - 1:
            # All chunks at once (one round of loads, not one per chunk): the largest value
            # wins, and of its chunks the first, i.e. the smallest index (chunks cover columns
            # in order); the smallest first-NaN index answers a row with a NaN.
            c = tl.arange(0, BLOCK_CHUNKS)
            live = c < chunks
            part = row * chunks + c
            v = tl.load(val_ptr + part, mask=live, other=float("-inf"), cache_modifier=".cg")
            i = tl.load(idx_ptr + part, mask=live, other=NO_INDEX, cache_modifier=".cg")
            n = tl.load(nan_ptr + part, mask=live, other=NO_INDEX, cache_modifier=".cg")
            m = tl.max(v, axis=0)
            m_idx = tl.min(tl.where(live & (v == m), i, NO_INDEX), axis=0)
            nan_idx = tl.min(n, axis=0)
            tl.store(out_ptr + row, tl.where(nan_idx < NO_INDEX, nan_idx, m_idx).to(tl.int64))
            tl.atomic_xchg(count_ptr + row, 0)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: each row's first index of its largest value (NaN is largest).
    ``x``: ``[B, V]`` with unit column stride (rows may be strided)."""
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"argmax takes [rows, columns] with contiguous columns, got shape {tuple(x.shape)} strides {x.stride()}")
    rows, cols = x.shape
    if cols == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(cols))
    chunks = triton.cdiv(cols, block)
    if chunks > 1:
        parts = torch.empty((3, rows * chunks), dtype=torch.int32, device=x.device)  # one allocation
        vals, idx, nans = parts[0].view(torch.float32), parts[1], parts[2]
        counts = split_counters(x.device, rows)
    else:  # unused with one chunk
        vals = idx = nans = counts = out
    _argmax_kernel[(rows, chunks)](
        x, out, vals, idx, nans, counts, cols, x.stride(0),
        NO_INDEX=_NO_INDEX, BLOCK=block, BLOCK_CHUNKS=triton.next_power_of_2(chunks), num_warps=4 if block >= 1024 else 1,
    )
    return out
