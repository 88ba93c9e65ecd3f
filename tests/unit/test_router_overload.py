"""Overload: bounded queues in the router (admission, the prepare executor) and at each
instance (a 429 the router routes around), a 429 with Retry-After past them, and no
request waiting forever."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import AsyncIterator

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from services.router.admission import Admission
from services.router.errors import ApiError
from services.router.executor import BoundedExecutor
from services.worker.app import full
from tests.router_harness import MODEL, Cluster, eventually, long_prompt, script_text, start_cluster

# --- admission --------------------------------------------------------------------------------------


async def test_admission_queues_then_refuses_with_429() -> None:
    adm = Admission(max_running=1, max_waiting=1, wait_timeout_s=5, retry_after_s=3)
    first = adm.slot()
    await first.__aenter__()
    second = asyncio.create_task(_hold(adm, 0))
    await eventually(lambda: adm.waiting == 1)
    with pytest.raises(ApiError) as exc:
        async with adm.slot():
            pass
    assert exc.value.status == 429 and exc.value.code == "queue_full" and exc.value.headers == {"Retry-After": "3"}
    await first.__aexit__(None, None, None)
    await second  # got the slot handed over
    assert (adm.running, adm.waiting) == (0, 0)


async def _hold(adm: Admission, seconds: float) -> None:
    async with adm.slot():
        await asyncio.sleep(seconds)


async def test_admission_wait_is_bounded() -> None:
    adm = Admission(max_running=1, max_waiting=4, wait_timeout_s=0.2, retry_after_s=1)
    holder = asyncio.create_task(_hold(adm, 10))
    await eventually(lambda: adm.running == 1)
    started = time.monotonic()
    with pytest.raises(ApiError) as exc:
        await _hold(adm, 0)
    assert exc.value.status == 429 and exc.value.code == "queue_timeout"
    assert 0.15 < time.monotonic() - started < 2
    assert adm.waiting == 0
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    assert adm.running == 0


async def test_admission_cancelled_waiters_leak_no_slot() -> None:
    adm = Admission(max_running=1, max_waiting=8, wait_timeout_s=5, retry_after_s=1)
    holder = asyncio.create_task(_hold(adm, 10))
    await eventually(lambda: adm.running == 1)
    waiters = [asyncio.create_task(_hold(adm, 0)) for _ in range(5)]
    await eventually(lambda: adm.waiting == 5)
    for w in waiters[:3]:
        w.cancel()
    holder.cancel()  # its slot goes to the first waiter still there
    await asyncio.gather(holder, *waiters, return_exceptions=True)
    assert (adm.running, adm.waiting) == (0, 0)
    async with adm.slot():
        assert adm.running == 1


# --- the prepare executor -----------------------------------------------------------------------------


async def test_executor_backlog_is_bounded() -> None:
    ex = BoundedExecutor(workers=1, max_pending=2, retry_after_s=2)
    gate = threading.Event()
    try:
        running = asyncio.create_task(ex.run(gate.wait))
        queued = asyncio.create_task(ex.run(lambda: 7))
        await eventually(lambda: ex.pending == 2)
        with pytest.raises(ApiError) as exc:
            await ex.run(lambda: 0)
        assert exc.value.status == 429 and exc.value.code == "router_busy" and exc.value.headers["Retry-After"] == "2"
        queued.cancel()  # not started: cancelled, and its place is free again
        await asyncio.gather(queued, return_exceptions=True)
        await eventually(lambda: ex.pending == 1)
        gate.set()
        assert await running is True
        assert await ex.run(lambda: 5) == 5
        await eventually(lambda: ex.pending == 0)
    finally:
        gate.set()
        ex.shutdown()


# --- the router --------------------------------------------------------------------------------------


@pytest.fixture
async def slow_cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster(max_running_requests=1, max_waiting_requests=1, queue_timeout_s=0.5, retry_after_s=2)
    c.decodes[0].event_delay_s = 0.05
    yield c
    await c.close()


async def test_router_full_answers_429_with_retry_after(slow_cluster: Cluster) -> None:
    c = slow_cluster
    client = c.openai()
    first = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", max_tokens=40))  # ~2 s
    await eventually(lambda: c.state.admission.running == 1)
    second = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", max_tokens=1))  # waits...
    await eventually(lambda: c.state.admission.waiting == 1)
    async with aiohttp.ClientSession() as http, http.post(c.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as resp:
        assert resp.status == 429 and resp.headers["Retry-After"] == "2"  # the queue is full
        assert (await resp.json())["error"]["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError) as exc:
        await second  # ... and gives up after queue_timeout_s
    assert exc.value.code == "queue_timeout" and exc.value.response.headers["Retry-After"] == "2"
    assert (await first).choices[0].text == script_text(0, 40)
    ok = await client.completions.create(model=MODEL, prompt="x", max_tokens=1)  # room again
    assert ok.choices[0].text == script_text(0, 1)
    metrics = await c.metrics()
    assert metrics['tidepool_router_overloaded_total{reason="queue_full"}'] == 1
    assert metrics['tidepool_router_overloaded_total{reason="queue_timeout"}'] == 1
    assert metrics["tidepool_router_slots_running"] == 0


async def test_a_full_decode_is_routed_around() -> None:
    c = await start_cluster(decodes=2)
    try:
        busy, free = c.decodes
        busy.status = 429
        await busy.stop_heartbeats()  # its full mark stays until it beats again
        free.running = 3  # busy looks idler, so it is tried first
        await free.heartbeat(c.url)
        r = await c.openai().completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert r.choices[0].text == script_text(0, 3)
        assert len(busy.requests) == 1 and len(free.requests) == 1
        workers = {w["id"]: w for w in (await c.openai().get("/workers", cast_to=object))["data"]}  # type: ignore[index]
        assert workers[busy.instance_id]["full"] and not workers[free.instance_id]["full"]
        r = await c.openai().completions.create(model=MODEL, prompt="x", max_tokens=3)  # full: ranked last
        assert len(busy.requests) == 1 and len(free.requests) == 2
        await busy.heartbeat(c.url)
        workers = {w["id"]: w for w in (await c.openai().get("/workers", cast_to=object))["data"]}  # type: ignore[index]
        assert not workers[busy.instance_id]["full"]
        assert (await c.metrics())['tidepool_router_instance_full_total{role="decode"}'] == 1
    finally:
        await c.close()


async def test_every_decode_full_is_429_after_the_queue_timeout_then_recovers() -> None:
    c = await start_cluster(queue_timeout_s=1.0, retry_after_s=3)
    try:
        c.decodes[0].status = 429
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as exc:
            await c.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert exc.value.code == "instances_full" and exc.value.response.headers["Retry-After"] == "3"
        assert 0.9 < time.monotonic() - started < 5
        tries = len(c.decodes[0].requests)
        assert 2 <= tries < 30  # retried as heartbeats cleared the mark, not in a busy loop
        c.decodes[0].status = None
        r = await c.openai().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert r.choices[0].text == script_text(0, 2)
    finally:
        await c.close()


async def test_a_decode_that_frees_up_serves_the_waiting_request() -> None:
    c = await start_cluster(queue_timeout_s=10.0)
    try:
        c.decodes[0].status = 429
        task = asyncio.create_task(c.openai().completions.create(model=MODEL, prompt="x", max_tokens=2))
        await eventually(lambda: len(c.decodes[0].requests) >= 2, timeout=5)
        c.decodes[0].status = None
        r = await asyncio.wait_for(task, 5)
        assert r.choices[0].text == script_text(0, 2)
    finally:
        await c.close()


async def test_a_full_prefill_costs_only_the_handoff() -> None:
    c = await start_cluster()
    try:
        c.prefills[0].status = 429
        await c.prefills[0].stop_heartbeats()  # no heartbeat clears its full mark (it stays live 2 s)
        client = c.openai()
        r = await client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3, extra_body={"tidepool": {"trace": True}})
        assert r.choices[0].text == script_text(0, 3)
        assert (await c.metrics())['tidepool_router_instance_full_total{role="prefill"}'] == 1
        assert c.decodes[0].requests[-1].first_token_id is None  # decode computed the prompt
        await client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3)
        assert len(c.prefills[0].requests) == 1  # not tried again while full
    finally:
        await c.close()


# --- an instance's own bound ---------------------------------------------------------------------------


def _runtime(registry: CollectorRegistry) -> SimpleNamespace:
    return SimpleNamespace(
        settings=SimpleNamespace(max_queue_depth=2, retry_after_s=4),
        in_flight=1,
        role="decode",
        instance_id="decode-x",
        metrics=SimpleNamespace(requests=Counter("r", "r", ["outcome"], registry=registry)),
    )


def test_an_instance_at_its_queue_bound_answers_429() -> None:
    registry = CollectorRegistry()
    rt = _runtime(registry)
    assert full(rt) is None  # type: ignore[arg-type]
    rt.in_flight = 2
    resp = full(rt)  # type: ignore[arg-type]
    assert resp is not None and resp.status == 429 and resp.headers["Retry-After"] == "4"
    assert registry.get_sample_value("r_total", {"outcome": "full"}) == 1


async def test_openai_client_retries_a_429_after_retry_after() -> None:
    """The official client honours Retry-After: with its retries on, a 429 costs latency."""
    c = await start_cluster(max_running_requests=1, max_waiting_requests=0, retry_after_s=1)
    try:
        c.decodes[0].event_delay_s = 0.05
        first = asyncio.create_task(c.openai().completions.create(model=MODEL, prompt="x", max_tokens=10))
        await eventually(lambda: c.state.admission.running == 1)
        client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="x", max_retries=3, timeout=20)
        started = time.monotonic()
        try:
            r = await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        finally:
            await client.close()
        assert r.choices[0].text == script_text(0, 1)
        assert time.monotonic() - started >= 0.9  # waited as told
        assert (await c.metrics())['tidepool_router_overloaded_total{reason="queue_full"}'] >= 1
        await first
    finally:
        await c.close()


@pytest.mark.parametrize("path", ["/v1/prefill", "/v1/decode"])
async def test_prefill_and_decode_check_their_bound_first(path: str) -> None:
    """The handlers ask ``full`` before reading anything (a stand-in runtime at its bound)."""
    from aiohttp import web

    from services.decode.app import handle_decode
    from services.prefill.app import handle_prefill
    from services.worker.app import RUNTIME

    rt = _runtime(CollectorRegistry())
    rt.in_flight = 2
    app = web.Application()
    app[RUNTIME] = rt  # type: ignore[assignment]
    app.router.add_post("/v1/prefill", handle_prefill)
    app.router.add_post("/v1/decode", handle_decode)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as http, http.post(f"http://{host}:{port}{path}", data=b"\x80") as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "4"
            assert (await resp.json())["error"]["code"] == "instance_full"
    finally:
        await runner.cleanup()
