"""Worker threads whose jobs are asyncio futures: the bulk path's blocking socket calls.

``loop.run_in_executor(ThreadPoolExecutor)`` costs the event loop more than the bulk path
can afford per pipeline: each job builds a ``concurrent.futures.Future`` (a ``Condition``),
checks the pool's thread count through a Python-level ``Semaphore``, and chains the
result back through ``wrap_future``'s callbacks. A prompt's 128-block write is 32
pipelines on a 4-node cluster; that machinery was 13% of the event loop's CPU for it
(py-spy on the 2-core VM, bench/RESULTS.md issue 8 round 11), on the loop that prefill's
engine thread shares the GIL with.

Here a job is ``(loop, future, fn)`` on a ``queue.SimpleQueue`` (C, lock-free for the
producer); a worker runs ``fn`` and hands the outcome back with one
``call_soon_threadsafe``. Threads start on demand, up to ``max_workers``, when no worker
is idle; they are daemons parked in ``SimpleQueue.get`` (the GIL released) between jobs.
A future the caller cancelled before its outcome came is left alone (``fn`` itself cannot
be interrupted: callers that must know when it has stopped touching memory wait for the
future through ``asyncio.shield``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable

_STOP = None  # a worker's sentinel


class WorkerThreads:
    """At most ``max_workers`` threads running blocking callables for asyncio callers."""

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # workers parked in get(): read without the lock (a stale read only starts one thread more)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> "asyncio.Future[Any]":
        """``fn()`` on a worker; its result (or exception) in the returned future of the running loop."""
        if self._closed:
            raise RuntimeError(f"{self.name} threads are shut down")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn))
        if self._idle == 0 and len(self._threads) < self.max_workers:
            t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()
        return fut

    def _work(self) -> None:
        jobs, lock = self._jobs, self._lock
        while True:
            with lock:
                self._idle += 1
            job = jobs.get()
            with lock:
                self._idle -= 1
            if job is _STOP:
                return
            loop, fut, fn = job
            try:
                outcome: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # handed to the caller, like an executor does
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, fut, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits for it any more
                pass
            del job, fut, fn, outcome  # no reference to the last job's objects while parked

    @property
    def threads(self) -> int:
        return len(self._threads)

    def shutdown(self) -> None:
        """Stop every worker once the jobs queued before this are done (blocking: call it off the loop)."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(_STOP)
        for t in self._threads:
            t.join()


def _settle(fut: "asyncio.Future[Any]", result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
