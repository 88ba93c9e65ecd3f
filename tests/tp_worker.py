"""One rank of the model-level tensor-parallel tests (tests/unit/test_tp_model.py with gloo on
the CPU, tests/gpu/test_tp_gpu.py with NCCL, one GPU per rank), run in its own process by
``torch.multiprocessing.spawn``.

Every rank loads only its shard and runs its own engine on the same prompts: the engines
schedule identically, so their forwards (and the collectives inside) pair up, and each
rank's greedy tokens come from the all-gathered logits. That checks the sharded model by
itself; the instance (rank 0 scheduling and broadcasting, tests/unit/test_tp_engine.py)
is tested on top of it. ``cuda_graphs`` (on a GPU) captures the forwards, the collectives
inside them, or leaves them eager; ``all_reduce`` is the group's (libs/dist/one_shot.py).
Results are saved with ``torch.save`` for the parent to compare with TP=1.

``all_reduce_rank`` is one rank of the one-shot all-reduce's GPU test."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.ranks import start_rank


def run(
    rank: int, world: int, port: int, model: str, prompts: list[list[int]], n_greedy: int, out_dir: str, device_type: str = "cpu",
    dtype: str = "float32", cuda_graphs: bool = True, all_reduce: str = "nccl",
) -> None:
    device = start_rank(rank, device_type)
    from libs.dist import ParallelLayout, init_parallel, shutdown_parallel
    from libs.engine import LLM, EngineConfig, SamplingParams
    from libs.model import load_model, make_backend

    groups = init_parallel(
        ParallelLayout(world_size=world, tp_size=world), rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=device, timeout_s=120,
        all_reduce=all_reduce,
    )
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
            "one_shot": groups.tp.one_shot is not None,
            "logits": [engine.first_step_logits(ids).cpu() for ids in prompts],
        }
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n_greedy, ignore_eos=True))
        results["tokens"] = [o.token_ids for o in outs]
        engine.close()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown_parallel()


def all_reduce_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """The TP group's ``all_reduce`` with the one-shot against NCCL's ``dist.all_reduce`` on
    the same values: bf16 and float32, sizes the one-shot takes and one it leaves to NCCL,
    launched eagerly and replayed from a CUDA graph with new values. Saves what it saw."""
    import torch.distributed as dist

    device = start_rank(rank, "cuda")
    from libs.dist import ParallelLayout, init_parallel, shutdown_parallel
    from libs.dist.one_shot import ONE_SHOT_MAX_BYTES

    groups = init_parallel(
        ParallelLayout(world_size=world, tp_size=world), rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=device, timeout_s=60,
        all_reduce="one_shot",
    )
    tp, seen = groups.tp, []
    gen = torch.Generator(device=device).manual_seed(7 + rank)  # every rank its own values
    try:
        for dtype in (torch.bfloat16, torch.float32):
            too_big = ONE_SHOT_MAX_BYTES // (384 * dtype.itemsize) + 1  # rows of 384 just past the one-shot's buffer
            for rows in (1, 7, 64, too_big):
                x = torch.randn(rows, 384, device=device, dtype=dtype, generator=gen)
                ref, before = x.clone(), x.clone()
                dist.all_reduce(ref, group=tp.handle)
                got = tp.all_reduce(x)
                one_shot = got.data_ptr() != x.data_ptr()  # the one-shot answers in a new tensor, NCCL in place
                seen.append({"dtype": str(dtype), "rows": rows, "one_shot": one_shot, "diff": float((got - ref).abs().max()),
                             "input_kept": bool(torch.equal(x, before)) if one_shot else None})
        # Captured in a graph (as a decode step runs it), replayed on new values.
        x = torch.zeros(16, 384, device=device, dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tp.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = tp.all_reduce(x)
        for _ in range(3):
            x.copy_(torch.randn(x.shape, device=device, dtype=x.dtype, generator=gen))
            ref = x.clone()
            dist.all_reduce(ref, group=tp.handle)
            graph.replay()
            seen.append({"dtype": "graph", "rows": 16, "one_shot": True, "diff": float((y - ref).abs().max()), "input_kept": None})
        graph.reset()
        torch.save(seen, Path(out_dir) / f"rank{rank}.pt")
    finally:
        shutdown_parallel()
