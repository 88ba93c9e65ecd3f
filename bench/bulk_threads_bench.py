"""What the bulk path's thread hand-offs cost the event loop.

Every pipeline of the bulk path (libs/kvpool/bulk.py, ``threads`` model) is one job on a
worker thread that the event loop waits for; a 2048-token prompt's 128-block write is 32
of them on a 4-node cluster. This measures, in one run:

- **the mechanism**: a job that does nothing, awaited through ``asyncio.shield`` as the
  bulk path does, through ``loop.run_in_executor(ThreadPoolExecutor)`` (the peer: the
  standard library's way) and through ``libs/kvpool/threads.WorkerThreads``, one at a time
  and ``--concurrency`` at once: the event loop's CPU time per job (``time.thread_time``)
  and the wall time per job;
- **a prompt's transfers** (``--nodes N``, a local N-node Redis Cluster; needs
  ``redis-server``): the loop's CPU time and the process's per 128-block write (prefill's
  way, through an ``AsyncWriter``) and per read (decode's ``get_blocks_into``), with the
  values ``--layers`` deep (1: what a block costs beyond its bytes).

    python -m bench.bulk_threads_bench [--jobs 20000] [--concurrency 1,8] [--nodes 4 --layers 1,30 --reps 100]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from bench.pool_throughput import Prompt  # noqa: E402  (sets OMP_WAIT_POLICY, sys.path)
import torch  # noqa: E402  (after the line above)
from libs.kvpool.config import PoolConfig
from libs.kvpool.layout import KVLayout
from libs.kvpool.redis_pool import RedisPool
from libs.kvpool.threads import WorkerThreads
from libs.kvpool.writer import AsyncWriter
from services.launch.redis_cluster import LocalRedisCluster


async def mechanism(jobs: int, concurrency: list[int]) -> None:
    loop = asyncio.get_running_loop()
    executor, threads = ThreadPoolExecutor(32), WorkerThreads(32, "bench")
    nothing: Callable[[], int] = lambda: 1  # noqa: E731

    async def stdlib() -> Any:
        return await asyncio.shield(loop.run_in_executor(executor, nothing))

    async def ours() -> Any:
        return await asyncio.shield(threads.submit(nothing))

    print("| way | jobs at once | loop CPU us/job | wall us/job |\n|---|---|---|---|")
    for rep in range(2):  # each twice, alternated: the box drifts
        for name, job in (("run_in_executor(ThreadPoolExecutor)", stdlib), ("WorkerThreads", ours)):
            for _ in range(1000):
                await job()
            for c in concurrency:
                n = max(1, jobs // c)
                c0, w0 = time.thread_time(), time.perf_counter()
                for _ in range(n):
                    await asyncio.gather(*(job() for _ in range(c)))
                done = n * c
                print(f"| {name} | {c} | {(time.thread_time() - c0) / done * 1e6:.1f} | {(time.perf_counter() - w0) / done * 1e6:.1f} |", flush=True)
    executor.shutdown()
    threads.shutdown()


async def transfers(url: str, layers: int, reps: int) -> None:
    pool = RedisPool(PoolConfig(url=url, key_prefix="bulk-threads-bench"))
    prompt = Prompt(0, KVLayout(layers, 3, 64, 16, torch.bfloat16))

    async def write() -> None:
        async with AsyncWriter(pool, workers=4, batch_blocks=16) as writer:
            session = writer.begin()
            for key, row in zip(prompt.keys, prompt.src_rows):
                await session.submit(prompt.ns, key, prompt.codec.encode_pending(row, 16))
            assert (await session.wait_all_done()).ok

    async def read() -> None:
        out = await pool.get_blocks_into(prompt.ns, prompt.keys, prompt.dests)
        assert not any(out), out

    await write()
    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [("write", write), ("read", read)]
    for name, step in steps:
        for _ in range(5):
            await step()
        walls, loops, procs = [], [], []
        for _ in range(reps):
            w0, l0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            await step()
            walls.append(time.perf_counter() - w0)
            loops.append(time.thread_time() - l0)
            procs.append(time.process_time() - p0)
        ms = lambda v: f"{statistics.median(v) * 1e3:.2f}"  # noqa: E731
        print(f"| {layers} | {name} | {ms(walls)} | {ms(loops)} | {ms(procs)} |", flush=True)
    await pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--nodes", type=int, default=0, help="also time a prompt's write and read on a local N-node cluster (0: skip)")
    ap.add_argument("--layers", default="1,30")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    asyncio.run(mechanism(args.jobs, [int(c) for c in args.concurrency.split(",")]))
    if args.nodes:
        print(f"\n{args.nodes}-node cluster, 128 blocks, medians of {args.reps} (ms)\n")
        print("| layers | transfer | wall | loop CPU | process CPU |\n|---|---|---|---|---|")
        with LocalRedisCluster(args.nodes, maxmemory=1 << 30) as cluster:
            for layers in [int(x) for x in args.layers.split(",")]:
                asyncio.run(transfers(cluster.url, layers, args.reps))


if __name__ == "__main__":
    main()
