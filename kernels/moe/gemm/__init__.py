"""Grouped GEMMs over the expert-major layouts of ``kernels/moe/scatter``.

- ``reference``: torch ``grouped_gemm_contiguous`` and ``grouped_gemm_masked``, the CPU
  path and the test oracle (a loop over experts).
- ``triton_gemm``: the same two functions as one Triton kernel (imported on demand: it
  needs triton, and on the CPU ``TRITON_INTERPRET=1`` set beforehand).

Both optionally fuse SwiGLU (``fuse_silu_and_mul``) into the product with the fused
gate/up weights. ``grouped_gemm_contiguous_fp8`` / ``grouped_gemm_masked_fp8``: the same
with e4m3 operands and 128x128 block scales per expert (FP8 experts; the format is
kernels/fp8's). This package imports nothing from ``libs`` or ``services``.
"""

from kernels.moe.gemm.reference import grouped_gemm_contiguous, grouped_gemm_masked

__all__ = ["grouped_gemm_contiguous", "grouped_gemm_masked"]
