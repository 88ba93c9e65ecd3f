"""services/router: the handoff trace (log line, response extension) and every metric, each
checked against a known workload so that none can sit at zero unnoticed."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

import openai
import pytest

from tests.router_harness import MODEL, Cluster, eventually, long_prompt, script_text, start_cluster, tokenizer


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster(prefills=1, decodes=2)
    yield c
    await c.close()


TRACE = {"tidepool": {"trace": True}}


async def test_trace_is_returned_only_when_asked(cluster: Cluster) -> None:
    client = cluster.openai()
    plain = await client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3)
    assert "tidepool" not in plain.model_dump()
    r = await client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3, extra_body=TRACE)
    trace = r.model_dump()["tidepool"]["trace"]
    assert trace["request_id"] == r.id.removeprefix("cmpl-") and trace["endpoint"] == "completions"
    router = trace["router"]
    assert 0 < router["tokenize_s"] <= router["ttft_s"] <= router["total_s"]
    (prompt,) = trace["prompts"]
    n_keys = len(cluster.prefills[0].requests[-1].prompt_token_ids) // 16 + 1
    pre = prompt["prefill"]
    assert pre["decision"] == "prefill" and pre["instance"] == "prefill-0"
    assert pre["bytes_written"] == 1000 * n_keys and pre["blocks_written"] == n_keys
    assert pre["timings"] == {"queue_s": 0.001, "compute_s": 0.01, "write_s": 0.004}
    assert pre["worker"]["pool_miss_reasons"] == {"absent": 2}
    (choice,) = prompt["choices"]
    (attempt,) = choice["attempts"]
    assert attempt["outcome"] == "length" and attempt["with_first_token"] and attempt["tokens"] == 2
    assert attempt["worker"]["pool_hit_blocks"] == n_keys - 1  # the fake loads every full block
    totals = trace["totals"]
    assert totals["bytes_written"] == 1000 * n_keys
    assert totals["bytes_read"] == 500 + 1000 * (n_keys - 1)  # prefill's own pool hit + decode's load
    assert totals["blocks_hit"] == 1 + (n_keys - 1)
    assert totals["blocks_missed"] == {"absent": 2, "expired": 1}
    assert totals["transfer_s"] == pytest.approx(0.001 + 0.004 + 0.002)  # prefill load + write, decode load
    assert totals["queue_s"] == pytest.approx(0.001 + 0.0005)
    assert totals["prefill_s"] == pytest.approx(0.01)


@pytest.mark.parametrize("include_usage", [False, True])
async def test_streamed_trace_rides_on_the_last_chunk(cluster: Cluster, include_usage: bool) -> None:
    async with cluster.http() as http:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": include_usage},
            **TRACE,
        }
        async with http.post("/v1/chat/completions", json=body) as resp:
            events = (await resp.read()).decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert ["tidepool" in c for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    trace = last["tidepool"]["trace"]
    assert trace["prompts"][0]["prefill"]["decision"] == "skip_short_prompt"
    assert len(trace["prompts"][0]["choices"]) == 2
    if include_usage:
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    else:
        assert last["choices"][0]["finish_reason"] == "length"


async def test_one_log_line_per_request(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tidepool.router.requests")
    client = cluster.openai()
    await client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3)
    await client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "tidepool.router.requests"]
    assert len(lines) == 2
    first, second = lines
    for field in ("outcome=ok", "prefill=prefill-0", "decode=decode-", "bytes_written=", "blocks_missed=absent:2+expired:1", "ttft_ms="):
        assert field in first, field
    assert "prefill=skip_short_prompt(1 < 32 tokens)" in second and "completion_tokens=3" in second


def value(metrics: dict[str, float], name: str, **labels: str) -> float:
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    return metrics.get(key, 0.0)


async def test_every_metric_moves_under_a_known_workload(cluster: Cluster) -> None:
    client = cluster.openai()
    m0 = await cluster.metrics()
    assert value(m0, "tidepool_router_requests_running") == 0 and value(m0, "tidepool_router_ttft_seconds_count") == 0

    # 1. a long prompt through prefill, 2 choices; 2. a short one skipping prefill
    r1 = await client.completions.create(model=MODEL, prompt=long_prompt(), n=2, max_tokens=4, seed=0)
    r2 = await client.completions.create(model=MODEL, prompt="x", max_tokens=5)
    # 3. prefill fails (decode serves it), and decode breaks once mid-stream (resumed)
    prefill = cluster.prefills[0]
    await prefill.stop_heartbeats()
    prefill.status = 503
    first, second = cluster.decodes
    second.running = 5
    await second.heartbeat(cluster.url)
    await second.stop_heartbeats()
    first.die_after = 2
    r3 = await client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=6)
    # 4. a bad request, and a stop string
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    r4 = await client.completions.create(model=MODEL, prompt="x", max_tokens=9, stop=[" brown"])
    assert r4.choices[0].text == " The quick"

    m = await cluster.metrics()
    ok = value(m, "tidepool_router_requests_total", endpoint="completions", outcome="ok")
    assert ok == 4 and value(m, "tidepool_router_requests_total", endpoint="completions", outcome="400") == 1
    for hist in ("tidepool_router_ttft_seconds", "tidepool_router_e2e_latency_seconds"):
        assert value(m, hist + "_count") == 4 and value(m, hist + "_sum") > 0
    assert value(m, "tidepool_router_time_per_output_token_seconds_count") == 5  # one per choice
    prompt_ids = tokenizer().encode(long_prompt())
    assert value(m, "tidepool_router_prompt_tokens_total") == 2 * len(prompt_ids) + 2
    completion = sum(u.completion_tokens for u in (r1.usage, r2.usage, r3.usage, r4.usage) if u)
    assert value(m, "tidepool_router_completion_tokens_total") == completion == 8 + 5 + 6 + 3
    decisions = {d: value(m, "tidepool_router_prefill_decisions_total", decision=d) for d in ("prefill", "skip_short_prompt", "prefill_failed")}
    assert decisions == {"prefill": 1, "skip_short_prompt": 2, "prefill_failed": 1}
    assert value(m, "tidepool_router_decode_resumptions_total", reason="truncated") == 1
    assert value(m, "tidepool_router_aborts_total", reason="stop_string") == 1
    # pool numbers from the traces: request 1 (prefill + 2 decodes), 2 and 4 (decode only), 3 (decode twice)
    n_keys = len(prompt_ids) // 16 + 1
    assert value(m, "tidepool_router_pool_hit_blocks_total") == 1 + 2 * (n_keys - 1)
    assert value(m, "tidepool_router_pool_miss_blocks_total", reason="absent") == 2
    # one per decode stream that finished (2 + 1 + 1): not the broken one, nor the one a stop string cut
    assert value(m, "tidepool_router_pool_miss_blocks_total", reason="expired") == 4
    assert value(m, "tidepool_router_pool_bytes_total", direction="written") == 1000 * n_keys
    assert value(m, "tidepool_router_pool_bytes_total", direction="read") == 500 + 2 * 1000 * (n_keys - 1)
    assert value(m, "tidepool_router_handoff_seconds_count") == 2  # each choice of request 1
    assert value(m, "tidepool_router_handoff_seconds_sum") == pytest.approx(2 * (0.004 + 0.002))
    assert value(m, "tidepool_router_cached_prompt_tokens_total") == 0
    assert value(m, "tidepool_router_registrations_total", role="decode") == 2
    assert value(m, "tidepool_router_registrations_total", role="prefill") == 1
    # instance gauges come from heartbeats
    assert value(m, "tidepool_instance_running", instance="decode-1", role="decode") == 5
    assert value(m, "tidepool_instance_free_kv_blocks", instance="decode-0", role="decode") == 1000
    assert value(m, "tidepool_instance_total_kv_blocks", instance="prefill-0", role="prefill") == 1000
    assert value(m, "tidepool_router_instances", role="decode", usable="true") == 1  # decode-0 broke
    assert value(m, "tidepool_router_instances", role="decode", usable="false") == 1
    assert value(m, "tidepool_router_instances", role="prefill", usable="false") == 1


async def test_cached_tokens_and_in_flight_gauges(cluster: Cluster) -> None:
    cluster.prefills[0].cached_tokens = 32
    cluster.prefills[0].delay_s = 0.3
    for d in cluster.decodes:
        d.event_delay_s = 0.1
    client = cluster.openai()
    task = asyncio.create_task(client.completions.create(model=MODEL, prompt=long_prompt(), max_tokens=5))

    async def gauge(name: str) -> float:
        return value(await cluster.metrics(), name)

    async def waiting() -> bool:
        return await gauge("tidepool_router_requests_waiting") == 1

    async def running() -> bool:
        return await gauge("tidepool_router_requests_running") == 1

    await eventually(waiting, what="a request waiting for its first token")
    assert await gauge("tidepool_router_requests_running") == 0
    await eventually(running, what="a request streaming")
    m = await cluster.metrics()
    assert value(m, "tidepool_router_requests_waiting") == 0
    assert sum(value(m, "tidepool_instance_router_in_flight", instance=d.instance_id, role="decode") for d in cluster.decodes) == 1
    r = await task
    assert r.choices[0].text == script_text(0, 5)
    m = await cluster.metrics()
    assert value(m, "tidepool_router_requests_running") == 0 and value(m, "tidepool_router_requests_waiting") == 0
    assert value(m, "tidepool_router_cached_prompt_tokens_total") == 32


async def test_dropped_instances_are_counted_and_leave_the_gauges() -> None:
    c = await start_cluster(prefills=0, decodes=2, heartbeat_timeout_s=1.0)
    try:
        await c.decodes[1].stop_heartbeats()

        async def dropped() -> bool:
            return value(await c.metrics(), "tidepool_router_instances_dropped_total", role="decode") == 1

        await eventually(dropped, what="decode-1 dropped")
        m = await c.metrics()
        assert value(m, "tidepool_instance_free_kv_blocks", instance="decode-1", role="decode") == 0
        assert 'tidepool_instance_free_kv_blocks{instance="decode-1",role="decode"}' not in m
        assert value(m, "tidepool_router_instances", role="decode", usable="true") == 1
    finally:
        await c.close()


async def test_stats_and_workers_endpoints(cluster: Cluster) -> None:
    async with cluster.http() as http:
        async with http.get("/stats") as resp:
            stats: dict[str, Any] = await resp.json()
        async with http.get("/v1/workers") as resp:
            workers = (await resp.json())["data"]
    assert stats["model"] == MODEL and stats["instances"]["decode"] == {"live": 2, "usable": 2}
    assert sorted((w["role"], w["id"]) for w in workers) == [("decode", "decode-0"), ("decode", "decode-1"), ("prefill", "prefill-0")]


async def test_a_client_hanging_up_after_done_is_an_ok_request(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that closes as soon as it has read ``[DONE]`` makes the final
    ``write_eof`` fail; everything was delivered, so the request is ``ok``, not ``error``."""
    from aiohttp import web

    write_eof = web.StreamResponse.write_eof

    async def reset(self: web.StreamResponse, data: bytes = b"") -> None:
        await write_eof(self, data)  # everything reached the client, then the socket reset
        raise ConnectionResetError("client closed after [DONE]")

    monkeypatch.setattr(web.StreamResponse, "write_eof", reset)
    caplog.set_level(logging.INFO, logger="tidepool.router.requests")
    stream = await cluster.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3, stream=True)
    assert len([c async for c in stream]) >= 3
    await eventually(lambda: any(r.name == "tidepool.router.requests" for r in caplog.records), what="the request's log line")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "tidepool.router.requests"]
    assert "outcome=ok" in line, line
    m = await cluster.metrics()
    assert value(m, "tidepool_router_requests_total", endpoint="completions", outcome="ok") == 1
    assert value(m, "tidepool_router_requests_total", endpoint="completions", outcome="error") == 0
