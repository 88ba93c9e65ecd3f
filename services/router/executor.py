"""The router's bounded executor: CPU work (JSON, validation, chat templates, tokenization)
off the event loop, with a bounded backlog.

The event loop only does I/O: a request's CPU work runs here as one job, on ``workers``
threads. Threads suffice because every long step releases the GIL: the tokenizer is
called through ``encode_batch`` (libs/model/tokenizer.py), and pure-Python steps (the
chat template, validation) yield it every few milliseconds. Measured before this: one
30 MB prompt tokenized with the GIL held stalled the loop for 46 s, long enough for every
instance's heartbeat to expire.

The backlog is bounded: with ``max_pending`` jobs queued or running, the next one is
refused at once with a 429 (``Retry-After``) rather than queued without limit. A job
whose caller went away is cancelled if it has not started; one already running finishes
(a thread cannot be interrupted) and still counts against the bound until it does.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from services.router.errors import overloaded

T = TypeVar("T")


class BoundedExecutor:
    """``workers`` threads and at most ``max_pending`` jobs in them or waiting for them."""

    def __init__(self, workers: int, max_pending: int, retry_after_s: float) -> None:
        if workers < 1 or max_pending < workers:
            raise ValueError(f"need workers >= 1 and max_pending >= workers, got {workers}, {max_pending}")
        self.workers = workers
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.pending = 0
        self.refused = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="router-cpu")

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread; a 429 :class:`ApiError` when the backlog is full."""
        if self.pending >= self.max_pending:
            self.refused += 1
            raise overloaded(
                f"the router's {self.max_pending} request-preparation slots are all busy",
                self.retry_after_s,
                code="router_busy",
            )
        loop = asyncio.get_running_loop()
        self.pending += 1
        future: Future[T] = self._pool.submit(fn)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(future)

    def _done(self) -> None:
        self.pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
