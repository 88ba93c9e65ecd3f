"""RedisPool on a real redis-server: the shared contract (on one Redis with both bulk
models, and on a real 3-node Redis Cluster), the schema, OOM, drops, hangs, restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from libs.kvpool.config import PoolConfig
from libs.kvpool.pool import PoolUnavailable, PutError
from libs.kvpool.redis_pool import RedisPool
from libs.kvpool.writer import AsyncWriter, WriteFailed
from tests.integration.conftest import unique_prefix
from tests.integration.redis_server import RedisServer
from tests.unit.test_kvpool_pool import KEYS, NS, VALUE_NBYTES, PoolContract, put_ok, values

pytestmark = pytest.mark.integration


@pytest.fixture
async def pool(pool_config: PoolConfig) -> AsyncIterator[RedisPool]:
    p = RedisPool(pool_config)
    yield p
    await p.close()


class TestRedisPool(PoolContract):
    """The contract of tests/unit/test_kvpool_pool.py, on Redis and on Redis Cluster."""

    @pytest.fixture(params=["single", "single-asyncio", "cluster"])
    async def pool(self, request: pytest.FixtureRequest, pool_config: PoolConfig) -> AsyncIterator[RedisPool]:
        url = request.getfixturevalue("redis_cluster").url if request.param == "cluster" else pool_config.url
        model = "asyncio" if request.param.endswith("asyncio") else "threads"
        p = RedisPool(dataclasses.replace(pool_config, url=url, bulk_model=model))
        yield p
        await p.close()


async def test_schema_is_the_documented_one(pool: RedisPool, pool_config: PoolConfig) -> None:
    await put_ok(pool, KEYS[:2], values(2))
    lease = await pool.create_lease(NS, KEYS[:1], ttl_s=60)
    await pool.record_misses("corrupt:checksum", 1)
    raw = aioredis.from_url(pool_config.url)
    try:
        p = pool_config.key_prefix
        found = sorted(k.decode() for k in await raw.keys(f"{p}:*"))
        assert found == sorted(
            [f"{p}:kv:{NS.hex}:{KEYS[0]}", f"{p}:kv:{NS.hex}:{KEYS[1]}", f"{p}:lru", f"{p}:size",
             f"{p}:bytes", f"{p}:stats", f"{p}:pins", f"{p}:leases", f"{p}:lease:{lease}"]
        )
        assert int(await raw.get(f"{p}:bytes")) == 2 * VALUE_NBYTES
        assert await raw.hget(f"{p}:pins", f"{NS.hex}:{KEYS[0]}") == b"1"
        assert await raw.hget(f"{p}:stats", "misses:corrupt:checksum") == b"1"
    finally:
        await raw.aclose()


async def test_many_blocks_pipelined_in_parallel_keep_their_order(pool_config: PoolConfig) -> None:
    from libs.blocks.keys import block_keys

    keys = block_keys(NS, list(range(4 * 64)))
    vals = [os.urandom(100 + i) for i in range(len(keys))]
    cfg = PoolConfig(url=pool_config.url, key_prefix=pool_config.key_prefix, pipeline_blocks=5, max_parallel=3)
    async with RedisPool(cfg) as pool:
        await put_ok(pool, keys, vals)
        assert await pool.get_blocks(NS, keys) == vals
        assert await pool.exists_prefix(NS, keys) == len(keys)
        assert (await pool.stats()).bytes == sum(map(len, vals))


async def test_a_cluster_gets_one_pipeline_per_node_not_per_partition(redis_cluster, pool_config: PoolConfig) -> None:
    """48 blocks spread over the 16 partitions of a 3-node cluster travel in one pipeline per
    node each way (pipelines of up to 16 blocks hold several partitions), and every block
    and its bookkeeping still lands in its own partition."""
    from libs.blocks.keys import block_keys

    keys = block_keys(NS, list(range(48 * NS.block_size)))
    assert len(keys) == 48
    vals = [os.urandom(1000 + i) for i in range(len(keys))]
    cfg = PoolConfig(url=redis_cluster.url, key_prefix=unique_prefix(), pipeline_blocks=16, max_parallel=4)
    async with RedisPool(cfg) as pool:
        await pool.get_blocks(NS, keys[:1])  # the topology
        before = pool.bulk.counters["pipelines"]
        await put_ok(pool, keys, vals)
        puts = pool.bulk.counters["pipelines"] - before
        assert await pool.get_blocks(NS, keys) == vals
        gets = pool.bulk.counters["pipelines"] - before - puts
        # 16 blocks per node at most per pipeline: ceil(share / 16) pipelines per node.
        assert 3 <= puts <= 6 and 3 <= gets <= 6, (puts, gets)
        stats = await pool.stats()
        assert stats.blocks == len(keys) and stats.bytes == sum(map(len, vals))
        assert await pool.exists_prefix(NS, keys) == len(keys)


async def test_a_full_redis_refuses_single_blocks_and_keeps_serving(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory(maxmemory="6mb")
    cfg = PoolConfig(url=server.url, key_prefix=unique_prefix())
    from libs.blocks.keys import block_keys

    keys = block_keys(NS, list(range(4 * 40)))
    vals = values(len(keys), nbytes=256 * 1024)
    async with RedisPool(cfg) as pool:
        results = await pool.put_blocks(NS, list(zip(keys, vals)))
        ok = [k for k, r in zip(keys, results) if r is None]
        refused = [r for r in results if r is not None]
        assert ok and refused, "6 MB of maxmemory should hold some but not all of 10 MB"
        assert all(isinstance(r, PutError) and r.reason == "oom" for r in refused)
        # Nothing half-done: exactly the accepted blocks exist and are accounted.
        exists = await pool.exists_blocks(NS, keys)
        assert [k for k, e in zip(keys, exists) if e] == ok
        stats = await pool.stats()
        assert stats.blocks == len(ok) and stats.bytes == len(ok) * 256 * 1024
        assert stats.write_errors == {"oom": len(refused)}
        # Reads, leases, miss reports and eviction all work while Redis is full.
        got = await pool.get_blocks(NS, ok[:2])
        assert got == [vals[keys.index(k)] for k in ok[:2]]
        lease = await pool.create_lease(NS, ok[:1], ttl_s=60)
        await pool.record_misses("corrupt:checksum", 1)
        result = await pool.evict(budget_bytes=0, max_blocks=1000)
        assert result.evicted == len(ok) - 1
        assert await pool.release_lease(lease)
        # With room again, the refused blocks go in.
        assert await pool.put_blocks(NS, [(keys[-1], vals[-1])]) == [None]


async def test_eviction_by_redis_memory_keeps_a_pool_writable_below_its_byte_budget(redis_factory: Callable[..., RedisServer]) -> None:
    """A byte budget above what Redis can hold (values' allocator overhead and buffers count
    toward maxmemory, not toward the budget): the policy loop also evicts by the server's
    used memory, so writes between its passes are never refused. Without it this pool
    fills up and refuses every write past ~6 MB (the budget is never reached)."""
    from libs.blocks.keys import block_keys
    from services.cache_store.policy import PolicyLoop

    server = redis_factory(maxmemory="6mb")
    keys = block_keys(NS, list(range(4 * 48)))
    vals = values(len(keys), nbytes=256 * 1024)  # 12 MB in all
    async with RedisPool(PoolConfig(url=server.url, key_prefix=unique_prefix())) as pool:
        policy = PolicyLoop(pool, budget_bytes=1 << 30, interval_s=1.0, evict_batch=64, memory_high_watermark=0.85)
        refused = []
        for key, val in zip(keys, vals):
            refused += [r.reason for r in await pool.put_blocks(NS, [(key, val)]) if r is not None]
            assert await policy.run_pass()
        assert refused == []
        assert policy.counters.memory_evictions > 0 and policy.counters.evicted_blocks > 0
        assert policy.counters.memory_fill < 0.95
        client = aioredis.from_url(server.url)
        try:
            info = await client.info("memory")
        finally:
            await client.aclose()
        assert await pool.memory_fill() == pytest.approx(info["used_memory"] / info["maxmemory"], rel=0.05)
        assert (await pool.stats()).bytes < 6 * 2**20  # the budget (1 GB) had nothing to do with it


async def test_cluster_eviction_stays_global_lru_when_the_oldest_blocks_share_a_partition(redis_cluster) -> None:
    """Each partition scans only about twice its share of what the excess needs; when the
    oldest blocks all sit in one partition, the rounds (cut at that partition's horizon)
    must still evict exactly the oldest, in order."""
    from libs.blocks.keys import block_keys
    from libs.kvpool.pool import block_id
    from libs.kvpool.topology import CLUSTER_PARTITIONS, partition_of

    keys = block_keys(NS, list(range(4 * 2000)))
    in_zero = [k for k in keys if partition_of(block_id(NS, k), CLUSTER_PARTITIONS) == 0][:40]
    others = [k for k in keys if partition_of(block_id(NS, k), CLUSTER_PARTITIONS) != 0][:200]
    async with RedisPool(PoolConfig(url=redis_cluster.url, key_prefix=unique_prefix())) as pool:
        for k in in_zero:  # the oldest, one at a time so their LRU stamps are ordered
            await put_ok(pool, [k], values(1))
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.01)
        await put_ok(pool, others, values(len(others)))
        total = (await pool.stats()).bytes
        result = await pool.evict(budget_bytes=total - 30 * VALUE_NBYTES, max_blocks=256)
        assert result.evicted == 30 and result.bytes_after == total - 30 * VALUE_NBYTES
        exists = await pool.exists_blocks(NS, in_zero + others)
        assert exists == [False] * 30 + [True] * (10 + len(others))


async def test_a_lease_over_several_partitions_is_reaped_once_and_everywhere(redis_cluster) -> None:
    """Each partition holding a lease's keys records it with its own node's clock, so the
    records fall due a few milliseconds apart. A reap between those moments once counted
    the lease, and the next reap counted it again (cache_store's test saw 2 reaped leases
    for 1). Here one record is made due long before the others."""
    import redis.asyncio.cluster as aiocluster

    from libs.kvpool.pool import block_id
    from libs.kvpool.topology import CLUSTER_PARTITIONS, partition_of

    async with RedisPool(PoolConfig(url=redis_cluster.url, key_prefix=unique_prefix())) as pool:
        spread = {partition_of(block_id(NS, k), CLUSTER_PARTITIONS): k for k in KEYS}
        assert len(spread) >= 2
        keys = list(spread.values())
        await put_ok(pool, keys, values(len(keys)))
        lease = await pool.create_lease(NS, keys, ttl_s=60)
        _, parts = await pool.layout()
        first = parts[min(spread)]
        client = aiocluster.RedisCluster.from_url(redis_cluster.url)
        try:
            assert await client.zadd(first.leases, {lease: 1}, xx=True, ch=True) == 1  # due since 1970
        finally:
            await client.aclose()
        assert await pool.reap_leases() == 1
        stats = await pool.stats()
        assert stats.leases == 0 and stats.pinned_blocks == 0  # every partition's record went with it
        assert await pool.reap_leases() == 0
        assert not await pool.release_lease(lease)


async def test_memory_fill_is_the_fullest_node_of_a_cluster(redis_cluster) -> None:
    async with RedisPool(PoolConfig(url=redis_cluster.url, key_prefix=unique_prefix())) as pool:
        fill = await pool.memory_fill()
    fills = []
    for port in redis_cluster.ports:
        client = aioredis.Redis(port=port)
        try:
            info = await client.info("memory")
        finally:
            await client.aclose()
        fills.append(info["used_memory"] / info["maxmemory"])
    assert 0 < fill < 1 and fill == pytest.approx(max(fills), rel=0.1)


async def test_a_dropped_connection_is_retried(pool: RedisPool, pool_config: PoolConfig) -> None:
    await put_ok(pool, KEYS[:2], values(2))
    raw = aioredis.from_url(pool_config.url)
    try:
        killed = await raw.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
    finally:
        await raw.aclose()
    # The pooled connection is dead; the call reconnects and succeeds without an error.
    assert await pool.exists_prefix(NS, KEYS[:2]) == 2


async def test_a_hung_redis_times_out_instead_of_hanging(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    cfg = PoolConfig(url=server.url, key_prefix=unique_prefix(), socket_timeout_s=0.3, retries=1, retry_backoff_s=0.01)
    async with RedisPool(cfg) as pool:
        await pool.ping()
        pid = server._proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(PoolUnavailable):
                await asyncio.wait_for(pool.get_blocks(NS, KEYS[:2]), timeout=10)
            assert time.monotonic() - start < 5
        finally:
            os.kill(pid, signal.SIGCONT)
        await pool.ping()


async def test_redis_restart_mid_write_fails_loudly_then_recovers(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    cfg = PoolConfig(url=server.url, key_prefix=unique_prefix(), socket_timeout_s=1.0, retries=1, retry_backoff_s=0.05)
    from libs.blocks.keys import block_keys

    keys = block_keys(NS, list(range(4 * 300)))
    vals = values(len(keys), nbytes=64 * 1024)
    async with RedisPool(cfg) as pool:
        await put_ok(pool, keys[:1], vals[:1])  # loads the scripts, warms a connection
        writer = AsyncWriter(pool, workers=2, queue_size=16, batch_blocks=4, op_timeout_s=10)
        session = writer.begin()

        async def produce() -> None:
            for k, v in zip(keys, vals):
                await session.submit(NS, k, v)

        producer = asyncio.create_task(produce())
        # Kill Redis (SIGKILL) once writes are flowing; the producer keeps submitting.
        deadline = time.monotonic() + 10
        while writer.stats()["blocks_written"] < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        server.stop()
        await asyncio.wait_for(producer, timeout=30)
        with pytest.raises(WriteFailed) as info:
            await asyncio.wait_for(session.wait_all_done(), timeout=30)
        report = info.value.report
        assert isinstance(info.value.first_error, PoolUnavailable)
        assert len(report.written) + len(report.failed) == len(keys)
        with pytest.raises(PoolUnavailable):
            await pool.ping()

        server.start()  # same port, empty, no scripts loaded
        await pool.ping()
        again = writer.begin()
        for k, v in zip(keys[:8], vals[:8]):
            await again.submit(NS, k, v)
        report = await asyncio.wait_for(again.wait_all_done(), timeout=30)
        assert len(report.written) == 8
        # EVALSHA scripts were flushed by the restart: they are reloaded transparently.
        assert await pool.get_blocks(NS, keys[:8]) == vals[:8]
        assert (await pool.stats()).blocks == 8
        await writer.close()


async def test_password_is_used_and_a_wrong_one_fails_cleanly(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory()
    raw = aioredis.from_url(server.url)
    await raw.config_set("requirepass", "s3cret")
    await raw.aclose()
    prefix = unique_prefix()
    async with RedisPool(PoolConfig(url=server.url, password="s3cret", key_prefix=prefix)) as pool:
        await put_ok(pool, KEYS[:1], values(1))
        assert await pool.exists_prefix(NS, KEYS[:1]) == 1
    async with RedisPool(PoolConfig(url=server.url, password="bad-pa55", key_prefix=prefix, retries=0)) as pool:
        with pytest.raises(PoolUnavailable) as info:
            await pool.ping()
        assert "s3cret" not in str(info.value) and "bad-pa55" not in str(info.value)
