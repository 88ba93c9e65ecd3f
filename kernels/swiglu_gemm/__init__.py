"""The MLP's gate/up projection with SwiGLU in the GEMM's epilogue, for prefill-sized batches.

A Llama-family MLP computes ``down(silu(x W_gate^T) * (x W_up^T))``. Unfused, the fused
gate/up GEMM writes a ``[M, 2I]`` product and ``kernels/activation``'s ``silu_and_mul``
reads it back and writes ``[M, I]``: at a 16 x 1024 prefill of SmolLM2-135M that round trip
is 11% of the step's GPU time on an H200 (bench/RESULTS.md, issue 10), half as long as the
GEMM itself at K = 576. Here each program keeps two accumulators (gate columns ``n``, up
columns ``I + n``) and writes only the activation.

- ``reference``: ``swiglu_linear(x, weight, config=None)``, ``F.linear`` then
  ``silu_and_mul``: the oracle and the path everywhere else.
- ``triton_swiglu_gemm``: the same signature, one launch (TMA loads on Hopper).
- ``threshold.json``: per device and gate/up weight shape ``NxK``, the smallest M from which
  the kernel beat cuBLAS plus ``silu_and_mul`` at every larger M measured, and the tiles
  per M (data, written by ``bench/swiglu_gemm_bench.py --write-threshold``). A device or
  shape the file does not name keeps the unfused path. ``threshold.swiglu_gemm_config``
  answers the dispatch question; libs/model/linear.py is the one caller.

This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""
