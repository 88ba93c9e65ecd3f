"""Triton paged decode attention: one query per sequence over its paged context. Same
signatures and semantics as ``kernels/attention/reference.py``.

- ``paged_decode_attention``: one program per (sequence, KV head, split). The program loads
  each K/V tile of its sequence once and serves all ``group`` query heads of that KV head as
  the rows of one ``[group padded to 16, head_dim]`` query tile, so the tensor cores do the
  GQA fan-out instead of re-reading the cache per query head. With few sequences the
  context is split across programs (flash-decoding); a second kernel merges the splits by
  their log-sum-exp (merging inside the same launch, by the last split to arrive, was
  measured slower on the H100: 230 vs 151 us per SmolLM2 batch-1 step, 370 vs 248 at
  batch 64; bench/RESULTS.md). The split count comes from host ints only (tensor shapes
  and the SM count); each program sizes its own split from its sequence's actual length, so a loose
  block-table width costs no extra work beyond empty programs.
  Under PDL (kernels/pdl) a program reads its step's metadata (lengths, positions, slots,
  block tables) and, while ``batch * kv_heads`` programs leave SMs idle, its first tile of
  cached keys before it waits for the projection ahead (``decode_prefetch_kv``).
- ``rotary_decode_attention``: a decode-only step's ``rotary_store_kv`` (kernels/attention's
  ``triton_store``) folded into the decode kernel (the model's decode steps on CUDA, one
  launch per layer fewer): each program rotates its query heads in registers, and the
  program whose split holds the new token's position rotates and stores that token's K and
  V before it reads the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_store import rotary_store_kv, store_rotated_kv
from kernels.attention.triton_tiles import LOG2E, attend_tile, check_gqa, fold_tile, gather_kv, head_block, native_dot, tile_rows
from kernels.device import device_facts
from kernels.pdl import pdl_launch, pdl_wait
from kernels.rope.triton_rope import check_rotary, rotated_halves, table_rows

# Tiling, from bench/attention_bench.py --sweep on an H100 and an H200 (SmolLM2 shape, bf16;
# bench/results/attention.md). Decode: 128 keys per tile, 4 warps, 3 stages was the best at
# batch 1 and within 5% (H100; 7% on the H200) of the best elsewhere; 64 keys were 10%
# slower at batch 1, and 32 keys or 8 warps slower everywhere.
_DECODE_BLOCK_N = 128
_DECODE_NUM_WARPS = 4
_DECODE_NUM_STAGES = 3
# Decode splits a sequence until there are about this many programs per SM (more programs
# in flight keep more loads outstanding), with splits of at least _MIN_SPLIT_TOKENS keys of
# the longest possible context; once the batch alone fills the SMs, of at least
# _MIN_SPLIT_TOKENS_BUSY (at batch 64 and context 256 one split beat two by 12%).
_DECODE_PROGRAMS_PER_SM = 6
_MIN_SPLIT_TOKENS = 128
_MIN_SPLIT_TOKENS_BUSY = 512
_MAX_SPLITS = 64
# SM count assumed off CUDA (the interpreter), so the split heuristic stays exercised.
_CPU_SM_COUNT = 4


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_ptr, sin_ptr, slot_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt_b, stride_bt_n,
    stride_ob, stride_oh, stride_od,
    stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd,
    stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr, PREFETCH_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    # num_splits is a runtime int (one compiled kernel serves every split count); SPLIT says
    # whether it is above 1, i.e. whether to write partials for the reduce kernel.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait (kernels/pdl), what kernels at least two launches back wrote: the
    # step's lengths, positions, slots and block tables, and (PREFETCH_KV) the keys and
    # values earlier steps cached, so this split's first tile is in flight while the qkv
    # projection before it finishes. Only the new token's K and V (stored by this launch or
    # the one just before) and q wait.
    seq_len = tl.load(seq_lens_ptr + seq)
    # This split's share of the sequence, in whole tiles, sized from the actual length.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    last = seq_len - 1  # the new token's position
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    if PREFETCH_KV:
        pos, block, row = tile_rows(table_row_ptr, stride_bt_n, start, end, BLOCK_N, BLOCK_SIZE, False)
        k, v = gather_kv(
            k_cache_ptr, v_cache_ptr, block, row, (pos < end) & (pos != last), kv_head,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, False,
        )

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    if ROPE:
        cos_lo, cos_hi, sin_lo, sin_hi = table_rows(
            positions_ptr, cos_ptr, sin_ptr, q_ptr, seq, stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
            HALF, HALF,
        )
        slot = tl.load(slot_ptr + seq).to(tl.int64)
    pdl_wait(PDL)
    if ROPE:
        # rotary_store_kv folded in: every program rotates its query heads in registers (q
        # is not written: the other splits read it too); the program whose split holds the
        # new token's position rotates that token's K and stores it and V into the cache
        # slot, then meets its threads at a barrier before it reads the slot back.
        q_lo, q_hi = rotated_halves(q_ptr + seq * stride_qb + kv_head * GROUP * stride_qh, stride_qh, stride_qd,
                                    cos_lo, cos_hi, sin_lo, sin_hi, GROUP, HALF, BLOCK_G, HALF)
        q = tl.reshape(tl.permute(tl.join(q_lo, q_hi), (0, 2, 1)), (BLOCK_G, BLOCK_D))  # [lo | hi]
        if seq_len > 0:
            if slot >= 0:
                if last // chunk == split:
                    k_lo, k_hi = rotated_halves(k_new_ptr + seq * stride_knt + kv_head * stride_knh, stride_knh, stride_knd,
                                                cos_lo, cos_hi, sin_lo, sin_hi, 1, HALF, 2, HALF)
                    r = tl.arange(0, 2)[:, None]
                    dh = tl.arange(0, HALF)[None, :]
                    store_rotated_kv(
                        k_lo, k_hi, v_new_ptr + seq * stride_vnt, stride_vnh, stride_vnd, slot, kv_head + r, dh, (r < 1) & (dh < HALF),
                        k_cache_ptr, v_cache_ptr, stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
                        HALF, BLOCK_SIZE,
                    )
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=q_mask, other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    loop_start = start
    if PREFETCH_KV:
        if start < end:
            if last < start + BLOCK_N:  # the first tile holds the new token: its row, stored now
                k_new, v_new = gather_kv(
                    k_cache_ptr, v_cache_ptr, block, row, pos == last, kv_head,
                    stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, False,
                )
                k = tl.where((pos == last)[:, None], k_new, k)
                v = tl.where((pos == last)[:, None], v_new, v)
            m_i, l_i, acc = fold_tile(q, m_i, l_i, acc, pos, k, v, end, g, qk_scale, False, NATIVE_DOT, False)
        loop_start = start + BLOCK_N
    for tile_start in range(loop_start, end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
            tile_start, end, g, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
            HEAD_DIM, False, NATIVE_DOT, BLOCK_N, BLOCK_D, BLOCK_SIZE, False,
        )

    # An empty range (seq_len 0, or a split past the end) leaves l_i = 0: output zeros.
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if not SPLIT:
        tl.store(out_ptr + seq * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are [B, num_heads, num_splits, BLOCK_D] fp32 and their log2-sum-exp2.
        # Empty splits store zeros and -inf so the reduction weighs them 0 without NaNs.
        row = (seq * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=q_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Merge one (sequence, head)'s split partials: softmax-weighted by their log-sum-exp."""
    pdl_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq * num_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0
    w = tl.exp2(lse - m)
    live = lse > float("-inf")
    o = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=live[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(o * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)



def _sm_count(device: torch.device) -> int:
    facts = device_facts(device)
    return facts[1] if facts is not None else _CPU_SM_COUNT


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """How many programs share one sequence's context, from host ints only.

    Enough splits to give every SM ``_DECODE_PROGRAMS_PER_SM`` programs, but no split shorter
    than ``_MIN_SPLIT_TOKENS`` keys (``_MIN_SPLIT_TOKENS_BUSY`` once ``batch * num_kv_heads``
    programs fill the SMs) of the longest possible context (``max_context``: the block-table
    width in tokens): below that the reduction costs more than it saves."""
    sms = _sm_count(device)
    programs = batch * num_kv_heads
    wanted = triton.cdiv(_DECODE_PROGRAMS_PER_SM * sms, max(programs, 1))
    min_tokens = _MIN_SPLIT_TOKENS if programs < sms else _MIN_SPLIT_TOKENS_BUSY
    most = max(1, max_context // min_tokens)
    return max(1, min(wanted, most, _MAX_SPLITS))


def decode_prefetch_kv(batch: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether each decode program loads its first tile of cached keys before the PDL wait:
    where ``batch * num_kv_heads`` programs leave SMs idle. There the step is a chain of
    latency-bound kernels and the early load takes a memory round trip off it (Llama-3.2-1B
    b1 on an H200: 0.900 -> 0.865 ms a step); once the programs fill the SMs, the tile held
    in registers across the wait costs occupancy and the loop's pipelining (SmolLM2 b64:
    63k -> 56k tokens/s; bench/RESULTS.md, issue 10, round 8)."""
    return batch * num_kv_heads < _sm_count(device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence (``q``: ``[B, num_heads, head_dim]``) over its paged context."""
    return paged_decode_attention_splits(
        q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=_decode_splits(q, k_cache, block_tables)
    )


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
    """``rotary_store_kv`` then ``paged_decode_attention`` for a decode-only step (one new
    token per sequence), with the rotation and the KV store inside the decode kernel: one
    launch fewer per layer. ``q`` and ``k`` are not modified (unlike ``rotary_store_kv``);
    the cache receives exactly what ``rotary_store_kv`` writes. Head sizes that are not a
    power of two take the two kernels."""
    check_rotary(q, k, positions, cos, sin)
    head_dim = q.shape[2]
    if head_dim != head_block(head_dim) or head_dim < 32:
        q, k = rotary_store_kv(q.clone(), k.clone(), v, positions, cos, sin, k_cache, v_cache, slot_mapping)
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return paged_decode_attention_splits(
        q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=_decode_splits(q, k_cache, block_tables),
        rope=(k, v, positions, cos, sin, slot_mapping),
    )


def _decode_splits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    max_context = block_tables.shape[1] * k_cache.shape[1]
    return decode_num_splits(q.shape[0], k_cache.shape[2], max_context, q.device)


def paged_decode_attention_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    rope: tuple | None = None,
    prefetch_kv: bool | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` with an explicit split count (tests and benchmarks);
    ``rope``: ``(k, v, positions, cos, sin, slot_mapping)``, as ``rotary_decode_attention``;
    ``prefetch_kv``: force ``decode_prefetch_kv``'s choice (tests)."""
    batch, num_heads, head_dim = q.shape
    group = check_gqa(q, k_cache)
    num_kv_heads = k_cache.shape[2]
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_d = head_block(head_dim)
    if num_splits > 1:
        part_out = torch.empty((batch, num_heads, num_splits, block_d), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:  # unused by the kernel without SPLIT
        part_out = part_lse = out
    if rope is not None:
        k, v, positions, cos, sin, _ = rope
        rope_args, rope_strides = rope, (*k.stride(), *v.stride(), positions.stride(0), *cos.stride(), *sin.stride())
    else:  # never read without ROPE
        rope_args, rope_strides = (q, q, seq_lens, q, q, seq_lens), (0,) * 11
    pdl = pdl_launch(q.device)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, *rope_args,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(), *rope_strides,
        num_heads, num_splits,
        HEAD_DIM=head_dim, GROUP=group, SPLIT=num_splits > 1, NATIVE_DOT=native_dot(q, k_cache),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_DECODE_BLOCK_N,
        BLOCK_D=block_d, BLOCK_SIZE=k_cache.shape[1], ROPE=rope is not None, HALF=head_dim // 2,
        PREFETCH_KV=decode_prefetch_kv(batch, num_kv_heads, q.device) if prefetch_kv is None else prefetch_kv,
        num_warps=_DECODE_NUM_WARPS, num_stages=_DECODE_NUM_STAGES,
        enable_fp_fusion=rope is None,  # the rotation bit-identical to rotary_store_kv's
        **pdl,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, *out.stride(), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            num_warps=1 if block_d <= 64 else 2, **pdl,
        )
    return out

