"""GEMM plans (kernels/fp8/plan.py): the serialized form stays backward compatible, the
tuned table is found by device, shape and M bucket, the heuristic fills in elsewhere; and
the tuner (bench/fp8_tune.py) writes a table that the lookup reads back."""

from __future__ import annotations

import json

import pytest

from kernels.fp8 import plan as plan_mod
from kernels.fp8.plan import GemmPlan, heuristic_plan, parse_configs, plan_gemm, swap_ab_max_m

# The five fields of the first release, as bench/fp8_gemm_bench.py and the kernels knew them.
OLD_FORM = {"swap_ab": True, "token_tile": 16, "weight_tile": 64, "num_warps": 4, "num_stages": 4}


def test_an_old_serialized_plan_loads_as_the_launch_it_described():
    plan = GemmPlan.from_dict(json.loads(json.dumps(OLD_FORM)))
    # group 8 was the kernel's fixed grouping; no split-K, no fused quantization, no TMA.
    assert plan == GemmPlan(True, 16, 64, 4, 4, group=8, split_k=1, fuse_quant=False, tma=False)
    full = GemmPlan(False, 128, 256, 8, 3, group=16, split_k=2, tma=True)
    assert GemmPlan.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    assert set(OLD_FORM) <= set(full.to_dict())  # nothing of the old form was renamed


@pytest.mark.parametrize(
    "bad, match",
    [
        ({**OLD_FORM, "splitk": 2}, "unknown GemmPlan field"),
        ({k: v for k, v in OLD_FORM.items() if k != "num_stages"}, "missing required"),
        ({**OLD_FORM, "split_k": "2"}, "must be int"),
        ({**OLD_FORM, "token_tile": True}, "must be int"),
        ({**OLD_FORM, "fuse_quant": 1}, "must be bool"),
        ({**OLD_FORM, "weight_tile": 48}, "weight_tile"),
        ({**OLD_FORM, "split_k": 0}, "split_k"),
        ({**OLD_FORM, "fuse_quant": True, "tma": True}, "tma"),
    ],
)
def test_a_bad_serialized_plan_is_refused_with_its_reason(bad, match):
    with pytest.raises(ValueError, match=match):
        GemmPlan.from_dict(bad)


def test_the_stored_data_files_parse():
    assert swap_ab_max_m() >= 0
    if plan_mod.CONFIGS_FILE.exists():
        table = parse_configs(json.loads(plan_mod.CONFIGS_FILE.read_text()))
        for shapes in table.values():
            for shape, variants in shapes.items():
                n_pad = int(shape.split("x")[0])
                for entries in variants.values():
                    assert entries and all(n_pad % e.plan.weight_tile == 0 for e in entries)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A tuned table for "Fake H100" and a CUDA device that says it is one."""
    def entry(max_m, tile):
        return {"max_m": max_m, "plan": {**OLD_FORM, "token_tile": tile}, "ms": 0.01}

    table = {
        "format": 1,
        "devices": {
            "Fake H100": {"shapes": {"4096x4096": {
                "swap_ab": [entry(16, 16), entry(1, 32), entry(64, 64)],
                "normal": [{"max_m": 1024, "plan": {**OLD_FORM, "swap_ab": False, "token_tile": 128}}],
            }}},
            "Other GPU": {"shapes": {"4096x4096": {"swap_ab": [entry(1, 128)]}}},
        },
    }
    path = tmp_path / "gemm_configs.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(plan_mod, "CONFIGS_FILE", path)
    monkeypatch.setattr(plan_mod, "device_facts", lambda d: ("Fake H100", 132) if d is not None and "cuda" in str(d) else None)
    plan_mod.reload()
    yield
    monkeypatch.undo()
    plan_mod.reload()


def test_the_tuned_plan_of_the_smallest_bucket_holding_m(fake_gpu):
    tile = lambda m, **kw: plan_gemm(m, swap_ab=True, n=4096, k=4096, device="cuda", **kw).token_tile  # noqa: E731
    assert [tile(m) for m in (1, 2, 16, 17, 64)] == [32, 16, 16, 64, 64]
    # Past the last bucket (64 < LARGE_M): the heuristic, not a plan tuned for 64 tokens.
    assert plan_gemm(100, swap_ab=True, n=4096, k=4096, device="cuda") == heuristic_plan(100, True, 4096, 4096, 132)
    assert plan_gemm(1, swap_ab=True, n=4000, k=4096, device="cuda").token_tile == 32  # N pads to 4096
    # Untuned: another shape, no device, the CPU: the heuristic.
    for kw in ({"n": 2048, "k": 4096, "device": "cuda"}, {"n": 4096, "k": 4096}, {"n": 4096, "k": 4096, "device": "cpu"}):
        assert plan_gemm(1, swap_ab=True, **kw) == heuristic_plan(1, True, plan_mod.padded(kw["n"]), 4096, 132 if kw.get("device") == "cuda" else None)
    # A bucket of 1024 tokens or more also serves the Ms above it.
    assert plan_gemm(1, swap_ab=False, n=4096, k=4096, device="cuda").token_tile == 128
    assert plan_gemm(8192, swap_ab=False, n=4096, k=4096, device="cuda").token_tile == 128


def test_the_swap_ab_threshold_is_per_device_and_its_first_form_still_reads():
    first_form = {"swap_ab_max_m": 16, "provisional": False, "device": "NVIDIA H100 80GB HBM3", "timings_ms": {}}
    assert plan_mod.parse_swap_ab_threshold(first_form) == (16, {})
    data = {**first_form, "by_device": {"NVIDIA H200": {"swap_ab_max_m": 32, "source": "...", "timings_ms": {}}}}
    assert plan_mod.parse_swap_ab_threshold(json.loads(json.dumps(data))) == (16, {"NVIDIA H200": 32})
    for bad, match in (
        ({"swap_ab_max_m": -1}, "swap_ab_max_m"),
        ({"swap_ab_max_m": True}, "swap_ab_max_m"),
        ({}, "swap_ab_max_m"),
        ({"swap_ab_max_m": 16, "by_device": [32]}, "by_device"),
        ({"swap_ab_max_m": 16, "by_device": {"G": {"swap_ab_max_m": "32"}}}, "by_device.*'G'"),
        ({"swap_ab_max_m": 16, "by_device": {"G": 32}}, "by_device.*'G'"),
    ):
        with pytest.raises(ValueError, match=match):
            plan_mod.parse_swap_ab_threshold(bad)


def test_plan_gemm_takes_the_threshold_of_its_device(fake_gpu, tmp_path, monkeypatch):
    path = tmp_path / "swap_ab_threshold.json"
    path.write_text(json.dumps({"swap_ab_max_m": 4, "by_device": {"Fake H100": {"swap_ab_max_m": 32}}}))
    monkeypatch.setattr(plan_mod, "THRESHOLD_FILE", path)
    plan_mod.reload()
    assert (swap_ab_max_m(), swap_ab_max_m("Fake H100"), swap_ab_max_m("Other GPU")) == (4, 32, 4)
    assert [plan_gemm(m, n=4096, k=4096, device="cuda").swap_ab for m in (1, 32, 33)] == [True, True, False]
    assert [plan_gemm(m, n=4096, k=4096, device="cpu").swap_ab for m in (4, 5)] == [True, False]
    assert [plan_gemm(m).swap_ab for m in (4, 5)] == [True, False]


def test_a_tuned_plan_whose_tile_does_not_divide_the_weight_is_not_used(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    bad = {**OLD_FORM, "weight_tile": 256}
    path.write_text(json.dumps({"format": 1, "devices": {"G": {"shapes": {"384x384": {"swap_ab": [{"max_m": 4, "plan": bad}]}}}}}))
    monkeypatch.setattr(plan_mod, "CONFIGS_FILE", path)
    plan_mod.reload()
    try:
        assert plan_mod.tuned_plan(1, 384, 384, True, "G") is None
    finally:
        monkeypatch.undo()
        plan_mod.reload()


def test_a_table_of_another_format_or_a_misfiled_plan_is_refused():
    with pytest.raises(ValueError, match="format"):
        parse_configs({"format": 2, "devices": {}})
    normal = {**OLD_FORM, "swap_ab": False}
    with pytest.raises(ValueError, match="other variant"):
        parse_configs({"format": 1, "devices": {"G": {"shapes": {"128x128": {"swap_ab": [{"max_m": 1, "plan": normal}]}}}}})


def test_heuristic_splits_k_only_where_row_tiles_leave_sms_idle():
    # Llama-3.2-1B's down projection at decode: 32 row tiles of 64 on 132 SMs, 64 K blocks.
    assert heuristic_plan(1, True, 2048, 8192, 132).split_k == 4
    assert heuristic_plan(1, True, 4096, 14336, 132).split_k == 2
    assert heuristic_plan(1, True, 14336, 4096, 132).split_k == 1  # 224 tiles fill the GPU
    assert heuristic_plan(1, True, 2048, 576, 132).split_k == 1  # 5 K blocks: too short to share
    assert heuristic_plan(1, True, 2048, 8192, None).split_k == 1


# -- the tuner ------------------------------------------------------------------------------


def test_tuner_candidates_fit_their_shape():
    from bench.fp8_tune import LLAMA3_8B, LLAMA3_8B_MS, work

    for n, k, m, swap, plans in work(LLAMA3_8B, LLAMA3_8B_MS, 132):
        assert plans[0] == heuristic_plan(m, swap, n, k, 132) and len(set(plans)) == len(plans)
        for p in plans:
            assert p.swap_ab == swap and n % p.weight_tile == 0
            assert p.split_k == 1 or k // 128 >= 4 * p.split_k
            assert not (p.fuse_quant and m > 64)


def test_tuner_writes_a_table_the_lookup_reads(tmp_path):
    """The toy run (Triton's interpreter, one plan per job): entries land under the device
    name, other devices' tables survive, and ``parse_configs`` reads the file back."""
    import time

    import torch

    from bench.fp8_tune import TOY_SHAPES, cpu_timer, merge_into, tune, work

    jobs = work(TOY_SHAPES, [1], 4, limit=1)
    results = tune(jobs, torch.device("cpu"), cpu_timer, {}, budget_s=600, t0=time.time())
    assert set(results["256x256"]) == {"swap_ab", "normal"}
    path = tmp_path / "configs.json"
    merge_into(path, "Other GPU", {"128x128": {"normal": [{"max_m": 1, "plan": {**OLD_FORM, "swap_ab": False}}]}}, {})
    merge_into(path, "cpu (Triton interpreter)", results, {"date": "now"})
    table = parse_configs(json.loads(path.read_text()))
    assert set(table) == {"Other GPU", "cpu (Triton interpreter)"}
    entry = table["cpu (Triton interpreter)"]["256x256"]["swap_ab"][0]
    assert entry.max_m == 1 and entry.plan == jobs[0][-1][0]


def test_tuner_compiles_in_worker_processes_and_reports_failures():
    """The pool the tuner compiles in (spawned processes; here Triton's interpreter, which
    the environment passes on): a plan that cannot run comes back with its reason."""
    from bench.fp8_tune import precompile

    good = [GemmPlan(True, 16, 64, 4, 2, fuse_quant=True), GemmPlan(False, 64, 128, 4, 2, split_k=2)]
    bad = GemmPlan(False, 64, 256, 4, 2)  # 256-row tiles do not divide the workers' 384-row weight
    failed = precompile([*good, bad], workers=1, device="cpu")
    assert list(failed) == [bad] and "weight tile (256)" in failed[bad]
