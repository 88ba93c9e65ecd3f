"""Block-scaled FP8 (e4m3, 128 x 128 weight blocks, DeepSeek-V3 / vLLM ``weight_block_size``).

- ``layout``: the format, the padded operand layouts and the alignment checks
  (``Fp8AlignmentError``).
- ``plan``: ``GemmPlan`` (normal or swap-AB, tiles, split-K, fused quantization, TMA) and
  ``plan_gemm``, which reads the measured swap-AB M threshold (``swap_ab_threshold.json``,
  written by ``bench/fp8_gemm_bench.py``) and the tuned tiles per device, shape and M
  (``gemm_configs.json``, written by ``bench/fp8_tune.py``), else a heuristic.
- ``reference``: torch ``quantize_weight``, ``per_token_group_quant``, ``block_scaled_mm``,
  ``fp8_linear`` and the dequantizers: the CPU path and the tests' oracle.
- ``triton_quant``: ``per_token_group_quant`` as one Triton kernel, padding fused in.
- ``triton_gemm``: ``block_scaled_mm`` and ``fp8_linear``, fp32 accumulation, per-block
  scales, swap-AB for small M, split-K, the quantization optionally fused in (imported on
  demand: they need triton; on the CPU ``TRITON_INTERPRET=1``).
- ``capability``: ``fp8_gemm_supported(device)``: SM 8.9+; False, never an exception.

This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.fp8.capability import fp8_gemm_supported
from kernels.fp8.layout import BLOCK, E4M3_MAX, FP8_DTYPE, Fp8AlignmentError
from kernels.fp8.plan import GemmPlan, plan_gemm, swap_ab_max_m

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8_DTYPE",
    "Fp8AlignmentError",
    "GemmPlan",
    "fp8_gemm_supported",
    "plan_gemm",
    "swap_ab_max_m",
]
