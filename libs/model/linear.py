"""Dense linear layers on the decode path: cuBLAS, or the Triton skinny GEMM for few rows.

The model's projections stay ``nn.Linear`` modules (the loader, the CPU packing and the FP8
conversion all rely on that); the model calls them through ``linear``, ``norm_linear`` and
``silu_mul_linear``, which send a plain ``nn.Linear`` on CUDA with at most ``skinny_max_m``
rows (measured data, kernels/gemv/threshold.json) to kernels/gemv's Triton kernel, with the
norm before the projection or the activation after the previous one folded into it. An
``Fp8Linear`` (libs/model/fp8.py) goes there too with at most ``fp8_skinny_max_m`` rows:
the same kernel reads its e4m3 weight and block scales and quantizes the activations as
kernels/fp8 does, so an FP8 decode step gets the same folds and one launch per projection.
Everything else goes where it went before: the norm kernel and the module itself (cuBLAS,
kernels/fp8's GEMMs, a 4-bit layer, the CPU's packed path), except the MLP's gate/up
projection at prefill sizes where kernels/swiglu_gemm was measured faster
(``gate_up_linear``: SwiGLU in that GEMM's epilogue, so down takes its input as it is).
The row count is a tensor shape, so a CUDA graph of each batch size or token bucket
captures one choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemv.threshold import MAX_M, fp8_skinny_max_m, skinny_max_m
from kernels.select import ops_for
from libs.model.fp8 import Fp8Linear, runs_fp8_kernels

_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.dtype in _SKINNY_DTYPES and weight.dtype == x.dtype
        and x.shape[0] <= skinny_max_m(x.device, weight.shape[0], weight.shape[1])
    )


def _fp8_skinny(x: torch.Tensor, module: Fp8Linear) -> bool:
    return (
        module.out_index is None and x.is_cuda and x.dim() == 2 and x.dtype in _SKINNY_DTYPES
        and 0 < x.shape[0] <= fp8_skinny_max_m(x.device, *module.weight_q.shape) and runs_fp8_kernels(x.device)
    )


def _skinny_operands(module: nn.Module, x: torch.Tensor) -> dict | None:
    """The skinny GEMM's weight arguments for ``module`` at this ``x``, or None where it
    does not serve (the module runs as it is)."""
    if type(module) is nn.Linear:
        return {"weight": module.weight} if _skinny(x, module.weight) else None
    if isinstance(module, Fp8Linear) and _fp8_skinny(x, module):
        return {"weight": module.weight_q, "weight_scale": module.weight_scale, "out_features": module.out_features}
    return None


def linear_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the skinny GEMM where it serves."""
    if _skinny(x, weight):
        from kernels.gemv.triton_gemv import skinny_linear

        return skinny_linear(x, weight, bias, static_weight=True)
    return F.linear(x, weight, bias)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` or an ``Fp8Linear`` takes the skinny GEMM where
    it serves."""
    operands = _skinny_operands(module, x)
    if operands is not None:
        from kernels.gemv.triton_gemv import skinny_linear

        return skinny_linear(x, bias=module.bias, static_weight=True, **operands)
    return module(x)


def norm_linear(norm: nn.Module, module: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(module(norm(h + residual)), h + residual)``, the decoder layer's residual add, its
    RMSNorm (``norm``: ``weight`` and ``eps``) and the projection after it; ``residual``
    None (the first layer): no add, and ``h`` is the stream. Through the skinny GEMM, one
    launch; else the fused add-and-norm kernel, then ``linear``."""
    operands = _skinny_operands(module, h) if norm.weight.dtype == h.dtype else None
    if operands is not None:
        from kernels.gemv.triton_gemv import norm_skinny_linear

        return norm_skinny_linear(h, residual, norm.weight, norm.eps, bias=module.bias, static_weight=True, **operands)
    x, stream = _add_norm(norm, h, residual)
    return linear(module, x), stream


def _add_norm(norm: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (norm(h), h) if residual is None else norm.add_and_norm(h, residual)


def _swiglu_config(module: nn.Module, x: torch.Tensor):
    """kernels/swiglu_gemm's tiles for ``SwiGLU(module(x))`` where that kernel was measured
    faster than cuBLAS plus ``silu_and_mul`` (a plain bf16/fp16 ``nn.Linear`` without bias
    on CUDA), else None."""
    if type(module) is not nn.Linear or module.bias is not None or not x.is_cuda or x.dim() != 2 or x.dtype not in _SKINNY_DTYPES:
        return None
    from kernels.swiglu_gemm.threshold import swiglu_gemm_config
    from kernels.swiglu_gemm.triton_swiglu_gemm import supports

    config = swiglu_gemm_config(x.device, *module.weight.shape, x.shape[0])
    return config if config is not None and supports(x, module.weight) is None else None


def gate_up_linear(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The MLP's gate/up projection: ``(y, activated)``. At prefill sizes where measured
    faster, ``y`` is already ``silu(gate) * up`` (kernels/swiglu_gemm: SwiGLU in the GEMM's
    epilogue, the ``[M, 2I]`` product never in memory) and ``activated`` True; otherwise
    ``y = module(x)`` through ``linear`` (the skinny GEMM keeps decode rows, whose
    activation folds into down's load instead)."""
    config = _swiglu_config(module, x) if _skinny_operands(module, x) is None else None
    if config is None:
        return linear(module, x), False
    from kernels.swiglu_gemm.triton_swiglu_gemm import swiglu_linear

    return swiglu_linear(x, module.weight, config), True


def norm_gate_up_linear(norm: nn.Module, module: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``norm_linear`` for the gate/up projection: ``(y, h + residual, activated)``, with
    ``y`` and ``activated`` as ``gate_up_linear`` gives them (the norm folded into the
    skinny GEMM for decode rows, as ``norm_linear`` does)."""
    if norm.weight.dtype == h.dtype and _skinny_operands(module, h) is not None:
        y, stream = norm_linear(norm, module, h, residual)
        return y, stream, False
    x, stream = _add_norm(norm, h, residual)
    y, activated = gate_up_linear(module, x)
    return y, stream, activated


def down_linear(module: nn.Module, y: torch.Tensor, activated: bool) -> torch.Tensor:
    """The MLP's down projection of ``gate_up_linear``'s ``y``: SwiGLU first (folded into the
    skinny GEMM where it serves) unless ``activated`` says it is done."""
    return linear(module, y) if activated else silu_mul_linear(module, y)


def silu_mul_linear(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``module(silu_and_mul(gate_up))`` (SwiGLU, the device's kernel: kernels/select.py);
    through the skinny GEMM the activation is folded into the GEMM's load of its input
    (one launch, not two)."""
    operands = _skinny_operands(module, gate_up)
    if operands is not None:
        from kernels.gemv.triton_gemv import skinny_linear

        return skinny_linear(gate_up, bias=module.bias, silu_mul=True, static_weight=True, **operands)
    return module(ops_for(gate_up.device).silu_and_mul(gate_up))
