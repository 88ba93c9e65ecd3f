"""End to end: the official openai client, through the router, with prefill and decode in
separate processes handing the KV off through Redis, on the real model."""

import pytest

from tests.integration.pd_helpers import CHAT, PROMPT, TRACE, assert_went_through_pd, engine_tokens, trace_of

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_chat_greedy_equals_the_engine(pd_client, reference_engine):
    client = pd_client
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    ref = engine_tokens(reference_engine, tok.encode_chat(CHAT), 24)
    resp = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=24, extra_body=TRACE)
    assert resp.choices[0].message.content == tok.decode(ref)
    assert resp.usage.completion_tokens == len(ref)
    assert resp.usage.prompt_tokens == len(tok.encode_chat(CHAT))
    assert_went_through_pd(trace_of(resp))


def test_chat_streaming_equals_the_engine(client, model, reference_engine):
    tok = reference_engine.tokenizer
    ref = engine_tokens(reference_engine, tok.encode_chat(CHAT), 24)
    stream = client.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}
    )
    text, usage, chunks = "", None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert chunks > 3  # really streamed
    assert text == tok.decode(ref)
    assert usage is not None and usage.completion_tokens == len(ref)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_the_engine(client, model, reference_engine, stream):
    tok = reference_engine.tokenizer
    ref = engine_tokens(reference_engine, tok.encode(PROMPT), 20)
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=20, stream=True) if c.choices)
    else:
        resp = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=20, extra_body=TRACE)
        text = resp.choices[0].text
        assert_went_through_pd(trace_of(resp))
    assert text == tok.decode(ref)


def test_seeded_sampling_is_reproducible_through_pd(client, model):
    kw = dict(model=model, messages=CHAT, temperature=0.9, top_p=0.95, max_tokens=16, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_prefix_reuse_reports_cached_tokens_and_skips_compute(client, model, reference_engine):
    system = "You are a meticulous librarian. " + "You answer with care, cite the shelf, and never invent a book. " * 6
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Where are the atlases?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Where is the poetry?"}]
    a = client.chat.completions.create(model=model, messages=first, temperature=0, max_tokens=8, extra_body=TRACE)
    b = client.chat.completions.create(model=model, messages=second, temperature=0, max_tokens=8, extra_body=TRACE)
    shared = len(reference_engine.tokenizer.encode_chat([{"role": "system", "content": system}])) // 16 * 16
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached >= shared - 16 and cached > 0
    prefill = trace_of(b)["prompts"][0]["prefill"]
    assert prefill["num_computed_tokens"] == b.usage.prompt_tokens - cached  # the shared part was not recomputed
    assert a.usage.prompt_tokens_details.cached_tokens < cached
    tok = reference_engine.tokenizer
    assert b.choices[0].message.content == tok.decode(engine_tokens(reference_engine, tok.encode_chat(second), 8))


def test_n_choices_and_logprobs(client, model):
    resp = client.chat.completions.create(
        model=model, messages=CHAT, temperature=1.0, n=3, max_tokens=6, seed=7, logprobs=True, top_logprobs=2
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        content = c.logprobs.content
        assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)


def test_bad_input_gets_4xx_and_the_service_stays_up(client, model, cluster):
    import openai
    import urllib.request

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CHAT, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=10**7)  # over the context
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x " * 9000, max_tokens=4)  # prompt over the context
    req = urllib.request.Request(cluster.url + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].message.content is not None
