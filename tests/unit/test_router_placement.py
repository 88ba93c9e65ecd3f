"""services/router: registration, heartbeats, expiry, /v1/workers, and where requests go."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

import msgpack
import pytest
from aiohttp import web

from libs.blocks import NamespaceRoot, block_keys
from libs.protocol import decode, encode
from libs.protocol.messages import Heartbeat, InstanceAck, RegisterInstance
from services.router import placement
from services.router.registry import Instance, Registry
from tests.fake_workers import BLOCK_SIZE, NAMESPACE
from tests.router_harness import MODEL, Cluster, eventually, long_prompt, script_text, start_cluster, tokenizer

MSGPACK = {"Content-Type": "application/msgpack"}


def registration(instance_id: str, role: str = "decode", **kw: Any) -> RegisterInstance:
    fields = dict(url=f"http://{instance_id}:1", model=MODEL, namespace=NAMESPACE, max_model_len=4096, block_size=16)
    return RegisterInstance(instance_id=instance_id, role=role, **{**fields, **kw})  # type: ignore[arg-type]


def beat(instance_id: str, role: str = "decode", **kw: int) -> Heartbeat:
    load = dict(running=0, waiting=0, free_blocks=100, total_blocks=100, queue_depth=0)
    return Heartbeat(instance_id=instance_id, role=role, **{**load, **kw})  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- registry and placement as functions ----------------------------------------------------------


def test_registry_expires_silent_instances_before_the_reaper_runs() -> None:
    clock = Clock()
    reg = Registry(heartbeat_timeout_s=2.0, clock=clock)
    reg.register(registration("d1"))
    reg.register(registration("d2"))
    clock.now += 1.5
    assert reg.heartbeat(beat("d2")) is not None
    clock.now += 1.0  # d1 silent for 2.5 s, d2 for 1.0 s
    assert [i.id for i in reg.live("decode")] == ["d2"]  # not picked even before expire()
    assert reg.heartbeat(beat("d1")) is None  # must register again
    assert [i.id for i in reg.expire()] == ["d1"] and list(reg.instances) == ["d2"]


def test_registry_unusable_until_next_heartbeat_and_role_checks() -> None:
    reg = Registry(heartbeat_timeout_s=5.0, clock=Clock())
    inst = reg.register(registration("d1"))
    reg.mark_unusable(inst, "connect")
    assert reg.usable("decode") == [] and reg.live("decode") == [inst]
    assert reg.heartbeat(beat("d1", role="prefill")) is None  # wrong role: re-register
    assert reg.heartbeat(beat("d1")) is inst and reg.usable("decode") == [inst]
    stale = inst
    reg.register(registration("d1", url="http://new:2"))  # a restart replaces the entry
    reg.mark_unusable(stale, "late failure of the old process")
    assert reg.usable("decode")[0].url == "http://new:2"


def test_registry_refuses_a_malformed_namespace() -> None:
    reg = Registry(heartbeat_timeout_s=5.0)
    with pytest.raises(ValueError):
        reg.register(registration("d1", namespace="zz"))


def make(reg: Registry, instance_id: str, role: str = "decode", reg_kw: dict | None = None, **load: int) -> Instance:
    inst = reg.register(registration(instance_id, role, **(reg_kw or {})))
    reg.heartbeat(beat(instance_id, role, **load))
    return inst


def test_decode_is_picked_by_load_then_free_blocks() -> None:
    reg = Registry(heartbeat_timeout_s=5.0, clock=Clock())
    busy = make(reg, "busy", running=4, free_blocks=90)
    idle = make(reg, "idle", running=1, waiting=1, free_blocks=10)
    idle2 = make(reg, "idle2", running=2, free_blocks=50)
    assert placement.pick_decode([busy, idle, idle2], 10) is idle2  # load 2 = 2; more free blocks wins
    idle2.dispatched += 1  # sent one since its heartbeat: now 3
    assert placement.pick_decode([busy, idle, idle2], 10) is idle
    idle.in_flight = 5  # this router knows better than the stale heartbeat
    assert placement.pick_decode([busy, idle, idle2], 10) is idle2


def test_decode_without_room_for_the_prompt_goes_last() -> None:
    reg = Registry(heartbeat_timeout_s=5.0, clock=Clock())
    full = make(reg, "full", running=0, free_blocks=3)
    roomy = make(reg, "roomy", running=6, free_blocks=80)
    assert placement.blocks_needed(48, 16) == 4
    assert placement.pick_decode([full, roomy], 48) is roomy
    assert placement.pick_decode([full, roomy], 47) is full  # 3 blocks hold 47 + 1 tokens


def test_decode_prefers_the_namespace_prefill_writes_in() -> None:
    reg = Registry(heartbeat_timeout_s=5.0, clock=Clock())
    other = make(reg, "other", reg_kw={"namespace": "cd" * 16}, running=0)
    same = make(reg, "same", running=3)
    assert placement.pick_decode([other, same], 10, namespace=NAMESPACE) is same
    assert placement.pick_decode([other, same], 10) is other


def test_prefill_is_picked_by_queue_depth_in_the_namespace() -> None:
    reg = Registry(heartbeat_timeout_s=5.0, clock=Clock())
    deep = make(reg, "deep", "prefill", queue_depth=3)
    shallow = make(reg, "shallow", "prefill", queue_depth=1)
    foreign = make(reg, "foreign", "prefill", reg_kw={"namespace": "cd" * 16}, queue_depth=0)
    assert placement.pick_prefill([deep, shallow, foreign], NAMESPACE) is shallow
    shallow.dispatched += 3
    assert placement.pick_prefill([deep, shallow, foreign], NAMESPACE) is deep
    assert placement.pick_prefill([foreign], NAMESPACE) is None


# --- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture
async def bare() -> AsyncIterator[Cluster]:
    c = await start_cluster(prefills=0, decodes=0, heartbeat_timeout_s=1.0)
    yield c
    await c.close()


async def post(c: Cluster, path: str, body: bytes) -> tuple[int, Any]:
    async with c.http() as http, http.post(path, data=body, headers=MSGPACK) as resp:
        raw = await resp.read()
        if resp.content_type == "application/msgpack":
            return resp.status, decode(raw, InstanceAck)
        return resp.status, json.loads(raw)


async def workers(c: Cluster) -> list[dict[str, Any]]:
    async with c.http() as http, http.get("/v1/workers") as resp:
        assert resp.status == 200
        return (await resp.json())["data"]


async def test_register_heartbeat_and_workers_listing(bare: Cluster) -> None:
    status, ack = await post(bare, "/internal/v1/register", encode(registration("d1")))
    assert status == 200 and ack == InstanceAck(instance_id="d1", heartbeat_timeout_s=1.0)
    status, ack = await post(bare, "/internal/v1/heartbeat", encode(beat("d1", running=3, free_blocks=40)))
    assert status == 200 and ack.instance_id == "d1"
    (w,) = await workers(bare)
    assert (w["id"], w["role"], w["url"], w["usable"]) == ("d1", "decode", "http://d1:1", True)
    assert w["load"] == {"running": 3, "waiting": 0, "queue_depth": 0, "free_blocks": 40, "total_blocks": 100}
    assert w["last_seen_s_ago"] < 1.0 and w["last_seen"] > 1.7e9
    status, err = await post(bare, "/internal/v1/heartbeat", encode(beat("ghost")))
    assert status == 404 and err["error"]["code"] == "unknown_instance"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (encode(registration("d1", model="other-model")), "model_mismatch"),
        (encode(registration("d1", namespace="nothex")), "invalid_value"),
        (encode(registration("d1", url="d1:1")), "invalid_value"),
        (b"\xc1", "malformed"),
        (msgpack.packb({"type": "RegisterInstance", "version": 1, "instance_id": "d1"}), "missing_field"),
    ],
)
async def test_bad_registrations_are_400(bare: Cluster, body: bytes, code: str) -> None:
    status, err = await post(bare, "/internal/v1/register", body)
    assert status == 400 and err["error"]["code"] == code
    assert await workers(bare) == []


async def test_dead_instances_are_dropped_and_come_back_by_registering(bare: Cluster) -> None:
    decode = await bare.add_decode("d-live")
    quiet = await bare.add_decode("d-quiet")
    await quiet.stop_heartbeats()
    await eventually(lambda: _ids(bare) == ["d-live"], what="d-quiet dropped")
    assert [w["id"] for w in await workers(bare)] == ["d-live"]
    assert await quiet.heartbeat(bare.url) == 404  # told to register again
    await quiet.join(bare.url)
    assert sorted(w["id"] for w in await workers(bare)) == ["d-live", "d-quiet"]
    assert decode.heartbeats_sent > 1


async def test_ready_only_while_a_decode_instance_is_registered(bare: Cluster) -> None:
    async def status(path: str) -> tuple[int, dict[str, Any]]:
        async with bare.http() as http, http.get(path) as resp:
            return resp.status, await resp.json()

    code, body = await status("/ready")
    assert code == 503 and body["ready"] is False and "no decode" in body["reason"]
    assert (await status("/health"))[0] == 200  # liveness is not readiness
    await bare.add_prefill("p1")
    assert (await status("/ready"))[0] == 503  # a prefill alone cannot answer a request
    decode = await bare.add_decode("d1")
    code, body = await status("/ready")
    assert code == 200 and body["live"] == {"prefill": 1, "decode": 1}
    await decode.stop_heartbeats()
    await eventually(lambda: _ids(bare) == ["p1"], what="d1 dropped")
    assert (await status("/ready"))[0] == 503
    await decode.join(bare.url)
    assert (await status("/ready"))[0] == 200


def _ids(c: Cluster) -> list[str]:
    return sorted(c.state.registry.instances)


async def test_requests_go_to_the_least_loaded_decode() -> None:
    c = await start_cluster(prefills=0, decodes=2)
    try:
        loaded, idle = c.decodes
        loaded.running, loaded.free_blocks = 8, 10
        await loaded.heartbeat(c.url)
        await idle.heartbeat(c.url)
        client = c.openai()
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert (len(loaded.requests), len(idle.requests)) == (0, 1)
        loaded.running, idle.running = 0, 8
        await loaded.heartbeat(c.url)
        await idle.heartbeat(c.url)
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert (len(loaded.requests), len(idle.requests)) == (1, 1)
    finally:
        await c.close()


async def test_a_burst_spreads_over_equal_decodes() -> None:
    c = await start_cluster(prefills=0, decodes=3)
    try:
        for d in c.decodes:
            await d.stop_heartbeats()  # no heartbeat resets the router's dispatch counts
            d.event_delay_s = 0.05
        client = c.openai()
        await asyncio.gather(*(client.completions.create(model=MODEL, prompt="x", max_tokens=3) for _ in range(6)))
        assert [len(d.requests) for d in c.decodes] == [2, 2, 2]
    finally:
        await c.close()


async def test_prefill_is_picked_by_queue_depth_and_skipped_for_short_prompts() -> None:
    c = await start_cluster(prefills=2, decodes=1, prefill_threshold_tokens=10)
    try:
        deep, shallow = c.prefills
        deep.queue_depth = 5
        await deep.heartbeat(c.url)
        client = c.openai()
        short = " ".join(["a"] * 5)
        await client.completions.create(model=MODEL, prompt=short, max_tokens=2)
        assert (len(deep.requests), len(shallow.requests)) == (0, 0)
        assert c.decodes[0].requests[-1].first_token_id is None
        exactly = tokenizer().encode(" ".join(["a"] * 10))
        assert len(exactly) == 10
        r = await client.completions.create(model=MODEL, prompt=exactly, max_tokens=2)
        assert (len(deep.requests), len(shallow.requests)) == (0, 1)
        assert c.decodes[0].requests[-1].first_token_id is not None
        assert r.choices[0].text == script_text(0, 2)
    finally:
        await c.close()


# --- prompts already in the pool -------------------------------------------------------------------


class FakeCacheStore:
    """cache_store's ``POST /v1/blocks/query`` (services/cache_store/app.py) over a set of ids."""

    def __init__(self) -> None:
        self.blocks: set[str] = set()
        self.queries: list[dict[str, Any]] = []
        self.status = 200
        self.hold: asyncio.Event | None = None  # set: each query waits for it
        self.asked = asyncio.Event()
        self.on_query: Callable[[], None] = lambda: None  # called as a query arrives, before its body is read
        app = web.Application()
        app.router.add_post("/v1/blocks/query", self.query)
        self.runner = web.AppRunner(app)

    async def query(self, request: web.Request) -> web.Response:
        self.on_query()
        body = await request.json()
        self.queries.append(body)
        self.asked.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "pool down"}}, status=self.status)
        exists = [f"{body['namespace']}:{k}" in self.blocks for k in body["keys"]]
        prefix = next((i for i, e in enumerate(exists) if not e), len(exists))
        return web.json_response({"prefix": prefix} if body.get("prefix_only") else {"exists": exists, "prefix": prefix})

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"


async def test_prompt_fully_in_the_pool_skips_prefill() -> None:
    store = FakeCacheStore()
    url = await store.start()
    c = await start_cluster(cache_store_url=url)
    try:
        prompt = tokenizer().encode(long_prompt())
        keys = [str(k) for k in block_keys(NamespaceRoot.from_hex(NAMESPACE, BLOCK_SIZE), prompt)]
        assert len(keys) > 2 and ":partial:" in keys[-1]
        store.blocks = {f"{NAMESPACE}:{k}" for k in keys[:-1]}  # all but the partial tail
        client = c.openai()
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert len(c.prefills[0].requests) == 1  # not all there: prefill runs
        assert store.queries[-1] == {"namespace": NAMESPACE, "keys": keys, "prefix_only": True}
        store.blocks.add(f"{NAMESPACE}:{keys[-1]}")
        # The query and the prefill call start together; the query finds every block and
        # the call (still waiting here) is abandoned with an abort.
        c.prefills[0].delay_s = 5.0
        r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert len(c.prefills[0].requests) == 2
        await eventually(lambda: c.prefills[0].aborts == [c.prefills[0].requests[-1].request_id])
        dec = c.decodes[0].requests[-1]
        assert dec.first_token_id is None and dec.block_keys == keys and dec.lease_id is None
        assert r.choices[0].text == script_text(0, 2)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1  # decode loaded them
        c.prefills[0].delay_s = 0.0
        store.status = 503  # the pool's trouble never fails a request
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert len(c.prefills[0].requests) == 3
        assert c.decodes[0].requests[-1].first_token_id is not None
    finally:
        await c.close()
        await store.runner.cleanup()


@pytest.mark.parametrize("stream_handoff", [False, True])
async def test_the_prefill_call_goes_out_before_the_pool_query(stream_handoff: bool) -> None:
    """A fresh prompt's critical path is its prefill call; the query is only useful when the
    whole prompt is already in the pool. So the call is sent first and the query's Python
    (128 block keys hashed, a JSON body) runs after it: cache_store sees the query only
    once prefill has read the call."""
    store = FakeCacheStore()
    url = await store.start()
    c = await start_cluster(cache_store_url=url)
    seen: list[int] = []  # prefill calls read when each query arrives
    store.on_query = lambda: seen.append(len(c.prefills[0].requests))
    try:
        c.prefills[0].streams = stream_handoff
        prompt = tokenizer().encode(long_prompt())
        client = c.openai()
        for _ in range(3):
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"tidepool": {"stream_handoff": stream_handoff}})
            assert r.choices[0].text == script_text(0, 2)
        assert seen == [1, 2, 3]
    finally:
        await c.close()
        await store.runner.cleanup()


@pytest.mark.parametrize("stream_handoff", [False, True])
async def test_pool_query_runs_beside_the_prefill_call(stream_handoff: bool) -> None:
    """The query does not delay a fresh prompt's prefill call; and a prompt whose prefill
    answers before the query (here: the query is slow) keeps prefill's first token."""
    store = FakeCacheStore()
    url = await store.start()
    store.hold = asyncio.Event()
    c = await start_cluster(cache_store_url=url, cache_store_timeout_s=8.0)  # a query that would hold a serial call back
    try:
        c.prefills[0].streams = stream_handoff
        prompt = tokenizer().encode(long_prompt())
        keys = [str(k) for k in block_keys(NamespaceRoot.from_hex(NAMESPACE, BLOCK_SIZE), prompt)]
        store.blocks = {f"{NAMESPACE}:{k}" for k in keys}  # all there, but the answer comes late
        client = c.openai()
        call = asyncio.create_task(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"tidepool": {"stream_handoff": stream_handoff}}))
        await asyncio.wait_for(store.asked.wait(), 5)
        await eventually(lambda: len(c.prefills[0].requests) == 1)  # called while the query waits
        if not stream_handoff:
            await asyncio.sleep(0.2)  # prefill has answered
        store.hold.set()
        r = await asyncio.wait_for(call, 10)
        assert r.choices[0].text == script_text(0, 2)
        if not stream_handoff:  # the result came first: kept, not abandoned
            assert c.prefills[0].aborts == []
            assert c.decodes[0].requests[-1].first_token_id is not None
    finally:
        await c.close()
        await store.runner.cleanup()
