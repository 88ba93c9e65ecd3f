"""Async scheduling against synchronous scheduling: decode ms/step at batch 1, 8 and 64.

Both modes run the same engine on the same weights in the same process, alternating
(sync, async, sync, async, ...) so a noisy shared machine affects both alike; each
figure is the median over repetitions of a steady-state decode window (prefill
excluded). The ratio is sync / async: above 1 means async scheduling is faster.

Models: the tiny test model and, on the CPU, the real SmolLM2-135M (its GGUF, float32);
on CUDA, SmolLM2-135M's shape with random bf16 weights. This is what decides where
``async_scheduling="auto"`` turns it on (libs/engine/config.py).

    python -m bench.async_scheduling [--device cpu] [--threads 1] [--reps 3] [--quick] [--out results.json]

``--quick`` halves the measured steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the box is shared: never spin

import torch  # noqa: E402

from bench.common import random_loaded, table  # noqa: E402
from bench.host_overhead import start_decoding  # noqa: E402
from libs.engine import EngineConfig, LLM  # noqa: E402
from libs.model import load_model, make_backend  # noqa: E402
from tests.models import tiny_loaded  # noqa: E402

BATCHES = (1, 8, 64)


def make_engine(loaded, device: torch.device, mode: str) -> LLM:
    cfg = dict(device=device.type, dtype="float32" if device.type == "cpu" else "bfloat16", num_blocks=1024 if device.type == "cpu" else 4096, max_num_seqs=64)
    if device.type == "cuda":
        cfg["prefill_graph_max_tokens"] = 2048  # the prompts here: at most 64 x 32 tokens
    return LLM(EngineConfig(**cfg, async_scheduling=mode), loaded=loaded)


def ms_per_step(eng: LLM, device: torch.device, batch: int, steps: int) -> float:
    """Steady-state decode ms/step of ``batch`` sequences; ``eng`` is drained afterwards."""
    start_decoding(eng, batch, steps + 4)
    for _ in range(2):
        eng.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = (time.perf_counter() - t) / steps
    while eng.has_unfinished_requests():
        eng.step()
    return dt * 1e3


def measure(loaded, device: torch.device, steps: dict[int, int], reps: int, progress=None, *, keep: bool | None = None) -> dict:
    """Alternating sync and async runs at each batch size. ``keep`` (the default on CUDA):
    both engines stay up for the whole model (graph capture costs seconds per engine);
    otherwise (the shared CPU box) one engine's KV cache at a time, a fresh engine a run."""
    keep = device.type == "cuda" if keep is None else keep
    engines: dict[str, LLM] = {}
    out = {}
    try:
        for batch in BATCHES:
            times = {"off": [], "on": []}
            for _ in range(reps):
                for mode in ("off", "on"):
                    eng = engines.get(mode) or make_engine(loaded, device, mode)
                    times[mode].append(ms_per_step(eng, device, batch, steps[batch]))
                    if keep:
                        engines[mode] = eng
                    else:
                        eng.close()
                        del eng
                        gc.collect()
                    if progress is not None:
                        progress.update(1)
            sync, asyn = statistics.median(times["off"]), statistics.median(times["on"])
            out[f"b{batch}"] = {"sync_ms": sync, "async_ms": asyn, "sync_over_async": sync / asyn, "runs": times}
    finally:
        for eng in engines.values():
            eng.close()
    return out


# The tiny test model's shape (tests/models.py), for CUDA as random bf16 weights built on
# the device: a lent GPU machine has no GGUF for tiny_loaded's tokenizer.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def models(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "tiny (random, bf16)": lambda: random_loaded("smollm2-135m", device, torch.bfloat16, **TINY_SHAPE),
            "smollm2-135m (random, bf16)": lambda: random_loaded("smollm2-135m", device, torch.bfloat16),
        }
    return {
        "tiny": tiny_loaded,
        "smollm2-135m (GGUF, fp32)": lambda: load_model(None, dtype=torch.float32, device=device, backend=make_backend("auto", device)),
    }


def run(device: torch.device, reps: int, quick: bool = False, progress=None) -> dict:
    res = {}
    for name, make in models(device).items():
        loaded = make()
        big = "smollm2" in name and device.type == "cpu"
        steps = {1: 16 if big else 64, 8: 12 if big else 48, 64: 6 if big else 24}
        if quick:
            steps = {b: max(4, s // 2) for b, s in steps.items()}
        res[name] = measure(loaded, device, steps, reps, progress)
    return res


def print_table(res: dict, header: str) -> None:
    rows = []
    for name, by_batch in res.items():
        for b, m in by_batch.items():
            rows.append([name, b, f"{m['sync_ms']:.3f}", f"{m['async_ms']:.3f}", f"{m['sync_over_async']:.2f}x"])
    print(header)
    print(table(["model", "batch", "sync ms/step", "async ms/step", "sync / async"], rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="half the measured steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    res = run(device, args.reps, quick=args.quick)
    print_table(res, f"\ndecode, sync vs async scheduling, {device}, {args.threads} thread(s), median of {args.reps}, torch {torch.__version__}\n")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(device), "threads": args.threads, "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
