"""Preparing the next step while the device runs this one (DESIGN.md, "Async prepare").

Async scheduling lays out and launches step N + 1 while step N still runs: on the CPU the
device queue runs steps on a worker thread (``AsyncRunner``). The runner must surface
exceptions at ``sync()`` and never deadlock; the engine must really overlap the two
sides, let a failing step reach the caller and recover, and never let the step being
prepared share mutable buffers with the one running.
"""

import hashlib
import threading
import time

import pytest

from libs.engine import SamplingParams
from libs.engine.async_runner import AsyncRunner, AsyncRunnerError
from tests.models import tiny_engine


def test_runner_returns_results_and_reraises_errors():
    r = AsyncRunner("t")
    r.submit(lambda a, b: a + b, 2, 3)
    assert r.sync(timeout=5) == 5

    def boom():
        raise KeyError("prepare failed")

    r.submit(boom)
    with pytest.raises(KeyError, match="prepare failed"):
        r.sync(timeout=5)
    r.submit(lambda: "still alive")  # the worker survived the exception
    assert r.sync(timeout=5) == "still alive"
    r.close()


def test_runner_misuse_is_an_error_not_a_hang():
    r = AsyncRunner("t")
    with pytest.raises(AsyncRunnerError):
        r.sync(timeout=1)
    gate = threading.Event()
    r.submit(gate.wait, 5)
    with pytest.raises(AsyncRunnerError):
        r.submit(lambda: None)
    gate.set()
    assert r.sync(timeout=5) is True
    r.close()
    with pytest.raises(AsyncRunnerError):
        r.submit(lambda: None)


def test_close_with_a_queued_task_fails_its_sync():
    r = AsyncRunner("t")
    gate = threading.Event()
    r.submit(gate.wait, 0.2)
    t = threading.Thread(target=r.close)
    t.start()
    gate.set()
    t.join(5)
    assert not t.is_alive()
    # The task had started (or not): sync returns its result or the close error, never hangs.
    try:
        r.sync(timeout=5)
    except AsyncRunnerError:
        pass


def test_runner_runs_and_collects_in_order_up_to_its_depth():
    r = AsyncRunner("t", max_pending=2)
    gate, order = threading.Event(), []
    r.submit(lambda: (gate.wait(5), order.append(1), "first")[2])
    r.submit(lambda: (order.append(2), "second")[1])
    with pytest.raises(AsyncRunnerError):
        r.submit(lambda: None)  # a third would exceed the depth
    gate.set()
    assert r.sync(timeout=5) == "first" and r.sync(timeout=5) == "second"
    assert order == [1, 2]
    # A failing task does not disturb the one queued behind it.
    r.submit(lambda: 1 / 0)
    r.submit(lambda: "after")
    with pytest.raises(ZeroDivisionError):
        r.sync(timeout=5)
    assert r.sync(timeout=5) == "after"
    r.close()


def workload():
    return [[200 + 13 * i + j for j in range(10 + 17 * i)] for i in range(6)]


def run(engine, stagger: bool = True):
    """Requests arriving over time, finishing at different lengths."""
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(workload()))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and (not stagger or step % 3 == 0):
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True))
        for o in engine.step():
            for c in o.outputs:
                outs.setdefault(o.request_id, []).extend(c.new_token_ids)
        step += 1
    return outs


def test_the_device_side_runs_on_its_own_thread_while_the_next_step_is_prepared():
    ref = run(tiny_engine(num_blocks=40, async_scheduling="off"))
    eng = tiny_engine(num_blocks=40, async_scheduling="on")
    threads, overlapped = set(), [0]
    execute, submit = eng.runner.execute, eng.queue.submit

    def spy_execute(step, pre_ops):
        threads.add(threading.get_ident())
        return execute(step, pre_ops)

    def spy_submit(fn):
        overlapped[0] += len(eng._in_flight) > 0  # a step is still out when the next goes
        return submit(fn)

    eng.runner.execute, eng.queue.submit = spy_execute, spy_submit
    assert run(eng) == ref
    assert threads and threading.get_ident() not in threads
    assert overlapped[0] > 20
    eng.close()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_failing_step_reaches_the_caller_and_the_engine_recovers(mode):
    eng = tiny_engine(async_scheduling=mode)
    eng.add_request("a", list(range(100, 120)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.add_request("b", list(range(300, 310)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    real, calls = eng.runner.execute, [0]

    def flaky(step, pre_ops):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected device failure")
        return real(step, pre_ops)

    eng.runner.execute = flaky
    with pytest.raises(RuntimeError, match="injected device failure"):
        for _ in range(3):  # async: the failure surfaces when that step is read back
            eng.step()
    outs = []
    while eng.has_unfinished_requests():  # no deadlock, no stuck step in flight
        outs += eng.step()
    finished = {o.request_id: o for o in outs if o.finished}
    assert set(finished) == {"a", "b"} and all(c.finish_reason == "abort" for o in finished.values() for c in o.outputs)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    # The engine serves new requests normally afterwards.
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert eng.generate([list(range(500, 530))], p)[0].token_ids == tiny_engine().generate([list(range(500, 530))], p)[0].token_ids
    eng.close()


def _fingerprint(step) -> str:
    i64, i32, f32 = step.layout.sizes()
    h = hashlib.sha256()
    for arr, n in zip(step.pack.arrays, (i64, i32, f32)):
        h.update(arr[:n].tobytes())
    return h.hexdigest()


def test_a_step_in_flight_shares_no_buffers_with_the_step_being_prepared():
    """The worker is slowed down so it always lags: if preparing step N + 1 wrote into
    memory step N reads, step N would see different inputs than were laid out for it."""
    eng = tiny_engine(async_scheduling="on", num_blocks=80)
    for i in range(4):
        eng.add_request(f"r{i}", list(range(100 + 40 * i, 130 + 40 * i)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    build, execute = eng.builder.build, eng.runner.execute
    laid_out: dict[int, str] = {}
    checked = [0]

    def spy_build(*a, **k):
        step = build(*a, **k)
        laid_out[step.index] = (_fingerprint(step), step.pack)
        return step

    def slow_execute(step, pre_ops):
        time.sleep(0.01)
        fp, pack = laid_out[step.index]
        assert _fingerprint(step) == fp, "a step's inputs changed while it was in flight"
        checked[0] += 1
        return execute(step, pre_ops)

    eng.builder.build, eng.runner.execute = spy_build, slow_execute
    while eng.has_unfinished_requests():
        eng.step()
    assert checked[0] > 15
    packs = [id(pack) for _, pack in laid_out.values()]
    assert all(a != b for a, b in zip(packs, packs[1:]))  # consecutive steps never share a pack
    eng.close()
