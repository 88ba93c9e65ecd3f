"""Block-scaled FP8 GEMM through cuBLASLt: the large-M path on Hopper.

Our Triton GEMM (``triton_gemm``) serves decode sizes well (swap-AB, split-K, fused
quantization) but runs large M at bf16's speed, about half of what the H100's FP8 tensor
cores give (bench/RESULTS.md, "FP8 weights"). cuBLASLt has had block-scaled FP8 GEMMs
since CUDA 12.9 in exactly our format (1 x 128 activation scales, 128 x 128 weight
scales, DeepSeek-V3's), which torch exposes as ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (older builds: ``torch._scaled_mm``,
which infers the recipes from the scale shapes). vLLM does the same on SM90 (a
CUTLASS/DeepGEMM kernel for large M, Triton as the fallback).

``fp8_linear`` here has ``triton_gemm.fp8_linear``'s signature; ``libs/model/fp8.py`` calls
it from ``plan.cublas_min_m()`` tokens up (data, measured by ``bench/fp8_gemm_bench.py
--write-threshold``) where ``cublas_block_fp8_usable`` says yes. That is a question, never
an error: it answers False off SM90 (torch restricts these recipes to it), on builds
without them, for shapes cuBLAS does not take (K blocks not a multiple of 4, N not a
multiple of 128), and if a one-time probe on the device fails or disagrees with the
reference; it never probes inside a CUDA-graph capture.

Layouts: the activation quantizer's output ``[M_pad, K_pad]`` (rows padded to 4) and its
scales outer-dim-major (a ``[M_pad, K_pad/128]`` view of a ``[K_pad/128, M_pad]`` tensor,
which the quantizer writes directly: cuBLAS reads them per K block); the weight
``[N_pad, K_pad]`` as the column-major right operand (its transpose, a view) and its
scales ``[N_pad/128, K_pad/128]`` transposed (a view).
"""

from __future__ import annotations

import functools

import torch

from kernels.fp8.layout import BLOCK

ROW_MULTIPLE = 4  # cuBLAS wants the token count a multiple of 4


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, a_s: torch.Tensor, b_s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    F = torch.nn.functional
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        return F.scaled_mm(a, b, a_s, F.ScalingType.BlockWise1x128, b_s, F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_s, scale_b=b_s, out_dtype=out_dtype)


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, *, n: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``Y [m, n] = quant(X) @ dequant(W)^T`` through cuBLASLt (check ``cublas_block_fp8_usable`` first)."""
    from kernels.fp8.triton_quant import per_token_group_quant

    m = x.shape[0]
    x_q, x_s = per_token_group_quant(x, row_multiple=ROW_MULTIPLE, column_major_scales=True)  # outer-dim-major
    y = _scaled_mm(x_q, w_q.t(), x_s, w_s.t(), out_dtype or x.dtype)
    return y[:m, :n]


def shape_ok(n_pad: int, k_pad: int) -> bool:
    return n_pad % BLOCK == 0 and k_pad % BLOCK == 0 and (k_pad // BLOCK) % 4 == 0


def cublas_block_fp8_usable(device: torch.device | str, n_pad: int, k_pad: int) -> bool:
    """Whether ``fp8_linear`` runs here for an ``[n_pad, k_pad]`` weight. Never raises."""
    try:
        dev = torch.device(device)
        if dev.type != "cuda" or not shape_ok(n_pad, k_pad):
            return False
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if _probe.cache_info().currsize == 0 and torch.cuda.is_current_stream_capturing():
            return False  # never probe inside a capture; the eager warm-up asks first
        return _probe(index)
    except Exception:  # a question, never an error
        return False


@functools.lru_cache(maxsize=None)
def _probe(index: int) -> bool:
    """One small GEMM on the device, checked against the reference."""
    try:
        if torch.version.hip is not None or tuple(torch.cuda.get_device_capability(index)) != (9, 0):
            return False
        from kernels.fp8 import reference as ref

        dev = torch.device("cuda", index)
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(256, 512, generator=g, device=dev) * 0.02
        x = torch.randn(8, 512, generator=g, device=dev).to(torch.bfloat16)
        w_q, w_s = ref.quantize_weight(w)
        got = fp8_linear(x, w_q, w_s, n=256, out_dtype=torch.bfloat16).float()
        want = ref.fp8_linear(x, w_q, w_s, n=256, out_dtype=torch.float32)
        return bool((got - want).norm() <= 2.0**-7 * want.norm())
    except Exception:
        return False
