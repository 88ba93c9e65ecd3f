"""cache_store as a real process (``python -m services.cache_store``) on a real redis-server
and on a real 3-node Redis Cluster (one byte budget over every node), over HTTP."""

from __future__ import annotations

import asyncio
import os
import time
from typing import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest

from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.config import PoolConfig
from libs.kvpool.header import HEADER, HEADER_NBYTES, MAGIC
from libs.kvpool.redis_pool import RedisPool, data_key
from tests.integration.conftest import unique_prefix
from tests.integration.redis_server import RedisServer
from tests.integration.service_process import ServiceProcess

pytestmark = pytest.mark.integration

NS = Namespace(model_digest="cache-store-it", dtype="float16", block_size=4)
KEYS = block_keys(NS, list(range(4 * 12)))
LAYERS, HEADS, DIM = 2, 2, 64  # a full fp16 block: 2*2*4*2*64*2 = 4 KiB of payload
VALUE_NBYTES = HEADER_NBYTES + LAYERS * 2 * 4 * HEADS * DIM * 2


def block_value(tokens: int = 4) -> bytes:
    """A valid value (the service checks integrity, not the model), with random payload."""
    import xxhash

    payload = os.urandom(LAYERS * 2 * tokens * HEADS * DIM * 2)
    header = HEADER.pack(MAGIC, 1, 2, LAYERS, HEADS, DIM, tokens, xxhash.xxh3_64_intdigest(payload))
    return header + payload


def path(key: object) -> str:
    return f"/v1/blocks/{NS.hex}:{key}"


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def start_cache_store(redis_url: str, prefix: str, *extra: str) -> ServiceProcess:
    args = [
        "--redis-url", redis_url, "--key-prefix", prefix, "--maintenance-interval-s", "0.05",
        "--redis-timeout-s", "0.5", "--log-level", "info", "--shutdown-timeout-s", "2", *extra,
    ]
    return ServiceProcess("cache_store", args).start()


@pytest.fixture
def service(pool_url: str) -> Iterator[tuple[ServiceProcess, str]]:
    prefix = unique_prefix()
    proc = start_cache_store(pool_url, prefix, "--budget-bytes", str(4 * VALUE_NBYTES), "--max-value-bytes", "65536")
    yield proc, prefix
    proc.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def test_blocks_queries_and_bad_input_over_http(service: tuple[ServiceProcess, str], http: aiohttp.ClientSession) -> None:
    proc, _ = service
    base = proc.url
    value = block_value()
    async with http.put(base + path(KEYS[0]), data=value) as r:
        assert r.status == 201, await r.text()
    async with http.get(base + path(KEYS[0])) as r:
        assert r.status == 200 and await r.read() == value
    async with http.head(base + path(KEYS[0])) as r:
        assert r.status == 200
    async with http.post(base + "/v1/blocks/query", json={"namespace": NS.hex, "keys": [str(k) for k in KEYS[:2]]}) as r:
        assert await r.json() == {"exists": [True, False], "prefix": 1}
    for keys, prefix in ((KEYS[:2], 1), (KEYS[1:3], 0)):
        async with http.post(base + "/v1/blocks/query", json={"namespace": NS.hex, "keys": [str(k) for k in keys], "prefix_only": True}) as r:
            assert await r.json() == {"prefix": prefix}
    # Bad input of every kind: a 4xx with a JSON reason, and the service stays up.
    bad = [
        ("PUT", path(KEYS[1]), value[:-3], 400, "invalid_block"),
        ("PUT", path(KEYS[1]), b"x" * 70000, 413, "too_large"),
        ("PUT", path(KEYS[1]), b"garbage", 400, "invalid_block"),
        ("GET", "/v1/blocks/" + "q" * 40, None, 400, "malformed_key"),
        ("GET", path(KEYS[5]), None, 404, "not_found"),
        ("DELETE", "/v1/leases/" + "0" * 32, None, 404, "not_found"),
        ("DELETE", "/v1/leases/xyz", None, 400, "malformed_lease"),
        ("POST", "/v1/blocks/query", b"\xff\xfe", 400, "malformed_body"),
    ]
    for method, url, data, status, code in bad:
        async with http.request(method, base + url, data=data) as r:
            assert r.status == status, (method, url, await r.text())
            assert (await r.json())["error"]["code"] == code
    async with http.delete(base + path(KEYS[0])) as r:
        assert r.status == 200
    async with http.get(base + "/health") as r:
        assert r.status == 200
    async with http.get(base + "/metrics") as r:
        text = await r.text()
        assert 'tidepool_cache_store_rejected_requests_total{reason="invalid_block"} 2.0' in text
    assert proc.stop() == 0, proc.output  # SIGTERM: a clean exit


async def test_budget_eviction_never_evicts_leased_blocks_and_expired_leases_are_reaped(
    service: tuple[ServiceProcess, str], http: aiohttp.ClientSession, pool_url: str
) -> None:
    proc, prefix = service
    base = proc.url
    async with http.post(base + "/v1/leases", json={"namespace": NS.hex, "keys": [str(k) for k in KEYS[:3]], "ttl_s": 1.0}) as r:
        assert r.status == 201
        lease = (await r.json())["lease_id"]
    # Like prefill: bytes go straight to Redis, cache_store only sees the bookkeeping.
    async with RedisPool(PoolConfig(url=pool_url, key_prefix=prefix)) as pool:
        for key in KEYS[:10]:
            assert await pool.put_blocks(NS, [(key, block_value())]) == [None]
            await asyncio.sleep(0.002)
        slots, _ = await pool.layout()
        if slots.cluster:  # the budget is one, the blocks are on several nodes
            nodes = {slots.node_for(data_key(prefix, f"{NS.hex}:{k}", cluster=True)) for k in KEYS[:10]}
            assert len(nodes) > 1

        async def within_budget() -> bool:
            return (await pool.stats()).bytes <= 4 * VALUE_NBYTES

        await wait_until(within_budget, 5, "eviction to the budget")
        exists = await pool.exists_blocks(NS, KEYS[:10])
        assert exists[:3] == [True, True, True], "a leased block was evicted"
        assert exists[3:] == [False] * 6 + [True], "LRU order: the newest unleased block stays"

        async def reaped() -> bool:
            return (await pool.stats()).leases == 0

        await wait_until(reaped, 5, "the expired lease to be reaped")
        stats = await pool.stats()
        assert stats.pinned_blocks == 0 and stats.evictions >= 6
    async with http.delete(base + f"/v1/leases/{lease}") as r:
        assert r.status == 404  # already reaped
    async with http.get(base + "/v1/stats") as r:
        stats = await r.json()
        assert stats["policy"]["reaped_leases"] == 1 and stats["bytes"] <= 4 * VALUE_NBYTES


async def test_survives_a_redis_restart(redis_factory: Callable[..., RedisServer], http: aiohttp.ClientSession) -> None:
    server = redis_factory()
    proc = start_cache_store(server.url, unique_prefix())
    try:
        base = proc.url

        def health(status: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                async with http.get(base + "/health") as r:
                    return r.status == status

            return check

        await wait_until(health(200), 5, "healthy at start")
        async with http.put(base + path(KEYS[0]), data=block_value()) as r:
            assert r.status == 201
        server.stop()
        await wait_until(health(503), 10, "/health to report the outage")
        async with http.get(base + path(KEYS[0])) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "pool_unavailable"
        async with http.get(base + "/v1/stats") as r:
            assert r.status == 200 and (await r.json())["redis_up"] is False
        server.start()
        await wait_until(health(200), 10, "/health to recover")
        async with http.put(base + path(KEYS[1]), data=block_value()) as r:
            assert r.status == 201, await r.text()
        async with http.get(base + path(KEYS[1])) as r:
            assert r.status == 200
        async with http.get(base + "/metrics") as r:
            text = await r.text()
        assert "tidepool_cache_store_outages_total 1.0" in text
        assert proc.running
    finally:
        proc.close()
