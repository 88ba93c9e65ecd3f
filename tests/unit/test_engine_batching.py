"""Batch invariance on the real model: a request's greedy tokens do not depend on what it
is batched with, on whether its prompt is chunked, or on prefix-cache hits."""

import pytest

from libs.engine import EngineConfig, LLM, SamplingParams
from tests.models import CHAT_PROMPTS, RAW_PROMPTS

N_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_prompts(engine) -> list[list[int]]:
    """16 prompts from 4 to ~250 tokens."""
    tok = engine.tokenizer
    texts = RAW_PROMPTS + [
        "Explain photosynthesis to a child. " * 6,
        "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z " * 4,
        "Here is a long story about a dragon who loved to read books in the library of the old castle. " * 5,
        "1, 2, 3, 4,",
    ]
    ids = [tok.encode(t) for t in texts] + [tok.encode_chat(m) for m in CHAT_PROMPTS]
    assert len(ids) == 16
    lengths = [len(x) for x in ids]
    assert min(lengths) < 8 and max(lengths) > 100
    return ids


def engine_like(base: LLM, **overrides) -> LLM:
    cfg = EngineConfig(device="cpu", dtype="float32", num_blocks=1024, max_num_seqs=32, **overrides)
    return LLM(cfg, loaded=base.loaded)


@pytest.mark.parametrize("rows", ["edges", pytest.param("every", marks=pytest.mark.slow)])  # every row: ~45 s
def test_batch_of_16_equals_alone(engine, mixed_prompts, rows):
    """All 16 in one batch; then alone the first and last rows of the batch and its shortest
    and longest prompts (``edges``), or every row (``every``: make test-slow)."""
    batched = engine.generate(mixed_prompts, GREEDY)
    lengths = [len(ids) for ids in mixed_prompts]
    if rows == "every":
        picked = list(range(len(mixed_prompts)))
    else:
        picked = sorted({0, len(mixed_prompts) - 1, lengths.index(min(lengths)), lengths.index(max(lengths))})
        assert len(picked) >= 3
    for i in picked:
        assert batched[i].token_ids == engine.generate([mixed_prompts[i]], GREEDY)[0].token_ids


def test_chunked_prefill_on_and_off(engine, mixed_prompts):
    chunked = engine_like(engine, max_num_batched_tokens=48, enable_prefix_caching=False)
    whole = engine_like(engine, enable_chunked_prefill=False, enable_prefix_caching=False)
    a = chunked.generate(mixed_prompts, GREEDY)
    assert chunked.num_steps > 16, "prompts were not chunked"
    b = whole.generate(mixed_prompts, GREEDY)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


def test_prefix_cache_hits_do_not_change_output(engine, mixed_prompts):
    fresh = engine_like(engine)
    long_ids = max(mixed_prompts, key=len)
    first = fresh.generate([long_ids], GREEDY)[0]
    assert first.num_cached_tokens == 0
    again = fresh.generate([long_ids], GREEDY)[0]
    assert again.num_cached_tokens >= len(long_ids) - fresh.config.block_size
    assert again.token_ids == first.token_ids
    # A different prompt sharing the prefix hits the shared blocks only.
    variant = long_ids[: len(long_ids) // 2] + engine.tokenizer.encode(" And then something else happened.")
    v_cold = engine_like(engine, enable_prefix_caching=False).generate([variant], GREEDY)[0]
    v_hit = fresh.generate([variant], GREEDY)[0]
    assert 0 < v_hit.num_cached_tokens <= len(long_ids) // 2
    assert v_hit.token_ids == v_cold.token_ids
