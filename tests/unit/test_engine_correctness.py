"""The engine against Hugging Face transformers on the same GGUF, in float32.

Greedy decoding must give the same tokens for >= 32 steps on raw and chat prompts (a
chat prompt is where a wrong Q/K un-permutation shows up), and the first step's logits
must agree to 1e-3.
"""

import pytest
import torch

from libs.engine import SamplingParams
from tests.models import CHAT_PROMPTS, RAW_PROMPTS, hf_greedy

N_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok.encode(p) for p in RAW_PROMPTS] + [tok.encode_chat(m) for m in CHAT_PROMPTS]


def test_prompt_set_is_big_enough(prompts):
    assert len(RAW_PROMPTS) >= 8 and len(CHAT_PROMPTS) >= 3
    assert len(prompts) == len(RAW_PROMPTS) + len(CHAT_PROMPTS)


@pytest.fixture(scope="module")
def hf_runs(hf_model, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and first-step logits per prompt, run once for both tests."""
    return [hf_greedy(hf_model, ids, N_TOKENS) for ids in prompts]


def test_greedy_matches_transformers(engine, hf_runs, prompts):
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    ours = engine.generate(prompts, params)  # all prompts in one batch
    for ids, result, (ref, _) in zip(prompts, ours, hf_runs):
        assert len(result.token_ids) == N_TOKENS
        assert result.token_ids == ref, engine.tokenizer.decode(ids)


def test_first_step_logits_match_transformers(engine, hf_runs, prompts):
    for ids, (_, ref) in zip(prompts, hf_runs):
        ours = engine.first_step_logits(ids)
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=1e-3, rtol=0), (ours - ref).abs().max()


def test_chat_answer_is_sensible(engine):
    """A smoke check that a chat prompt is rendered and answered, not just echoed."""
    r = engine.generate(messages=CHAT_PROMPTS[0], params=SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in r.text
    assert r.finish_reason == "stop"
