"""Garbage collection in a serving process: the startup heap frozen, every pause measured.

CPython's cyclic collector runs on whichever thread happens to allocate, holding the GIL,
so while it runs the event loop and the engine's step thread both stand still, and every
running sequence's next token waits. A young collection is cheap: it walks the few
objects made since the last one. A full (generation 2) collection walks every tracked
object in the process, and a worker's startup leaves a lot of them behind: the model's
modules and parameter wrappers, the tokenizer's tables, the CUDA graphs' bookkeeping.
``bench/gc_pause.py`` measured it (bench/RESULTS.md, issue 10): a SmolLM2-shaped GPU
engine on the H200 host holds 305,926 tracked objects, and a full collection of them took
188 ms, about 420 batch-1 decode steps; the embedded SmolLM2 on the 2-core CPU VM, 202,940
objects and 81-181 ms. One such pause mid-decode delays every running request's next token
by that much.

Those objects live as long as the process, so scanning them finds nothing.
:func:`freeze_startup_heap`, called once the service is up (``services/common/runner.py``),
collects once and then moves everything still alive into the permanent generation that
collections skip (``gc.freeze``), as vLLM's engine core does after start-up. A full
collection then walked 11-12 objects, in under a microsecond. Refcounting still frees
frozen objects that are dropped later; only cyclic garbage among them is never reclaimed,
and the startup heap has next to none.

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
