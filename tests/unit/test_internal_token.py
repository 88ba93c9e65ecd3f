"""The services' shared internal token: internal endpoints refuse calls without it, calls
between services carry it, and secrets are compared in constant time."""

from __future__ import annotations

import hmac

import aiohttp
import pytest

from libs.protocol import INTERNAL_TOKEN_HEADER, encode
from libs.protocol.messages import Heartbeat
from services.common import parse_settings
from services.router.settings import RouterSettings
from tests.fake_workers import FakeDecode
from tests.router_harness import MODEL, fake_model, long_prompt, script_text, start_cluster

TOKEN = "internal-token-for-tests-0123456789"
MSGPACK = {"Content-Type": "application/msgpack"}


async def test_router_internal_routes_need_the_token() -> None:
    c = await start_cluster(internal_token=TOKEN)
    try:
        beat = encode(Heartbeat(instance_id="decode-0", role="decode", running=0, waiting=0, free_blocks=1, total_blocks=1))
        async with aiohttp.ClientSession() as http:
            for headers, status, code in (
                ({}, 401, "missing_internal_token"),
                ({INTERNAL_TOKEN_HEADER: "wrong-token-wrong-token"}, 401, "invalid_internal_token"),
                ({INTERNAL_TOKEN_HEADER: TOKEN}, 200, None),
            ):
                async with http.post(c.url + "/internal/v1/heartbeat", data=beat, headers={**MSGPACK, **headers}) as resp:
                    assert resp.status == status
                    if code:
                        assert (await resp.json())["error"]["code"] == code
            for path in ("/health", "/metrics", "/stats", "/v1/models", "/openapi.json"):
                async with http.get(c.url + path) as resp:  # operations and the public API: no token
                    assert resp.status in (200, 404) and resp.status != 401, path
        # the fake instances registered with the token (the harness gives it to them) ...
        r = await c.openai().completions.create(model=MODEL, prompt=long_prompt(), max_tokens=3)
        assert r.choices[0].text == script_text(0, 3)
        # ... and the router's calls to them carried it: prefill, decode
        assert c.prefills[0].tokens_seen == [TOKEN] and c.decodes[0].tokens_seen == [TOKEN]
    finally:
        await c.close()


async def test_an_instance_without_the_token_cannot_register() -> None:
    c = await start_cluster(prefills=0, decodes=0, internal_token=TOKEN)
    stranger = await FakeDecode(role="decode", model=fake_model(), model_name=MODEL, instance_id="stranger").start()
    try:
        status, body = await stranger.register(c.url)
        assert status == 401 and b"missing_internal_token" in body
        assert c.state.registry.instances == {}
    finally:
        await stranger.stop()
        await c.close()


async def test_secrets_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    c = await start_cluster(prefills=0, internal_token=TOKEN, api_key="client-key")
    try:
        compared.clear()
        async with aiohttp.ClientSession() as http:
            async with http.get(c.url + "/v1/models", headers={"Authorization": "Bearer guess"}) as resp:
                assert resp.status == 401
            async with http.post(c.url + "/internal/v1/heartbeat", data=b"", headers={INTERNAL_TOKEN_HEADER: "guess"}) as resp:
                assert resp.status == 401
        assert (b"guess", b"client-key") in compared and (b"guess", TOKEN.encode()) in compared
    finally:
        await c.close()


def test_the_token_is_a_setting_of_every_service_and_never_printed() -> None:
    from services.cache_store.settings import CacheStoreSettings
    from services.worker.settings import WorkerSettings

    for cls in (RouterSettings, CacheStoreSettings, WorkerSettings):
        s = parse_settings(cls, [], env={"TIDEPOOL_INTERNAL_TOKEN": TOKEN})
        assert s.internal_token == TOKEN and TOKEN not in repr(s)
    with pytest.raises(SystemExit):
        parse_settings(RouterSettings, ["--internal-token", "short"], env={})
