"""The Triton skinny GEMM (kernels/gemv) against its torch reference on fresh random inputs,
in the interpreter here (float32) and on the GPU in tests/gpu (bfloat16): every M the
kernel takes (the broadcast path below 16 rows, ``tl.dot`` from 16), ragged N and K, bias,
the fused SiLU-and-multiply, strided ``x``; the dispatch threshold as data."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")

from kernels.gemv import reference as ref  # noqa: E402
from kernels.gemv import threshold  # noqa: E402
from kernels.gemv import triton_gemv as tri  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's bf16 math is wrong
TOL = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


def _rand(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 33])
@pytest.mark.parametrize("n,k", [(96, 200), (40, 576), (300, 64)])
def test_matches_reference(m, n, k):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs every run
    x, w = _rand(m, k, seed=seed), _rand(n, k, seed=seed + 1) / k**0.5
    torch.testing.assert_close(tri.skinny_linear(x, w), ref.skinny_linear(x, w), **TOL)


@pytest.mark.parametrize("m", [1, 5, 64])
def test_bias_and_fused_silu_mul(m):
    seed = torch.randint(0, 2**31, ()).item()
    n, k = 72, 136
    gate_up, w, b = _rand(m, 2 * k, seed=seed), _rand(n, k, seed=seed + 1) / k**0.5, _rand(n, seed=seed + 2)
    torch.testing.assert_close(tri.skinny_linear(gate_up, w, b, silu_mul=True), ref.skinny_linear(gate_up, w, b, silu_mul=True), **TOL)
    # folded into the load, the activation is the Triton activation kernel's to the bit
    from kernels.activation.triton_activation import silu_and_mul

    act = silu_and_mul(gate_up)
    assert torch.equal(tri.skinny_linear(gate_up, w, b, silu_mul=True), tri.skinny_linear(act, w, b))


def test_strided_x_and_empty_shapes():
    seed = torch.randint(0, 2**31, ()).item()
    wide, w = _rand(4, 300, seed=seed), _rand(50, 128, seed=seed + 1)
    x = wide[:, 100:228]  # a column slice: row stride 300
    torch.testing.assert_close(tri.skinny_linear(x, w), ref.skinny_linear(x, w), **TOL)
    assert tri.skinny_linear(_rand(0, 128, seed=1), w).shape == (0, 50)


def test_refusals_name_the_problem():
    w = _rand(8, 32, seed=0)
    with pytest.raises(ValueError, match="needs 64"):
        tri.skinny_linear(_rand(2, 32, seed=1), w, silu_mul=True)
    with pytest.raises(ValueError, match="at most 64 rows"):
        tri.skinny_linear(_rand(65, 32, seed=1), w)


def test_heuristic_spreads_small_outputs_over_the_sms():
    cpu = torch.device("cpu")  # the interpreter assumes 132 SMs
    assert tri.heuristic_config(1, 576, 576, cpu) == (1, 4, 1024, 4)  # 144 programs of 4 rows, one K step
    assert tri.heuristic_config(1, 49152, 576, cpu) == (1, 32, 256, 4)  # the LM head: plenty of programs already
    assert tri.heuristic_config(4, 2048, 8192, cpu) == (4, 4, 512, 4)
    assert tri.heuristic_config(32, 960, 576, cpu) == (32, 32, 128, 4)  # tensor cores from 16 rows
    assert tri.config(1, 576, 576, cpu) == tri.heuristic_config(1, 576, 576, cpu)  # nothing is tuned off CUDA


@pytest.mark.parametrize("m", [1, 3, 16])
def test_every_candidate_computes_the_product(m):
    seed = torch.randint(0, 2**31, ()).item()
    x, w = _rand(m, 80, seed=seed), _rand(40, 80, seed=seed + 1) / 80**0.5
    want = ref.skinny_linear(x, w)
    cands = tri.candidates(m, 40, 80)
    assert len(cands) >= 6 and all(c[0] >= m for c in cands)
    for cfg in cands[:: max(1, len(cands) // 4)]:  # a spread of them (the interpreter is slow)
        torch.testing.assert_close(tri.skinny_linear(x, w, config_override=cfg), want, **TOL)


def test_tuned_configs_serve_the_smallest_tuned_m_that_holds_m(monkeypatch):
    data = {"format": 1, "devices": {"GPU X": {"max_m": 8, "configs": {"96x64": {"1": [1, 8, 64, 4], "4": [4, 16, 64, 8], "16": [16, 32, 64, 4]}}}}}
    parsed = threshold.parse_thresholds(data)
    assert parsed["GPU X"][1]["96x64"][4] == (4, 16, 64, 8)
    monkeypatch.setattr(threshold, "_thresholds", lambda: parsed)
    assert threshold.tuned_config("GPU X", 96, 64, 1) == (1, 8, 64, 4)
    assert threshold.tuned_config("GPU X", 96, 64, 3) == (4, 16, 64, 8)
    assert threshold.tuned_config("GPU X", 96, 64, 9) == (16, 32, 64, 4)
    assert threshold.tuned_config("GPU X", 96, 64, 17) is None  # past the sweep: the heuristic
    assert threshold.tuned_config("GPU X", 64, 96, 1) is None and threshold.tuned_config("GPU Y", 96, 64, 1) is None
    with pytest.raises(ValueError, match="4 positive ints"):
        threshold.parse_thresholds({"format": 1, "devices": {"G": {"max_m": 1, "configs": {"8x8": {"1": [1, 8, 0, 4]}}}}})


def test_threshold_is_data(monkeypatch, tmp_path):
    assert threshold.parse_thresholds({"format": 1, "devices": {"H100": {"max_m": 8}}}) == {"H100": (8, {}, {}, 0, {})}
    with pytest.raises(ValueError, match="max_m must be"):
        threshold.parse_thresholds({"format": 1, "devices": {"H100": {"max_m": -1}}})
    with pytest.raises(ValueError, match="format"):
        threshold.parse_thresholds({"devices": {}})
    threshold.parse_thresholds(json.loads(threshold.THRESHOLD_FILE.read_text()))  # the shipped file parses
    assert threshold.skinny_max_m(torch.device("cpu")) == 0
    monkeypatch.setenv(threshold.ENV, "8")
    assert threshold.skinny_max_m(torch.device("cpu")) == 0  # off CUDA, never
    if torch.cuda.is_available():
        assert threshold.skinny_max_m(torch.device("cuda")) == 8
    monkeypatch.setenv(threshold.ENV, "100")
    assert threshold.skinny_max_m(torch.device("cuda")) == threshold.MAX_M == tri.MAX_M  # never past the kernel's rows
    monkeypatch.setenv(threshold.ENV, "eight")
    with pytest.raises(ValueError, match="non-negative int"):
        threshold.skinny_max_m(torch.device("cpu"))


def test_a_shape_measured_by_the_sweep_serves_up_to_its_own_limit(monkeypatch):
    """``max_m_by_shape`` (written by the sweep per weight shape) decides for the shapes it
    names, the device's ``max_m`` for the others; a file written before the field existed
    still parses, with every shape at ``max_m`` (its serialized form stays compatible)."""
    data = {"format": 1, "devices": {"GPU X": {"max_m": 1, "max_m_by_shape": {"960x576": 4, "49152x576": 0, "8x8": 512}, "configs": {}}}}
    parsed = threshold.parse_thresholds(data)
    monkeypatch.setattr(threshold, "_thresholds", lambda: parsed)
    monkeypatch.setattr(threshold, "device_facts", lambda device: ("GPU X", 132))
    monkeypatch.delenv(threshold.ENV, raising=False)
    dev = torch.device("cpu")  # device_facts answers for it here
    assert threshold.skinny_max_m(dev, 960, 576) == 4
    assert threshold.skinny_max_m(dev, 49152, 576) == 0  # measured slower even at M = 1
    assert threshold.skinny_max_m(dev, 576, 576) == 1 and threshold.skinny_max_m(dev) == 1  # not measured: the device's
    assert threshold.skinny_max_m(dev, 8, 8) == threshold.MAX_M
    monkeypatch.setenv(threshold.ENV, "0")
    monkeypatch.setattr(threshold, "device_facts", lambda device: None)
    assert threshold.skinny_max_m(dev, 960, 576) == 0  # the override wins (and off CUDA, never)
    old = threshold.parse_thresholds({"format": 1, "devices": {"GPU X": {"max_m": 2, "configs": {}}}})
    assert old["GPU X"].max_m_by_shape == {} and old["GPU X"].max_m == 2
    for bad in ({"960x576": -1}, {"960x576": True}, [4]):
        with pytest.raises(ValueError, match="max_m_by_shape"):
            threshold.parse_thresholds({"format": 1, "devices": {"G": {"max_m": 1, "max_m_by_shape": bad}}})


def test_bench_shape_thresholds_need_a_margin_at_every_m_up_to_them():
    from bench.gemv_bench import SHAPE_MARGIN, shape_thresholds

    def row(n, k, m, ratio):
        return dict(n=n, k=k, m=m, ratio=ratio)

    rows = [row(8, 8, 1, 1.5), row(8, 8, 2, 1.2), row(8, 8, 4, 0.9), row(8, 8, 8, 2.0),  # 8 wins, 4 does not
            row(16, 8, 1, 1.01), row(16, 8, 2, 1.5),  # within the noise at M = 1: never
            row(4, 4, 1, 1.3), row(4, 4, 1, 0.95)]  # two models share a shape: both must win
    assert SHAPE_MARGIN > 1.0
    assert shape_thresholds(rows) == {"8x8": 2, "16x8": 0, "4x4": 0}


def test_bench_threshold_is_the_largest_m_won_on_every_model_up_to_it():
    from bench.gemv_bench import choose_threshold, step_sums

    models = {"a": (2, [("qkv", 8, 8), ("lm_head", 16, 8)]), "b": (1, [("qkv", 8, 8), ("lm_head", 16, 8)])}
    speed = {1: (1.0, 2.0), 2: (1.0, 1.5), 4: (1.0, 0.9), 8: (1.0, 3.0)}  # ours, cuBLAS per call
    rows = [dict(model=mod, proj=p, m=m, ours_ms=o, cublas_ms=c) for mod in models for p in ("qkv", "lm_head") for m, (o, c) in speed.items()]
    sums = step_sums(rows, models)
    assert [(s["model"], s["m"], s["ours_ms"]) for s in sums][:2] == [("a", 1, 3.0), ("a", 2, 3.0)]  # 2 layers + head
    assert choose_threshold(sums) == 2  # M = 4 loses, so 8 is not taken though it wins
    rows[0]["cublas_ms"] = 0.1  # model a's qkv at M = 1 now loses badly
    assert choose_threshold(step_sums(rows, models)) == 0


def test_the_bf16_sweep_rewrites_its_part_of_a_device_entry_and_keeps_the_fp8_limits(monkeypatch, tmp_path):
    """bench/gemv_bench.py --write-threshold replaces the device's bf16 limits and tiles;
    the FP8 skinny limits and tiles in the same entry are bench/fp8_gemm_bench.py's and stay
    (dropping the tiles once sent Llama-3.2-1B's FP8 decode to the heuristic's, 0.905 -> 0.970 ms)."""
    from bench import gemv_bench

    path = tmp_path / "threshold.json"
    fp8 = {"fp8_max_m": 1, "fp8_max_m_by_shape": {"2048x2048:fp8": 4}, "fp8_source": "an FP8 sweep"}
    path.write_text(json.dumps({"format": 1, "devices": {"GPU X": {"max_m": 0, "configs": {"8x8": {"1": [1, 4, 8, 4]}, "8x8:fp8": {"1": [1, 2, 8, 4]}}, **fp8},
                                                         "GPU Y": {"max_m": 2}}}))
    monkeypatch.setattr(threshold, "THRESHOLD_FILE", path)
    monkeypatch.setattr(threshold, "reload", lambda: None)
    models = {"a": (1, [("qkv", 16, 8)])}
    rows = [dict(model="a", proj="qkv", n=16, k=8, m=m, ours_ms=1.0, untuned_ms=1.5, cublas_ms=2.0, ratio=2.0, config=[m, 8, 8, 4])
            for m in (1, 2)]
    assert gemv_bench.write_threshold(rows, models, "GPU X", commit="abc", date="today") == 2
    written = json.loads(path.read_text())["devices"]
    assert written["GPU X"]["configs"] == {"8x8:fp8": {"1": [1, 2, 8, 4]}, "16x8": {"1": [1, 8, 8, 4], "2": [2, 8, 8, 4]}}  # the old bf16 tiles are gone
    assert {k: written["GPU X"][k] for k in fp8} == fp8 and written["GPU Y"] == {"max_m": 2}
    assert threshold.parse_thresholds(json.loads(path.read_text()))["GPU X"].fp8_max_m_by_shape == {"2048x2048:fp8": 4}
    # The device-wide limit (for shapes the sweep did not measure) is the heuristic tiles':
    # where only the tuned ones win, it is 0, while the measured shape keeps its own limit.
    rows[0]["untuned_ms"] = 2.5
    assert gemv_bench.write_threshold(rows, models, "GPU X") == 0
    written = json.loads(path.read_text())["devices"]["GPU X"]
    assert written["max_m"] == 0 and written["max_m_by_shape"] == {"16x8": 2}


def test_partial_sweep_replaces_only_its_shapes(tmp_path, monkeypatch):
    """``--models`` (a sweep of some models, e.g. a TP shard's shapes): the device-wide
    limit, the other shapes' limits and tiles, and the full sweep's date stay."""
    from bench import gemv_bench

    path = tmp_path / "threshold.json"
    entry = {"max_m": 2, "max_m_by_shape": {"8x8": 4, "16x8": 0}, "configs": {"8x8": {"1": [1, 4, 8, 4]}, "16x8": {"1": [1, 2, 8, 4]}},
             "date": "full", "commit": "f00"}
    path.write_text(json.dumps({"format": 1, "devices": {"GPU X": entry}}))
    monkeypatch.setattr(threshold, "THRESHOLD_FILE", path)
    monkeypatch.setattr(threshold, "reload", lambda: None)
    models = {"b": (1, [("qkv", 16, 8)])}
    rows = [dict(model="b", proj="qkv", n=16, k=8, m=1, ours_ms=1.0, untuned_ms=3.0, cublas_ms=2.0, ratio=2.0, config=[1, 8, 8, 4])]
    assert gemv_bench.write_threshold(rows, models, "GPU X", commit="abc", date="today", partial=True) == 2
    written = json.loads(path.read_text())["devices"]["GPU X"]
    assert written["max_m_by_shape"] == {"8x8": 4, "16x8": 1}
    assert written["configs"] == {"8x8": {"1": [1, 4, 8, 4]}, "16x8": {"1": [1, 8, 8, 4]}}
    assert (written["date"], written["commit"]) == ("full", "f00")
    assert written["partial_sweeps"] == [{"models": ["b"], "date": "today", "commit": "abc"}]
    assert threshold.parse_thresholds(json.loads(path.read_text()))["GPU X"].max_m_by_shape == {"8x8": 4, "16x8": 1}


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_folded_in_matches_reference(m, with_residual):
    seed = torch.randint(0, 2**31, ()).item()
    n, k = 72, 200
    x, w = _rand(m, k, seed=seed), _rand(n, k, seed=seed + 1) / k**0.5
    residual = _rand(m, k, seed=seed + 2) if with_residual else None
    norm_w, bias = 1 + 0.1 * _rand(k, seed=seed + 3), _rand(n, seed=seed + 4)
    out, stream = tri.norm_skinny_linear(x, residual, norm_w, 1e-5, w, bias)
    want, want_stream = ref.norm_skinny_linear(x, residual, norm_w, 1e-5, w, bias)
    torch.testing.assert_close(out, want, **TOL)
    if with_residual:
        assert torch.equal(stream, want_stream)  # one rounding of the sum, as torch's add
    else:
        assert stream is x


def test_norm_refusals():
    x, w = _rand(2, 32, seed=0), _rand(8, 32, seed=1)
    with pytest.raises(ValueError, match="residual"):
        tri.norm_skinny_linear(x, _rand(2, 16, seed=2), _rand(32, seed=3), 1e-5, w)
    with pytest.raises(ValueError, match="norm weight"):
        tri.norm_skinny_linear(x, None, _rand(64, seed=3)[::2], 1e-5, w)


@pytest.mark.slow  # ~17 s on a cold Triton cache (CI's): make test-slow; test_kernels_build_for_hopper builds the served forms
def test_variants_compile_for_hopper_without_spills():
    """The interpreter checks the arithmetic; this checks the kernel builds for an H100
    (sm_90, compiled here without a GPU) and keeps its tiles in registers: the launches the
    wrappers make at the decode shapes (bf16, so with the GPU's specializations), every
    folded variant, with the heuristic's tiles and the tuning sweep's largest."""
    from pathlib import Path

    from tests import sm90_compile, triton_launches

    if not sm90_compile.tools_available() or not triton_launches.recording():
        pytest.skip("needs Triton's NVIDIA tools and the interpreter (a CPU run)")
    bf16 = dict(dtype=torch.bfloat16)
    with triton_launches.capture() as jobs:  # nothing runs: only the launches are recorded
        for m in (1, 4, 16, 64):
            for n, k in ((960, 576), (2048, 8192)):
                w, h = torch.empty(n, k, **bf16), torch.empty(m, k, **bf16)
                largest = max(tri.candidates(m, n, k), key=lambda c: c[1] * c[2])
                for cfg in (None, largest):
                    tri.skinny_linear(h, w, torch.empty(n, **bf16), config_override=cfg)
                    tri.skinny_linear(torch.empty(m, 2 * k, **bf16), w, silu_mul=True, config_override=cfg)
                    tri.norm_skinny_linear(h, torch.empty(m, k, **bf16), torch.empty(k, **bf16), 1e-5, w, config_override=cfg)
    assert len(jobs) == 4 * 2 * 2 * 3 and all(j["types"]["w_ptr"] == "*bf16" for j in jobs)
    assert "K" in jobs[0]["divisible"] and jobs[0]["constexprs"]["stride_wk"] == 1  # as a GPU launch specializes
    results = sm90_compile.compile_in_subprocess(jobs, cwd=Path(__file__).resolve().parents[2])
    for job, res in zip(jobs, results):
        assert "error" not in res, (job["constexprs"], res)
        assert res["local"] == 0 and res["regs"] <= 255, (job["constexprs"], job["num_warps"], res)


@pytest.mark.slow  # a whole model through the interpreter: make test-slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a CPU run: CPU tensors through the interpreter (tests/gpu checks the GPU)")
def test_model_through_the_skinny_gemm_equals_the_plain_path(monkeypatch):
    """The model's wiring of the skinny GEMM (libs/model/linear.py: qkv and gate/up with
    their norms folded in, down with the activation, o and the LM head plain), checked on
    the CPU: with the dispatch forced on for float32 in the interpreter, the tiny model's
    logits and greedy tokens match the plain path's, and every projection went through
    the kernels. On a GPU machine tests/gpu/test_decode_fusions_gpu.py checks the same
    through the engine's graphs."""
    from libs.engine import SamplingParams
    from libs.model import linear as lin
    from tests.gemv_calls import count_skinny_calls
    from tests.models import tiny_engine

    eng = tiny_engine()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # a prefill and a decode step (interpreted: slow)
    plain_logits = eng.first_step_logits(prompts[0])
    plain = [o.token_ids for o in eng.generate(prompts, params)]

    calls = count_skinny_calls(monkeypatch)
    monkeypatch.setattr(lin, "_skinny", lambda x, w: x.dim() == 2 and x.dtype == w.dtype and 0 < x.shape[0] <= tri.MAX_M)
    torch.testing.assert_close(eng.first_step_logits(prompts[0]), plain_logits, atol=1e-4, rtol=1e-4)
    assert calls["norm"] == 2 * 2 and calls["silu_mul"] == 2 and calls["plain"] == 2 + 1  # 2 layers, then the LM head
    assert [o.token_ids for o in eng.generate(prompts, params)] == plain


@pytest.mark.parametrize("kind", ["plain", "silu_mul", "norm"])
def test_the_weight_slice_requested_before_the_wait_computes_the_same(kind, monkeypatch):
    """The PDL path's prefetch (kernels/pdl; on the GPU only with PDL, for a static weight)
    forced on here: where one step covers K the program's weight slice is loaded before the
    loop, and the result is the reference's. A K past one step never prefetches."""
    assert tri._prefetch(True, True, 1024, 576)  # PDL, a static weight, one step covers K
    assert not tri._prefetch(True, False, 1024, 576)  # a weight the previous kernel may have written
    assert not tri._prefetch(True, True, 512, 576) and not tri._prefetch(False, True, 1024, 576)
    seed = torch.randint(0, 2**31, ()).item()
    monkeypatch.setattr(tri, "_prefetch", lambda pdl, static_weight, block_k, k: static_weight and block_k >= k)
    m, n, k = 3, 40, 96
    w = _rand(n, k, seed=seed) / k**0.5
    cfg = (4, 8, 128, 4)  # one step covers K = 96
    if kind == "norm":
        x, r, nw = _rand(m, k, seed=seed + 1), _rand(m, k, seed=seed + 2), 1 + 0.1 * _rand(k, seed=seed + 3)
        got, stream = tri.norm_skinny_linear(x, r, nw, 1e-5, w, config_override=cfg, static_weight=True)
        want, want_stream = ref.norm_skinny_linear(x, r, nw, 1e-5, w)
        torch.testing.assert_close(stream, want_stream, **TOL)
    else:
        silu = kind == "silu_mul"
        x = _rand(m, 2 * k if silu else k, seed=seed + 1)
        got = tri.skinny_linear(x, w, silu_mul=silu, config_override=cfg, static_weight=True)
        want = ref.skinny_linear(x, w, silu_mul=silu)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("kind", ["plain", "silu_mul", "norm"])
def test_whole_tiles_load_without_masks_and_compute_the_same(m, kind):
    """Where M, N and K are multiples of the blocks (the decode shapes with their tuned
    tiles), the kernel loads without masks, and at one row accumulates in 1-D: the
    reference's result either way, with a bias too."""
    cfg = (m, 8, 64, 4)
    n, k = 48, 192
    assert tri._even(m, n, k, cfg[:3])
    assert not tri._even(m, n + 1, k, cfg[:3]) and not tri._even(m, n, k + 16, cfg[:3]) and not tri._even(m - 1 or 3, n, k, cfg[:3])
    seed = torch.randint(0, 2**31, ()).item()
    w, b = _rand(n, k, seed=seed) / k**0.5, _rand(n, seed=seed + 1)
    if kind == "norm":
        x, r, nw = _rand(m, k, seed=seed + 2), _rand(m, k, seed=seed + 3), 1 + 0.1 * _rand(k, seed=seed + 4)
        got, stream = tri.norm_skinny_linear(x, r, nw, 1e-5, w, b, config_override=cfg)
        want, want_stream = ref.norm_skinny_linear(x, r, nw, 1e-5, w, b)
        assert torch.equal(stream, want_stream)
    else:
        silu = kind == "silu_mul"
        x = _rand(m, 2 * k if silu else k, seed=seed + 2)
        got, want = tri.skinny_linear(x, w, b, silu_mul=silu, config_override=cfg), ref.skinny_linear(x, w, b, silu_mul=silu)
    torch.testing.assert_close(got, want, **TOL)


def test_whole_tiles_drop_the_masks_for_a_dense_weight_only():
    """The launches at Llama-3.2-1B's decode shapes: a bf16 weight with whole tiles loads
    without masks (``EVEN``), a ragged one and an FP8 weight keep them (the form the FP8
    tiles were tuned and measured in: bench/RESULTS.md, issue 10, rounds 7 and 8)."""
    from kernels.fp8 import reference as fp8_ref
    from tests import triton_launches

    if not triton_launches.recording():
        pytest.skip("records launches in the interpreter (a CPU run)")
    bf16 = dict(dtype=torch.bfloat16)
    with triton_launches.capture() as jobs:  # nothing runs: only the launches are recorded
        tri.skinny_linear(torch.empty(1, 2048, **bf16), torch.empty(2048, 2048, **bf16), config_override=(1, 4, 2048, 4))
        tri.skinny_linear(torch.empty(1, 2000, **bf16), torch.empty(2048, 2000, **bf16), config_override=(1, 4, 2048, 4))
        tri.skinny_linear(torch.empty(3, 2048, **bf16), torch.empty(2048, 2048, **bf16), config_override=(4, 4, 2048, 4))
        w_q, w_s = torch.empty(2048, 2048, dtype=fp8_ref.FP8_DTYPE), torch.empty(16, 16)
        tri.skinny_linear(torch.empty(1, 2048, **bf16), w_q, weight_scale=w_s, config_override=(1, 4, 2048, 4))
    assert [j["constexprs"]["EVEN"] for j in jobs] == [True, False, False, False]
