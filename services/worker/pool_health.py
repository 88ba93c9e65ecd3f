"""Is the pool's Redis reachable from this instance? Detecting outages and restarts.

Why: while Redis is away every handoff is a miss and the instance serves by recomputing
(faults cost latency, never a request). A Redis that refuses connections costs nothing
to try, but one that hangs (stopped, partitioned, swapping) costs each request the pool's
socket timeouts and retries, for every request, for as long as it lasts. So the
instance keeps one opinion about the pool:

- any pool failure on the request path (``report_failure``), or a failed ping, marks the
  pool *down*: requests skip it at once (their blocks count as ``unavailable`` misses) and
  prefill writes nothing;
- a background ping every ``check_s`` brings it back *up* when Redis answers again:
  after a restart (empty, on the same URL; the client reconnects by itself) the pool is
  used again within ``check_s``.

Each transition is logged once and counted (``outages``); ``/stats`` shows the state under
``pool`` and ``/metrics`` exports ``tidepool_pool_up`` and ``tidepool_pool_outages``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from libs.kvpool.pool import BlockPool

log = logging.getLogger(__name__)


class PoolHealth:
    def __init__(self, pool: BlockPool, *, check_s: float, timeout_s: float) -> None:
        self.pool = pool
        self.check_s = check_s
        self.timeout_s = timeout_s
        self.up: bool | None = None  # unknown until the first ping
        self.outages = 0
        self.recoveries = 0
        self.last_error: str | None = None
        self._down_since: float | None = None

    @property
    def usable(self) -> bool:
        """Worth trying: up, or not known to be down yet."""
        return self.up is not False

    def report_failure(self, exc: BaseException) -> None:
        """A pool call failed: stop using the pool until a ping answers."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self.up is not False:
            self.up = False
            self.outages += 1
            self._down_since = time.monotonic()
            log.warning("pool unavailable (%s); recomputing instead until it answers", self.last_error)

    def _report_up(self) -> None:
        if self.up is False:
            self.recoveries += 1
            down_s = time.monotonic() - (self._down_since or time.monotonic())
            log.warning("pool reachable again after %.1f s: using it again", down_s)
        self.up = True
        self._down_since = None

    async def check(self) -> bool:
        """Ping once and update the state; returns whether the pool answered."""
        try:
            await asyncio.wait_for(self.pool.ping(), self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure to answer is an outage, whatever raised it
            self.report_failure(exc)
            return False
        self._report_up()
        return True

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.check_s)

    def stats(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "outages": self.outages,
            "recoveries": self.recoveries,
            "last_error": self.last_error,
            "down_for_s": None if self._down_since is None else round(time.monotonic() - self._down_since, 3),
        }
