"""services/router: faults cost latency, never a request; clients that leave abort downstream."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp
import openai
import pytest

from tests.router_harness import MODEL, Cluster, eventually, long_prompt, script_text, start_cluster, tokenizer


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster(prefills=1, decodes=2)
    yield c
    await c.close()


FULL = script_text(0)


async def complete(c: Cluster, stream: bool, **kwargs: object) -> tuple[str, str | None]:
    """(text, finish_reason) of a one-choice completion, streamed or not."""
    client = c.openai()
    args = dict(model=MODEL, prompt=long_prompt(), max_tokens=40, **kwargs)
    if not stream:
        r = await client.completions.create(**args)  # type: ignore[call-overload]
        return r.choices[0].text, r.choices[0].finish_reason
    chunks = [ch async for ch in await client.completions.create(stream=True, **args)]  # type: ignore[call-overload]
    return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason


# --- prefill faults: decode serves the whole request --------------------------------------------------


@pytest.mark.parametrize("fault", ["status_503", "killed", "timeout"])
async def test_prefill_failure_falls_back_to_decode_alone(fault: str) -> None:
    c = await start_cluster(prefills=1, decodes=1, prefill_timeout_s=0.3)
    try:
        prefill = c.prefills[0]
        await prefill.stop_heartbeats()  # so it cannot report back between the two requests
        if fault == "status_503":
            prefill.status = 503
        elif fault == "timeout":
            prefill.hang = True
        else:
            await prefill.kill()  # still registered: its heartbeats stop, the router finds out by calling
        text, finish = await complete(c, stream=False)
        assert (text, finish) == (FULL, "stop")
        (dec,) = c.decodes[0].requests
        assert dec.first_token_id is None and dec.lease_id is None
        assert dec.prompt_token_ids == tokenizer().encode(long_prompt())
        if fault == "timeout":  # prefill may still be working on it
            await eventually(lambda: dec.request_id in prefill.aborts, what="AbortRequest at prefill")
        # no new heartbeat since: the failed prefill is skipped without another try
        await complete(c, stream=False)
        assert len(prefill.requests) == (0 if fault == "killed" else 1)
    finally:
        await c.close()


async def test_an_overloaded_prefill_is_used_again_after_its_next_heartbeat(cluster: Cluster) -> None:
    prefill = cluster.prefills[0]
    await prefill.stop_heartbeats()
    prefill.status = 503
    await complete(cluster, stream=False)
    prefill.status = None
    await complete(cluster, stream=False)
    assert len(prefill.requests) == 1  # unusable until it reports again
    assert await prefill.heartbeat(cluster.url) == 200
    await complete(cluster, stream=False)
    assert len(prefill.requests) == 2


# --- decode faults: resumed elsewhere, same text -------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_killed_mid_stream_is_resumed_on_another_instance(cluster: Cluster, stream: bool) -> None:
    first, second = cluster.decodes
    first.running, second.running = 0, 3  # the first is picked first
    for d in cluster.decodes:
        await d.heartbeat(cluster.url)
        d.event_delay_s = 0.01
    first.die_after = 4  # four events (tokens), then the connection is cut
    text, finish = await complete(cluster, stream=stream, seed=0)
    assert (text, finish) == (FULL, "stop")
    (broken,) = first.requests
    (resumed,) = second.requests
    prompt = tokenizer().encode(long_prompt())
    script = tokenizer().encode(FULL)
    # prefill gave token 0; decode streamed tokens 1..4 before dying
    assert broken.first_token_id == script[0] and broken.prompt_token_ids == prompt
    assert resumed.prompt_token_ids == prompt + script[:4]
    assert resumed.first_token_id == script[4]
    assert resumed.sampling.max_tokens == 40 - 4 and resumed.sampling.seed == 0
    assert resumed.request_id == broken.request_id + ".r1" and resumed.lease_id is None
    assert all(":partial:" not in k for k in resumed.block_keys)
    metrics = await cluster.metrics()
    assert metrics['tidepool_router_decode_resumptions_total{reason="truncated"}'] == 1


async def test_decode_killed_with_no_other_instance_resumes_after_it_registers_again() -> None:
    c = await start_cluster(prefills=0, decodes=1, retry_wait_s=5.0)
    try:
        old = c.decodes[0]
        old.die_after = 3
        old.event_delay_s = 0.01
        task = asyncio.create_task(complete(c, stream=True, seed=3))
        await eventually(lambda: old.instance_id in c.state.registry.instances and _unusable(c, old.instance_id), what="decode marked unusable")
        await old.kill()
        restarted = await c.add_decode(old.instance_id)  # same id, new port: a restart
        text, finish = await task
        assert (text, finish) == (script_text(3), "stop")
        (resumed,) = restarted.requests
        assert resumed.first_token_id is not None and resumed.request_id.endswith(".r1")
    finally:
        await c.close()


def _unusable(c: Cluster, instance_id: str) -> bool:
    return c.state.registry.instances[instance_id].unusable is not None


async def test_decode_503_goes_to_another_instance(cluster: Cluster) -> None:
    busy, other = cluster.decodes
    other.running = 2
    await other.heartbeat(cluster.url)
    busy.status = 503
    text, _ = await complete(cluster, stream=False)
    assert text == FULL
    assert len(busy.requests) == 1 and len(other.requests) == 1
    assert other.requests[0].request_id.endswith(".r1")


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_failing_everywhere_is_an_error_not_a_hang(stream: bool) -> None:
    c = await start_cluster(prefills=0, decodes=2, decode_retries=1, retry_wait_s=0.2)
    try:
        for d in c.decodes:
            d.die_after = 2
        with pytest.raises(openai.APIError) as exc:
            await complete(c, stream=stream)
        if not stream:
            assert isinstance(exc.value, openai.InternalServerError) and exc.value.status_code == 503
        assert "decode failed 2 times" in exc.value.message
        assert sum(len(d.requests) for d in c.decodes) == 2
    finally:
        await c.close()


async def test_decode_refusing_the_request_is_not_retried(cluster: Cluster) -> None:
    for d in cluster.decodes:
        d.status = 400
    with pytest.raises(openai.InternalServerError) as exc:
        await complete(cluster, stream=False)
    assert exc.value.status_code == 502 and "fake decode says 400" in exc.value.message
    assert sum(len(d.requests) for d in cluster.decodes) == 1


# --- the client goes away ------------------------------------------------------------------------------


async def test_client_disconnect_mid_stream_aborts_decode(cluster: Cluster) -> None:
    decode = cluster.decodes[0]
    cluster.decodes[1].running = 9
    await cluster.decodes[1].heartbeat(cluster.url)
    decode.event_delay_s = 0.05
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
        async with http.post(cluster.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # one chunk, then hang up
            (req,) = decode.requests
    await eventually(lambda: req.request_id in decode.aborts, what="AbortRequest at decode")
    await eventually(lambda: req.request_id in decode.disconnected, what="decode stream closed")
    assert decode.active == set()
    metrics = await cluster.metrics()
    assert metrics['tidepool_router_aborts_total{reason="client_disconnect"}'] == 1
    assert metrics['tidepool_router_requests_total{endpoint="completions",outcome="client_disconnect"}'] == 1


async def test_client_disconnect_during_prefill_aborts_prefill(cluster: Cluster) -> None:
    prefill = cluster.prefills[0]
    prefill.delay_s = 5.0
    with pytest.raises(openai.APITimeoutError):
        await cluster.openai(timeout=0.5).completions.create(model=MODEL, prompt=long_prompt(), max_tokens=5)
    (req,) = prefill.requests
    await eventually(lambda: req.request_id in prefill.aborts, what="AbortRequest at prefill")
    await asyncio.sleep(0.1)
    assert all(d.requests == [] for d in cluster.decodes)  # nothing more was started


async def test_client_disconnect_aborts_every_choice(cluster: Cluster) -> None:
    for d in cluster.decodes:
        d.event_delay_s = 0.05
    with pytest.raises(openai.APITimeoutError):
        await cluster.openai(timeout=0.4).completions.create(model=MODEL, prompt=long_prompt(), n=3, max_tokens=200)
    started = [r.request_id for d in cluster.decodes for r in d.requests]
    assert len(started) == 3
    await eventually(
        lambda: sorted(a for d in cluster.decodes for a in d.aborts) == sorted(started), what="an abort per choice"
    )
