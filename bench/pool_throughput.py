"""KV pool throughput against redis-benchmark, in one run: one Redis, and Redis Clusters.

One 2048-token prompt of SmolLM2-135M bf16 KV (30 layers, 3 kv heads, head dim 64, block
size 16): 128 blocks of 368,640 B plus the 24-byte header. What prefill and decode do:

- ``encode + put``: ``BlockCodec.encode_pending`` over the staging rows (the header and
  views of the payload, which is never copied), written in chunks of ``pipeline_blocks``
  by ``RedisPool.put_blocks``, all at once (a SET per block and one account script per
  partition and pipeline on the bulk path), each value checksummed by the bulk thread
  that sends it, as prefill stores; vs ``redis-benchmark SET``;
- ``get + decode``: one ``RedisPool.get_blocks_into`` of all 128 blocks straight into the
  staging rows, each verified in place by ``BlockCodec.verify_landed`` (header fields,
  checksum) as soon as it lands, as decode loads; vs ``redis-benchmark GET``;

for each bulk concurrency model (``threads``: blocking ``recv_into``/``sendmsg`` on a thread
pool; ``asyncio``: ``BufferedProtocol`` on uvloop), with ``max_parallel`` sockets per node
and ``pipeline_blocks`` per pipeline; redis-benchmark gets the same shape (``-c`` sockets,
``-P`` pipeline, same value size), twice: with its default single key, and with ``-r``
over as many keys as a prompt has blocks. One key is one value that Redis overwrites and
reads in the CPU's caches; ours, like any pool, touch a prompt's worth (47 MB) of
values, and so does redis-benchmark with ``-r``: both ratios are reported. ``codec
share`` is the CPU time spent in the codec (header and checksum: ``time.thread_time``
summed over the threads that ran it) over the row's wall time: the issue allows 10%. It
overlaps with the transfer (other threads keep moving bytes meanwhile), so it is a cost
in CPU, not all of it in latency.

Then, against local Redis Clusters of 1, 2 and 4 nodes (``--cluster-sizes``): aggregate
``get + decode`` and ``encode + put`` of ``--concurrency`` prompts at once (the pool shards
each prompt over 16 partitions spread over the nodes), dealt over ``--client-processes``
client processes (several prefill and decode instances share one pool; one Python process
is itself a limit at these rates), beside ``redis-benchmark --cluster``
on the same cluster, and the ratio to the 1-node cluster (the goal: >= 2.5x at 4 nodes, on
a host whose cores are not the limit).

GB/s counts value bytes (1 GB = 1e9 B). The machine may be shared, so each repetition runs
redis-benchmark and then ours back to back and the ratio is taken within the repetition.
Staging is pinned when CUDA is available (as in the services), ordinary memory otherwise.
The script starts its own servers (no persistence, ``noeviction``); ``--redis-bin`` points
at another Redis build (the GPU host has none installed: /work/shared/device/README.md)
and ``--redis-args`` passes extra server flags (``--io-threads 4``).

    python bench/pool_throughput.py --markdown bench/results/pool_bulk.md
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import io
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import uvloop  # noqa: E402

from libs.blocks.keys import Namespace, block_keys  # noqa: E402
from libs.kvpool.codec import BlockCodec  # noqa: E402
from libs.kvpool.config import BULK_MODELS, PoolConfig  # noqa: E402
from libs.kvpool.header import HEADER_NBYTES, PendingValue  # noqa: E402
from libs.kvpool.layout import KVLayout  # noqa: E402
from libs.kvpool.redis_pool import RedisPool  # noqa: E402
from services.launch.processes import Child, free_port  # noqa: E402
from services.launch.redis_cluster import LocalRedisCluster  # noqa: E402

LAYOUT = KVLayout(30, 3, 64, 16, torch.bfloat16)  # SmolLM2-135M
PROMPT_TOKENS = 2048
VALUE_NBYTES = LAYOUT.block_nbytes + HEADER_NBYTES


class Prompt:
    """One prompt's blocks in (pinned) staging, written from and read back into it."""

    def __init__(self, index: int, layout: KVLayout = LAYOUT) -> None:
        self.codec = BlockCodec(layout)
        self.ns = Namespace(model_digest=f"bench-{index}", dtype="bf16", block_size=16)
        self.keys = block_keys(self.ns, list(range(PROMPT_TOKENS)))
        pin = torch.cuda.is_available()
        self.src = torch.empty(len(self.keys), *layout.block_shape, dtype=layout.dtype, pin_memory=pin)
        self.src.copy_(torch.randn(self.src.shape).to(layout.dtype))
        self.dst = torch.empty_like(self.src, pin_memory=pin)
        # Slots as the services use them: one numpy view per staging buffer (BlockCodec.byte_rows).
        self.src_rows, self.dst_rows = self.codec.byte_rows(self.src), self.codec.byte_rows(self.dst)
        self.headers = np.empty((len(self.keys), HEADER_NBYTES), dtype=np.uint8)
        self.dests = [self.codec.value_views(memoryview(self.headers[i]), self.dst_rows[i], 16) for i in range(len(self.keys))]
        self.nbytes = len(self.keys) * (layout.block_nbytes + HEADER_NBYTES)
        self.codec_s: list[float] = []  # CPU seconds in the codec, appended from any thread
        self.codec_wall_s: list[float] = []  # the same calls' wall seconds (GIL waits, preemption included)

    def _timed(self, fn: Callable[[], object]) -> None:
        t0, w0 = time.thread_time(), time.perf_counter()
        fn()
        self.codec_s.append(time.thread_time() - t0)
        self.codec_wall_s.append(time.perf_counter() - w0)

    async def encode_put(self, pool: RedisPool, chunk: int) -> None:
        """As prefill stores (services/worker/transfer.py): every block a pending value at
        once (header, views of its row), written in chunks of ``chunk`` blocks, all at once;
        each value checksummed by the bulk thread that sends it (``_TimedPending.seal``)."""
        values: list = []
        self._timed(lambda: values.extend(_TimedPending(self, self.codec.encode_pending(r, 16)) for r in self.src_rows))

        async def one(lo: int) -> None:
            hi = min(lo + chunk, len(self.keys))
            results = await pool.put_blocks(self.ns, list(zip(self.keys[lo:hi], values[lo:hi])))
            assert not any(results), results

        await asyncio.gather(*(one(lo) for lo in range(0, len(self.keys), chunk)))

    async def get_decode(self, pool: RedisPool) -> None:
        """As decode loads: each value verified in place as soon as it lands (on_landed)."""

        def verify(i: int) -> None:
            self._timed(lambda: self.codec.verify_landed(memoryview(self.headers[i]), self.dst_rows[i], 16))

        outcomes = await pool.get_blocks_into(self.ns, self.keys, self.dests, on_landed=verify)
        assert not any(outcomes), outcomes

    def check(self) -> None:
        assert torch.equal(self.dst.view(torch.uint8), self.src.view(torch.uint8)), "a block came back different"


class _TimedPending(PendingValue):
    """A pending value whose seal (the checksum, on the sending thread) counts as codec time."""

    __slots__ = ("_prompt",)

    def __init__(self, prompt: Prompt, value: PendingValue) -> None:
        super().__init__(value.parts[0], value.parts[1:])
        self._prompt = prompt

    def seal(self) -> list[memoryview]:
        out: list[memoryview] = []
        self._prompt._timed(lambda: out.extend(super(_TimedPending, self).seal()))
        return out


def codec_probe(prompt: Prompt) -> str:
    """One thread's costs on this host, alone, in the prompt's own staging memory (pinned
    when CUDA is there) beside ordinary memory: tells a slow codec row apart from a slow
    memory or a slow hash build. Run after a warm-up get, so ``dst`` holds landed values."""
    import xxhash

    def best(fn: Callable[[], None], reps: int = 3) -> float:
        out = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    n = len(prompt.keys)
    staged = prompt.src.view(torch.uint8).numpy().reshape(n, -1)
    plain = staged.copy()  # pageable, same bytes
    rate = lambda rows: rows.nbytes / best(lambda: [xxhash.xxh3_64().update(r) for r in rows]) / 1e9  # noqa: E731
    codec, headers = prompt.codec, prompt.headers
    encode = best(lambda: [codec.encode_pending(r, 16).seal() for r in prompt.src_rows]) / n
    encode_t = best(lambda: [codec.encode_views(prompt.src[i], 16) for i in range(n)]) / n
    verify = best(lambda: [codec.verify_landed(memoryview(headers[i]), prompt.dst_rows[i], 16) for i in range(n)]) / n
    verify_t = best(lambda: [codec.verify_landed(memoryview(headers[i]), prompt.dst[i], 16) for i in range(n)]) / n
    oneshot = "releases" if int(xxhash.VERSION.split(".")[0]) >= 4 else "HOLDS"  # python-xxhash's C source
    return (f"Codec probe (one thread, alone): xxhash {xxhash.VERSION} (its one-shot xxh3_64_intdigest {oneshot} the GIL; "
            f"the codec hashes through xxh3_64().update, which releases it); xxh3 over the staging rows {rate(staged):.1f} GB/s"
            f"{' (pinned)' if prompt.src.is_pinned() else ''}, over ordinary memory {rate(plain):.1f} GB/s; "
            f"per block, slots as byte rows (torch rows): encode + seal {encode * 1e6:.1f} ({encode_t * 1e6:.1f}) us, "
            f"verify_landed {verify * 1e6:.1f} ({verify_t * 1e6:.1f}) us.")


@dataclass
class Samples:
    values: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, label: str, value: float) -> None:
        self.values.setdefault(label, []).append(value)

    def spread(self, label: str) -> str:
        v = self.values[label]
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    def median(self, label: str) -> float:
        return statistics.median(self.values[label])


def redis_benchmark(
    binary: str, port: int, clients: int, pipeline: int, requests: int, cluster: bool, keyspace: int = 0
) -> dict[str, float]:
    """GB/s of one redis-benchmark run of SET and GET with our value size.

    ``--cluster`` mode spreads its keys over the nodes; redis-benchmark refuses it for a
    single node, which serves every slot, so one node runs in plain mode. By default every
    request names one key, so Redis overwrites and reads one value that stays in the CPU's
    caches; ``keyspace`` (``-r``) spreads them over that many keys, the working set ours
    has (a prompt's blocks)."""
    out = subprocess.run(
        [binary, "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(VALUE_NBYTES), "-n", str(requests),
         "-c", str(clients), "-P", str(pipeline), "--csv", *(["--cluster"] if cluster else []),
         *(["-r", str(keyspace)] if keyspace else [])],
        capture_output=True, text=True, check=True,
    ).stdout
    return {row[0]: float(row[1]) * VALUE_NBYTES / 1e9 for row in csv.reader(io.StringIO(out)) if row and row[0] in ("SET", "GET")}


async def timed(fn: Callable[[], Awaitable[None]], nbytes: int, rounds: int) -> float:
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        await fn()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


class Ours:
    """Our rows on one server or cluster, all ``prompts`` at once (warmed up by ``start``)."""

    def __init__(self, url: str, prompts: list[Prompt], model: str, args: argparse.Namespace) -> None:
        self.pool = RedisPool(PoolConfig(
            url=url, key_prefix=f"bench-{model}", pipeline_blocks=args.pipeline_blocks, max_parallel=args.max_parallel,
            max_connections=max(args.max_parallel, 4) * 4, bulk_model=model,
        ))
        self.prompts = prompts
        self.args = args
        self.nbytes = sum(p.nbytes for p in prompts)
        self.calls = {"encode + put": self._put_all, "get + decode": self._get_all}

    async def _put_all(self) -> None:
        await asyncio.gather(*(p.encode_put(self.pool, self.args.pipeline_blocks) for p in self.prompts))

    async def _get_all(self) -> None:
        await asyncio.gather(*(p.get_decode(self.pool) for p in self.prompts))

    async def start(self) -> "Ours":
        for _ in range(self.args.warmup):
            await self._put_all()
            await self._get_all()
        for p in self.prompts:
            p.check()
        return self

    async def row(self, label: str) -> tuple[float, float, float, float]:
        """GB/s of ``label`` (median of rounds); the codec's share of its time: CPU seconds
        (``thread_time``) and wall seconds inside the codec calls, over the wall; and the
        bulk path's system calls per block (each one takes the GIL back)."""
        for p in self.prompts:
            p.codec_s.clear()
            p.codec_wall_s.clear()
        calls0 = self.pool.bulk.counters["syscalls"]
        start = time.perf_counter()
        gbps = await timed(self.calls[label], self.nbytes, self.args.rounds)
        wall = time.perf_counter() - start
        blocks = self.args.rounds * sum(len(p.keys) for p in self.prompts)
        return (gbps, sum(sum(p.codec_s) for p in self.prompts) / wall,
                sum(sum(p.codec_wall_s) for p in self.prompts) / wall,
                (self.pool.bulk.counters["syscalls"] - calls0) / blocks)

    async def close(self) -> None:
        for p in self.prompts:
            p.check()
        await self.pool.close()


BASELINE = {"encode + put": "SET", "get + decode": "GET"}


async def single_redis(url: str, port: int, args: argparse.Namespace) -> Samples:
    samples = Samples()
    prompts = [Prompt(0)]
    ours = {model: await Ours(url, prompts, model, args).start() for model in args.models}
    samples.notes.append(codec_probe(prompts[0]))
    try:
        for _ in range(args.reps):
            theirs = redis_benchmark(args.redis_benchmark, port, args.max_parallel, args.pipeline_blocks, args.bench_requests, False)
            keyed = redis_benchmark(
                args.redis_benchmark, port, args.max_parallel, args.pipeline_blocks, args.bench_requests, False,
                keyspace=len(prompts[0].keys),
            )
            for test, gbps in theirs.items():
                samples.add(f"redis-benchmark {test}", gbps)
                samples.add(f"redis-benchmark {test} keys", keyed[test])
            for model, rows in ours.items():
                for label in BASELINE:
                    gbps, share, wall_share, syscalls = await rows.row(label)
                    samples.add(f"{model} {label}", gbps)
                    samples.add(f"{model} {label} ratio", gbps / theirs[BASELINE[label]])
                    samples.add(f"{model} {label} ratio keys", gbps / keyed[BASELINE[label]])
                    samples.add(f"{model} {label} codec", share)
                    samples.add(f"{model} {label} codec wall", wall_share)
                    samples.add(f"{model} {label} syscalls", syscalls)
    finally:
        for rows in ours.values():
            await rows.close()
    return samples


def _client_process(url: str, indices: list[int], args: argparse.Namespace, barrier, results) -> None:  # noqa: ANN001
    """One client process of the cluster rows: its prompts at once, each round started by
    ``barrier`` together with the other processes; reports each call's monotonic span."""
    torch.set_num_threads(1)

    async def run() -> None:
        ours = await Ours(url, [Prompt(i) for i in indices], args.cluster_model, args).start()
        try:
            for _ in range(args.reps):
                for label in BASELINE:
                    for _ in range(args.rounds):
                        await asyncio.to_thread(barrier.wait)
                        t0 = time.monotonic()
                        await ours.calls[label]()
                        results.put((label, t0, time.monotonic(), ours.nbytes))
        finally:
            await ours.close()

    uvloop.run(run())


def on_cluster(url: str, port: int, nodes: int, args: argparse.Namespace) -> Samples:
    """``--concurrency`` prompts at once, dealt over ``--client-processes`` client processes
    (separate instances, as prefill and decode are): aggregate GB/s of each round is every
    process's bytes over the span from the first start to the last end."""
    ctx = multiprocessing.get_context("spawn")
    procs = max(1, min(args.client_processes, args.concurrency))
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url, list(range(i, args.concurrency, procs)), args, barrier, results), daemon=True)
               for i in range(procs)]
    for w in workers:
        w.start()
    samples = Samples()
    try:
        for _ in range(args.reps):
            theirs = redis_benchmark(
                args.redis_benchmark, port, args.max_parallel * nodes, args.pipeline_blocks, args.bench_requests * nodes, nodes > 1
            )
            for test, gbps in theirs.items():
                samples.add(f"redis-benchmark {test}", gbps)
            for label in BASELINE:
                rates = []
                for _ in range(args.rounds):
                    barrier.wait(timeout=300)
                    spans = [results.get(timeout=300) for _ in range(procs)]
                    rates.append(sum(s[3] for s in spans) / (max(s[2] for s in spans) - min(s[1] for s in spans)) / 1e9)
                gbps = statistics.median(rates)
                samples.add(label, gbps)
                samples.add(f"{label} ratio", gbps / theirs[BASELINE[label]])
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    if any(w.exitcode for w in workers):
        raise RuntimeError(f"a client process failed: exit codes {[w.exitcode for w in workers]}")
    return samples


def start_redis(args: argparse.Namespace, workdir: str) -> tuple[Child, int]:
    port = free_port()
    proc = Child(
        "redis",
        [args.redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "4gb", "--maxmemory-policy", "noeviction", "--dir", workdir, *args.redis_args.split()],
        log_path=Path(workdir) / "redis.log",
    )
    proc.start()
    deadline = time.monotonic() + 10
    while subprocess.run([args.redis_cli, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
        if time.monotonic() > deadline or not proc.running:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (redis-benchmark, then ours)")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of ours per row and rep (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pipeline-blocks", type=int, default=PoolConfig.pipeline_blocks)
    parser.add_argument("--max-parallel", type=int, default=PoolConfig.max_parallel, help="sockets per node")
    parser.add_argument("--bench-requests", type=int, default=512, help="redis-benchmark -n per test and rep (per node on clusters)")
    parser.add_argument("--models", default=",".join(BULK_MODELS), help="bulk concurrency models on one Redis")
    parser.add_argument("--cluster-sizes", default="1,2,4", help="Redis Cluster sizes to run (empty: none)")
    parser.add_argument("--cluster-model", default="threads", choices=BULK_MODELS)
    parser.add_argument("--concurrency", type=int, default=4, help="prompts in flight at once on the clusters")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="client processes the clusters' prompts are dealt over (1: all in one process)")
    parser.add_argument("--redis-bin", default="", help="folder with redis-server, redis-cli, redis-benchmark (default: PATH)")
    parser.add_argument("--redis-args", default="", help="extra redis-server flags, e.g. '--io-threads 4'")
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    for tool in ("redis-server", "redis-cli", "redis-benchmark"):
        path = shutil.which(os.path.join(args.redis_bin, tool) if args.redis_bin else tool)
        if path is None:
            sys.exit(f"{tool} is needed (make install; on the GPU host see /work/shared/device/README.md)")
        setattr(args, tool.replace("-", "_"), path)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="tidepool-bench-redis-")
    lines: list[str] = []
    raw: dict[str, dict[str, list[float]]] = {}
    redis, port = start_redis(args, workdir)
    try:
        single = uvloop.run(single_redis(f"redis://127.0.0.1:{port}/0", port, args))
    finally:
        redis.kill()
    raw["single"] = single.values
    lines += [
        f"| one Redis | GB/s | ratio to redis-benchmark (1 key) | ratio to redis-benchmark -r {PROMPT_TOKENS // 16} "
        "(ours' working set) | codec share: CPU / wall | syscalls per block |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model in args.models:
        for label, test in BASELINE.items():
            lines.append(
                f"| {model}: {label} | {single.spread(f'{model} {label}')} | **{single.spread(f'{model} {label} ratio')}** "
                f"| **{single.spread(f'{model} {label} ratio keys')}** "
                f"| {100 * single.median(f'{model} {label} codec'):.1f}% / {100 * single.median(f'{model} {label} codec wall'):.1f}% "
                f"| {single.median(f'{model} {label} syscalls'):.1f} |"
            )
    for test in ("SET", "GET"):
        lines.append(f"| redis-benchmark {test} (1 key) | {single.spread('redis-benchmark ' + test)} | | | | |")
        lines.append(f"| redis-benchmark {test} -r {PROMPT_TOKENS // 16} | {single.spread(f'redis-benchmark {test} keys')} | | | | |")
    sizes = [int(n) for n in args.cluster_sizes.split(",") if n]
    if sizes:
        lines += [
            "",
            f"| Redis Cluster ({args.concurrency} prompts at once in {args.client_processes} client process(es), {args.cluster_model}) | nodes | GB/s | ratio to redis-benchmark --cluster | vs 1 node | redis-benchmark --cluster GB/s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        base: dict[str, float] = {}
        for n in sizes:
            with LocalRedisCluster(
                n, maxmemory=4 << 30, extra_args=args.redis_args.split(),
                redis_server=args.redis_server, redis_cli=args.redis_cli,
            ) as nodes:
                samples = on_cluster(nodes.url, nodes.ports[0], n, args)
            raw[f"cluster-{n}"] = samples.values
            for label, test in BASELINE.items():
                base.setdefault(label, samples.median(label))
                lines.append(
                    f"| {label} | {n} | {samples.spread(label)} | {samples.spread(label + ' ratio')} | "
                    f"**{samples.median(label) / base[label]:.2f}x** | {samples.spread('redis-benchmark ' + test)} |"
                )
    shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()
    version = subprocess.run([args.redis_server, "--version"], capture_output=True, text=True).stdout.split()[2]
    header = [
        f"Device: {platform.machine()}, {os.cpu_count()} CPUs; CUDA: {torch.cuda.is_available()} (staging "
        f"{'pinned' if torch.cuda.is_available() else 'ordinary memory'}); Redis {version.removeprefix('v=')} "
        f"{args.redis_args}; Python {platform.python_version()}, uvloop; {datetime.datetime.now():%Y-%m-%d %H:%M}; "
        f"load average (1/5 min) {load_before[0]:.1f}/{load_before[1]:.1f} before, {load_after[0]:.1f}/{load_after[1]:.1f} after",
        f"Prompt: {PROMPT_TOKENS} tokens = {PROMPT_TOKENS // 16} blocks of {VALUE_NBYTES:,} B (SmolLM2-135M bf16). "
        f"Client: pipeline_blocks={args.pipeline_blocks}, max_parallel={args.max_parallel} sockets per node; "
        f"redis-benchmark -c {args.max_parallel} (x nodes) -P {args.pipeline_blocks} -n {args.bench_requests} (x nodes). "
        f"GB/s of value bytes: median (min-max) over {args.reps} interleaved reps, each one redis-benchmark run then "
        f"the median of {args.rounds} calls of ours (after {args.warmup} warm-up calls); ratios within each rep. "
        "Codec share: CPU time (thread_time) and wall time in BlockCodec calls (header, checksum) / the row's wall time.",
        *single.notes,
        "",
    ]
    table = "\n".join(header + lines) + "\n"
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
