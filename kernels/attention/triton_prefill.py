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

A fresh prompt (nothing cached before this chunk: its context is its queries) can read its
keys and values from this step's K and V (``new_kv``: the rows the KV store has just
written, views of the qkv projection's output) instead of gathering them through the
block table. They are contiguous rows there, so ``_fresh_prefill_kernel`` loads each K/V
tile with one TMA bulk copy on Hopper (a host-built tensor descriptor; plain row loads
elsewhere) and keeps no per-key block ids or 64-bit address tiles in registers. Measured on
an H200 (bench/RESULTS.md, issue 10, round 19: with the diagonal tiles' V rows past the
sequence zeroed), us per layer against this module's paged kernel: SmolLM2's heads at
16 x 1024, 83 against 101; 16 prompts of 64-2,048 tokens, 92 against 117; Llama-3.2-1B's
heads, 246-251 against 260-265; Qwen2.5-7B's (head dim 128) at 4 x 4096, 1,079-1,095
against 1,441-1,450. With ``new_kv`` the wrapper launches that kernel for the
fresh sequences and the paged kernel for the rest (each skips the other's), so a CUDA graph
captured once serves any mix: which kernel does the work is decided per sequence on the
device.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from kernels.attention.triton_tiles import LOG2E, attend_tile, check_gqa, fold_tile, head_block, native_dot

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
# Fresh prompts (``_fresh_prefill_kernel``): (query rows, keys per tile, warps, stages) for
# heads up to 64 wide, and wider ones with and without TMA. From a sweep on the H200 (round
# 18): at head dim 64, 64 rows x 64 keys with 3 stages was fastest with TMA on both
# SmolLM2's and Llama-3.2-1B's heads (within 2% of the best); at 128, 128 x 128 with 8 warps
# (1,010 us against 1,039-1,528 for the other tilings). 128-key tiles of 128-wide heads
# take 192 KB of shared memory at 3 stages: without TMA (GPUs before Hopper, which also
# have less) the keys per tile stay 64. fp32 operands (4 bytes, multiplied in IEEE fp32)
# take 64 x 64 tiles in 2 stages: the 16-bit tilings need up to 450 KB at fp32, past any
# GPU's 227 KB (an fp32 engine on an H200 failed to launch with them).
_FRESH_TILES = (64, 64, 4, 3)
_FRESH_TILES_WIDE_TMA = (128, 128, 8, 3)
_FRESH_TILES_WIDE = (128, 64, 8, 3)
_FRESH_TILES_FP32 = (64, 64, 4, 2)


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
    BLOCK_SIZE: tl.constexpr, SKIP_FRESH: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, in-sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # keys already cached before this chunk
    run = first < q_len
    if SKIP_FRESH:  # ``_fresh_prefill_kernel`` serves the sequences with nothing cached before
        run = run & (prefix > 0)
    if run:

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



@triton.jit
def _fresh_prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """``_prefill_kernel`` for the sequences whose context is exactly this chunk (nothing
    cached before it), reading keys and values from this step's rows ``k``/``v``
    (``[T, kv_heads, head_dim]``, the query tokens' own rows) instead of the cache. ``TMA``:
    through ``k_desc``/``v_desc``, descriptors of ``[T, kv_heads * head_dim]`` views with
    ``[BLOCK_N, HEAD_DIM]`` boxes (rows past the buffer come back as zeros; in the diagonal
    tiles, V's rows past the sequence's queries are zeroed: they may be the next sequence's
    or a CUDA graph bucket's padding, which can hold NaN)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + seq)
    if (first < q_len) & (seq_len == q_len):
        r = tl.arange(0, BLOCK_M)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_valid = (r < BLOCK_Q * GROUP) & (token < q_len)
        d = tl.arange(0, HEAD_DIM)
        t64 = (q_start + token).to(tl.int64)
        q = tl.load(q_ptr + t64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=row_valid[:, None], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        n = tl.arange(0, BLOCK_N)
        k_cols = k_ptr + kv_head * stride_kh + d[None, :] * stride_kd
        v_cols = v_ptr + kv_head * stride_vh + d[None, :] * stride_vd
        # As in _prefill_kernel: keys below the tile's first query fold in whole tiles
        # without masks, the diagonal tiles with the causal mask.
        unmasked_end = (first + 1) // BLOCK_N * BLOCK_N
        causal_end = tl.minimum(first + BLOCK_Q, q_len)
        for tile_start in range(0, unmasked_end, BLOCK_N):
            if TMA:
                k = k_desc.load([q_start + tile_start, kv_head * HEAD_DIM])
                v = v_desc.load([q_start + tile_start, kv_head * HEAD_DIM])
            else:
                rows = (q_start + tile_start + n).to(tl.int64)[:, None]
                k = tl.load(k_cols + rows * stride_kt)
                v = tl.load(v_cols + rows * stride_vt)
            m_i, l_i, acc = fold_tile(q, m_i, l_i, acc, tile_start + n, k, v, causal_end, token, qk_scale, False, NATIVE_DOT, True)
        for tile_start in range(unmasked_end, causal_end, BLOCK_N):
            pos = tile_start + n
            inside = (pos < causal_end)[:, None]
            if TMA:
                k = k_desc.load([q_start + tile_start, kv_head * HEAD_DIM])
                # The box's rows past this sequence's queries are the next sequence's or
                # padding rows of a CUDA graph's bucket, which hold anything (NaN, inf).
                # Their keys are masked, so p is 0 there, but 0 * NaN is NaN in P @ V.
                v = tl.where(inside, v_desc.load([q_start + tile_start, kv_head * HEAD_DIM]), 0.0)
            else:
                rows = (q_start + pos).to(tl.int64)[:, None]
                k = tl.load(k_cols + rows * stride_kt, mask=inside, other=0.0)
                v = tl.load(v_cols + rows * stride_vt, mask=inside, other=0.0)
            m_i, l_i, acc = fold_tile(q, m_i, l_i, acc, pos, k, v, causal_end, token, qk_scale, True, NATIVE_DOT, False)
        o = acc / l_i[:, None]
        tl.store(out_ptr + t64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def _fresh_form(q: torch.Tensor, k_cache: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether fresh prompts can read ``new_kv``: the step's own K and V rows, of the
    cache's dtype (so their values are what the cache holds), with a power-of-two head
    size (the kernel's tiles are whole heads)."""
    if new_kv is None:
        return False
    head_dim = q.shape[2]
    k, v = new_kv
    want = (q.shape[0], k_cache.shape[2], head_dim)
    return (tuple(k.shape) == want and tuple(v.shape) == want and k.dtype == v.dtype == k_cache.dtype
            and head_dim == head_block(head_dim))


@lru_cache(maxsize=16)
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _use_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """TMA for the fresh kernel's K/V tiles: on Hopper and later, where the rows are views
    a tensor descriptor can take (heads contiguous in a row; 16-byte aligned rows). Asked
    per launch (an eager prefill asks once a layer), so the capability is cached."""
    if not q.is_cuda or not _has_tma(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return False
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (k, v))


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``[T, heads, head_dim]`` with contiguous heads as ``[T, heads * head_dim]``."""
    return t.as_strided((t.shape[0], t.shape[1] * t.shape[2]), (t.stride(0), 1))


def _fresh_tiles(head_dim: int, tma: bool, element_size: int) -> tuple[int, int, int, int]:
    """(query rows, keys per tile, warps, stages) of ``_fresh_prefill_kernel``."""
    if element_size > 2:
        return _FRESH_TILES_FP32
    if head_dim <= 64:
        return _FRESH_TILES
    return _FRESH_TILES_WIDE_TMA if tma else _FRESH_TILES_WIDE


def _launch_fresh(q, new_kv, query_start_loc, seq_lens, out, scale, group) -> None:
    num_tokens, _, head_dim = q.shape
    k, v = new_kv
    tma = _use_tma(q, k, v)
    block_m, block_n, num_warps, num_stages = _fresh_tiles(head_dim, tma, k.element_size())
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    k_desc, v_desc = k, v  # unread without TMA
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc = TensorDescriptor.from_tensor(_rows_view(k), [block_n, head_dim])
        v_desc = TensorDescriptor.from_tensor(_rows_view(v), [block_n, head_dim])
    num_seqs = query_start_loc.shape[0] - 1
    _fresh_prefill_kernel[(num_tokens // block_q + num_seqs, k.shape[1])](
        q, k, v, k_desc, v_desc, query_start_loc, seq_lens, out, scale * LOG2E, num_seqs,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        HEAD_DIM=head_dim, GROUP=group, NATIVE_DOT=native_dot(q, k),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, TMA=tma,
        num_warps=num_warps, num_stages=num_stages,
    )


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
    step's K and V as the cache received them (``[T, kv_heads, head_dim]`` each); sequences
    with nothing cached before this chunk then read theirs from there (the module
    docstring), the others from the cache."""
    num_tokens, num_heads, head_dim = q.shape
    group = check_gqa(q, k_cache)
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    fresh = _fresh_form(q, k_cache, new_kv)
    if fresh:
        _launch_fresh(q, new_kv, query_start_loc, seq_lens, out, scale, group)
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
        BLOCK_SIZE=k_cache.shape[1], SKIP_FRESH=fresh,
        num_warps=_PREFILL_NUM_WARPS_WIDE if wide else _PREFILL_NUM_WARPS,
        num_stages=_PREFILL_NUM_STAGES_WIDE if wide else _PREFILL_NUM_STAGES,
    )
    return out
