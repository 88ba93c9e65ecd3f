"""Pick the MoE kernels for a device: Triton on CUDA, the torch references elsewhere.

``moe_ops_for(device)`` returns a namespace with ``scatter_contiguous``, ``scatter_masked``,
``combine``, ``grouped_gemm_contiguous`` and ``grouped_gemm_masked``; the two sets have the
same signatures (kernels/moe/scatter, kernels/moe/gemm). ``triton_moe_ops()`` is also what
the tests run in the interpreter on the CPU.

The Triton modules are imported on first use, never at import time: they need triton, and
off CUDA they run only in the interpreter (``TRITON_INTERPRET=1`` set before the import).
"""

from __future__ import annotations

import functools
from types import ModuleType, SimpleNamespace

import torch


def _ops(scatter: ModuleType, gemm: ModuleType) -> SimpleNamespace:
    return SimpleNamespace(
        name=scatter.__name__.rsplit(".", 1)[-1],
        scatter_contiguous=scatter.scatter_contiguous,
        scatter_masked=scatter.scatter_masked,
        combine=scatter.combine,
        grouped_gemm_contiguous=gemm.grouped_gemm_contiguous,
        grouped_gemm_masked=gemm.grouped_gemm_masked,
    )


@functools.lru_cache(maxsize=None)
def reference_moe_ops() -> SimpleNamespace:
    from kernels.moe.gemm import reference as gemm
    from kernels.moe.scatter import reference as scatter

    return _ops(scatter, gemm)


@functools.lru_cache(maxsize=None)
def triton_moe_ops() -> SimpleNamespace:
    from kernels.moe.gemm import triton_gemm as gemm
    from kernels.moe.scatter import triton_scatter as scatter

    return _ops(scatter, gemm)


def moe_ops_for(device: torch.device | str) -> SimpleNamespace:
    return triton_moe_ops() if torch.device(device).type == "cuda" else reference_moe_ops()
