"""Where an eager prefill step's host time goes on a GPU (issue 10).

On the H100 a 16 x 1024-token prefill that ran eagerly (larger than the biggest prefill
graph then captured) spent 31.9 ms launching 340 kernels whose GPU time is 12.8 ms in one
run (bench/results/gpu_profile_h100_r7_prefill.txt) and 19 ms wall in another engine.
This times that step, SmolLM2 shape, random bf16 weights, for engines with prefill graphs
up to 8192 tokens, 16384 (the default since) and none, each with Python's garbage
collector on and frozen, and reports per configuration:

- the wall time of the batch and the host phases of its step (``launch`` is the eager
  forward's launching);
- the CUDA caching allocator's device allocations, frees and retries during the batch
  (``torch.cuda.memory_stats``: a step that calls cudaMalloc/cudaFree synchronises);
- the host operations that took the time (torch profiler, CPU side, by self time);
- every operation that made the host wait for the GPU during one batch
  (``torch.cuda.set_sync_debug_mode("warn")``), with where it was called.

    python -m bench.prefill_host [--reps 3]

What it found (H100, bench/results/prefill_host_h100.txt): no allocator traffic, no
synchronisation, GC not the cause; the eager step is host-bound (launch 17-21 ms, of
which the torch ops are 8 ms and the rest Python and Triton's launcher), its graph
launches in 1.3 ms.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import random_loaded, table
from bench.gpu_engine import engine, prefill_batch, random_prompts

STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def batch(eng, g: torch.Generator) -> dict:
    prompts = random_prompts(eng, [1024] * 16, g)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    eng.phases.history = []
    t = time.perf_counter()
    prefill_batch(eng, prompts)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    history, eng.phases.history = eng.phases.history, None
    after = torch.cuda.memory_stats()
    out = {"wall_ms": wall * 1e3, "launch_ms": sum(h["launch"] for h in history) * 1e3,
           "schedule_prepare_ms": sum(h["schedule"] + h["prepare"] for h in history) * 1e3, "steps": len(history)}
    out.update({k: after.get(k, 0) - before.get(k, 0) for k in STATS})
    return out


def syncs(eng, g: torch.Generator) -> str:
    """The host-device synchronisations of one batch, counted by message and call site."""
    import warnings
    from collections import Counter

    seen: Counter = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            batch(eng, g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        seen[f"{str(w.message)[:80]} at {w.filename}:{w.lineno}"] += 1
    return "synchronising operations (count, what, where):\n" + "\n".join(f"{n:5d}  {k}" for k, n in seen.most_common(20))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    loaded = random_loaded("smollm2-135m", dev, torch.bfloat16)
    rows, profiles = [], []
    for graphs in (8192, 16384, 0):
        eng = engine(loaded, async_scheduling="on", prefill_graph_max_tokens=graphs)
        g = torch.Generator().manual_seed(graphs)
        for _ in range(2):
            batch(eng, g)
        for frozen in (False, True):
            if frozen:
                gc.collect()
                gc.freeze()
                gc.disable()
            try:
                runs = [batch(eng, g) for _ in range(args.reps)]
            finally:
                if frozen:
                    gc.enable()
                    gc.unfreeze()
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append([graphs, "frozen" if frozen else "on", f"{med['wall_ms']:.2f}", f"{med['launch_ms']:.2f}",
                         f"{med['schedule_prepare_ms']:.2f}", med["steps"], *(f"{med[k]:.0f}" for k in STATS)])
            print(rows[-1], flush=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            batch(eng, g)
        profiles.append((graphs, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)))
        profiles.append((graphs, syncs(eng, g)))
        eng.close()
    print(f"\n{torch.cuda.get_device_name()}: 16 x 1024 prefill, medians of {args.reps}\n")
    print(table(["prefill graphs up to", "GC", "wall ms", "launch ms", "schedule+prepare ms", "steps", *STATS], rows))
    for graphs, text in profiles:
        print(f"\n## host operations, prefill graphs up to {graphs} (one batch, GC on)\n\n{text}")


if __name__ == "__main__":
    main()
