"""cache_store's HTTP API on the in-memory twin (the real process on Redis: tests/integration)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.codec import BlockCodec
from libs.kvpool.layout import KVLayout
from libs.kvpool.memory import MemoryPool
from libs.kvpool.pool import block_id
from services.cache_store.app import build_app
from services.cache_store.settings import CacheStoreSettings

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
CODEC = BlockCodec(LAYOUT)
NS = Namespace(model_digest="app-model", dtype="float16", block_size=4)
KEYS = block_keys(NS, list(range(4 * 6 + 3)))  # 6 full blocks and a partial tail of 3
FULL = CODEC.value_nbytes(4)


def encoded(i: int, tokens: int = 4) -> bytes:
    gen = torch.Generator().manual_seed(i)
    return bytes(CODEC.encode(torch.randn(LAYOUT.block_shape, generator=gen).to(LAYOUT.dtype), tokens))


def url(key: object) -> str:
    return f"/v1/blocks/{block_id(NS, key)}"  # type: ignore[arg-type]


@pytest.fixture
async def pool() -> MemoryPool:
    return MemoryPool()


@pytest.fixture
async def client(pool: MemoryPool) -> AsyncIterator[TestClient]:
    settings = CacheStoreSettings(
        port=0, budget_bytes=3 * FULL, max_value_bytes=4 * FULL, maintenance_interval_s=0.02, max_query_keys=16
    )
    async with TestClient(TestServer(build_app(settings, pool=pool))) as c:
        yield c


async def error_code(resp) -> str:  # type: ignore[no-untyped-def]
    body = await resp.json()
    return body["error"]["code"]


async def test_block_put_get_head_delete(client: TestClient) -> None:
    value = encoded(0)
    resp = await client.put(url(KEYS[0]), data=value)
    assert resp.status == 201, await resp.text()
    assert (await resp.json())["tokens"] == 4
    resp = await client.get(url(KEYS[0]))
    assert resp.status == 200 and await resp.read() == value
    assert resp.content_type == "application/octet-stream"
    assert (await client.head(url(KEYS[0]))).status == 200
    assert (await client.head(url(KEYS[1]))).status == 404
    assert (await client.delete(url(KEYS[0]))).status == 200
    resp = await client.get(url(KEYS[0]))
    assert resp.status == 404 and await error_code(resp) == "not_found"
    assert (await client.delete(url(KEYS[0]))).status == 404


async def test_partial_block_must_hold_the_key_s_token_count(client: TestClient) -> None:
    tail = KEYS[-1]
    assert tail.partial and tail.num_tokens == 3
    assert (await client.put(url(tail), data=encoded(1, tokens=3))).status == 201
    resp = await client.put(url(tail), data=encoded(1, tokens=2))
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda v: v[:-1], "truncated"),
        (lambda v: v + b"\0", "length"),
        (lambda v: b"XXXX" + v[4:], "magic"),
        (lambda v: v[:40] + bytes([v[40] ^ 1]) + v[41:], "checksum"),
        (lambda v: b"", "truncated"),
    ],
)
async def test_put_of_an_invalid_block_is_a_400_naming_the_reason(client: TestClient, mangle, reason) -> None:  # type: ignore[no-untyped-def]
    resp = await client.put(url(KEYS[0]), data=mangle(encoded(0)))
    assert resp.status == 400
    body = await resp.json()
    assert body["error"]["code"] == "invalid_block" and body["error"]["param"] == reason
    assert (await client.head(url(KEYS[0]))).status == 404


async def test_bad_input_is_a_4xx_with_a_json_reason(client: TestClient) -> None:
    cases = [
        (client.get("/v1/blocks/nonsense"), 400, "malformed_key"),
        (client.put(f"/v1/blocks/{NS.hex}:{'z' * 32}", data=b"x"), 400, "malformed_key"),
        (client.put(url(KEYS[0]), data=b"\0" * (4 * FULL + 1)), 413, "too_large"),
        (client.put(url(KEYS[0]) + "?lease=nope", data=encoded(0)), 400, "malformed_lease"),
        (client.put(url(KEYS[0]) + "?lease=" + "a" * 32, data=encoded(0)), 409, "lease"),
        (client.post("/v1/blocks/query", data=b"{not json"), 400, "malformed_body"),
        (client.post("/v1/blocks/query", json=[1, 2]), 400, "malformed_body"),
        (client.post("/v1/blocks/query", json={"namespace": NS.hex, "keys": [1]}), 400, "malformed_key"),
        (client.post("/v1/blocks/query", json={"namespace": "x", "keys": []}), 400, "malformed_key"),
        (client.post("/v1/blocks/query", json={"namespace": NS.hex, "keys": [str(KEYS[0])] * 17}), 400, "too_large"),
        (client.post("/v1/blocks/query", json={"namespace": NS.hex, "keys": [], "prefix_only": "yes"}), 400, "malformed_body"),
        (client.post("/v1/leases", json={"namespace": NS.hex, "keys": [], "ttl_s": -1}), 400, "malformed_body"),
        (client.post("/v1/leases", json={"namespace": NS.hex, "keys": [], "ttl_s": "10"}), 400, "malformed_body"),
        (client.post("/v1/leases", json={"namespace": NS.hex, "keys": [], "ttl_s": 10**6}), 400, "malformed_body"),
        (client.delete("/v1/leases/nope"), 400, "malformed_lease"),
        (client.delete("/v1/leases/" + "b" * 32), 404, "not_found"),
    ]
    for request, status, code in cases:
        resp = await request
        assert resp.status == status, (code, await resp.text())
        assert await error_code(resp) == code
    assert (await client.get("/health")).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'tidepool_cache_store_rejected_requests_total{reason="malformed_key"} 4.0' in metrics


async def test_query_reports_existence_and_the_leading_prefix(client: TestClient) -> None:
    for i in (0, 1, 3):
        assert (await client.put(url(KEYS[i]), data=encoded(i))).status == 201
    resp = await client.post("/v1/blocks/query", json={"namespace": NS.hex, "keys": [str(k) for k in KEYS[:5]]})
    assert await resp.json() == {"exists": [True, True, False, True, False], "prefix": 2}
    for keys, prefix in ((KEYS[:5], 2), (KEYS[2:5], 0), (KEYS[3:4], 1), (KEYS[:2], 2)):
        resp = await client.post("/v1/blocks/query", json={"namespace": NS.hex, "keys": [str(k) for k in keys], "prefix_only": True})
        assert await resp.json() == {"prefix": prefix}


async def test_budget_eviction_spares_leased_blocks_and_reaps_expired_leases(client: TestClient, pool: MemoryPool) -> None:
    resp = await client.post("/v1/leases", json={"namespace": NS.hex, "keys": [str(k) for k in KEYS[:2]], "ttl_s": 0.3})
    assert resp.status == 201
    lease = await resp.json()
    assert lease["blocks"] == 2
    for i in range(6):
        assert (await client.put(url(KEYS[i]), data=encoded(i))).status == 201
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.15)  # several policy passes
    stats = await (await client.get("/v1/stats")).json()
    assert stats["bytes"] <= 3 * FULL and stats["evictions"] == 3
    assert await pool.exists_blocks(NS, KEYS[:6]) == [True, True, False, False, False, True]
    await asyncio.sleep(0.4)  # the lease expires, is reaped, and its blocks become evictable
    stats = await (await client.get("/v1/stats")).json()
    assert stats["leases"] == 0 and stats["pinned_blocks"] == 0 and stats["policy"]["reaped_leases"] == 1
    assert (await client.delete(f"/v1/leases/{lease['lease_id']}")).status == 404
    metrics = await (await client.get("/metrics")).text()
    for line in (
        "tidepool_pool_evictions_total 3.0",
        f"tidepool_pool_evicted_bytes_total {3.0 * FULL}",
        "tidepool_cache_store_reaped_leases_total 1.0",
        "tidepool_pool_leases 0.0",
        f"tidepool_pool_budget_bytes {3.0 * FULL}",
    ):
        assert line in metrics, line


async def test_stats_and_metrics_are_set_from_the_start(client: TestClient) -> None:
    assert (await client.put(url(KEYS[0]), data=encoded(0))).status == 201
    assert (await client.put(url(KEYS[1]) + "?lease=" + "c" * 32, data=encoded(1))).status == 409
    await client.get(url(KEYS[0]))
    await client.get(url(KEYS[1]))
    stats = await (await client.get("/v1/stats")).json()
    assert stats == {**stats, "blocks": 1, "hits": 1, "misses": {"absent": 1}, "redis_up": True}
    assert (await (await client.get("/stats")).json()).keys() == stats.keys()
    await asyncio.sleep(0.05)
    metrics = await (await client.get("/metrics")).text()
    for line in (
        "tidepool_pool_blocks 1.0",
        "tidepool_pool_hits_total 1.0",
        'tidepool_pool_misses_total{reason="absent"} 1.0',
        'tidepool_pool_write_errors_total{reason="oom"} 0.0',
        'tidepool_pool_write_errors_total{reason="lease"} 1.0',
        "tidepool_pool_puts_total 1.0",
        f"tidepool_pool_written_bytes_total {float(FULL)}",
        f"tidepool_pool_read_bytes_total {float(FULL)}",
        "tidepool_pool_evictions_total 0.0",
        "tidepool_cache_store_redis_up 1.0",
    ):
        assert line in metrics, line


async def test_health_follows_the_pool(client: TestClient, pool: MemoryPool) -> None:
    assert (await client.get("/health")).status == 200
    await pool.close()
    assert (await client.get("/health")).status == 503
    resp = await client.get(url(KEYS[0]))
    assert resp.status == 503 and await error_code(resp) == "pool_unavailable"
    stats = await (await client.get("/v1/stats")).json()
    assert stats["redis_up"] is False and stats["stale"] is True


async def test_the_policy_loop_outlives_failures() -> None:
    from services.cache_store.policy import PolicyLoop

    calls = 0

    async def fault(op: str, ids: object) -> None:
        nonlocal calls
        if op == "reap_leases":
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in a pool call")
            if calls == 2:
                from libs.kvpool.pool import PoolUnavailable

                raise PoolUnavailable("redis down")

    policy = PolicyLoop(MemoryPool(fault=fault), budget_bytes=0, interval_s=0.01, evict_batch=8)
    assert not await policy.run_pass()
    assert policy.redis_up is None  # a bug says nothing about Redis
    assert not await policy.run_pass()
    assert policy.redis_up is False and policy.counters.outages == 1
    assert await policy.run_pass()
    assert policy.redis_up is True
    assert policy.counters.errors_by_kind == {"RuntimeError": 1, "PoolUnavailable": 1}
    assert (policy.counters.passes, policy.counters.failed_passes) == (3, 2)


async def test_the_policy_loop_stops_even_if_a_cancellation_is_swallowed() -> None:
    # Python 3.11's asyncio.wait_for (inside redis-py) can swallow a cancellation; a loop
    # that relied on one cancel would then never stop, and neither would the service.
    from services.cache_store.policy import PolicyLoop

    entered = asyncio.Event()

    async def swallow(op: str, ids: object) -> None:
        if op == "reap_leases":
            entered.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # what the wait_for race does: the call completes, the cancel is lost

    policy = PolicyLoop(MemoryPool(fault=swallow), budget_bytes=0, interval_s=30, evict_batch=8)
    policy.start()
    await asyncio.wait_for(entered.wait(), 5)
    await asyncio.wait_for(policy.stop(), 5)


async def test_the_policy_loop_keeps_pace_with_a_pool_filled_at_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a pass that had to evict, the next comes after ``pressure_interval_s``, not the
    full interval: writes arriving faster than one budget's slack per interval would
    otherwise find Redis full (OOM) between passes. A pass with nothing to evict goes back
    to the full interval."""
    from services.cache_store import policy as policy_module
    from services.cache_store.policy import PolicyLoop

    pool = MemoryPool(capacity_bytes=5 * FULL)  # "maxmemory": two blocks of slack above the budget
    policy = PolicyLoop(pool, budget_bytes=3 * FULL, interval_s=30.0, pressure_interval_s=0.01, evict_batch=8)
    sleeps: list[float] = []
    written = iter(range(4 * 6))
    refused: list[str] = []
    real_sleep = asyncio.sleep

    async def writes_between_passes(seconds: float) -> None:
        """Each pause of the loop: the writers add as much as that pause lets them (two
        blocks in a short one, more in a long one), then the loop goes on."""
        if seconds == 0:  # the pool twin yielding inside a call, not the loop's pause
            return await real_sleep(0)
        sleeps.append(seconds)
        for _ in range(2 if seconds < 1 else 4):
            i = next(written, None)
            if i is None:
                policy._stopping = True
                break
            key = block_keys(Namespace(model_digest=f"fill-{i}", dtype="float16", block_size=4), [1, 2, 3, 4])[0]
            errors = await pool.put_blocks(NS, [(key, encoded(i))])
            refused.extend(e.reason for e in errors if e is not None)
        await real_sleep(0)

    monkeypatch.setattr(policy_module.asyncio, "sleep", writes_between_passes)
    await policy._run()
    assert policy.counters.evicted_blocks > 0
    assert refused == [], "writes between passes at the pressure interval must fit the slack"
    # Nothing to evict at first (empty pool): the full interval; then the pool sits at its
    # budget and every pass evicts, so the short one.
    assert sleeps[0] == 30.0 and set(sleeps[2:]) == {0.01}


async def test_the_policy_loop_evicts_by_the_servers_memory_below_its_budget() -> None:
    """The twin's capacity stands for Redis' maxmemory: a pool at 95% of it is brought to
    the high watermark although its byte budget is far away, and takes writes again."""
    from services.cache_store.policy import PolicyLoop

    pool = MemoryPool(capacity_bytes=20 * FULL)
    for i in range(19):
        key = block_keys(Namespace(model_digest=f"mem-{i}", dtype="float16", block_size=4), [1, 2, 3, 4])[0]
        assert await pool.put_blocks(NS, [(key, encoded(i))]) == [None]
    policy = PolicyLoop(pool, budget_bytes=1000 * FULL, interval_s=1.0, evict_batch=4, memory_high_watermark=0.8)
    assert await policy.run_pass()
    assert policy.counters.memory_evictions == 1 and policy.counters.memory_fill == pytest.approx(0.95)
    assert await pool.memory_fill() <= 0.8
    assert policy.counters.evicted_blocks == 3  # the oldest first, as many as the watermark needs
    assert await policy.run_pass() and policy.counters.memory_evictions == 1  # under the watermark: nothing more
    with pytest.raises(ValueError):
        PolicyLoop(pool, budget_bytes=0, interval_s=1.0, evict_batch=4, memory_high_watermark=0)


async def test_a_pool_left_near_its_budget_keeps_the_short_interval() -> None:
    """Right after an eviction the pool sits at its budget; a pass that finds nothing to
    evict then must not send the loop back to its long interval while writes keep coming
    (they come in bursts and would overflow before it). A full pool idle for a whole
    interval, and a pool well below both limits, get the long one."""
    from services.cache_store.policy import PolicyLoop

    pool = MemoryPool()
    for i in range(20):
        key = block_keys(Namespace(model_digest=f"near-{i}", dtype="float16", block_size=4), [1, 2, 3, 4])[0]
        assert await pool.put_blocks(NS, [(key, encoded(i))]) == [None]
    now = [0.0]
    at_budget = PolicyLoop(pool, budget_bytes=20 * FULL, interval_s=1.0, pressure_interval_s=0.01, evict_batch=4, clock=lambda: now[0])
    assert await at_budget.run_pass() and at_budget.counters.evicted_blocks == 0 and at_budget.under_pressure
    now[0] = 0.5
    assert await at_budget.run_pass() and at_budget.under_pressure  # no write since, but within the interval
    now[0] = 1.2
    assert await at_budget.run_pass() and not at_budget.under_pressure  # full but idle for an interval: the long one
    key = block_keys(Namespace(model_digest="near-more", dtype="float16", block_size=4), [1, 2, 3, 4])[0]
    assert await pool.put_blocks(NS, [(key, encoded(99))]) == [None]
    assert await at_budget.run_pass() and at_budget.under_pressure  # written again: it evicted, short again
    roomy = PolicyLoop(pool, budget_bytes=40 * FULL, interval_s=1.0, pressure_interval_s=0.01, evict_batch=4)
    assert await roomy.run_pass() and not roomy.under_pressure
