"""The streamed handoff against the real processes (docs/HANDOFF.md): prefill writes each
chunk's blocks while it computes the next, decode loads them before prefill is done, and
every fault on the way costs latency, never the request or its text."""

import asyncio
import threading
import time

import aiohttp
import pytest
import redis.asyncio as aioredis

from libs.kvpool.config import PoolConfig
from libs.kvpool.redis_pool import RedisPool
from libs.protocol import encode, iter_messages
from libs.protocol.messages import (
    DecodeRequest,
    HandoffUpdate,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TokenEvent,
)
from libs.kvpool.scripts import CREATE_LEASE_LUA, RELEASE_LUA
from tests.integration.pd_helpers import TRACE, engine_tokens, metric, metrics, script_calls, trace_of, wait_until

pytestmark = pytest.mark.integration

HEADERS = {"Content-Type": "application/msgpack"}


def long_prompt(topic: str, repeats: int = 22) -> str:
    """About 30 tokens a repeat: 600+ tokens, ten 64-token prefill chunks and more."""
    return f"Notes on {topic}. " + " ".join(f"Entry {i}: the {topic} was recorded again, with care and in detail." for i in range(repeats))


def attempt0(trace: dict) -> dict:
    return trace["prompts"][0]["choices"][0]["attempts"][0]


def test_decode_loads_blocks_before_prefill_finishes(cluster, client, reference_engine):
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    text = long_prompt("lighthouse")
    prompt = tok.encode(text)
    ref = engine_tokens(reference_engine, prompt, 8)
    urls = (cluster.prefills[0].url, cluster.decodes[0].url, cluster.url)
    before = {u: metrics(u) for u in urls}
    resp = client.completions.create(model=model, prompt=text, temperature=0, max_tokens=8, extra_body=TRACE)
    after = {u: metrics(u) for u in urls}
    d = lambda url, name, **l: metric(after[url], name, **l) - metric(before[url], name, **l)  # noqa: E731
    assert resp.choices[0].text == tok.decode(ref)

    trace = trace_of(resp)
    pre = trace["prompts"][0]["prefill"]
    assert pre["decision"] == "prefill"
    a = attempt0(trace)
    dec = a["worker"]
    assert a["streamed"] and a["with_first_token"]
    n_blocks = -(-len(prompt) // 16)
    # prefill: blocks were durable before its last chunk was computed
    assert 0 < pre["worker"]["streamed_blocks"] < n_blocks
    assert pre["worker"]["durable_blocks"] == n_blocks
    # decode: loaded blocks while prefill was still computing (one host: wall clocks compare),
    # more before prefill's result came, the rest after it, missing none
    assert dec["first_load_done_at"] < pre["worker"]["compute_done_at"]
    assert 0 < dec["early_blocks"] <= n_blocks
    assert dec["pool_hit_blocks"] == n_blocks and not dec["pool_miss_reasons"]
    # progress..., then the last one; the router cuts off a progress post still in flight when
    # the last one is due (services/router/handoff.py), which decode may or may not have taken
    assert a["handoff_updates"] >= 2 and a["handoff_updates"] <= dec["handoff_updates"] <= a["handoff_updates"] + 1
    assert dec["load_tail_s"] <= dec["load_s"] + 1e-6  # part of the loading overlapped prefill

    # every counter moved by what this one request did
    p, dc, r = urls
    assert d(p, "tidepool_prefill_streamed_blocks_total") == pre["worker"]["streamed_blocks"]
    assert d(dc, "tidepool_handoff_early_blocks_total") == dec["early_blocks"]
    assert d(dc, "tidepool_handoff_updates_total", kind="final") == 1
    assert d(dc, "tidepool_handoff_updates_total", kind="progress") == dec["handoff_updates"] - 1
    assert d(r, "tidepool_router_handoff_updates_total", kind="final") == 1
    assert d(r, "tidepool_router_handoff_updates_total", kind="progress") == a["handoff_updates"] - 1
    assert d(r, "tidepool_router_handoff_updates_total", kind="failed") == 0
    assert d(dc, "tidepool_handoff_seconds_count", phase="load") == 1
    assert d(p, "tidepool_handoff_seconds_count", phase="store") == 1


@pytest.mark.slow  # ~10 s: make test-slow; the other PD tests compare the streamed handoff with the engine
def test_stream_handoff_on_and_off_give_identical_output(cluster, client, reference_engine):
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    for on in (True, False):  # a fresh prompt each: each mode through a full handoff
        text = long_prompt("harbour crane" if on else "grain silo", 12)
        extra = {"tidepool": {"trace": True, "stream_handoff": on}}
        resp = client.completions.create(model=model, prompt=text, temperature=0, max_tokens=10, extra_body=extra)
        assert resp.choices[0].text == tok.decode(engine_tokens(reference_engine, tok.encode(text), 10))
        a = attempt0(trace_of(resp))
        assert a["streamed"] is on and a["worker"].get("streamed", False) is on
        assert a["worker"]["pool_hit_blocks"] > 0
    # The same prompt, sampled with a seed, on and then off: the same text.
    text = long_prompt("weather station", 8)
    seeded = dict(model=model, prompt=text, temperature=0.9, top_p=0.95, seed=77, max_tokens=12)
    texts = []
    for on in (True, False):
        resp = client.completions.create(**seeded, extra_body={"tidepool": {"trace": True, "stream_handoff": on}})
        assert trace_of(resp)["prompts"][0]["prefill"]["decision"] in ("prefill", "skip_in_pool")
        texts.append(resp.choices[0].text)
    assert texts[0] == texts[1]


def test_prefill_killed_mid_stream_decode_recomputes_the_tail(cluster, client, reference_engine):
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    text = long_prompt("tide gauge", 30)
    prompt = tok.encode(text)
    ref = tok.decode(engine_tokens(reference_engine, prompt, 8))
    prefill = cluster.prefills[0]
    written = lambda: metric(metrics(prefill.url), "tidepool_pool_written_blocks_total")  # noqa: E731
    start = written()
    failed = lambda: (metric(metrics(cluster.decodes[0].url), "tidepool_handoff_updates_total", kind="failed"),  # noqa: E731
                      metric(metrics(cluster.url), "tidepool_router_handoff_updates_total", kind="failed"))
    failed_before = failed()
    out: dict = {}

    def call():
        try:
            out["resp"] = client.completions.create(model=model, prompt=text, temperature=0, max_tokens=8, extra_body=TRACE)
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = e

    restarts = cluster.supervisor.restarts(prefill.name)
    t = threading.Thread(target=call)
    t.start()
    with cluster.supervisor.paused(prefill):  # held down until the request is answered
        wait_until(lambda: written() >= start + 8, 60, "prefill to write its first chunks")
        prefill.kill()  # SIGKILL mid-stream: the rest of the prompt is never written
        t.join(180)
        assert "error" not in out, out.get("error")
        resp = out["resp"]
        assert resp.choices[0].text == ref
        trace = trace_of(resp)
        assert trace["prompts"][0]["prefill"]["decision"] == "prefill_failed"
        a = attempt0(trace)
        dec = a["worker"]
        assert a["streamed"] and not a["with_first_token"]  # decode sampled the first token itself
        assert dec["prefill_error"]
        n_blocks = -(-len(prompt) // 16)
        assert 8 <= dec["pool_hit_blocks"] < n_blocks  # what prefill made durable was loaded...
        assert resp.usage.prompt_tokens_details.cached_tokens == dec["pool_hit_blocks"] * 16  # ...the tail recomputed
        assert [b - a for a, b in zip(failed_before, failed())] == [1, 1]  # decode got, the router forwarded, one "failed"
    # The supervisor starts it again; it re-registers under its id.
    wait_until(lambda: cluster.supervisor.restarts(prefill.name) == restarts + 1, 120, "the supervisor to restart prefill")
    wait_until(lambda: any(w.get("role") == "prefill" and w.get("usable", True) for w in cluster.workers()), 30, "prefill to re-register")


def by_hand(cluster, prompt: list[int], *, lease_ttl_s: float, between=None, on_progress=None, max_tokens: int = 8) -> tuple[list[int], list, PrefillResult, dict]:
    """A streamed handoff driven by hand: prefill's progress stream read to its end (each
    progress event passed to ``on_progress``), then ``between(result)``, then decode with
    ``await_handoff`` fed the last update."""

    async def go():
        spec = SamplingSpec(temperature=0, max_tokens=max_tokens)
        rid = f"stream-{time.monotonic_ns()}"
        req = PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec, lease_ttl_s=lease_ttl_s, stream_progress=True, want_trace=True)
        async with aiohttp.ClientSession(headers=cluster.internal_headers()) as s:
            msgs = []
            async with s.post(cluster.prefills[0].url + "/v1/prefill", data=encode(req), headers=HEADERS) as r:
                assert r.status == 200, await r.text()
                async for m in iter_messages(r):
                    msgs.append(m)
                    if on_progress is not None and isinstance(m, PrefillProgress):
                        await on_progress(m)
            progress, result = msgs[:-1], msgs[-1]
            assert isinstance(result, PrefillResult) and all(isinstance(m, PrefillProgress) for m in progress)
            if between is not None:
                await between(result)
            dreq = DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec, want_trace=True, await_handoff=True)
            tokens, trace = [result.first_token_ids[0]], None
            async with s.post(cluster.decodes[0].url + "/v1/decode", data=encode(dreq), headers=HEADERS) as r:
                update = HandoffUpdate(request_id=rid, durable_blocks=progress[-1].durable_blocks, lease_id=result.lease_id,
                                       done=True, first_token_id=result.first_token_ids[0])
                async with s.post(cluster.decodes[0].url + "/v1/handoff", data=encode(update), headers=HEADERS) as u:
                    assert u.status == 200, await u.text()
                async for ev in iter_messages(r, TokenEvent):
                    tokens += ev.token_ids
                    trace = ev.trace or trace
            return tokens, progress, result, trace

    return asyncio.run(go())


@pytest.mark.slow  # ~18 s: make test-slow; tests/integration/test_kvpool_bulk_faults.py checks the expired lease on the pool in make test
def test_progress_is_monotonic_and_leases_expiring_cost_only_a_recompute(cluster, reference_engine):
    tok = reference_engine.tokenizer
    pool_cfg = PoolConfig(url=cluster.redis_url, key_prefix="tidepool")

    # 1. The lease expires before decode reads, and the unpinned blocks are evicted:
    #    every block is a miss and decode recomputes the prompt.
    prompt = tok.encode(long_prompt("salt marsh", 10))
    ref = engine_tokens(reference_engine, prompt, 8)

    async def expire_and_evict(result: PrefillResult):
        await asyncio.sleep(max(0.0, result.trace["leased_at"] + 4.2 - time.time()))  # past the lease's TTL
        async with RedisPool(pool_cfg) as pool:
            await pool.reap_leases()  # (cache_store's policy loop may have reaped it first)
            assert not await pool.release_lease(result.lease_id)  # gone: the blocks are unpinned
            assert (await pool.evict(0, 100_000)).evicted >= result.blocks_written

    tokens, progress, result, trace = by_hand(cluster, prompt, lease_ttl_s=4.0, between=expire_and_evict)
    assert tokens == ref
    durable = [p.durable_blocks for p in progress]
    assert durable == sorted(durable) and durable[-1] == len(result.block_keys)  # only ever grows, to all of them
    assert progress[0].durable_blocks == 0  # the first progress came at once, before the lease (a fresh prompt)
    first_durable = next(p for p in progress if p.durable_blocks > 0)
    assert first_durable.lease_id == result.lease_id is not None  # the lease came before the first write
    assert trace["pool_hit_blocks"] == 0 and trace["pool_miss_reasons"].get("absent") == 1
    assert trace["early_blocks"] == 0

    # 2. The lease expires while prefill still writes (its expiry moved into the past in
    #    Redis once the first blocks are durable): the later blocks are refused ("lease"),
    #    so they never become durable, and decode recomputes from there.
    prompt = tok.encode(long_prompt("river delta", 30))
    ref = engine_tokens(reference_engine, prompt, 8)

    async def expire_early(p: PrefillProgress) -> None:
        if p.durable_blocks > 0 and not expired:
            expired.append(p.durable_blocks)
            r = aioredis.Redis.from_url(cluster.redis_url)
            try:
                assert await r.zscore("tidepool:leases", p.lease_id) is not None  # the live lease...
                await r.zadd("tidepool:leases", {p.lease_id: 0}, xx=True)  # ...now expired (ms of Redis TIME)
            finally:
                await r.aclose()

    expired: list[int] = []
    tokens, progress, result, trace = by_hand(cluster, prompt, lease_ttl_s=30, on_progress=expire_early)
    assert expired and tokens == ref
    assert result.blocks_failed > 0 and result.trace["write_fail_reasons"].get("lease") == result.blocks_failed
    assert 0 < progress[-1].durable_blocks < len(result.block_keys)
    assert trace["pool_hit_blocks"] <= progress[-1].durable_blocks
    assert trace["pool_miss_reasons"].get("absent") == 1


def test_client_leaving_mid_handoff_frees_every_block_and_staging_buffer(cluster, client):
    model = client.models.list().data[0].id
    pre, dec = cluster.prefills[0].url, cluster.decodes[0].url
    progress = lambda: metric(metrics(dec), "tidepool_handoff_updates_total", kind="progress")  # noqa: E731
    start = progress()

    async def leave_mid_handoff():
        body = {"model": model, "prompt": long_prompt("ferry timetable", 30), "max_tokens": 8, "stream": True}
        async with aiohttp.ClientSession() as s:
            request = asyncio.ensure_future(s.post(cluster.url + "/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while progress() < start + 2:  # decode is loading while prefill computes
                assert time.monotonic() < deadline and not request.done(), "no streamed handoff under way"
                await asyncio.sleep(0.05)
            request.cancel()  # the client goes away before its first token
            await asyncio.gather(request, return_exceptions=True)

    ended = lambda: sum(metric(metrics(dec), "tidepool_worker_requests_total", outcome=o) for o in ("aborted", "disconnected"))  # noqa: E731
    before = ended()
    asyncio.run(leave_mid_handoff())

    def idle(url: str) -> bool:
        s = cluster.get_json(url + "/stats")
        e = s["engine"]
        return s["staging_in_use"] == 0 and e["running"] == e["waiting"] == 0 and e["free_blocks"] == e["total_blocks"]

    wait_until(lambda: idle(pre) and idle(dec), 30, "prefill and decode to drop the request and its staging")
    assert ended() == before + 1  # decode ended the waiting request (aborted, or its stream closed)


def test_the_first_token_is_sent_before_the_last_writes_end(cluster, reference_engine):
    """Prefill's first token does not wait for the pool: with Redis holding every write
    (``CLIENT PAUSE WRITE`` from the lease's progress on), the first token still comes, in
    a progress event while blocks are not yet durable, and the handoff then completes."""
    tok = reference_engine.tokenizer
    prompt = tok.encode(long_prompt("barometer", 10))
    ref = engine_tokens(reference_engine, prompt, 8)
    seen: list[PrefillProgress] = []

    async def pause_writes(p: PrefillProgress) -> None:
        r = aioredis.Redis.from_url(cluster.redis_url)
        try:
            if not seen:
                await r.execute_command("CLIENT", "PAUSE", 4000, "WRITE")  # lifted below, or after 4 s
            if p.first_token_ids is not None:
                await r.execute_command("CLIENT", "UNPAUSE")
        finally:
            await r.aclose()
        seen.append(p)

    tokens, progress, result, trace = by_hand(cluster, prompt, lease_ttl_s=30, on_progress=pause_writes)
    assert tokens == ref
    (first,) = [p for p in progress if p.first_token_ids is not None]
    assert first.first_token_ids == result.first_token_ids and first.computed_tokens == len(prompt)
    assert first.durable_blocks < first.num_blocks  # the writes were still held
    assert progress[-1].durable_blocks == len(result.block_keys) and result.blocks_failed == 0


@pytest.mark.slow  # ~19 s: make test-slow; the mid-stream SIGKILL test stays in make test
def test_decode_continues_from_a_first_token_whose_prefill_then_failed(cluster, reference_engine):
    """The client may hold prefill's first token before prefill fails (it is sent before the
    last writes end). Decode, told so in the last update (the token and the error), loads
    what is durable, computes the rest of the prompt, and continues after that token."""
    tok = reference_engine.tokenizer
    prompt = tok.encode(long_prompt("ice core", 30))
    ref = engine_tokens(reference_engine, prompt, 8)

    async def go():
        spec = SamplingSpec(temperature=0, max_tokens=8)
        rid = f"first-then-fail-{time.monotonic_ns()}"
        req = PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec, lease_ttl_s=30, stream_progress=True, want_trace=True)
        r = aioredis.Redis.from_url(cluster.redis_url)
        paused = False
        try:
            async with aiohttp.ClientSession(headers=cluster.internal_headers()) as s:
                async with s.post(cluster.prefills[0].url + "/v1/prefill", data=encode(req), headers=HEADERS) as pr:
                    assert pr.status == 200, await pr.text()
                    messages = iter_messages(pr)
                    async for m in messages:  # hold every write once the first blocks are durable
                        assert isinstance(m, PrefillProgress)
                        if not paused and (m.durable_blocks > 0 or m.first_token_ids is not None):
                            await r.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
                            paused = True
                        if m.first_token_ids is not None:
                            first = m
                            break
                    # Prefill "dies" here, as far as decode knows: the last update has its token and an error.
                    dreq = DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec, want_trace=True, await_handoff=True)
                    tokens, trace = [first.first_token_ids[0]], None
                    async with s.post(cluster.decodes[0].url + "/v1/decode", data=encode(dreq), headers=HEADERS) as dr:
                        update = HandoffUpdate(request_id=rid, durable_blocks=first.durable_blocks, lease_id=first.lease_id, done=True,
                                               first_token_id=first.first_token_ids[0], error="prefill died")
                        async with s.post(cluster.decodes[0].url + "/v1/handoff", data=encode(update), headers=HEADERS) as u:
                            assert u.status == 200, await u.text()
                        async for ev in iter_messages(dr, TokenEvent):
                            tokens += ev.token_ids
                            trace = ev.trace or trace
                    await r.execute_command("CLIENT", "UNPAUSE")
                    paused = False
                    async for _ in messages:  # prefill itself finishes its writes and answers
                        pass
        finally:
            if paused:
                await r.execute_command("CLIENT", "UNPAUSE")
            await r.aclose()
        return tokens, first, trace

    tokens, first, trace = asyncio.run(go())
    assert tokens == ref
    assert first.durable_blocks < first.num_blocks  # a tail decode had to compute
    assert trace["prefill_error"] == "prefill died"
    assert first.durable_blocks <= trace["pool_hit_blocks"] < first.num_blocks


def test_decode_releases_the_lease_once_its_first_token_is_out(cluster, reference_engine):
    """Decode releases the handoff lease after its first token has gone out, not while its
    engine prepares that token's step: the release's Lua calls on every partition would run
    on decode's event loop then and hold the GIL the engine thread needs (on the H100 they
    cost the first step 2 ms: bench/RESULTS.md, issue 8 round 10). And it does release it."""
    prompt = reference_engine.tokenizer.encode(long_prompt("tide tables", 4))
    with script_calls(cluster.redis_url, RELEASE_LUA) as releases:
        tokens, _, result, trace = by_hand(cluster, prompt, lease_ttl_s=30)
        wait_until(lambda: any(result.lease_id in c for _, c in releases), 10, "decode to release the lease")
    assert tokens == engine_tokens(reference_engine, prompt, 8)
    released_at = min(t for t, c in releases if result.lease_id in c)
    assert released_at > trace["first_token_at"] > trace["engine_at"]  # after the first token, never during its step

    async def still_leased() -> bool:
        async with RedisPool(PoolConfig(url=cluster.redis_url, key_prefix="tidepool")) as pool:
            return await pool.release_lease(result.lease_id)

    assert not asyncio.run(still_leased())  # already released by decode


def test_prefill_leases_a_fresh_prompt_while_its_step_runs_and_pool_blocks_before_loading(cluster, reference_engine):
    """A prompt with nothing in the pool goes to the engine without the lease; prefill asks
    for it once the engine has put the first step on the device (its Python then runs while
    the device computes, not in front of the pool query or beside the step's preparation).
    A prompt whose blocks are in the pool is leased before they are loaded."""
    prompt = reference_engine.tokenizer.encode(long_prompt("lock gates", 4))
    with script_calls(cluster.redis_url, CREATE_LEASE_LUA) as leases:
        _, _, fresh, _ = by_hand(cluster, prompt, lease_ttl_s=30)
        _, _, again, _ = by_hand(cluster, prompt, lease_ttl_s=30)  # its blocks are in the pool now
        wait_until(lambda: all(any(r.lease_id in c for _, c in leases) for r in (fresh, again)), 10, "both leases")
    at = {r.lease_id: min(t for t, c in leases if r.lease_id in c) for r in (fresh, again)}
    f, a = fresh.trace, again.trace
    assert f["blocks_already_in_pool"] == 0 and a["blocks_already_in_pool"] > 0
    assert f["engine_at"] < f["lease_started_at"] < at[fresh.lease_id]  # asked once the step was on the device
    assert at[again.lease_id] < a["engine_at"]  # pinned before the engine relies on them
