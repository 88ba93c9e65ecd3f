"""The block-scaled FP8 GEMM against its peers, and the swap-AB threshold it stores.

Llama-3-8B's projection shapes (N x K: 4096 x 4096, 14336 x 4096, 4096 x 14336) at
M in {1, 4, 16, 64, 128, 256, 1024, 4096}, all in one run on one GPU:

- ours, swap-AB (``plan_gemm(m, swap_ab=True)``);
- ours, without swap-AB;
- ``torch._scaled_mm`` with rowwise scales (one per token, one per output channel: the
  closest cuBLAS FP8 GEMM; a coarser format than 128 x 128 blocks);
- bf16 ``torch.matmul``.

The FP8 GEMMs get pre-quantized operands; the activation quantization (our Triton kernel,
padding fused) is timed on its own and added in the "ours + quant" column, which is what a
linear layer costs. Ratios: swap-AB / without (goal >= 1.3x at M <= 16), bf16 / ours-best
(goal >= 1.3x at M <= 64, >= 1.5x at M >= 2048), scaled_mm / ours-best.

``--write-threshold`` stores, in kernels/fp8/swap_ab_threshold.json, the largest M of the
sweep up to which swap-AB is faster on every shape (geometric mean), with the device,
date and timings: ``plan_gemm`` reads it. Every variant's output is checked against the
reference before it is timed.

``--toy`` runs tiny shapes on the CPU in Triton's interpreter: it checks that the script
and every variant work (``torch._scaled_mm`` is CUDA-only and is skipped), and its timings
mean nothing.

    python -m bench.fp8_gemm_bench [--write-threshold] [--out bench/results/fp8_gemm.json]
    TRITON_INTERPRET=1 python -m bench.fp8_gemm_bench --toy
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from bench.common import table
from kernels.fp8 import layout, plan_gemm
from kernels.fp8 import reference as ref

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
MS = [1, 4, 16, 64, 128, 256, 1024, 4096]
TOY_SHAPES = [(256, 256)]
TOY_MS = [1, 4, 16, 64]


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of a call."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def cpu(fn: Callable[[], object]) -> float:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cpu


def scaled_mm_rowwise(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """``torch._scaled_mm`` with a scale per token and per output channel, or None where
    this torch/GPU has no rowwise FP8 GEMM."""
    if x.device.type != "cuda":
        return None
    xs = (x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-10) / layout.E4M3_MAX)
    ws = (w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-10) / layout.E4M3_MAX)
    xq, wq = ref.to_e4m3(x.float() / xs), ref.to_e4m3(w.float() / ws)
    fn = lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)  # noqa: E731
    try:
        y = fn()
    except (RuntimeError, TypeError) as e:
        print(f"torch._scaled_mm rowwise unavailable for {tuple(x.shape)} x {tuple(w.shape)}: {str(e).splitlines()[0]}")
        return None
    exact = x.float() @ w.float().t()
    assert (y.float() - exact).norm() <= 0.1 * exact.norm(), "torch._scaled_mm gave a wrong product"
    return fn


def run(device: torch.device, shapes: list[tuple[int, int]], ms: list[int]) -> list[dict]:
    from kernels.fp8 import triton_gemm, triton_quant

    ms_of = timer(device)
    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for n, k in shapes:
        g = torch.Generator(device=device).manual_seed(n + k)
        w = torch.randn(n, k, generator=g, device=device) * 0.02
        w_q, w_s = ref.quantize_weight(w)
        w16 = w.to(out_dtype)
        for m in ms:
            x = torch.randn(m, k, generator=g, device=device).to(out_dtype)
            row: dict = {"n": n, "k": k, "m": m}
            normal = plan_gemm(m, swap_ab=False)
            x_ref = ref.per_token_group_quant(x, row_multiple=normal.row_multiple)
            expected = ref.block_scaled_mm(*x_ref, w_q, w_s, m=m, n=n, plan=normal)
            for name, swap in (("swap_ab", True), ("normal", False)):
                plan = plan_gemm(m, swap_ab=swap)
                x_q, x_s = triton_quant.per_token_group_quant(x, row_multiple=plan.row_multiple)
                gemm = lambda: triton_gemm.block_scaled_mm(x_q, x_s, w_q, w_s, m=m, n=n, out_dtype=out_dtype, plan=plan)  # noqa: E731
                got = gemm().float()
                assert (got - expected).norm() <= 2.0**-7 * expected.norm(), f"{name} wrong at m={m} n={n} k={k}"
                row[name] = ms_of(gemm)
                row[f"quant_{name}"] = ms_of(lambda: triton_quant.per_token_group_quant(x, row_multiple=plan.row_multiple))
            scaled = scaled_mm_rowwise(x, w)
            row["scaled_mm_rowwise"] = ms_of(scaled) if scaled is not None else None
            row["bf16"] = ms_of(lambda: torch.matmul(x, w16.t()))
            best = min(("swap_ab", "normal"), key=lambda v: row[v])
            row["ours_best"] = best
            row["ours_with_quant"] = row[best] + row[f"quant_{best}"]
            rows.append(row)
            print(json.dumps(row))
    return rows


def choose_threshold(rows: list[dict]) -> int:
    """The largest M up to which swap-AB is faster than the normal variant (geometric mean
    over the shapes) at every M of the sweep; 0 if it never is at M = 1."""
    threshold = 0
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m]
        speedup = math.exp(sum(math.log(r["normal"] / r["swap_ab"]) for r in at_m) / len(at_m))
        if speedup <= 1.0:
            break
        threshold = m
    return threshold


def report(rows: list[dict]) -> str:
    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or b is None else f"{a / b:.2f}x"

    headers = ["N x K", "M", "swap-AB ms", "normal ms", "quant ms", "scaled_mm ms", "bf16 ms", "swap/normal", "bf16/ours", "bf16/(ours+quant)", "scaled_mm/ours"]
    body = []
    for r in rows:
        best = r[r["ours_best"]]
        body.append([
            f"{r['n']} x {r['k']}", r["m"], f"{r['swap_ab']:.4f}", f"{r['normal']:.4f}", f"{r['quant_' + r['ours_best']]:.4f}",
            "n/a" if r["scaled_mm_rowwise"] is None else f"{r['scaled_mm_rowwise']:.4f}", f"{r['bf16']:.4f}",
            ratio(r["normal"], r["swap_ab"]), ratio(r["bf16"], best), ratio(r["bf16"], r["ours_with_quant"]), ratio(r["scaled_mm_rowwise"], best),
        ])
    return table(headers, body)


def write_threshold(rows: list[dict], device: torch.device) -> int:
    value = choose_threshold(rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    data = {
        "swap_ab_max_m": value,
        "provisional": False,
        "source": f"bench/fp8_gemm_bench.py --write-threshold at commit {commit}: largest M of the sweep up to which swap-AB beats the normal variant on every Llama-3-8B shape (geometric mean)",
        "device": torch.cuda.get_device_name(device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "timings_ms": {f"{r['n']}x{r['k']}@{r['m']}": {"swap_ab": r["swap_ab"], "normal": r["normal"]} for r in rows},
    }
    Path(layout.THRESHOLD_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toy", action="store_true", help="tiny shapes on the CPU (Triton's interpreter): checks the script, times nothing real")
    ap.add_argument("--write-threshold", action="store_true", help="store the measured swap-AB M threshold (GPU only)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    device = torch.device("cpu" if args.toy else "cuda")
    if args.write_threshold and device.type != "cuda":
        ap.error("--write-threshold needs GPU timings (not --toy)")
    rows = run(device, TOY_SHAPES if args.toy else SHAPES, TOY_MS if args.toy else MS)
    print(report(rows))
    print(f"swap-AB faster up to M = {choose_threshold(rows)} (stored: {layout.swap_ab_max_m()})")
    if args.write_threshold:
        print(f"wrote swap_ab_max_m = {write_threshold(rows, device)} to {layout.THRESHOLD_FILE}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
