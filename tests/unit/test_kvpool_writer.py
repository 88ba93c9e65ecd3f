"""The async writer on the in-memory twin: results, errors, backpressure, and nothing ever hangs.

Every wait is bounded by ``asyncio.wait_for`` so that a hang is a failure, not a stuck run.
"""

from __future__ import annotations

import asyncio
import os
from typing import Sequence

import pytest

from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.memory import MemoryPool
from libs.kvpool.pool import PoolUnavailable, PutError, block_id
from libs.kvpool.writer import AsyncWriter, SessionCancelled, WriteFailed, WriterClosed, WriteSession

NS = Namespace(model_digest="writer-model", dtype="bf16", block_size=4)
KEYS = block_keys(NS, list(range(4 * 64)))
LIMIT = 5.0  # seconds any single wait in these tests may take


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") + os.urandom(60)


async def submit_all(session, keys, start: int = 0) -> None:  # type: ignore[no-untyped-def]
    for i, k in enumerate(keys, start):
        await asyncio.wait_for(session.submit(NS, k, value(i)), LIMIT)


async def expect_failure(session: WriteSession) -> WriteFailed:
    """``wait_all_done`` must raise :class:`WriteFailed`, within LIMIT."""
    with pytest.raises(WriteFailed) as info:
        await asyncio.wait_for(session.wait_all_done(), LIMIT)
    return info.value


class Gate:
    """A fault hook that holds every put_blocks call until opened, and records the batches."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.calls: list[list[str]] = []

    @property
    def batches(self) -> list[int]:
        return [len(c) for c in self.calls]

    async def __call__(self, op: str, ids: Sequence[str]) -> None:
        if op == "put_blocks":
            self.calls.append(list(ids))
            await self.open.wait()


async def test_writes_everything_in_batches() -> None:
    gate = Gate()
    gate.open.set()
    pool = MemoryPool(fault=gate)
    async with AsyncWriter(pool, workers=2, queue_size=8, batch_blocks=4) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:20])
        report = await asyncio.wait_for(session.wait_all_done(), LIMIT)
    assert sorted(report.written) == sorted(str(k) for k in KEYS[:20]) and report.ok
    assert await pool.exists_prefix(NS, KEYS[:20]) == 20
    assert (await pool.get_blocks(NS, KEYS[:1]))[0][:4] == (0).to_bytes(4, "little")
    assert sum(gate.batches) == 20 and max(gate.batches) <= 4
    assert writer.stats()["blocks_written"] == 20 and writer.stats()["blocks_failed"] == 0


async def test_several_blocks_go_in_one_pool_call() -> None:
    gate = Gate()
    pool = MemoryPool(fault=gate)
    async with AsyncWriter(pool, workers=1, queue_size=16, batch_blocks=4) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:9])  # the worker holds block 0; 8 wait in the queue
        gate.open.set()
        await asyncio.wait_for(session.wait_all_done(), LIMIT)
    assert gate.batches == [1, 4, 4]
    assert writer.stats()["batches"] == 3 and writer.stats()["batch_errors"] == 0


async def test_on_written_hears_each_block_when_its_batch_is_acknowledged() -> None:
    gate = Gate()
    pool = MemoryPool(fault=gate, capacity_bytes=6 * 64)
    heard: list[str] = []
    async with AsyncWriter(pool, workers=1, queue_size=16, batch_blocks=4) as writer:
        session = writer.begin(on_written=heard.append)
        await submit_all(session, KEYS[:9])  # the worker holds block 0 in the pool
        await asyncio.sleep(0)
        assert heard == [], "nothing is announced before the pool acknowledged it"
        gate.open.set()
        for _ in range(200):  # the first batches land before wait_all_done is called
            if len(heard) >= 5:
                break
            await asyncio.sleep(0)
        assert heard[:5] == [str(k) for k in KEYS[:5]]
        failure = await expect_failure(session)  # past 6 blocks the pool is full: those are refused
    assert heard == [str(k) for k in KEYS[:6]] == sorted(failure.report.written, key=heard.index)
    assert set(failure.report.failed) == {str(k) for k in KEYS[6:9]}


async def test_backpressure_submit_waits_and_the_queue_stays_bounded() -> None:
    gate = Gate()
    pool = MemoryPool(fault=gate)
    workers, queue_size, batch = 2, 4, 3
    async with AsyncWriter(pool, workers=workers, queue_size=queue_size, batch_blocks=batch) as writer:
        session = writer.begin()
        # Workers take one batch each off the queue (and then block in the pool), so
        # the writer holds at most queue_size + workers * batch blocks.
        capacity = queue_size + workers * batch
        producer = asyncio.create_task(submit_all(session, KEYS[:30]))
        for _ in range(200):
            await asyncio.sleep(0)
        assert not producer.done(), "submit must wait when the queue is full"
        assert writer.queue_depth == queue_size
        assert session.pending <= capacity + 1  # + the block submit is waiting to queue
        gate.open.set()
        await asyncio.wait_for(producer, LIMIT)
        report = await asyncio.wait_for(session.wait_all_done(), LIMIT)
        assert len(report.written) == 30
        assert writer.stats()["queue_high_water"] == queue_size


async def test_submit_does_not_wait_for_the_pool_while_there_is_room() -> None:
    gate = Gate()  # the pool never answers until opened
    async with AsyncWriter(MemoryPool(fault=gate), workers=1, queue_size=32, batch_blocks=4) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:20])  # would time out if submit waited on the pool
        gate.open.set()
        await asyncio.wait_for(session.wait_all_done(), LIMIT)


async def test_refused_blocks_surface_at_wait_all_done_with_the_report() -> None:
    pool = MemoryPool(capacity_bytes=5 * 64)
    async with AsyncWriter(pool, workers=2, queue_size=8, batch_blocks=3) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:8])
        failure = await expect_failure(session)
    err = failure
    assert isinstance(err.first_error, PutError) and err.first_error.reason == "oom"
    assert err.__cause__ is err.first_error
    assert len(err.report.written) == 5 and len(err.report.failed) == 3
    assert set(err.report.written) | set(err.report.failed) == {str(k) for k in KEYS[:8]}
    assert writer.stats()["blocks_failed"] == 3


async def test_a_failing_pool_call_fails_its_blocks_and_the_rest_go_on() -> None:
    poisoned = block_id(NS, KEYS[3])
    doomed: list[str] = []

    async def flaky(op: str, ids: Sequence[str]) -> None:
        if op == "put_blocks" and poisoned in ids:
            doomed.extend(ids)
            raise PoolUnavailable("connection dropped (injected)")

    async with AsyncWriter(MemoryPool(fault=flaky), workers=2, queue_size=4, batch_blocks=2) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:8])
        failure = await expect_failure(session)
    assert isinstance(failure.first_error, PoolUnavailable)
    assert sorted(block_id(NS, k) for k in failure.report.failed) == sorted(doomed)
    assert len(failure.report.written) == 8 - len(doomed)
    assert writer.stats()["batch_errors"] == 1 and writer.stats()["blocks_failed"] == len(doomed)


async def test_a_hung_pool_call_is_cut_by_the_timeout() -> None:
    never = Gate()
    async with AsyncWriter(MemoryPool(fault=never), workers=1, queue_size=4, op_timeout_s=0.1) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:3])
        failure = await expect_failure(session)
    assert isinstance(failure.first_error, TimeoutError)
    assert len(failure.report.failed) == 3


class WorkerBug(BaseException):
    """Something no pool call should raise: it gets past ``except Exception`` and kills a worker."""


async def test_a_dying_worker_fails_every_pending_block_and_stops_the_writer() -> None:
    gate = Gate()

    async def die(op: str, ids: Sequence[str]) -> None:
        await gate(op, ids)
        raise WorkerBug("boom")

    writer = AsyncWriter(MemoryPool(fault=die), workers=2, queue_size=4, batch_blocks=2)
    session = writer.begin()
    producer = asyncio.create_task(submit_all(session, KEYS[:20]))  # blocks on the full queue
    await asyncio.sleep(0.01)
    gate.open.set()
    with pytest.raises(WriterClosed):
        await asyncio.wait_for(producer, LIMIT)
    failure = await expect_failure(session)
    assert isinstance(failure.first_error, WriterClosed)
    assert "WorkerBug" in str(failure.first_error) or "died" in str(failure.first_error)
    assert not failure.report.written
    with pytest.raises(WriterClosed):
        writer.begin()
    assert writer.stats()["workers_alive"] == 0
    await asyncio.wait_for(writer.close(), LIMIT)


async def test_a_cancelled_worker_task_stops_the_writer_too() -> None:
    gate = Gate()
    writer = AsyncWriter(MemoryPool(fault=gate), workers=1, queue_size=4)
    session = writer.begin()
    await submit_all(session, KEYS[:3])
    await asyncio.sleep(0.01)
    writer._workers[0].cancel()  # what a stray cancel from elsewhere would do
    failure = await expect_failure(session)
    assert len(failure.report.failed) == 3
    with pytest.raises(WriterClosed):
        writer.begin()


async def test_close_fails_queued_and_in_flight_blocks_and_wakes_blocked_submits() -> None:
    gate = Gate()
    writer = AsyncWriter(MemoryPool(fault=gate), workers=1, queue_size=2, batch_blocks=1)
    session = writer.begin()
    producer = asyncio.create_task(submit_all(session, KEYS[:10]))
    await asyncio.sleep(0.01)
    assert not producer.done()
    await asyncio.wait_for(writer.close(), LIMIT)
    with pytest.raises(WriterClosed):
        await asyncio.wait_for(producer, LIMIT)
    failure = await expect_failure(session)
    assert len(failure.report.failed) == 3  # one in flight, two queued
    assert all(isinstance(e, WriterClosed) for e in failure.report.failed.values())
    with pytest.raises(WriterClosed):
        writer.begin()
    await writer.close()  # idempotent


async def test_a_cancelled_session_skips_its_queued_blocks_only() -> None:
    gate = Gate()
    pool = MemoryPool(fault=gate)
    async with AsyncWriter(pool, workers=1, queue_size=16, batch_blocks=2) as writer:
        doomed, kept = writer.begin(), writer.begin()
        await submit_all(doomed, KEYS[:6])
        await submit_all(kept, KEYS[6:10], start=6)
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(SessionCancelled):
            await doomed.submit(NS, KEYS[20], b"x")
        gate.open.set()
        failure = await expect_failure(doomed)
        report = await asyncio.wait_for(kept.wait_all_done(), LIMIT)
    # The batch already handed to the pool completes; the rest is skipped.
    in_flight = gate.calls[0]
    assert sorted(block_id(NS, k) for k in failure.report.written) == sorted(in_flight)
    assert all(isinstance(e, SessionCancelled) for e in failure.report.failed.values())
    assert len(failure.report.failed) == 6 - len(in_flight)
    assert sorted(report.written) == sorted(str(k) for k in KEYS[6:10])


async def test_sessions_do_not_share_failures() -> None:
    pool = MemoryPool()
    async with AsyncWriter(pool, workers=2, queue_size=8, batch_blocks=4) as writer:
        stale = writer.begin(lease_id="f" * 32)  # a lease that does not exist
        lease = await pool.create_lease(NS, [], ttl_s=60)
        good = writer.begin(lease_id=lease)
        await submit_all(stale, KEYS[:3])
        await submit_all(good, KEYS[3:6], start=3)
        failure = await expect_failure(stale)
        report = await asyncio.wait_for(good.wait_all_done(), LIMIT)
    assert isinstance(failure.first_error, PutError) and failure.first_error.reason == "lease"
    assert len(report.written) == 3
    assert (await pool.stats()).pinned_blocks == 3


async def test_cancelling_a_blocked_submit_leaves_the_session_consistent() -> None:
    gate = Gate()
    async with AsyncWriter(MemoryPool(fault=gate), workers=1, queue_size=1, batch_blocks=1) as writer:
        session = writer.begin()
        await submit_all(session, KEYS[:2])  # one in flight, one queued
        blocked = asyncio.create_task(session.submit(NS, KEYS[2], b"x"))
        await asyncio.sleep(0.01)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert session.pending == 2
        gate.open.set()
        report = await asyncio.wait_for(session.wait_all_done(), LIMIT)
        assert len(report.written) == 2


async def test_session_and_writer_misuse_is_refused() -> None:
    async with AsyncWriter(MemoryPool()) as writer:
        session = writer.begin()
        assert (await session.wait_all_done()).written == ()
        with pytest.raises(RuntimeError):
            await session.submit(NS, KEYS[0], b"x")
        with pytest.raises(ValueError):
            await writer.begin().submit(NS, "not-a-key", b"x")
        with pytest.raises(ValueError):
            writer.begin(lease_id="not-a-lease")
    with pytest.raises(ValueError):
        AsyncWriter(MemoryPool(), workers=0)
    with pytest.raises(ValueError):
        AsyncWriter(MemoryPool(), queue_size=0)
    with pytest.raises(TypeError):
        AsyncWriter(None)  # type: ignore[arg-type]


def test_a_writer_needs_a_running_loop() -> None:
    with pytest.raises(RuntimeError):
        AsyncWriter(MemoryPool())


def test_worker_write_settings_are_checked_at_start_up(capsys) -> None:
    from services.common.settings import parse_settings
    from services.worker.settings import WorkerSettings

    s = parse_settings(WorkerSettings, ["--pool-workers", "2", "--pool-write-batch", "32", "--pool-sockets", "1"], {})
    assert (s.pool_workers, s.pool_write_batch, s.pool_sockets) == (2, 32, 1)
    assert parse_settings(WorkerSettings, [], {}).pool_write_batch == 16
    for flag in ("--pool-workers", "--pool-write-batch", "--pool-sockets"):
        with pytest.raises(SystemExit) as e:
            parse_settings(WorkerSettings, [flag, "0"], {})
        assert e.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_settings(WorkerSettings, ["--pool-sockets", "33"], {})
    assert e.value.code == 2 and "pool_sockets must be <= 32" in capsys.readouterr().err
