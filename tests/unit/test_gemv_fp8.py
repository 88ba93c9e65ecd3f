"""The skinny GEMM with an FP8 weight (kernels/gemv, ``weight_scale=``) against its torch
reference, kernels/fp8's ``fp8_linear``: on fresh random inputs, in the interpreter here
(float32 activations) and on the GPU in tests/gpu (bfloat16). Every fused form the decode
step runs (plain, SiLU-and-multiply, the residual add and RMSNorm), ragged N and K (the
weight padded to 128), bias, every M the FP8 path takes, the PDL prefetch form, and the
dispatch threshold as data.

Tolerance: the kernel and the reference quantize the activations with the same arithmetic
(the same e4m3 values and scales, bit for bit) and multiply the same dequantized values in
fp32; only the order of the fp32 sums differs, about K * 2**-24 of the sum of |products|.
So the float32 results agree to 1e-4 relative; in bfloat16 (the GPU) the output's own
rounding, 2**-8, dominates."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from kernels.fp8 import reference as fp8_ref  # noqa: E402
from kernels.gemv import reference as ref  # noqa: E402
from kernels.gemv import threshold  # noqa: E402
from kernels.gemv import triton_gemv as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


def _rand(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE)


def _fp8_weight(n, k, seed):
    w_q, w_s = fp8_ref.quantize_weight(_rand(n, k, seed=seed).float() / k**0.5)
    return w_q, w_s


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(96, 200), (300, 256), (40, 576)])
def test_matches_reference(m, n, k):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs every run
    x = _rand(m, k, seed=seed)
    w_q, w_s = _fp8_weight(n, k, seed + 1)
    got = tri.skinny_linear(x, w_q, weight_scale=w_s, out_features=n)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, ref.skinny_linear(x, w_q, weight_scale=w_s, out_features=n), **TOL)


def test_reference_is_kernels_fp8_linear():
    """The oracle itself: the FP8 GEMM's reference, whose activations are quantized per
    token group, not the float product (which it differs from by e4m3's error)."""
    seed = torch.randint(0, 2**31, ()).item()
    x = _rand(2, 256, seed=seed)
    w_q, w_s = _fp8_weight(64, 256, seed + 1)
    want = fp8_ref.fp8_linear(x, w_q, w_s, n=64, out_dtype=torch.float32).to(x.dtype)
    assert torch.equal(ref.skinny_linear(x, w_q, weight_scale=w_s, out_features=64), want)
    dense = x.float() @ fp8_ref.dequantize_weight(w_q, w_s)[:64].t()
    assert not torch.equal(want.float(), dense)  # the activations' quantization shows


@pytest.mark.parametrize("m", [1, 5])
def test_bias_and_fused_silu_mul(m):
    seed = torch.randint(0, 2**31, ()).item()
    n, k = 72, 136
    gate_up, b = _rand(m, 2 * k, seed=seed), _rand(n, seed=seed + 2)
    w_q, w_s = _fp8_weight(n, k, seed + 1)
    got = tri.skinny_linear(gate_up, w_q, b, silu_mul=True, weight_scale=w_s, out_features=n)
    torch.testing.assert_close(got, ref.skinny_linear(gate_up, w_q, b, silu_mul=True, weight_scale=w_s, out_features=n), **TOL)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_folded_in_matches_reference(m, with_residual):
    seed = torch.randint(0, 2**31, ()).item()
    n, k = 72, 200
    x = _rand(m, k, seed=seed)
    w_q, w_s = _fp8_weight(n, k, seed + 1)
    residual = _rand(m, k, seed=seed + 2) if with_residual else None
    norm_w = 1 + 0.1 * _rand(k, seed=seed + 3)
    out, stream = tri.norm_skinny_linear(x, residual, norm_w, 1e-5, w_q, weight_scale=w_s, out_features=n)
    want, want_stream = ref.norm_skinny_linear(x, residual, norm_w, 1e-5, w_q, weight_scale=w_s, out_features=n)
    torch.testing.assert_close(out, want, **TOL)
    assert torch.equal(stream, want_stream) if with_residual else stream is x


@pytest.mark.parametrize("m", [1, 3, 8])
def test_every_candidate_computes_the_product(m):
    seed = torch.randint(0, 2**31, ()).item()
    n, k = 136, 384
    x = _rand(m, k, seed=seed)
    w_q, w_s = _fp8_weight(n, k, seed + 1)
    want = ref.skinny_linear(x, w_q, weight_scale=w_s, out_features=n)
    cands = tri.candidates(m, w_q.shape[0], w_q.shape[1], fp8=True)
    assert cands and all(c[2] % 128 == 0 and c[1] <= 128 for c in cands)
    for cfg in cands:
        torch.testing.assert_close(tri.skinny_linear(x, w_q, weight_scale=w_s, out_features=n, config_override=cfg), want, **TOL)


@pytest.mark.parametrize("kind", ["plain", "silu_mul", "norm"])
def test_the_weight_slice_requested_before_the_wait_computes_the_same(kind, monkeypatch):
    """With the prefetch forced on (on the GPU: PDL and a static weight), the e4m3 slice and
    its block scales are loaded before the loop, and the result is the reference's."""
    seed = torch.randint(0, 2**31, ()).item()
    monkeypatch.setattr(tri, "_prefetch", lambda pdl, static_weight, block_k, k: static_weight and block_k >= k)
    m, n, k = 3, 40, 200
    w_q, w_s = _fp8_weight(n, k, seed)
    cfg = (4, 8, 256, 4)  # one step covers K = 200
    fp8 = dict(weight_scale=w_s, out_features=n)
    if kind == "norm":
        x, r, nw = _rand(m, k, seed=seed + 1), _rand(m, k, seed=seed + 2), 1 + 0.1 * _rand(k, seed=seed + 3)
        got = tri.norm_skinny_linear(x, r, nw, 1e-5, w_q, config_override=cfg, static_weight=True, **fp8)[0]
        want = ref.norm_skinny_linear(x, r, nw, 1e-5, w_q, **fp8)[0]
    else:
        silu = kind == "silu_mul"
        x = _rand(m, 2 * k if silu else k, seed=seed + 1)
        got = tri.skinny_linear(x, w_q, silu_mul=silu, config_override=cfg, static_weight=True, **fp8)
        want = ref.skinny_linear(x, w_q, silu_mul=silu, **fp8)
    torch.testing.assert_close(got, want, **TOL)


def test_refusals_name_the_problem():
    w_q, w_s = _fp8_weight(64, 200, 0)
    with pytest.raises(ValueError, match="padded columns"):
        tri.skinny_linear(_rand(2, 300, seed=1), w_q, weight_scale=w_s)
    with pytest.raises(ValueError, match=f"at most {threshold.FP8_MAX_M} rows"):
        tri.skinny_linear(_rand(threshold.FP8_MAX_M + 1, 200, seed=1), w_q, weight_scale=w_s)
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 128"):
        tri.skinny_linear(_rand(2, 200, seed=1), w_q, weight_scale=w_s, config_override=(2, 8, 64, 4))
    with pytest.raises(ValueError, match="out_features"):
        tri.skinny_linear(_rand(2, 200, seed=1), w_q, weight_scale=w_s, out_features=200)
    with pytest.raises(ValueError):
        tri.skinny_linear(_rand(2, 200, seed=1), w_q, weight_scale=w_s[:, :1])  # not the weight's block grid


def test_fp8_threshold_and_tiles_are_data(monkeypatch, tmp_path):
    """``fp8_max_m`` per device (absent: 0, the FP8 GEMMs of kernels/fp8 serve) and per
    measured shape, the environment override, and tuned tiles under ``NxK:fp8``, apart
    from the bf16 ones."""
    data = {"format": 1, "devices": {"GPU X": {"max_m": 8, "fp8_max_m": 4, "fp8_max_m_by_shape": {"256x512:fp8": 1},
                                               "configs": {"256x512:fp8": {"4": [4, 8, 512, 4]}, "256x512": {"4": [4, 4, 128, 4]}}},
                                     "GPU Y": {"max_m": 8}}}
    path = tmp_path / "threshold.json"
    path.write_text(json.dumps(data))
    monkeypatch.setattr(threshold, "THRESHOLD_FILE", path)
    threshold.reload()
    try:
        cuda = torch.device("cuda", 0)
        monkeypatch.setattr(threshold, "device_facts", lambda d: ("GPU X", 132))
        assert threshold.fp8_skinny_max_m(cuda) == 4 and threshold.fp8_skinny_max_m(cuda, 512, 512) == 4
        assert threshold.fp8_skinny_max_m(cuda, 256, 512) == 1  # this shape's own measured limit
        assert threshold.tuned_config("GPU X", 256, 512, 3, fp8=True) == (4, 8, 512, 4)
        assert threshold.tuned_config("GPU X", 256, 512, 3) == (4, 4, 128, 4)
        monkeypatch.setattr(threshold, "device_facts", lambda d: ("GPU Y", 132))
        assert threshold.fp8_skinny_max_m(cuda) == 0
        monkeypatch.setenv(threshold.FP8_ENV, "64")
        assert threshold.fp8_skinny_max_m(cuda) == threshold.FP8_MAX_M
        assert threshold.fp8_skinny_max_m(torch.device("cpu")) == 0
        monkeypatch.setenv(threshold.FP8_ENV, "x")
        with pytest.raises(ValueError, match=threshold.FP8_ENV):
            threshold.fp8_skinny_max_m(cuda)
        data["devices"]["GPU X"]["fp8_max_m"] = -1
        with pytest.raises(ValueError, match="fp8_max_m"):
            threshold.parse_thresholds(data)
        data["devices"]["GPU X"]["fp8_max_m"], data["devices"]["GPU X"]["fp8_max_m_by_shape"] = 1, {"256x512:fp8": "2"}
        with pytest.raises(ValueError, match="fp8_max_m_by_shape"):
            threshold.parse_thresholds(data)
    finally:
        threshold.reload()


@pytest.mark.slow  # ~40 s on a cold Triton cache (CI's): make test-slow; test_kernels_build_for_hopper builds the served forms
def test_variants_compile_for_hopper_without_spills():
    """The FP8 launches the decode step makes, compiled for an H100 (sm_90) without a GPU:
    every folded form at Llama-3.2-1B's shapes, with the heuristic's tiles and the sweep's
    largest, keep their tiles in registers (the interpreter above checks the arithmetic)."""
    from pathlib import Path

    from tests import sm90_compile, triton_launches

    if not sm90_compile.tools_available() or not triton_launches.recording():
        pytest.skip("needs Triton's NVIDIA tools and the interpreter (a CPU run)")
    bf16 = dict(dtype=torch.bfloat16)
    with triton_launches.capture() as jobs:  # nothing runs: only the launches are recorded
        for m in (1, threshold.FP8_MAX_M):  # the broadcast product's smallest and largest row tiles
            for n, k in ((3072, 2048), (2048, 8192)):
                w_q, w_s = torch.empty(n, k, dtype=fp8_ref.FP8_DTYPE), torch.empty(n // 128, k // 128)
                h = torch.empty(m, k, **bf16)
                largest = max(tri.candidates(m, n, k, fp8=True), key=lambda c: c[1] * c[2])
                for cfg in (None, largest):
                    fp8 = dict(weight_scale=w_s, config_override=cfg)
                    tri.skinny_linear(h, w_q, torch.empty(n, **bf16), **fp8)
                    tri.skinny_linear(torch.empty(m, 2 * k, **bf16), w_q, silu_mul=True, **fp8)
                    tri.norm_skinny_linear(h, torch.empty(m, k, **bf16), torch.empty(k, **bf16), 1e-5, w_q, **fp8)
    assert len(jobs) == 2 * 2 * 2 * 3 and all(j["types"]["w_ptr"] == "*fp8e4nv" for j in jobs)
    results = sm90_compile.compile_in_subprocess(jobs, cwd=Path(__file__).resolve().parents[2])
    for job, res in zip(jobs, results):
        assert "error" not in res, (job["constexprs"], res)
        assert res["local"] == 0 and res["regs"] <= 255, (job["constexprs"], job["num_warps"], res)


@pytest.mark.slow  # a whole model through the interpreter: make test-slow
@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU run: CPU tensors through the interpreter (tests/gpu checks the GPU)")
def test_fp8_model_through_the_skinny_gemm_equals_its_fp8_gemm_path(monkeypatch):
    """libs/model/linear.py's wiring of FP8 layers into the skinny GEMM (qkv and gate/up
    with their norms folded in, down with the activation, o plain; the LM head is not FP8):
    with the dispatch forced on in the interpreter, the tiny FP8 model's logits and greedy
    tokens match its FP8 layers run as they are (the reference's dequantize-then-matmul on
    the CPU), and every FP8 projection went through the kernel."""
    from libs.model import linear as lin
    from libs.model.fp8 import quantize_projections
    from libs.engine import SamplingParams
    from tests.gemv_calls import count_skinny_calls
    from tests.models import tiny_engine

    eng = tiny_engine()
    assert quantize_projections(eng.runner.model, torch.device("cpu")) == 2 * 4
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    plain_logits = eng.first_step_logits(prompts[0])
    plain = [o.token_ids for o in eng.generate(prompts, params)]

    calls = count_skinny_calls(monkeypatch)
    monkeypatch.setattr(lin, "_fp8_skinny", lambda x, module: x.dim() == 2 and 0 < x.shape[0] <= threshold.FP8_MAX_M)
    torch.testing.assert_close(eng.first_step_logits(prompts[0]), plain_logits, atol=1e-4, rtol=1e-4)
    assert calls["norm"] == 2 * 2 and calls["silu_mul"] == 2 and calls["plain"] == 2  # 2 layers; the LM head is not FP8
    assert calls["fp8"] == calls["norm"] + calls["silu_mul"] + calls["plain"]
    assert [o.token_ids for o in eng.generate(prompts, params)] == plain


def test_bench_shape_thresholds_need_a_margin_at_every_m_up_to_them():
    from bench.fp8_gemm_bench import choose_skinny_threshold, skinny_shape_thresholds

    def row(n, m, skinny, swap, normal):
        return dict(n=n, k=256, m=m, skinny=skinny, swap_ab=swap, normal=normal)

    rows = [row(128, 1, 1.0, 2.0, 2.0), row(128, 4, 1.0, 1.01, 3.0), row(128, 16, 1.0, 2.0, 2.0),  # 4 wins by < 2%
            row(200, 1, 1.0, 1.5, 0.9), row(200, 4, 1.0, 2.0, 2.0),  # the normal variant wins at 1
            row(384, 1, 1.0, 2.0, 2.0), row(384, 4, 1.0, 2.0, 2.0), row(384, 64, None, 1.0, 1.0)]
    assert skinny_shape_thresholds(rows) == {"128x256:fp8": 1, "256x256:fp8": 0, "384x256:fp8": 4}
    assert choose_skinny_threshold(rows) == 0  # the 200-row shape loses at M = 1
    assert choose_skinny_threshold([r for r in rows if r["n"] != 200]) == 16  # every shape measured at each M
