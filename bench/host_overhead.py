"""CPU: where a decode step's host time goes, phase by phase.

The engine times its own phases (libs/engine/step_timer.py): schedule, prepare (apply
the scheduler's changes to the persistent batch, lay out the inputs), launch (hand the
device work over; on the CPU without async scheduling the forward and sampling run right
there), sample (wait for and read the sampled ids), output (append, stop checks, request
outputs); and the time spent in the model forward. On the CPU the forward is the model's
compute, so the host overhead of a step is ``step - forward``.

Three models, at batch 1 and 64: a near-zero-cost model (the tiny shape with a 512-token
vocabulary, so the forward and the vocabulary-wide sampling ops are cheap and the host
overhead shows), the tiny test model (49k vocabulary), and SmolLM2-135M's shape with
random weights. Medians over the measured steps, in microseconds.

The figures before the restructure were taken with an earlier version of this script
that wrapped the engine's methods from outside (bench/results/host_overhead_before.md).

    python -m bench.host_overhead [--steps 32] [--async-scheduling off] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the box is shared: never spin

import torch  # noqa: E402

from bench.common import random_loaded, table  # noqa: E402
from libs.engine import EngineConfig, LLM, SamplingParams  # noqa: E402
from libs.engine.step_timer import PHASES  # noqa: E402
from tests.models import tiny_loaded  # noqa: E402

NULL_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def start_decoding(eng: LLM, batch: int, max_tokens: int, prompt_len: int = 32, vocab: int = 400) -> None:
    """``batch`` greedy sequences, stepped until every one of them decodes."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, vocab, (prompt_len,), generator=g).tolist()
        eng.add_request(f"r{batch}-{i}", ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while eng.num_waiting or len(eng.scheduler.decoding) < batch:
        eng.step()


def decode_phases(loaded, batch: int, steps: int, **cfg) -> dict[str, float]:
    eng = LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=512, max_num_seqs=max(64, batch), **cfg), loaded=loaded)
    start_decoding(eng, batch, steps + 8)
    eng.phases.history = []
    for _ in range(steps):
        eng.step()
    history = eng.phases.history
    while eng.has_unfinished_requests():
        eng.step()
    eng.close()
    med = {k: statistics.median(h[k] for h in history) * 1e6 for k in (*PHASES, "forward", "step")}
    med["host"] = statistics.median(h["step"] - h["forward"] for h in history) * 1e6  # per step, then the median
    return med


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--async-scheduling", default="off", choices=("off", "on"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    models = {
        "null": lambda: random_loaded("smollm2-135m", cpu, torch.float32, **NULL_SHAPE),
        "tiny": tiny_loaded,
        "smollm2-135m": lambda: random_loaded("smollm2-135m", cpu, torch.float32),
    }
    res = {}
    for name, make in models.items():
        loaded = make()
        for batch in (1, 64):
            res[f"{name}/b{batch}"] = decode_phases(loaded, batch, args.steps, async_scheduling=args.async_scheduling)
    rows = [
        [key, *(f"{m[p]:.0f}" for p in PHASES), f"{m['forward']:.0f}", f"{m['host']:.0f}", f"{m['step']:.0f}"]
        for key, m in res.items()
    ]
    print(
        f"\nCPU decode step, median us per phase ({args.steps} steps, {args.threads} thread(s), async scheduling "
        f"{args.async_scheduling}, torch {torch.__version__})\n"
    )
    print(table(["model/batch", *PHASES, "forward", "host (step - forward)", "step"], rows))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
