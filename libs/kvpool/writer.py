"""Asynchronous block writes: ``session = writer.begin()``, ``await session.submit(...)``*,
``report = await session.wait_all_done()`` (DESIGN.md, "Concurrency rules").

Prefill hands each finished block to a session and goes on computing; a fixed set of
worker tasks drains one shared bounded queue and writes blocks to the pool in pipelined
batches. Rules, each from a bug in the system this is modelled on (seeds/000):

- No half-constructed writer. The constructor validates its arguments and starts its
  workers, or raises; there is no "pool missing" path that fails later.
- Backpressure. The queue holds at most ``queue_size`` blocks; ``submit`` waits for room,
  so a slow pool slows the producer instead of growing memory. Beyond the queue, each
  worker holds at most one batch of ``batch_blocks`` blocks in flight.
- The producer never waits on the pool except at ``wait_all_done``: ``submit`` only waits
  for queue room.
- Errors surface. A refused block (``PutError``), a failed batch (``PoolUnavailable``, a
  timeout) or a cancelled session is recorded per block; ``wait_all_done`` raises
  :class:`WriteFailed` carrying the first error (also its ``__cause__``) and the
  :class:`WriteReport` of which blocks were written and which failed.
- Nothing hangs. Every submitted block ends written or failed: a worker that dies stops
  the writer and fails every pending block, ``close`` fails what is queued or in flight,
  a pool call that never returns is cut by ``op_timeout_s``, and a ``submit`` waiting for
  room wakes with :class:`WriterClosed` when the writer stops.
- Sessions are independent: each keeps its own pending count and report; a failure of
  one session's block is not charged to another's.
- Progress is visible per block: a session's ``on_written(key)`` hears of each block as
  soon as its batch is acknowledged, long before ``wait_all_done`` (the streamed handoff
  announces durable blocks from there, so decode reads them while the rest is written).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from libs.kvpool.bulk import settle
from libs.kvpool.header import Value
from libs.kvpool.pool import LEASE_ID_RE, BlockPool, KeyLike, NamespaceLike, PoolError, key_text, namespace_hex

log = logging.getLogger(__name__)

T = TypeVar("T")


class WriterClosed(PoolError):
    """The writer was closed or stopped after a worker died; the block was not written."""


class SessionCancelled(PoolError):
    """The session was cancelled before the block was written."""


@dataclass(frozen=True)
class WriteReport:
    """What a session wrote. Keys are ``str(BlockKey)`` (unique across namespaces: the chain starts there)."""

    written: tuple[str, ...]
    failed: dict[str, BaseException] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


class WriteFailed(PoolError):
    """Raised by ``wait_all_done`` when any block of the session failed."""

    def __init__(self, report: WriteReport, first_error: BaseException) -> None:
        super().__init__(
            f"{len(report.failed)} of {len(report.failed) + len(report.written)} blocks failed; "
            f"first: {type(first_error).__name__}: {first_error}"
        )
        self.report = report
        self.first_error = first_error


class _BoundedChannel(Generic[T]):
    """A FIFO with a hard bound and a synchronous ``close`` that wakes every waiter.

    asyncio.Queue cannot be closed before Python 3.13, and a producer blocked on a full
    queue whose consumers died would wait forever; this one returns ``False`` instead.
    """

    def __init__(self, maxsize: int) -> None:
        self._items: deque[T] = deque()
        self._maxsize = maxsize
        self._put_waiters: deque[asyncio.Future[None]] = deque()
        self._take_waiters: deque[asyncio.Future[None]] = deque()
        self.closed = False
        self.high_water = 0

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _wake_one(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _wait(self, waiters: deque[asyncio.Future[None]]) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            # Woken and cancelled at once: hand the wake-up on so it is not lost.
            if fut.done() and not fut.cancelled():
                self._wake_one(waiters)
            raise

    async def put(self, item: T) -> bool:
        """Append ``item``, waiting for room; ``False`` (item not added) once closed."""
        while not self.closed and len(self._items) >= self._maxsize:
            await self._wait(self._put_waiters)
        if self.closed:
            return False
        self._items.append(item)
        self.high_water = max(self.high_water, len(self._items))
        self._wake_one(self._take_waiters)
        return True

    async def take(self, n: int) -> list[T]:
        """Up to ``n`` items, waiting for at least one; ``[]`` once closed."""
        while not self.closed and not self._items:
            await self._wait(self._take_waiters)
        if self.closed:
            return []
        batch = [self._items.popleft() for _ in range(min(n, len(self._items)))]
        for _ in batch:
            self._wake_one(self._put_waiters)
        if self._items:
            self._wake_one(self._take_waiters)
        return batch

    def close(self) -> list[T]:
        """Stop the channel; returns what was still queued and wakes every waiter."""
        self.closed = True
        leftover = list(self._items)
        self._items.clear()
        for waiters in (self._put_waiters, self._take_waiters):
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
        return leftover


class _Item:
    __slots__ = ("session", "ns", "key", "value", "done")

    def __init__(self, session: "WriteSession", ns: str, key: str, value: Value) -> None:
        self.session = session
        self.ns = ns
        self.key = key
        self.value = value
        self.done = False


class WriteSession:
    """One producer's writes (typically one prefill request). Create with :meth:`AsyncWriter.begin`."""

    def __init__(self, writer: "AsyncWriter", lease_id: str | None, on_written: Callable[[str], None] | None = None) -> None:
        self._writer = writer
        self.lease_id = lease_id
        self._on_written = on_written
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._written: list[str] = []
        self._failed: dict[str, BaseException] = {}
        self._first_error: BaseException | None = None
        self._finished = False
        self.cancelled = False

    @property
    def pending(self) -> int:
        return self._pending

    async def submit(self, ns: NamespaceLike, key: KeyLike, value: Value) -> None:
        """Queue one encoded block; waits only for queue room.

        ``value`` is held until written, so it must not change: a value of views of
        staging memory (``BlockCodec.encode_views``) keeps that memory busy until the
        session is done or :meth:`settled` after a cancel. Raises :class:`WriterClosed` if the writer stopped,
        :class:`SessionCancelled` after :meth:`cancel`, ``RuntimeError`` after
        :meth:`wait_all_done`, ``ValueError`` for a malformed namespace or key.
        """
        if self._finished:
            raise RuntimeError("submit after wait_all_done: begin a new session")
        if self.cancelled:
            raise SessionCancelled("session was cancelled")
        self._writer._check_running()
        item = _Item(self, namespace_hex(ns), key_text(key), value)
        self._pending += 1
        self._idle.clear()
        queued = False
        try:
            queued = await self._writer._channel.put(item)
        finally:
            if not queued:  # cancelled while waiting for room, or the writer stopped
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()
        if not queued:
            raise WriterClosed("writer stopped while waiting for queue room") from self._writer._failure

    def cancel(self) -> None:
        """Skip this session's blocks not yet handed to the pool; ``wait_all_done`` then fails."""
        self.cancelled = True

    def _finish(self, item: _Item, error: BaseException | None) -> None:
        if item.done:
            return
        item.done = True
        item.value = b""  # drop the buffer as soon as it is written
        if error is None:
            self._written.append(item.key)
            if self._on_written is not None:
                try:
                    self._on_written(item.key)
                except Exception:  # noqa: BLE001 - a caller's bug must not lose the outcome
                    log.exception("on_written(%s) raised", item.key)
        else:
            self._failed[item.key] = error
            if self._first_error is None:
                self._first_error = error
        self._pending -= 1
        if self._pending == 0:
            self._idle.set()

    async def settled(self) -> None:
        """Wait, through cancellations, until none of this session's blocks is queued or being
        written (after :meth:`cancel`, or when giving up): then its values' memory is free."""
        await settle(asyncio.ensure_future(self._idle.wait()))

    async def wait_all_done(self) -> WriteReport:
        """Wait until every submitted block is written or failed; the report, or :class:`WriteFailed`."""
        self._finished = True
        await self._idle.wait()
        report = WriteReport(tuple(self._written), dict(self._failed))
        if self._first_error is not None:
            raise WriteFailed(report, self._first_error) from self._first_error
        return report


class AsyncWriter:
    """Worker tasks writing sessions' blocks to a :class:`BlockPool`. Must be built inside a running loop.

    ``batch_blocks`` 16: one pool call per batch, pipelined per node; on the H100 host a
    2048-token prompt's 128 blocks took 35 ms in batches of 8 and 26 ms in 16s on one
    Redis (bench/handoff_probe.py), while a bigger batch acknowledges its first block later.
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        workers: int = 4,
        queue_size: int = 64,
        batch_blocks: int = 16,
        op_timeout_s: float | None = 60.0,
    ) -> None:
        if not isinstance(pool, BlockPool):
            raise TypeError(f"pool must be a BlockPool, got {type(pool).__name__}")
        for name, value in (("workers", workers), ("queue_size", queue_size), ("batch_blocks", batch_blocks)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if op_timeout_s is not None and op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be > 0 or None, got {op_timeout_s}")
        loop = asyncio.get_running_loop()  # raises RuntimeError outside a loop: no half-built writer
        self.pool = pool
        self.batch_blocks = batch_blocks
        self.queue_size = queue_size
        self.op_timeout_s = op_timeout_s
        self._channel: _BoundedChannel[_Item] = _BoundedChannel(queue_size)
        self._failure: BaseException | None = None
        self._closing = False
        self.counters = {"blocks_written": 0, "blocks_failed": 0, "batches": 0, "batch_errors": 0}
        self._workers = [loop.create_task(self._work(), name=f"kvpool-writer-{i}") for i in range(workers)]
        for task in self._workers:
            task.add_done_callback(self._on_worker_exit)

    # -- public ---------------------------------------------------------------------------

    def begin(self, *, lease_id: str | None = None, on_written: Callable[[str], None] | None = None) -> WriteSession:
        """A new session; its blocks are pinned by ``lease_id`` when given. ``on_written(key)``
        (``str(BlockKey)``) is called on the event loop for each block once it is written."""
        if lease_id is not None and not LEASE_ID_RE.match(lease_id):
            raise ValueError(f"malformed lease id {lease_id!r}")
        self._check_running()
        return WriteSession(self, lease_id, on_written)

    @property
    def queue_depth(self) -> int:
        return len(self._channel)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "queue_depth": len(self._channel),
            "queue_high_water": self._channel.high_water,
            "queue_size": self.queue_size,
            "workers_alive": sum(not t.done() for t in self._workers),
        }

    @property
    def running(self) -> bool:
        return self._failure is None

    async def close(self) -> None:
        """Stop the workers. Blocks still queued or in flight fail with :class:`WriterClosed`.

        For a clean stop, ``wait_all_done`` every session first. Idempotent.
        """
        if self._failure is None:
            self._failure = WriterClosed("writer closed")
        self._closing = True
        self._fail_queued()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

    async def __aenter__(self) -> "AsyncWriter":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._failure is not None:
            raise WriterClosed(f"writer is stopped: {self._failure}") from self._failure

    def _fail_queued(self) -> None:
        error = WriterClosed(f"writer stopped before the block was written: {self._failure}")
        for item in self._channel.close():
            self._record(item, error)

    def _on_worker_exit(self, task: asyncio.Task[None]) -> None:
        if self._closing:
            return
        cause = task.exception() if not task.cancelled() else asyncio.CancelledError()
        log.error("kvpool writer worker %s died: %r; stopping the writer", task.get_name(), cause)
        self._failure = WriterClosed(f"writer worker died: {cause!r}")
        self._closing = True
        self._fail_queued()
        for other in self._workers:
            other.cancel()

    def _record(self, item: _Item, error: BaseException | None) -> None:
        if item.done:
            return
        self.counters["blocks_written" if error is None else "blocks_failed"] += 1
        item.session._finish(item, error)

    async def _work(self) -> None:
        while True:
            batch = await self._channel.take(self.batch_blocks)
            if not batch:
                return
            try:
                await self._write(batch)
            except BaseException as exc:
                # Cancelled by close(), or something no pool call should raise: every
                # block in hand still gets an outcome before this worker goes.
                error = WriterClosed(f"writer stopped while the block was being written: {exc!r}")
                for item in batch:
                    self._record(item, error)
                raise

    async def _write(self, batch: list[_Item]) -> None:
        groups: dict[tuple[str, str | None], list[_Item]] = {}
        for item in batch:
            if item.session.cancelled:
                self._record(item, SessionCancelled("session was cancelled before the block was written"))
            else:
                groups.setdefault((item.ns, item.session.lease_id), []).append(item)
        for (ns, lease_id), items in groups.items():
            self.counters["batches"] += 1
            results: list[Any]
            try:
                async with asyncio.timeout(self.op_timeout_s):
                    results = await self.pool.put_blocks(
                        ns, [(it.key, it.value) for it in items], lease_id=lease_id
                    )
                if len(results) != len(items):
                    raise PoolError(f"pool answered {len(results)} results for {len(items)} blocks")
            except Exception as exc:
                self.counters["batch_errors"] += 1
                results = [exc] * len(items)
            for item, result in zip(items, results):
                self._record(item, result)
