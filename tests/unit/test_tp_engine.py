"""A tensor-parallel engine (``tensor_parallel_size=2`` on the CPU: this process is rank 0,
it starts rank 1 as ``python -m libs.engine.tp.worker``) against the TP=1 engine.

- Rank 0 alone schedules and samples; each step's inputs go to rank 1 first. Greedy
  output (a prompt long enough to be prefilled in several chunks, batched with short
  ones), seeded sampling with ``n=2`` (the fork's block copy is mirrored), and a prefix
  cache hit all equal TP=1.
- The handoff through whole-block values (the pool's, without Redis: BlockCodec): a
  TP=2 export imported by the TP=1 engine, and a TP=1 export imported by the TP=2
  engine, each continues exactly like TP=1 end to end; the TP=2 export's values are
  byte-identical to TP=1's.

Faults are in tests/unit/test_tp_faults.py (one TP engine per process at a time:
torch.distributed has one default group).
"""

from __future__ import annotations

import time

import pytest
import torch

from libs.engine import LLM, EngineConfig, KVImport, SamplingParams
from libs.kvpool.codec import BlockCodec
from tests.models import CHAT_PROMPTS, RAW_PROMPTS

pytestmark = pytest.mark.slow  # two-rank TP on the CPU: make test-slow runs it, make test not

if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
LONG = " ".join(RAW_PROMPTS)  # ~110 tokens: two 64-token chunks


def tp_config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, num_threads=1,
                tensor_parallel_size=2, tp_timeout_s=20)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tp_engine():
    eng = LLM(tp_config())
    yield eng
    eng.close()


SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, n=2, seed=7, ignore_eos=True)


def prompts(tok) -> list[list[int]]:
    """A prompt of two chunks batched with two short ones."""
    return [tok.encode(LONG), tok.encode_chat(CHAT_PROMPTS[0]), tok.encode(RAW_PROMPTS[3])]


def assert_same_tokens(eng: LLM, ref: LLM, ps: list[list[int]], params: SamplingParams) -> list:
    """``eng`` and ``ref`` generate the same tokens for ``ps``; ``ref``'s outputs."""
    ours, theirs = eng.generate(ps, params), ref.generate(ps, params)
    assert [o.token_ids for o in ours] == [r.token_ids for r in theirs]
    return theirs


def test_rank0_plans_and_rank1_follows(tp_engine, engine):
    tok = tp_engine.tokenizer
    ps = prompts(tok)
    ref = assert_same_tokens(tp_engine, engine, ps, GREEDY)
    assert tp_engine.runner.cache.shape[4] == 1  # rank 0 holds one of SmolLM2's 3 KV heads
    assert tp_engine.tp.channel.messages >= tp_engine.num_steps  # a plan per step, at least
    # A prefix cache hit (the long prompt again) computes only its tail, and still agrees.
    again = tp_engine.generate([ps[0]], GREEDY)[0]
    assert again.token_ids == ref[0].token_ids and again.num_cached_tokens >= 48


def test_seeded_sampling_with_forks_equals_tp1(tp_engine, engine):
    ref = assert_same_tokens(tp_engine, engine, [tp_engine.tokenizer.encode_chat(CHAT_PROMPTS[1])], SEEDED)
    assert ref[0].token_ids != ref[1].token_ids


def test_prompt_logprobs_equal_tp1(tp_engine, engine):
    """Prompt logprobs run the vocabulary-parallel LM head on every rank (the spans travel
    in the forward plan); a two-chunk prompt's scores equal TP=1's."""
    ids = tp_engine.tokenizer.encode(LONG)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    (ours,), (ref,) = tp_engine.generate([ids], params), engine.generate([ids], params)
    assert ours.prompt_logprobs.token_ids == ref.prompt_logprobs.token_ids == ids[1:]
    assert ours.prompt_logprobs.logprobs == pytest.approx(ref.prompt_logprobs.logprobs, abs=1e-4)
    assert ours.prompt_logprobs.top_ids == ref.prompt_logprobs.top_ids and ours.token_ids == ref.token_ids


# -- the handoff through whole-block values ---------------------------------------------------


def export_values(eng: LLM, prompt: list[int]) -> tuple[int, list[bytes]]:
    """Prefill ``prompt`` with export: its first token and its blocks as pool values."""
    rid = f"export-{time.monotonic_ns()}"
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    first, exported = None, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.outputs and out.outputs[0].new_token_ids:
                first = out.outputs[0].new_token_ids[0]
            if out.exported_kv is not None:
                exported = out.exported_kv
    codec = BlockCodec(eng.layout)
    values = [bytes(b"".join(codec.encode_views(block, n))) for block, n in exported.blocks()]
    exported.release()
    return first, values


def import_and_continue(eng: LLM, prompt: list[int], first: int, values: list[bytes]) -> tuple[list[int], int]:
    """Decode's side: the values into staging, then continue after ``first``; the tokens
    and how many prompt tokens were imported (the rest were local prefix cache hits)."""
    codec, swapper = BlockCodec(eng.layout), eng.swapper
    buffers, left = [], list(values)
    while left:
        chunk, left = left[: swapper.max_blocks], left[swapper.max_blocks :]
        buf = swapper.acquire(len(chunk))
        for row, value in zip(buf.host, chunk):
            codec.decode(value, row)
        buffers.append(buf)
    imp = KVImport(buffers, first_block=0, num_tokens=len(prompt))
    rid = f"import-{time.monotonic_ns()}"
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), output_prefix=[first], kv_import=imp)
    tokens, imported, cached = [first], 0, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            imported, cached = max(imported, out.num_imported_tokens), max(cached, out.num_cached_tokens)
            for c in out.outputs:
                tokens.extend(c.new_token_ids)
    assert imported + cached >= len(prompt) - 1 and imported > 0
    return tokens, imported


def test_handoff_tp2_to_tp1_and_back_equals_tp1(tp_engine, engine):
    """Prompts neither engine has seen (no local prefix cache hit on the importing side:
    every prompt token is imported, whole blocks and a partial one), then one whose first
    blocks the importer has cached (only the rest is imported, from the middle of a
    staging buffer)."""
    tok = tp_engine.tokenizer
    p1 = tok.encode(" ".join(reversed(RAW_PROMPTS)))
    p2 = tok.encode(" ".join(RAW_PROMPTS[4:] + RAW_PROMPTS[:4]))
    first2, values2 = export_values(tp_engine, p1)  # TP=2 prefill ...
    tokens, imported = import_and_continue(engine, p1, first2, values2)  # ... -> TP=1 decode
    assert imported == len(p1) and tokens[:N] == engine.generate([p1], GREEDY)[0].token_ids
    first1, values1 = export_values(engine, p2)  # TP=1 prefill ...
    tokens, imported = import_and_continue(tp_engine, p2, first1, values1)  # ... -> TP=2 decode
    assert imported == len(p2) and tokens[:N] == engine.generate([p2], GREEDY)[0].token_ids
    tp_engine.generate([tok.encode(LONG)], GREEDY)  # tp_engine caches LONG's leading blocks (whatever ran before)
    p3 = tok.encode(LONG + " Once more, in 1969,")
    first3, values3 = export_values(engine, p3)
    tokens, imported = import_and_continue(tp_engine, p3, first3, values3)
    assert 0 < imported < len(p3) and tokens[:N] == engine.generate([p3], GREEDY)[0].token_ids
    # The blocks of one prompt from both layouts: same length, header and token counts,
    # values close (not bit-identical: TP sums the row-parallel partials in another order,
    # compounded over 30 layers).
    _, values1 = export_values(engine, p1)
    assert len(values2) == len(values1) == -(-len(p1) // 16)
    codec = BlockCodec(engine.layout)
    for v2, v1 in zip(values2, values1):
        assert len(v2) == len(v1)
        a, b = torch.zeros(engine.layout.block_shape), torch.zeros(engine.layout.block_shape)
        assert codec.decode(v2, a) == codec.decode(v1, b)
        torch.testing.assert_close(a, b, atol=5e-3, rtol=1e-3)
