"""The whole PD path on one machine, against the co-located engine, in one run; and where
the client's time to the second token goes.

Two sides, the same prompt length, greedy, ``ignore_eos``:

- **co-located**: the engine alone in one process (``LLM``, no pool, no HTTP), its
  default chunking: time to the first token (TTFT) and to the second (TTFT plus one decode
  step), in a process of its own; and its TTFT with each prefill chunk as its step budget,
  which tells the cost of chunking itself from the cost of the handoff;
- **PD**: Redis (or a local Redis Cluster, ``--redis-nodes``), cache_store, router,
  prefill and decode as processes (services.launch), the client streaming completions
  through the router. For each pool and each prefill chunk size
  (``--prefill-chunks``: prefill's ``--max-num-batched-tokens``, the piece a streamed
  handoff hands over) and each handoff mode (streamed, and serial: ``stream_handoff``
  false per request, interleaved), fresh prompts every request.

Reported per row (medians): client TTFT and its ratio to the co-located TTFT, time to
the second token and its ratio to the co-located TTFT + one decode step, prefill
compute, and the pool time *not overlapped with compute*: from the end of prefill's
compute to the end of decode's loads (the traces' wall-clock ``compute_done_at`` and
``load_done_at``, comparable on one host), split into prefill's writes after compute
(``write_s``) and decode's reads after the handoff's last update reached it
(``load_tail_s``; all of ``load_s`` when serial), the rest being messages; and the share
of blocks decode loaded before that last update.

Goals (issue 8, judged on an H100 with 2048-token prompts): time to the second token
<= 60 ms, and <= 1.5x the co-located TTFT + one decode step.

On a GPU the models are random weights of SmolLM2-135M's shape saved as a Hugging Face
checkpoint (the GGUF cannot travel to the lent machines; ``--tokenizer`` gives its
tokenizer files), bf16. ``--device cpu`` runs the same script at small scale on the real
SmolLM2 GGUF (float32), for the record and as a check of the script. ``--layers N`` uses a
random checkpoint of N layers on either device (``--tokenizer`` needed): with one layer a
CPU run's compute is small, so the host's own path (the router's front, the messages) can
be timed here, on the 2-core VM:

    python -m bench.gpu_pd --tokenizer DIR [--prompt-len 2048] [--requests 8] [--prefill-chunks 512,1024,2048]
    python -m bench.gpu_pd --device cpu --prompt-len 512 --requests 4 --prefill-chunks 128,512
    python -m bench.gpu_pd --device cpu --layers 1 --tokenizer DIR --prefill-chunks 2048 --redis-nodes 4 --requests 15
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import torch

from bench.common import hf_llama, table
from bench.loadgen import sse_chunks
from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.processes import free_port

VOCAB = 49152
WARMUP = 2


def random_checkpoint(tokenizer_dir: Path, layers: int | None = None, *, root: Path = Path("/tmp")) -> str:
    """The folder of a random SmolLM2-shaped checkpoint (``layers`` of them, default all),
    made once per machine and reused (bench/pd_vs_engine.py's GPU runs serve it too).

    It is written beside its final name and renamed when complete, so a write that failed
    half-way (a missing tokenizer folder, a call cut off) leaves nothing to reuse: a
    lent GPU machine stays warm between calls, and the next call would serve the broken
    folder."""
    folder = root / ("tidepool-random-smollm2" + (f"-{layers}-layers" if layers else ""))
    if not folder.exists():
        partial = root / f".{folder.name}.partial-{os.getpid()}"
        try:
            make_checkpoint(partial, tokenizer_dir, layers)
            try:
                partial.rename(folder)
            except OSError:
                if not folder.exists():
                    raise  # else another process finished first: theirs serves
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return str(folder)


def make_checkpoint(folder: Path, tokenizer_dir: Path, layers: int | None = None) -> None:
    hf = hf_llama(torch.device("cpu"), torch.bfloat16, **({"num_hidden_layers": layers} if layers else {}))
    hf.save_pretrained(folder, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


# -- co-located: one process, no pool --------------------------------------------------------------


def colocated_rows(args: argparse.Namespace, model: str | None) -> dict[str, list[dict]]:
    """Runs in its own process (``--colocated-only``): TTFT and time to the second token,
    with the engine's default step budget (the goal's reference, key ``"default"``) and
    with each prefill chunk as the budget (what chunking alone costs, no pool involved)."""
    from libs.engine import EngineConfig, LLM, SamplingParams

    out: dict[str, list[dict]] = {}
    for budget in [None, *(c for c in args.prefill_chunks if c < args.prompt_len)]:
        cfg = EngineConfig(model=model, device=args.device, dtype="auto", num_threads=args.threads, max_model_len=4096,
                           max_num_batched_tokens=budget,
                           **({"kv_cache_gb": 4} if args.device.startswith("cuda") else {"num_blocks": 512}))
        llm = LLM(cfg)
        rows = []
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i, p in enumerate(prompts(WARMUP + args.requests, args.prompt_len, seed=1)):
            times = []
            t0 = time.perf_counter()
            for ids in llm.stream(p, params):
                times += [time.perf_counter() - t0] * len(ids)
            if i >= WARMUP:
                rows.append({"ttft_s": times[0], "second_token_s": times[1]})
        out["default" if budget is None else str(budget)] = rows
        del llm
    return out


def colocated(args: argparse.Namespace) -> dict[str, list[dict]]:
    argv = [sys.executable, "-m", "bench.gpu_pd", "--colocated-only", "--device", args.device, "--prompt-len", str(args.prompt_len),
            "--requests", str(args.requests), "--threads", str(args.threads), "--prefill-chunks", ",".join(map(str, args.prefill_chunks)),
            *(["--tokenizer", args.tokenizer] if args.tokenizer else []), *(["--layers", str(args.layers)] if args.layers else [])]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- PD through the router -----------------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], stream_handoff: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True,
            "tidepool": {"trace": True, "stream_handoff": stream_handoff}}
    t0, wall0 = time.perf_counter(), time.time()
    first = second = None
    trace = None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in sse_chunks(r):
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                now = time.perf_counter() - t0
                if first is None:
                    first = now
                elif second is None:
                    second = now
            if "tidepool" in chunk:
                trace = chunk["tidepool"]["trace"]
    p = trace["prompts"][0]
    pre, attempt = p["prefill"], p["choices"][0]["attempts"][0]
    dec, t = attempt["worker"], pre["timings"]
    streamed = bool(attempt.get("streamed"))
    read_exposed = dec.get("load_tail_s", 0.0) if streamed else dec.get("load_s", 0.0)
    decode_wait = (dec.get("handoff_wait_s", 0.0) + read_exposed) if streamed else dec.get("load_s", 0.0)
    blocks = max(1, dec.get("pool_hit_blocks", 0) + sum(dec.get("pool_miss_reasons", {}).values()))
    return {
        "stream_handoff": stream_handoff,
        "streamed": streamed,
        "decision": pre.get("decision"),
        "client_ttft_s": first,
        "client_second_token_s": second,
        "prefill_compute_s": t.get("queue_s", 0.0) + t.get("compute_s", 0.0),
        "engine_steps": pre["worker"].get("engine_steps", 0.0),
        "engine_step_s": pre["worker"].get("engine_step_s", 0.0),
        "device_busy_s": pre["worker"].get("device_busy_s", 0.0),
        "write_exposed_s": t.get("write_s", 0.0),
        "read_s": dec.get("load_s", 0.0),
        "read_exposed_s": read_exposed,
        "pool_exposed_s": max(0.0, dec.get("load_done_at", 0.0) - pre["worker"].get("compute_done_at", 0.0)),
        "first_decode_step_s": (dec.get("first_token_s") or 0.0) - decode_wait,
        "early_share": dec.get("early_blocks", 0) / blocks,
        "bytes_written": pre.get("bytes_written", 0),
        "write_fail_reasons": pre["worker"].get("write_fail_reasons", {}),
        "bytes_read": dec.get("bytes_read", 0),
        "timeline": timeline(wall0, pre, dec, first, second),
        "trace": trace,  # the router's whole trace
    }


# (label, where, field): the services' wall-clock phase marks, in the order a request meets them.
PHASES = [
    ("router calls prefill", "router", "called_at"),
    ("prefill receives", "prefill", "received_at"),
    ("prefill job starts", "prefill", "started_at"),  # validated, stream headers sent, block keys hashed
    ("prefill: pool query answered", "prefill", "pool_queried_at"),
    ("engine gets the prompt", "prefill", "engine_at"),
    ("lease asked", "prefill", "lease_started_at"),  # a fresh prompt: once its first step is on the device
    ("lease taken", "prefill", "leased_at"),
    ("compute done", "prefill", "compute_done_at"),
    ("decode receives", "decode", "received_at"),
    ("first blocks in decode staging", "decode", "first_load_done_at"),
    ("writes acknowledged", "prefill", "written_at"),
    ("client: first token", "client", "first"),
    ("decode acts on the last update", "decode", "final_update_at"),  # after any fetch in flight
    ("decode: blocks loaded", "decode", "load_done_at"),
    ("decode engine gets the request", "decode", "engine_at"),
    ("decode engine: first token on the host", "decode", "engine_first_token_at"),
    ("decode: first token out", "decode", "first_token_at"),
    ("client: second token", "client", "second"),
]


def timeline(wall0: float, pre: dict, dec: dict, first: float | None, second: float | None) -> dict[str, float | None]:
    """Each phase mark in seconds since the client sent the request (all on one host);
    ``pre`` is the router's prefill trace (its ``worker``: prefill's own)."""
    client = {"first": first, "second": second}
    where_from = {"router": pre, "prefill": pre["worker"], "decode": dec}
    out: dict[str, float | None] = {}
    for label, where, key in PHASES:
        if where == "client":
            out[label] = client[key]
            continue
        at = where_from[where].get(key)
        out[label] = None if at is None else at - wall0
    return out


async def drive(url: str, args: argparse.Namespace, chunk: int) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async with s.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        fresh = iter(prompts(2 * (args.warmup + args.requests), args.prompt_len, seed=1000 + chunk))
        for _ in range(args.warmup):  # kernels, graphs, connections, both paths (and a small pool filled to its budget)
            for mode in (True, False):
                await one(s, url, model, next(fresh), mode)
        rows = []
        for i in range(args.requests):
            for mode in ((True, False) if i % 2 == 0 else (False, True)):  # interleaved: drift hits both
                rows.append({"chunk": chunk, **await one(s, url, model, next(fresh), mode)})
        return rows


def pool_state(cluster: LocalCluster) -> str:
    """The pool after a row: cache_store's statistics and policy counters, and each Redis
    server's memory (a pool at its budget must still take writes: any refused shows here)."""
    stats = cluster.get_json(cluster.cache_store.url + "/v1/stats")
    pol = stats.get("policy", {})
    keep = ("passes", "evicted_blocks", "memory_evictions", "memory_fill", "last_pass_s")
    ports = cluster.redis_nodes.ports if cluster.redis_nodes is not None else [cluster._redis_port]
    mem = []
    cli = shutil.which("redis-cli")
    for port in ports if cli else []:
        info = subprocess.run([cli, "-p", str(port), "info", "memory"], capture_output=True, text=True).stdout
        f = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        if f.get("maxmemory", "0") != "0":
            mem.append(f"{int(f['used_memory']) / int(f['maxmemory']):.2f} (clients {int(f.get('mem_clients_normal', 0)) / 1e6:.1f} MB)")
    return (f"pool after the row: {stats.get('blocks')} blocks, {stats.get('bytes', 0) / 1e9:.2f} GB, pinned {stats.get('pinned_blocks')}, "
            f"write errors {stats.get('write_errors')}; policy {({k: pol.get(k) for k in keep})}; servers' used/max memory: {', '.join(mem)}")


def cluster_config(args: argparse.Namespace, model: str | None, chunk: int, redis_nodes: int) -> ClusterConfig:
    cuda = args.device.startswith("cuda")
    return ClusterConfig(
        router_port=free_port(), model=model, device=args.device, threads=args.threads, pool_gb=args.pool_gb or (8 if cuda else 2),
        redis_cluster=redis_nodes, redis_args=args.redis_args.split(),
        log_dir=Path("/tmp/tidepool-gpu-pd-logs"),
        worker_args=["--max-model-len", "4096", *(["--kv-cache-gb", "4"] if cuda else ["--num-blocks", "512"]), *args.worker_args.split()],
        prefill_args=["--max-num-batched-tokens", str(chunk)],
        # A generous heartbeat timeout: on a shared, loaded box a missed beat must not drop an instance mid-run.
        router_args=["--prefill-threshold-tokens", "0", "--heartbeat-timeout-s", "60"],
    )


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def pool_name(nodes: int) -> str:
    return "one Redis" if nodes == 0 else f"{nodes}-node cluster"


def report(args: argparse.Namespace, colo: dict[str, list[dict]], rows: list[dict], device: str) -> str:
    colo_ttft, colo_second = med(colo["default"], "ttft_s"), med(colo["default"], "second_token_s")
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    chunked = "; ".join(f"{c}-token chunks: TTFT {ms(med(colo[str(c)], 'ttft_s'))} ms" for c in args.prefill_chunks if str(c) in colo)
    random = args.device.startswith("cuda") or args.layers  # main's choice of checkpoint
    weights = f"random SmolLM2-135M weights, {args.layers or 30} layers" if random else "SmolLM2-135M-Instruct GGUF"
    out = [f"\n{device}: {args.prompt_len}-token prompts, median of {args.requests} per row "
           f"({'bf16' if args.device.startswith('cuda') else 'float32'}, {weights}; "
           f"{args.threads} torch threads per model process; pool {args.pool_gb or 'default'} GB; Redis flags '{args.redis_args}'; worker flags '{args.worker_args}')\n",
           f"co-located engine (one process, no pool): TTFT {ms(colo_ttft)} ms, TTFT + one decode step {ms(colo_second)} ms"
           + (f" (the same engine with its step budget at the prefill chunk, what chunking alone costs: {chunked})" if chunked else "") + "\n"]
    headers = ["pool", "prefill chunk", "handoff", "client TTFT ms", "vs co-located TTFT", "client 2nd token ms", "vs co-located TTFT + 1 step",
               "prefill compute ms (in engine steps / device busy, steps)", "pool not overlapped with compute ms (writes after + reads after)", "pool reads ms (all)", "blocks loaded before the result"]
    body = []
    for nodes in args.redis_nodes:
        for chunk in args.prefill_chunks:
            for mode in (True, False):
                sel = [r for r in rows if r["chunk"] == chunk and r["stream_handoff"] == mode and r["redis_nodes"] == nodes]
                first, second = med(sel, "client_ttft_s"), med(sel, "client_second_token_s")
                body.append([pool_name(nodes), chunk, "streamed" if mode else "serial", ms(first), f"{first / colo_ttft:.2f}x", ms(second),
                             f"{second / colo_second:.2f}x",
                             f"{ms(med(sel, 'prefill_compute_s'))} ({ms(med(sel, 'engine_step_s'))} / {ms(med(sel, 'device_busy_s'))}, "
                             f"{med(sel, 'engine_steps'):.0f})",
                             f"{ms(med(sel, 'pool_exposed_s'))} ({ms(med(sel, 'write_exposed_s'))} + {ms(med(sel, 'read_exposed_s'))})",
                             ms(med(sel, "read_s")), f"{100 * med(sel, 'early_share'):.0f}%"])
    out.append(table(headers, body))
    out.append("\nWhere the time goes: each phase's median, ms since the client sent the request (wall clocks of one host)\n")
    heads, cols = ["phase"], []
    for nodes in args.redis_nodes:
        for chunk in args.prefill_chunks:
            for mode in (True, False):
                sel = [r for r in rows if r["chunk"] == chunk and r["stream_handoff"] == mode and r["redis_nodes"] == nodes]
                heads.append(f"{pool_name(nodes)}, {chunk}, {'streamed' if mode else 'serial'}")
                cols.append(sel)
    lines = []
    for label, _, _ in PHASES:
        cells = []
        for sel in cols:
            vals = [r["timeline"][label] for r in sel if r["timeline"].get(label) is not None]
            cells.append(ms(statistics.median(vals)) if vals else "")
        lines.append([label, *cells])
    out.append(table(heads, lines))
    refused = [r for r in rows if r.get("write_fail_reasons")]
    if refused:  # such a request's decode computed what the pool did not get: not a handoff measurement
        reasons: dict[str, int] = {}
        for r in refused:
            for k, n in r["write_fail_reasons"].items():
                reasons[k] = reasons.get(k, 0) + n
        out.append(f"\n**{len(refused)} of {len(rows)} requests had prefill writes refused** (blocks by reason: {reasons}): "
                   "their decode recomputed the missing tail, so the medians above mix them in.")
    out.append(f"\nKV moved per request: {med(rows, 'bytes_written') / 1e6:.1f} MB written, {med(rows, 'bytes_read') / 1e6:.1f} MB read. "
               "Goals (H100, 2048 tokens): client time to the second token <= 60 ms and <= 1.5x the co-located TTFT + one step.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="CUDA or --layers: folder with SmolLM2's tokenizer files (for the random checkpoint)")
    ap.add_argument("--layers", type=int, default=None, help="a random checkpoint with this many layers, on any device (default: all 30)")
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (small scale, real GGUF)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=8, help="per row (chunk size x handoff mode)")
    ap.add_argument("--prefill-chunks", default=None, help="comma-separated prefill --max-num-batched-tokens values (default: 512,prompt-len)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per model process (default 4 on CUDA, 1 on CPU)")
    ap.add_argument("--redis-nodes", default="0", help="comma-separated pools to run: 0 = one Redis, N = a local N-node Redis Cluster")
    ap.add_argument("--redis-args", default="", help="more redis-server flags, e.g. '--io-threads 4 --io-threads-do-reads yes'")
    ap.add_argument("--pool-gb", type=float, default=None,
                    help="the pool's Redis memory (default 8 on CUDA: every request writes into new server memory); "
                         "a small pool runs at its budget, evicting, as a pool in service does")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help="untimed requests per handoff mode first (enough of them fill a small --pool-gb to its budget)")
    ap.add_argument("--worker-args", default="", help="more prefill and decode flags, e.g. '--pool-workers 8'")
    ap.add_argument("--out", default=None, help="write the rows and the report as JSON here")
    ap.add_argument("--colocated-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.threads = args.threads or (4 if cuda else 1)
    args.prefill_chunks = [int(c) for c in (args.prefill_chunks or f"512,{args.prompt_len}").split(",")]
    args.redis_nodes = [int(n) for n in args.redis_nodes.split(",")]
    model: str | None = None
    if cuda or args.layers:
        if not args.tokenizer:
            ap.error("--tokenizer is required on CUDA and with --layers (the random checkpoint needs SmolLM2's tokenizer files)")
        model = random_checkpoint(Path(args.tokenizer), args.layers)
    if args.colocated_only:
        print(json.dumps(colocated_rows(args, model)))
        return
    colo = colocated(args)
    rows = []
    for nodes in args.redis_nodes:
        for chunk in args.prefill_chunks:
            with LocalCluster(cluster_config(args, model, chunk, nodes)) as cluster:
                got = [{"redis_nodes": nodes, **r} for r in asyncio.run(drive(cluster.url, args, chunk))]
                print(pool_state(cluster), flush=True)
            rows += got
            # As it goes, so that a run cut short by a time limit still says something.
            print(f"{pool_name(nodes)}, {chunk}-token chunks: client 2nd token median "
                  + ", ".join(f"{'streamed' if m else 'serial'} {1e3 * med([r for r in got if r['stream_handoff'] == m], 'client_second_token_s'):.1f} ms"
                              for m in (True, False)), flush=True)
    assert all(r["decision"] == "prefill" and r["streamed"] == r["stream_handoff"] for r in rows), rows
    device = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    text = report(args, colo, rows, device)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "colocated": colo, "pd": rows, "report": text}, indent=1))


if __name__ == "__main__":
    main()
