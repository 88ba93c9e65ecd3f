"""CPU: where a decode step's host time goes, phase by phase (baseline instrumentation).

Each step is split into schedule, prepare (plan + input tensors), forward (the model),
sample (sampler launch + the host read of the ids) and output (everything else in
``step()``: appending tokens, stop checks, request outputs). On the CPU the forward is the
model's compute, so the host overhead is the sum of the other phases; the engine is run
with a near-zero-cost model (the tiny shape with a 512-token vocabulary), the tiny test
model, and SmolLM2-135M's shape (random weights), at batch 1 and 64.

This version times the phases by wrapping the engine's methods from outside (the engine
had no phase timer yet). Medians over the measured steps, in microseconds.

    python -m bench.host_overhead [--steps 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the box is shared: never spin

import torch  # noqa: E402

from bench.common import random_loaded, table
from libs.engine import EngineConfig, LLM, SamplingParams
import libs.engine.engine as engine_mod
from tests.models import tiny_loaded

NULL_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PHASES = ("schedule", "prepare", "forward", "sample", "output")


class Phases:
    """Per-step phase times, collected by wrapping the engine's methods."""

    def __init__(self, eng: LLM):
        self.steps: list[dict[str, float]] = []
        self._cur: dict[str, float] = defaultdict(float)
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(eng, "_inputs_for", "prepare")
        self._wrap(eng.runner, "forward", "forward")
        self._wrap(eng.runner, "sample", "sample")
        self._wrap(eng.runner.sampler, "collect", "sample")
        plan_cls = engine_mod.StepPlan
        phases = self

        class TimedPlan(plan_cls):  # type: ignore[misc, valid-type]
            @classmethod
            def from_schedule(cls, *a, **k):
                t = time.perf_counter()
                try:
                    return plan_cls.from_schedule(*a, **k)
                finally:
                    phases._cur["prepare"] += time.perf_counter() - t

        engine_mod.StepPlan = TimedPlan
        step = eng.step

        def timed_step():
            self._cur = defaultdict(float)
            t = time.perf_counter()
            out = step()
            total = time.perf_counter() - t
            self._cur["output"] = total - sum(self._cur[p] for p in PHASES if p != "output")
            self._cur["total"] = total
            self.steps.append(dict(self._cur))
            return out

        eng.step = timed_step

    def _wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._cur[phase] += time.perf_counter() - t

        setattr(obj, name, timed)

    def medians(self) -> dict[str, float]:
        return {p: statistics.median(s[p] for s in self.steps) * 1e6 for p in (*PHASES, "total")}


def decode_phases(loaded, batch: int, steps: int, **cfg) -> dict[str, float]:
    eng = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=4096, max_num_seqs=max(64, batch), **cfg), loaded=loaded)
    phases = Phases(eng)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, 400, (32,), generator=g).tolist()
        eng.add_request(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while eng.num_waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    phases.steps.clear()
    for _ in range(steps):
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    eng.close()
    return phases.medians()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    models = {
        # Near-zero-cost model: the tiny shape with a 512-token vocabulary, so the forward
        # and the vocabulary-wide sampling ops are cheap and the host overhead shows.
        "null": random_loaded("smollm2-135m", cpu, torch.float32, **NULL_SHAPE),
        "tiny": tiny_loaded(),
        "smollm2-135m": random_loaded("smollm2-135m", cpu, torch.float32),
    }
    res = {}
    for name, loaded in models.items():
        for batch in (1, 64):
            res[f"{name}/b{batch}"] = decode_phases(loaded, batch, args.steps)
    rows = []
    for key, m in res.items():
        host = sum(m[p] for p in PHASES if p != "forward")
        rows.append([key, *(f"{m[p]:.0f}" for p in PHASES), f"{host:.0f}", f"{m['total']:.0f}"])
    print(f"\nCPU decode step, median us per phase ({args.steps} steps, {args.threads} threads, torch {torch.__version__})\n")
    print(table(["model/batch", *PHASES, "host (all but forward)", "step"], rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
