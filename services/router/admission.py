"""Admission: how many requests the router serves at once, and how many may wait for a turn.

A request takes a slot before its body is read and keeps it until its response ends
(streams included), so slots bound everything a request holds in the router: its body,
its prepared prompts, its downstream connections. ``max_running`` requests hold slots;
up to ``max_waiting`` more wait for one, first come first served, for at most
``wait_timeout_s``. Past either bound the answer is a 429 with ``Retry-After``, at once
(a full queue) or after the wait (a slot never freed up). So memory stays bounded under
any load and no request waits forever: an admitted one is bounded by the downstream
timeouts (handoff.py), a queued one by ``wait_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

from services.router.errors import overloaded


class Admission:
    def __init__(self, max_running: int, max_waiting: int, wait_timeout_s: float, retry_after_s: float) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.wait_timeout_s = wait_timeout_s
        self.retry_after_s = retry_after_s
        self.running = 0
        self._queue: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``async with``; a 429 :class:`ApiError` if none comes."""
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.running < self.max_running and not self._queue:
            self.running += 1
            return
        if len(self._queue) >= self.max_waiting:
            raise overloaded(
                f"the router is serving {self.running} requests with {len(self._queue)} waiting, its limit",
                self.retry_after_s,
                code="queue_full",
            )
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._queue.append(turn)
        timer = loop.call_later(self.wait_timeout_s, self._expire, turn)
        try:
            await turn  # set by _release, which hands its slot over (running stays the same)
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # the slot arrived together with the cancellation
            else:
                self._discard(turn)
            raise
        finally:
            timer.cancel()

    def _expire(self, turn: asyncio.Future[None]) -> None:
        if turn.done():
            return
        self._discard(turn)
        turn.set_exception(
            overloaded(
                f"no request slot freed up within {self.wait_timeout_s:g} s",
                self.retry_after_s,
                code="queue_timeout",
            )
        )

    def _discard(self, turn: asyncio.Future[None]) -> None:
        try:
            self._queue.remove(turn)
        except ValueError:
            pass

    def _release(self) -> None:
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.running -= 1
