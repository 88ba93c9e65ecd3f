"""A worker's view of the pool (services/worker/pool_health.py): a failure marks it down at
once, a ping that answers brings it back, a hung Redis counts as down, each outage once."""

import asyncio

from libs.kvpool.memory import MemoryPool
from libs.kvpool.pool import PoolUnavailable
from services.worker.pool_health import PoolHealth


class Switch:
    """A fault hook: ``mode`` None (answer), "down" (refuse) or "hang" (never answer)."""

    def __init__(self) -> None:
        self.mode: str | None = None

    async def __call__(self, op: str, ids) -> None:
        if self.mode == "down":
            raise PoolUnavailable("connection refused")
        if self.mode == "hang":
            await asyncio.sleep(3600)


async def test_outage_and_recovery_are_detected_and_counted_once():
    switch = Switch()
    health = PoolHealth(MemoryPool(fault=switch), check_s=0.01, timeout_s=0.05)
    assert health.up is None and health.usable  # unknown: worth trying
    assert await health.check() and health.up is True
    switch.mode = "down"
    assert not await health.check()
    assert not await health.check()
    assert (health.up, health.usable, health.outages) == (False, False, 1)
    assert "connection refused" in health.stats()["last_error"]
    switch.mode = None  # Redis restarted
    assert await health.check()
    assert (health.up, health.outages, health.recoveries) == (True, 1, 1)
    assert health.stats()["down_for_s"] is None


async def test_a_request_failure_marks_down_until_a_ping_answers():
    health = PoolHealth(MemoryPool(), check_s=0.01, timeout_s=0.05)
    await health.check()
    health.report_failure(TimeoutError("read timed out"))
    assert not health.usable and health.outages == 1
    task = asyncio.create_task(health.run())
    try:
        for _ in range(100):
            if health.up:
                break
            await asyncio.sleep(0.01)
        assert health.up and health.recoveries == 1
    finally:
        task.cancel()


async def test_a_hung_pool_is_down_after_the_check_timeout():
    switch = Switch()
    switch.mode = "hang"
    health = PoolHealth(MemoryPool(fault=switch), check_s=0.01, timeout_s=0.05)
    assert not await asyncio.wait_for(health.check(), 1.0)
    assert health.up is False and "TimeoutError" in health.last_error
