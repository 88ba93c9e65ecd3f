"""1,000 handoffs through the worker's transfer code (services/worker/transfer.py: store from
export staging, load into import staging) on a real Redis and on a real Redis Cluster,
with faults mixed in (connections killed between store and load, loads and stores
cancelled mid-flight). Afterwards no staging buffer is still lent out, no socket or file
descriptor is left over, and every completed handoff delivered its exact bytes."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis
import torch

from kernels.swap import BlockSwapper
from libs.blocks.keys import block_keys
from libs.engine import ExportedKV
from libs.kvpool.config import PoolConfig
from libs.kvpool.redis_pool import RedisPool
from services.worker.transfer import load_blocks, store_blocks
from tests.integration.conftest import unique_prefix
from tests.integration.transfer_runtime import LAYOUT, NS, runtime

pytestmark = pytest.mark.integration

HANDOFFS = 1000


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pooled_sockets(pool: RedisPool) -> int:
    """Sockets the pool keeps on purpose: bulk sockets and connected control-plane connections."""
    control = sum(
        c.is_connected for p in pool.control._pools.values() for c in (*p._available_connections, *p._in_use_connections)
    )
    return pool.bulk.open_sockets + control


def export(swapper: BlockSwapper, tokens: int, seed: int) -> tuple[ExportedKV, torch.Tensor]:
    """A prefill's export: the prompt's blocks in staging, as the engine leaves them."""
    n = -(-tokens // 16)
    buf = swapper.acquire(n)
    data = torch.randn(n, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(seed))
    buf.host.copy_(data)
    return ExportedKV([buf], tokens, 16), data


async def handoff(rt, i: int, kill_url: str | None) -> bool:
    """One prefill -> pool -> decode handoff; faults by ``i``. True if the KV arrived intact."""
    tokens = 16 * (1 + i % 4) - (i % 3)  # 1-4 blocks, sometimes a partial tail
    keys = block_keys(NS, [i * 7919 + t for t in range(tokens)])
    exported, data = export(rt.llm.swapper, tokens, i)
    lease = await rt.pool.create_lease(NS, keys, ttl_s=30)
    if i % 100 == 66:  # the prefill request is cancelled while its blocks are being written
        task = asyncio.ensure_future(store_blocks(rt, exported, keys, 0, lease))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await rt.pool.release_lease(lease)
        return False
    stored = await store_blocks(rt, exported, keys, 0, lease)
    assert stored.blocks_written == len(keys), stored
    if kill_url is not None and i % 100 == 10:  # every connection dropped between store and load
        with redis.Redis.from_url(kill_url) as r:
            r.client_kill_filter(_type="normal", skipme=True)
    if i % 100 == 33:  # the decode request is cancelled mid-load
        task = asyncio.ensure_future(load_blocks(rt, keys, 0, max_tokens=tokens))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await rt.pool.release_lease(lease)
        return False
    load = await load_blocks(rt, keys, 0, max_tokens=tokens)
    await rt.pool.release_lease(lease)
    assert load.hit_blocks == len(keys), load.miss_reasons
    try:
        got = torch.cat([b.host for b in load.kv_import.buffers])[: len(keys)]
        for j, k in enumerate(keys):
            assert torch.equal(got[j, :, :, : k.num_tokens], data[j, :, :, : k.num_tokens])
    finally:
        load.kv_import.release()
    await rt.pool.delete_blocks(NS, keys)
    return True


@pytest.mark.parametrize("where, model", [("single", "threads"), pytest.param("cluster", "asyncio", marks=pytest.mark.slow)])  # ~16 s: make test-slow
async def test_a_thousand_handoffs_leak_no_staging_socket_or_fd(request: pytest.FixtureRequest, where: str, model: str) -> None:
    url = request.getfixturevalue("redis_server" if where == "single" else "redis_cluster").url
    swapper = BlockSwapper(LAYOUT.allocate(8), max_blocks=4, num_buffers=4)
    pool = RedisPool(PoolConfig(url=url, key_prefix=unique_prefix(), bulk_model=model, retries=2))
    rt = runtime(pool, swapper)
    try:
        for i in range(20):  # warm up: every pool reaches its steady number of sockets
            await handoff(rt, 1 + i * 3, None)
        fds, sockets = open_fds(), pooled_sockets(pool)
        kill_url = url if where == "single" else None  # on the cluster, CLIENT KILL would hit one node
        done = sum([await handoff(rt, i, kill_url) for i in range(HANDOFFS)])
        assert done >= HANDOFFS * 0.97
        await asyncio.sleep(0.05)  # cancelled writes settle
        assert swapper.in_use == 0, "a staging buffer was never given back"
        assert all(not n.busy for n in pool.bulk._nodes.values())
        assert pool.bulk.open_sockets <= pool.config.max_parallel * len(pool.bulk._nodes)
        # The pools may still grow to their bounds (more sockets to a node as concurrency
        # varies); any other new descriptor is a leak.
        assert open_fds() - fds <= pooled_sockets(pool) - sockets, "a file descriptor leaked"
        assert (await pool.stats()).pinned_blocks == 0
    finally:
        await rt.writer.close()
        await pool.close()
        swapper.close()
