"""The engine against Hugging Face transformers on the same GGUF, in float32.

Greedy decoding must give the same tokens for >= 32 steps on raw and chat prompts (a
chat prompt is where a wrong Q/K un-permutation shows up), and the first step's logits
must agree to 1e-3.
"""

import pytest
import torch

from libs.engine import SamplingParams
from tests.models import CHAT_PROMPTS, CORE_TOKENS, RAW_PROMPTS, hf_greedy_batch

N_TOKENS = CORE_TOKENS


def test_prompt_set_is_big_enough(core_prompts):
    assert len(RAW_PROMPTS) >= 8 and len(CHAT_PROMPTS) >= 3 and N_TOKENS >= 32
    assert len(core_prompts) == len(RAW_PROMPTS) + len(CHAT_PROMPTS)


@pytest.fixture(scope="module")
def hf_runs(hf_model, core_prompts) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy tokens and first-step logits per prompt, run once for both tests
    (all prompts in one padded batch: a third of the time of one run per prompt)."""
    return hf_greedy_batch(hf_model, core_prompts, N_TOKENS)


def test_greedy_matches_transformers(engine, core_greedy, hf_runs, core_prompts):
    # core_greedy: the engine's tokens with every prompt in one batch (tests/unit/conftest.py)
    for ids, tokens, (ref, _) in zip(core_prompts, core_greedy, hf_runs):
        assert len(tokens) == N_TOKENS
        assert tokens == ref, engine.tokenizer.decode(ids)


def test_first_step_logits_match_transformers(engine, hf_runs, core_prompts):
    for ids, (_, ref) in zip(core_prompts, hf_runs):
        ours = engine.first_step_logits(ids)
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=1e-3, rtol=0), (ours - ref).abs().max()


def test_chat_answer_is_sensible(engine):
    """A smoke check that a chat prompt is rendered and answered, not just echoed."""
    r = engine.generate(messages=CHAT_PROMPTS[0], params=SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in r.text
    assert r.finish_reason == "stop"
