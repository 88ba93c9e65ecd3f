"""Triton paged attention: the GPU path behind the attention backend.

Same signatures and semantics as ``kernels/attention/reference.py`` (read its docstring for
the shapes). Everything here is written for the engine's block-major cache, whose per-layer
K and V caches are strided views, and for GQA models with few KV heads:

- ``store_kv``: one program per token copies its ``[kv_heads, head_dim]`` K and V rows into
  their slots. A negative slot is padding and writes nothing. ``rotary_store_kv`` does
  kernels/rope's rotary on the token's q and k first, in the same program (the model's
  path on CUDA: one launch per layer instead of two).
- ``rotary_decode_attention``: a decode-only step's ``rotary_store_kv`` folded into the
  decode kernel (the model's decode steps on CUDA, one launch per layer fewer): each
  program rotates its query heads in registers, and the program whose split holds the
  new token's position rotates and stores that token's K and V before it reads the cache.
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
- ``paged_prefill_attention``: flash-attention over the paged context. One program per
  (query tile, KV head); a query tile packs ``BLOCK_M // group`` consecutive query tokens
  times the ``group`` heads of one KV head, so again each K/V tile is loaded once for the
  whole group. Query tiles are laid out without a host sync: sequence ``i`` owns the tiles
  starting at ``query_start_loc[i] // BLOCK_Q + i``, which bounds the grid by
  ``T // BLOCK_Q + B`` programs; each program binary-searches ``query_start_loc`` for its
  sequence and exits if its tile is past the sequence's queries (zero-length entries get
  one such empty program).

Keys are gathered token by token through the block table (``BLOCK_N`` tokens per tile,
independent of the block size), so tiles span several small blocks. All softmax
arithmetic is fp32 (base-2 exponentials with the scale folded into ``log2(e)``); on CUDA
16-bit inputs feed the tensor cores directly with fp32 accumulation, elsewhere (the CPU
interpreter, whose bf16 arithmetic is wrong, and fp32 inputs) operands are converted to
fp32 and multiplied in IEEE fp32. Outputs are stored in the query dtype.

The wrappers never read device memory on the host: they launch kernels whose grids derive
from tensor shapes and host ints and allocate with ``torch.empty``, so the decode step can
be captured in a CUDA graph (compile the kernels with one eager call before capturing).

Constraints: ``head_dim`` is any size from 1 up (tiles are padded to a power of two of at
least 16, so sizes that are not powers of two waste some lanes; it is a compile-time
constant, which lets the masks fold away so tile loads vectorize and pipeline);
``block_size`` is any positive size (powers of two make the slot arithmetic cheapest). A sequence with no
context (``seq_len`` 0, e.g. CUDA-graph padding) gets a zero output, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import device_facts
from kernels.pdl import pdl_launch, pdl_wait
from kernels.rope.triton_rope import check_rotary, rotary_num_warps, rotate_heads, rotated_halves, table_rows

_LOG2E = 1.4426950408889634

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
# SM count assumed off CUDA (the interpreter), so the split heuristic stays exercised.
_CPU_SM_COUNT = 4


# --------------------------------------------------------------------------- kernels


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # negative slots are padding (e.g. CUDA-graph batch padding)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                    mask=mask)
        k_dst = (k_cache_ptr + block * stride_kcb + offset * stride_kcs
                 + h[:, None] * stride_kch + d[None, :] * stride_kcd)
        v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vcs
                 + h[:, None] * stride_vch + d[None, :] * stride_vcd)
        # Through fp32: a plain copy when dtypes match, a rounding cast when they do not.
        tl.store(k_dst, k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_rotated_kv(
    k_lo, k_hi, v_src, stride_vh, stride_vd, slot, h, d, mask,
    k_cache_ptr, v_cache_ptr,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One token's rotated K halves (heads ``h``, ``[heads, half]`` tiles) and its V (read
    at ``v_src``) into cache slot ``slot`` (>= 0)."""
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd
    tl.store(k_dst, k_lo.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_dst + HALF * stride_kcd, k_hi.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_src = v_src + h * stride_vh + d * stride_vd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    v_lo = tl.load(v_src, mask=mask)
    v_hi = tl.load(v_src + HALF * stride_vd, mask=mask)
    tl.store(v_dst, v_lo.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + HALF * stride_vcd, v_hi.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One token: rotary on its q and k heads (in place, kernels/rope's arithmetic), then its
    rotated K and its V into the token's cache slot (a negative slot writes nothing)."""
    token = tl.program_id(0).to(tl.int64)
    cos_lo, cos_hi, sin_lo, sin_hi = table_rows(
        positions_ptr, cos_ptr, sin_ptr, q_ptr, token, stride_pos, stride_cos_p, stride_cos_d, stride_sin_p, stride_sin_d,
        HALF, BLOCK_HALF,
    )
    rotate_heads(q_ptr + token * stride_qt, stride_qh, stride_qd, cos_lo, cos_hi, sin_lo, sin_hi,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)
    k_lo, k_hi = rotate_heads(k_ptr + token * stride_kt, stride_kh, stride_kd, cos_lo, cos_hi, sin_lo, sin_hi,
                               NUM_KV_HEADS, HALF, BLOCK_HK, BLOCK_HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_HK)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        _store_rotated_kv(
            k_lo, k_hi, v_ptr + token * stride_vt, stride_vh, stride_vd, slot, h, d, (h < NUM_KV_HEADS) & (d < HALF),
            k_cache_ptr, v_cache_ptr, stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
            HALF, BLOCK_SIZE,
        )


@triton.jit
def _tile_rows(table_row_ptr, stride_bt_n, tile_start, key_end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               WHOLE: tl.constexpr):
    """Keys ``[tile_start, tile_start + BLOCK_N)``: their positions, and for those below
    ``key_end`` their cache block (from the block table) and row inside it. ``WHOLE``: the
    caller knows every key of the tile is below ``key_end`` (no mask)."""
    pos = tile_start + tl.arange(0, BLOCK_N)
    if WHOLE:
        block = tl.load(table_row_ptr + (pos // BLOCK_SIZE) * stride_bt_n)
    else:
        block = tl.load(table_row_ptr + (pos // BLOCK_SIZE) * stride_bt_n, mask=pos < key_end, other=0)
    block = block.to(tl.int64)  # block * block stride overflows int32 on large caches
    return pos, block, pos % BLOCK_SIZE


@triton.jit
def _gather_kv(
    k_cache_ptr, v_cache_ptr, block, row, rows_valid, kv_head,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WHOLE: tl.constexpr,
):
    """The K and V rows of ``kv_head`` at cache ``(block, row)`` where ``rows_valid``, zeros
    elsewhere. ``WHOLE``: every row is valid (and, with the head as wide as its tile,
    nothing is masked)."""
    d = tl.arange(0, BLOCK_D)
    k_ptrs = k_cache_ptr + block[:, None] * stride_kb + row[:, None] * stride_kt + kv_head * stride_kh + d[None, :] * stride_kd
    v_ptrs = v_cache_ptr + block[:, None] * stride_vb + row[:, None] * stride_vt + kv_head * stride_vh + d[None, :] * stride_vd
    if WHOLE and BLOCK_D == HEAD_DIM:
        return tl.load(k_ptrs), tl.load(v_ptrs)
    kv_mask = rows_valid[:, None] & (d[None, :] < HEAD_DIM)
    return tl.load(k_ptrs, mask=kv_mask, other=0.0), tl.load(v_ptrs, mask=kv_mask, other=0.0)


@triton.jit
def _fold_tile(
    q, m_i, l_i, acc, pos, k, v, key_end, q_pos, qk_scale,
    CAUSAL: tl.constexpr, NATIVE_DOT: tl.constexpr, WHOLE: tl.constexpr,
):
    """One online-softmax step: fold the loaded keys at ``pos`` below ``key_end`` into the
    running max ``m_i``, denominator ``l_i`` and output ``acc`` of every query row. With
    ``CAUSAL``, row ``r`` only sees keys at positions ``<= q_pos[r]``. ``WHOLE`` (not with
    ``CAUSAL``): every key is below ``key_end``, so nothing is masked and the scale folds
    into the exponent's argument (one FMA a score instead of a multiply, two compares and a
    select before it)."""
    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    # Callers guarantee every row sees at least one key of the first tile it folds in, so
    # m_new is finite and exp2(-inf - m_new) = 0 handles both masked keys and the first step.
    if WHOLE:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # qk_scale > 0: the same max
        p = tl.exp2(s * qk_scale - m_new[:, None])
    else:
        key_valid = pos < key_end
        s = s * qk_scale
        if CAUSAL:
            visible = key_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = key_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc,
    k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
    tile_start, key_end, q_pos, qk_scale,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, NATIVE_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, WHOLE: tl.constexpr,
):
    """``_tile_rows``, ``_gather_kv``, ``_fold_tile``: keys ``[tile_start, tile_start + BLOCK_N) ∩ [0,
    key_end)`` folded into every query row's running softmax (``WHOLE``: the tile lies
    below ``key_end`` and is not causal-masked)."""
    pos, block, row = _tile_rows(table_row_ptr, stride_bt_n, tile_start, key_end, BLOCK_N, BLOCK_SIZE, WHOLE)
    k, v = _gather_kv(
        k_cache_ptr, v_cache_ptr, block, row, pos < key_end, kv_head,
        stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, WHOLE,
    )
    return _fold_tile(q, m_i, l_i, acc, pos, k, v, key_end, q_pos, qk_scale, CAUSAL, NATIVE_DOT, WHOLE)


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
        pos, block, row = _tile_rows(table_row_ptr, stride_bt_n, start, end, BLOCK_N, BLOCK_SIZE, False)
        k, v = _gather_kv(
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
                    _store_rotated_kv(
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
                k_new, v_new = _gather_kv(
                    k_cache_ptr, v_cache_ptr, block, row, pos == last, kv_head,
                    stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, HEAD_DIM, BLOCK_D, False,
                )
                k = tl.where((pos == last)[:, None], k_new, k)
                v = tl.where((pos == last)[:, None], v_new, v)
            m_i, l_i, acc = _fold_tile(q, m_i, l_i, acc, pos, k, v, end, g, qk_scale, False, NATIVE_DOT, False)
        loop_start = start + BLOCK_N
    for tile_start in range(loop_start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
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
        # and every tile below it is whole, folded without masks (``_fold_tile``'s WHOLE).
        unmasked_end = (prefix + first + 1) // BLOCK_N * BLOCK_N
        causal_end = prefix + tl.minimum(first + BLOCK_Q, q_len)  # past the tile's last query
        for tile_start in range(0, unmasked_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
                tile_start, causal_end, q_pos, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
                stride_vd, HEAD_DIM, False, NATIVE_DOT, BLOCK_N, BLOCK_D, BLOCK_SIZE, True,
            )
        # Padding rows (past q_len) have q_pos beyond causal_end; key 0 keeps them finite.
        for tile_start in range(unmasked_end, causal_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, stride_bt_n, kv_head,
                tile_start, causal_end, q_pos, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
                stride_vd, HEAD_DIM, True, NATIVE_DOT, BLOCK_N, BLOCK_D, BLOCK_SIZE, False,
            )
        o = acc / l_i[:, None]
        tl.store(out_ptr + t64[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=qo_mask)


# --------------------------------------------------------------------------- host side


def _head_block(head_dim: int) -> int:
    # tl.dot needs every tile dimension >= 16, and tl.arange a power of two.
    return max(16, triton.next_power_of_2(head_dim))


def _native_dot(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Feed the tensor cores 16-bit operands directly (CUDA only: the interpreter's bf16
    arithmetic is wrong, and fp32 inputs keep IEEE fp32 products)."""
    return q.is_cuda and q.dtype == cache.dtype and q.dtype in (torch.float16, torch.bfloat16)


def _check_gqa(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs cache {k_cache.shape[3]}")
    return num_heads // num_kv_heads


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


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K and V (``[T, kv_heads, head_dim]``) into their cache slots.
    Slots ``< 0`` are padding and write nothing."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


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
    """``apply_rotary`` then ``store_kv`` in one launch: rotates ``q`` and ``k`` in place
    (``[T, heads, head_dim]``; returns them, kernels/rope's contract) and writes the rotated
    K and V into their cache slots. Saves a launch per layer and a re-read of K."""
    check_rotary(q, k, positions, cos, sin)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    num_kv_heads, half = k.shape[1], head_dim // 2
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
        *q.stride(), *k.stride(), *v.stride(), positions.stride(0), *cos.stride(), *sin.stride(),
        *k_cache.stride(), *v_cache.stride(),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=rotary_num_warps(num_q_heads + num_kv_heads, half),
        enable_fp_fusion=False,  # bit-identical to apply_rotary (kernels/rope/triton_rope.py)
    )
    return q, k


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
    if head_dim != _head_block(head_dim) or head_dim < 32:
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
    group = _check_gqa(q, k_cache)
    num_kv_heads = k_cache.shape[2]
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_d = _head_block(head_dim)
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
        scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(), *rope_strides,
        num_heads, num_splits,
        HEAD_DIM=head_dim, GROUP=group, SPLIT=num_splits > 1, NATIVE_DOT=_native_dot(q, k_cache),
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
    group = _check_gqa(q, k_cache)
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs <= 0:
        return out
    block_d = _head_block(head_dim)
    wide = block_d > 64
    block_m = max(_PREFILL_BLOCK_M_WIDE if wide else _PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group  # query tokens per tile
    _prefill_kernel[(num_tokens // block_q + num_seqs, k_cache.shape[2])](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, num_seqs,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        HEAD_DIM=head_dim, GROUP=group, NATIVE_DOT=_native_dot(q, k_cache),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=_PREFILL_BLOCK_N, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=_PREFILL_NUM_WARPS_WIDE if wide else _PREFILL_NUM_WARPS,
        num_stages=_PREFILL_NUM_STAGES_WIDE if wide else _PREFILL_NUM_STAGES,
    )
    return out
