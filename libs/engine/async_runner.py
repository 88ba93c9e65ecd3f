"""Background tasks on one worker thread, collected in order at ``sync()`` (seed 001's
AsyncRunner, done right).

The engine runs a step's device work through it on the CPU when async scheduling is on
(libs/engine/device_queue.py): the worker executes step N while the engine thread
schedules and lays out step N + 1. What the reviewers of the original caught, and what
this one guarantees:

- An exception in a task never kills the worker or deadlocks the caller: it is stored
  and re-raised by the ``sync()`` that collects that task, in the caller's thread.
- ``sync()`` always returns or raises; it never waits on a task that cannot finish (the
  worker is a plain thread with nothing else to do, and ``close()`` fails what is left).
- State is explicit: more than ``max_pending`` uncollected tasks, ``sync()`` with none,
  or using a closed runner raises ``AsyncRunnerError``.
- Tasks run one at a time, in submission order, and are collected in that order.
- A task and the caller share no mutable state: a task gets immutable inputs and returns
  freshly allocated outputs (the caller's job; see libs/engine/step_inputs.py).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class AsyncRunnerError(RuntimeError):
    """Misuse: submit while full, sync with nothing pending, or use after close."""


class AsyncRunner(Generic[T]):
    def __init__(self, name: str = "async-runner", *, max_pending: int = 1):
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self._name = name
        self._max_pending = max_pending
        self._lock = threading.Condition()
        self._tasks: deque[tuple[Callable[..., T], tuple[Any, ...], Future[T]]] = deque()
        self._futures: deque[Future[T]] = deque()  # submitted, not collected yet, in order
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Tasks submitted and not collected by ``sync()`` yet."""
        return len(self._futures)

    def submit(self, fn: Callable[..., T], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise AsyncRunnerError(f"{self._name} is closed")
            if len(self._futures) >= self._max_pending:
                raise AsyncRunnerError(f"{self._name} already has {len(self._futures)} pending task(s): sync() first")
            future: Future[T] = Future()
            self._futures.append(future)
            self._tasks.append((fn, args, future))
            self._lock.notify()

    def sync(self, timeout: float | None = None) -> T:
        """The oldest uncollected task's result; re-raises its exception here."""
        with self._lock:
            if not self._futures:
                raise AsyncRunnerError(f"{self._name} has no pending task")
            future = self._futures[0]
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                if self._futures and self._futures[0] is future and future.done():
                    self._futures.popleft()

    def close(self) -> None:
        """Stop the worker; pending tasks' ``sync()`` raise (or return if they finished)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            for f in self._futures:
                if not f.done():
                    f.set_exception(AsyncRunnerError(f"{self._name} closed before the task ran"))
            self._tasks.clear()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._tasks and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                fn, args, future = self._tasks.popleft()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to sync(), never swallowed
                future.set_exception(e)
