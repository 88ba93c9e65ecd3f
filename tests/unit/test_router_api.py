"""services/router: the OpenAI API as the official client sees it (router in-process, fake
prefill/decode instances behind it)."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import openai
import pytest

from tests.router_harness import MODEL, Cluster, long_prompt, script_text, start_cluster, tokenizer


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster()
    yield c
    await c.close()


CHAT = [{"role": "user", "content": "Tell me about foxes."}]


# --- completions ----------------------------------------------------------------------------


async def test_completion_short_prompt_is_served_by_decode_alone(cluster: Cluster) -> None:
    r = await cluster.openai().completions.create(model=MODEL, prompt="Once", max_tokens=5)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert [c.text for c in r.choices] == [script_text(0, 5)]
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (1, 5, 6)
    assert cluster.prefills[0].requests == []  # 1 token < the threshold: no prefill
    (req,) = cluster.decodes[0].requests
    assert req.first_token_id is None and req.sampling.max_tokens == 5 and req.want_trace


async def test_completion_long_prompt_goes_through_prefill(cluster: Cluster) -> None:
    prompt = long_prompt()
    r = await cluster.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=50, seed=2)
    assert r.choices[0].text == script_text(2)  # runs to EOS
    assert r.choices[0].finish_reason == "stop"
    ids = tokenizer().encode(prompt)
    (pre,) = cluster.prefills[0].requests
    assert pre.prompt_token_ids == ids and pre.sampling.n == 1 and pre.sampling.seed == 2 and pre.want_trace
    (dec,) = cluster.decodes[0].requests
    assert dec.prompt_token_ids == ids and dec.first_token_id == fake_first(2)
    assert dec.lease_id == f"lease-{pre.request_id}" and dec.block_keys and dec.sampling.max_tokens == 50
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(tokenizer().encode(script_text(2))) + 1  # + EOS


def fake_first(position: int) -> int:
    return tokenizer().encode(" The quick brown fox jumps")[position]


async def test_completion_stream_ends_with_done(cluster: Cluster) -> None:
    async with cluster.http() as http:
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "stream": True}
        async with http.post("/v1/completions", json=body) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == script_text(0, 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all("usage" not in c for c in chunks)  # only with include_usage


async def test_completion_stream_with_include_usage(cluster: Cluster) -> None:
    stream = await cluster.openai().completions.create(
        model=MODEL, prompt=long_prompt(), max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    *body, last = chunks
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6 and last.usage.prompt_tokens == len(tokenizer().encode(long_prompt()))
    assert "".join(c.choices[0].text for c in body) == script_text(0, 6)


async def test_batch_prompts_and_n_give_indexed_choices(cluster: Cluster) -> None:
    r = await cluster.openai().completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=3, seed=0)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    # prompt p, choice i -> index p*n + i; choice i uses seed + i (decode alone: no prefill)
    assert by_index == {0: script_text(0, 3), 1: script_text(1, 3), 2: script_text(0, 3), 3: script_text(1, 3)}
    assert r.usage is not None and r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 12


async def test_token_id_prompts(cluster: Cluster) -> None:
    tok = tokenizer()
    client = cluster.openai()
    one = await client.completions.create(model=MODEL, prompt=tok.encode("Hello there"), max_tokens=2)
    assert one.choices[0].text == script_text(0, 2)
    assert cluster.decodes[0].requests[-1].prompt_token_ids == tok.encode("Hello there")
    many = await client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, echo=True)
    texts = sorted(many.choices, key=lambda c: c.index)
    assert [c.text for c in texts] == [tok.decode([1, 2, 3]) + script_text(0, 2), tok.decode([4, 5]) + script_text(0, 2)]


async def test_echo_prepends_the_prompt(cluster: Cluster) -> None:
    client = cluster.openai()
    r = await client.completions.create(model=MODEL, prompt="Say:", max_tokens=3, echo=True)
    assert r.choices[0].text == "Say:" + script_text(0, 3)
    stream = await client.completions.create(model=MODEL, prompt="Say:", max_tokens=3, echo=True, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "Say:" + script_text(0, 3)


@pytest.mark.parametrize("prompt", ["Once", long_prompt()], ids=["decode-alone", "prefill"])
async def test_best_of_returns_the_n_best_by_cumulative_logprob(cluster: Cluster, prompt: str) -> None:
    # The fake model gives every token logprob -0.25, so a candidate's cumulative logprob is
    # -0.25 x its length; candidate i (seed 0 + i) starts at script position i and runs to
    # EOS, so the later it starts the shorter and better it is: 2, then 1, then 0.
    r = await cluster.openai().completions.create(model=MODEL, prompt=prompt, n=2, best_of=3, max_tokens=50, seed=0)
    assert [(c.index, c.text) for c in sorted(r.choices, key=lambda c: c.index)] == [(0, script_text(2)), (1, script_text(1))]
    assert all(c.logprobs is None for c in r.choices)  # ranked by logprobs the client did not ask for
    lengths = [len(tokenizer().encode(script_text(i))) + 1 for i in range(3)]  # + EOS
    assert r.usage is not None and r.usage.completion_tokens == sum(lengths)  # every candidate's tokens
    sent = cluster.decodes[0].requests + cluster.prefills[0].requests
    assert sent and all(req.sampling.logprobs == 0 for req in sent)
    if cluster.prefills[0].requests:
        assert cluster.prefills[0].requests[0].sampling.n == 3


async def test_best_of_with_logprobs_and_without_best_of(cluster: Cluster) -> None:
    client = cluster.openai()
    r = await client.completions.create(model=MODEL, prompt="Once", n=1, best_of=2, max_tokens=50, seed=3, logprobs=2)
    (choice,) = r.choices
    assert choice.index == 0 and choice.text == script_text(4)  # seeds 3, 4: start 4 is shorter
    assert choice.logprobs is not None and sum(choice.logprobs.token_logprobs) == -0.25 * len(choice.logprobs.tokens)
    assert cluster.decodes[0].requests[-1].sampling.logprobs == 2
    same = await client.completions.create(model=MODEL, prompt="Once", n=2, best_of=2, max_tokens=3, seed=0)
    assert [c.text for c in sorted(same.choices, key=lambda c: c.index)] == [script_text(0, 3), script_text(1, 3)]
    assert cluster.decodes[0].requests[-1].sampling.logprobs is None  # best_of == n ranks nothing


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [({"n": 3, "best_of": 2}, "greater than or equal"), ({"best_of": 2, "stream": True}, "cannot be streamed"), ({"best_of": 129}, "")],
)
async def test_best_of_refused(cluster: Cluster, extra: dict, fragment: str) -> None:
    async with cluster.http() as http:
        async with http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["param"] == "best_of" and fragment in error["message"]
    assert cluster.decodes[0].requests == []


def _check_scored_prompt(logprobs, prompt_ids: list[int], k: int, completion_tokens: int) -> None:
    """The fake model's scored prompt (token i from 1 at -i/10), then the completion's."""
    tok = tokenizer()
    texts = [tok.decode([t], skip_special_tokens=False) for t in prompt_ids]
    n = len(prompt_ids)
    assert logprobs.tokens[:n] == texts and len(logprobs.tokens) == n + completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:n] == pytest.approx([-(i + 1) / 10 for i in range(n - 1)])
    assert all(len(top) >= min(k, 1) and top[texts[i]] == logprobs.token_logprobs[i] for i, top in enumerate(logprobs.top_logprobs[1:n], 1))
    assert logprobs.token_logprobs[n:] == [-0.25] * completion_tokens  # the fake's sampled tokens
    offsets = [0]
    for t in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert logprobs.text_offset == offsets


@pytest.mark.parametrize("prompt", ["Say: hello there", long_prompt()], ids=["decode-alone", "prefill"])
async def test_echo_with_logprobs_scores_the_prompt(cluster: Cluster, prompt: str) -> None:
    ids = tokenizer().encode(prompt)
    r = await cluster.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2, n=2, seed=0)
    for c in r.choices:
        assert c.text == prompt + script_text(c.index, 3)
        _check_scored_prompt(c.logprobs, ids, 2, 3)
    prefill = cluster.prefills[0].requests
    decodes = cluster.decodes[0].requests
    if prefill:  # PD: prefill scores the prompt, decode only generates
        assert prefill[0].sampling.prompt_logprobs == 2 and all(d.sampling.prompt_logprobs is None for d in decodes)
    else:  # decode computes the prompt, so it scores it
        assert [d.sampling.prompt_logprobs for d in decodes] == [2, 2]
    stream = await cluster.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0, stream=True)
    chunks = [c async for c in stream]
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) >= len(ids) + 1  # the prompt and the first token together
    assert "".join(c.choices[0].text for c in chunks) == prompt + script_text(0, 3)


async def test_prompt_logprobs_fall_back_to_decode_when_prefill_fails(cluster: Cluster) -> None:
    cluster.prefills[0].status = 503
    ids = tokenizer().encode(long_prompt())
    r = await cluster.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=2, echo=True, logprobs=1)
    _check_scored_prompt(r.choices[0].logprobs, ids, 1, 2)
    (dec,) = cluster.decodes[0].requests
    assert dec.first_token_id is None and dec.sampling.prompt_logprobs == 1


# --- chat ---------------------------------------------------------------------------------


async def test_chat_non_streaming(cluster: Cluster) -> None:
    r = await cluster.openai().chat.completions.create(model=MODEL, messages=CHAT, seed=1)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == script_text(1)
    assert choice.finish_reason == "stop" and choice.logprobs is None
    prompt_ids = tokenizer().encode_chat(CHAT)
    assert cluster.decodes[0].requests[0].prompt_token_ids == prompt_ids
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt_ids)
    # chat's default max_tokens is the rest of the context
    assert cluster.decodes[0].requests[0].sampling.max_tokens == 2048 - len(prompt_ids)


async def test_chat_streaming_role_first_then_content_then_usage(cluster: Cluster) -> None:
    stream = await cluster.openai().chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, max_completion_tokens=7, stream_options={"include_usage": True}  # type: ignore[arg-type]
    )
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == script_text(0, 7)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
    assert cluster.decodes[0].requests[0].sampling.max_tokens == 7


async def test_chat_n_with_prefill_fans_out_one_decode_per_choice(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": long_prompt()}]
    r = await cluster.openai().chat.completions.create(model=MODEL, messages=messages, n=3, seed=0, max_tokens=4)  # type: ignore[arg-type]
    assert {c.index: c.message.content for c in r.choices} == {i: script_text(i, 4) for i in range(3)}
    (pre,) = cluster.prefills[0].requests
    assert pre.sampling.n == 3
    decs = sorted(cluster.decodes[0].requests, key=lambda d: d.request_id)
    assert [d.first_token_id for d in decs] == [fake_first(i) for i in range(3)]
    assert [d.sampling.n for d in decs] == [1, 1, 1]
    assert [d.sampling.seed for d in decs] == [0, 1, 2]  # seed passed through, + i per choice
    assert len({d.request_id for d in decs}) == 3
    assert r.usage is not None and r.usage.completion_tokens == 12


# --- stop strings, sampling fields, logprobs ---------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_split_across_tokens_cuts_and_aborts_decode(cluster: Cluster, stream: bool) -> None:
    client = cluster.openai()
    kwargs = dict(model=MODEL, prompt="Once", max_tokens=15, stop=["x ju", "never"])
    decode = cluster.decodes[0]
    decode.event_delay_s = 0.02  # decode is still generating when the stop string matches
    if stream:
        s = await client.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
        chunks = [c async for c in s]
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = await client.completions.create(**kwargs)  # type: ignore[call-overload]
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == " The quick brown fo" and finish == "stop"  # " fox" + " jumps" hold "x ju"
    (req,) = decode.requests
    from tests.router_harness import eventually

    await eventually(lambda: req.request_id in decode.aborts, what="AbortRequest at decode")
    await eventually(lambda: req.request_id in decode.disconnected, what="decode stream closed")


async def test_stop_token_ids_and_vllm_extras_reach_decode(cluster: Cluster) -> None:
    stop_id = fake_first(3)  # " fox"
    r = await cluster.openai().completions.create(
        model=MODEL,
        prompt="Once",
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=1234567,
        user="someone",
        extra_body={
            "stop_token_ids": [stop_id],
            "top_k": 0,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 2,
        },
    )
    s = cluster.decodes[0].requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, -1, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (s.seed, s.stop_token_ids, s.ignore_eos, s.min_tokens, s.n) == (1234567, [stop_id], True, 2, 1)
    assert r.choices[0].finish_reason == "stop"
    start = 1234567 % 5
    assert r.choices[0].text == script_text(start, 4 - start)  # up to and including " fox"


async def test_completion_logprobs_shape(cluster: Cluster) -> None:
    r = await cluster.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text == script_text(0, 4)
    assert lp.token_logprobs == [-0.25] * 4
    assert lp.text_offset == [0, 4, 10, 16]
    assert all(len(top) == 2 and top[tok] == -0.25 for top, tok in zip(lp.top_logprobs, lp.tokens))
    assert cluster.prefills[0].requests[0].sampling.logprobs == 2
    assert cluster.decodes[0].requests[0].first_logprobs is not None  # prefill's, handed over


async def test_chat_logprobs_shape_streaming_and_not(cluster: Cluster) -> None:
    client = cluster.openai()
    r = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=3)  # type: ignore[arg-type]
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [c.token for c in content] == [" The", " quick", " brown"]
    assert content[0].bytes == list(b" The") and content[0].logprob == -0.25
    assert [len(c.top_logprobs) for c in content] == [3, 3, 3]
    assert content[0].top_logprobs[1].logprob == -1.25
    s = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, stream=True)  # type: ignore[arg-type]
    entries = [e for c in [c async for c in s] if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in entries] == [" The", " quick", " brown"] and all(e.top_logprobs == [] for e in entries)


async def test_usage_reports_cached_tokens(cluster: Cluster) -> None:
    cluster.prefills[0].cached_tokens = 16
    r = await cluster.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == 16


# --- models, auth, errors ------------------------------------------------------------------------


async def test_models_lists_the_served_model(cluster: Cluster) -> None:
    models = await cluster.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "tidepool"


async def test_api_key_is_required_when_configured() -> None:
    c = await start_cluster(api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError) as exc:
            await c.openai(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await c.openai(api_key="wrong").models.list()
        ok = await c.openai(api_key="sekret").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert ok.choices[0].text == script_text(0, 1)
        async with c.http() as http:
            async with http.get("/v1/workers") as resp:
                assert resp.status == 401
            async with http.get("/health") as resp:
                assert resp.status == 200  # operations are not behind the key
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),  # prompt + max_tokens > max_model_len
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {str(10**9): 1}}, "logit_bias"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"grammar": 'root ::= "a" | nope'}, "grammar"),
    ],
)
async def test_out_of_range_values_are_400(cluster: Cluster, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        await cluster.openai().completions.create(model=MODEL, prompt="x", max_tokens=extra.pop("max_tokens", 4), extra_body=extra)
    assert exc.value.status_code == 400 and exc.value.param == param
    assert exc.value.type == "invalid_request_error"
    assert cluster.decodes[0].requests == []  # nothing went downstream


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "json_schema": {"type": "object"}}, "json_schema"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ],
)
async def test_chat_bad_fields_are_400(cluster: Cluster, extra: dict, param: str) -> None:
    body = {"messages": CHAT, **extra}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as exc:
        await cluster.openai().chat.completions.create(model=MODEL, messages=messages, extra_body=body)  # type: ignore[arg-type]
    assert exc.value.param == param


async def test_prompt_over_the_context_is_400(cluster: Cluster) -> None:
    ids = list(range(100, 100 + 2048))
    with pytest.raises(openai.BadRequestError) as exc:
        await cluster.openai().completions.create(model=MODEL, prompt=ids, max_tokens=1)
    assert exc.value.code == "context_length_exceeded" and "2048" in exc.value.message
    r = await cluster.openai().completions.create(model=MODEL, prompt=ids[:-1])  # default max_tokens fits
    assert r.usage is not None and r.usage.completion_tokens == 1


async def test_unknown_model_is_404(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        await cluster.openai().chat.completions.create(model="gpt-4", messages=CHAT)  # type: ignore[arg-type]
    assert exc.value.status_code == 404 and exc.value.code == "model_not_found" and exc.value.param == "model"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "x", "n": 2.5}', "n"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "x", "temperature": true}', "temperature"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
        (b'{"prompt": "x", "stop": 5}', "stop"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
        (b'{"prompt": 5}', "prompt"),
        (b'{"prompt": ["a", 1]}', "prompt"),
        (b'{"prompt": [[1], [-1]]}', "prompt[1]"),
        (b'{"prompt": ""}', "prompt"),
        (b'{}', "prompt"),
        (b'{"prompt": "x", "model": 7}', "model"),
        (b'{"prompt": "x", "tidepool": {"trace": "yes"}}', "tidepool.trace"),
        (b'\xff\xfe', None),
    ],
)
async def test_malformed_bodies_are_400_and_the_router_stays_up(cluster: Cluster, body: bytes, param: str | None) -> None:
    async with cluster.http() as http:
        async with http.post("/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    r = await cluster.openai().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert r.choices[0].text == script_text(0, 1)


async def test_no_decode_instance_is_503() -> None:
    c = await start_cluster(decodes=0, retry_wait_s=0.3)
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            await c.openai().completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert exc.value.status_code == 503 and exc.value.code == "no_decode_instance"
        assert c.prefills[0].requests == []
    finally:
        await c.close()


async def test_a_request_waits_for_a_decode_instance_to_register() -> None:
    """A router that just restarted knows no decode until its next heartbeat: the request waits."""
    c = await start_cluster(decodes=0, retry_wait_s=5.0)
    try:
        pending = asyncio.create_task(c.openai().completions.create(model=MODEL, prompt="x", max_tokens=1))
        await asyncio.sleep(0.5)
        assert not pending.done()
        await c.add_decode()
        r = await asyncio.wait_for(pending, 5.0)
        assert r.choices[0].text == script_text(0, 1)
    finally:
        await c.close()
