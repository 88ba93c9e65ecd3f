"""What the digest kernels accept, checked before a launch with a clear error."""

from __future__ import annotations

from typing import Sequence, Union

import torch

from kernels.digest import xxh3

Ints = Union[torch.Tensor, Sequence[int]]


class DigestShapeError(ValueError):
    """Operands the digest kernels cannot take (shape, dtype, device, range)."""


def token_row_nbytes(cache: torch.Tensor) -> int:
    """Bytes of one token's K (or V) row: ``kv_heads * head_dim`` elements."""
    return cache.shape[4] * cache.shape[5] * cache.element_size()


def supports(cache: torch.Tensor) -> bool:
    """Whether the kernels can digest this cache's blocks: a contiguous 6-D cache whose token
    row is whole 8-byte words and whose one-token payload is already a long XXH3 input
    (more than 240 bytes: every real model's; tiny test models may fall short)."""
    if cache.dim() != 6 or not cache.is_contiguous():
        return False
    row = token_row_nbytes(cache)
    return row % 8 == 0 and cache.shape[1] * 2 * row >= xxh3.MIN_LEN


def _as_list(values: Ints, what: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point:
            raise DigestShapeError(f"{what} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}")
        return values.tolist()
    return [int(v) for v in values]


def check_layout(cache: torch.Tensor, out: torch.Tensor, n: int) -> None:
    """The cache is digestable and ``out`` holds ``n`` int64 digests."""
    if not supports(cache):
        raise DigestShapeError(
            f"cannot digest a cache of shape {tuple(cache.shape)} {cache.dtype} (contiguous: {cache.is_contiguous()}): "
            f"a token row must be whole 8-byte words and a one-token payload at least {xxh3.MIN_LEN} bytes"
        )
    if out.dtype != torch.int64 or out.dim() != 1 or out.numel() != n:
        raise DigestShapeError(f"out must be {n} int64 values, got {out.dtype} {tuple(out.shape)}")


def check_digest(cache: torch.Tensor, block_ids: Ints, num_tokens: Ints, out: torch.Tensor) -> tuple[list[int], list[int]]:
    """Validate every operand, values included (a host read): the ids and token counts as lists."""
    ids, tokens = _as_list(block_ids, "block_ids"), _as_list(num_tokens, "num_tokens")
    if len(ids) != len(tokens):
        raise DigestShapeError(f"{len(ids)} block ids with {len(tokens)} token counts")
    check_layout(cache, out, len(ids))
    bad = [b for b in ids if not 0 <= b < cache.shape[0]]
    if bad:
        raise DigestShapeError(f"block ids {bad[:4]} outside the cache's {cache.shape[0]} blocks")
    bad = [t for t in tokens if not 1 <= t <= cache.shape[3]]
    if bad:
        raise DigestShapeError(f"token counts {bad[:4]} outside [1, {cache.shape[3]}]")
    return ids, tokens
