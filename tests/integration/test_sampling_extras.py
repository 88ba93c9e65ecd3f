"""``best_of`` and prompt logprobs (``echo`` with ``logprobs``) end to end: the official
openai client, through the router, on the real model, through PD (a long prompt: prefill
scores it, chunk by chunk, 64 tokens a chunk in this cluster) and with decode serving
alone (a short prompt: decode scores it). The scores are compared with the in-process
engine (itself checked against transformers in tests/unit/test_prompt_logprobs.py)."""

from __future__ import annotations

import pytest

from libs.engine import SamplingParams
from tests.integration.pd_helpers import TRACE, trace_of

pytestmark = pytest.mark.integration

SHORT = "The capital of France is"
# Prompts of this module's own (other modules expect pd_helpers.PROMPT to be new to the pool).
PROMPT = (
    "The old cartographer unrolled the map of the northern coast on the oak table. Every inlet "
    "had a name he had given it, and on the evening before the survey ship sailed he"
)
LONG = PROMPT + (  # over 64 tokens: prefill scores it in two chunks of 64
    " The wind had turned by nightfall, and the harbour master came up the hill with a lantern and"
    " news of a storm that the fishermen had seen gathering beyond the islands since noon, so that"
)

TOL = 2e-3


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.mark.parametrize(("prompt", "echo"), [(SHORT, False), (PROMPT, True)], ids=["decode-alone", "prefill"])
def test_best_of_returns_the_best_candidates(client, model, prompt, echo):
    """The n best of best_of are the n best of the same candidates asked as n = best_of.
    Sampled candidates are equal across two requests only if both take the same path: a
    short prompt is always decode's alone; a long one would be served from the pool the
    second time, unless it is scored (echo with logprobs), which always goes to prefill."""
    ask = dict(model=model, prompt=prompt, temperature=1.0, max_tokens=8, seed=11, logprobs=0, echo=echo, extra_body=TRACE)
    every = client.completions.create(**ask, n=4)
    best = client.completions.create(**ask, n=2, best_of=4)
    skip = every.usage.prompt_tokens if echo else 0  # the echoed prompt's entries are not ranked
    for r in (every, best):
        assert trace_of(r)["prompts"][0]["prefill"]["decision"] == ("prefill" if echo else "skip_short_prompt")
    score = {c.index: sum(c.logprobs.token_logprobs[skip:]) for c in every.choices}
    texts = {c.index: c.text for c in every.choices}
    want = sorted(score, key=lambda i: (-score[i], i))[:2]  # the same four candidates, ranked
    got = sorted(best.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [texts[i] for i in want]
    assert [sum(c.logprobs.token_logprobs[skip:]) for c in got] == pytest.approx([score[i] for i in want], abs=1e-3)
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all four were generated
    if not echo:
        quiet = client.completions.create(**{**ask, "logprobs": None}, n=1, best_of=4)
        assert quiet.choices[0].logprobs is None and quiet.choices[0].text == texts[want[0]]


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode-alone", "prefill"])
def test_echo_with_logprobs_scores_the_prompt(client, model, reference_engine, prompt):
    ids = reference_engine.tokenizer.encode(prompt)
    (ref,) = reference_engine.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    for attempt in range(2):  # the second time the prompt is in the pool and the caches: still computed
        r = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=3, extra_body=TRACE)
        (c,) = r.choices
        lp = c.logprobs
        n = len(ids)
        assert c.text.startswith(prompt) and len(lp.tokens) == n + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:n] == pytest.approx(ref.prompt_logprobs.logprobs, abs=TOL)
        for top, ref_ids, ref_vals in zip(lp.top_logprobs[1:n], ref.prompt_logprobs.top_ids, ref.prompt_logprobs.top_logprobs):
            assert len(top) in (3, 4)  # the token itself is added when it is not among the top 3
            assert sorted(top.values(), reverse=True)[:3] == pytest.approx(ref_vals, abs=TOL)
        decision = trace_of(r)["prompts"][0]["prefill"]["decision"]
        assert decision == ("prefill" if prompt == LONG else "skip_short_prompt"), decision
        if prompt == LONG:
            assert n > 64 and trace_of(r)["prompts"][0]["prefill"]["num_computed_tokens"] == n
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].text.startswith(prompt)
    assert chunks[0].choices[0].logprobs.token_logprobs[1:n] == pytest.approx(ref.prompt_logprobs.logprobs, abs=TOL)
