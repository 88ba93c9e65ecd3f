"""FP8 MoE experts on CUDA: the block-scaled Triton grouped GEMMs at real layer shapes
against the torch reference on the same GPU, the FP8 executors against the reference
executor and against bf16 experts, CUDA-graph capture of the FP8 hybrid, and the engine
on a tiny Qwen3-MoE with ``quantization="fp8"`` (Triton FP8 experts under CUDA graphs).

Needs FP8 tensor cores (SM 8.9+) for the Triton path; elsewhere it checks that the
selection falls back to the references and skips the rest.

Layer shapes (random weights, quantized at load like a bf16 checkpoint's): Mixtral-8x7B
(8 experts, top-2, hidden 4096, intermediate 14336) and Qwen3-30B-A3B (128 experts, top-8,
hidden 2048, intermediate 768). Token counts: 1, 13, 64 and 1031.

Tolerances: kernel and reference read the same e4m3 operands and scales and accumulate in
fp32; the kernel sums each 128-block's MMA partial then scales it, the reference sums
dequantized products, so they differ by fp32 summation order, then both round once to
bf16: within 1% of the output's norm, as the bf16 grouped GEMMs' GPU test. FP8 against
bf16 experts: e4m3's error on both operands of two chained GEMMs (about 5% rms a GEMM,
see tests/unit/test_moe_models.py): within 15% of the output's norm.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

triton = pytest.importorskip("triton")

from kernels.fp8 import fp8_gemm_supported  # noqa: E402
from kernels.fp8 import reference as fp8_ref  # noqa: E402
from kernels.fp8 import triton_quant  # noqa: E402
from kernels.moe.gemm import reference as gemm_ref  # noqa: E402
from kernels.moe.gemm import triton_gemm as gemm_tri  # noqa: E402
from kernels.moe.scatter import reference as scatter_ref  # noqa: E402
from kernels.moe.select import reference_moe_ops  # noqa: E402
from libs.model.fp8 import Fp8Experts  # noqa: E402
from libs.model.graph_capture import for_graph  # noqa: E402
from libs.model.moe import executors as ex  # noqa: E402
from libs.model.moe.strategy import select_executor  # noqa: E402
from tests.gpu.test_moe_gpu import SHAPES, TOKENS, random_layer, rel_err, routed_tokens  # noqa: E402

CUDA = torch.device("cuda")
FP8_GPU = fp8_gemm_supported(CUDA)
needs_fp8 = pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores (SM 8.9+)")


@pytest.fixture(scope="module", params=list(SHAPES))
def layer(request):
    shape = SHAPES[request.param]
    w13, w2, gate = random_layer(shape)
    return shape, w13, w2, Fp8Experts.quantize(w13, parts=2), Fp8Experts.quantize(w2), gate


def routed(layer, num_tokens: int, seed: int = 1):
    shape, *_, gate = layer
    return routed_tokens(shape, gate, num_tokens, seed)


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused_silu"])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_fp8_grouped_gemms_equal_reference(layer, num_tokens, fuse):
    shape, _, _, q13, q2, _ = layer
    w, n = (q13, shape.intermediate) if fuse else (q2, shape.hidden)
    x, routing = routed(layer, num_tokens)
    # plain: the down projection's input, [T, I] (fused: gate/up's, [T, H])
    a = x if fuse else torch.randn(num_tokens, shape.intermediate, device=CUDA).bfloat16()
    lay = scatter_ref.scatter_contiguous(a, routing.ids, shape.num_experts, 64)
    used = lay.m_indices >= 0
    a_q, a_s = triton_quant.per_token_group_quant(lay.x)
    r_q, r_s = fp8_ref.per_token_group_quant(lay.x)
    assert torch.equal(a_q[used].view(torch.uint8), r_q[used].view(torch.uint8)) and torch.equal(a_s[used], r_s[used])
    ref = gemm_ref.grouped_gemm_contiguous_fp8(a_q, a_s, w.q, w.scale, lay.m_indices, 64, n=n, fuse_silu_and_mul=fuse, out_dtype=torch.bfloat16)
    tri = gemm_tri.grouped_gemm_contiguous_fp8(a_q, a_s, w.q, w.scale, lay.m_indices, 64, n=n, fuse_silu_and_mul=fuse, out_dtype=torch.bfloat16)
    assert rel_err(tri[used], ref[used]) < 1e-2
    masked = scatter_ref.scatter_masked(a, routing.ids, shape.num_experts)
    e, max_m, k = masked.x.shape
    m_q, m_s = triton_quant.per_token_group_quant(masked.x.reshape(e * max_m, k))
    m_q, m_s = m_q.view(e, max_m, -1), m_s.view(e, max_m, -1)
    ref = gemm_ref.grouped_gemm_masked_fp8(m_q, m_s, w.q, w.scale, masked.counts, n=n, fuse_silu_and_mul=fuse, out_dtype=torch.bfloat16)
    tri = gemm_tri.grouped_gemm_masked_fp8(m_q, m_s, w.q, w.scale, masked.counts, n=n, fuse_silu_and_mul=fuse, out_dtype=torch.bfloat16)
    raw = gemm_tri.grouped_gemm_masked_fp8(masked.x, None, w.q, w.scale, masked.counts, n=n, fuse_silu_and_mul=fuse, out_dtype=torch.bfloat16)
    for i, c in enumerate(masked.counts.tolist()):
        if c:
            assert rel_err(tri[i, :c], ref[i, :c]) < 1e-2
            assert torch.equal(raw[i, :c], tri[i, :c])  # quantized inside the GEMM: the same bits


@pytest.mark.parametrize("name", ["auto", "contiguous", "masked", "hybrid"])
@pytest.mark.parametrize("num_tokens", [0, *TOKENS])
def test_fp8_executors_equal_reference_and_stay_near_bf16(layer, name, num_tokens):
    shape, w13, w2, q13, q2, _ = layer
    sel = select_executor(name, CUDA, torch.bfloat16, shape, fp8=True)
    if not FP8_GPU:
        assert "reference FP8" in sel.reason or "SM 8.9" in sel.reason
        pytest.skip(sel.reason)
    assert "Triton FP8" in sel.reason and sel.executor.runs_fp8
    x, routing = routed(layer, num_tokens)
    out = sel.executor(x, routing, q13, q2)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    if num_tokens:
        assert rel_err(out, ex.ContiguousExecutor(reference_moe_ops())(x, routing, q13, q2)) < 2e-2
        assert rel_err(out, ex.LoopExecutor()(x, routing, w13, w2)) < 0.15


@needs_fp8
@pytest.mark.parametrize("num_tokens", [1, 13, 128])
def test_fp8_hybrid_is_captured_in_a_cuda_graph(layer, num_tokens):
    shape, _, _, q13, q2, _ = layer
    sel = select_executor("auto", CUDA, torch.bfloat16, shape, fp8=True)
    assert sel.executor.name == "hybrid"
    captured = sel.executor.for_tokens(num_tokens, capturing=True)  # the tier a capture runs
    assert captured.graph_safe
    x, routing = routed(layer, num_tokens)
    static_x, static_w, static_ids = x.clone(), routing.weights.clone(), routing.ids.clone()
    run = lambda: sel.executor(static_x, type(routing)(static_w, static_ids), q13, q2)  # noqa: E731
    with for_graph():  # the engine's warm-up: compiles the tier the capture records
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x2, routing2 = routed(layer, num_tokens, seed=7)
    static_x.copy_(x2)
    static_w.copy_(routing2.weights)
    static_ids.copy_(routing2.ids)
    graph.replay()
    torch.testing.assert_close(out, captured(x2, routing2, q13, q2), atol=0, rtol=0)


@needs_fp8
def test_engine_runs_fp8_experts_under_cuda_graphs(tmp_path_factory):
    from libs.engine import LLM, EngineConfig, SamplingParams
    from tests.checkpoints import save_tokenizer, write_checkpoint
    from tests.models import RAW_PROMPTS, hf_gguf_tokenizer
    from tests.unit.test_moe_models import CASES

    folder = tmp_path_factory.mktemp("qwen3_moe_fp8")
    write_checkpoint(*CASES["qwen3_moe"], folder, save_tokenizer(tmp_path_factory.mktemp("tok")))

    def engine(**kw):
        return LLM(EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", num_blocks=256, max_num_seqs=16, **kw))

    fp8, bf16 = engine(quantization="fp8"), engine()
    block = fp8.loaded.model.layers[0].mlp
    assert block.w13.q.dtype == torch.float8_e4m3fn and block.w13.q.device.type == "cuda"
    tok = hf_gguf_tokenizer()
    prompts = [[int(t) for t in tok.encode(p, add_special_tokens=False)] for p in RAW_PROMPTS[:4]]
    rel = sorted(rel_err(fp8.first_step_logits(ids), bf16.first_step_logits(ids)) for ids in prompts)
    assert rel[len(rel) // 2] < 0.25  # the bound of tests/unit/test_moe_models.py
    assert "Triton FP8" in block.selection.reason
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphs = fp8.generate(prompts, params)
    assert fp8.runner.graphs.replays["decode"] > 0
    eager = engine(quantization="fp8", cuda_graphs=False).generate(prompts, params)
    assert [r.token_ids for r in graphs] == [r.token_ids for r in eager]
