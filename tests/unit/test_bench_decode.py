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


def test_transformers_prefill_with_last_logits_computes_one_row_per_prompt(monkeypatch):
    """The like-for-like peer figure asks transformers for the last position's logits only:
    the keyword reaches the forward (a typo or a transformers without it would fail here,
    not on the GPU host), and the forward then returns one row per prompt."""
    import torch

    from bench.common import hf_llama
    from bench.gpu_engine import hf_prefill

    hf = hf_llama(torch.device("cpu"), torch.float32, num_hidden_layers=1, hidden_size=64, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    shapes = []
    forward = hf.forward
    monkeypatch.setattr(hf, "forward", lambda *a, **kw: shapes.append(out := forward(*a, **kw)) or out)
    assert hf_prefill(hf, batch=2, length=8, last_logits=True) > 0
    assert {tuple(o.logits.shape) for o in shapes} == {(2, 1, 128)}
    shapes.clear()
    hf_prefill(hf, batch=2, length=8)
    assert {tuple(o.logits.shape) for o in shapes} == {(2, 8, 128)}


def test_tp_bench_engines_take_every_sizing_flag(tmp_path):
    """bench/tp_bench.py's engine configuration carries the cache and length flags it
    parses (a comment once swallowed ``num_blocks`` and ``max_model_len``, so both silently
    took EngineConfig's defaults), and sizes max_num_seqs for its batch-2 warm-up."""
    from argparse import Namespace

    from bench.tp_bench import config

    args = Namespace(device="cpu", batches=[1], num_blocks=1234, max_model_len=4321, budget=512, threads=1)
    cfg = config(args, tmp_path, 2, tp_all_reduce="nccl")
    assert (cfg.num_blocks, cfg.max_model_len, cfg.max_num_seqs) == (1234, 4321, 2)
    assert (cfg.max_num_batched_tokens, cfg.tensor_parallel_size, cfg.tp_all_reduce) == (512, 2, "nccl")
