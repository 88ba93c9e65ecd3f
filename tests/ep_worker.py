"""One rank of the expert-parallel tests (tests/unit/test_moe_ep.py with gloo on the CPU,
tests/gpu/test_moe_gpu.py with NCCL, one GPU per rank), run in its own process by
``torch.multiprocessing.spawn``; results are saved on the CPU with ``torch.save`` for the
parent to compare with EP=1. Each check runs with dense experts and with FP8 experts
(``Fp8Experts``, each rank holding its experts' e4m3 weights and scales)."""

from __future__ import annotations

from pathlib import Path

import torch

from libs.dist import ParallelLayout, init_parallel, shutdown_parallel
from libs.model.config import ModelConfig, MoEConfig
from libs.model.moe import MoEOptions
from libs.model.moe.block import SparseMoeBlock
from libs.model.moe.routing import Routing
from tests.moe_inputs import make_ids
from tests.ranks import start_rank

WORLD = 2
LAYER = ModelConfig(
    architecture="qwen3_moe", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=2, head_dim=16, max_position_embeddings=64,
    moe=MoEConfig(num_experts=8, top_k=3, intermediate_size=24, renormalize=True),
)
# (name, tokens on rank 0, tokens on rank 1, routing): rank 1 empty; rank 0's pairs all
# owned by rank 1 (so rank 0 receives nothing); random routing.
LAYER_CASES = [("rank1-empty", 13, 0, "uniform"), ("all-to-rank1", 7, 5, "rank1-experts"), ("uniform", 37, 11, "uniform")]


def layer_tokens(case: str, rank: int, seed: int = 0) -> tuple[torch.Tensor, Routing]:
    _, t0, t1, kind = next(c for c in LAYER_CASES if c[0] == case)
    n = (t0, t1)[rank]
    g = torch.Generator().manual_seed(seed + 100 * rank + len(case))
    x = torch.randn(n, LAYER.hidden_size, generator=g)
    if kind == "rank1-experts":
        ids = make_ids("uniform", n, 4, 3, seed) + 4  # experts 4..7 live on rank 1
    else:
        ids = make_ids(kind, n, 8, 3, seed + rank)
    return x, Routing(torch.rand(n, 3, generator=g), ids)


def full_block(strategy: str, device: torch.device | str = "cpu", fp8: bool = False) -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(LAYER, MoEOptions(strategy=strategy))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    block = block.to(device)
    if fp8:
        block.quantize_experts(torch.device(device))
    return block


def ep_block(full: SparseMoeBlock, strategy: str, group) -> SparseMoeBlock:
    block = SparseMoeBlock(LAYER, MoEOptions(strategy=strategy, ep=group))
    first, local = block.dispatch.first_expert, block.dispatch.num_local_experts
    device = full.gate.weight.device
    with torch.no_grad():
        block.gate.weight.copy_(full.gate.weight)
        if full.fp8:
            block.set_experts(full.w13.narrow_experts(first, local), full.w2.narrow_experts(first, local))
        else:
            block.w13.copy_(full.w13[first:first + local])
            block.w2.copy_(full.w2[first:first + local])
    return block.to(device)


def run(
    rank: int, port: int, model_folder: str, prompts: list[list[int]], n_greedy: int, out_dir: str,
    device_type: str = "cpu", strategies: tuple[str, ...] = ("loop", "contiguous", "masked"),
    fp8_strategies: tuple[str, ...] = ("contiguous", "masked"),
) -> None:
    device = start_rank(rank, device_type)
    groups = init_parallel(ParallelLayout(world_size=WORLD, ep_size=WORLD), rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=device)
    try:
        results: dict = {"ep_rank": groups.ep.rank, "ep_size": groups.ep.size}
        runs = [(s, False) for s in strategies] + [(s, True) for s in fp8_strategies]
        for strategy, fp8 in runs:
            block = ep_block(full_block(strategy, device, fp8), strategy, groups.ep)
            name = f"fp8-{strategy}" if fp8 else strategy
            results[f"local_experts_{name}"] = (block.dispatch.first_expert, block.w13.shape[0])
            results[f"dtype_{name}"] = block.w13.dtype
            for case, *_ in LAYER_CASES:
                x, routing = layer_tokens(case, rank)
                with torch.no_grad():
                    out = block.dispatch(x.to(device), Routing(*(t.to(device) for t in routing)), block.run_experts)
                results[f"layer/{name}/{case}"] = out.cpu()
        from libs.engine import EngineConfig, LLM, SamplingParams
        from libs.model import load_model
        from libs.model.attention import torch_backend

        loaded = load_model(model_folder, dtype=torch.float32, device=device, backend=torch_backend(), moe=MoEOptions(ep=groups.ep))
        # EP reads split sizes on the host at every layer: not capturable in a CUDA graph.
        engine = LLM(EngineConfig(device=str(device), dtype="float32", num_blocks=96, cuda_graphs=False), loaded=loaded)
        results["experts_stored"] = sum(layer.mlp.w13.shape[0] for layer in loaded.model.layers if hasattr(layer.mlp, "w13"))
        results["logits"] = [engine.first_step_logits(ids).cpu() for ids in prompts]
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n_greedy, ignore_eos=True))
        results["tokens"] = [o.token_ids for o in outs]
        if fp8_strategies:
            del engine, loaded
            loaded = load_model(model_folder, dtype=torch.float32, device=device, backend=torch_backend(), moe=MoEOptions(ep=groups.ep), quantization="fp8")
            engine = LLM(EngineConfig(device=str(device), dtype="float32", num_blocks=96, cuda_graphs=False), loaded=loaded)
            blocks = [layer.mlp for layer in loaded.model.layers if hasattr(layer.mlp, "w13")]
            results["fp8_experts"] = [(b.w13.dtype, b.w13.shape[0], b.w13.q.shape[0]) for b in blocks]
            results["fp8_logits"] = [engine.first_step_logits(ids).cpu() for ids in prompts]
            outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n_greedy, ignore_eos=True))
            results["fp8_tokens"] = [o.token_ids for o in outs]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown_parallel()
