"""Prompt logprobs (libs/engine/prompt_logprobs.py) on the real SmolLM2 in float32, against
transformers' ``log_softmax`` of its logits at every prompt position.

Tolerance: 2e-3 absolute on every logprob (the engine's logits agree with transformers' to
1e-3, test_engine_correctness.py; a log-softmax adds the error of its normalizer). The
top-k alternatives are checked by value against the reference's top-k, and each one's
reference logprob, since ids may swap where two logprobs are within the tolerance."""

from __future__ import annotations

import pytest
import torch

from libs.engine import LLM, EngineConfig, SamplingParams
from libs.engine.errors import InvalidSamplingParamsError
from tests.models import CHAT_PROMPTS, RAW_PROMPTS

TOL = 2e-3
K = 5


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(RAW_PROMPTS[1]), tok.encode_chat(CHAT_PROMPTS[1])]


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]  # position i predicts token i + 1


def check(scores, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert scores is not None and scores.token_ids == ids[1:]
    want = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    got = torch.tensor(scores.logprobs)
    assert torch.allclose(got, want, atol=TOL, rtol=0), (got - want).abs().max()
    top_vals = ref.topk(k, dim=-1).values
    assert torch.allclose(torch.tensor(scores.top_logprobs), top_vals, atol=TOL, rtol=0)
    chosen_ref = ref.gather(1, torch.tensor(scores.top_ids))
    assert torch.allclose(torch.tensor(scores.top_logprobs), chosen_ref, atol=TOL, rtol=0)


def test_prompt_logprobs_match_transformers(engine, hf_model, prompts):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    results = engine.generate(prompts, params)  # one batch: both prompts' rows in one step
    for ids, r in zip(prompts, results):
        check(r.prompt_logprobs, ids, reference(hf_model, ids), K)
        assert len(r.token_ids) == 2


@pytest.mark.parametrize("mode", ["sync", "async", "graphs"])
def test_chunked_prefill_concatenates_the_chunks(engine, hf_model, prompts, mode):
    """A 13-token budget splits the prompt into chunks not aligned with the 16-token blocks,
    batched behind the decode rows of a short request (so a chunk's rows start after them).
    ``async``: a chunk is planned before the last one's scores are read; ``graphs``: the
    prefill-graph layout (padded token bucket), run eagerly on the CPU. After the first
    request the prefix cache holds the prompt; a scored prompt must not use it (it would
    have no scores for the cached part), an unscored one still does."""
    small = LLM(
        EngineConfig(device="cpu", dtype="float32", num_blocks=256, max_num_seqs=4, max_num_batched_tokens=13,
                     async_scheduling="off" if mode == "sync" else "on"),
        loaded=engine.loaded,
    )
    if mode == "graphs":
        small.enable_graphs(emulate=True)
    try:
        ids, short = prompts[1], prompts[0][:4]
        assert len(ids) > 2 * 13
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=K)]
        _, r = small.generate([short, ids], params)
        (again,) = small.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        (cached,) = small.generate([ids], SamplingParams(temperature=0, max_tokens=1))
        if mode == "graphs":
            assert small.runner.graphs.replays["prefill"] > 2
    finally:
        small.close()
    ref = reference(hf_model, ids)
    check(r.prompt_logprobs, ids, ref, K)
    assert r.num_cached_tokens == 0 and again.num_cached_tokens == 0  # computed, not looked up
    assert again.prompt_logprobs.logprobs == pytest.approx(r.prompt_logprobs.logprobs, abs=1e-4)
    assert again.prompt_logprobs.top_ids == [[]] * (len(ids) - 1)
    assert cached.prompt_logprobs is None and cached.num_cached_tokens > 0  # unscored requests still hit the cache


def test_n_and_edge_prompts(engine, hf_model, prompts):
    ids = prompts[0]
    a, b = engine.generate([ids], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3, prompt_logprobs=1))
    assert a.prompt_logprobs is b.prompt_logprobs  # scored once, by the sequence that computes the prompt
    check(a.prompt_logprobs, ids, reference(hf_model, ids), 1)
    (one,) = engine.generate([[ids[0]]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    assert one.prompt_logprobs is not None and len(one.prompt_logprobs) == 0  # nothing before the first token
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(prompt_logprobs=21)
