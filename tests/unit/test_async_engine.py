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
