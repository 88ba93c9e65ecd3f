"""Triton skinny GEMM: ``skinny_linear`` of ``kernels/gemv/reference.py`` in one launch.

One program per ``BLOCK_N`` output columns (weight rows), all M rows at once: it streams
its ``[BLOCK_N, K]`` slice of the weight once, in ``[BLOCK_N, BLOCK_K]`` tiles, and
multiplies each tile by the matching ``[BLOCK_M, BLOCK_K]`` slice of ``x`` (a few KB,
served from L2 to every program). Below 16 rows the product is a broadcast multiply and
a sum over K in fp32 (tensor cores need 16 rows; these sizes are bound by the weight's
bytes, not by math); from 16 rows it is ``tl.dot`` with fp32 accumulation. ``BLOCK_N``
shrinks until there are about two programs per SM, so even a 576-column projection
spreads over the GPU; the weight tile per step stays around 8k elements. Where
``bench/gemv_bench.py --tune`` measured this GPU, its fastest configuration per shape and
M (kernels/gemv/threshold.json) replaces that heuristic.

Where M, N and K are multiples of the blocks (the decode shapes with their tiles) and
the weight is not FP8, the loads go without masks (``EVEN``); one row without tensor
cores accumulates in 1-D rather than through a ``[1, BLOCK_N, BLOCK_K]`` broadcast. Both
measured on an H200 at Llama-3.2-1B's down at M = 1: 13.6 us masked and 14.2 in the 3-D
form against 11.0 with neither (bench/RESULTS.md, issue 10, round 7).

``silu_mul``: ``x`` is ``[M, 2K]`` (gate, then up) and each loaded slice becomes
``silu(gate) * up`` with kernels/activation's rounding (each factor rounded to the
output dtype), so the result equals ``skinny_linear(silu_and_mul(x), w)``.

``norm_skinny_linear``: the decoder layer's residual add and RMSNorm before a projection,
folded in the same way (vLLM fuses the add into the norm; here both go into the GEMM, as
the norm's row is only K values): each program first sums its rows' squares over K, then
loads ``x + residual`` again tile by tile, normalises it with kernels/norm's rounding and
multiplies; program 0 writes the new residual stream. One launch instead of two; the sum
of squares runs in another order than kernels/norm's, so the result matches the unfused
pair to rounding, not bit for bit.

On Hopper the kernel takes part in programmatic dependent launch (kernels/pdl): its programs
start while the previous kernel finishes and wait for it before reading their inputs, and
for a static weight (``static_weight=True``: the model's) where one step covers K they
request their whole weight slice before that wait. So a decode step's chain of
projections does not pay a launch and a memory latency at every boundary.

An FP8 weight (``weight_scale=``: kernels/fp8's padded e4m3 with 128 x 128 block scales;
``W_FP8``) takes the same kernel, at most 8 rows: each K step quantizes the loaded rows
of ``x`` per token and group of 128 with kernels/fp8's ``quantize_groups`` (the same
e4m3 values and scales as its quantization kernel), dequantizes both tiles to fp32 and
multiplies as the broadcast path does, so the folds and PDL above serve FP8 decode too.
``BLOCK_K`` is whole groups and ``BLOCK_N`` at most 128, so a program's rows share one
block row of scales. Measured on an H200 (bench/RESULTS.md, FP8): 1.4-3x kernels/fp8's
GEMMs at M = 1 on Llama-3.2-1B's qkv, o and down and Llama-3-8B's 4096 x 4096, slower on
the wide shapes and, 2048 x 2048 apart, from M = 4; kernels/gemv/threshold.json says
where it serves.

The wrapper reads no device memory on the host (shapes, strides and the SM count only):
capturable in a CUDA graph once compiled by an eager call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import device_facts
from kernels.fp8.layout import BLOCK as _FP8_GROUP
from kernels.fp8.layout import E4M3_MAX, FP32_MAX, SCALE_EPS, check_weight, padded
from kernels.fp8.triton_quant import quantize_groups
from kernels.gemv.threshold import FP8_MAX_M, MAX_M, tuned_config
from kernels.pdl import pdl_launch, pdl_wait

_TILE = 8192  # weight elements per program per K step (times BLOCK_M below 16 rows)
_DOT_MIN_M = 16


@triton.jit
def _masked_load(ptrs, mask, EVEN: tl.constexpr):
    """``tl.load`` of a tile, masked (0 outside) unless the launch is ``EVEN``: every tile
    whole, where the masks only cost (bench/RESULTS.md, issue 10: 13.6 against 11.0 us on
    Llama-3.2-1B's down at M = 1)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _stream_tile(x_ptr, r_ptr, rm, ks, x_mask, stride_xm, stride_xk, stride_rm, stride_rk, dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 EVEN: tl.constexpr):
    """A tile of the residual stream ``x + residual`` (rounded once to the stream's dtype,
    as torch's add), in fp32; masked lanes are 0."""
    s = _masked_load(x_ptr + rm[:, None] * stride_xm + ks[None, :] * stride_xk, x_mask, EVEN).to(tl.float32)
    if HAS_RESIDUAL:
        r = _masked_load(r_ptr + rm[:, None] * stride_rm + ks[None, :] * stride_rk, x_mask, EVEN).to(tl.float32)
        s = (s + r).to(dtype).to(tl.float32)
    return s


@triton.jit
def _fp8_dequantized(x, w, sw, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, q_eps, fp32_max, fp8_max):
    """``(x, w)`` of one K step as the block-scaled FP8 GEMM sees them, in fp32: ``x``
    quantized per token and group of 128 with kernels/fp8's own arithmetic
    (``quantize_groups``) and multiplied back by its scales, ``w`` (e4m3) times its
    block's scale per column ``sw`` (a program's rows lie in one 128-row block). The same
    values as the reference's ``dequantize_activation`` and ``dequantize_weight``. Only
    the few rows of ``x`` are regrouped; the weight tile keeps its layout."""
    GROUPS: tl.constexpr = BLOCK_K // 128
    xq, xs = quantize_groups(tl.reshape(x.to(tl.float32), (BLOCK_M * GROUPS, 128)), 1, q_eps, fp32_max, fp8_max)
    x_dq = tl.reshape(xq * xs[:, None], (BLOCK_M, BLOCK_K))
    return x_dq, w.to(tl.float32) * sw[None, :]


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, r_ptr, nw_ptr, res_out_ptr, ws_ptr,
    M, N, K, eps, q_eps, fp32_max, fp8_max,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_rm, stride_rk, stride_ws,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_DOT: tl.constexpr,
    W_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    dtype = out_ptr.dtype.element_ty
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    if W_FP8:
        # The block scales of this program's rows (BLOCK_N <= 128 divides 128: one block
        # row), gathered per column (a step's columns share BLOCK_K / 128 values, from L1).
        ws_row = ws_ptr + (pid * BLOCK_N // 128) * stride_ws
    if PREFETCH:
        # One step covers K and the caller declared the weight static (``_prefetch``): the
        # program's whole weight slice is requested before waiting for the previous kernel
        # (kernels/pdl), so its latency overlaps that kernel.
        w = _masked_load(w_rows + rk[None, :] * stride_wk, n_ok[:, None] & (rk < K)[None, :], EVEN)
        if W_FP8:
            sw = _masked_load(ws_row + rk // 128, rk < K, EVEN)
    pdl_wait(PDL)
    if NORM:
        # RMSNorm of the stream first: every program sums its rows' squares (M x K values,
        # a few KB from L2); program 0 also writes the new residual stream.
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            x_mask = m_ok[:, None] & (ks < K)[None, :]
            s = _stream_tile(x_ptr, r_ptr, rm, ks, x_mask, stride_xm, stride_xk, stride_rm, stride_rk, dtype, HAS_RESIDUAL, EVEN)
            if HAS_RESIDUAL:
                if pid == 0:
                    tl.store(res_out_ptr + rm[:, None] * K + ks[None, :], s.to(dtype), mask=x_mask)
            sum_sq += tl.sum(s * s, axis=1)
        rstd = tl.rsqrt(sum_sq / K + eps)
    # One row without tensor cores accumulates in 1-D: the [1, N, K] broadcast's layout
    # measured 14.2 against 11.0 us on Llama-3.2-1B's down (bench/RESULTS.md, issue 10).
    ONE_ROW: tl.constexpr = BLOCK_M == 1 and not USE_DOT and not W_FP8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_row = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        if not PREFETCH:
            w = _masked_load(w_rows + ks[None, :] * stride_wk, n_ok[:, None] & k_ok[None, :], EVEN)
            if W_FP8:
                sw = _masked_load(ws_row + ks // 128, k_ok, EVEN)
        x_mask = m_ok[:, None] & k_ok[None, :]
        if NORM:
            # kernels/norm's rounding: the normalised row to the dtype, then times the weight.
            s = _stream_tile(x_ptr, r_ptr, rm, ks, x_mask, stride_xm, stride_xk, stride_rm, stride_rk, dtype, HAS_RESIDUAL, EVEN)
            normed = (s * rstd[:, None]).to(dtype).to(tl.float32)
            x = (normed * _masked_load(nw_ptr + ks, k_ok, EVEN).to(tl.float32)[None, :]).to(dtype)
        elif SILU_MUL:
            gate = _masked_load(x_rows + ks[None, :] * stride_xk, x_mask, EVEN).to(tl.float32)
            up = _masked_load(x_rows + (ks + K)[None, :] * stride_xk, x_mask, EVEN).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            x = (act * up).to(dtype)
        else:
            x = _masked_load(x_rows + ks[None, :] * stride_xk, x_mask, EVEN)
        if W_FP8:
            x_dq, w_dq = _fp8_dequantized(x, w, sw, BLOCK_M, BLOCK_K, q_eps, fp32_max, fp8_max)
            acc += tl.sum(x_dq[:, None, :] * w_dq[None, :, :], axis=2)
        elif USE_DOT:
            acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
        elif ONE_ROW:
            acc_row += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)  # x is [1, BLOCK_K]
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if ONE_ROW:
        acc = acc_row[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def _programs_wanted(device: torch.device) -> int:
    # The interpreter gets an H100's count, so the shrinking rule is exercised on the CPU.
    facts = device_facts(device)
    return 2 * (facts[1] if facts is not None else 132)


def heuristic_config(
    m: int, n: int, k: int, device: torch.device, tile: int = _TILE, num_warps: int = 4, fp8: bool = False,
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for an ``[m, k] x [n, k]^T`` product
    where nothing was tuned: ``BLOCK_N`` halved (from 32, to 4 at least) until there are
    about two programs per SM, ``BLOCK_K`` the rest of a ``tile``-element step. ``fp8``:
    an e4m3 weight (one byte per element, so twice the elements per step; ``BLOCK_K`` whole
    groups of 128, and no tensor-core path)."""
    block_m = triton.next_power_of_2(max(m, 1))
    if block_m >= _DOT_MIN_M and not fp8:
        return block_m, 32, 128, num_warps
    block_n = 32
    while block_n > 4 and triton.cdiv(n, block_n) < _programs_wanted(device):
        block_n //= 2
    return block_m, block_n, _block_k(k, (2 * tile if fp8 else tile) // (block_n * block_m), fp8), num_warps


def _block_k(k: int, elements: int, fp8: bool) -> int:
    low = _FP8_GROUP if fp8 else 16
    return max(low, min(triton.next_power_of_2(k), elements))


def candidates(m: int, n: int, k: int, fp8: bool = False) -> list[tuple[int, int, int, int]]:
    """The configurations bench/gemv_bench.py --tune (bf16) and bench/fp8_gemm_bench.py
    (``fp8``) measure for one shape and M."""
    block_m = triton.next_power_of_2(max(m, 1))
    if block_m >= _DOT_MIN_M and not fp8:
        return [(block_m, bn, bk, 4) for bn in (16, 32, 64) for bk in (64, 128)]
    out = []
    for bn in (4, 8, 16, 32) if not fp8 else (4, 8, 16, 32, 64):
        for tile in (_TILE, 2 * _TILE) if not fp8 else (2 * _TILE, 4 * _TILE):
            for warps in (4, 8):
                out.append((block_m, bn, _block_k(k, tile // (bn * block_m), fp8), warps))
    return list(dict.fromkeys(out))


def config(m: int, n: int, k: int, device: torch.device, fp8: bool = False) -> tuple[int, int, int, int]:
    """The tuned configuration for this GPU, shape and M where kernels/gemv/threshold.json
    has one, else ``heuristic_config``."""
    facts = device_facts(device)
    tuned = tuned_config(facts[0], n, k, m, fp8) if facts is not None else None
    return tuned if tuned is not None else heuristic_config(m, n, k, device, fp8=fp8)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, silu_mul: bool = False) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    parts = 2 if silu_mul else 1
    if weight_scale is None:
        if x.shape[1] != parts * weight.shape[1]:
            raise ValueError(f"x has {x.shape[1]} columns; weight {tuple(weight.shape)} needs {parts * weight.shape[1]}")
        if x.shape[0] > MAX_M:
            raise ValueError(f"the skinny GEMM takes at most {MAX_M} rows, got {x.shape[0]}")
        return
    check_weight(weight, weight_scale)
    if x.shape[1] % parts or padded(x.shape[1] // parts) != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns; an FP8 weight of {weight.shape[1]} padded columns needs {parts} x K with K padded to {weight.shape[1]}")
    if x.shape[0] > FP8_MAX_M:
        raise ValueError(f"the skinny GEMM takes at most {FP8_MAX_M} rows with an FP8 weight, got {x.shape[0]}")


def _prefetch(pdl: bool, static_weight: bool, block_k: int, k: int) -> bool:
    """Whether programs request their weight slice before waiting for the previous kernel:
    with PDL, for a weight the caller declares static, where one step covers K. (Before the
    wait nothing the previous kernel wrote is guaranteed visible, so a weight that kernel
    might have just written must wait like any input. A loop that carried each next tile
    across steps measured slower than the plain one: bench/RESULTS.md, issue 10, round 5.)"""
    return pdl and static_weight and block_k >= k


def _even(m: int, n: int, k: int, tiles: tuple[int, int, int]) -> bool:
    """Whether every tile of an ``[m, k] x [n, k]^T`` launch is whole (M, N and K multiples
    of the blocks), so the kernel loads without masks."""
    block_m, block_n, block_k = tiles
    return m == block_m and n % block_n == 0 and k % block_k == 0


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
    config_override: tuple[int, int, int, int] | None, *, silu_mul: bool = False,
    norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor] | None = None, static_weight: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> None:
    m, n, k = x.shape[0], out.shape[1], x.shape[1] // 2 if silu_mul else x.shape[1]
    if m == 0 or n == 0:
        return
    fp8 = weight_scale is not None
    block_m, block_n, block_k, num_warps = config_override or config(m, weight.shape[0], weight.shape[1], x.device, fp8)
    if fp8 and (block_n > _FP8_GROUP or block_k % _FP8_GROUP or block_m > FP8_MAX_M):
        raise ValueError(f"config {(block_m, block_n, block_k, num_warps)}: an FP8 weight needs BLOCK_N <= 128, BLOCK_K a multiple of 128, BLOCK_M <= {FP8_MAX_M}")
    residual, norm_weight, eps, res_out = norm if norm is not None else (None, weight, 0.0, out)
    r = residual if residual is not None else x
    scales = weight_scale if fp8 else out
    launch = pdl_launch(x.device)
    launch["PREFETCH"] = _prefetch(launch["PDL"], static_weight, block_k, k)
    # An FP8 weight keeps the masks, the form its tiles were tuned and measured in. (Round 7
    # blamed an FP8 decode regression on their loss; round 8 found the cause was lost tiles:
    # 0.970 ms with the masks back, 0.886 with the tiles. The unmasked FP8 form was never
    # measured on its own; bench/RESULTS.md, issue 10.)
    launch["EVEN"] = not fp8 and _even(m, n, k, (block_m, block_n, block_k))
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, r, norm_weight, res_out, scales,
        m, n, k, eps, SCALE_EPS, FP32_MAX, E4M3_MAX, *x.stride(), *weight.stride(), out.stride(0), *r.stride(), scales.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        USE_DOT=block_m >= _DOT_MIN_M and not fp8, W_FP8=fp8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, **launch,
    )


def _out_features(weight: torch.Tensor, weight_scale: torch.Tensor | None, out_features: int | None) -> int:
    if out_features is None:
        return weight.shape[0]
    if weight_scale is None or not 0 < out_features <= weight.shape[0]:
        raise ValueError(f"out_features ({out_features}) is for an FP8 weight's padded rows ({weight.shape[0]}), at most that many")
    return out_features


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
    weight_scale: torch.Tensor | None = None, out_features: int | None = None,
    config_override: tuple[int, int, int, int] | None = None, static_weight: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` (``[M, 2K]`` with ``silu_mul``), M <= 64;
    the output is new, contiguous, in ``x``'s dtype. ``weight_scale``: ``weight`` is a
    padded e4m3 weight with these 128 x 128 block scales (kernels/fp8's format) and ``x``
    is quantized per token and group of 128 as kernels/fp8 does, M <= 8; its first
    ``out_features`` rows are the output. ``config_override``: a configuration of
    ``candidates`` (the tuning sweep), else ``config``'s. ``static_weight``: no kernel
    writes ``weight`` any more (a loaded model's), so with PDL it may be read before the
    previous kernel has completed."""
    _check(x, weight, weight_scale, silu_mul)
    out = torch.empty((x.shape[0], _out_features(weight, weight_scale, out_features)), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config_override, silu_mul=silu_mul, static_weight=static_weight, weight_scale=weight_scale)
    return out


def norm_skinny_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor | None = None,
    out_features: int | None = None, config_override: tuple[int, int, int, int] | None = None, static_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), x + residual)`` in one launch (``residual`` None:
    no add, and the stream returned is ``x`` itself); the reference's signature, plus
    ``skinny_linear``'s ``config_override`` and ``static_weight``."""
    _check(x, weight, weight_scale)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    if norm_weight.shape != (x.shape[1],) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm weight must be a contiguous [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    out = torch.empty((x.shape[0], _out_features(weight, weight_scale, out_features)), dtype=x.dtype, device=x.device)
    stream = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    _launch(x, weight, bias, out, config_override, norm=(residual, norm_weight, eps, stream), static_weight=static_weight,
            weight_scale=weight_scale)
    return out, stream
