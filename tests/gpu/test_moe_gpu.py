"""MoE on CUDA: the Triton kernels and executors in bf16 at real layer shapes against the
torch references on the same GPU, CUDA-graph capture of the grouped executors, the engine
on a MoE checkpoint against transformers, and expert parallelism over NCCL (two GPUs).

Layer shapes (random weights): Mixtral-8x7B (8 experts, top-2, hidden 4096, intermediate
14336) and Qwen3-30B-A3B (128 experts, top-8, hidden 2048, intermediate 768). Token
counts: 1, 13 (prime), 64 and 1031 (past every tile), with real top-k routing from a
random router and with FakeBalanceExpert.

Tolerances: scatter is a copy (exact); the GEMMs accumulate in fp32 like torch and round
once to bf16, so they differ from torch by summation order: within two bf16 steps of the
output's scale; the executors chain two GEMMs, SwiGLU and the combine.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

triton = pytest.importorskip("triton")

from kernels.moe.gemm import reference as gemm_ref  # noqa: E402
from kernels.moe.gemm import triton_gemm as gemm_tri  # noqa: E402
from kernels.moe.scatter import reference as scatter_ref  # noqa: E402
from kernels.moe.scatter import triton_scatter as scatter_tri  # noqa: E402
from libs.model.graph_capture import for_graph  # noqa: E402
from libs.model.moe import executors as ex  # noqa: E402
from libs.model.moe import strategy  # noqa: E402
from libs.model.moe.routing import FakeBalanceExpert, select_topk  # noqa: E402
from libs.model.moe.strategy import LayerShape, select_executor  # noqa: E402

CUDA = torch.device("cuda")
MIXTRAL = LayerShape(num_experts=8, top_k=2, hidden=4096, intermediate=14336)
QWEN3 = LayerShape(num_experts=128, top_k=8, hidden=2048, intermediate=768)
SHAPES = {"mixtral": MIXTRAL, "qwen3": QWEN3}
TOKENS = [1, 13, 64, 1031]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def random_layer(shape: LayerShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w13, w2, gate)`` of one MoE layer of ``shape``: bf16, seeded, on the GPU."""
    g = torch.Generator(device=CUDA).manual_seed(0)
    w13 = (torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, generator=g, device=CUDA) / shape.hidden**0.5).bfloat16()
    w2 = (torch.randn(shape.num_experts, shape.hidden, shape.intermediate, generator=g, device=CUDA) / shape.intermediate**0.5).bfloat16()
    gate = (torch.randn(shape.num_experts, shape.hidden, generator=g, device=CUDA) / shape.hidden**0.5).bfloat16()
    return w13, w2, gate


def routed_tokens(shape: LayerShape, gate: torch.Tensor, num_tokens: int, seed: int = 1):
    """``num_tokens`` random bf16 rows and their top-k routing by ``gate``."""
    g = torch.Generator(device=CUDA).manual_seed(seed + num_tokens)
    x = torch.randn(num_tokens, shape.hidden, generator=g, device=CUDA).bfloat16()
    return x, select_topk(x @ gate.T, shape.top_k, renormalize=True)


@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request):
    shape = SHAPES[request.param]
    return (request.param, shape, *random_layer(shape))


def routed(layer, num_tokens: int, balanced: bool, seed: int = 1):
    _, shape, _, _, gate = layer
    x, routing = routed_tokens(shape, gate, num_tokens, seed)
    if balanced:
        routing = FakeBalanceExpert(shape.num_experts)(routing)
    return x, routing


@pytest.mark.parametrize("balanced", [False, True], ids=["topk", "fake_balance"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_scatter_and_combine_equal_reference(layer, num_tokens, balanced):
    _, shape, *_ = layer
    x, routing = routed(layer, num_tokens, balanced)
    for block_m in (64, 128):
        ref = scatter_ref.scatter_contiguous(x, routing.ids, shape.num_experts, block_m)
        tri = scatter_tri.scatter_contiguous(x, routing.ids, shape.num_experts, block_m)
        for name in ("m_indices", "dst", "counts", "seg_ends"):
            assert torch.equal(getattr(ref, name), getattr(tri, name)), name
        used = ref.m_indices >= 0
        assert torch.equal(ref.x[used], tri.x[used])
    ref_m = scatter_ref.scatter_masked(x, routing.ids, shape.num_experts)
    tri_m = scatter_tri.scatter_masked(x, routing.ids, shape.num_experts)
    assert torch.equal(ref_m.dst, tri_m.dst) and torch.equal(ref_m.counts, tri_m.counts)
    rows = ref_m.dst.flatten().long()
    assert torch.equal(ref_m.x.view(-1, shape.hidden)[rows], tri_m.x.view(-1, shape.hidden)[rows])
    y = torch.randn(ref.x.shape[0], shape.hidden, device=CUDA).bfloat16()
    torch.testing.assert_close(scatter_tri.combine(y, ref.dst, routing.weights), scatter_ref.combine(y, ref.dst, routing.weights), atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_silu"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_grouped_gemms_equal_reference(layer, num_tokens, fuse):
    _, shape, w13, _, _ = layer
    x, routing = routed(layer, num_tokens, balanced=False)
    w = w13  # [E, 2I, H]: fused, SwiGLU gives [.., I]; plain, [.., 2I]
    lay = scatter_ref.scatter_contiguous(x, routing.ids, shape.num_experts, 64)
    used = lay.m_indices >= 0
    ref = gemm_ref.grouped_gemm_contiguous(lay.x, w, lay.m_indices, 64, fuse)
    tri = gemm_tri.grouped_gemm_contiguous(lay.x, w, lay.m_indices, 64, fuse)
    assert rel_err(tri[used], ref[used]) < 1e-2
    masked = scatter_ref.scatter_masked(x, routing.ids, shape.num_experts)
    ref = gemm_ref.grouped_gemm_masked(masked.x, w, masked.counts, fuse)
    tri = gemm_tri.grouped_gemm_masked(masked.x, w, masked.counts, fuse)
    for e, c in enumerate(masked.counts.tolist()):
        if c:
            assert rel_err(tri[e, :c], ref[e, :c]) < 1e-2


@pytest.mark.parametrize("name", ["contiguous", "masked", "hybrid", "grouped_mm"])
@pytest.mark.parametrize("balanced", [False, True], ids=["topk", "fake_balance"])
@pytest.mark.parametrize("num_tokens", [0, *TOKENS])
def test_executors_equal_the_loop(layer, name, num_tokens, balanced):
    _, shape, w13, w2, _ = layer
    sel = select_executor(name, CUDA, torch.bfloat16, shape)
    if name == "grouped_mm" and sel.executor.name != "grouped_mm":
        pytest.skip(sel.reason)
    assert sel.executor.name == name
    assert name == "grouped_mm" or "Triton" in sel.reason
    x, routing = routed(layer, num_tokens, balanced)
    out = sel.executor(x, routing, w13, w2)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    if num_tokens:
        assert rel_err(out, ex.LoopExecutor()(x, routing, w13, w2)) < 2e-2


@pytest.mark.parametrize("num_tokens", [1, 13, 128])
def test_hybrid_is_captured_in_a_cuda_graph(layer, num_tokens):
    """Auto picks the hybrid on CUDA; its path for this size replays on new inputs."""
    _, shape, w13, w2, _ = layer
    sel = select_executor("auto", CUDA, torch.bfloat16, shape)
    assert sel.executor.name == "hybrid"
    captured = sel.executor.for_tokens(num_tokens, capturing=True)  # the tier a capture runs
    assert captured.graph_safe
    x, routing = routed(layer, num_tokens, balanced=False)
    static_x, static_w, static_ids = x.clone(), routing.weights.clone(), routing.ids.clone()
    run = lambda: sel.executor(static_x, type(routing)(static_w, static_ids), w13, w2)  # noqa: E731
    with for_graph():  # the engine's warm-up: compiles the tier the capture records
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x2, routing2 = routed(layer, num_tokens, balanced=False, seed=7)
    static_x.copy_(x2)
    static_w.copy_(routing2.weights)
    static_ids.copy_(routing2.ids)
    graph.replay()
    torch.testing.assert_close(out, captured(x2, routing2, w13, w2), atol=0, rtol=0)


def test_grouped_mm_capability_is_sm90():
    usable = strategy.grouped_mm_usable(CUDA, torch.bfloat16, QWEN3)
    if strategy.sm_version(CUDA) < (9, 0):
        assert not usable
        assert select_executor("grouped_mm", CUDA, torch.bfloat16, QWEN3).executor.name == "hybrid"
    else:
        assert usable == hasattr(torch, "_grouped_mm"), "an SM90 GPU whose torch has _grouped_mm must be able to run it"
    assert not strategy.grouped_mm_usable(CUDA, torch.float16, QWEN3)


# -- the engine on a MoE checkpoint ------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    from tests.checkpoints import save_tokenizer, write_checkpoint
    from tests.unit.test_moe_models import CASES

    folder = tmp_path_factory.mktemp("qwen3_moe")
    model = write_checkpoint(*CASES["qwen3_moe"], folder, save_tokenizer(tmp_path_factory.mktemp("tok")))
    return folder, model.cuda()


def _engine(folder, **kw):
    from libs.engine import EngineConfig, LLM

    return LLM(EngineConfig(**{"model": str(folder), "device": "cuda", "num_blocks": 256, "max_num_seqs": 16, **kw}))


def test_engine_on_cuda_matches_transformers(qwen3_moe):
    from tests.models import RAW_PROMPTS, hf_gguf_tokenizer

    folder, hf = qwen3_moe
    eng = _engine(folder, dtype="float32")
    assert eng.runner.graphs is not None
    block = eng.loaded.model.layers[0].mlp
    tok = hf_gguf_tokenizer()
    prompts = [[int(t) for t in tok.encode(p, add_special_tokens=False)] for p in RAW_PROMPTS[:4]]
    for ids in prompts[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device=CUDA)).logits[0, -1].float().cpu()
        assert (eng.first_step_logits(ids) - ref).abs().max().item() < 2e-3
    assert block.selection.executor.name == "hybrid"
    from libs.engine import SamplingParams

    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert eng.runner.graphs.replays["decode"] > 0
    for ids, r in zip(prompts, got):
        out, past, x = [], None, torch.tensor([ids], device=CUDA)
        with torch.no_grad():
            for _ in range(32):
                o = hf(input_ids=x, past_key_values=past, use_cache=True)
                past, t = o.past_key_values, int(o.logits[0, -1].argmax())
                out.append(t)
                x = torch.tensor([[t]], device=CUDA)
        assert r.token_ids == out


def test_engine_graphs_do_not_change_bf16_outputs(qwen3_moe):
    from libs.engine import SamplingParams
    from tests.models import RAW_PROMPTS, hf_gguf_tokenizer

    folder, _ = qwen3_moe
    tok = hf_gguf_tokenizer()
    prompts = [[int(t) for t in tok.encode(p, add_special_tokens=False)] for p in RAW_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = _engine(folder, dtype="bfloat16", cuda_graphs=False).generate(prompts, params)
    graphs = _engine(folder, dtype="bfloat16").generate(prompts, params)
    assert [r.token_ids for r in graphs] == [r.token_ids for r in eager]


def test_explicit_loop_strategy_refuses_graph_capture_clearly(qwen3_moe):
    folder, _ = qwen3_moe
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        _engine(folder, dtype="bfloat16", moe_strategy="loop")
    assert _engine(folder, dtype="bfloat16", moe_strategy="loop", cuda_graphs=False) is not None


# -- expert parallelism over NCCL ---------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_ep2_equals_ep1(tmp_path, qwen3_moe):
    import torch.multiprocessing as mp

    from services.launch.processes import free_port
    from tests import ep_worker
    from tests.models import RAW_PROMPTS, hf_gguf_tokenizer

    folder, _ = qwen3_moe
    tok = hf_gguf_tokenizer()
    prompts = [[int(t) for t in tok.encode(p, add_special_tokens=False)] for p in RAW_PROMPTS[:2]]
    mp.spawn(ep_worker.run, args=(free_port(), str(folder), prompts, 16, str(tmp_path), "cuda", ("contiguous", "masked", "hybrid")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, results in enumerate(ranks):
        for strategy_name in ("contiguous", "masked", "hybrid"):
            full = ep_worker.full_block(strategy_name, CUDA)
            for case, *_ in ep_worker.LAYER_CASES:
                x, routing = ep_worker.layer_tokens(case, rank)
                with torch.no_grad():
                    ref = full.dispatch(x.cuda(), type(routing)(*(t.cuda() for t in routing)), full.run_experts).cpu()
                torch.testing.assert_close(results[f"layer/{strategy_name}/{case}"], ref, atol=1e-5, rtol=1e-5)
    from libs.engine import SamplingParams

    ref_engine = _engine(folder, dtype="float32", cuda_graphs=False)
    ref_tokens = [o.token_ids for o in ref_engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    for results in ranks:
        assert results["tokens"] == ref_tokens
