"""How long a full garbage collection stops a worker's engine, before and after the startup
heap is frozen (issue 10: the GPU never waits for Python; services/common/gc_heap.py).

The collector holds the GIL while it runs, so the engine's step thread and the event loop
stop for it. This builds the engine a worker builds (on CUDA: SmolLM2-135M's shape with
random weights, bf16, CUDA graphs; elsewhere the embedded SmolLM2-135M on the CPU), runs a
short batch so that every lazily built structure exists, then times full collections
(``gc.collect()``, generation 2) in the same process: first with the heap as it is, then
after ``freeze_startup_heap`` (what services/common/runner.py does before a service's ready
line), each after one more batch served. The ratio is before / after.

    python -m bench.gc_pause [--reps 7] [--out bench/results/gc_pause.json]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from bench.common import git_commit, table, write_json
from libs.engine import LLM, SamplingParams
from services.common.gc_heap import freeze_startup_heap


def build() -> LLM:
    if torch.cuda.is_available():
        from bench.common import random_loaded
        from bench.gpu_engine import engine

        return engine(random_loaded("smollm2-135m", torch.device("cuda"), torch.bfloat16))
    return LLM()


def pauses_ms(reps: int) -> list[float]:
    """Full collections (generation 2), milliseconds each."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def serve_a_batch(eng: LLM) -> None:
    """What a worker does between two collections: requests come and go."""
    eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 8, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))


def measure(reps: int) -> dict:
    eng = build()
    serve_a_batch(eng)
    gc.unfreeze()
    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"}
    serve_a_batch(eng)
    res["tracked_before"] = len(gc.get_objects())
    res["full_before_ms"] = pauses_ms(reps)
    res["frozen_objects"] = freeze_startup_heap()
    serve_a_batch(eng)
    res["tracked_after"] = len(gc.get_objects())
    res["full_after_ms"] = pauses_ms(reps)
    gc.unfreeze()
    eng.close()
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = measure(args.reps)
    res.update(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=git_commit(), python=platform.python_version())
    before, after = statistics.median(res["full_before_ms"]), statistics.median(res["full_after_ms"])
    print(f"{res['device']}: {res['frozen_objects']:,} objects frozen at startup")
    print(table(
        ["heap", "tracked objects", "full collection, median (us)", "slowest (us)"],
        [["as it is", f"{res['tracked_before']:,}", f"{before * 1e3:.1f}", f"{max(res['full_before_ms']) * 1e3:.1f}"],
         ["startup heap frozen", f"{res['tracked_after']:,}", f"{after * 1e3:.1f}", f"{max(res['full_after_ms']) * 1e3:.1f}"]],
    ))
    res["before_over_after"] = before / after
    print(f"before / after: {res['before_over_after']:,.0f}x")
    write_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
