"""Torch reference for paged attention: the CPU path, and the oracle the Triton kernels are tested against.

Shapes (all kernels in kernels/attention share these signatures):

- ``k_cache``, ``v_cache``: one layer's view of the paged cache,
  ``[num_blocks, block_size, num_kv_heads, head_dim]``; may be strided (the engine's
  cache is block-major, see libs/kvpool/layout.py), so nothing here assumes contiguity.
- ``slot_mapping``: ``[T]`` int64, flat slot ``block_id * block_size + offset`` per token.
- ``block_tables``: ``[B, max_blocks]`` int32, padded with any valid block id.
- ``seq_lens``: ``[B]`` int32, context length of each sequence *including* this step's tokens.
- ``query_start_loc``: ``[B + 1]`` int32, cumulative query lengths (varlen layout).
- ``q``: ``[T, num_heads, head_dim]``; ``num_heads`` is a multiple of ``num_kv_heads`` (GQA).

Queries sit at the end of their sequence: query ``j`` of a sequence with ``n`` queries and
context ``L`` is at position ``L - n + j`` and attends to keys ``[0, L - n + j]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.rope import reference as rope_reference


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K and V (``[T, kv_heads, head_dim]``) into their cache slots.
    Slots ``< 0`` are padding (e.g. a CUDA-graph batch padded past its real tokens) and write
    nothing."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # padding present (rare off CUDA)
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on ``q`` and ``k`` (kernels/rope), then the rotated K and V into their slots;
    returns the rotated ``(q, k)``."""
    q, k = rope_reference.apply_rotary(q, k, positions, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A decode-only step's attention from unrotated ``q`` and ``k`` (``[B, heads,
    head_dim]``, one new token per sequence): ``rotary_store_kv`` then
    ``paged_decode_attention``. ``q`` and ``k`` are not modified."""
    q, _ = rotary_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def _gather_context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, kv_heads, head_dim]``: one sequence's keys or values in position order."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[table[:n_blocks]].flatten(0, 1)[:length]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (``q``: ``[B, num_heads, head_dim]``) over its paged context.

    All sequences at once: each one's blocks are gathered up to the longest context and the
    padding is masked out. Masked keys add exact zeros, so a sequence's result does not
    depend on what it is batched with, nor on what its cache holds past its length, NaN
    included (both checked in the tests, the first bit for bit). A sequence of
    length 0 (a padding row) gets zeros, as in the Triton kernel.
    """
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    n_blocks = max(1, -(-int(seq_lens.max()) // block_size))
    table = block_tables[:, :n_blocks].long()
    length = n_blocks * block_size
    valid = torch.arange(length, device=q.device) < seq_lens.unsqueeze(1)  # [B, L]
    # The gathered copies are zeroed past each length: a masked score is added -inf, and a
    # masked value multiplied by a zero weight, so a NaN or inf left in a slot past the
    # length (a reused staging row imported with a partial block) would poison the row.
    hidden = ~valid.view(batch, length, 1, 1)
    k = k_cache[table].view(batch, length, num_kv_heads, head_dim).masked_fill_(hidden, 0).transpose(1, 2).to(q.dtype)
    v = v_cache[table].view(batch, length, num_kv_heads, head_dim).masked_fill_(hidden, 0).transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid.view(batch, 1, 1, length), scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).squeeze(2)
    if int(seq_lens.min()) > 0:
        return o
    return torch.where((seq_lens > 0).view(batch, 1, 1), o, 0.0).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new queries over its whole paged context
    (the cached prefix and this chunk). Covers prefill and chunked prefill. ``new_kv``: this
    step's K and V as the cache received them (``[T, kv_heads, head_dim]``); a sequence with
    nothing cached before this chunk reads its keys and values there instead of gathering
    them from the cache (the same values, where the cache's dtype is theirs)."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, length in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        if new_kv is not None and length == e - s and new_kv[0].dtype == k_cache.dtype:
            k, v = new_kv[0][s:e], new_kv[1][s:e]
        else:
            k = _gather_context(k_cache, block_tables[i], length)
            v = _gather_context(v_cache, block_tables[i], length)
        out[s:e] = _attend(q[s:e], k, v, scale, causal_offset=length - (e - s))
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None
) -> torch.Tensor:
    """``q``: [n, Hq, D]; ``k``, ``v``: [L, Hkv, D]. Query j sits at position causal_offset + j."""
    n, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kh = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    vh = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
    mask = None
    if causal_offset is not None and n > 1:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + causal_offset
        mask = torch.arange(length, device=q.device).unsqueeze(0) <= rows  # [n, L]
    o = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
    )
    return o[0].transpose(0, 1)
