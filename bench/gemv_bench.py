"""The Triton skinny GEMM (kernels/gemv) against cuBLAS at decode sizes, and the threshold
the model's dispatch reads.

The projections of a decode step, N x K, for SmolLM2-135M (qkv 960 x 576, o 576 x 576,
gate/up 3072 x 576, down 576 x 1536, LM head 49152 x 576) and Llama-3.2-1B (3072 x 2048,
2048 x 2048, 16384 x 2048, 2048 x 8192, 128256 x 2048) and Qwen2.5-7B (4608 x 3584,
3584 x 3584, 37888 x 3584, 3584 x 18944, 152064 x 3584), and one rank's shard of Qwen2.5-7B
at tensor-parallel size 2 (2304 x 3584, 3584 x 1792, 18944 x 3584, 3584 x 9472, 76032 x 3584),
at M in {1, 2, 4, 8, 16, 32, 64},
in bf16, all in one run on one GPU:

- ours: ``triton_gemv.skinny_linear``; qkv and gate/up as ``norm_skinny_linear`` (the
  residual add and RMSNorm before them folded in), down with the SiLU-and-multiply
  folded in (``silu_mul=True``, its input the ``[M, 2K]`` gate/up output);
- cuBLAS: ``F.linear`` (what the model runs otherwise), after the Triton add-and-norm
  kernel for qkv and gate/up and the SiLU-and-multiply kernel for down, as the model runs
  them (so both columns time the same work).

Every figure is a CUDA-graph replay with the weights cold in L2 (bench/gpu_timing.py),
as a decode step's graph runs them. Each output is checked against the reference first.
Ratios are cuBLAS / ours (above 1: ours faster); "step GEMMs" sums a model's projections
over its layers plus the LM head at that M, as one decode step runs them.

``--tune`` times every configuration of ``triton_gemv.candidates`` per shape and M and
counts ours as the fastest (the heuristic's time is kept beside it). ``--write-threshold``
stores, in kernels/gemv/threshold.json under this GPU's name, the largest M of the sweep
up to which ours beats cuBLAS on every model's step-GEMM sum (for shapes the sweep did not
measure), per measured shape the largest M up to which ours beats cuBLAS at every M (so
the dispatch never takes the kernel where it lost), and the configuration used per shape
and M, with the date and timings. ``--threshold-from`` writes the same from a saved run.

    python -m bench.gemv_bench [--tune] [--write-threshold] [--out bench/results/gemv_h100.json]
    python -m bench.gemv_bench --threshold-from bench/results/gemv_h100.json
    TRITON_INTERPRET=1 python -m bench.gemv_bench --toy   # checks the script on the CPU
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from bench.common import git_commit, kernel_bench_parser, table
from bench.gpu_timing import copies_for, kernel_timer
from kernels.gemv import reference as ref
from kernels.gemv import threshold as thr
from kernels.pdl import pdl_enabled

# name -> (layers, [(projection, N, K)]). What is folded into ours (and run before cuBLAS as
# the model runs it): the residual add and RMSNorm into qkv and gate/up, SwiGLU into down.
MODELS = {
    "smollm2-135m": (30, [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]),
    "llama-3.2-1b": (16, [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192), ("lm_head", 128256, 2048)]),
    "qwen2.5-7b": (28, [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944), ("lm_head", 152064, 3584)]),
    # One rank of TP=2 (libs/model/parallel.py): column-parallel qkv, gate/up and LM head
    # halved along N, row-parallel o and down along K.
    "qwen2.5-7b-tp2": (28, [("qkv", 2304, 3584), ("o", 3584, 1792), ("gate_up", 18944, 3584), ("down", 3584, 9472), ("lm_head", 76032, 3584)]),
}
NORM_BEFORE = {"qkv", "gate_up"}
TOY_MODELS = {"toy": (2, [("qkv", 96, 64), ("down", 64, 96), ("lm_head", 200, 64)])}
MS = [1, 2, 4, 8, 16, 32, 64]
TOY_MS = [1, 4, 16]
EPS = 1e-5


def projection(name: str, m: int, k: int, device: torch.device, dtype: torch.dtype):
    """``(ours(w, cfg), cublas(w), reference(w))`` for one projection at M = ``m``: callables
    on fresh random inputs, each with what the model folds in or runs first."""
    from kernels.gemv import triton_gemv
    from kernels.select import ops_for

    ops = ops_for(device)
    if name in NORM_BEFORE:
        h, residual = torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, k, device=device, dtype=dtype)
        nw = 1 + 0.1 * torch.randn(k, device=device, dtype=dtype)
        return (
            lambda w, cfg=None: triton_gemv.norm_skinny_linear(h, residual, nw, EPS, w, config_override=cfg, static_weight=True)[0],
            lambda w: torch.nn.functional.linear(ops.fused_add_rms_norm(h, residual, nw, EPS)[0], w),
            lambda w: ref.norm_skinny_linear(h.float(), residual.float(), nw.float(), EPS, w.float())[0],
        )
    fused = name == "down"
    x = torch.randn(m, 2 * k if fused else k, device=device, dtype=dtype)
    return (
        lambda w, cfg=None: triton_gemv.skinny_linear(x, w, silu_mul=fused, config_override=cfg, static_weight=True),
        (lambda w: torch.nn.functional.linear(ops.silu_and_mul(x), w)) if fused else (lambda w: torch.nn.functional.linear(x, w)),
        lambda w: ref.skinny_linear(x.float(), w.float(), silu_mul=fused),
    )


def run(device: torch.device, models: dict, ms: list[int], dtype: torch.dtype, tune: bool = False,
        budget_s: float | None = None) -> list[dict]:
    """``budget_s``: with ``tune``, the seconds after which the remaining shapes keep the
    heuristic's configuration (compiling every candidate takes minutes on a fresh machine)."""
    from kernels.gemv import triton_gemv

    time_ms = kernel_timer(device)
    t0 = time.monotonic()
    rows = []
    for model, (_, shapes) in models.items():
        for name, n, k in shapes:
            weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            n_copies = copies_for(weight.numel() * weight.element_size()) if device.type == "cuda" else 1
            weights = [weight] + [weight.clone() for _ in range(n_copies - 1)]
            for m in ms:
                ours, cublas, reference = projection(name, m, k, device, dtype)
                want = reference(weight)

                def check(cfg) -> None:
                    err = (ours(weight, cfg).float() - want).norm() / want.norm().clamp_min(1e-12)
                    assert err < 2e-2, f"{model} {name} M={m} {cfg}: relative error {err:.3g}"

                best_cfg = triton_gemv.config(m, n, k, device)
                check(best_cfg)
                t_ours = t_heuristic = time_ms([lambda w=w: ours(w, best_cfg) for w in weights])
                tuning = tune and (budget_s is None or time.monotonic() - t0 < budget_s)
                for cfg in triton_gemv.candidates(m, n, k) if tuning else []:
                    check(cfg)
                    t = time_ms([lambda w=w, cfg=cfg: ours(w, cfg) for w in weights])
                    if t < t_ours:
                        best_cfg, t_ours = cfg, t
                t_cublas = time_ms([lambda w=w: cublas(w) for w in weights])
                gbps = weight.numel() * weight.element_size() / (t_ours * 1e-3) / 1e9
                rows.append(dict(model=model, proj=name, n=n, k=k, m=m, ours_ms=t_ours, cublas_ms=t_cublas,
                                 ratio=t_cublas / t_ours, ours_gb_s=gbps, config=list(best_cfg), untuned_ms=t_heuristic, tuned=tuning))
                print(f"{model} {name} {n}x{k} M={m}: ours {t_ours * 1e3:.2f} us, cuBLAS {t_cublas * 1e3:.2f} us", flush=True)
    return rows


def step_sums(rows: list[dict], models: dict) -> list[dict]:
    """Per model and M: the decode step's GEMMs (projections x layers, plus the LM head)."""
    out = []
    for model, (layers, shapes) in models.items():
        for m in sorted({r["m"] for r in rows if r["model"] == model}):
            mine = {r["proj"]: r for r in rows if r["model"] == model and r["m"] == m}
            ours = sum(mine[p]["ours_ms"] * (1 if p == "lm_head" else layers) for p, _, _ in shapes)
            cublas = sum(mine[p]["cublas_ms"] * (1 if p == "lm_head" else layers) for p, _, _ in shapes)
            out.append(dict(model=model, m=m, ours_ms=ours, cublas_ms=cublas, ratio=cublas / ours))
    return out


def choose_threshold(sums: list[dict]) -> int:
    """The largest M up to which ours wins every model's step sum at every M (0: none)."""
    best = 0
    for m in sorted({s["m"] for s in sums}):
        if all(s["ratio"] > 1.0 for s in sums if s["m"] == m):
            best = m
        else:
            break
    return best


# A single projection's timing is noisier than a step's sum: per shape, ours must win by
# this much to serve.
SHAPE_MARGIN = 1.02


def shape_thresholds(rows: list[dict]) -> dict[str, int]:
    """Per weight shape ``NxK``: the largest measured M up to which ours beat cuBLAS by
    ``SHAPE_MARGIN`` (each with what the model folds in or runs first) at every measured
    M of that shape, in every model that has it (0: not even at M = 1)."""
    out: dict[str, int] = {}
    for key in sorted({thr.shape_key(r["n"], r["k"]) for r in rows}):
        mine = [r for r in rows if thr.shape_key(r["n"], r["k"]) == key]
        best = 0
        for m in sorted({r["m"] for r in mine}):
            if all(r["ratio"] >= SHAPE_MARGIN for r in mine if r["m"] == m):
                best = m
            else:
                break
        out[key] = best
    return out


def heuristic_rows(rows: list[dict]) -> list[dict]:
    """The rows with ours timed at the heuristic's tiles (``untuned_ms``): what a shape the
    sweep did not measure gets."""
    return [{**r, "ours_ms": r.get("untuned_ms", r["ours_ms"])} for r in rows]


def write_threshold(rows: list[dict], models: dict, device_name: str, commit: str | None = None, date: str | None = None,
                    partial: bool = False) -> int:
    """Store the device's entry in threshold.json (``commit`` and ``date``: the measured
    run's, when it is rewritten from a saved one). The device-wide ``max_m`` serves the
    shapes the sweep did not measure, with the heuristic's tiles, so it is chosen on the
    heuristic's step sums: chosen on the tuned ones (Qwen2.5-7B 1.02x at M = 1 on the H200)
    it sent Llama-3-8B's bf16 decode to the skinny GEMM, 4.4 -> 7.0 ms a step.

    ``partial`` (a sweep of some of the models, ``--models``): only the measured shapes'
    limits, tiles and step sums are replaced; the device-wide ``max_m`` and every other
    shape's entries stay as the last full sweep left them."""
    sums = step_sums(rows, models)
    date, commit = date or datetime.now(timezone.utc).isoformat(timespec="seconds"), commit or git_commit()
    data = json.loads(thr.THRESHOLD_FILE.read_text())
    thr.parse_thresholds(data)
    previous = data.setdefault("devices", {}).get(device_name, {})
    max_m = previous.get("max_m", 0) if partial else choose_threshold(step_sums(heuristic_rows(rows), models))
    # The FP8 weights' tiles (``NxK:fp8``) are bench/fp8_gemm_bench.py's sweep's, and stay;
    # after a partial sweep, so does every shape it did not measure.
    kept = (lambda key: True) if partial else (lambda key: key.endswith(":fp8"))
    configs = {key: tiles for key, tiles in previous.get("configs", {}).items() if kept(key)}
    measured = {thr.shape_key(r["n"], r["k"]) for r in rows}
    for key in measured:
        configs.pop(key, None)
    for r in rows:
        configs.setdefault(thr.shape_key(r["n"], r["k"]), {})[str(r["m"])] = r["config"]
    step_sums_ms = {f"{s['model']}@{s['m']}": {"ours": s["ours_ms"], "cublas": s["cublas_ms"]} for s in sums}
    data["devices"][device_name] = {
        "max_m": max_m,
        "max_m_by_shape": {**(previous.get("max_m_by_shape", {}) if partial else {}), **shape_thresholds(rows)},
        "configs": configs,
        # a partial sweep leaves the full sweep's date and commit, and adds its own to ``partial_sweeps``
        "date": previous.get("date") if partial else date,
        "commit": previous.get("commit") if partial else commit,
        "step_sums_ms": {**(previous.get("step_sums_ms", {}) if partial else {}), **step_sums_ms},
        # bench/fp8_gemm_bench.py's part of the entry (the FP8 skinny limits) is its own to rewrite
        **{key: value for key, value in previous.items() if key.startswith("fp8_")},
    }
    if partial:
        sweep = {"models": list(models), "date": date, "commit": commit}
        data["devices"][device_name]["partial_sweeps"] = [*previous.get("partial_sweeps", []), sweep]
    thr.THRESHOLD_FILE.write_text(json.dumps(data, indent=2) + "\n")
    thr.reload()
    return max_m


def main() -> None:
    ap = kernel_bench_parser(__doc__, "store the measured M threshold (and with --tune the fastest tiles) for this GPU (GPU only)")
    ap.add_argument("--tune", action="store_true", help="time every candidate configuration per shape and M; ours = the fastest")
    ap.add_argument("--tune-budget-s", type=float, default=None, help="stop tuning after this many seconds (the rest keep the heuristic)")
    ap.add_argument("--models", type=lambda v: v.split(","), default=None,
                    help=f"sweep only these ({', '.join(MODELS)}); --write-threshold then replaces only their shapes' entries")
    ap.add_argument("--ms", type=lambda v: [int(x) for x in v.split(",")], default=None, help=f"the M values (default {MS})")
    ap.add_argument("--threshold-from", default=None, metavar="JSON",
                    help="write threshold.json from a saved run's --out file (its device, rows and commit) instead of measuring")
    args = ap.parse_args()
    if args.threshold_from:
        saved = json.loads(Path(args.threshold_from).read_text())
        measured = json.loads(thr.THRESHOLD_FILE.read_text()).get("devices", {}).get(saved["device"], {})
        max_m = write_threshold(saved["rows"], MODELS, saved["device"], commit=saved.get("commit"), date=saved.get("date", measured.get("date")))
        print(f"wrote max_m = {max_m} and per shape {shape_thresholds(saved['rows'])} for {saved['device']} to {thr.THRESHOLD_FILE}")
        return
    toy = args.toy or not torch.cuda.is_available()
    device = torch.device("cpu" if toy else "cuda")
    models, ms = (TOY_MODELS, TOY_MS) if toy else (MODELS, MS)
    partial = args.models is not None and not toy
    if partial:
        unknown = set(args.models) - set(MODELS)
        if unknown:
            raise SystemExit(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
        models = {m: MODELS[m] for m in args.models}
    ms = args.ms or ms
    rows = run(device, models, ms, torch.float32 if toy else torch.bfloat16, tune=args.tune, budget_s=args.tune_budget_s)
    sums = step_sums(rows, models)
    name = "cpu (interpreter: timings mean nothing)" if toy else torch.cuda.get_device_name(device)
    pdl = pdl_enabled(device)  # ours overlaps the previous kernel's tail with it (kernels/pdl), cuBLAS does not
    print(f"\n## {name}, torch {torch.__version__}, commit {git_commit()}, PDL {'on' if pdl else 'off'}\n")
    print(table(["model", "proj", "N x K", "M", "ours us", "cuBLAS us", "cuBLAS/ours", "ours GB/s", "config (BM, BN, BK, warps)", "untuned us"],
                [[r["model"], r["proj"], f"{r['n']}x{r['k']}", r["m"], f"{r['ours_ms'] * 1e3:.2f}", f"{r['cublas_ms'] * 1e3:.2f}",
                  f"{r['ratio']:.2f}x", f"{r['ours_gb_s']:.0f}", r["config"], f"{r['untuned_ms'] * 1e3:.2f}"] for r in rows]))
    print("\nstep projections with their norms and activation (x layers, + LM head):\n")
    print(table(["model", "M", "ours us", "cuBLAS us", "cuBLAS/ours"],
                [[s["model"], s["m"], f"{s['ours_ms'] * 1e3:.1f}", f"{s['cublas_ms'] * 1e3:.1f}", f"{s['ratio']:.2f}x"] for s in sums]))
    if args.write_threshold and not toy:
        print(f"\nwrote max_m = {write_threshold(rows, models, name, partial=partial)} and per shape {shape_thresholds(rows)} for {name} to {thr.THRESHOLD_FILE}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, torch=torch.__version__, commit=git_commit(), pdl=pdl,
                                                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"), rows=rows, step_sums=sums), indent=1))


if __name__ == "__main__":
    main()
