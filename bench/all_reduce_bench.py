"""The TP group's all-reduce by message size: the one-shot over symmetric memory
(libs/dist/one_shot.py) against NCCL, in one run, on the GPUs of one host.

Each rank is a process on its own GPU, joined through ``libs.dist.init_parallel`` with
``all_reduce="one_shot"``. For every size (bf16 rows of ``--hidden`` values: a decode
step's batch sizes, then prefill's token counts) it times ``dist.all_reduce`` (NCCL) and
the one-shot:

- eagerly: ``--iters`` launches back to back, timed with CUDA events;
- in a CUDA graph: ``--per-graph`` all-reduces captured once, replayed ``--replays``
  times (how a decode step runs them).

It also checks the one-shot's sum against NCCL's. Rank 0 prints a table (µs per
all-reduce, one-shot / NCCL) and writes the JSON. The one-shot's buffer is ``--max-bytes``
here (64 MiB), past the engine's ``ONE_SHOT_MAX_BYTES`` (libs/dist/one_shot.py), which
is the largest size where it won in graphs.

    python -m bench.all_reduce_bench --out bench/results/all_reduce_h200x2.json   # two GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import git_commit, table, write_json

ROWS = (1, 4, 16, 64, 128, 256, 1024, 4096, 8192)


def timed(fn, iters: int) -> float:
    """Seconds per call of ``fn`` (already warm), by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def graphed(op, x: torch.Tensor, per_graph: int, replays: int) -> float:
    """Seconds per all-reduce, ``per_graph`` of them captured in one graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            op(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            op(x)
    graph.replay()
    seconds = timed(graph.replay, replays) / per_graph
    graph.reset()
    return seconds


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from libs.dist import ParallelLayout, init_parallel, shutdown_parallel

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    from libs.dist.one_shot import attach

    groups = init_parallel(ParallelLayout(world_size=world, tp_size=world), rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=device)
    tp = groups.tp
    attach(tp, device, required=True, max_bytes=args.max_bytes)  # past the default, to find where NCCL wins
    nccl = lambda x: dist.all_reduce(x, group=tp.handle)  # noqa: E731
    rows = []
    try:
        for n in args.rows:
            gen = torch.Generator(device=device).manual_seed(1000 * n + rank)
            x = torch.randn(n, args.hidden, device=device, dtype=torch.bfloat16, generator=gen)
            one_shot = tp.one_shot.fits(x)
            row = {"rows": n, "bytes": x.numel() * x.element_size(), "one_shot_fits": one_shot}
            if one_shot:  # the one-shot's sum against NCCL's, before NCCL's timing sums x in place
                ref = x.clone()
                dist.all_reduce(ref, group=tp.handle)
                got = tp.one_shot(x)
                row["max_abs_diff"] = float((got.float() - ref.float()).abs().max())
            xn = x.clone()
            row["nccl_eager_us"] = timed(lambda: nccl(xn), args.iters) * 1e6 if n <= 256 else None
            row["nccl_graph_us"] = graphed(nccl, xn, args.per_graph, args.replays) * 1e6
            if one_shot:
                row["one_shot_eager_us"] = timed(lambda: tp.one_shot(x), args.iters) * 1e6 if n <= 256 else None
                row["one_shot_graph_us"] = graphed(tp.one_shot, x, args.per_graph, args.replays) * 1e6
            rows.append(row)
            dist.barrier(group=tp.control_handle)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        shutdown_parallel()


def report(res: dict) -> str:
    f = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
    out = []
    for r in res["rows"]:
        g = r.get("one_shot_graph_us")
        out.append([r["rows"], f"{r['bytes'] / 1024:,.0f}", f(r["nccl_eager_us"]), f(r.get("one_shot_eager_us")), f(r["nccl_graph_us"]), f(g),
                    f"{g / r['nccl_graph_us']:.2f}x" if g else "(NCCL only)", "" if g is None else f"{r['max_abs_diff']:.1e}"])
    head = f"{res['world']} x {res['device']}, torch {res['torch']}, bf16 rows of {res['hidden']}, µs per all-reduce"
    return head + "\n\n" + table(["rows", "KiB", "NCCL eager", "one-shot eager", "NCCL graph", "one-shot graph", "one-shot / NCCL (graph)", "max |diff|"], out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=3584, help="values per row (Qwen2.5-7B's hidden size)")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=list(ROWS))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--per-graph", type=int, default=56, help="all-reduces per graph (a 28-layer model's decode step)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--max-bytes", type=int, default=64 << 20, help="the one-shot's buffer (the engine's default is ONE_SHOT_MAX_BYTES)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} GPUs; this machine has {torch.cuda.device_count()}")
    from services.launch.processes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        mp.spawn(rank_main, args=(args.world, free_port(), args, path), nprocs=args.world, join=True)
        rows = json.loads(Path(path).read_text())
    res = {"device": torch.cuda.get_device_name(), "world": args.world, "hidden": args.hidden, "torch": torch.__version__,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(), "rows": rows,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    print(report(res))
    write_json(res, args.out and str(args.out))
    return res


if __name__ == "__main__":
    main()
