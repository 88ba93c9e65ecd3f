"""Skinny GEMMs: the linear layers of a decode step, ``[M, K] x [N, K]^T`` with M small.

At batch 1 a decode step of SmolLM2-135M on an H100 spends 475 of its 840 us of kernel
time in 121 cuBLAS GEMMs of 0.7-3.5 MB each (bench/results/gpu_profile_h100_r4.txt): about
3.9 us apiece where reading the weight takes 0.2-1.2 us, so the step is paying cuBLAS's
fixed cost per launch, not bandwidth. Llama-3.2-1B's larger layers run at 2.4 of the
H100's ~3.3 TB/s. A GEMV-style kernel that streams the weight once over many programs and
keeps the few rows of ``x`` in registers is the usual answer (vLLM's and SGLang's decode
paths carry such kernels for small batches).

- ``reference``: ``skinny_linear(x, weight, bias=None, *, silu_mul=False)``, torch's
  ``F.linear`` (after SwiGLU's ``silu(gate) * up`` with ``silu_mul``), and
  ``norm_skinny_linear(x, residual, norm_weight, eps, weight, bias=None)``, a decoder
  layer's residual add and RMSNorm (kernels/norm) then the projection: the oracles.
- ``triton_gemv``: the same signatures, one launch each; the activation and the norm are
  folded into the load of ``x``, so at decode sizes a layer runs four kernels fewer.
  ``weight_scale=`` takes an FP8 weight in kernels/fp8's format (e4m3, 128 x 128 block
  scales; the reference is then kernels/fp8's ``fp8_linear``): the activations are
  quantized per token and group of 128 in registers, so an FP8 decode step gets the same
  folds and one launch per projection (M <= 8: no tensor-core path).
- ``threshold.json``: per device, the largest M that takes the Triton kernel, overall and
  per weight shape the sweep measured (data, written by ``bench/gemv_bench.py
  --write-threshold`` from timings against cuBLAS in the same run). A device not in it
  takes cuBLAS at every M.

``skinny_max_m(device, n, k)`` answers the dispatch question (``TIDEPOOL_SKINNY_MAX_M``
overrides the file: 0 turns the kernel off, N sends M <= N to it); for FP8 weights
``threshold.fp8_skinny_max_m(device, n_pad, k_pad)`` (``TIDEPOOL_FP8_SKINNY_MAX_M``;
measured per shape by bench/fp8_gemm_bench.py). libs/model/linear.py is
the one caller.
"""

from kernels.gemv.reference import norm_skinny_linear, skinny_linear
from kernels.gemv.threshold import skinny_max_m

__all__ = ["norm_skinny_linear", "skinny_linear", "skinny_max_m"]
