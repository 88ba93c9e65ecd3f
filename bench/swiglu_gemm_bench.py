"""The gate/up GEMM with SwiGLU folded in (kernels/swiglu_gemm) against cuBLAS followed by
``silu_and_mul``, at prefill sizes, and the threshold the model's dispatch reads.

The gate/up projections (N = 2 x intermediate, K = hidden) of SmolLM2-135M (3072 x 576),
Qwen2.5-0.5B (9728 x 896), Llama-3.2-1B (16384 x 2048) and Qwen2.5-7B (37888 x 3584), at M
in {256, 1024, 4096, 16384} rows (a prefill step's tokens; 16384 is a 16 x 1024 batch, the
prefill graphs' largest bucket), bf16, in one run on one GPU:

- fused: ``triton_swiglu_gemm.swiglu_linear``, at each of ``CANDIDATES``' tiles (the
  fastest counts);
- unfused: ``F.linear`` (cuBLAS) then kernels/activation's Triton ``silu_and_mul``, as the
  model runs them otherwise.

Every figure is a CUDA-graph replay with the operands cold in L2 (bench/gpu_timing.py).
Each fused output is checked against the unfused one first. Ratios are unfused / fused
(above 1: fused faster). ``--write-threshold`` stores, in kernels/swiglu_gemm/threshold.json
under this GPU's name, per shape the smallest M from which the fused kernel beat the
unfused path by ``MARGIN`` at every larger M measured (no entry: it never did at the
largest), and the fastest tiles per M.

    python -m bench.swiglu_gemm_bench [--write-threshold] [--out bench/results/swiglu_gemm_h200.json]
    python -m bench.swiglu_gemm_bench --threshold-from bench/results/swiglu_gemm_h200.json [more runs' JSON]
    TRITON_INTERPRET=1 python -m bench.swiglu_gemm_bench --toy   # checks the script on the CPU
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import git_commit, kernel_bench_parser, table
from bench.gpu_timing import copies_for, kernel_timer
from kernels.swiglu_gemm import threshold as thr

SHAPES = {"smollm2-135m": (3072, 576), "qwen2.5-0.5b": (9728, 896), "llama-3.2-1b": (16384, 2048), "qwen2.5-7b": (37888, 3584)}
MS = [256, 1024, 4096, 16384]
TOY_SHAPES = {"toy": (96, 64)}
TOY_MS = [8, 40]
# (block_m, block_n, block_k, group_m, num_stages, num_warps): the H200 probe's best few
# (bench/RESULTS.md, issue 10), 64-row tiles for the smaller M, and for the larger K
# 256-row tiles, 128-deep K steps and deeper pipelines.
CANDIDATES = [
    (128, 64, 64, 8, 3, 8), (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 3, 8), (64, 64, 64, 8, 3, 4), (64, 128, 64, 8, 3, 4),
    (256, 64, 64, 8, 3, 8), (128, 64, 128, 8, 3, 8), (128, 64, 64, 8, 4, 8), (128, 64, 64, 8, 5, 8),
]
TOY_CANDIDATES = [(16, 16, 32, 4, 2, 4), (32, 16, 32, 4, 2, 4)]
# One shape's timing is noisy: the fused kernel must win by this much to serve.
MARGIN = 1.02


def run(device: torch.device, shapes: dict, ms: list[int], dtype: torch.dtype, candidates: list[tuple]) -> list[dict]:
    from kernels.select import ops_for
    from kernels.swiglu_gemm.triton_swiglu_gemm import SwigluConfig, swiglu_linear

    time_ms = kernel_timer(device)
    act = ops_for(device).silu_and_mul
    rows = []
    for model, (n, k) in shapes.items():
        for m in ms:
            nbytes = (m * k + n * k) * torch.finfo(dtype).bits // 8
            copies = copies_for(nbytes) if device.type == "cuda" else 1
            xs = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(copies)]
            ws = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for _ in range(copies)]
            want = act(F.linear(xs[0], ws[0])).float()
            t_unfused = time_ms([lambda x=x, w=w: act(F.linear(x, w)) for x, w in zip(xs, ws)])
            best, t_best = None, float("inf")
            for tiles in candidates:
                cfg = SwigluConfig(*tiles)
                got = swiglu_linear(xs[0], ws[0], cfg).float()
                err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
                assert err < 2e-2, f"{model} M={m} {tiles}: relative error {err:.3g}"
                t = time_ms([lambda x=x, w=w, cfg=cfg: swiglu_linear(x, w, cfg) for x, w in zip(xs, ws)])
                if t < t_best:
                    best, t_best = list(tiles), t
            flops = 2 * m * n * k
            rows.append(dict(model=model, n=n, k=k, m=m, fused_ms=t_best, unfused_ms=t_unfused, ratio=t_unfused / t_best,
                             fused_tflops=flops / t_best / 1e9, config=best))
            print(f"{model} {n}x{k} M={m}: fused {t_best * 1e3:.1f} us {best}, unfused {t_unfused * 1e3:.1f} us", flush=True)
            del xs, ws
    return rows


def shape_entries(rows: list[dict]) -> dict[str, dict]:
    """Per weight shape: ``min_m`` (the smallest measured M from which the fused kernel beat
    the unfused path by ``MARGIN`` at every larger measured M) and the tiles per M; shapes
    where it lost at the largest M get no entry."""
    out = {}
    for key in sorted({thr.shape_key(r["n"], r["k"]) for r in rows}):
        mine = sorted((r for r in rows if thr.shape_key(r["n"], r["k"]) == key), key=lambda r: -r["m"])
        min_m = None
        for r in mine:
            if r["ratio"] < MARGIN:
                break
            min_m = r["m"]
        if min_m is not None:
            out[key] = {"min_m": min_m, "configs": {str(r["m"]): r["config"] for r in mine if r["m"] >= min_m}}
    return out


def worst_rows(runs: list[list[dict]]) -> list[dict]:
    """Per shape and M, the row of the run where the fused kernel did worst against the
    unfused path (its tiles with it)."""
    worst: dict[tuple, dict] = {}
    for rows in runs:
        for r in rows:
            key = (r["n"], r["k"], r["m"])
            if key not in worst or r["ratio"] < worst[key]["ratio"]:
                worst[key] = r
    return list(worst.values())


def write_threshold(rows: list[dict], device_name: str, commit: str | None = None, date: str | None = None) -> dict[str, dict]:
    """Replace the device's entry in threshold.json; returns its shapes."""
    shapes = shape_entries(rows)
    data = json.loads(thr.THRESHOLD_FILE.read_text())
    thr.parse_thresholds(data)
    data.setdefault("devices", {})[device_name] = {
        "shapes": shapes,
        "date": date or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or git_commit(),
        "ratios": {f"{thr.shape_key(r['n'], r['k'])}@{r['m']}": round(r["ratio"], 3) for r in rows},
    }
    thr.THRESHOLD_FILE.write_text(json.dumps(data, indent=2) + "\n")
    thr.reload()
    return shapes


def main() -> None:
    ap = kernel_bench_parser(__doc__, "store, per gate/up shape, the smallest M from which the fused kernel wins, and its tiles, for this GPU (GPU only)")
    ap.add_argument("--threshold-from", default=None, nargs="+", metavar="JSON",
                    help="write threshold.json from saved runs' --out files of one device instead of measuring; with several, "
                         "each shape and M keeps its worst run (the kernel must have won in every run)")
    args = ap.parse_args()
    if args.threshold_from:
        runs = [json.loads(Path(f).read_text()) for f in args.threshold_from]
        if len({r["device"] for r in runs}) != 1:
            raise SystemExit(f"--threshold-from: the runs are of different devices: {sorted({r['device'] for r in runs})}")
        last = runs[-1]
        shapes = write_threshold(worst_rows([r["rows"] for r in runs]), last["device"], commit=last.get("commit"), date=last.get("date"))
        print(f"wrote {shapes} for {last['device']} to {thr.THRESHOLD_FILE}")
        return
    toy = args.toy or not torch.cuda.is_available()
    device = torch.device("cpu" if toy else "cuda")
    shapes, ms, candidates = (TOY_SHAPES, TOY_MS, TOY_CANDIDATES) if toy else (SHAPES, MS, CANDIDATES)
    rows = run(device, shapes, ms, torch.float32 if toy else torch.bfloat16, candidates)
    name = "cpu (interpreter: timings mean nothing)" if toy else torch.cuda.get_device_name(device)
    print(f"\n## {name}, torch {torch.__version__}, commit {git_commit()}\n")
    print(table(["model", "N x K", "M", "fused us", "unfused us", "unfused/fused", "fused TFLOP/s", "tiles"],
                [[r["model"], f"{r['n']}x{r['k']}", r["m"], f"{r['fused_ms'] * 1e3:.1f}", f"{r['unfused_ms'] * 1e3:.1f}",
                  f"{r['ratio']:.2f}x", f"{r['fused_tflops']:.0f}", r["config"]] for r in rows]))
    if args.write_threshold and not toy:
        print(f"\nwrote {write_threshold(rows, name)} for {name} to {thr.THRESHOLD_FILE}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, torch=torch.__version__, commit=git_commit(),
                                                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), rows=rows), indent=1))


if __name__ == "__main__":
    main()
