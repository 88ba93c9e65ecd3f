"""Triton skinny GEMM: ``skinny_linear`` of ``kernels/gemv/reference.py`` in one launch.

One program per ``BLOCK_N`` output columns (weight rows), all M rows at once: it streams
its ``[BLOCK_N, K]`` slice of the weight once, in ``[BLOCK_N, BLOCK_K]`` tiles, and
multiplies each tile by the matching ``[BLOCK_M, BLOCK_K]`` slice of ``x`` (a few KB,
served from L2 to every program). Below 16 rows the product is a broadcast multiply and
a sum over K in fp32 (tensor cores need 16 rows; these sizes are bound by the weight's
bytes, not by math); from 16 rows it is ``tl.dot`` with fp32 accumulation. ``BLOCK_N``
shrinks until there are about two programs per SM, so even a 576-column projection
spreads over the GPU; the weight tile per step stays around 8k elements.

``silu_mul``: ``x`` is ``[M, 2K]`` (gate, then up) and each loaded slice becomes
``silu(gate) * up`` with kernels/activation's rounding (each factor rounded to the
output dtype), so the result equals ``skinny_linear(silu_and_mul(x), w)``.

The wrapper reads no device memory on the host (shapes, strides and the SM count only):
capturable in a CUDA graph once compiled by an eager call.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_TILE = 8192  # weight elements per program per K step (times BLOCK_M below 16 rows)
_DOT_MIN_M = 16
MAX_M = 64  # larger batches are cuBLAS's


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x_mask = m_ok[:, None] & k_ok[None, :]
        if SILU_MUL:
            gate = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + (ks + K)[None, :] * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
            x = (act * up).to(out_ptr.dtype.element_ty)
        else:
            x = tl.load(x_rows + ks[None, :] * stride_xk, mask=x_mask, other=0.0)
        if USE_DOT:
            acc = tl.dot(x.to(w.dtype), tl.trans(w), acc)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_wanted(device: torch.device) -> int:
    # The interpreter gets an H100's count, so the shrinking rule is exercised on the CPU.
    return 2 * (_sm_count(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 132)


def config(m: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for an ``[m, k] x [n, k]^T`` product."""
    block_m = triton.next_power_of_2(max(m, 1))
    if block_m >= _DOT_MIN_M:
        block_n, block_k = 32, 128
    else:
        block_n = 32
        while block_n > 4 and triton.cdiv(n, block_n) < _programs_wanted(device):
            block_n //= 2
        block_k = max(16, min(triton.next_power_of_2(k), _TILE // (block_n * block_m)))
    return block_m, block_n, block_k


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[M, K]`` (``[M, 2K]`` with ``silu_mul``), M <= 64;
    the output is new, contiguous, in ``x``'s dtype."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, width = x.shape
    n, k = weight.shape
    if width != (2 * k if silu_mul else k):
        raise ValueError(f"x has {width} columns; weight {tuple(weight.shape)} needs {2 * k if silu_mul else k}")
    if m > MAX_M:
        raise ValueError(f"skinny_linear takes at most {MAX_M} rows, got {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = config(m, n, k, x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, *x.stride(), *weight.stride(), out.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, USE_DOT=block_m >= _DOT_MIN_M,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return out
