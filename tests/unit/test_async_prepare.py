"""Async prepare: the next step's inputs are built on a worker thread while this step runs.

The AsyncRunner must surface exceptions at sync() and never deadlock; the engine with
async prepare must produce exactly what it produces without it, actually use the inputs
built ahead, and share no mutable buffers between the two sides.
"""

import threading

import pytest

from libs.engine import SamplingParams
from libs.engine.async_runner import AsyncRunner, AsyncRunnerError
from libs.engine.inputs import StepPlan
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


def workload():
    return [[200 + 13 * i + j for j in range(10 + 17 * i)] for i in range(6)]


def run(engine, stagger: bool = True):
    """Requests arriving over time, finishing at different lengths: hits and misses."""
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


def test_engine_outputs_are_identical_with_async_prepare():
    ref = run(tiny_engine(num_blocks=40, async_prepare="off"))
    eng = tiny_engine(num_blocks=40, async_prepare="on")
    got = run(eng)
    assert got == ref
    assert eng.prepared_ahead_hits > 10  # inputs built ahead were really used
    assert eng.prepared_ahead_misses > 0  # ... and mispredictions fell back correctly
    eng.close()


def test_a_failing_prepare_reaches_the_caller_and_the_engine_recovers(monkeypatch):
    import libs.engine.engine as engine_mod

    eng = tiny_engine(async_prepare="on")
    eng.add_request("a", list(range(100, 120)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.step()
    real = engine_mod.build_inputs
    calls = {"n": 0}

    def flaky(plan, device):
        calls["n"] += 1
        if plan.is_decode_only and not plan.seqs[0].token_ids:  # the ahead-of-time build
            raise RuntimeError("injected prepare failure")
        return real(plan, device)

    monkeypatch.setattr(engine_mod, "build_inputs", flaky)
    with pytest.raises(RuntimeError, match="injected prepare failure"):
        eng.step()
    monkeypatch.setattr(engine_mod, "build_inputs", real)
    while eng.has_unfinished_requests():  # no deadlock, no stuck pending task
        eng.step()
    eng.close()


def test_prepared_inputs_share_no_buffers_with_the_running_step():
    eng = tiny_engine(async_prepare="on")
    eng.add_request("a", list(range(100, 120)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seen: list[int] = []
    alive = []  # keep every step's inputs, so freed memory cannot be recycled into a false alarm
    build = eng._inputs_for

    def spy(plan):
        inputs, ids = build(plan)
        alive.append(inputs)
        ptrs = {t.data_ptr() for t in (inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens)}
        assert not ptrs & set(seen), "a step reused another step's input buffer"
        seen.extend(ptrs)
        return inputs, ids

    eng._inputs_for = spy
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.prepared_ahead_hits > 5
    eng.close()


def test_plans_are_immutable_snapshots():
    eng = tiny_engine()
    eng.add_request("a", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3))
    out = eng.scheduler.schedule()
    plan = StepPlan.from_schedule(out, [s.num_samples for s in out.scheduled], 16)
    with pytest.raises(Exception):
        plan.seqs[0].start = 5  # frozen dataclass
    table = plan.seqs[0].block_table
    out.scheduled[0].seq.block_table.append(63)
    assert plan.seqs[0].block_table == table  # a copy, not the live list
