"""Where a prefill step's GPU time goes: one 16 x 1024-token step under the torch profiler,
kernels grouped by what they do. Used to decide what to optimise; prints a table.

    python -m bench.gpu_prefill_profile
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import hf_llama, ours_from_hf, table
from bench.gpu_engine import engine
from libs.engine import SamplingParams


def group(name: str) -> str:
    n = name.lower()
    for key, label in (("_prefill_kernel", "attention (prefill)"), ("_store_kv", "store_kv"), ("rms", "rms_norm"), ("rotary", "rotary"), ("rope", "rotary"),
                       ("silu", "silu_and_mul"), ("gemm", "GEMM"), ("sm90", "GEMM"), ("cutlass", "GEMM"), ("nvjet", "GEMM"), ("xmma", "GEMM"), ("embedding", "embedding"), ("index", "indexing")):
        if key in n:
            return label
    return "other: " + name[:60]


def main() -> None:
    dev = torch.device("cuda")
    hf = hf_llama(dev, torch.bfloat16)
    eng = engine(ours_from_hf(hf, dev, torch.bfloat16))
    g = torch.Generator().manual_seed(3)

    def step_batch():
        for i in range(16):
            eng.add_request(f"p{i}-{time.monotonic_ns()}", torch.randint(0, 49152, (1024,), generator=g).tolist(), SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()

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
    by = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type.name == "CUDA" and dt:
            by[group(e.key)][0] += dt / 1e3
            by[group(e.key)][1] += e.count
            total += dt / 1e3
    rows = sorted(([k, f"{v[0]:.2f}", v[1], f"{100 * v[0] / total:.1f}%"] for k, v in by.items()), key=lambda r: -float(r[1]))
    print(f"\nprefill 16x1024: wall {wall * 1e3:.2f} ms, GPU kernel time {total:.2f} ms ({16384 / wall / 1e3:.0f}k tokens/s)\n")
    print(table(["kernels", "GPU ms", "launches", "share"], rows[:20]))


if __name__ == "__main__":
    main()
