"""Triton token bitmask application; same signature and semantics as ``reference``.

One program per (constrained row, block of ``BLOCK`` tokens): it loads the block's words,
tests each token's bit and stores ``-inf`` where it is clear. Only constrained rows are
launched, so a batch with one constrained request costs one row's worth of work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.bitmask.reference import _check

_BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, vocab_size, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(rows_ptr + r)
    tokens = b * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    words = tl.load(bitmask_ptr + r * bitmask_stride + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    ptrs = logits_ptr + row * logits_stride + tokens
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty), mask=in_vocab & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """See ``kernels.bitmask.reference.apply_token_bitmask_``."""
    _check(logits, bitmask, rows)
    if rows.numel() == 0:
        return logits
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    vocab = logits.shape[1]
    grid = (rows.shape[0], triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab, BLOCK=_BLOCK)
    return logits
