"""Expert parallelism: dispatch and combine time, and one MoE layer's scaling from EP=1 to EP=2.

Two processes, one GPU each, NCCL (``--toy``: gloo on the CPU with small shapes, to check
the script). Each rank holds half the experts of a layer (random bf16 weights: Qwen3-30B-A3B,
128 experts top-8, and Mixtral-8x7B, 8 experts top-2) and routes its own ``T`` tokens
(a random router's top-k, or FakeBalanceExpert). Per ``T``, medians of ``--reps``, both
ranks in lockstep (a barrier and a device sync around every timed call):

- dispatch: counts exchange + all-to-all of rows and local ids (``ExpertParallelDispatch.dispatch``);
- experts: this rank's executor on what it received (``auto``: the hybrid on CUDA);
- combine: all-to-all back + weighted sum (``ExpertParallelDispatch.combine``);
- layer: the three together, as the model runs them;
- EP=1: rank 0 alone with every expert on ``2T`` tokens (both ranks' worth), the same executor.

``scaling = EP=1 time for 2T tokens / EP=2 layer time`` (2.0 would be perfect: two GPUs, twice
the tokens, the same time). The slowest rank's time is what a step waits for.

GPU (two of them): ``python -m bench.moe_ep_bench --out bench/results/moe_ep_h200x2.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import table  # noqa: E402
from bench.moe_bench import SHAPES, TOY_SHAPES, Layer, timer  # noqa: E402
from libs.dist import ParallelLayout, init_parallel, shutdown_parallel  # noqa: E402
from libs.model.moe.dispatch import ExpertParallelDispatch  # noqa: E402
from libs.model.moe.routing import Routing  # noqa: E402
from libs.model.moe.strategy import LayerShape, device_name, select_executor  # noqa: E402

WORLD = 2
TOKENS = [1, 64, 256, 4096]
TOY_TOKENS = [1, 16, 64]


def _rank(rank: int, port: int, shapes: dict[str, LayerShape], tokens: list[int], routings: list[str], reps: int, warmup: int, out: str, device_type: str) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = init_parallel(ParallelLayout(WORLD, WORLD), rank=rank, init_method=f"tcp://127.0.0.1:{port}", device=device)
    base = timer(device, reps, warmup)

    def time_ms(fn):  # both ranks start together, and a call ends when its device work does
        def synced():
            dist.barrier()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return base(synced)

    rows = []
    try:
        for name, shape in shapes.items():
            layer = Layer(shape, device)  # the full layer, same seed on both ranks
            ep = ExpertParallelDispatch(groups.ep, shape.num_experts)
            lo, n = ep.first_expert, ep.num_local_experts
            w13, w2 = layer.w13[lo:lo + n].contiguous(), layer.w2[lo:lo + n].contiguous()
            local_shape = LayerShape(n, shape.top_k, shape.hidden, shape.intermediate)
            executor = select_executor("auto", device, torch.bfloat16, local_shape).executor
            full = select_executor("auto", device, torch.bfloat16, shape).executor
            run = lambda x, r: executor(x, r, w13, w2)  # noqa: E731
            for routing in routings:
                for t in tokens:
                    x, r = layer.inputs(t, routing, seed=1 + rank, offset=lo)
                    d = ep.dispatch(x, r)
                    y = run(d.rows, d.routing)
                    row = {
                        "shape": name, "routing": routing, "tokens_per_rank": t, "rank": rank, "received_rows": d.rows.shape[0],
                        "dispatch": time_ms(lambda: ep.dispatch(x, r)),
                        "experts": time_ms(lambda: run(d.rows, d.routing)),
                        "combine": time_ms(lambda: ep.combine(y, d, r.weights)),
                        "layer": time_ms(lambda: ep(x, r, run)),
                    }
                    if rank == 0:  # EP=1: every expert on one device, both ranks' tokens
                        x2, r2 = layer.inputs(2 * t, routing, seed=99)
                        row["ep1_2T"] = base(lambda: full(x2, Routing(r2.weights, r2.ids), layer.w13, layer.w2))
                    dist.barrier()
                    rows.append(row)
        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            Path(out).write_text(json.dumps([r for per_rank in gathered for r in per_rank]))
    finally:
        shutdown_parallel()


def summarize(rows: list[dict]) -> list[list[object]]:
    out = []
    keys = sorted({(r["shape"], r["routing"], r["tokens_per_rank"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        per_rank = [r for r in rows if (r["shape"], r["routing"], r["tokens_per_rank"]) == key]
        slowest = {p: max(r[p] for r in per_rank) for p in ("dispatch", "experts", "combine", "layer")}
        ep1 = next(r["ep1_2T"] for r in per_rank if r["rank"] == 0)
        out.append([
            *key, "/".join(str(r["received_rows"]) for r in sorted(per_rank, key=lambda r: r["rank"])),
            *(f"{slowest[p]:.3f}" for p in ("dispatch", "experts", "combine", "layer")),
            f"{ep1:.3f}", f"{ep1 / slowest['layer']:.2f}x",
        ])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--toy", action="store_true", help="gloo on the CPU, small shapes: checks the script")
    p.add_argument("--shapes", default=None)
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated")
    p.add_argument("--routing", default="topk,balanced")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device_type = "cpu" if args.toy else "cuda"
    if device_type == "cuda" and torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} GPUs (or --toy for the CPU)", file=sys.stderr)
        return 2
    shapes = TOY_SHAPES if args.toy else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (TOY_TOKENS if args.toy else TOKENS)
    from services.launch.processes import free_port

    raw = Path(args.out or "/tmp/moe_ep_bench_raw.json").with_suffix(".raw.json")
    mp.spawn(_rank, args=(free_port(), shapes, tokens, args.routing.split(","), args.reps, args.warmup, str(raw), device_type), nprocs=WORLD, join=True)
    rows = json.loads(raw.read_text())
    md = table(
        ["shape", "routing", "tokens/rank", "rows received (rank 0/1)", "dispatch ms", "experts ms", "combine ms", "EP=2 layer ms", "EP=1 layer ms (2T tokens)", "scaling"],
        summarize(rows),
    )
    print(md)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dev = device_name(torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu"))
        meta = {"device": f"{WORLD} x {dev}", "date": str(datetime.date.today()), "commit": commit, "torch": torch.__version__, "command": " ".join(sys.argv)}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "markdown": md}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
