"""One background task at a time, collected at ``sync()`` (seed 001's AsyncRunner, done right).

The engine uses it to build the next step's inputs on the CPU while the device runs the
current step. What the reviewers of the original caught, and what this one guarantees:

- An exception in the task never kills the worker or deadlocks the caller: it is stored
  and re-raised by ``sync()`` in the caller's thread.
- ``sync()`` always returns or raises; it never waits on a task that cannot finish (the
  worker is a plain thread with nothing else to do, and ``close()`` cancels cleanly).
- State is explicit: submitting while a task is pending, or using a closed runner, raises.
- The task and the caller share no mutable state: the task gets immutable inputs and
  returns freshly allocated outputs (the caller's job; see ``model_runner.prepare``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class AsyncRunnerError(RuntimeError):
    """Misuse: submit while busy, sync with nothing pending, or use after close."""


class AsyncRunner(Generic[T]):
    def __init__(self, name: str = "async-runner"):
        self._name = name
        self._lock = threading.Condition()
        self._task: tuple[Callable[..., T], tuple[Any, ...]] | None = None
        self._future: Future[T] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        return self._future is not None

    def submit(self, fn: Callable[..., T], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise AsyncRunnerError(f"{self._name} is closed")
            if self._future is not None:
                raise AsyncRunnerError(f"{self._name} already has a pending task: sync() it first")
            self._future = Future()
            self._task = (fn, args)
            self._lock.notify()

    def sync(self, timeout: float | None = None) -> T:
        """The task's result; re-raises its exception here."""
        with self._lock:
            future = self._future
            if future is None:
                raise AsyncRunnerError(f"{self._name} has no pending task")
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                if self._future is future and future.done():
                    self._future = None

    def close(self) -> None:
        """Stop the worker; a pending task's ``sync()`` raises (or returns if it finished)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()
        with self._lock:
            if self._future is not None and not self._future.done():
                self._future.set_exception(AsyncRunnerError(f"{self._name} closed before the task ran"))

    def _work(self) -> None:
        while True:
            with self._lock:
                while self._task is None and not self._closed:
                    self._lock.wait()
                if self._task is None:
                    return
                (fn, args), self._task = self._task, None
                future = self._future
            assert future is not None
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to sync(), never swallowed
                future.set_exception(e)
