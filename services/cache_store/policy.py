"""The pool's policy loop: reap expired leases, evict to the byte budget, refresh statistics.

Redis runs with ``maxmemory-policy noeviction``, so nothing leaves the pool unless this
loop (or an explicit DELETE) removes it. Each pass:

1. reaps leases whose TTL passed, so the blocks they pinned become evictable again
   (before evicting: an expired lease must not keep a block alive for one more pass);
2. evicts least recently used unleased blocks, ``evict_batch`` per script call so that
   Redis is never paused for long, until the pool's bytes are within the budget or only
   pinned blocks are left; then, if the fullest Redis server uses more than
   ``memory_high_watermark`` (0.8) of its ``maxmemory``, further down to the bytes that
   bring it to the watermark. The budget counts value bytes only; each value also costs
   allocator overhead (a 368,664-byte SmolLM2 block takes a 393,216-byte allocation), and
   clients' query and output buffers count toward ``maxmemory`` too. A budget of 80% of
   ``maxmemory`` left too little of the rest for those on an H100: prefill's writes were
   refused (OOM) for 9-14 of 24 handoffs into a 1.5 GB pool at its budget, and in a small
   pool before the budget was ever reached (bench/RESULTS.md, issue 8);
3. reads the pool-wide statistics that /metrics and /stats serve.

Passes run every ``interval_s``, or every ``pressure_interval_s`` while the pool is filled
at its budget or watermark (within the last ``interval_s`` a pass evicted, or found it
within 5% of either and grown since the pass before): a pool written faster than its
slack per ``interval_s`` would otherwise fill that slack between passes and refuse writes
(OOM) until the next one. Memory counts whatever else the servers hold too: a pool sharing
Redis with other data gives way to it.

A failing pass (Redis down, restarting, timing out) is counted, logged once per outage and
retried on the next tick: the loop never exits on an error, and the pool client
reconnects by itself, so the service recovers without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from libs.kvpool.pool import BlockPool, PoolError, PoolStats

log = logging.getLogger("tidepool.cache_store.policy")

# A pool within this fraction of its budget or memory watermark that grew since the previous
# pass is being filled at it, as is one a pass had to evict from.
NEAR = 0.95


@dataclass
class PolicyCounters:
    """What the loop did, for /metrics and /stats. Every field starts at a real zero."""

    passes: int = 0
    failed_passes: int = 0
    reaped_leases: int = 0
    evicted_blocks: int = 0
    evicted_bytes: int = 0
    memory_evictions: int = 0  # passes that evicted below the budget for the servers' memory
    memory_fill: float = 0.0  # the fullest server's used / max memory at the last pass
    last_error: str | None = None
    last_pass_s: float = 0.0
    outages: int = 0
    errors_by_kind: dict[str, int] = field(default_factory=dict)


class PolicyLoop:
    def __init__(
        self, pool: BlockPool, *, budget_bytes: int, interval_s: float, evict_batch: int, pressure_interval_s: float | None = None,
        memory_high_watermark: float = 0.8, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < memory_high_watermark <= 1:
            raise ValueError(f"memory_high_watermark must be in (0, 1], got {memory_high_watermark}")
        self.memory_high_watermark = memory_high_watermark
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.interval_s = interval_s
        self.pressure_interval_s = min(interval_s, pressure_interval_s if pressure_interval_s is not None else interval_s)
        self.under_pressure = False  # filled at a limit within the last interval_s: short passes
        self._clock = clock
        self._pressed_at = -float("inf")  # when a pass last evicted, or found the pool near a limit and grown
        self._last_bytes = 0  # the pool's bytes after the previous pass
        self.evict_batch = evict_batch
        self.counters = PolicyCounters()
        self.snapshot: PoolStats | None = None  # the latest pool statistics
        self.redis_up: bool | None = None  # unknown until the first pass
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="cache_store-policy")

    async def stop(self) -> None:
        """Stop the loop; returns only once it has.

        Cancelling once is not enough on Python 3.11: ``asyncio.wait_for`` (inside
        redis-py's socket calls) can swallow a cancellation that lands as its inner call
        completes, and the loop would go on to sleep with the cancel lost, so shutdown
        would wait forever. The flag ends the loop at its next turn, and the cancel is
        repeated until the task is done.
        """
        self._stopping = True
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)

    async def _run(self) -> None:
        while not self._stopping:
            await self.run_pass()
            await asyncio.sleep(self.pressure_interval_s if self.under_pressure else self.interval_s)

    async def _evict_to(self, budget: int) -> int:
        """Evict to ``budget`` bytes, ``evict_batch`` blocks per call; the bytes left."""
        while True:
            result = await self.pool.evict(budget, self.evict_batch)
            self.counters.evicted_blocks += result.evicted
            self.counters.evicted_bytes += result.freed_bytes
            if result.evicted < self.evict_batch or result.bytes_after <= budget:
                return result.bytes_after

    async def run_pass(self) -> bool:
        """One reap/evict/stats pass; ``False`` (and counted) if the pool failed."""
        start = time.perf_counter()
        evicted_before = self.counters.evicted_blocks
        try:
            self.counters.reaped_leases += await self.pool.reap_leases()
            bytes_now = await self._evict_to(self.budget_bytes)
            fill = self.counters.memory_fill = await self.pool.memory_fill()
            if fill > self.memory_high_watermark and bytes_now > 0:
                # Blocks spread evenly over the servers, so scaling the pool's bytes scales
                # the fullest server's share of them (its fixed overhead makes this land a
                # little above the watermark; the next pass takes the rest).
                self.counters.memory_evictions += 1
                bytes_now = await self._evict_to(int(bytes_now * self.memory_high_watermark / fill))
            # Filled at a limit: the next writes may cross it before a full interval passes.
            # Writes come in bursts (a prompt's blocks), so a pass that sees none keeps the
            # short interval for one full interval after the last sign; an idle full pool
            # then goes back to the long one.
            near = bytes_now >= NEAR * self.budget_bytes or fill >= NEAR * self.memory_high_watermark
            if self.counters.evicted_blocks > evicted_before or (near and bytes_now > self._last_bytes):
                self._pressed_at = self._clock()
            self.under_pressure = self._clock() - self._pressed_at < self.interval_s
            self._last_bytes = bytes_now
            self.snapshot = await self.pool.stats()
        except Exception as exc:  # the loop must outlive any failure, or eviction stops for good
            kind = type(exc).__name__
            self.counters.failed_passes += 1
            self.counters.errors_by_kind[kind] = self.counters.errors_by_kind.get(kind, 0) + 1
            self.counters.last_error = f"{kind}: {exc}"
            if not isinstance(exc, PoolError):
                log.exception("policy pass failed (a bug, not an outage)")
            elif self.redis_up is not False:  # log an outage once, not once per tick
                self.counters.outages += 1
                log.warning("pool unavailable, retrying every %.1fs: %s", self.interval_s, exc)
                self.redis_up = False
            return False
        finally:
            self.counters.passes += 1
            self.counters.last_pass_s = time.perf_counter() - start
        if self.redis_up is False:
            log.info("pool reachable again")
        self.redis_up = True
        return True
