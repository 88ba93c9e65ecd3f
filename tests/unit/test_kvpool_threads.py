"""libs/kvpool/threads.py: the bulk path's worker threads, jobs as asyncio futures."""

from __future__ import annotations

import asyncio
import threading

import pytest

from libs.kvpool.threads import WorkerThreads


async def test_results_and_exceptions_come_back_in_the_callers_future() -> None:
    pool = WorkerThreads(4, "t")
    try:
        main = threading.get_ident()
        assert await pool.submit(lambda: threading.get_ident()) != main  # ran on a worker
        assert await pool.submit(lambda: 7) == 7

        def fail() -> None:
            raise OSError("socket gone")

        with pytest.raises(OSError, match="socket gone"):
            await pool.submit(fail)
    finally:
        await asyncio.to_thread(pool.shutdown)


async def test_threads_start_on_demand_up_to_the_bound_and_jobs_beyond_it_wait() -> None:
    pool = WorkerThreads(3, "t")
    release = threading.Event()
    running = threading.Semaphore(0)

    def blocked() -> int:
        running.release()
        release.wait(10)
        return threading.get_ident()

    try:
        assert pool.threads == 0
        futs = [pool.submit(blocked) for _ in range(5)]
        for _ in range(3):  # three run at once...
            assert await asyncio.to_thread(running.acquire, True, 5)
        assert pool.threads == 3
        assert not await asyncio.to_thread(running.acquire, True, 0.2)  # ...the other two wait for a worker
        release.set()
        idents = await asyncio.gather(*futs)
        assert len(set(idents)) == 3 and pool.threads == 3
        await pool.submit(lambda: None)  # idle workers are reused, none started
        assert pool.threads == 3
    finally:
        release.set()
        await asyncio.to_thread(pool.shutdown)


async def test_a_cancelled_future_is_left_alone_and_shielding_waits_for_the_job() -> None:
    pool = WorkerThreads(1, "t")
    go = threading.Event()
    done = threading.Event()

    def job() -> str:
        go.wait(5)
        done.set()
        return "late"

    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    try:
        fut = pool.submit(job)
        fut.cancel()  # the job still runs; its outcome must not raise InvalidStateError on the loop
        shielded = pool.submit(lambda: "next")  # queued behind it on the one worker
        go.set()
        assert await asyncio.wait_for(asyncio.shield(shielded), 5) == "next"
        assert done.is_set()  # the one worker finished the cancelled job first
        await asyncio.sleep(0)
        assert errors == []
    finally:
        go.set()
        await asyncio.to_thread(pool.shutdown)


async def test_shutdown_finishes_queued_jobs_stops_every_worker_and_refuses_more() -> None:
    pool = WorkerThreads(2, "t")
    futs = [pool.submit(lambda i=i: i * i) for i in range(6)]
    await asyncio.to_thread(pool.shutdown)
    assert await asyncio.gather(*futs) == [i * i for i in range(6)]
    assert not any(t.name.startswith("t-") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)


def test_a_job_that_outlives_its_loop_is_dropped_quietly() -> None:
    pool = WorkerThreads(1, "t")
    go = threading.Event()

    async def start() -> None:
        pool.submit(lambda: go.wait(5))

    asyncio.run(start())  # the loop closes with the job still running
    go.set()

    async def again() -> str:  # the one worker survived handing its outcome to a closed loop
        return await asyncio.wait_for(pool.submit(lambda: "alive"), 5)

    assert asyncio.run(again()) == "alive"
    assert pool.threads == 1
    pool.shutdown()


def test_max_workers_must_be_positive() -> None:
    with pytest.raises(ValueError):
        WorkerThreads(0, "t")
