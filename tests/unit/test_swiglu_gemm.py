"""The gate/up GEMM with SwiGLU in its epilogue (kernels/swiglu_gemm) against its torch
reference on fresh random inputs, in Triton's interpreter here (tests/gpu/test_swiglu_gemm_gpu.py
runs it on the GPU at prefill sizes); its operand checks; the dispatch threshold as data;
the benchmark's threshold rule; the model's MLP through the dispatch.

Tolerances, relative to each output (``rtol``) plus a floor for outputs near zero:
- fp32: the interpreter multiplies in IEEE fp32, so only the summation order differs:
  1e-5;
- fp16: the kernel rounds the two products, silu and the result to fp16 where the
  reference does; a product that lands near a rounding edge may round the other way
  after a different summation order, one ulp (2^-11 relative), which silu and the
  multiply carry through: 2^-9;
- bf16: the interpreter's casts to bf16 truncate instead of rounding (kernels/rope's note),
  at each of the three roundings: up to three ulps of 2^-8 against round-to-nearest: 2^-5.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from kernels.swiglu_gemm import reference as ref  # noqa: E402
from kernels.swiglu_gemm import threshold as thr  # noqa: E402
from kernels.swiglu_gemm import triton_swiglu_gemm as tri  # noqa: E402

RTOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-5}
SMALL = tri.SwigluConfig(32, 16, 32, 4, 2, 4)  # interpreter-sized tiles


def _rand(*shape, gen, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def assert_within(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    floor = 1e-3 * want.float().abs().max().item()
    bad = (got.float() - want.float()).abs() > rtol * want.float().abs() + floor
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outside rtol {rtol}: got {got.float()[bad][:4]}, want {want.float()[bad][:4]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,inter", [(1, 64, 16), (3, 200, 40), (37, 576, 96), (130, 72, 24)])
def test_matches_reference(dtype, m, k, inter):
    """Rows, K and the intermediate size off the tiles' multiples (the descriptors' bounds
    do the masking; a gate tile past I reads up rows that the store drops)."""
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())  # fresh inputs every run
    x = _rand(m, k, gen=gen, dtype=dtype)
    w = _rand(2 * inter, k, gen=gen, dtype=dtype, scale=k**-0.5)
    got = tri.swiglu_linear(x, w, SMALL)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert_within(got, ref.swiglu_linear(x, w), RTOL[dtype])


def test_gate_and_up_halves_are_not_swapped():
    """silu(gate) * up is not symmetric: a weight whose halves are swapped must give a
    different answer (guards the up rows' offset)."""
    gen = torch.Generator().manual_seed(1)
    x, w = _rand(20, 64, gen=gen, dtype=torch.float32), _rand(64, 64, gen=gen, dtype=torch.float32, scale=0.125)
    got = tri.swiglu_linear(x, w, SMALL)
    swapped = ref.swiglu_linear(x, torch.cat([w[32:], w[:32]]))
    assert_within(got, ref.swiglu_linear(x, w), RTOL[torch.float32])
    assert not torch.allclose(got, swapped, rtol=1e-2, atol=1e-3)


def test_empty_and_zero_k():
    w = torch.randn(32, 16)
    assert tri.swiglu_linear(torch.randn(0, 16), w, SMALL).shape == (0, 16)
    out = tri.swiglu_linear(torch.randn(5, 0), torch.randn(32, 0), SMALL)
    assert out.shape == (5, 16) and not out.any()


@pytest.mark.parametrize(
    "x,w,needle",
    [
        (torch.randn(4, 16), torch.randn(30, 8), "K = 16"),
        (torch.randn(4, 16), torch.randn(31, 16), "gate rows"),
        (torch.randn(4, 16), torch.randn(32, 16, dtype=torch.float16), "share a dtype"),
        (torch.randn(4, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64), "share a dtype"),
        (torch.randn(4, 6, dtype=torch.bfloat16), torch.randn(32, 6, dtype=torch.bfloat16), "16-byte"),
        (torch.randn(16, 4).t(), torch.randn(32, 16), "unit column stride"),
        (torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(12, 16, dtype=torch.bfloat16), "intermediate 6"),
        (torch.randn(4, 16), torch.randn(2, 32, 16), "2-D"),
    ],
)
def test_operands_refused_with_a_reason(x, w, needle):
    assert needle in tri.supports(x, w)
    with pytest.raises(ValueError, match="swiglu_linear"):
        tri.swiglu_linear(x, w)


# -- the threshold file ------------------------------------------------------------------

GPU = torch.device("cuda", 0)


def _entry(min_m=1024, configs=None):
    return {"min_m": min_m, "configs": configs or {"1024": [64, 64, 64, 8, 3, 4], "16384": [128, 64, 64, 8, 3, 8]}}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device named "GPU X" with the given shapes in the threshold data."""

    def install(shapes: dict) -> None:
        parsed = thr.parse_thresholds({"format": 1, "devices": {"GPU X": {"shapes": shapes}}})
        monkeypatch.setattr(thr, "_thresholds", lambda: parsed)
        monkeypatch.setattr(thr, "device_facts", lambda device: ("GPU X", 132))

    monkeypatch.delenv(thr.ENV, raising=False)
    return install


def test_the_shipped_file_parses():
    thr.parse_thresholds(json.loads(thr.THRESHOLD_FILE.read_text()))


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"format": 2}, "format"),
        ({"format": 1, "devices": {"G": {}}}, "'shapes'"),
        ({"format": 1, "devices": {"G": {"shapes": {"8x8": {"min_m": 0, "configs": {"1": [1] * 6}}}}}}, "min_m"),
        ({"format": 1, "devices": {"G": {"shapes": {"8x8": {"min_m": 4, "configs": {}}}}}}, "configs"),
        ({"format": 1, "devices": {"G": {"shapes": {"8x8": {"min_m": 4, "configs": {"4": [1, 2, 3]}}}}}}, "6 positive ints"),
        ({"format": 1, "devices": {"G": {"shapes": {"8x8": {"min_m": 4, "configs": {"x": [1] * 6}}}}}}, "6 positive ints"),
    ],
)
def test_bad_files_are_refused(data, needle):
    with pytest.raises(ValueError, match=needle):
        thr.parse_thresholds(data)


def test_config_from_min_m_and_the_next_larger_tuned_m(fake_gpu):
    fake_gpu({"3072x576": _entry()})
    assert thr.swiglu_gemm_config(GPU, 3072, 576, 1023) is None
    assert thr.swiglu_gemm_config(GPU, 3072, 576, 1024) == tri.SwigluConfig(64, 64, 64, 8, 3, 4)
    assert thr.swiglu_gemm_config(GPU, 3072, 576, 1025) == tri.SwigluConfig(128, 64, 64, 8, 3, 8)
    assert thr.swiglu_gemm_config(GPU, 3072, 576, 40000) == tri.SwigluConfig(128, 64, 64, 8, 3, 8)
    assert thr.swiglu_gemm_config(GPU, 16384, 2048, 16384) is None  # a shape not measured faster
    assert thr.swiglu_gemm_config(torch.device("cpu"), 3072, 576, 16384) is None


def test_env_overrides_the_file(fake_gpu, monkeypatch):
    fake_gpu({"3072x576": _entry()})
    monkeypatch.setenv(thr.ENV, "0")
    assert thr.swiglu_gemm_config(GPU, 3072, 576, 16384) is None
    monkeypatch.setenv(thr.ENV, "1")
    assert thr.swiglu_gemm_config(GPU, 3072, 576, 8) == tri.SwigluConfig(64, 64, 64, 8, 3, 4)
    assert thr.swiglu_gemm_config(GPU, 16384, 2048, 8) == tri.DEFAULT_CONFIG
    assert thr.swiglu_gemm_config(torch.device("cpu"), 3072, 576, 8) is None
    monkeypatch.setenv(thr.ENV, "yes")
    with pytest.raises(ValueError, match=thr.ENV):
        thr.swiglu_gemm_config(GPU, 3072, 576, 8)


# -- the benchmark's rule ----------------------------------------------------------------


def _row(m, ratio, n=3072, k=576):
    return dict(model="x", n=n, k=k, m=m, ratio=ratio, fused_ms=1.0, unfused_ms=ratio, config=[128, 64, 64, 8, 3, m % 7 + 1])


def test_min_m_is_where_the_kernel_wins_at_every_larger_m():
    from bench.swiglu_gemm_bench import MARGIN, shape_entries

    rows = [_row(256, 1.5), _row(1024, 0.9), _row(4096, MARGIN), _row(16384, 1.2)]
    rows += [_row(m, r, n=16384, k=2048) for m, r in ((256, 1.3), (16384, 0.97))]
    entries = shape_entries(rows)
    assert entries == {"3072x576": {"min_m": 4096, "configs": {"16384": rows[3]["config"], "4096": rows[2]["config"]}}}


def test_several_runs_keep_each_shapes_worst():
    from bench.swiglu_gemm_bench import shape_entries, worst_rows

    run1 = [_row(1024, 1.01), _row(4096, 1.3), _row(16384, 1.2)]
    run2 = [_row(1024, 1.4), _row(4096, 1.1), _row(16384, 1.25)]
    rows = worst_rows([run1, run2])
    assert sorted((r["m"], r["ratio"]) for r in rows) == [(1024, 1.01), (4096, 1.1), (16384, 1.2)]
    assert shape_entries(rows)["3072x576"]["min_m"] == 4096  # 1,024 lost the margin in one run


def test_write_threshold_replaces_the_device_entry(tmp_path, monkeypatch):
    from bench import swiglu_gemm_bench

    path = tmp_path / "threshold.json"
    path.write_text(json.dumps({"format": 1, "devices": {"GPU Y": {"shapes": {"8x8": _entry(4, {"4": [1] * 6})}}}}))
    monkeypatch.setattr(thr, "THRESHOLD_FILE", path)
    swiglu_gemm_bench.write_threshold([_row(1024, 1.1), _row(16384, 1.3)], "GPU X", commit="abc", date="today")
    parsed = thr.parse_thresholds(json.loads(path.read_text()))
    assert parsed["GPU X"]["3072x576"].min_m == 1024 and "GPU Y" in parsed
    assert json.loads(path.read_text())["devices"]["GPU X"]["commit"] == "abc"


def test_the_benchmark_runs_in_the_interpreter():
    from bench import swiglu_gemm_bench as b

    rows = b.run(torch.device("cpu"), b.TOY_SHAPES, b.TOY_MS, torch.float32, b.TOY_CANDIDATES[:1])
    assert [r["m"] for r in rows] == b.TOY_MS and all(r["config"] == list(b.TOY_CANDIDATES[0]) for r in rows)


# -- the model's dispatch ----------------------------------------------------------------


def test_mlp_takes_the_fused_path_where_the_dispatch_says_so(monkeypatch):
    """libs/model/linear.py: where a config is given, the MLP's gate/up output is already
    activated and down takes it as it is; the result equals the unfused MLP's. (On the CPU
    the dispatch never picks the kernel; here it is made to, with the interpreter's.)"""
    from libs.model import linear
    from libs.model.config import ModelConfig
    from libs.model.llama import MLP

    cfg = ModelConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=32, max_position_embeddings=64)
    mlp = MLP(cfg)
    x = torch.randn(40, 64)
    want = mlp(x)
    calls = []

    def fake_config(module, x):
        calls.append(tuple(module.weight.shape))
        return SMALL

    monkeypatch.setattr(linear, "_swiglu_config", fake_config)
    y, activated = linear.gate_up_linear(mlp.gate_up_proj, x)
    assert activated and y.shape == (40, 48)
    assert_within(mlp(x), want, 1e-4)
    assert calls == [(96, 64), (96, 64)]
