"""Tune the block-scaled FP8 GEMM's tiles on this GPU and store the winners as data.

For every weight shape (N x K) and M of the sweep, and for each variant (swap-AB for
M <= 256, normal for every M), a compact grid of plans (kernels/fp8/plan.py: token and
weight tiles, warps, pipeline stages, split-K, the activation quantization fused in or
not, TMA or pointer loads; the untuned heuristic's own plan always among them) is:

1. compiled, up front, in a pool of worker processes (Triton's compiler and ptxas are
   the slow part; its on-disk cache hands the binaries to this process);
2. checked against the torch reference on the same random operands (norm-wise within
   2**-7: e4m3 inputs, fp32 block sums, a bf16 output), before and after timing;
3. timed as a linear layer runs it (activation quantization included, whether fused
   into the GEMM or its own launch), replayed from a CUDA graph with the weights cold in
   L2 (bench/gpu_timing.py).

The fastest plan per (device, shape, variant, M) goes into kernels/fp8/gemm_configs.json,
which ``plan_gemm`` reads at launch (an entry tuned at M serves the Ms above the previous
tuned M up to it); other devices' entries in the file are kept. Shapes: Llama-3-8B's
projections at the issue's Ms, and Llama-3.2-1B's (the decode benchmark's model) at
decode sizes.

Budget: about 2-3 minutes on an H100 (``--budget-s``, default 170, stops measuring when
spent; what is left untuned runs the heuristic, and the output says so).

    python -m bench.fp8_tune [--budget-s 170] [--out kernels/fp8/gemm_configs.json]
    TRITON_INTERPRET=1 python -m bench.fp8_tune --toy      # the script on the CPU; times nothing
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from kernels.fp8 import reference as ref
from kernels.fp8.layout import BLOCK, padded
from kernels.fp8.plan import CONFIGS_FILE, CONFIGS_FORMAT, GemmPlan, heuristic_plan, reload, shape_key

LLAMA3_8B = [(4096, 4096), (14336, 4096), (4096, 14336)]
# The Ms, and 32: between swap-AB's decode sizes and 64 (bench/RESULTS.md, issue 13:
# at M = 32 swap-AB in 16-token tiles beat the normal plan that served there).
LLAMA3_8B_MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]
LLAMA32_1B = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # qkv, o, gate_up, down
LLAMA32_1B_MS = [1, 16, 32, 64]
# The engine fuses Llama-3-8B's qkv and gate/up into one weight each: shapes the issue's
# list lacks, which ran the untuned plan (bench/RESULTS.md, "FP8 decode on Llama-3-8B's shape").
LLAMA3_8B_FUSED = [(6144, 4096), (28672, 4096)]
SWAP_AB_MAX_TUNED_M = 256
TOY_SHAPES, TOY_MS = [(256, 256)], [1, 16]
REL_TOL = 2.0**-7


def token_tile_for(m: int) -> int:
    return min(max(16, 1 << (m - 1).bit_length()), 128)


def candidates(swap_ab: bool, m: int, n_pad: int, k_pad: int, num_sms: int) -> list[GemmPlan]:
    """The grid for one (variant, M, shape), the heuristic's plan first."""
    k_blocks = k_pad // BLOCK
    out = [heuristic_plan(m, swap_ab, n_pad, k_pad, num_sms)]

    def add(tt: int, wt: int, warps: int, stages: int, splits=(1,), fuse=(False,), tma=(False,), group: int = 8) -> None:
        if n_pad % wt:
            return
        base_tiles = (n_pad // wt) * math.ceil(m / tt)
        for split in splits:
            if split > 1 and (k_blocks < 4 * split or base_tiles >= num_sms):
                continue  # a short K, or enough tiles to fill the GPU without splitting
            for f in fuse:
                for t in tma:
                    if not (f and t):
                        out.append(GemmPlan(swap_ab, tt, wt, warps, stages, group=group, split_k=split, fuse_quant=f, tma=t))

    if swap_ab:
        tt = token_tile_for(m)
        if tt <= 16:
            # Decode sizes stream the weight: deeper pipelines and TMA at every split (a
            # probe found 8 stages and TMA with split-K 4 fastest on two of Llama-3-8B's
            # shapes). The fused quantization is left out here: its best plan measured
            # 1.2-1.7x slower than its own kernel plus the GEMM on every shape, and
            # 1.14-2.2x after the quantizer's reciprocal (bench/RESULTS.md, "The quantizer
            # multiplies by the reciprocal").
            for wt in (32, 64, 128):
                for stages in (5 if wt <= 64 else 4, 8):
                    add(tt, wt, 4, stages, splits=(1, 2, 4, 8), tma=(False, True))
        elif tt <= 64:
            for wt in (64, 128):
                add(tt, wt, 4, 4, splits=(1, 2, 4), fuse=(False, True))
                add(tt, wt, 4, 4, splits=(1, 2), tma=(True,))
            # Token tiles smaller than M, with the decode sizes' depth and TMA: each program's
            # MMA stays narrow and the weight tile is read once per token tile (from L2 after
            # the first). At M = 32 a probe measured 16-token tiles 1.05-1.33x the normal plan
            # then served on four of five shapes (bench/RESULTS.md, issue 13).
            for small in (16, 32):
                if small < tt:
                    add(small, 64, 4, 5, splits=(1, 2, 4), tma=(True,))
        else:
            for wt in (64, 128):
                add(tt, wt, 4, 4, splits=(1, 2), tma=(False, True))
    elif m <= 64:
        # The same depths and TMA as swap-AB's grid: "ours without" is tuned as hard.
        for wt in (64, 128):
            for stages in (3, 4, 8):
                add(64, wt, 4, stages, splits=(1, 2, 4), tma=(False, True))
    elif m <= 256:
        for tt, warps in ((64, 4), (128, 4), (128, 8)):
            for stages in (3, 4):
                add(tt, 128, warps, stages)
        for stages in (3, 4):
            add(128, 128, 8, stages, tma=(True,))
    else:
        for tt, wt, warps in ((64, 128, 4), (128, 128, 4), (128, 128, 8), (128, 256, 8), (64, 256, 4)):
            for stages in (3, 4):
                add(tt, wt, warps, stages, tma=(False, True))
    return list(dict.fromkeys(out))  # the heuristic may also be in the grid


def work(shapes: list[tuple[int, int]], ms: list[int], num_sms: int, limit: int | None = None) -> list[tuple[int, int, int, bool, list[GemmPlan]]]:
    """(n, k, m, swap_ab, plans) for every tuning job, in the order they are measured."""
    jobs = []
    for n, k in shapes:
        for m in ms:
            for swap in (True, False):
                if swap and m > SWAP_AB_MAX_TUNED_M:
                    continue
                plans = candidates(swap, m, padded(n), padded(k), num_sms)
                jobs.append((n, k, m, swap, plans[:limit] if limit else plans))
    return jobs


# -- compiling in worker processes ----------------------------------------------------------

_W: dict = {}
REPRESENTATIVE = {"cuda": (4096, 4096), "cpu": (384, 256)}  # N x K the workers compile on


def _worker_init(device: str) -> None:
    n, k = REPRESENTATIVE[device]
    g = torch.Generator(device=device).manual_seed(0)
    _W["w"] = ref.quantize_weight(torch.randn(n, k, generator=g, device=device) * 0.02)
    _W["x"] = torch.randn(256, k, generator=g, device=device).to(torch.bfloat16 if device == "cuda" else torch.float32)


def _compile_one(plan_dict: dict) -> tuple[dict, str | None]:
    """Launch ``plan`` once on a representative shape: every tuned shape's strides and
    sizes are multiples of 16, so they share this compilation (Triton's specialization)."""
    from kernels.fp8 import triton_gemm

    plan = GemmPlan.from_dict(plan_dict)
    try:
        w_q, w_s = _W["w"]
        triton_gemm.fp8_linear(_W["x"][: plan.token_tile], w_q, w_s, n=w_q.shape[0], plan=plan)
        if w_q.is_cuda:
            torch.cuda.synchronize()
        return plan_dict, None
    except Exception as e:  # a plan this GPU or Triton cannot run: reported, then skipped
        return plan_dict, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def precompile(plans: list[GemmPlan], workers: int, device: str = "cuda") -> dict[GemmPlan, str]:
    """Compile every plan in ``workers`` processes (Triton's on-disk cache hands the
    binaries to this one); returns the plans that failed, with why."""
    failed: dict[GemmPlan, str] = {}
    if workers <= 0:
        return failed
    t = time.time()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init, initargs=(device,)) as pool:
        for i, (d, err) in enumerate(pool.map(_compile_one, [p.to_dict() for p in plans], chunksize=1)):
            if err:
                failed[GemmPlan.from_dict(d)] = err
            if (i + 1) % 20 == 0 or i + 1 == len(plans):
                print(f"  compiled {i + 1}/{len(plans)} plans in {time.time() - t:.0f} s ({len(failed)} failed)", flush=True)
    return failed


# -- measuring ------------------------------------------------------------------------------


def rel_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return math.inf
    return ((y.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def tune(jobs, device: torch.device, timer: Callable, failed: dict[GemmPlan, str], budget_s: float, t0: float) -> dict:
    """Measure every job's plans; returns ``{shape: {variant: [entry]}}``."""
    from kernels.fp8 import triton_gemm

    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict = {}
    operands: dict = {}
    skipped = 0
    for n, k, m, swap, plans in jobs:
        if (n, k) not in operands:
            operands.clear()  # one shape's copies at a time
            g = torch.Generator(device=device).manual_seed(n * 7 + k)
            w_q, w_s = ref.quantize_weight(torch.randn(n, k, generator=g, device=device) * 0.02)
            operands[(n, k)] = (g, w_q, w_s, ref.dequantize_weight(w_q, w_s)[:n])
        g, w_q, w_s, w_dense = operands[(n, k)]
        if time.time() - t0 > budget_s:
            skipped += 1
            print(f"  budget spent: {n}x{k} M={m} {'swap_ab' if swap else 'normal'} left to the heuristic", flush=True)
            continue
        x = torch.randn(m, k, generator=g, device=device).to(out_dtype)
        x_q, x_s = ref.per_token_group_quant(x)
        expected = ref.dequantize_activation(x_q, x_s)[:m, :k] @ w_dense[:, :k].t()
        copies = timer.copies(w_q.numel() + x.numel() * x.element_size()) if hasattr(timer, "copies") else 1
        ws = [(w_q, w_s)] + [(w_q.clone(), w_s.clone()) for _ in range(copies - 1)]
        xs = [x] + [x.clone() for _ in range(copies - 1)]
        timings = []
        for plan in plans:
            if plan in failed:
                continue
            try:
                err = rel_error(triton_gemm.fp8_linear(x, w_q, w_s, n=n, out_dtype=out_dtype, plan=plan), expected)
                if err > REL_TOL:
                    failed[plan] = f"wrong result at {n}x{k} M={m}: relative error {err:.2e}"
                    continue
                ms = timer([lambda i=i, plan=plan: triton_gemm.fp8_linear(xs[i], *ws[i], n=n, out_dtype=out_dtype, plan=plan) for i in range(copies)])
                err = rel_error(triton_gemm.fp8_linear(x, w_q, w_s, n=n, out_dtype=out_dtype, plan=plan), expected)
                if err > REL_TOL:
                    failed[plan] = f"wrong result after timing at {n}x{k} M={m}: relative error {err:.2e}"
                    continue
            except Exception as e:
                failed[plan] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                continue
            timings.append((ms, plan))
        if not timings:
            print(f"  {n}x{k} M={m}: no plan ran", flush=True)
            continue
        best_ms, best = min(timings, key=lambda t: t[0])
        heuristic_ms = next((t for t, p in timings if p == plans[0]), None)
        variant = "swap_ab" if swap else "normal"
        results.setdefault(shape_key(padded(n), padded(k)), {}).setdefault(variant, []).append(
            {"max_m": m, "plan": best.to_dict(), "ms": round(best_ms, 5), "heuristic_ms": None if heuristic_ms is None else round(heuristic_ms, 5), "candidates": len(timings)}
        )
        speedup = "" if heuristic_ms is None else f" ({heuristic_ms / best_ms:.2f}x the heuristic's {heuristic_ms:.4f})"
        print(f"[{time.time() - t0:5.0f} s] {n:5d}x{k:<5d} M={m:<4d} {variant:7s} {len(timings):2d} plans: best {best_ms:.4f} ms {best.label}{speedup}", flush=True)
    if skipped:
        print(f"{skipped} (shape, M, variant) jobs left to the heuristic: budget of {budget_s:.0f} s spent", flush=True)
    return results


def gpu_timer() -> Callable:
    from bench.gpu_timing import copies_for, graph_ms

    def timer(calls):
        return graph_ms(calls, min_calls=max(24, len(calls)), reps=5)

    timer.copies = copies_for  # type: ignore[attr-defined]
    return timer


def cpu_timer(calls) -> float:
    t = time.perf_counter()
    calls[0]()
    return (time.perf_counter() - t) * 1e3


def merge_into(path: Path, device_name: str, shapes: dict, meta: dict) -> None:
    """Write this device's table into ``path``, keeping other devices'."""
    data = json.loads(path.read_text()) if path.exists() else {}
    if data.get("format") != CONFIGS_FORMAT:
        data = {"format": CONFIGS_FORMAT, "devices": {}}
    data.setdefault("devices", {})[device_name] = {**meta, "shapes": shapes}
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="tiny shapes, few plans, Triton's interpreter on the CPU: checks the script")
    ap.add_argument("--budget-s", type=float, default=170.0, help="stop measuring after this many seconds (default 170)")
    ap.add_argument("--workers", type=int, default=None, help="compiler processes (default: CPU cores - 1, at most 15; 0: compile in this process)")
    ap.add_argument("--out", default=None, help=f"the table to write (default {CONFIGS_FILE}; --toy writes only where given)")
    args = ap.parse_args()
    t0 = time.time()
    if args.toy:
        device, name, num_sms = torch.device("cpu"), "cpu (Triton interpreter)", 4
        jobs = work(TOY_SHAPES, TOY_MS, num_sms, limit=3)
        timer, failed = cpu_timer, {}
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --toy)")
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        name, num_sms = props.name, props.multi_processor_count
        # Smallest M first: decode sizes are cheap to measure and matter most; should the
        # budget run out, what is left is the large M of one shape, not a whole model.
        jobs = work(LLAMA3_8B, LLAMA3_8B_MS, num_sms) + work(LLAMA32_1B + LLAMA3_8B_FUSED, LLAMA32_1B_MS, num_sms)
        jobs.sort(key=lambda j: j[2])
        unique = list(dict.fromkeys(p for *_, plans in jobs for p in plans))
        workers = args.workers if args.workers is not None else max(1, min(15, (os.cpu_count() or 2) - 1))
        print(f"{name}, {num_sms} SMs: {len(jobs)} jobs, {sum(len(j[-1]) for j in jobs)} measurements, {len(unique)} distinct plans; compiling with {workers} processes", flush=True)
        try:
            failed = precompile(unique, workers)
        except Exception as e:  # the pool itself broke: compile on first use instead
            print(f"  parallel compilation failed ({type(e).__name__}: {e}); compiling in this process", flush=True)
            failed = {}
        for plan, err in failed.items():
            print(f"  skipped {plan.label}: {err}", flush=True)
        timer = gpu_timer()
    results = tune(jobs, device, timer, failed, args.budget_s, t0)
    out = Path(args.out) if args.out else (None if args.toy else CONFIGS_FILE)
    if out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        import triton

        meta = {
            "source": f"bench/fp8_tune.py at commit {commit or 'unknown'}",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "num_sms": num_sms,
            "timing": "per linear layer (activation quantization included), CUDA-graph replay, weights cold in L2" if device.type == "cuda" else "interpreter: meaningless",
        }
        merge_into(out, name, results, meta)
        reload()
        print(f"wrote {sum(len(v) for s in results.values() for v in s.values())} tuned entries for {name!r} to {out}")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
