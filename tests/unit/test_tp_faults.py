"""Faults of a tensor-parallel engine (``tensor_parallel_size=2`` on the CPU; this process
is rank 0): nothing hangs.

- A rank killed while the engine is idle: the watcher reports it (the failure callback
  fires: a service deregisters and goes down on it) and the next step fails at once with
  ``TensorParallelError``.
- A rank that stops answering (SIGSTOP): the step's collective fails after the
  collective timeout (``tp_timeout_s``), the group is marked failed, and later steps fail
  at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from libs.engine import LLM
from libs.engine.tp.group import TensorParallelError
from tests.models import RAW_PROMPTS
from tests.unit.test_tp_engine import GREEDY, tp_config

pytestmark = pytest.mark.slow  # two-rank TP on the CPU: make test-slow runs it, make test not

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)


def _wait_failure(eng: LLM, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while eng.tp.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return eng.tp.failure


def test_a_dead_rank_fails_the_engine_at_once():
    eng = LLM(tp_config(num_blocks=64))
    seen: list[str] = []
    got = threading.Event()
    eng.tp.on_failure(lambda reason: (seen.append(reason), got.set()))
    try:
        ids = eng.tokenizer.encode(RAW_PROMPTS[0])
        assert eng.generate([ids], GREEDY)[0].token_ids  # healthy first
        os.kill(eng.tp.ranks.pids[0], signal.SIGKILL)
        assert got.wait(10), "the watcher did not report the dead rank"
        assert "rank 1" in seen[0] and "exited" in seen[0]
        t = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            eng.generate([ids], GREEDY)
        assert time.monotonic() - t < 5
    finally:
        eng.close()


def test_a_hung_rank_fails_the_step_after_the_timeout():
    eng = LLM(tp_config(num_blocks=64, tp_timeout_s=3))
    pid = eng.tp.ranks.pids[0]
    try:
        ids = eng.tokenizer.encode(RAW_PROMPTS[0])
        os.kill(pid, signal.SIGSTOP)
        t = time.monotonic()
        with pytest.raises(TensorParallelError):
            eng.generate([ids], GREEDY)
        assert 2.5 < time.monotonic() - t < 30
        assert _wait_failure(eng, 1) is not None
        t = time.monotonic()
        with pytest.raises(TensorParallelError, match="failed earlier"):
            eng.generate([ids], GREEDY)
        assert time.monotonic() - t < 1
    finally:
        os.kill(pid, signal.SIGCONT)
        eng.close()
