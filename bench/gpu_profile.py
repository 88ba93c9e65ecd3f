"""Where a step's GPU time goes: decode steps (batch 1 and 64) and one 16 x 1024-token
prefill step under the torch profiler, kernels grouped by what they do, per step. Used
to decide what to optimise (issue 10); prints tables.

    python -m bench.gpu_profile [--shape smollm2-135m] [--decode-batches 1,64] [--no-prefill] [--raw 25]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import random_loaded, table
from bench.gpu_engine import decode, engine, prefill_batch, random_prompts
from libs.engine import SamplingParams

GROUPS = (
    ("_prefill_kernel", "attention (prefill)"), ("decode_kernel", "attention (decode)"), ("_store_kv", "store_kv"),
    ("rms", "rms_norm"), ("rotary", "rotary"), ("rope", "rotary"), ("silu", "silu_and_mul"), ("gemv", "GEMV"),
    ("gemm", "GEMM"), ("sm90", "GEMM"), ("cutlass", "GEMM"), ("nvjet", "GEMM"), ("xmma", "GEMM"),
    ("embedding", "embedding"), ("argmax", "sampling"), ("sort", "sampling"), ("softmax", "sampling"),
    ("reduce", "reductions"), ("index", "indexing"), ("copy", "copies"), ("elementwise", "elementwise"),
)


def group(name: str) -> str:
    n = name.lower()
    for key, label in GROUPS:
        if key in n:
            return label
    return "other: " + name[:60]


def kernel_table(prof, per: int, raw: int) -> str:
    by = defaultdict(lambda: [0.0, 0])
    names = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" and dt:
            for d, key in ((by, group(e.key)), (names, e.key[:90])):
                d[key][0] += dt / per
                d[key][1] += e.count / per
            total += dt / per
    rows = sorted(([k, f"{v[0]:.1f}", f"{v[1]:.1f}", f"{100 * v[0] / total:.1f}%"] for k, v in by.items()), key=lambda r: -float(r[1]))
    out = f"GPU kernel time per step {total:.1f} us, {sum(v[1] for v in by.values()):.0f} kernels per step\n\n"
    out += table(["kernels", "GPU us/step", "launches/step", "share"], rows[:20])
    if raw:
        rows = sorted(([k, f"{v[0]:.1f}", f"{v[1]:.1f}"] for k, v in names.items()), key=lambda r: -float(r[1]))
        out += "\n\n" + table(["kernel", "GPU us/step", "launches/step"], rows[:raw])
    return out


def profile_decode(eng, batch: int, steps: int, raw: int) -> None:
    r = decode(eng, batch, 32)  # warm, and the step time without the profiler
    vocab = eng.vocab_size
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        eng.add_request(f"x{batch}-{i}-{time.monotonic_ns()}", torch.randint(0, vocab, (128,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    while eng.num_waiting or len(eng.scheduler.decoding) < batch:
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    print(f"\n## decode batch {batch}: {r['ms_per_step']:.3f} ms/step without the profiler, GPU idle {r['gpu_idle_fraction']}\n")
    print(kernel_table(prof, steps, raw))


def profile_prefill(eng, raw: int) -> None:
    """The kernels of one 16 x 1024 prefill, then where its wall time goes on the host:
    admission (``add_request``), each engine phase of its steps, and a cProfile of the
    engine's own functions (the GPU waits for all of this before the step's graph runs)."""
    import cProfile
    import io
    import pstats

    g = torch.Generator().manual_seed(3)
    host = {"add_request": 0.0}

    def step_batch():
        host["add_request"] = prefill_batch(eng, random_prompts(eng, [1024] * 16, g))

    step_batch()
    step_batch()
    torch.cuda.synchronize()
    t = time.perf_counter()
    step_batch()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_batch()
        torch.cuda.synchronize()
    print(f"\n## prefill 16x1024: wall {wall * 1e3:.2f} ms ({16384 / wall / 1e3:.0f}k tokens/s)\n")
    print(kernel_table(prof, 1, raw))
    eng.phases.history = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    step_batch()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    history, eng.phases.history = eng.phases.history, None
    rows = [["add_request x 16", f"{host['add_request'] * 1e3:.2f}"]]
    for i, h in enumerate(history):
        rows += [[f"step {i}: {k}", f"{h[k] * 1e3:.2f}"] for k in h]
    print(f"\nhost time of the prefill (wall {wall * 1e3:.2f} ms), ms\n")
    print(table(["part", "ms"], rows))
    pr = cProfile.Profile()
    pr.enable()
    step_batch()
    torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    print("\ncProfile of one prefill (by own time)\n" + out.getvalue())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--raw", type=int, default=25, help="also list this many kernels by name")
    ap.add_argument("--async-scheduling", default="on")
    args = ap.parse_args(argv)
    loaded = random_loaded(args.shape, torch.device("cuda"), torch.bfloat16)
    eng = engine(loaded, async_scheduling=args.async_scheduling)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.shape}, bf16, async scheduling {args.async_scheduling}")
    decode(eng, 2, steps=16)  # warm-up: compile every kernel and settle allocations first
    for b in (int(x) for x in args.decode_batches.split(",") if x):
        profile_decode(eng, b, args.steps, args.raw)
    if not args.no_prefill:
        profile_prefill(eng, args.raw)
    eng.close()


if __name__ == "__main__":
    main()
