"""Triton paged prefill attention: causal varlen flash-attention of each sequence's new
queries over its whole paged context (the cached prefix and this chunk), for prefill and
chunked prefill. Same signature and semantics as ``kernels/attention/reference.py``.

One program per (query tile, KV head); a query tile packs ``BLOCK_M // group`` consecutive
query tokens times the ``group`` heads of one KV head, so each K/V tile is loaded once for
the whole group. Query tiles are laid out without a host sync: sequence ``i`` owns the
tiles starting at ``query_start_loc[i] // BLOCK_Q + i``, which bounds the grid by
``T // BLOCK_Q + B`` programs; each program binary-searches ``query_start_loc`` for its
sequence and exits if its tile is past the sequence's queries (zero-length entries get one
such empty program). Keys every row of the tile sees (below the causal diagonal) are folded
in whole tiles without masks; the diagonal tiles take the masked fold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_tiles import LOG2E, attend_tile, check_gqa, head_block, native_dot

# Prefill: query rows (tokens x group heads), keys per tile, warps and stages, for head
# tiles up to 64 wide and (``_WIDE``) wider. Measured on the H200 (bench/RESULTS.md, issue
# 10 round 17; three alternations in one process): at head dim 64, 64 rows with 2 stages
# against 128 rows with 3 were 1.03-1.05x on SmolLM2's heads (16 x 1024, chunks after a
# cached prefix, mixed lengths), 1.11x on Llama-3.2-1B's and 0.99x on Qwen2.5-0.5B's
# (group 7); at 128 rows a program holds 253 registers a thread, two programs an SM. At
# head dim 128 (Qwen2.5-7B) 64 rows were 0.92x or slower.
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_M_WIDE = 128
_PREFILL_BLOCK_N = 64
_PREFILL_NUM_WARPS = 4
_PREFILL_NUM_WARPS_WIDE = 8
_PREFILL_NUM_STAGES = 2
_PREFILL_NUM_STAGES_WIDE = 3


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence ``i`` whose first query tile, ``query_start_loc[i] // BLOCK_Q + i``,
    is at or before ``tile`` (binary search over the monotone tile starts)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bt_b, stride_bt_n,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, in-sequence
    if first < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len  # keys already cached before this chunk

        # Row r of the tile is query token first + r // GROUP, head r % GROUP of this KV head.
        r = tl.arange(0, BLOCK_M)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_valid = (r < BLOCK_Q * GROUP) & (token < q_len)
        d = tl.arange(0, BLOCK_D)
        qo_mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
        t64 = (q_start + token).to(tl.int64)
        q = tl.load(q_ptr + t64[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :] * stride_qd, mask=qo_mask, other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        q_pos = prefix + token

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
        # Keys [0, prefix + first] are visible to every row: no causal mask needed there,
        # and every tile below it is whole, folded without masks (``fold_tile``'s WHOLE).
        unmasked_end = (prefix + first + 1) // BLOCK_N * BLOCK_N
        causal_end = prefix + tl.minimum(first + BLOCK_Q, q_len)  # past the tile's last query
        for tile_start in range(0, unmasked_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
                tile_start, causal_end, q_pos, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
                stride_vd, HEAD_DIM, False, NATIVE_DOT, BLOCK_N, BLOCK_D, BLOCK_SIZE, True,
            )
        # Padding rows (past q_len) have q_pos beyond causal_end; key 0 keeps them finite.
        for tile_start in range(unmasked_end, causal_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
                tile_start, causal_end, q_pos, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
                stride_vd, HEAD_DIM, True, NATIVE_DOT, BLOCK_N, BLOCK_D, BLOCK_SIZE, False,
            )
        o = acc / l_i[:, None]
        tl.store(out_ptr + t64[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=qo_mask)



def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new queries over its whole paged context
    (the cached prefix and this chunk). Covers prefill and chunked prefill."""
    num_tokens, num_heads, head_dim = q.shape
    group = check_gqa(q, k_cache)
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    block_d = head_block(head_dim)
    wide = block_d > 64
    block_m = max(_PREFILL_BLOCK_M_WIDE if wide else _PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group  # query tokens per tile
    _prefill_kernel[(num_tokens // block_q + num_seqs, k_cache.shape[2])](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E, num_seqs,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        HEAD_DIM=head_dim, GROUP=group, NATIVE_DOT=native_dot(q, k_cache),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=_PREFILL_BLOCK_N, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=_PREFILL_NUM_WARPS_WIDE if wide else _PREFILL_NUM_WARPS,
        num_stages=_PREFILL_NUM_STAGES_WIDE if wide else _PREFILL_NUM_STAGES,
    )
    return out
