"""The engine's worker thread (libs/engine/async_engine.py) as a service drives it.

With async scheduling a request's last token is still in flight after its sequence
retired (nothing running, nothing waiting). The worker must read it at once: it once
slept its 2 ms "exports only" pause first, which delayed every request's last token by
up to 2 ms (in a PD handoff, the second token the client waits for).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from libs.engine import SamplingParams
from libs.engine.async_engine import AsyncEngine
from tests.models import tiny_engine


class RecordingWake(threading.Event):
    """The worker's wake-up event, noting each wait and the engine's state at that moment."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        super().__init__()
        self.engine = engine
        self.waits: list[tuple[float | None, int, int, int]] = []

    def wait(self, timeout: float | None = None) -> bool:
        e = self.engine
        self.waits.append((timeout, e.num_steps_in_flight, e.num_running, e.num_waiting))
        return super().wait(timeout)


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_the_worker_never_sleeps_while_a_step_is_in_flight(max_tokens: int) -> None:
    eng = tiny_engine(async_scheduling="on")
    assert eng.async_scheduling

    async def main() -> list[list[int]]:
        ae = AsyncEngine(eng)
        wake = ae._wake = RecordingWake(eng)
        ae.start()
        try:
            got = []
            for i in range(3):
                toks: list[int] = []
                async for out in ae.add_request(f"r{i}", [5, 6, 7, 8 + i], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)):
                    toks.extend(out.outputs[0].new_token_ids)
                got.append(toks)
            return got, wake.waits
        finally:
            await ae.stop()

    got, waits = asyncio.run(main())
    assert [len(t) for t in got] == [max_tokens] * 3
    asleep_in_flight = [w for w in waits if w[1]]
    assert not asleep_in_flight, f"the worker waited (timeout, in flight, running, waiting) with a step in flight: {asleep_in_flight}"
    assert waits, "the worker never waited: the recording event was not used"


class GatedScheduler:
    """Holds the engine thread in ``schedule`` until the test opens the gate."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._scheduler = engine.scheduler
        self._schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self

    def __call__(self):  # noqa: ANN204
        if self._scheduler.waiting:  # a request to admit: the step that launches it
            self.entered.set()
            self.gate.wait(10)
        return self._schedule()


def test_launched_is_set_once_the_first_step_is_on_the_device_and_before_any_output() -> None:
    """A service does its own Python work (prefill's lease) when ``launched`` is set: after
    the engine thread has enqueued the step, never while it still prepares it."""
    eng = tiny_engine(async_scheduling="on")
    steps: list[set[str]] = []  # request ids of each launched step, as the engine thread saw them

    async def main() -> tuple[bool, bool, list[str]]:
        ae = AsyncEngine(eng)
        hook = eng.on_launch
        eng.on_launch = lambda step: (steps.append({c.seq.request_id for c in step.chunks}), hook(step))
        gated = GatedScheduler(eng)
        ae.start()
        try:
            stream = ae.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), notify_launch=True)
            assert await asyncio.to_thread(gated.entered.wait, 10)
            await asyncio.sleep(0.05)
            early = stream.launched.is_set()  # the engine thread is held before the step exists
            gated.gate.set()
            await asyncio.wait_for(stream.launched.wait(), 10)
            launched_step = bool(steps) and "r" in steps[0]
            order = []
            async for out in stream:
                order.append("output" if stream.launched.is_set() else "output before launched")
            return early, launched_step, order
        finally:
            gated.gate.set()
            await ae.stop()
            eng.close()  # a step may still be on the device queue's thread: torch aborts at exit otherwise

    early, launched_step, order = asyncio.run(main())
    assert not early, "launched was set before the engine thread had launched any step"
    assert launched_step, "launched was set, but no launched step held the request"
    assert order and all(o == "output" for o in order)


def test_launched_is_set_for_a_request_aborted_before_its_first_step() -> None:
    """Nobody waits forever: a request that ends before any step launched it sets it too."""
    eng = tiny_engine(async_scheduling="on")

    async def main() -> tuple[bool, bool]:
        ae = AsyncEngine(eng)
        gated = GatedScheduler(eng)
        ae.start()
        try:
            stream = ae.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3), notify_launch=True)
            assert await asyncio.to_thread(gated.entered.wait, 10)
            stream.abort()
            await asyncio.wait_for(stream.launched.wait(), 10)
            return stream.aborted, ae._launch_waiters == set()
        finally:
            gated.gate.set()
            await ae.stop()
            eng.close()  # a step may still be on the device queue's thread: torch aborts at exit otherwise

    aborted, forgotten = asyncio.run(main())
    assert aborted and forgotten
