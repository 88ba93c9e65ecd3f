"""bench/gpu_engine.py's decode loop refuses a batch the engine can never run at once
(its wait for every sequence to be decoding would not end: bench/tp_bench.py --batches 1
once spun there for good)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.gpu_engine import decode
from libs.engine import EngineConfig


def test_a_batch_above_max_num_seqs_is_an_error_not_a_hang():
    engine = SimpleNamespace(config=EngineConfig(max_num_seqs=1))  # the check reads only the config
    with pytest.raises(ValueError, match=r"decode batch 2 exceeds the engine's max_num_seqs \(1\)"):
        decode(engine, 2, steps=4)
