"""One rank of the model-level tensor-parallel tests (tests/unit/test_tp_model.py with gloo on
the CPU, tests/gpu/test_tp_gpu.py with NCCL, one GPU per rank), run in its own process by
``torch.multiprocessing.spawn``.

Every rank loads only its shard and runs its own engine on the same prompts: the engines
schedule identically, so their forwards (and the collectives inside) pair up, and each
rank's greedy tokens come from the all-gathered logits. That checks the sharded model by
itself; the instance (rank 0 scheduling and broadcasting, tests/unit/test_tp_engine.py)
is tested on top of it. ``cuda_graphs`` (on a GPU) captures the forwards, the collectives
inside them, or leaves them eager. Results are saved with ``torch.save`` for the parent to
compare with TP=1."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ranks import start_rank


def run(
    rank: int, world: int, port: int, model: str, prompts: list[list[int]], n_greedy: int, out_dir: str, device_type: str = "cpu",
    dtype: str = "float32", cuda_graphs: bool = True,
) -> None:
    device = start_rank(rank, device_type)
    from libs.dist import ParallelLayout, init_parallel, shutdown_parallel
    from libs.engine import LLM, EngineConfig, SamplingParams
    from libs.model import load_model, make_backend

    groups = init_parallel(ParallelLayout(world_size=world, tp_size=world), rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=device, timeout_s=120)
    try:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        loaded = load_model(model, dtype=torch_dtype, device=device, backend=make_backend("auto", device), tp=groups.tp)
        engine = LLM(EngineConfig(device=str(device), dtype=dtype, num_blocks=96, cuda_graphs=cuda_graphs and device.type == "cuda"), loaded=loaded)
        m = loaded.model
        results = {
            "kv_heads": m.kv_heads,
            "kv_written": m.kv_written,
            "cache_heads": engine.runner.cache.shape[4],
            "num_heads": m.layers[0].self_attn.num_heads,
            "params": sum(p.numel() for p in m.parameters()),
            "logits": [engine.first_step_logits(ids).cpu() for ids in prompts],
        }
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n_greedy, ignore_eos=True))
        results["tokens"] = [o.token_ids for o in outs]
        engine.close()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown_parallel()
