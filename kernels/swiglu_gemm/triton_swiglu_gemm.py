"""Triton gate/up GEMM with SwiGLU in its epilogue: the GPU path behind
``kernels/swiglu_gemm/reference.py`` (same signature).

``Y [M, I] = swiglu(X W[:I]^T, X W[I:]^T)`` for the fused ``[2I, K]`` gate/up weight. A
program owns a ``BLOCK_M x BLOCK_N`` tile of Y and accumulates two fp32 tiles, the gate
columns ``n`` and the up columns ``I + n``, from the same loaded tile of X; the epilogue is
kernels/activation's ``swiglu``, which rounds as the unfused path does (each product to
the output dtype, silu to it, then the multiply), so the output equals ``F.linear`` then
``silu_and_mul`` up to the GEMMs' summation order (equal to the bit in the H200 probes of
bench/RESULTS.md, issue 10). Programs are numbered in groups of ``GROUP_M`` row tiles, so
neighbours share weight tiles in L2.

Operands are read through host-built tensor descriptors (TMA bulk copies on Hopper, which
Triton pipelines over ``num_stages`` buffers; plain block copies in the interpreter). Their
bounds do the masking: rows of X past M and columns of K past its end load as zeros, and
the store drops columns past I. A gate tile that runs past I reads the first up rows
instead, and an up tile past 2I reads zeros: both only feed columns the store drops.

On CUDA 16-bit operands feed the tensor cores directly (fp32 accumulation); fp32 inputs,
and every input in Triton's CPU interpreter (whose bf16 arithmetic is wrong), are converted
to fp32 and multiplied in IEEE fp32. The wrapper never reads device memory on the host, so
a call can be captured in a CUDA graph once compiled by an eager one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.activation.triton_activation import swiglu

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SwigluConfig(NamedTuple):
    """One launch's tiles: rows and output columns per program, K per step, grouped
    ordering, pipeline depth and warps."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int


# The H200 probe's best at 16384 rows on SmolLM2-135M's and Llama-3.2-1B's gate/up shapes.
DEFAULT_CONFIG = SwigluConfig(128, 64, 64, 8, 3, 8)


@triton.jit
def _swiglu_gemm_kernel(
    x_desc, w_desc, y_desc, m, intermediate, k,
    NATIVE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(m, BLOCK_M)
    tiles_n = tl.cdiv(intermediate, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    off_m = (first_m + (pid % per_group) % group_size) * BLOCK_M
    off_n = ((pid % per_group) // group_size) * BLOCK_N
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        x = x_desc.load([off_m, k0])
        w_gate = w_desc.load([off_n, k0])
        w_up = w_desc.load([intermediate + off_n, k0])
        if NATIVE_DOT:
            acc_gate = tl.dot(x, w_gate.T, acc_gate)
            acc_up = tl.dot(x, w_up.T, acc_up)
        else:
            x = x.to(tl.float32)
            acc_gate = tl.dot(x, w_gate.to(tl.float32).T, acc_gate, input_precision="ieee")
            acc_up = tl.dot(x, w_up.to(tl.float32).T, acc_up, input_precision="ieee")
    y_desc.store([off_m, off_n], swiglu(acc_gate, acc_up, y_desc.dtype))


def supports(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why ``swiglu_linear`` cannot take these operands, or None when it can (never raises):
    2-D operands of one device and dtype (bf16, fp16, fp32) with a common K, an even
    number of weight rows, unit inner strides, and the 16-byte row strides and base
    addresses a tensor descriptor needs (the output's rows too: intermediate a multiple
    of 8 in 16-bit, of 4 in fp32)."""
    if x.dim() != 2 or weight.dim() != 2:
        return f"x and weight must be 2-D, got {x.dim()}-D and {weight.dim()}-D"
    if x.shape[1] != weight.shape[1]:
        return f"x has K = {x.shape[1]}, weight {weight.shape[1]}"
    if weight.shape[0] % 2:
        return f"weight must be [2 * intermediate, K] (gate rows, then up), got {weight.shape[0]} rows"
    if x.dtype != weight.dtype or x.dtype not in _DTYPES:
        return f"x and weight must share a dtype among {[str(d) for d in _DTYPES]}, got {x.dtype} and {weight.dtype}"
    if x.device != weight.device:
        return f"x is on {x.device}, weight on {weight.device}"
    size = x.element_size()
    if (weight.shape[0] // 2 * size) % 16:
        return f"the output's rows (intermediate {weight.shape[0] // 2} x {size} bytes) must be a multiple of 16 bytes (tensor descriptors)"
    for name, t in (("x", x), ("weight", weight)):
        if t.numel() and (t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16):
            return f"{name} needs unit column stride, 16-byte aligned rows and base (tensor descriptors), got strides {t.stride()}"
    return None


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor, config: SwigluConfig | None = None) -> torch.Tensor:
    """``silu(x @ gate^T) * (x @ up^T)``, ``[M, I]`` in ``x``'s dtype, for the fused
    ``[2I, K]`` gate/up ``weight``; ``config`` defaults to ``DEFAULT_CONFIG``. Raises
    ``ValueError`` naming the problem for operands it cannot take (``supports``)."""
    problem = supports(x, weight)
    if problem is not None:
        raise ValueError(f"swiglu_linear: {problem}")
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = config or DEFAULT_CONFIG
    m, k = x.shape
    intermediate = weight.shape[0] // 2
    y = torch.empty((m, intermediate), dtype=x.dtype, device=x.device)
    if m == 0 or intermediate == 0:
        return y
    if k == 0:
        return y.zero_()  # silu(0) * 0
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(intermediate, cfg.block_n),)
    _swiglu_gemm_kernel[grid](
        TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
        TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]),
        TensorDescriptor.from_tensor(y, [cfg.block_m, cfg.block_n]),
        m, intermediate, k,
        NATIVE_DOT=x.is_cuda and x.dtype != torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y
