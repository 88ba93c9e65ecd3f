"""MoE expert executors against their peers, one MoE layer (router excluded), bf16.

Layer shapes with random weights: Mixtral-8x7B (8 experts, top-2, hidden 4096,
intermediate 14336) and Qwen3-30B-A3B (128 experts, top-8, hidden 2048, intermediate
768); token counts 1, 8, 64, 256 (decode) and 4096, 16384 (prefill); routing from a
random router's top-k (skewed, as real routing is) and from FakeBalanceExpert (balanced).
In the same run, on the same inputs:

- ours: contiguous, masked and hybrid (libs/model/moe/executors.py; Triton on CUDA);
- a per-expert loop of torch matmuls (``LoopExecutor``);
- ``torch._grouped_mm`` on our contiguous layout, where it runs;
- the dense FLOP-equivalent: the same ``6 * T * k * H * I`` FLOPs as two plain matmuls
  (``[T*k, H] x [H, 2I]`` and ``[T*k, I] x [I, H]``), the measured bf16 matmul rate.

Each candidate's output is checked against the loop's before it is timed. Reported per
row: ms, TFLOP/s, the hybrid's speed relative to the best other candidate (goal >= 1) and
to the dense rate (goal >= 0.6 at prefill sizes).

``--write-thresholds`` first times masked against contiguous on a finer token grid, and
contiguous against ``torch._grouped_mm`` on that grid and at 4096 and 16384 tokens, and
writes the crossover (the largest count where masked is not slower), the faster
large-batch executor and, where that is grouped_mm, the count from which it wins per GPU
and layer shape into libs/model/moe/hybrid_thresholds.json, which the hybrid then uses.

Timing (``--timing``, shared with bench/moe_fp8_bench.py). ``graphs``, the default on
CUDA: a candidate that can be captured (``graph_safe``) is replayed from a CUDA graph
(bench/gpu_timing.py), as the engine's decode and prefill graphs run the experts, over
``ROUTINGS`` inputs routed differently and used in turn (one call's experts are then not
still in L2 for the next); one that cannot (the torch loop and ``torch._grouped_mm``'s
executor read group sizes on the host) is timed eagerly and named in the row's ``eager``.
The masked/contiguous crossover is measured from graphs, and contiguous against
``torch._grouped_mm`` eagerly on both sides (that executor only ever serves eager
batches). ``eager``: one call between two CUDA events, the Python launches included: at
decode sizes mostly the host, which is how the thresholds up to 2026-11-28 were measured.

GPU: ``python -m bench.moe_bench --out bench/results/moe_bench_h100.json``.
CPU check of the script (toy shapes, torch reference kernels): ``python -m bench.moe_bench --toy``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import table  # noqa: E402
from bench.gpu_timing import graph_ms  # noqa: E402
from bench.swap_bench import median_ms  # noqa: E402
from libs.model.moe import executors as ex  # noqa: E402
from libs.model.moe import strategy  # noqa: E402
from libs.model.moe.routing import FakeBalanceExpert, Routing, select_topk  # noqa: E402
from libs.model.moe.strategy import LayerShape, device_name, select_executor  # noqa: E402

SHAPES = {
    "mixtral-8x7b": LayerShape(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "qwen3-30b-a3b": LayerShape(num_experts=128, top_k=8, hidden=2048, intermediate=768),
}
TOY_SHAPES = {
    "toy-mixtral": LayerShape(num_experts=8, top_k=2, hidden=128, intermediate=256),
    "toy-qwen3": LayerShape(num_experts=16, top_k=4, hidden=64, intermediate=64),
}
TOKENS = [1, 8, 64, 256, 4096, 16384]
TOY_TOKENS = [1, 8, 64, 256]
THRESHOLD_TOKENS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
LARGE_TOKENS = [4096, 16384]  # where the large-batch executor is chosen
OURS = ("contiguous", "masked", "hybrid")
ROUTINGS = 4  # differently routed inputs per token count, used in turn under --timing graphs


def timer(device: torch.device, reps: int, warmup: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of ``fn``: CUDA events on a GPU (bench/swap_bench.py's), perf_counter elsewhere."""
    if device.type == "cuda":
        return lambda fn: median_ms(fn, reps, warmup)

    def cpu(fn):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    return cpu


CallsTimer = Callable[[list[Callable[[], object]], bool], tuple[float, bool]]


def calls_timer(device: torch.device, timing: str, reps: int, warmup: int) -> CallsTimer:
    """``(ms per call, timed eagerly)`` of a list of calls (one per routed input): replayed
    from a CUDA graph with ``timing == "graphs"`` where ``capturable``, else the first call
    alone, eagerly (``timer``)."""
    eager = timer(device, reps, warmup)

    def time_calls(calls: list[Callable[[], object]], capturable: bool) -> tuple[float, bool]:
        if timing == "graphs" and device.type == "cuda" and capturable:
            return graph_ms(calls, min_calls=max(24, len(calls)), reps=reps), False
        return eager(calls[0]), True

    return time_calls


class Layer:
    """Random bf16 weights of one shape, and routed inputs of any size."""

    def __init__(self, shape: LayerShape, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        h, i, e = shape.hidden, shape.intermediate, shape.num_experts
        self.shape, self.device = shape, device
        self.w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).bfloat16()
        self.w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).bfloat16()
        self.gate = (torch.randn(e, h, generator=g, device=device) / h**0.5).bfloat16()

    def routed(self, num_tokens: int, routing: str, count: int) -> list[tuple[torch.Tensor, Routing]]:
        """``count`` inputs of ``num_tokens`` tokens, routed differently (seeds apart)."""
        return [self.inputs(num_tokens, routing, seed=1 + 1000 * i) for i in range(count)]

    def inputs(self, num_tokens: int, routing: str, seed: int = 1, offset: int = 0) -> tuple[torch.Tensor, Routing]:
        """``offset``: FakeBalanceExpert's start (an EP rank starts on its own experts)."""
        g = torch.Generator(device=self.device).manual_seed(seed + num_tokens)
        x = torch.randn(num_tokens, self.shape.hidden, generator=g, device=self.device).bfloat16()
        r = select_topk(x @ self.gate.T, self.shape.top_k, renormalize=True)
        return x, FakeBalanceExpert(self.shape.num_experts, offset)(r) if routing == "balanced" else r

    def dense(self, num_tokens: int) -> Callable[[], object]:
        """Two plain matmuls with the layer's FLOPs (one expert's weights, T*k rows)."""
        rows = num_tokens * self.shape.top_k
        a = torch.randn(rows, self.shape.hidden, device=self.device).bfloat16()
        b = torch.randn(rows, self.shape.intermediate, device=self.device).bfloat16()
        w13, w2 = self.w13[0].T, self.w2[0].T
        return lambda: (a @ w13, b @ w2)


def candidates(layer: Layer) -> dict[str, ex.ExpertExecutor | None]:
    dtype, device, shape = torch.bfloat16, layer.device, layer.shape
    out: dict[str, ex.ExpertExecutor | None] = {name: select_executor(name, device, dtype, shape).executor for name in OURS}
    out["torch loop"] = ex.LoopExecutor()
    gm = select_executor("grouped_mm", device, dtype, shape)
    out["torch._grouped_mm"] = gm.executor if gm.executor.name == "grouped_mm" else None
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-9)).item()


def measure_thresholds(shapes: dict[str, LayerShape], device: torch.device, time_calls: CallsTimer, routings: int,
                       tokens: list[int], large_tokens: list[int]) -> dict:
    """Masked vs contiguous on a fine grid (from graphs where ``time_calls`` replays them);
    the crossover per shape, and the timings. Contiguous vs ``torch._grouped_mm`` eagerly."""
    out = {}
    for name, shape in shapes.items():
        layer = Layer(shape, device)
        cand = candidates(layer)

        def timed(executor: ex.ExpertExecutor, inputs: list, capturable: bool) -> float:
            return time_calls([lambda x=x, r=r: executor(x, r, layer.w13, layer.w2) for x, r in inputs], capturable)[0]

        rows, crossover, masked_wins = {}, 0, True
        for t in tokens:
            inputs = layer.routed(t, "topk", routings)
            masked, contiguous = timed(cand["masked"], inputs, True), timed(cand["contiguous"], inputs, True)
            rows[t] = (masked, contiguous)
            masked_wins = masked_wins and masked <= contiguous  # the crossover ends the masked range
            if masked_wins:
                crossover = t
        large = {}  # contiguous against torch._grouped_mm on every count, where it runs; both eager
        if cand["torch._grouped_mm"] is not None:
            for t in [*tokens, *large_tokens]:
                inputs = layer.routed(t, "topk", 1)
                large[t] = (timed(cand["contiguous"], inputs, False), timed(cand["torch._grouped_mm"], inputs, False))
        top = {t: large[t] for t in large_tokens if t in large}
        wins = bool(top) and sum(g for _, g in top.values()) < sum(c for c, _ in top.values())
        out[shape.key()] = {
            "name": name, "max_masked_tokens": crossover, "ms_masked_contiguous": rows,
            "large": "grouped_mm" if wins else "contiguous", "ms_contiguous_grouped_mm": large,
        }
        if wins:
            out[shape.key()]["min_grouped_mm_tokens"] = max(grouped_mm_crossover(large), crossover + 1)
        tiers = f"contiguous, grouped_mm from {out[shape.key()]['min_grouped_mm_tokens']}" if wins else "contiguous"
        print(f"threshold {name}: masked up to {crossover} tokens, then {tiers}", flush=True)
    return out


def grouped_mm_crossover(times: dict[int, tuple[float, float]]) -> int:
    """The smallest measured token count from which ``torch._grouped_mm`` was faster than
    contiguous at that count and every larger one (``times``: count -> (contiguous ms,
    grouped_mm ms)); past the largest count if it never was at the top."""
    start = max(times) + 1
    for t in sorted(times, reverse=True):
        contiguous, grouped = times[t]
        if grouped >= contiguous:
            break
        start = t
    return start


def write_thresholds(measured: dict, device: torch.device, commit: str, path: Path = strategy.THRESHOLDS_PATH, timing: str = "graphs") -> None:
    table_ = json.loads(path.read_text())
    entries = table_.setdefault(device_name(device), {})
    for key, m in measured.items():
        entries[key] = {
            "max_masked_tokens": m["max_masked_tokens"], "large": m["large"], "provisional": False,
            **({"min_grouped_mm_tokens": m["min_grouped_mm_tokens"]} if "min_grouped_mm_tokens" in m else {}),
            "source": f"bench/moe_bench.py --write-thresholds --timing {timing}, {datetime.date.today()}, commit {commit}, topk routing",
            "ms_masked_contiguous": {str(t): [round(a, 4), round(b, 4)] for t, (a, b) in m["ms_masked_contiguous"].items()},
            "ms_contiguous_grouped_mm": {str(t): [round(a, 4), round(b, 4)] for t, (a, b) in m["ms_contiguous_grouped_mm"].items()},
        }
    path.write_text(json.dumps(table_, indent=2) + "\n")
    strategy._thresholds.cache_clear()


def run(shapes: dict[str, LayerShape], tokens: list[int], routings: list[str], device: torch.device, time_calls: CallsTimer,
        inputs_per_count: int) -> list[dict]:
    results = []
    for name, shape in shapes.items():
        layer = Layer(shape, device)
        cand = candidates(layer)
        for routing in routings:
            for t in tokens:
                inputs = layer.routed(t, routing, inputs_per_count)
                x, r = inputs[0]
                ref = cand["torch loop"](x, r, layer.w13, layer.w2)
                row = {"shape": name, "routing": routing, "tokens": t, "flops": 6 * t * shape.top_k * shape.hidden * shape.intermediate,
                       "eager": []}
                for cname, executor in cand.items():
                    if executor is None:
                        row[cname] = None
                        continue
                    err = rel_err(executor(x, r, layer.w13, layer.w2), ref)
                    if err > 2e-2:
                        raise AssertionError(f"{cname} differs from the loop by {err:.3g} ({name}, {routing}, T={t})")
                    calls = [lambda xi=xi, ri=ri, e=executor: e(xi, ri, layer.w13, layer.w2) for xi, ri in inputs]
                    row[cname], eagerly = time_calls(calls, executor.graph_safe)
                    row["eager"] += [cname] if eagerly else []
                row["dense matmul"], _ = time_calls([layer.dense(t)], True)
                row["hybrid took"] = cand["hybrid"].for_tokens(t, capturing="hybrid" not in row["eager"] and device.type == "cuda").name
                results.append(row)
                print(json.dumps(row), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return results


def markdown(results: list[dict]) -> str:
    names = [*OURS, "torch loop", "torch._grouped_mm", "dense matmul"]
    rows = []
    for r in results:
        ms = {n: r[n] for n in names if r.get(n) is not None}
        others = [v for n, v in ms.items() if n not in ("hybrid", "dense matmul")]
        tflops = lambda v: r["flops"] / (v * 1e-3) / 1e12  # noqa: E731
        rows.append([
            r["shape"], r["routing"], r["tokens"], *[f"{ms[n]:.3f}" if n in ms else "n/a" for n in names],
            r.get("hybrid took", ""), f"{tflops(ms['hybrid']):.1f}", f"{min(others) / ms['hybrid']:.2f}x",
            f"{ms['dense matmul'] / ms['hybrid']:.2f}", ", ".join(r.get("eager", [])) or "none",
        ])
    headers = ["shape", "routing", "tokens", *[f"{n} ms" for n in names], "hybrid took", "hybrid TFLOP/s", "hybrid vs best other", "hybrid / dense rate",
               "timed eagerly"]
    return table(headers, rows)


def common_args(p: argparse.ArgumentParser) -> None:
    """The flags both MoE benches take (this one and moe_fp8_bench): grid, timing, output."""
    p.add_argument("--toy", action="store_true", help="small shapes and token counts (checks the script on a CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the shapes")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the rows and the machine's description as JSON")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--timing", choices=("graphs", "eager"), default="graphs",
                   help="CUDA-graph replay over differently routed inputs where capturable (the default), or one eager call between events")
    p.add_argument("--routings", type=int, default=ROUTINGS, help="routed inputs per token count, used in turn (graphs)")


def grid(args: argparse.Namespace, tokens: list[int], toy_tokens: list[int]) -> tuple[dict, list[int]]:
    """The shapes and token counts ``args`` select (``tokens``/``toy_tokens`` by default)."""
    shapes = TOY_SHAPES if args.toy else SHAPES
    if args.shapes:
        shapes = {k: v for k, v in shapes.items() if k in args.shapes.split(",")}
    counts = [int(t) for t in args.tokens.split(",")] if args.tokens else (toy_tokens if args.toy else tokens)
    return shapes, counts


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def report(args: argparse.Namespace, device: torch.device, commit: str, results: list[dict], md: str) -> None:
    """Print the table; write the rows and the run's description where ``args`` asks."""
    print(md)
    meta = {"device": device_name(device), "date": str(datetime.date.today()), "commit": commit, "torch": torch.__version__, "command": " ".join(sys.argv)}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(f"{json.dumps(meta)}\n\n{md}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(p)
    p.add_argument("--routing", default="topk,balanced", help="topk, balanced or both")
    p.add_argument("--write-thresholds", action="store_true", help="measure the hybrid's crossover first and store it")
    p.add_argument("--thresholds-path", type=Path, default=strategy.THRESHOLDS_PATH, help="where --write-thresholds writes (default: the file the hybrid reads)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes, tokens = grid(args, TOKENS, TOY_TOKENS)
    time_calls = calls_timer(device, args.timing, args.reps, args.warmup)
    commit = head_commit()
    if args.write_thresholds:
        if device.type != "cuda" and args.thresholds_path == strategy.THRESHOLDS_PATH:
            print("the shipped thresholds are a GPU's crossover: on the CPU, write elsewhere (--thresholds-path)", file=sys.stderr)
            return 2
        grids = (TOY_TOKENS, TOY_TOKENS[-1:]) if args.toy else (THRESHOLD_TOKENS, LARGE_TOKENS)
        measured = measure_thresholds(shapes, device, time_calls, args.routings, *grids)
        write_thresholds(measured, device, commit, args.thresholds_path, args.timing)
    results = run(shapes, tokens, args.routing.split(","), device, time_calls, args.routings)
    report(args, device, commit, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
