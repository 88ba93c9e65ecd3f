"""The pool contract, run here on the in-memory twin and in tests/integration on real Redis.

:class:`PoolContract` holds every behaviour both backends must share; a subclass supplies
the ``pool`` fixture. Twin-only behaviour (fault hooks) is tested below it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Sequence

import numpy as np
import pytest

from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.memory import MemoryPool
from libs.kvpool.pool import BlockPool, PoolUnavailable, PutError, block_id, block_ids, parse_block_id

NS = Namespace(model_digest="contract-model", dtype="bf16", block_size=4)
OTHER_NS = Namespace(model_digest="other-model", dtype="bf16", block_size=4)
KEYS = block_keys(NS, list(range(4 * 8 + 2)))  # 8 full blocks and a partial tail of 2
VALUE_NBYTES = 1000


def values(n: int, nbytes: int = VALUE_NBYTES) -> list[bytes]:
    return [os.urandom(nbytes) for _ in range(n)]


async def put_ok(pool: BlockPool, keys, vals, ns=NS, **kw) -> None:
    results = await pool.put_blocks(ns, list(zip(keys, vals)), **kw)
    assert results == [None] * len(keys)


class PoolContract:
    """Behaviour shared by every :class:`BlockPool`; subclasses provide a fresh ``pool``."""

    async def test_put_get_roundtrip_and_misses(self, pool: BlockPool) -> None:
        vals = values(4)
        await put_ok(pool, KEYS[:4], vals)
        got = await pool.get_blocks(NS, [KEYS[0], KEYS[5], KEYS[3], KEYS[8]])
        assert got == [vals[0], None, vals[3], None]
        stats = await pool.stats()
        assert stats.hits == 2 and stats.misses == {"absent": 2}
        assert stats.bytes_read == 2 * VALUE_NBYTES
        assert stats.puts == 4 and stats.bytes_written == 4 * VALUE_NBYTES
        # Same key string under another namespace is another block.
        assert await pool.get_blocks(OTHER_NS, [str(KEYS[0])]) == [None]

    async def test_get_blocks_into_lands_values_in_caller_memory(self, pool: BlockPool) -> None:
        vals = values(3)
        await put_ok(pool, KEYS[:3], vals)
        await put_ok(pool, KEYS[3:4], [b"too short"])
        dests = [np.zeros(VALUE_NBYTES, dtype=np.uint8) for _ in range(5)]
        landed: list[int] = []
        out = await pool.get_blocks_into(
            NS, KEYS[:5], [[memoryview(d[:24]), memoryview(d[24:])] for d in dests], on_landed=landed.append
        )
        assert out == [None, None, None, "length", "absent"]
        assert sorted(landed) == [0, 1, 2]  # once each, only for values that landed whole
        assert [d.tobytes() for d in dests[:3]] == vals
        assert not dests[3].any()  # a value of the wrong size is never written anywhere
        stats = await pool.stats()
        assert stats.hits == 4 and stats.misses == {"absent": 1}

        def refuse(i: int) -> None:
            if i == 1:
                raise RuntimeError("a bug in the caller's callback")

        out = await pool.get_blocks_into(NS, KEYS[:3], [[memoryview(d)] for d in dests[:3]], on_landed=refuse)
        assert out == [None, "error", None]
        with pytest.raises(ValueError):
            await pool.get_blocks_into(NS, KEYS[:2], [[memoryview(dests[0])]])

    async def test_empty_calls(self, pool: BlockPool) -> None:
        assert await pool.exists_prefix(NS, []) == 0
        assert await pool.get_blocks(NS, []) == []
        assert await pool.put_blocks(NS, []) == []
        assert await pool.exists_blocks(NS, []) == []
        assert await pool.delete_blocks(NS, []) == 0
        assert await pool.get_blocks_into(NS, [], []) == []

    async def test_exists_prefix_stops_at_the_first_gap(self, pool: BlockPool) -> None:
        await put_ok(pool, KEYS[:3] + KEYS[4:6], values(5))
        assert await pool.exists_prefix(NS, KEYS) == 3
        assert await pool.exists_prefix(NS, KEYS[4:6]) == 2
        assert await pool.exists_prefix(NS, KEYS[3:]) == 0
        assert await pool.exists_blocks(NS, KEYS[:6]) == [True, True, True, False, True, True]
        # Existence checks are not reads: no hits, no misses.
        stats = await pool.stats()
        assert stats.hits == 0 and stats.misses == {}

    async def test_partial_tail_is_a_block_like_any_other(self, pool: BlockPool) -> None:
        tail = KEYS[-1]
        assert tail.partial
        await put_ok(pool, [tail], [b"tail"])
        assert await pool.get_blocks(NS, [str(tail)]) == [b"tail"]

    async def test_bytes_are_counted_once_per_block(self, pool: BlockPool) -> None:
        vals = values(3)
        await put_ok(pool, KEYS[:3], vals)
        await put_ok(pool, KEYS[:3], vals)  # the same blocks again (two prefills of one prompt)
        stats = await pool.stats()
        assert (stats.blocks, stats.bytes) == (3, 3 * VALUE_NBYTES)
        assert stats.puts == 6
        assert await pool.delete_blocks(NS, [KEYS[0], KEYS[7]]) == 1
        stats = await pool.stats()
        assert (stats.blocks, stats.bytes) == (2, 2 * VALUE_NBYTES)
        assert await pool.get_blocks(NS, [KEYS[0]]) == [None]

    async def test_evicts_least_recently_used_first(self, pool: BlockPool) -> None:
        for k, v in zip(KEYS[:4], values(4)):
            await put_ok(pool, [k], [v])
            await asyncio.sleep(0.003)  # distinct LRU stamps (Redis stamps in ms)
        await pool.get_blocks(NS, [KEYS[0]])  # block 0 becomes the most recent
        result = await pool.evict(budget_bytes=2 * VALUE_NBYTES, max_blocks=100)
        assert (result.evicted, result.freed_bytes, result.bytes_after) == (2, 2 * VALUE_NBYTES, 2 * VALUE_NBYTES)
        assert await pool.exists_blocks(NS, KEYS[:4]) == [True, False, False, True]
        stats = await pool.stats()
        assert (stats.evictions, stats.evicted_bytes, stats.blocks) == (2, 2 * VALUE_NBYTES, 2)

    async def test_evict_respects_max_blocks(self, pool: BlockPool) -> None:
        await put_ok(pool, KEYS[:5], values(5))
        result = await pool.evict(budget_bytes=0, max_blocks=2)
        assert result.evicted == 2 and result.bytes_after == 3 * VALUE_NBYTES
        assert (await pool.evict(budget_bytes=10**9, max_blocks=100)).evicted == 0

    async def test_leased_blocks_are_never_evicted(self, pool: BlockPool) -> None:
        await put_ok(pool, KEYS[:4], values(4))
        lease = await pool.create_lease(NS, KEYS[:2], ttl_s=60)
        result = await pool.evict(budget_bytes=0, max_blocks=100)
        assert result.evicted == 2 and result.bytes_after == 2 * VALUE_NBYTES
        assert await pool.exists_blocks(NS, KEYS[:4]) == [True, True, False, False]
        stats = await pool.stats()
        assert stats.leases == 1 and stats.pinned_blocks == 2
        assert await pool.release_lease(lease) is True
        assert await pool.release_lease(lease) is False
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 2
        assert (await pool.stats()).pinned_blocks == 0

    async def test_two_leases_on_one_block_both_hold_it(self, pool: BlockPool) -> None:
        await put_ok(pool, KEYS[:1], values(1))
        first = await pool.create_lease(NS, KEYS[:1], ttl_s=60)
        second = await pool.create_lease(NS, KEYS[:1], ttl_s=60)
        assert await pool.release_lease(first)
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 0
        assert await pool.release_lease(second)
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 1

    async def test_put_under_a_lease_pins_the_block(self, pool: BlockPool) -> None:
        lease = await pool.create_lease(NS, [], ttl_s=60)
        await put_ok(pool, KEYS[:2], values(2), lease_id=lease)
        await put_ok(pool, KEYS[2:3], values(1))
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 1
        assert (await pool.stats()).pinned_blocks == 2
        # Writing the same block again under the same lease pins it once.
        await put_ok(pool, KEYS[:1], values(1), lease_id=lease)
        assert await pool.release_lease(lease)
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 2

    async def test_unknown_or_expired_lease_refuses_the_block_only(self, pool: BlockPool) -> None:
        await put_ok(pool, KEYS[:1], values(1))
        missing = "0" * 32
        results = await pool.put_blocks(NS, list(zip(KEYS[1:3], values(2))), lease_id=missing)
        assert all(isinstance(r, PutError) and r.reason == "lease" for r in results)
        assert await pool.exists_blocks(NS, KEYS[:3]) == [True, False, False]
        stats = await pool.stats()
        assert stats.blocks == 1 and stats.write_errors == {"lease": 2}
        short = await pool.create_lease(NS, [], ttl_s=0.05)
        await asyncio.sleep(0.1)
        (result,) = await pool.put_blocks(NS, [(KEYS[3], b"x")], lease_id=short)
        assert isinstance(result, PutError) and result.reason == "lease"

    async def test_expired_leases_are_reaped(self, pool: BlockPool) -> None:
        await put_ok(pool, KEYS[:2], values(2))
        await pool.create_lease(NS, KEYS[:1], ttl_s=0.05)
        await pool.create_lease(NS, KEYS[1:2], ttl_s=60)
        assert await pool.reap_leases() == 0
        await asyncio.sleep(0.1)
        # Expired but not yet reaped: still pinned.
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 0
        assert await pool.reap_leases() == 1
        stats = await pool.stats()
        assert stats.leases == 1 and stats.pinned_blocks == 1
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 1
        assert await pool.exists_blocks(NS, KEYS[:2]) == [False, True]

    async def test_record_misses(self, pool: BlockPool) -> None:
        await pool.record_misses("corrupt:checksum", 3)
        await pool.record_misses("corrupt:checksum")
        await pool.record_misses("expired", 0)
        assert (await pool.stats()).misses == {"corrupt:checksum": 4}
        with pytest.raises(ValueError):
            await pool.record_misses("Bad Reason!", 1)

    async def test_rejects_malformed_names(self, pool: BlockPool) -> None:
        with pytest.raises(ValueError):
            await pool.get_blocks(NS, ["not-a-key"])
        with pytest.raises(ValueError):
            await pool.get_blocks("zz" * 16, KEYS[:1])
        with pytest.raises(ValueError):
            await pool.put_blocks(NS, [(KEYS[0], b"x")], lease_id="not-a-lease")
        with pytest.raises(ValueError):
            await pool.create_lease(NS, KEYS[:1], ttl_s=0)
        assert await pool.release_lease("not-a-lease") is False

    async def test_ping(self, pool: BlockPool) -> None:
        await pool.ping()


class TestMemoryPool(PoolContract):
    @pytest.fixture
    async def pool(self) -> MemoryPool:
        return MemoryPool()


def test_block_ids_roundtrip() -> None:
    bid = block_id(NS, KEYS[-1])
    assert bid == f"{NS.hex}:{KEYS[-1]}"
    assert parse_block_id(bid) == (NS.hex, str(KEYS[-1]))
    for bad in ("", NS.hex, f"{NS.hex}:", f"{NS.hex}:{'g' * 32}", f"{NS.hex}:{KEYS[0]}:partial:0", f"x:{KEYS[0]}"):
        with pytest.raises(ValueError):
            parse_block_id(bad)


async def test_twin_refuses_blocks_past_capacity_one_by_one() -> None:
    pool = MemoryPool(capacity_bytes=2 * VALUE_NBYTES + 10)
    results = await pool.put_blocks(NS, list(zip(KEYS[:4], values(4))))
    assert results[:2] == [None, None]
    assert [r.reason for r in results[2:]] == ["oom", "oom"]
    assert (await pool.stats()).write_errors == {"oom": 2}


async def test_twin_fault_hook_sees_every_call_and_can_fail_it() -> None:
    calls: list[tuple[str, list[str]]] = []

    async def fault(op: str, ids: Sequence[str]) -> None:
        calls.append((op, list(ids)))
        if op == "get_blocks":
            raise PoolUnavailable("injected")

    pool = MemoryPool(fault=fault)
    await put_ok(pool, KEYS[:3], values(3))
    with pytest.raises(PoolUnavailable):
        await pool.get_blocks(NS, KEYS[:2])
    assert calls == [("put_blocks", block_ids(NS, KEYS[:3])), ("get_blocks", block_ids(NS, KEYS[:2]))]
    await pool.close()
    with pytest.raises(PoolUnavailable):
        await pool.ping()


def test_pool_config_validates_and_never_prints_a_password() -> None:
    from libs.kvpool.config import PoolConfig

    config = PoolConfig(url="redis://:hunter2@db:6379/1", password="hunter2", key_prefix="prod-a")
    assert "hunter2" not in repr(config)
    for bad in (
        {"url": "http://db"},
        {"key_prefix": "has space"},
        {"key_prefix": ""},
        {"pipeline_blocks": 0},
        {"retries": -1},
        {"socket_timeout_s": 0},
        {"max_parallel": 8, "max_connections": 4},
    ):
        with pytest.raises(ValueError):
            PoolConfig(**bad)  # type: ignore[arg-type]
