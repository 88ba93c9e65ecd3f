"""Mixture-of-experts kernels, one folder per family, each a torch reference beside Triton.

- ``scatter/``: ep_scatter (routed tokens into the contiguous or the masked expert-major
  layout, capacities computed and checked) and the weighted combine back to tokens.
- ``gemm/``: grouped GEMMs over those layouts, optionally with SwiGLU fused in; bf16/fp32
  weights, or FP8 (e4m3, block scales per expert, activations quantized per token group
  by kernels/fp8's quantizer).
- ``select.py``: ``moe_ops_for(device)``: Triton on CUDA, the references elsewhere.

The executors that chain them (scatter → GEMM → GEMM → combine), the strategy that picks
one, routing and expert parallelism live in ``libs/model/moe``. This package imports
nothing from ``libs`` or ``services``: tensors in, tensors out.
"""
