"""Expert executors and their selection (libs/model/moe/executors.py, strategy.py).

Every executor against the per-expert loop, and the loop against a dense first-principles
sum, on fresh random weights: token counts 0, 1, a prime and one past a tile, uniform,
skewed, balanced and partly-elsewhere routing. The grouped executors run both the torch
references of the kernels and the Triton kernels (in the interpreter on the CPU, fp32);
``grouped_mm`` runs torch's CPU build in bf16.

Selection: explicit strategies honoured (reference kernels off CUDA), ``auto`` on the CPU
and on a "cuda" device without one, ``grouped_mm`` falling back where it cannot run, every
capability check answering False instead of raising when its probe breaks, the hybrid
threshold read from data, and the graph-capture refusal.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernels.moe.select import reference_moe_ops, triton_moe_ops  # noqa: E402
from libs.model.graph_capture import capturing_graph  # noqa: E402
from libs.model.moe import executors as ex  # noqa: E402
from libs.model.moe import strategy  # noqa: E402
from libs.model.moe.routing import Routing  # noqa: E402
from libs.model.moe.strategy import LayerShape, select_executor  # noqa: E402
from tests.moe_inputs import make_ids  # noqa: E402

E, K, H, INTER = 4, 2, 32, 24
CPU = torch.device("cpu")


def problem(num_tokens: int, kind: str, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    routing = Routing(torch.rand(num_tokens, K, generator=g), make_ids(kind, num_tokens, E, K, seed))
    return x.to(dtype), routing, w13.to(dtype), w2.to(dtype)


def dense_reference(x, routing, w13, w2) -> torch.Tensor:
    """Every expert on every token, then the routed ones picked: no scatter, no grouping."""
    h = torch.einsum("th,enh->ten", x.float(), w13.float())
    y = torch.einsum("tei,ehi->teh", F.silu(h[..., :INTER]) * h[..., INTER:], w2.float())
    out = torch.zeros(x.shape[0], H)
    for j in range(routing.ids.shape[1]):
        ids = routing.ids[:, j].long()
        ok = (ids >= 0) & (ids < E)
        picked = y[torch.arange(x.shape[0]), ids.clamp(0, E - 1)]
        out += torch.where(ok[:, None], routing.weights[:, j, None] * picked, 0.0)
    return out


EXECUTORS = {
    "contiguous-reference": lambda: ex.ContiguousExecutor(reference_moe_ops(), block_m=16),
    "masked-reference": lambda: ex.MaskedExecutor(reference_moe_ops()),
    "contiguous-triton": lambda: ex.ContiguousExecutor(triton_moe_ops(), block_m=16),
    "masked-triton": lambda: ex.MaskedExecutor(triton_moe_ops()),
    "hybrid-triton": lambda: ex.HybridExecutor(ex.MaskedExecutor(triton_moe_ops()), ex.ContiguousExecutor(triton_moe_ops(), block_m=16), 13),
}


@pytest.mark.parametrize("kind", ["uniform", "skewed", "balanced", "elsewhere"])
@pytest.mark.parametrize("num_tokens", [0, 1, 13, 37])
def test_loop_equals_dense_first_principles(num_tokens, kind):
    x, routing, w13, w2 = problem(num_tokens, kind, seed=num_tokens + 3)
    out = ex.LoopExecutor()(x, routing, w13, w2)
    assert out.shape == (num_tokens, H)
    torch.testing.assert_close(out, dense_reference(x, routing, w13, w2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(EXECUTORS))
@pytest.mark.parametrize("kind", ["uniform", "skewed", "balanced", "elsewhere"])
@pytest.mark.parametrize("num_tokens", [0, 1, 13, 37])
def test_executor_equals_loop(name, num_tokens, kind):
    x, routing, w13, w2 = problem(num_tokens, kind, seed=5 * num_tokens + len(kind))
    out = EXECUTORS[name]()(x, routing, w13, w2)
    assert out.shape == (num_tokens, H) and out.dtype == x.dtype
    torch.testing.assert_close(out, ex.LoopExecutor()(x, routing, w13, w2), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not strategy.grouped_mm_usable(CPU, torch.bfloat16, LayerShape(E, K, H, INTER)), reason="this torch has no CPU _grouped_mm")
@pytest.mark.parametrize("kind", ["uniform", "skewed", "elsewhere"])
@pytest.mark.parametrize("num_tokens", [0, 1, 13, 37])
def test_grouped_mm_equals_loop_in_bf16(num_tokens, kind):
    x, routing, w13, w2 = problem(num_tokens, kind, seed=num_tokens, dtype=torch.bfloat16)
    out = ex.GroupedMMExecutor(reference_moe_ops())(x, routing, w13, w2)
    torch.testing.assert_close(out.float(), ex.LoopExecutor()(x, routing, w13, w2).float(), atol=2e-2, rtol=2e-2)


def test_hybrid_picks_by_token_count():
    masked, contiguous = ex.MaskedExecutor(reference_moe_ops()), ex.ContiguousExecutor(reference_moe_ops())
    hybrid = ex.HybridExecutor(masked, contiguous, max_masked_tokens=8)
    assert [hybrid.for_tokens(t) for t in (1, 8, 9, 4096)] == [masked, masked, contiguous, contiguous]
    assert hybrid.graph_safe and not ex.LoopExecutor.graph_safe and not ex.GroupedMMExecutor.graph_safe
    assert contiguous.for_tokens(1) is contiguous


def test_hybrid_largest_tier_runs_from_its_count_and_never_inside_a_capture():
    """Three tiers: masked, contiguous, then (where measured faster) a non-capturable one;
    inside a graph capture the contiguous tier takes the last tier's batches."""
    masked, contiguous, loop = ex.MaskedExecutor(reference_moe_ops()), ex.ContiguousExecutor(reference_moe_ops()), ex.LoopExecutor()
    hybrid = ex.HybridExecutor(masked, contiguous, 8, largest=loop, min_largest_tokens=100)
    assert [hybrid.for_tokens(t) for t in (1, 8, 9, 99, 100, 4096)] == [masked, masked, contiguous, contiguous, loop, loop]
    assert [hybrid.for_tokens(t, capturing=True) for t in (8, 99, 100, 4096)] == [masked, contiguous, contiguous, contiguous]
    assert hybrid.graph_safe  # every batch size has a capturable executor
    x, routing, w13, w2 = problem(13, "skewed", seed=3)
    torch.testing.assert_close(ex.HybridExecutor(masked, contiguous, 8, loop, 13)(x, routing, w13, w2), loop(x, routing, w13, w2))
    with pytest.raises(ValueError, match="go together"):
        ex.HybridExecutor(masked, contiguous, 8, largest=loop)
    with pytest.raises(ValueError, match="must exceed"):
        ex.HybridExecutor(masked, contiguous, 8, largest=loop, min_largest_tokens=8)


def test_for_graph_marks_the_warm_up_as_the_capture():
    """The engine's warm-up runs before a capture are marked (libs/model/graph_capture.py),
    so the hybrid compiles the tier the capture will record; nesting restores the mark."""
    from libs.model.graph_capture import for_graph

    cuda = torch.device("cuda")
    assert capturing_graph(CPU) is False
    with for_graph():
        assert capturing_graph(cuda) is True and capturing_graph(CPU) is False
        with for_graph():
            pass
        assert capturing_graph(cuda) is True
    if not torch.cuda.is_available():
        assert capturing_graph(cuda) is False


def test_grouped_mm_crossover_is_where_it_wins_from_then_on():
    from bench.moe_bench import grouped_mm_crossover

    # (contiguous ms, grouped_mm ms): grouped wins at 8 (noise), loses at 64, wins from 256 on
    times = {1: (1.0, 2.0), 8: (1.0, 0.5), 64: (1.0, 2.0), 256: (2.0, 1.5), 4096: (5.0, 4.0)}
    assert grouped_mm_crossover(times) == 256
    assert grouped_mm_crossover({1: (1.0, 0.5), 64: (2.0, 1.0)}) == 1
    assert grouped_mm_crossover({1: (1.0, 0.5), 64: (1.0, 2.0)}) == 65  # loses at the top: never


def test_bench_timer_falls_back_to_one_eager_call_where_it_cannot_replay_a_graph():
    """bench/moe_bench.py's ``calls_timer``: CUDA-graph replay over every routed input only
    on CUDA and for a capturable candidate; otherwise the first call alone, eagerly, and
    the result says so."""
    from bench.moe_bench import calls_timer

    counts = [0, 0]
    calls = [lambda: counts.__setitem__(0, counts[0] + 1), lambda: counts.__setitem__(1, counts[1] + 1)]
    for timing, capturable in (("graphs", True), ("graphs", False), ("eager", True)):
        counts[:] = [0, 0]
        ms, eagerly = calls_timer(CPU, timing, reps=3, warmup=2)(calls, capturable)
        assert eagerly and ms >= 0.0 and counts == [5, 0], (timing, capturable, counts)


# -- selection --------------------------------------------------------------------------------

SHAPE = LayerShape(E, K, H, INTER)


@pytest.mark.parametrize("device", [CPU, torch.device("cuda")], ids=["cpu", "cuda-absent"])
def test_auto_on_a_machine_without_a_gpu_is_the_loop(device):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    sel = select_executor("auto", device, torch.float32, SHAPE)
    assert sel.executor.name == "loop" and "no Triton-capable GPU" in sel.reason


@pytest.mark.parametrize("name", ["contiguous", "masked", "hybrid"])
def test_explicit_grouped_strategies_use_reference_kernels_off_cuda(name):
    sel = select_executor(name, CPU, torch.float32, SHAPE)
    assert sel.executor.name == name and "torch reference kernels" in sel.reason
    inner = sel.executor.small if name == "hybrid" else sel.executor
    assert inner.ops is reference_moe_ops()


def test_grouped_mm_falls_back_where_it_cannot_run():
    sel = select_executor("grouped_mm", CPU, torch.float32, SHAPE)  # needs bf16
    assert sel.executor.name == "loop" and sel.reason.startswith("grouped_mm unavailable")
    sel = select_executor("grouped_mm", torch.device("cuda"), torch.bfloat16, SHAPE)
    if not torch.cuda.is_available():
        assert sel.executor.name == "loop"
    odd = LayerShape(E, K, H + 1, INTER)  # rows not 16-byte aligned
    assert select_executor("grouped_mm", CPU, torch.bfloat16, odd).executor.name == "loop"
    with pytest.raises(ValueError, match="unknown moe_strategy"):
        select_executor("fastest", CPU, torch.float32, SHAPE)


def test_capability_checks_answer_false_instead_of_raising(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", boom)
    monkeypatch.setattr(torch.cuda, "get_device_name", boom)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", boom)
    cuda = torch.device("cuda")
    assert strategy.sm_version(cuda) is None
    assert strategy.triton_usable(cuda) is False
    assert capturing_graph(cuda) is False
    assert strategy.device_name(cuda) == "cuda"
    assert strategy.grouped_mm_usable(cuda, torch.bfloat16, SHAPE) is False
    assert select_executor("auto", cuda, torch.bfloat16, SHAPE).executor.name == "loop"
    strategy._grouped_mm_probe.cache_clear()
    monkeypatch.setattr(torch, "_grouped_mm", boom, raising=False)
    assert strategy.grouped_mm_usable(CPU, torch.bfloat16, SHAPE) is False
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert strategy.grouped_mm_usable(CPU, torch.bfloat16, SHAPE) is False
    strategy._grouped_mm_probe.cache_clear()
    monkeypatch.setattr(strategy, "_triton_importable", boom)
    assert strategy.triton_usable(cuda) is False


def test_hybrid_threshold_is_data(tmp_path):
    value, entry = strategy.hybrid_threshold(CPU, SHAPE)
    shipped = json.loads(strategy.THRESHOLDS_PATH.read_text())
    assert value == shipped["default"]["default"]["max_masked_tokens"] and entry["provisional"] is True
    table = {
        "default": {"default": {"max_masked_tokens": 64}},
        "cpu": {"default": {"max_masked_tokens": 7}, SHAPE.key(): {"max_masked_tokens": 33}},
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    assert strategy.hybrid_threshold(CPU, SHAPE, path)[0] == 33
    assert strategy.hybrid_threshold(CPU, LayerShape(8, 2, 64, 64), path)[0] == 7
    assert strategy.hybrid_threshold(torch.device("cuda"), SHAPE, path)[0] == 64


def _thresholds_file(tmp_path, monkeypatch, entry: dict):
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({"default": {"default": entry}}))
    monkeypatch.setattr(strategy, "THRESHOLDS_PATH", path)
    return path


@pytest.mark.skipif(not strategy.grouped_mm_usable(CPU, torch.bfloat16, SHAPE), reason="this torch has no CPU _grouped_mm")
def test_grouped_mm_competes_in_the_hybrid_as_measured_data(tmp_path, monkeypatch):
    """Where the benchmark found torch._grouped_mm faster on large batches ("large"), the
    hybrid runs it there, if it can run here; small batches stay masked (capturable)."""
    _thresholds_file(tmp_path, monkeypatch, {"max_masked_tokens": 4, "large": "grouped_mm"})
    sel = select_executor("hybrid", CPU, torch.bfloat16, SHAPE)
    assert sel.executor.for_tokens(4).name == "masked" and sel.executor.for_tokens(5).name == "grouped_mm"
    assert "grouped_mm above" in sel.reason
    x, routing, w13, w2 = problem(13, "skewed", seed=1, dtype=torch.bfloat16)
    torch.testing.assert_close(sel.executor(x, routing, w13, w2).float(), ex.LoopExecutor()(x, routing, w13, w2).float(), atol=2e-2, rtol=2e-2)
    assert sel.executor.for_tokens(5, capturing=True).name == "contiguous"  # grouped_mm is not capturable
    fp32 = select_executor("hybrid", CPU, torch.float32, SHAPE)  # grouped_mm cannot run fp32: contiguous
    assert fp32.executor.for_tokens(5).name == "contiguous"


@pytest.mark.skipif(not strategy.grouped_mm_usable(CPU, torch.bfloat16, SHAPE), reason="this torch has no CPU _grouped_mm")
def test_grouped_mm_starts_at_its_measured_crossover(tmp_path, monkeypatch):
    """``min_grouped_mm_tokens``: contiguous between the masked range and it."""
    _thresholds_file(tmp_path, monkeypatch, {"max_masked_tokens": 4, "large": "grouped_mm", "min_grouped_mm_tokens": 20})
    sel = select_executor("hybrid", CPU, torch.bfloat16, SHAPE)
    assert [sel.executor.for_tokens(t).name for t in (4, 5, 19, 20, 4096)] == ["masked", "contiguous", "contiguous", "grouped_mm", "grouped_mm"]
    assert "contiguous up to 19, grouped_mm from 20" in sel.reason


def test_graph_capture_refuses_a_non_capturable_executor(monkeypatch, tmp_path):
    from libs.model.config import ModelConfig, MoEConfig
    from libs.model.moe import MoEOptions
    from libs.model.moe import block as block_module

    cfg = ModelConfig(
        architecture="mixtral", vocab_size=10, hidden_size=H, intermediate_size=INTER, num_layers=1, num_heads=2,
        num_kv_heads=2, head_dim=16, max_position_embeddings=64, moe=MoEConfig(num_experts=E, top_k=K, intermediate_size=INTER),
    )
    moe_block = block_module.SparseMoeBlock(cfg, MoEOptions(strategy="loop"))
    for p in moe_block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, H)
    assert moe_block(x).shape == (3, H)
    monkeypatch.setattr(block_module, "capturing_graph", lambda device: True)
    with pytest.raises(RuntimeError, match="'loop'.*cannot be captured"):
        moe_block(x)
    moe_block.strategy, moe_block.selection = "contiguous", None
    assert moe_block(x).shape == (3, H)
    # A hybrid whose last tier cannot be captured runs that tier's batches on contiguous there.
    ops = reference_moe_ops()
    hybrid = ex.HybridExecutor(ex.MaskedExecutor(ops), ex.ContiguousExecutor(ops), 1, largest=ex.LoopExecutor(), min_largest_tokens=2)
    moe_block.strategy, moe_block.selection = "hybrid", strategy.Selection(hybrid, "hybrid", "test")
    assert moe_block(x).shape == (3, H)
    # A hybrid is judged by what it picks for the batch: masked decode captures even when
    # large batches would go to a non-capturable executor.
    moe_block.selection = block_module.Selection(
        ex.HybridExecutor(ex.MaskedExecutor(reference_moe_ops()), ex.LoopExecutor(), max_masked_tokens=3), "hybrid", "test",
    )
    assert moe_block(x).shape == (3, H)
    with pytest.raises(RuntimeError, match="'loop'"):
        moe_block(torch.randn(4, H))


def test_fp8_experts_take_their_own_crossover_not_the_bf16_one(tmp_path, monkeypatch):
    """The bf16 crossover sent 1-token FP8 layers to the masked FP8 GEMM, 4.5x slower than
    contiguous on the H100: FP8 uses ``fp8_max_masked_tokens`` where measured, else none."""
    _thresholds_file(tmp_path, monkeypatch, {"max_masked_tokens": 8, "large": "contiguous"})
    hybrid, reason = strategy._hybrid(CPU, torch.bfloat16, SHAPE, fp8=True)
    assert hybrid.for_tokens(1).name == "contiguous" and "FP8 crossover not measured" in reason
    assert strategy._hybrid(CPU, torch.bfloat16, SHAPE)[0].for_tokens(8).name == "masked"
    strategy._thresholds.cache_clear()  # the same path, new contents
    _thresholds_file(tmp_path, monkeypatch, {"max_masked_tokens": 8, "fp8_max_masked_tokens": 2, "large": "contiguous"})
    hybrid, _ = strategy._hybrid(CPU, torch.bfloat16, SHAPE, fp8=True)
    assert hybrid.for_tokens(2).name == "masked" and hybrid.for_tokens(3).name == "contiguous"
