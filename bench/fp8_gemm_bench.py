"""The block-scaled FP8 GEMM against its peers, and the swap-AB threshold it stores.

Llama-3-8B's projection shapes (N x K: 4096 x 4096, 14336 x 4096, 4096 x 14336) at
M in {1, 4, 16, 64, 128, 256, 1024, 4096}, all in one run on one GPU:

- ours, swap-AB (``plan_gemm(m, swap_ab=True, n=, k=, device=)``: the tuned plan where
  bench/fp8_tune.py stored one for this GPU, else the heuristic);
- ours, without swap-AB (the same, ``swap_ab=False``);
- ``torch._scaled_mm`` with rowwise scales (one per token, one per output channel: the
  closest cuBLAS FP8 GEMM; a coarser format than 128 x 128 blocks), on operands
  quantized beforehand: its figure leaves out the activation quantization;
- ours through cuBLASLt's block-scaled FP8 GEMM (kernels/fp8/cublas_gemm.py; the same
  format, activation quantization included), where this GPU and torch have it (SM90);
- ours through the skinny GEMM (kernels/gemv with the e4m3 weight, ``weight_scale=``),
  at M <= 8: the weight's rows spread over many programs, each streaming its slice once
  with the activations' quantization folded in (one launch), fp32 math on CUDA cores (a
  GEMV: no MMA at these sizes). Its tiles are swept per shape and M (``--tune``: every
  ``triton_gemv.candidates(fp8=True)``), the heuristic's time kept beside it;
- bf16 ``torch.matmul``.

Besides Llama-3-8B's shapes, Llama-3.2-1B's decode projections (3072 x 2048, 2048 x 2048,
16384 x 2048, 2048 x 8192) run at M <= 64, so the skinny GEMM's tiles are measured for
the decode benchmark's model too.

"Ours as served" is what an FP8 layer runs at that M: the skinny GEMM up to
``fp8_skinny_max_m`` (where the model calls it through libs/model/linear.py), cuBLAS from
``cublas_min_m`` up where usable, else the Triton plan (swap-AB up to its threshold).

Ours is timed as a linear layer runs it, ``triton_gemm.fp8_linear``: the activation
quantization included, whether the plan fuses it into the GEMM or launches the
quantization kernel first (that kernel's own time is its own column). Every figure is a
CUDA-graph replay with the weights cold in L2 (bench/gpu_timing.py says why not
``do_bench``). Ratios: swap-AB / without (goal >= 1.3x at M <= 16), bf16 / ours-best
(goal >= 1.3x at M <= 64, >= 1.5x at M >= 2048), scaled_mm / ours-best.

``--write-threshold`` stores, in kernels/fp8/swap_ab_threshold.json, the largest M of the
sweep up to which swap-AB is faster on every shape (geometric mean), with the device,
date and timings: ``plan_gemm`` reads it; in kernels/fp8/cublas_threshold.json the
smallest M from which cuBLAS beats our best Triton variant at every larger M of the sweep
(geometric mean over the shapes); and in kernels/gemv/threshold.json, under this GPU,
``fp8_max_m`` (the largest M up to which the skinny GEMM beats both block-scaled variants
on every shape measured, each one by itself: what unmeasured shapes get), per shape the
largest M up to which it won at every M (``fp8_max_m_by_shape``, by a 2% margin) and its
fastest tiles per shape and M (``NxK:fp8``). Every variant's output is checked against the
reference before it is timed.

``--toy`` runs tiny shapes on the CPU in Triton's interpreter: it checks that the script
and every variant work (``torch._scaled_mm`` is CUDA-only and is skipped), and its timings
mean nothing.

    python -m bench.fp8_gemm_bench [--tune] [--write-threshold] [--out bench/results/fp8_gemm.json]
    TRITON_INTERPRET=1 python -m bench.fp8_gemm_bench --toy
"""

from __future__ import annotations

import json
import math
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from bench.common import kernel_bench_parser, table
from bench.gpu_timing import copies_for, kernel_timer
from bench.common import git_commit
from bench.gemv_bench import SHAPE_MARGIN
from kernels.device import device_name
from kernels.fp8 import layout, plan
from kernels.fp8 import reference as ref
from kernels.gemv import threshold as gemv_threshold

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]
MS = [1, 4, 16, 32, 64, 128, 256, 1024, 4096]  # the issue's Ms and 32 (bench/fp8_tune.py says why)
DECODE_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # Llama-3.2-1B
DECODE_MS = [1, 4, 16, 32, 64]
TOY_SHAPES = [(256, 256)]
TOY_MS = [1, 4, 16, 64]
TRITON_VARIANTS = ("swap_ab", "normal", "skinny")


def copies(device: torch.device, *tensors: torch.Tensor) -> int:
    if device.type != "cuda":
        return 1
    return copies_for(sum(t.numel() * t.element_size() for t in tensors))


def scaled_mm_rowwise(x: torch.Tensor, w: torch.Tensor, n_copies: int) -> list[Callable[[], torch.Tensor]] | None:
    """``torch._scaled_mm`` with a scale per token and per output channel (one call per
    operand copy), or None where this torch/GPU has no rowwise FP8 GEMM."""
    if x.device.type != "cuda":
        return None
    xs = (x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-10) / layout.E4M3_MAX)
    ws = (w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-10) / layout.E4M3_MAX)
    xq, wq = ref.to_e4m3(x.float() / xs), ref.to_e4m3(w.float() / ws)
    wqs = [wq] + [wq.clone() for _ in range(n_copies - 1)]
    calls = [lambda wq=wq: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16) for wq in wqs]
    try:
        y = calls[0]()
    except (RuntimeError, TypeError) as e:
        print(f"torch._scaled_mm rowwise unavailable for {tuple(x.shape)} x {tuple(w.shape)}: {str(e).splitlines()[0]}")
        return None
    exact = x.float() @ w.float().t()
    assert (y.float() - exact).norm() <= 0.1 * exact.norm(), "torch._scaled_mm gave a wrong product"
    return calls


def skinny(x: torch.Tensor, wqs: list, n: int, expected: torch.Tensor, time_of, tune: bool) -> tuple[float, list[int], float]:
    """The skinny GEMM at this shape and M: ``(ms, config, heuristic ms)``, its tiles those a
    layer runs (this GPU's stored ones, else the heuristic's) or, with ``tune``, the
    fastest of those and ``candidates`` (each checked against the reference first)."""
    from kernels.gemv import triton_gemv

    w_q, w_s = wqs[0]
    m, (n_pad, k_pad) = x.shape[0], w_q.shape

    def timed(cfg) -> float:
        got = triton_gemv.skinny_linear(x, w_q, weight_scale=w_s, out_features=n, config_override=cfg).float()
        assert (got - expected).norm() <= 2.0**-7 * expected.norm(), f"skinny {cfg} wrong at m={m} n={n}"
        return time_of([lambda q=q: triton_gemv.skinny_linear(x, q[0], weight_scale=q[1], out_features=n, config_override=cfg, static_weight=True)
                        for q in wqs])

    heuristic = triton_gemv.heuristic_config(m, n_pad, k_pad, x.device, fp8=True)
    best = triton_gemv.config(m, n_pad, k_pad, x.device, fp8=True)  # the stored tiles, as a layer runs
    best_ms = timed(best)
    heuristic_ms = best_ms if best == heuristic else timed(heuristic)
    for cfg in triton_gemv.candidates(m, n_pad, k_pad, fp8=True) if tune else []:
        t = timed(cfg)
        if t < best_ms:
            best, best_ms = cfg, t
    return best_ms, list(best), heuristic_ms


def run(device: torch.device, shapes: list[tuple[int, int]], ms: list[int], tune: bool = False) -> list[dict]:
    from kernels.fp8 import cublas_gemm, triton_gemm, triton_quant

    time_of = kernel_timer(device)
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
            expected = ref.fp8_linear(x, w_q, w_s, n=n, out_dtype=torch.float32)
            c = copies(device, w_q, x)
            wqs = [(w_q, w_s)] + [(w_q.clone(), w_s.clone()) for _ in range(c - 1)]
            for name, swap in (("swap_ab", True), ("normal", False)):
                p = plan.plan_gemm(m, swap_ab=swap, n=n, k=k, device=device)
                got = triton_gemm.fp8_linear(x, w_q, w_s, n=n, out_dtype=out_dtype, plan=p).float()
                assert (got - expected).norm() <= 2.0**-7 * expected.norm(), f"{name} wrong at m={m} n={n} k={k}"
                row[name] = time_of([lambda q=q, p=p: triton_gemm.fp8_linear(x, *q, n=n, out_dtype=out_dtype, plan=p) for q in wqs])
                row[f"plan_{name}"] = p.label
            row["skinny"] = row["skinny_config"] = row["skinny_heuristic"] = None
            if m <= gemv_threshold.FP8_MAX_M:
                row["skinny"], row["skinny_config"], row["skinny_heuristic"] = skinny(x, wqs, n, expected, time_of, tune)
                row["plan_skinny"] = f"skinny {tuple(row['skinny_config'])}"
            row["quant"] = time_of([lambda: triton_quant.per_token_group_quant(x, row_multiple=16)])
            row["cublas_block"] = None
            if cublas_gemm.cublas_block_fp8_usable(device, n, k):
                got = cublas_gemm.fp8_linear(x, w_q, w_s, n=n, out_dtype=out_dtype).float()
                assert (got - expected).norm() <= 2.0**-7 * expected.norm(), f"cuBLAS block wrong at m={m} n={n} k={k}"
                row["cublas_block"] = time_of([lambda q=q: cublas_gemm.fp8_linear(x, *q, n=n, out_dtype=out_dtype) for q in wqs])
            scaled = scaled_mm_rowwise(x, w, c)
            row["scaled_mm_rowwise"] = time_of(scaled) if scaled is not None else None
            c16 = copies(device, w16)
            w16s = [w16] + [w16.clone() for _ in range(c16 - 1)]
            row["bf16"] = time_of([lambda v=v: torch.matmul(x, v.t()) for v in w16s])
            row["ours_best"] = min((v for v in TRITON_VARIANTS if row[v] is not None), key=lambda v: row[v])
            triton_served = "swap_ab" if m <= plan.swap_ab_max_m(device_name(device)) else "normal"
            if m <= gemv_threshold.fp8_skinny_max_m(device, *w_q.shape):
                triton_served = "skinny"
            row["served"] = "cublas_block" if row["cublas_block"] is not None and m >= plan.cublas_min_m() else triton_served
            rows.append(row)
            print(json.dumps(row), flush=True)
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


def choose_skinny_threshold(rows: list[dict]) -> int:
    """The largest M up to which the skinny GEMM beats both block-scaled variants on every
    shape measured at every M of the sweep (each shape by itself: one slow shape in a
    decode step costs what it costs); 0 if it does not at M = 1."""
    threshold = 0
    for m in sorted({r["m"] for r in rows if r["skinny"] is not None}):
        if not all(r["skinny"] < min(r["swap_ab"], r["normal"]) for r in rows if r["m"] == m):
            break
        threshold = m
    return threshold


def skinny_shape_thresholds(rows: list[dict]) -> dict[str, int]:
    """Per padded weight shape ``NxK:fp8``: the largest M up to which the skinny GEMM beat
    both block-scaled variants by ``SHAPE_MARGIN`` (bench/gemv_bench.py's: a single
    projection's timing is noisy) at every measured M (0: not at M = 1)."""
    out: dict[str, int] = {}
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows if r["skinny"] is not None):
        best = 0
        for r in sorted((r for r in rows if (r["n"], r["k"]) == (n, k) and r["skinny"] is not None), key=lambda r: r["m"]):
            if min(r["swap_ab"], r["normal"]) < SHAPE_MARGIN * r["skinny"]:
                break
            best = r["m"]
        out[gemv_threshold.shape_key(layout.padded(n), layout.padded(k), fp8=True)] = best
    return out


def choose_cublas_threshold(rows: list[dict]) -> int | None:
    """The smallest M of the sweep from which cuBLAS's block-scaled GEMM beats our best
    Triton variant at that M and every larger one (geometric mean over the shapes); None
    where it never does or did not run."""
    if any(r["cublas_block"] is None for r in rows):
        return None
    best = None
    for m in sorted({r["m"] for r in rows}, reverse=True):
        at_m = [r for r in rows if r["m"] == m]
        if math.exp(sum(math.log(r[r["ours_best"]] / r["cublas_block"]) for r in at_m) / len(at_m)) <= 1.0:
            break
        best = m
    return best


def report(rows: list[dict]) -> str:
    def ratio(a: float | None, b: float | None) -> str:
        return "n/a" if a is None or b is None else f"{a / b:.2f}x"

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    headers = ["N x K", "M", "swap-AB ms", "normal ms", "skinny ms", "cuBLAS block ms", "quant kernel ms", "scaled_mm ms (no quant)", "bf16 ms",
               "swap/normal", "skinny/normal", "bf16/ours Triton", "bf16/ours as served", "served", "scaled_mm/ours", "best plan"]
    body = []
    for r in rows:
        best = r[r["ours_best"]]
        body.append([
            f"{r['n']} x {r['k']}", r["m"], f"{r['swap_ab']:.4f}", f"{r['normal']:.4f}", ms(r["skinny"]),
            "n/a" if r["cublas_block"] is None else f"{r['cublas_block']:.4f}", f"{r['quant']:.4f}",
            "n/a" if r["scaled_mm_rowwise"] is None else f"{r['scaled_mm_rowwise']:.4f}", f"{r['bf16']:.4f}",
            ratio(r["normal"], r["swap_ab"]), ratio(r["normal"], r["skinny"]), ratio(r["bf16"], best), ratio(r["bf16"], r[r["served"]]), r["served"],
            ratio(r["scaled_mm_rowwise"], best), r["plan_" + r["ours_best"]],
        ])
    return table(headers, body)


def write_skinny_threshold(rows: list[dict], device_name: str) -> int:
    """This GPU's ``fp8_max_m`` and the skinny GEMM's measured tiles (``NxK:fp8`` per M) in
    kernels/gemv/threshold.json, beside the bf16 entry's own fields."""
    value = choose_skinny_threshold(rows)
    data = json.loads(gemv_threshold.THRESHOLD_FILE.read_text())
    entry = data.setdefault("devices", {}).setdefault(device_name, {"max_m": 0})
    configs = entry.setdefault("configs", {})
    for r in rows:
        if r["skinny"] is not None:
            key = gemv_threshold.shape_key(layout.padded(r["n"]), layout.padded(r["k"]), fp8=True)
            configs.setdefault(key, {})[str(r["m"])] = r["skinny_config"]
    entry["fp8_max_m"] = value
    entry["fp8_max_m_by_shape"] = skinny_shape_thresholds(rows)
    entry["fp8_source"] = (f"bench/fp8_gemm_bench.py --write-threshold at commit {git_commit()}, "
                           f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}: skinny GEMM vs both block-scaled variants")
    gemv_threshold.parse_thresholds(data)
    gemv_threshold.THRESHOLD_FILE.write_text(json.dumps(data, indent=2) + "\n")
    gemv_threshold.reload()
    return value


def write_threshold(rows: list[dict], device: torch.device) -> int:
    """The swap-AB and cuBLAS thresholds from ``rows``: the issue's shapes (Llama-3-8B's).
    The swap-AB one is stored for this device (``by_device``); the default, which devices
    that never measured their own take, is kept (or set, in a file that has none)."""
    value = choose_threshold(rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    entry = {
        "swap_ab_max_m": value,
        "source": f"bench/fp8_gemm_bench.py --write-threshold at commit {commit}: largest M of the sweep up to which swap-AB beats the normal variant on every Llama-3-8B shape (geometric mean; per linear layer, tuned plans, CUDA-graph replay)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "timings_ms": {f"{r['n']}x{r['k']}@{r['m']}": {"swap_ab": r["swap_ab"], "normal": r["normal"]} for r in rows},
    }
    path = Path(plan.THRESHOLD_FILE)
    data = json.loads(path.read_text()) if path.exists() else {"swap_ab_max_m": value, "provisional": False}
    data.setdefault("by_device", {})[device_name(device)] = entry
    plan.parse_swap_ab_threshold(data)
    path.write_text(json.dumps(data, indent=2) + "\n")
    cublas = choose_cublas_threshold(rows)
    if cublas is not None:
        Path(plan.CUBLAS_THRESHOLD_FILE).write_text(json.dumps({
            "cublas_min_m": cublas,
            "provisional": False,
            "source": f"bench/fp8_gemm_bench.py --write-threshold at commit {commit}: smallest M of the sweep from which cuBLASLt's block-scaled GEMM beats our best Triton variant at every larger M on the Llama-3-8B shapes (geometric mean)",
            "device": device_name(device),
            "date": entry["date"],
            "timings_ms": {f"{r['n']}x{r['k']}@{r['m']}": {"cublas_block": r["cublas_block"], "triton_best": r[r["ours_best"]]} for r in rows},
        }, indent=2) + "\n")
    plan.reload()
    return value


def main() -> None:
    ap = kernel_bench_parser(__doc__, "store the measured swap-AB, cuBLAS and skinny-GEMM thresholds (GPU only)")
    ap.add_argument("--tune", action="store_true", help="sweep the skinny GEMM's tiles per shape and M (else the stored ones, or the heuristic's)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.toy else "cuda")
    if args.write_threshold and device.type != "cuda":
        ap.error("--write-threshold needs GPU timings (not --toy)")
    rows = run(device, TOY_SHAPES if args.toy else SHAPES, TOY_MS if args.toy else MS, tune=args.tune)
    issue_rows = list(rows)
    if not args.toy:
        rows += run(device, DECODE_SHAPES, DECODE_MS, tune=args.tune)
    print(report(rows))
    print(f"swap-AB faster up to M = {choose_threshold(issue_rows)} (stored for this device: {plan.swap_ab_max_m(device_name(device))})")
    print(f"cuBLAS block-scaled faster from M = {choose_cublas_threshold(issue_rows)} (stored: {plan.cublas_min_m()})")
    print(f"skinny GEMM faster up to M = {choose_skinny_threshold(rows)} on every shape, per shape {skinny_shape_thresholds(rows)}")
    if args.write_threshold:
        print(f"wrote swap_ab_max_m = {write_threshold(issue_rows, device)} to {plan.THRESHOLD_FILE}")
        name = device_name(device)
        print(f"wrote fp8_max_m = {write_skinny_threshold(rows, name)} for {name} to {gemv_threshold.THRESHOLD_FILE}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
