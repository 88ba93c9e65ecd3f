"""services/router: the streamed handoff against fake instances — progress forwarded to
decode, the first token at prefill's result, and every fault on the way costing latency,
never the request or its text."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.router_harness import MODEL, Cluster, eventually, long_prompt, script_text, start_cluster

FULL = script_text(0)


async def streamed_cluster(**settings: object) -> Cluster:
    c = await start_cluster(prefills=1, decodes=2, **settings)
    c.prefills[0].streams = True
    return c


async def complete(c: Cluster, **kwargs: object):
    args = dict(model=MODEL, prompt=long_prompt(), max_tokens=40, extra_body={"tidepool": {"trace": True}})
    args.update(kwargs)
    return await c.openai().completions.create(**args)  # type: ignore[call-overload]


def attempts(resp) -> list[dict]:
    return resp.model_extra["tidepool"]["trace"]["prompts"][0]["choices"][0]["attempts"]


async def handoff_run(c: Cluster):
    """One completion through a streamed handoff: the response, decode's one request, the
    updates it got, and ``delta(kind)`` of the router's forwarded-updates counter."""
    before = await c.metrics()
    resp = await complete(c)
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (FULL, "stop")
    (dec,) = [d for d in c.decodes if d.requests]
    (req,) = dec.requests
    after = await c.metrics()
    name = 'tidepool_router_handoff_updates_total{{kind="{}"}}'.format
    return resp, req, dec.updates[req.request_id], lambda kind: after.get(name(kind), 0) - before.get(name(kind), 0)


def the_decode(c: Cluster):
    (dec,) = [d for d in c.decodes if d.requests]
    return dec


async def test_progress_reaches_decode_before_the_first_token_and_the_text_is_intact() -> None:
    c = await streamed_cluster()
    try:
        resp, req, updates, delta = await handoff_run(c)
        assert req.await_handoff and req.first_token_id is None and req.lease_id is None
        durable = [u.durable_blocks for u in updates]
        assert durable == sorted(durable) and len(durable) >= 3  # several progress steps, in order
        assert [u.done for u in updates] == [False] * (len(updates) - 1) + [True]
        last = updates[-1]
        assert last.first_token_id == c.prefills[0].model.start(None) and last.durable_blocks == durable[-1]
        assert all(u.lease_id == "lease-" + req.request_id for u in updates)
        (a,) = attempts(resp)
        assert a["streamed"] and a["with_first_token"] and a["handoff_updates"] == len(updates)
        assert a["tokens_before"] == 0 and a["tokens"] == resp.usage.completion_tokens - 1  # the first came from prefill
        assert (delta("progress"), delta("final"), delta("failed")) == (len(updates) - 1, 1, 0)
    finally:
        await c.close()


async def test_a_prefill_that_does_not_stream_takes_the_classic_path() -> None:
    c = await streamed_cluster()
    c.prefills[0].streams = False  # answers with its result only
    try:
        resp = await complete(c)
        assert resp.choices[0].text == FULL
        (req,) = the_decode(c).requests
        assert not req.await_handoff and req.first_token_id is not None
        assert not attempts(resp)[0]["streamed"]
    finally:
        await c.close()


async def test_stream_handoff_off_per_request() -> None:
    c = await streamed_cluster()
    try:
        resp = await complete(c, extra_body={"tidepool": {"trace": True, "stream_handoff": False}})
        assert resp.choices[0].text == FULL
        assert not c.prefills[0].requests[0].stream_progress
        assert not the_decode(c).requests[0].await_handoff
    finally:
        await c.close()


async def test_prefill_dying_mid_stream_lets_decode_compute_the_rest() -> None:
    c = await streamed_cluster()
    c.prefills[0].die_mid_stream = True
    try:
        resp, req, updates, delta = await handoff_run(c)
        last = updates[-1]
        assert last.done and last.first_token_id is None and last.error  # decode samples the first token itself
        assert 0 < last.durable_blocks  # what prefill made durable before it died is still offered
        trace = resp.model_extra["tidepool"]["trace"]
        assert trace["prompts"][0]["prefill"]["decision"] == "prefill_failed"
        (a,) = attempts(resp)
        assert a["streamed"] and not a["with_first_token"] and a["tokens"] == resp.usage.completion_tokens
        assert (delta("final"), delta("failed")) == (0, 1)
    finally:
        await c.close()


async def test_the_first_token_reaches_the_client_before_prefill_ends() -> None:
    """Prefill sends its first token in a progress event; its result (after its last writes)
    is held back until the client has streamed that token."""
    c = await streamed_cluster()
    pre = c.prefills[0]
    pre.first_at_step, pre.release = 1, asyncio.Event()
    try:
        stream = await c.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=40, stream=True)
        chunks = stream.__aiter__()
        first = await asyncio.wait_for(chunks.__anext__(), 5)  # the result is held: only the progress can bring it
        assert first.choices[0].text == script_text(0, 1) and not pre.release.is_set()
        updates = the_decode(c).updates[pre.requests[0].request_id]
        assert updates and not any(u.done for u in updates)  # decode still waits for the handoff
        pre.release.set()
        rest = [ch.choices[0].text async for ch in chunks if ch.choices]
        assert first.choices[0].text + "".join(rest) == FULL
        (last,) = [u for u in updates if u.done]
        assert last.first_token_id == pre.model.start(None) and last.error is None
    finally:
        await c.close()


async def test_prefill_dying_after_its_first_token_keeps_that_token() -> None:
    """The client has the first token already: decode continues from it, computing the
    prompt's tail, and the text neither repeats nor loses a token."""
    c = await streamed_cluster()
    pre = c.prefills[0]
    pre.first_at_step, pre.die_mid_stream = 1, True
    try:
        resp, req, updates, delta = await handoff_run(c)
        last = updates[-1]
        assert last.done and last.error and last.first_token_id == pre.model.start(None)
        assert 0 < last.durable_blocks
        assert resp_prefill(resp)["decision"] == "prefill_failed"
        (a,) = attempts(resp)
        assert a["streamed"] and a["with_first_token"] and a["tokens"] == resp.usage.completion_tokens - 1
        assert (delta("final"), delta("failed")) == (0, 1)
    finally:
        await c.close()


async def test_a_first_token_out_of_the_vocabulary_fails_prefill_not_the_request() -> None:
    c = await streamed_cluster()
    pre = c.prefills[0]
    pre.first_at_step = 1
    real = pre._result
    pre._result = lambda req: dataclasses.replace(real(req), first_token_ids=[10**6])  # type: ignore[method-assign]
    try:
        resp, req, updates, delta = await handoff_run(c)
        assert resp_prefill(resp)["decision"] == "prefill_failed"
        assert updates[-1].first_token_id is None and updates[-1].error == "protocol"
    finally:
        await c.close()


def resp_prefill(resp) -> dict:
    return resp.model_extra["tidepool"]["trace"]["prompts"][0]["prefill"]


async def test_decode_dying_while_it_waits_for_the_handoff_resumes_elsewhere() -> None:
    c = await streamed_cluster()
    c.prefills[0].progress_delay_s = 0.1
    try:
        picked, other = c.decodes  # equal instances: the first is picked first (placement.py)
        picked.die_awaiting_handoff = True
        resp = await complete(c)
        assert (resp.choices[0].text, resp.choices[0].finish_reason) == (FULL, "stop")
        tries = attempts(resp)
        assert [t["instance"] for t in tries] == [picked.instance_id, other.instance_id]
        assert tries[0]["outcome"] == "truncated" and tries[0]["streamed"]
        assert picked.updates and len(other.requests) == 1
    finally:
        await c.close()


@pytest.mark.parametrize("n", [1, 2])
async def test_a_stop_string_on_the_first_token_aborts_the_waiting_decode(n: int) -> None:
    c = await streamed_cluster()
    c.prefills[0].progress_delay_s = 0.05
    try:
        stops = [script_text(i, 1) for i in range(n)]  # each choice's first token (seed 0: choice i starts at i)
        resp = await complete(c, stop=stops, n=n, seed=0)
        assert all(ch.finish_reason == "stop" and ch.text == "" for ch in resp.choices)
        started = [r.request_id for d in c.decodes for r in d.requests]
        assert len(started) == n and all(r.await_handoff for d in c.decodes for r in d.requests)
        aborted = lambda: {rid for d in c.decodes for rid in d.aborts}  # noqa: E731
        await eventually(lambda: set(started) <= aborted(), what="AbortRequest at every waiting decode")
    finally:
        await c.close()
