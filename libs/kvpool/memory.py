"""The in-memory twin of the Redis pool, for unit tests of everything above the pool.

It keeps the same bookkeeping as the Redis schema (libs/kvpool/redis_pool.py): sizes
counted once on creation, an LRU order, pins counted per lease, the same stats counters,
and the same per-block refusals (``"oom"`` past ``capacity_bytes``, ``"lease"`` for an
unknown or expired lease). Every method is a coroutine that yields to the loop, like a
network call.

Fault injection, for tests of callers:

- ``fault``: an async hook awaited at the start of every operation with the operation's
  name and the block ids it touches (empty for operations on no block). It may sleep (a slow pool), raise (a failing
  pool: raise :class:`PoolUnavailable` to look like a dropped connection), or never return
  (a hung pool).
- ``capacity_bytes``: like Redis' ``maxmemory`` with ``noeviction``, a write that would
  go past it is refused for that block only.
- ``clock``: seconds, for lease expiry; tests pass a fake one to expire leases at will.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from typing import Awaitable, Callable, Sequence

from libs.kvpool.header import Value, value_nbytes, value_parts
from libs.kvpool.pool import BlockPool, EvictResult, PoolStats, PoolUnavailable, PutError

FaultHook = Callable[[str, Sequence[str]], Awaitable[None]]


class MemoryPool(BlockPool):
    def __init__(
        self,
        *,
        capacity_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        fault: FaultHook | None = None,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        self.fault = fault
        self._data: dict[str, bytes] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._bytes = 0
        self._counters: Counter[str] = Counter()
        self._pins: Counter[str] = Counter()
        self._leases: dict[str, tuple[float, set[str]]] = {}
        self._closed = False

    async def _enter(self, op: str, ids: Sequence[str] = ()) -> None:
        if self._closed:
            raise PoolUnavailable("pool is closed")
        if self.fault is not None:
            await self.fault(op, ids)
        await asyncio.sleep(0)

    # -- data plane -----------------------------------------------------------------------

    async def _exists_prefix(self, ids: list[str]) -> int:
        await self._enter("exists_prefix", ids)
        for n, bid in enumerate(ids):
            if bid not in self._data:
                return n
        return len(ids)

    async def _exists_blocks(self, ids: list[str]) -> list[bool]:
        await self._enter("exists_blocks", ids)
        return [bid in self._data for bid in ids]

    async def _get_blocks(self, ids: list[str]) -> list[bytes | None]:
        await self._enter("get_blocks", ids)
        values = [self._data.get(bid) for bid in ids]
        for bid, value in zip(ids, values):
            if value is None:
                self._counters["misses:absent"] += 1
            else:
                self._lru.move_to_end(bid)
                self._counters["hits"] += 1
                self._counters["bytes_read"] += len(value)
        return values

    async def _put_blocks(self, pairs: list[tuple[str, Value]], lease_id: str | None) -> list[PutError | None]:
        await self._enter("put_blocks", [bid for bid, _ in pairs])
        return [self._put_one(bid, value, lease_id) for bid, value in pairs]

    def _put_one(self, bid: str, value: Value, lease_id: str | None) -> PutError | None:
        old = self._data.get(bid)
        nbytes = value_nbytes(value)
        grow = nbytes - (len(old) if old is not None else 0)
        error: PutError | None = None
        if self.capacity_bytes is not None and grow > 0 and self._bytes + grow > self.capacity_bytes:
            error = PutError("oom", f"{self._bytes} + {grow} bytes would exceed capacity {self.capacity_bytes}")
        elif lease_id is not None and not self._lease_live(lease_id):
            error = PutError("lease", f"lease {lease_id} is unknown or expired")
        if error is not None:
            self._counters[f"write_errors:{error.reason}"] += 1
            return error
        if lease_id is not None:
            members = self._leases[lease_id][1]
            if bid not in members:
                members.add(bid)
                self._pins[bid] += 1
        self._data[bid] = b"".join(value_parts(value))
        self._bytes += grow
        self._lru[bid] = None
        self._lru.move_to_end(bid)
        self._counters["puts"] += 1
        self._counters["bytes_written"] += nbytes
        return None

    async def _delete_blocks(self, ids: list[str]) -> int:
        await self._enter("delete_blocks", ids)
        return sum(self._drop(bid) for bid in ids)

    def _drop(self, bid: str) -> bool:
        value = self._data.pop(bid, None)
        if value is None:
            return False
        self._bytes -= len(value)
        del self._lru[bid]
        return True

    # -- leases ---------------------------------------------------------------------------

    def _lease_live(self, lease_id: str) -> bool:
        lease = self._leases.get(lease_id)
        return lease is not None and lease[0] > self.clock()

    async def _create_lease(self, lease_id: str, ids: list[str], ttl_s: float) -> None:
        await self._enter("create_lease", ids)
        members = set(ids)
        self._leases[lease_id] = (self.clock() + ttl_s, members)
        self._pins.update(members)

    async def _release_lease(self, lease_id: str) -> bool:
        await self._enter("release_lease")
        return self._release(lease_id)

    def _release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._pins.subtract(lease[1])
        for bid in lease[1]:
            if self._pins[bid] <= 0:
                del self._pins[bid]
        return True

    async def reap_leases(self, max_leases: int = 1000) -> int:
        await self._enter("reap_leases")
        now = self.clock()
        due = sorted((exp, lid) for lid, (exp, _) in self._leases.items() if exp <= now)[:max_leases]
        for _, lid in due:
            self._release(lid)
        return len(due)

    # -- accounting and policy ----------------------------------------------------------

    async def _count(self, counters: dict[str, int]) -> None:
        await self._enter("count")
        self._counters.update(counters)

    async def stats(self) -> PoolStats:
        await self._enter("stats")
        return PoolStats.from_counters(
            blocks=len(self._data),
            bytes=self._bytes,
            leases=len(self._leases),
            pinned_blocks=len(self._pins),
            counters=dict(self._counters),
        )

    async def memory_fill(self) -> float:
        await self._enter("memory_fill")
        return self._bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    async def evict(self, budget_bytes: int, max_blocks: int) -> EvictResult:
        await self._enter("evict")
        evicted = freed = 0
        for bid in list(self._lru):
            if self._bytes <= budget_bytes or evicted >= max_blocks:
                break
            if self._pins[bid] > 0:
                continue
            freed += len(self._data[bid])
            self._drop(bid)
            evicted += 1
        self._counters["evictions"] += evicted
        self._counters["evicted_bytes"] += freed
        return EvictResult(evicted, freed, self._bytes)

    # -- lifecycle ----------------------------------------------------------------------

    async def ping(self) -> None:
        await self._enter("ping")

    async def close(self) -> None:
        self._closed = True
