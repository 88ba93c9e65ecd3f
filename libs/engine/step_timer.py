"""How busy the device is (GPU time per step, idle gaps between steps), and where the
host's time per step goes.

CUDA events are recorded around each step's device work (forward and sampling) on the
stream; after the step's host sync both have completed, so reading them costs nothing.
The idle time between two consecutive steps is the gap from one step's end event to
the next one's start event: host-side scheduling, input preparation and launch latency
that the device waited for. Off CUDA nothing is measured.
"""

from __future__ import annotations

import torch


class StepTimer:
    """``start()``/``stop()`` return a step's events, which travel with its result (async
    scheduling launches step N + 1 before step N is read back); ``account(events)`` adds
    the step once its result is on the host.

    The events are ``torch.Event``s (recorded on the current stream in C++, where
    ``torch.cuda.Event.record`` looks the stream up in Python) and are recorded again by
    later steps once accounted: creating and recording two fresh ``torch.cuda.Event``s
    cost a batch-1 decode step about 35 us of host time on an H200 host."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.device = device
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.steps = 0
        self._prev_end: torch.Event | None = None
        self._spare: list[torch.Event] = []  # accounted events, free to record again

    def start(self) -> "torch.Event | None":
        return self._record()

    def stop(self) -> "torch.Event | None":
        return self._record()

    def _record(self) -> "torch.Event | None":
        if not self.enabled:
            return None
        ev = self._spare.pop() if self._spare else torch.Event(self.device, enable_timing=True)
        ev.record()
        return ev

    def account(self, events: tuple) -> None:
        """Add a step from its ``(start, stop)`` events (after its host sync, when both
        have completed); steps must be accounted in launch order."""
        start, end = events
        if start is None or end is None:
            return
        end.synchronize()
        self.busy_s += start.elapsed_time(end) / 1e3
        if self._prev_end is not None:
            self.idle_s += max(0.0, self._prev_end.elapsed_time(start) / 1e3)
            self._spare.append(self._prev_end)
        self._spare.append(start)
        self._prev_end = end
        self.steps += 1

    def reset(self) -> None:
        """Start a new measurement window (and forget the previous step: an idle period
        between windows, e.g. no requests at all, is not counted)."""
        self.busy_s = self.idle_s = 0.0
        self.steps = 0
        if self._prev_end is not None:
            self._spare.append(self._prev_end)
        self._prev_end = None

    @property
    def idle_fraction(self) -> float | None:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if self.enabled and total > 0 else None


PHASES = ("schedule", "prepare", "launch", "sample", "output")


class HostPhases:
    """Host seconds per step phase, always on (a few ``perf_counter`` calls a step).

    - ``schedule``: the scheduler's decision;
    - ``prepare``: applying it to the persistent batch and laying out the step's inputs;
    - ``launch``: handing the step's device work over (on the CPU without async
      scheduling the work runs right there, so it includes the forward and sampling);
    - ``sample``: waiting for a step's sampled ids and reading them;
    - ``output``: appending tokens, stop checks, request outputs.

    ``forward`` is the time the device queue spent in the model forward (host launch
    time on CUDA, compute on the CPU). ``history`` keeps every step when enabled
    (benchmarks take medians of it)."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys((*PHASES, "forward", "step"), 0.0)
        self.steps = 0
        self.history: list[dict[str, float]] | None = None

    def record(self, phases: dict[str, float]) -> None:
        self.steps += 1
        for k, v in phases.items():
            self.totals[k] += v
        if self.history is not None:
            self.history.append(phases)
