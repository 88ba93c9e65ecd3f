"""KV pool throughput on loopback Redis: our client against redis-benchmark, in one run.

One 2048-token prompt in SmolLM2's layout (30 layers, 3 kv heads, head dim 64, block size
16): 128 blocks of 368,640 B in bf16 (737,280 B in fp32), plus the 24-byte header. Rows:

- ``put`` / ``get``: one ``RedisPool.put_blocks`` / ``get_blocks`` call for all 128 blocks of
  pre-encoded values (pipelined chunks of ``--pipeline-blocks`` on up to ``--max-parallel``
  connections, bookkeeping included: the MULTI/EXEC account script on put, the LRU touch
  on get);
- ``encode + put`` / ``get + decode``: the same with the codec between a staging tensor and
  the values, i.e. what prefill and decode do;
- ``redis-benchmark SET`` / ``GET``: the C client on the same server with the same value size,
  ``-c`` = ``--max-parallel`` connections and ``-P`` = ``--pipeline-blocks``, the same shape
  of concurrency as ours.

GB/s counts value bytes (1 GB = 1e9 B). The machine may be shared, so the two are
interleaved: each of ``--reps`` repetitions runs redis-benchmark once and then each of our
rows (median of ``--rounds`` calls), and the ratio is taken within the repetition. The
script starts its own redis-server (no persistence, ``noeviction``) and runs the client on
uvloop, as the services do.

    python3 bench/pool_throughput.py [--markdown bench/results/pool.md]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import uvloop  # noqa: E402

from libs.blocks.keys import Namespace, block_keys  # noqa: E402
from libs.kvpool.codec import BlockCodec  # noqa: E402
from libs.kvpool.config import PoolConfig  # noqa: E402
from libs.kvpool.layout import KVLayout  # noqa: E402
from libs.kvpool.redis_pool import RedisPool  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, PROMPT_TOKENS = 30, 3, 64, 16, 2048
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, workdir: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", "4gb", "--maxmemory-policy", "noeviction", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def redis_benchmark_gbps(port: int, value_nbytes: int, clients: int, pipeline: int, requests: int) -> dict[str, float]:
    """GB/s of one redis-benchmark run of SET and GET with values of ``value_nbytes``."""
    out = subprocess.run(
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(value_nbytes),
         "-n", str(requests), "-c", str(clients), "-P", str(pipeline), "--csv"],
        capture_output=True, text=True, check=True,
    ).stdout
    return {row[0]: float(row[1]) * value_nbytes / 1e9 for row in csv.reader(io.StringIO(out)) if row and row[0] in ("SET", "GET")}


async def median_gbps(fn: Callable[[], Awaitable[None]], nbytes: int, rounds: int) -> float:
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        await fn()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


BASELINE = {"put": "SET", "get": "GET", "encode + put": "SET", "get + decode": "GET"}


async def bench_dtype(port: int, name: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """GB/s samples per row, and the ratio samples ``<row> ratio``, over ``--reps`` interleaved reps.

    Each rep runs redis-benchmark and then ours back to back, and the ratio is taken within
    the rep: on a shared machine the load drifts between reps, not within one.
    """
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPES[name])
    codec = BlockCodec(layout)
    ns = Namespace(model_digest=f"bench-{name}", dtype=name, block_size=BLOCK_SIZE)
    keys = block_keys(ns, list(range(PROMPT_TOKENS)))
    staging = torch.randn(len(keys), *layout.block_shape).to(layout.dtype)
    out = torch.empty_like(staging)
    values = [codec.encode(staging[i], BLOCK_SIZE) for i in range(len(keys))]
    nbytes = sum(map(len, values))
    config = PoolConfig(
        url=f"redis://127.0.0.1:{port}/0", key_prefix=f"bench{name}", pipeline_blocks=args.pipeline_blocks,
        max_parallel=args.max_parallel, max_connections=max(args.max_parallel, 4),
    )
    samples: dict[str, list[float]] = {}
    async with RedisPool(config) as pool:
        items = list(zip(keys, values))

        async def put() -> None:
            results = await pool.put_blocks(ns, items)
            assert not any(results), results

        async def get() -> None:
            got = await pool.get_blocks(ns, keys)
            assert all(v is not None for v in got)

        async def encode_put() -> None:
            encoded = [(k, codec.encode(staging[i], BLOCK_SIZE)) for i, k in enumerate(keys)]
            results = await pool.put_blocks(ns, encoded)
            assert not any(results), results

        async def get_decode() -> None:
            for i, v in enumerate(await pool.get_blocks(ns, keys)):
                codec.decode(v, out[i], expected_tokens=BLOCK_SIZE)

        rows = {"put": put, "get": get, "encode + put": encode_put, "get + decode": get_decode}
        for fn in rows.values():  # warm-up: connections, scripts, allocator
            for _ in range(args.warmup):
                await fn()
        for _ in range(args.reps):
            theirs = redis_benchmark_gbps(port, len(values[0]), args.max_parallel, args.pipeline_blocks, args.bench_requests)
            for test, gbps in theirs.items():
                samples.setdefault(f"redis-benchmark {test}", []).append(gbps)
            for label, fn in rows.items():
                gbps = await median_gbps(fn, nbytes, args.rounds)
                samples.setdefault(label, []).append(gbps)
                samples.setdefault(f"{label} ratio", []).append(gbps / theirs[BASELINE[label]])
        assert torch.equal(out.view(torch.uint8), staging.view(torch.uint8))
    return samples


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (redis-benchmark, then ours)")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of ours per row and rep (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pipeline-blocks", type=int, default=PoolConfig.pipeline_blocks)
    parser.add_argument("--max-parallel", type=int, default=PoolConfig.max_parallel)
    parser.add_argument("--bench-requests", type=int, default=512, help="redis-benchmark -n per test and rep")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    if not shutil.which("redis-server") or not shutil.which("redis-benchmark"):
        sys.exit("redis-server and redis-benchmark are needed (make redis)")
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="tidepool-bench-redis-")
    redis = start_redis(port, workdir)
    lines = []
    try:
        for name in args.dtypes.split(","):
            samples = uvloop.run(bench_dtype(port, name, args))
            value_nbytes = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPES[name].itemsize + 24
            lines.append(f"| **{name}** ({value_nbytes:,} B a value) | | |")
            for label in BASELINE:
                lines.append(f"| ours: {label} | {spread(samples[label])} | {spread(samples[label + ' ratio'])} |")
            for test in ("SET", "GET"):
                lines.append(f"| redis-benchmark {test} | {spread(samples['redis-benchmark ' + test])} | |")
    finally:
        redis.kill()
        redis.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    header = [
        f"Device: {platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}); "
        f"{subprocess.run(['redis-server', '--version'], capture_output=True, text=True).stdout.split()[2]}; "
        f"Python {platform.python_version()}, uvloop; {datetime.date.today()}; "
        f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (shared machine)",
        f"Prompt: {PROMPT_TOKENS} tokens = {PROMPT_TOKENS // BLOCK_SIZE} blocks, SmolLM2 layout. "
        f"Client: pipeline_blocks={args.pipeline_blocks}, max_parallel={args.max_parallel}; "
        f"redis-benchmark -c {args.max_parallel} -P {args.pipeline_blocks} -n {args.bench_requests}. "
        f"GB/s of value bytes (1 GB = 1e9 B): median (min-max) over {args.reps} interleaved reps, each rep "
        f"one redis-benchmark run then the median of {args.rounds} calls of ours (after {args.warmup} warm-up "
        "calls); ratio = ours / redis-benchmark (SET for puts, GET for gets) within each rep.",
        "",
        "| operation | GB/s | ratio to redis-benchmark |",
        "|---|---:|---:|",
    ]
    table = "\n".join(header + lines) + "\n"
    print(table)
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
