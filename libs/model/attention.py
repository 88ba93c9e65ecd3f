"""The attention backend interface: the one seam between the model and its attention kernels.

The model computes q, k and v and hands them, with one layer's K/V cache views and the
step's ``AttentionMetadata``, to a backend. The backend writes k and v into their cache
slots and attends over each sequence's paged context. Backends differ only in the
kernels they call: ``TorchAttentionBackend`` uses the torch references (the CPU path),
``TritonAttentionBackend`` the Triton kernels (CUDA). Both come from kernels/attention
with identical signatures, so the model never changes.

A step's batch is laid out decode-first: the first ``num_decodes`` sequences have exactly
one query token each, the rest are prefill chunks (chunked prefill shares the batch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step inputs that every layer's attention shares (built once by the model runner).

    Tensors live on the model's device. Decode sequences come first.
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [B - num_decodes + 1] int32, relative to the first prefill token
    num_decodes: int
    num_prefill_tokens: int
    max_seq_len: int = 0  # host-side bound, lets kernels size their grids without a sync
    # Generated tokens right after the decodes, in multi-token chunks: speculative
    # verification (libs/engine/spec). Attention treats them as prefill chunks; the 4-bit
    # decode path (libs/model/quantized.py) as generated tokens.
    num_verify_tokens: int = 0

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class AttentionBackend(Protocol):
    name: str

    def __call__(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class PagedAttention:
    """Store this step's K/V (rotating q and k first, in the same kernel, when given the
    rotary tables), then run the decode kernel on the decode rows and the prefill kernel on
    the rest. With ``rotary_decode`` (the rotation and the store inside the decode kernel), a
    decode-only step given the rotary tables runs one kernel for all of it."""

    def __init__(
        self, name: str, store_kv: Callable, decode: Callable, prefill: Callable, rotary_store_kv: Callable,
        rotary_decode: Callable | None = None, fresh_prefill: bool = True,
    ):
        self.name = name
        self.fresh_prefill = fresh_prefill
        self._store_kv = store_kv
        self._rotary_store_kv = rotary_store_kv
        self._decode = decode
        self._rotary_decode = rotary_decode
        self._prefill = prefill

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, rope: tuple | None = None) -> torch.Tensor:
        """``rope``: ``(positions, cos, sin)`` when ``q`` and ``k`` are not rotated yet; the
        rotation then happens with the KV store (one kernel on CUDA)."""
        if rope is not None and meta.num_prefill_tokens == 0 and self._rotary_decode is not None:
            return self._rotary_decode(q, k, v, *rope, k_cache, v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, scale)
        if rope is None:
            self._store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            q, k = self._rotary_store_kv(q, k, v, *rope, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if meta.num_prefill_tokens == 0:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        # The K and V just stored, for the prefill kernel's fresh prompts (nothing cached
        # before this chunk): their rows, read in place of the cache where the cache holds
        # the same values (same dtype). kernels/attention's paged_prefill_attention.
        fresh_kv = (k, v) if self.fresh_prefill and k.dtype == k_cache.dtype and v.dtype == v_cache.dtype else None
        if nd == 0:
            return self._prefill(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, fresh_kv
            )
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        out[nd:] = self._prefill(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc, meta.seq_lens[nd:], scale,
            None if fresh_kv is None else (k[nd:], v[nd:]),
        )
        return out


def torch_backend() -> PagedAttention:
    from kernels.attention import reference as ref

    return PagedAttention(
        "torch", ref.store_kv, ref.paged_decode_attention, ref.paged_prefill_attention, ref.rotary_store_kv, ref.rotary_decode_attention
    )


# The fused decode kernel (kernels/attention ``rotary_decode_attention``: rotary and the KV
# store folded into decode attention) is on by default: on the H100 it passed
# tests/gpu/test_decode_fusions_gpu.py and made decode 1.02-1.06x faster (bench/RESULTS.md,
# "Round 4"). TIDEPOOL_FUSED_DECODE=0 turns it off (rotary_store_kv then the decode kernel).
FUSED_DECODE_ENV = "TIDEPOOL_FUSED_DECODE"
# Fresh prompts' prefill attention reads this step's K/V rows instead of the cache
# (kernels/attention/triton_prefill.py: TMA on Hopper; on the H200 1.06-1.33x the paged
# kernel, bench/RESULTS.md issue 10 round 19). TIDEPOOL_FRESH_PREFILL=0 turns it off.
FRESH_PREFILL_ENV = "TIDEPOOL_FRESH_PREFILL"


def _flag(name: str) -> bool:
    flag = os.environ.get(name, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {flag!r}")
    return flag == "1"


def triton_backend(fused_decode: bool | None = None, fresh_prefill: bool | None = None) -> PagedAttention:
    """``fused_decode``: decode-only steps through ``rotary_decode_attention`` (default: on,
    unless ``TIDEPOOL_FUSED_DECODE=0``). ``fresh_prefill``: fresh prompts' attention reads
    the step's K/V rows (default: on, unless ``TIDEPOOL_FRESH_PREFILL=0``)."""
    from kernels.attention import triton_attention as tri

    fused_decode = _flag(FUSED_DECODE_ENV) if fused_decode is None else fused_decode
    fresh_prefill = _flag(FRESH_PREFILL_ENV) if fresh_prefill is None else fresh_prefill
    return PagedAttention(
        "triton", tri.store_kv, tri.paged_decode_attention, tri.paged_prefill_attention, tri.rotary_store_kv,
        tri.rotary_decode_attention if fused_decode else None, fresh_prefill,
    )


def make_backend(name: str, device: torch.device) -> PagedAttention:
    """``auto`` picks Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return torch_backend()
    if name == "triton":
        return triton_backend()
    raise ValueError(f"unknown attention backend {name!r} (torch, triton, auto)")
