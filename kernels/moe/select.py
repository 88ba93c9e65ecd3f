"""Pick the MoE kernels for a device: Triton on CUDA, the torch references elsewhere.

``moe_ops_for(device)`` returns a namespace with ``scatter_contiguous``, ``scatter_masked``,
``combine``, ``grouped_gemm_contiguous`` and ``grouped_gemm_masked``; the two sets have the
same signatures (kernels/moe/scatter, kernels/moe/gemm). ``triton_moe_ops()`` is also what
the tests run in the interpreter on the CPU.

Each namespace also carries the FP8 expert path: ``per_token_group_quant`` (kernels/fp8's
activation quantizer) and ``grouped_gemm_contiguous_fp8`` / ``grouped_gemm_masked_fp8``.
FP8 GEMMs need FP8 tensor cores (SM 8.9+, ``kernels.fp8.fp8_gemm_supported``), so
``moe_ops_for(device, fp8=True)`` on an older CUDA GPU mixes them: the Triton scatter and
combine, with the FP8 quantizer and GEMMs of the references (dequantize-then-matmul).

The Triton modules are imported on first use, never at import time: they need triton, and
off CUDA they run only in the interpreter (``TRITON_INTERPRET=1`` set before the import).
"""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

import torch

from kernels.fp8 import fp8_gemm_supported


def _ops(scatter: ModuleType, gemm: ModuleType, quant: ModuleType, fp8_gemm: ModuleType | None = None) -> SimpleNamespace:
    fp8_gemm = fp8_gemm or gemm
    return SimpleNamespace(
        name=scatter.__name__.rsplit(".", 1)[-1],
        scatter_contiguous=scatter.scatter_contiguous,
        scatter_masked=scatter.scatter_masked,
        combine=scatter.combine,
        grouped_gemm_contiguous=gemm.grouped_gemm_contiguous,
        grouped_gemm_masked=gemm.grouped_gemm_masked,
        per_token_group_quant=quant.per_token_group_quant,
        grouped_gemm_contiguous_fp8=fp8_gemm.grouped_gemm_contiguous_fp8,
        grouped_gemm_masked_fp8=fp8_gemm.grouped_gemm_masked_fp8,
    )


@functools.lru_cache(maxsize=None)
def reference_moe_ops() -> SimpleNamespace:
    from kernels.fp8 import reference as quant
    from kernels.moe.gemm import reference as gemm
    from kernels.moe.scatter import reference as scatter

    return _ops(scatter, gemm, quant)


@functools.lru_cache(maxsize=None)
def triton_moe_ops() -> SimpleNamespace:
    from kernels.fp8 import triton_quant as quant
    from kernels.moe.gemm import triton_gemm as gemm
    from kernels.moe.scatter import triton_scatter as scatter

    return _ops(scatter, gemm, quant)


@functools.lru_cache(maxsize=None)
def triton_moe_ops_reference_fp8() -> SimpleNamespace:
    """Triton scatter, combine and dense GEMMs; the FP8 ones as references (pre-SM89 GPUs)."""
    from kernels.fp8 import reference as quant
    from kernels.moe.gemm import reference as fp8_gemm
    from kernels.moe.gemm import triton_gemm as gemm
    from kernels.moe.scatter import triton_scatter as scatter

    ops = _ops(scatter, gemm, quant, fp8_gemm)
    ops.name += "+reference_fp8"
    return ops


def moe_ops_for(device: torch.device | str, fp8: bool = False) -> SimpleNamespace:
    device = torch.device(device)
    if device.type != "cuda":
        return reference_moe_ops()
    if fp8 and not fp8_gemm_supported(device):
        return triton_moe_ops_reference_fp8()
    return triton_moe_ops()
