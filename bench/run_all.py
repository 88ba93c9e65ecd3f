"""``make bench``: every benchmark this machine can run, one after another, each bounded.

CPU benchmarks always run (with reduced sizes, so each stays within its time limit);
GPU ones run where CUDA is present. Each benchmark runs as its own process (a
benchmark's threads, caches and servers never leak into the next), with its output
written to ``bench/out/run_all-<date>/<name>.txt`` (git-ignored) (and ``.json`` / ``.md`` where the
benchmark writes one); a progress bar shows which one is running and for how long. The
summary at the end says where each result went, or why it failed. Figures that go into
bench/RESULTS.md still need a quiet machine (DEVELOPERS.md).

``--quick`` runs only the benchmarks that have a quick form (the engine's: host phases,
sync vs async scheduling, and on CUDA gpu_engine), each with fewer steps: a check that
they run and a first look, minutes instead of an hour.

    python -m bench.run_all [--only NAME,...] [--quick] [--list]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Bench:
    name: str
    args: list[str]  # after ``python``; ``{out}`` is the results folder
    limit_s: int
    gpu: bool = False
    needs: list[str] = field(default_factory=list)  # executables on PATH
    what: str = ""
    quick: list[str] | None = None  # with --quick: these args replace ``args``; None: not run


BENCHES = [
    Bench("host_overhead", ["-m", "bench.host_overhead", "--steps", "24", "--out", "{out}/host_overhead.json"], 600,
          what="CPU decode step: host time per phase",
          quick=["-m", "bench.host_overhead", "--steps", "6", "--out", "{out}/host_overhead.json"]),
    Bench("async_scheduling_cpu", ["-m", "bench.async_scheduling", "--reps", "2", "--out", "{out}/async_scheduling_cpu.json"], 900,
          what="CPU decode: sync vs async scheduling at batch 1/8/64",
          quick=["-m", "bench.async_scheduling", "--reps", "1", "--quick", "--out", "{out}/async_scheduling_cpu.json"]),
    Bench("gc_pause", ["-m", "bench.gc_pause", "--out", "{out}/gc_pause.json"], 300,
          what="a full garbage collection of the worker's engine, before and after the startup heap is frozen (GPU engine where CUDA is present)",
          quick=["-m", "bench.gc_pause", "--reps", "3", "--out", "{out}/gc_pause.json"]),
    Bench("cpu_engine", ["-m", "bench.cpu_engine", "--threads", "2", "--out", "{out}/cpu_engine.json"], 900,
          what="CPU engine vs llama.cpp (its columns say 'missing' without llama-cpp-python)"),
    Bench("cpu_linear", ["-m", "bench.cpu_linear_bench", "--threads", "1", "--out", "{out}/cpu_linear.json"], 600,
          what="CPU float32 linears: oneDNN packed weights vs F.linear, one forward's layers and the engine's decode",
          quick=["-m", "bench.cpu_linear_bench", "--threads", "1", "--reps", "2", "--max-tokens", "16", "--out", "{out}/cpu_linear.json"]),
    Bench("pool_throughput", ["bench/pool_throughput.py", "--reps", "2", "--markdown", "{out}/pool_throughput.md"], 600,
          needs=["redis-server", "redis-benchmark"], what="KV pool client vs redis-benchmark"),
    Bench("handoff_probe", ["-m", "bench.handoff_probe", "--nodes", "0,4", "--reps", "5"], 300, needs=["redis-server", "redis-cli"],
          what="one prompt's pool writes and reads in the services' patterns (writer, new keys, decode's runs), one Redis and a 4-node cluster"),
    Bench("bulk_threads", ["-m", "bench.bulk_threads_bench", "--nodes", "4", "--reps", "30"], 300, needs=["redis-server", "redis-cli"],
          what="the bulk path's thread hand-off vs run_in_executor, and a prompt's write/read loop CPU on a 4-node cluster"),
    Bench("pd_vs_engine", ["-m", "bench.pd_vs_engine", "--threads", "1", "--requests", "16", "--concurrency", "8",
                            "--output-len", "uniform:16-32", "--handoff-requests", "3", "--num-blocks", "512"], 900,
          needs=["redis-server"], what="PD through the router vs the in-process engine"),
    Bench("tp_cpu", ["-m", "bench.tp_bench", "--device", "cpu", "--shape", "tiny-qwen2", "--batches", "1,8", "--prefill", "2x256",
                     "--handoff-tokens", "512", "--steps", "16", "--threads", "1", "--num-blocks", "512", "--budget", "512",
                     "--out", "{out}/tp_cpu.json"], 600,
          what="TP=2 vs TP=1 on the CPU (gloo, tiny shape): the benchmark works; its ratios say nothing about GPUs"),
    Bench("gpu_engine", ["-m", "bench.gpu_engine", "--out", "{out}/gpu_engine.json"], 1800, gpu=True,
          what="GPU engine vs transformers and the weights-read floor, three shapes",
          quick=["-m", "bench.gpu_engine", "--quick", "--out", "{out}/gpu_engine.json"]),
    Bench("async_scheduling_gpu", ["-m", "bench.async_scheduling", "--device", "cuda", "--out", "{out}/async_scheduling_gpu.json"], 900,
          gpu=True, what="GPU decode: sync vs async scheduling",
          quick=["-m", "bench.async_scheduling", "--device", "cuda", "--reps", "1", "--quick", "--out", "{out}/async_scheduling_gpu.json"]),
    Bench("spec_cpu", ["-m", "bench.spec_bench", "--threads", "2", "--out", "{out}/spec_cpu.json"], 2400,
          what="CPU speculative decoding vs none: n-gram on copying and chat workloads, a mixed batch, self-draft with and without a pruned vocabulary",
          quick=["-m", "bench.spec_bench", "--threads", "2", "--max-tokens", "64", "--reps", "1", "--only", "copy", "chat", "--out", "{out}/spec_cpu.json"]),
    Bench("gpu_spec", ["-m", "bench.gpu_spec", "--out", "{out}/gpu_spec.json"], 600, gpu=True,
          what="GPU speculation cost: forced acceptance 0/0.5/1, k = 1..8, verify step vs decode step",
          quick=["-m", "bench.gpu_spec", "--ks", "1", "4", "8", "--out", "{out}/gpu_spec.json"]),
    Bench("tp_gpu", ["-m", "bench.tp_bench", "--out", "{out}/tp_gpu.json"], 1800, gpu=True,
          what="TP=2 vs TP=1 (Qwen2.5-7B shape, two GPUs): decode b1/b64, prefill 8x2048, the handoff across layouts"),
    Bench("gpu_profile", ["-m", "bench.gpu_profile"], 600, gpu=True, what="where decode and prefill steps spend GPU time"),
    Bench("prefill_host", ["-m", "bench.prefill_host"], 600, gpu=True, what="where an eager prefill step's host time goes"),
    Bench("attention", ["bench/attention_bench.py", "--markdown", "{out}/attention.md"], 900, gpu=True, what="paged attention kernels"),
    Bench("swap", ["bench/swap_bench.py", "--markdown", "{out}/swap.md"], 600, gpu=True, what="swap kernels vs copies"),
    Bench("fp8_quality", ["-m", "bench.fp8_quality", "--out", "{out}/fp8_quality.json"], 1200,
          what="FP8 weights on SmolLM2 vs float32: greedy agreement, perplexity (CPU)"),
    Bench("fp8_tune", ["-m", "bench.fp8_tune", "--out", "{out}/fp8_gemm_configs.json"], 300, gpu=True,
          what="FP8 GEMM tile tuning (its table goes to the results folder, not kernels/fp8)"),
    Bench("fp8_gemm", ["-m", "bench.fp8_gemm_bench", "--out", "{out}/fp8_gemm.json"], 300, gpu=True,
          what="FP8 GEMM (swap-AB, normal) vs torch._scaled_mm and bf16"),
    Bench("fp8_decode", ["-m", "bench.fp8_decode_bench", "--out", "{out}/fp8_decode.json"], 300, gpu=True,
          what="decode ms/step, Llama-3.2-1B shape, FP8 vs bf16"),
    Bench("moe_fp8", ["-m", "bench.moe_fp8_bench", "--out", "{out}/moe_fp8.json"], 600, gpu=True,
          what="FP8 MoE experts (grouped GEMMs and the layer) vs bf16 ours and torch._grouped_mm"),
]


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def run(bench: Bench, out: Path, bar: tqdm, *, quick: bool = False) -> tuple[str, str]:
    """(status, where): status is ok, failed (exit code), timeout or skipped."""
    missing = [n for n in bench.needs if shutil.which(n) is None]
    if missing:
        return "skipped", f"needs {', '.join(missing)}"
    log = out / f"{bench.name}.txt"
    args = bench.quick if quick and bench.quick is not None else bench.args
    cmd = [sys.executable, *(a.replace("{out}", str(out)) for a in args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"$ {' '.join(cmd[1:])}\n\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        shown = -1e9
        every = 1.0 if sys.stderr.isatty() else 60.0  # a log file gets a line a minute
        while proc.poll() is None:
            elapsed = time.monotonic() - t0
            if elapsed - shown >= every:
                bar.set_postfix_str(f"{bench.name} {elapsed:.0f}s / {bench.limit_s}s")
                shown = elapsed
            if elapsed > bench.limit_s:
                proc.kill()
                proc.wait()
                return "timeout", str(log)
            time.sleep(0.5)
    produced = sorted(p for p in out.glob(f"{bench.name}*") if p != log)
    where = ", ".join(str(p.relative_to(ROOT)) for p in [log, *produced])
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated benchmark names")
    ap.add_argument("--quick", action="store_true", help="only the benchmarks with a quick form, shortened")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = ap.parse_args(argv)
    gpu = cuda_available()
    chosen = [b for b in BENCHES if args.only is None or b.name in args.only.split(",")]
    if args.list:
        for b in chosen:
            print(f"{b.name:24} {'GPU' if b.gpu else 'CPU'}  <= {b.limit_s}s  {'quick ' if b.quick else '      '}{b.what}")
        return 0
    out = ROOT / "bench" / "out" / f"run_all-{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}"
    out.mkdir(parents=True, exist_ok=True)
    todo = [b for b in chosen if (gpu or not b.gpu) and (not args.quick or b.quick is not None)]
    summary = [(b.name, "skipped", "no CUDA here") for b in chosen if b.gpu and not gpu]
    summary += [(b.name, "skipped", "no quick form") for b in chosen if args.quick and b.quick is None and (gpu or not b.gpu)]
    with tqdm(todo, desc="benchmarks", unit="bench") as bar:
        for b in bar:
            summary.append((b.name, *run(b, out, bar, quick=args.quick)))
    print(f"\nresults in {out.relative_to(ROOT)}/ (record figures in bench/RESULTS.md with device, date and commit)\n")
    width = max(len(n) for n, _, _ in summary)
    for name, status, where in summary:
        print(f"  {name:{width}}  {status:18}  {where}")
    return 0 if all(s in ("ok", "skipped") for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
