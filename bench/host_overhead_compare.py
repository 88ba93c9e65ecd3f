"""CPU: a decode step's host overhead, this tree against an earlier revision, same run.

The earlier revision is extracted with ``git archive`` into a temporary folder and both
trees run the same measurement in their own processes, alternating (before, after,
before, after, ...), so a shared, noisy machine weighs on both alike. Host overhead is
``step time - model forward time`` per step (the forward is the model's compute on the
CPU; everything else is the host's), median over the measured steps, then median over
repetitions. ``--clock thread`` times with the engine thread's CPU time instead of the
wall clock (one torch thread, so the forward runs on that thread too): what a loaded
machine adds is waiting for a core, which that clock leaves out. A tree whose engine has a phase timer (``LLMEngine.phases``) reports it; an
older one is timed by wrapping its methods (``Phases`` of its bench/host_overhead.py).

    python -m bench.host_overhead_compare --before 44893c3 [--clock thread] [--reps 3] [--steps 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import table

ROOT = Path(__file__).resolve().parents[1]
CASES = [("null", 1), ("null", 64), ("tiny", 1), ("tiny", 64), ("smollm2-135m", 1), ("smollm2-135m", 64)]


def _child(steps: int, cases: list, clock: str) -> None:
    """Runs inside a tree (its ``libs`` and ``bench``), prints one JSON line per case."""
    import gc
    import json
    import statistics
    import time

    if clock == "thread":  # every phase timer in both trees reads perf_counter
        time.perf_counter = time.thread_time

    import torch

    import bench.host_overhead as ho
    from bench.common import random_loaded
    from libs.engine import EngineConfig, LLM, SamplingParams
    from tests.models import tiny_loaded

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    null = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    makers = {"null": lambda: random_loaded("smollm2-135m", cpu, torch.float32, **null), "tiny": tiny_loaded,
              "smollm2-135m": lambda: random_loaded("smollm2-135m", cpu, torch.float32)}
    loaded = {}
    for name, batch in cases:
        if name not in loaded:
            loaded[name] = makers[name]()
        eng = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=512, max_num_seqs=64), loaded=loaded[name])
        new = hasattr(eng, "phases")
        wrapped = None if new else ho.Phases(eng)
        g = torch.Generator().manual_seed(batch)
        for i in range(batch):
            ids = torch.randint(10, 400, (32,), generator=g).tolist()
            eng.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
        def running():
            r = eng.scheduler.running
            return r.values() if isinstance(r, dict) else r

        while eng.num_waiting or any(s.num_output_tokens == 0 for s in running()):
            eng.step()
        if new:
            eng.phases.history = []
        else:
            wrapped.steps.clear()
        for _ in range(steps):
            eng.step()
        if new:
            hist = [(h["step"], h["forward"]) for h in eng.phases.history]
        else:
            hist = [(h["total"], h["forward"]) for h in wrapped.steps]
        while eng.has_unfinished_requests():
            eng.step()
        eng.close()
        del eng
        gc.collect()  # one engine's KV cache at a time
        host = statistics.median(s - f for s, f in hist) * 1e6
        step = statistics.median(s for s, _ in hist) * 1e6
        print(json.dumps({"case": f"{name}/b{batch}", "host_us": host, "step_us": step}), flush=True)


def run_tree(tree: Path, steps: int, clock: str) -> dict[str, dict]:
    code = inspect.getsource(_child) + f"\n_child({steps}, {CASES!r}, {clock!r})\n"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="git revision to compare with")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the engine thread's CPU time (time.thread_time), robust to a loaded machine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.reps):
            runs["before"].append(run_tree(old, args.steps, args.clock))
            runs["after"].append(run_tree(ROOT, args.steps, args.clock))
    res = {}
    for name, batch in CASES:
        case = f"{name}/b{batch}"
        med = {side: {k: statistics.median(r[case][k] for r in runs[side]) for k in ("host_us", "step_us")} for side in runs}
        res[case] = {**{f"{side}_{k}": v for side, m in med.items() for k, v in m.items()}, "host_ratio": med["before"]["host_us"] / med["after"]["host_us"]}
    rows = [[c, f"{r['before_host_us']:.0f}", f"{r['after_host_us']:.0f}", f"{r['host_ratio']:.2f}x", f"{r['before_step_us']:.0f}", f"{r['after_step_us']:.0f}"] for c, r in res.items()]
    print(f"\nCPU decode step host overhead (step - forward), median us ({args.clock} clock), {args.reps} alternating reps of {args.steps} steps, before = {args.before}\n")
    print(table(["model/batch", "host before", "host after", "before / after", "step before", "step after"], rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"before": args.before, "reps": args.reps, "steps": args.steps, "results": res, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
