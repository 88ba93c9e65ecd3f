"""Count the skinny GEMM's launches by kind (tests of the model's wiring, CPU and GPU)."""

from __future__ import annotations


def count_skinny_calls(monkeypatch) -> dict[str, int]:
    """Wrap kernels/gemv's Triton entry points for the test; returns the live counts
    (``plain``, ``silu_mul``, ``norm``; ``fp8``: those of them with an FP8 weight). The
    model looks them up at call time."""
    from kernels.gemv import triton_gemv

    calls = {"plain": 0, "silu_mul": 0, "norm": 0, "fp8": 0}
    real, real_norm = triton_gemv.skinny_linear, triton_gemv.norm_skinny_linear

    def counting(*args, silu_mul=False, **kw):
        calls["silu_mul" if silu_mul else "plain"] += 1
        calls["fp8"] += kw.get("weight_scale") is not None
        return real(*args, silu_mul=silu_mul, **kw)

    def counting_norm(*args, **kw):
        calls["norm"] += 1
        calls["fp8"] += kw.get("weight_scale") is not None
        return real_norm(*args, **kw)

    monkeypatch.setattr(triton_gemv, "skinny_linear", counting)
    monkeypatch.setattr(triton_gemv, "norm_skinny_linear", counting_norm)
    return calls
