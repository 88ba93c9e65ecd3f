"""A tensor-parallel engine (TP=2 on the CPU, gloo) under async scheduling and on the
padded graph layouts, against the TP=1 engine (synchronous, eager).

- ``enable_graphs(emulate=True)`` on rank 0 makes rank 1 take the same graph layouts: the
  steps run as decode and prefill graph replays on both ranks (emulated: the padded
  layouts run eagerly, libs/engine/cuda_graphs.py), and greedy and seeded output equal TP=1.
- Async scheduling: the device queue's worker thread runs the steps (rank 0 sends each
  step's plan from there) while the engine thread schedules the next one and exports a
  finished prompt's blocks (messages from two threads, kept in order by the runner's lock).
  A request decoding alongside the export and the exported blocks continued by the TP=1
  engine both equal TP=1.

One TP engine per process at a time (torch.distributed has one default group): this
module's engine lives only in its one test.
"""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLM, SamplingParams
from libs.kvpool.codec import BlockCodec
from tests.models import CHAT_PROMPTS, RAW_PROMPTS
from tests.unit.test_tp_engine import GREEDY, N, SEEDED, assert_same_tokens, import_and_continue, prompts, tp_config

pytestmark = pytest.mark.slow  # two-rank TP on the CPU: make test-slow runs it, make test not

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)


def test_async_scheduling_on_graph_layouts_equals_tp1(engine):
    eng = LLM(tp_config(async_scheduling="on"))
    try:
        assert eng.async_scheduling and eng.queue.threaded
        eng.enable_graphs(emulate=True)
        tok = eng.tokenizer
        assert_same_tokens(eng, engine, prompts(tok), GREEDY)
        assert_same_tokens(eng, engine, [tok.encode_chat(CHAT_PROMPTS[1])], SEEDED)
        replays = dict(eng.runner.graphs.replays)
        assert replays["decode"] > 0 and replays["prefill"] > 0

        # An export while another request decodes: the export (engine thread) and the
        # steps (the queue's thread) interleave.
        other = tok.encode(RAW_PROMPTS[2])
        prompt = tok.encode(" ".join(RAW_PROMPTS[5:] + RAW_PROMPTS[:2]))
        eng.add_request("decoding", other, GREEDY)
        got: dict[str, list[int]] = {"decoding": [], "export": []}
        exported = None
        steps = 0
        while eng.has_unfinished_requests():
            if steps == 2:  # "decoding" has a step in flight
                eng.add_request("export", prompt, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
            steps += 1
            for out in eng.step():
                for c in out.outputs:
                    got[out.request_id].extend(c.new_token_ids)
                if out.exported_kv is not None:
                    exported = out.exported_kv
        assert got["decoding"] == engine.generate([other], GREEDY)[0].token_ids
        assert exported is not None
        codec = BlockCodec(eng.layout)
        values = [bytes(b"".join(codec.encode_views(block, n))) for block, n in exported.blocks()]
        exported.release()
        tokens, imported = import_and_continue(engine, prompt, got["export"][0], values)
        assert imported == len(prompt) and tokens[:N] == engine.generate([prompt], GREEDY)[0].token_ids
        assert eng.runner.graphs.replays["decode"] > replays["decode"]
    finally:
        eng.close()
