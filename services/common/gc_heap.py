"""Garbage collection in a serving process: the startup heap frozen, every pause measured.

CPython's cyclic collector runs on whichever thread happens to allocate, holding the GIL,
so while it runs the event loop and the engine's step thread both stand still, and every
running sequence's next token waits. A young collection is cheap: it walks the few
objects made since the last one. A full (generation 2) collection walks every tracked
object in the process, and a worker's startup leaves a lot of them behind: the model's
modules and parameter wrappers, the tokenizer's tables, the CUDA graphs' bookkeeping.
About 185,000 objects for SmolLM2-135M, and a full collection of them took 81-87 ms on the
2-core CPU VM (bench/RESULTS.md, issue 10): one such pause mid-decode is a step's worth of
tokens late for every request in the batch.

Those objects live as long as the process, so scanning them finds nothing.
:func:`freeze_startup_heap`, called once the service is up (``services/common/runner.py``),
collects once and then moves everything still alive into the permanent generation that
collections skip (``gc.freeze``), as vLLM's engine core does after start-up. The same
full collection then took 0.1-0.4 ms. Refcounting still frees frozen objects that are
dropped later; only cyclic garbage among them is never reclaimed, and the startup heap
has next to none.

:class:`GcPauses` times every collection through ``gc.callbacks`` and exports them on the
service's own registry: ``tidepool_gc_pause_seconds{generation}`` (a histogram) and
``tidepool_gc_frozen_objects``. It is installed when the app starts and removed when it
stops, so apps made and dropped in one test process leave no callback behind.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Young collections take microseconds; a full one of an unfrozen worker heap, tens of ms.
PAUSE_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object still alive; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _FrozenObjects(Collector):
    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "tidepool_gc_frozen_objects", "objects in the collector's permanent generation (gc.freeze at startup)",
            value=gc.get_freeze_count(),
        )


class GcPauses:
    """Times each collection (``gc.callbacks``) into a histogram on ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.pauses = Histogram(
            "tidepool_gc_pause_seconds", "time the garbage collector held the GIL, per collection",
            ["generation"], buckets=PAUSE_BUCKETS, registry=registry,
        )
        registry.register(_FrozenObjects())
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.labels(str(info["generation"])).observe(time.perf_counter() - self._started)
            self._started = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
