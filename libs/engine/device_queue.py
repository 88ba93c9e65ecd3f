"""Where a step's device work runs, in order, without the engine thread waiting for it.

``submit(fn)`` hands over one step's device work (copies, forward, sampling) and returns
a ``Pending`` whose ``result()`` is the one place the engine waits for the device, and
where an error in the work is raised, however the work ran.

- CUDA: ``fn`` runs at once on the engine thread; it only *enqueues* kernels on the
  current stream, so it returns long before they finish. Its result carries a CUDA event
  recorded after the step's device-to-host copy of the sampled ids; ``result()`` waits
  on that event (never a device-wide sync).
- CPU, synchronous: ``fn`` runs at once and does the work; ``result()`` returns it.
- CPU, asynchronous: ``fn`` runs on a worker thread (libs/engine/async_runner.py), one
  step after another in submission order, like a CUDA stream. torch releases the GIL in
  its kernels, so the engine thread schedules and lays out step N + 1 while the worker
  computes step N.

Whatever runs on the queue must get everything it reads as immutable inputs (the step's
staging slot, lists built for it): the engine thread moves on at once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from libs.engine.async_runner import AsyncRunner

# At most two steps are ever in flight: N running, N + 1 queued behind it.
MAX_IN_FLIGHT = 2


class Pending:
    """One submitted step; ``result()`` must be called in submission order."""

    def __init__(self, runner: AsyncRunner | None, value: Any = None, error: BaseException | None = None):
        self._runner = runner
        self._value = value
        self._error = error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._runner is not None:
            self._value, self._runner = self._runner.sync(), None
        event = getattr(self._value, "event", None)
        if event is not None:
            event.synchronize()
        return self._value


class DeviceQueue:
    def __init__(self, device: torch.device, *, asynchronous: bool):
        self.device = device
        self.asynchronous = asynchronous
        self._runner: AsyncRunner | None = None
        if asynchronous and device.type != "cuda":
            self._runner = AsyncRunner("device-queue", max_pending=MAX_IN_FLIGHT)

    def submit(self, fn: Callable[[], Any]) -> Pending:
        if self._runner is None:
            try:
                return Pending(None, fn())
            except Exception as e:  # noqa: BLE001 - raised at result(), as on the worker
                return Pending(None, error=e)
        self._runner.submit(fn)
        return Pending(self._runner)

    @property
    def threaded(self) -> bool:
        return self._runner is not None

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()

