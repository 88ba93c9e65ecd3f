"""PD serving through the router against the in-process engine, on this machine, one run.

1. Throughput at 16 concurrent streams: the same seeded workload through the in-process
   engine (``AsyncEngine``, no HTTP) and through Redis + cache_store + router + prefill +
   decode as processes (``services.launch``). Goal: PD >= 0.8x the in-process throughput.
2. Handoff share of TTFT for 1024-token prompts: one request at a time through PD, its
   trace giving the pool write (prefill) and pool read (decode) times. Goal: <= 10%.

Both PD parts run with the streamed handoff on and off (``--stream-handoff both``, the
default; per request, in one cluster), each mode on its own prompts so that neither
finds the other's blocks cached. With streaming, the pool time that counts is the part
not overlapped with prefill's compute: from the end of compute to the end of decode's
loads (the traces' wall-clock stamps, one host).

On a GPU (``--device cuda``) both sides run random weights of SmolLM2-135M's shape, bf16
(``--tokenizer``: its tokenizer files; the GGUF cannot travel to the lent machines), and
the PD rows also say how much CPU each service process used per second of the run: the
router, prefill and decode are Python event loops (decode's shares its GIL with the
engine's step thread), and at GPU speed one of them at a full core is the limit.

    python -m bench.pd_vs_engine [--threads 2] [--requests 48] [--stream-handoff both|on|off] [--prefill-chunk 256]
    python -m bench.pd_vs_engine --device cuda --tokenizer DIR --concurrency 64 --requests 384 \
        --prompt-len fixed:128 --output-len fixed:128 --handoff-requests 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import subprocess
import sys
from dataclasses import asdict

import aiohttp
import torch

from bench.common import table, write_json
from bench.loadgen import HEADERS, EngineTarget, HttpTarget, Report, Request, run, sse_chunks, workload
from libs.engine import EngineConfig, LLM
from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.processes import free_port


def gpu_model(tokenizer: str | None) -> str:
    """The random SmolLM2-shaped checkpoint the GPU runs serve (bench/gpu_pd.py's, made once)."""
    from bench.gpu_pd import random_checkpoint

    if not tokenizer:
        raise SystemExit("--device cuda needs --tokenizer (SmolLM2's tokenizer files, for the random checkpoint)")
    return random_checkpoint(Path(tokenizer))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.device == "cuda":
        return EngineConfig(model=gpu_model(args.tokenizer), device="cuda", dtype="auto", max_model_len=4096, kv_cache_gb=4)
    return EngineConfig(device="cpu", num_threads=args.threads, num_blocks=args.num_blocks, quantized_weights=args.quantized)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_pids(cluster: LocalCluster) -> dict[str, int]:
    children = {"router": cluster.router, "prefill": cluster.prefills[0], "decode": cluster.decodes[0],
                "cache_store": cluster.cache_store, "redis": cluster.redis}
    return {name: c.proc.pid for name, c in children.items() if c is not None and c.proc is not None}


async def in_process(reqs, concurrency: int, args: argparse.Namespace):
    torch.set_num_threads(args.threads)
    target = EngineTarget(LLM(engine_config(args)))
    try:
        await run(target, reqs[:4], 4)  # warm-up
        return await run(target, reqs, concurrency)
    finally:
        await target.close()


def mode_extra(on: bool) -> dict:
    return {"tidepool": {"stream_handoff": on}}


def distinct(reqs, salt: int):
    """The same workload with different prompts: a new first token changes every block key."""
    return [Request([(r.prompt[0] + salt) % 49152 or 1, *r.prompt[1:]], r.max_tokens) for r in reqs]


async def through_pd(url: str, reqs, concurrency: int, on: bool, pids: dict[str, int]) -> tuple[Report, dict[str, float]]:
    """The report, and each service's CPU seconds per second of the measured run."""
    target = await HttpTarget.connect(url, mode_extra(on))
    try:
        await run(target, reqs[:4], 4)
        before, t0 = {n: cpu_seconds(p) for n, p in pids.items()}, time.perf_counter()
        report = await run(target, reqs, concurrency)
        wall = time.perf_counter() - t0
        return report, {n: (cpu_seconds(p) - before[n]) / wall for n, p in pids.items()}
    finally:
        await target.close()


async def handoff_share(url: str, n: int, on: bool, prompt_len: int = 1024) -> list[dict]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        for req in workload(n + 1, f"fixed:{prompt_len}", "fixed:4", seed=99 if on else 100):
            body = {"model": model, "prompt": req.prompt, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True,
                    "tidepool": {"trace": True, "stream_handoff": on}}
            t0, ttft, trace = time.perf_counter(), None, None
            async with s.post(url + "/v1/completions", json=body) as r:
                async for chunk in sse_chunks(r):
                    if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        ttft = time.perf_counter() - t0
                    trace = chunk.get("tidepool", {}).get("trace", trace)
            p = trace["prompts"][0]
            dec = p["choices"][0]["attempts"][0]["worker"]
            write = p["prefill"]["timings"].get("write_s", 0.0)  # prefill's writes after its compute
            read = dec.get("load_s", 0.0)
            exposed = max(0.0, dec.get("load_done_at", 0.0) - p["prefill"]["worker"].get("compute_done_at", 0.0))
            out.append({"ttft_s": ttft, "write_s": write, "read_s": read, "exposed_s": exposed,
                        "compute_s": p["prefill"]["timings"].get("compute_s", 0.0)})
    return out[1:]  # the first warms up


def in_process_subprocess(args: argparse.Namespace) -> Report:
    """The in-process side, in a process of its own like every PD service: measured in the
    benchmark's own process, the engine was seen to leave the services behind it slower."""
    argv = [sys.executable, "-m", "bench.pd_vs_engine", "--in-process-only", "--threads", str(args.threads),
            "--concurrency", str(args.concurrency), "--requests", str(args.requests), "--prompt-len", args.prompt_len,
            "--output-len", args.output_len, "--num-blocks", str(args.num_blocks), *(["--quantized"] if args.quantized else []),
            "--device", args.device, *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return Report(**json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="torch threads: in-process engine, and each of prefill/decode")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", default="uniform:64-256")
    ap.add_argument("--output-len", default="uniform:48-96")
    ap.add_argument("--quantized", action="store_true", help="both sides decode with the GGUF's 4-bit weights")
    ap.add_argument("--handoff-requests", type=int, default=7)
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV cache blocks of each engine (in-process, prefill, decode)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="prefill's --max-num-batched-tokens (default: the engine's, 1024 on the CPU)")
    ap.add_argument("--stream-handoff", choices=["both", "on", "off"], default="both", help="PD with the streamed handoff, the serial one, or both")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: random SmolLM2-shaped weights, bf16 (needs --tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="with --device cuda: folder with SmolLM2's tokenizer files")
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    ap.add_argument("--in-process-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    reqs = workload(args.requests + 4, args.prompt_len, args.output_len, seed=1)
    if args.in_process_only:
        print(json.dumps(asdict(asyncio.run(in_process(reqs[4:], args.concurrency, args)))))
        return
    local = in_process_subprocess(args)
    chunk = ["--max-num-batched-tokens", str(args.prefill_chunk)] if args.prefill_chunk else []
    if args.device == "cuda":
        model, worker = gpu_model(args.tokenizer), ["--max-model-len", "4096", "--kv-cache-gb", "4"]
    else:
        model, worker = None, ["--num-blocks", str(args.num_blocks), *(["--quantized-weights"] if args.quantized else [])]
    cfg = ClusterConfig(router_port=free_port(), model=model, device=args.device, threads=args.threads, log_dir=Path(".run/bench-logs"),
                        pool_gb=8.0 if args.device == "cuda" else 1.0,
                        worker_args=worker, prefill_args=chunk,
                        router_args=["--heartbeat-timeout-s", "60"])  # a loaded box must not drop instances mid-run
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.stream_handoff]
    hand, pd, cpu = {}, {}, {}
    with LocalCluster(cfg) as cluster:
        for on in modes:  # an idle system: one request at a time
            if args.handoff_requests:
                hand[on] = asyncio.run(handoff_share(cluster.url, args.handoff_requests, on))
        for i, on in enumerate(modes):
            pd[on], cpu[on] = asyncio.run(through_pd(cluster.url, distinct(reqs[4:], 1 + i), args.concurrency, on, service_pids(cluster)))
    label = {True: "streamed handoff", False: "serial handoff"}
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()}, {os.cpu_count()} cores"
    print(f"\n{where}, {args.threads} torch threads per model process, "
          f"{args.requests} requests, prompts {args.prompt_len}, outputs {args.output_len}, {args.concurrency} concurrent\n")
    print(table(HEADERS, [local.row("in-process engine"), *(pd[on].row(f"PD through the router, {label[on]}") for on in modes)]))
    for on in modes:
        print(f"\nPD ({label[on]}) / in-process throughput: {pd[on].throughput / local.throughput:.2f}x (goal >= 0.8x); "
              "CPU seconds per second of the run: " + ", ".join(f"{n} {v:.2f}" for n, v in cpu[on].items()))
    write_json({"args": vars(args), "in_process": asdict(local), "device": where,
                "pd": {label[on]: {**asdict(pd[on]), "cpu_per_s": cpu[on]} for on in modes}}, args.out)
    for on in hand:
        med = {k: statistics.median(h[k] for h in hand[on]) for k in hand[on][0]}
        share = (med["write_s"] + med["read_s"]) / med["ttft_s"]
        print(f"\n1024-token prompts, {label[on]}, median of {len(hand[on])}: TTFT {med['ttft_s'] * 1e3:.0f} ms (prefill compute {med['compute_s'] * 1e3:.0f} ms); "
              f"pool write after compute {med['write_s'] * 1e3:.1f} ms + read {med['read_s'] * 1e3:.1f} ms (all) = {share * 100:.1f}% of TTFT (goal <= 10%); "
              f"not overlapped with compute (compute end to decode loaded): {med['exposed_s'] * 1e3:.1f} ms = {100 * med['exposed_s'] / med['ttft_s']:.1f}% of TTFT")


if __name__ == "__main__":
    main()
