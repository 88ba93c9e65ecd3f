"""One prompt's handoff transfers outside the services, in the patterns the services use.

``bench.gpu_pd`` shows prefill writing a 2048-token prompt's 47 MB at ~0.9-1.4 GB/s and
decode reading it at ~1.1-1.7 GB/s, while ``bench/pool_throughput.py`` moves the same
blocks at 1.6-2.0 GB/s on one Redis. This probe times, on one Redis and on a local
Redis Cluster, with the services' pool settings:

- ``put, all at once``: pool_throughput's encode + put (every block handed over at once,
  in pipelines of ``pipeline_blocks``);
- ``writer W x B``: prefill's way (services/worker/transfer.py ``store_blocks``): every
  block submitted to an :class:`AsyncWriter` of W workers taking batches of B blocks;
  with ``--digested``, alternately with each block's checksum hashed by the bulk thread
  that sends it (a CPU prefill) and given (a GPU prefill: kernels/digest);
- ``get, all at once``: one ``get_blocks_into`` of every block (decode's serial load);
- ``get, runs of K``: consecutive ``get_blocks_into`` calls of K blocks (the streamed
  handoff's fetch of each newly durable run);
- ``get ..., P-block pipelines on S sockets`` (``--get-pipelines PxS,...``): all the
  blocks, and the last half (decode's fetch at the last update when half the prompt came
  early), with ``pipeline_blocks`` P and ``max_parallel`` S: how a node's blocks spread
  over its sockets.

The put rows overwrite the same keys every repetition (the servers reuse the values'
memory); ``new keys`` rows write a prompt never seen before each time, as the services do
until the pool is full (the servers' memory grows, page by page).

``--layers 1`` makes each value 1/30 of SmolLM2's (12 KB): the rows then time what a block
costs beyond its bytes (commands, replies, the writer's and the bulk threads' hand-offs).

    python -m bench.handoff_probe --redis-bin /tmp/redis-root/usr/bin --nodes 0,4 [--layers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.pool_throughput import Prompt, start_redis  # noqa: E402  (sets OMP_WAIT_POLICY, sys.path)
import torch  # noqa: E402  (after the line above)
from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.config import PoolConfig
from libs.kvpool.header import HEADER_NBYTES, unpack_header
from libs.kvpool.layout import KVLayout
from libs.kvpool.redis_pool import RedisPool
from libs.kvpool.writer import AsyncWriter
from services.launch.redis_cluster import LocalRedisCluster


async def probe(url: str, args: argparse.Namespace) -> list[tuple[str, float]]:
    pool = RedisPool(PoolConfig(url=url, key_prefix="probe"))
    prompt = Prompt(0, args.layout)
    rows: list[tuple[str, float]] = []

    async def timed(label: str, fn, setup=None, nbytes: int = prompt.nbytes) -> None:
        for _ in range(args.warmup):
            await setup() if setup else None
            await fn()
        times = []
        for _ in range(args.reps):
            await setup() if setup else None
            t0 = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        rows.append((label, ms))
        print(f"  {label:<50} {ms:7.1f} ms  {nbytes / ms / 1e6:5.2f} GB/s", flush=True)

    await timed("put, all at once", lambda: prompt.encode_put(pool, 16))
    fresh = iter(range(10**9))
    written: list = []  # (namespace, keys) of the new-keys rows, oldest first

    async def evict_oldest() -> None:  # what cache_store does at its budget: the servers reuse that memory
        if written:
            ns, keys = written.pop(0)
            await pool.delete_blocks(ns, keys)

    # Each block's checksum as a GPU prefill has it (kernels/digest: computed on the device
    # by the swap-out), here taken once outside the timings.
    digests = [unpack_header(prompt.codec.encode_pending(row, 16).seal()[0]).checksum if args.digested else None for row in prompt.src_rows]
    modes = [(m, False) for m in ("same keys", "new keys", "new keys, the oldest evicted first")]
    if args.digested:  # the same writes, the sender hashing nothing, alternated with the hashing ones
        modes = [(m, d) for m in ("new keys", "new keys, the oldest evicted first") for d in (False, True, False, True)]
    for workers, batch in args.writers:
        for mode, digested in modes:
            async def through_writer(workers: int = workers, batch: int = batch, mode: str = mode, digested: bool = digested) -> None:
                ns, keys = prompt.ns, prompt.keys
                if mode != "same keys":
                    ns = Namespace(model_digest=f"probe-{next(fresh)}", dtype="bf16", block_size=16)
                    keys = block_keys(ns, list(range(len(prompt.keys) * 16)))
                    written.append((ns, keys))
                async with AsyncWriter(pool, workers=workers, batch_blocks=batch) as writer:
                    session = writer.begin()
                    for key, row, digest in zip(keys, prompt.src_rows, digests):
                        value = prompt.codec.encode_digested(row, 16, digest) if digested else prompt.codec.encode_pending(row, 16)
                        await session.submit(ns, key, value)
                    report = await session.wait_all_done()
                    assert report.ok

            source = ", digests given (GPU prefill)" if digested else (", hashed by the sender" if args.digested else "")
            await timed(f"writer {workers} x {batch}, {mode}{source}", through_writer, evict_oldest if "evicted" in mode else None)
    await timed("get, all at once", lambda: prompt.get_decode(pool))
    for k in args.runs:
        async def in_runs(k: int = k) -> None:
            for lo in range(0, len(prompt.keys), k):
                out = await pool.get_blocks_into(prompt.ns, prompt.keys[lo : lo + k], prompt.dests[lo : lo + k])
                assert not any(out), out

        await timed(f"get, runs of {k}", in_runs)
    for p, sockets in args.get_pipelines:
        other = RedisPool(PoolConfig(url=url, key_prefix="probe", pipeline_blocks=p, max_parallel=sockets))

        async def get_from(lo: int, other: RedisPool = other) -> None:
            out = await other.get_blocks_into(prompt.ns, prompt.keys[lo:], prompt.dests[lo:])
            assert not any(out), out

        half = len(prompt.keys) // 2
        await timed(f"get, all at once, {p}-block pipelines on {sockets} sockets", lambda: get_from(0))
        await timed(
            f"get, the last {len(prompt.keys) - half}, {p}-block pipelines on {sockets} sockets", lambda: get_from(half),
            nbytes=prompt.nbytes * (len(prompt.keys) - half) // len(prompt.keys),
        )
        await other.close()
    prompt.check()
    await pool.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-bin", default="")
    ap.add_argument("--redis-args", default="")
    ap.add_argument("--nodes", default="0,4", help="0 = one Redis, N = an N-node cluster")
    ap.add_argument("--writers", default="4x16,4x32")
    ap.add_argument("--runs", default="8,32")
    ap.add_argument("--get-pipelines", default="16x4,8x4,4x4,8x8", help="pipeline_blocks x max_parallel of the last get rows")
    ap.add_argument("--digested", action="store_true",
                    help="writer rows only with new keys, each twice with the sender hashing and twice with the checksums given (as a GPU prefill's)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30,
                    help="layers in a block (SmolLM2-135M: 30); 1 makes values small, so the rows time what each block costs beyond its bytes")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    args.writers = [tuple(int(x) for x in w.split("x")) for w in args.writers.split(",") if w]
    args.runs = [int(k) for k in args.runs.split(",") if k]
    args.get_pipelines = [tuple(int(x) for x in g.split("x")) for g in args.get_pipelines.split(",") if g]
    args.layout = KVLayout(args.layers, 3, 64, 16, torch.bfloat16)  # SmolLM2-135M's block, args.layers deep
    server = args.redis_server = os.path.join(args.redis_bin, "redis-server") if args.redis_bin else "redis-server"
    cli = args.redis_cli = os.path.join(args.redis_bin, "redis-cli") if args.redis_bin else "redis-cli"
    for n in (int(x) for x in args.nodes.split(",")):
        print(f"{'one Redis' if n == 0 else f'{n}-node cluster'}: 128 blocks of {args.layout.block_nbytes + HEADER_NBYTES:,} B", flush=True)
        if n == 0:
            with tempfile.TemporaryDirectory() as work:
                child, port = start_redis(args, work)
                try:
                    asyncio.run(probe(f"redis://127.0.0.1:{port}/0", args))
                finally:
                    child.stop()
        else:
            with LocalRedisCluster(n, maxmemory=4 << 30, extra_args=args.redis_args.split(),
                                   redis_server=server, redis_cli=cli, log_dir=Path(tempfile.mkdtemp())) as cluster:
                asyncio.run(probe(cluster.url, args))


if __name__ == "__main__":
    main()
