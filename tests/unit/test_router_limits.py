"""The router's input limits: body size (413), JSON depth and text (400), the prompt-length
precheck, and the event loop staying free while a request is read, refused or prepared."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import AsyncIterator

import aiohttp
import pytest

from tests.router_harness import MODEL, Cluster, script_text, start_cluster, tokenizer

MiB = 1024 * 1024
CHAT = [{"role": "user", "content": "Tell me about foxes."}]


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = await start_cluster()
    yield c
    await c.close()


async def _small_request(cluster: Cluster) -> str:
    r = await cluster.openai(timeout=10).completions.create(model=MODEL, prompt="Once", max_tokens=3)
    return r.choices[0].text


def _huge_completion_body(size: int) -> bytes:
    head = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 1, "prompt": "'
    return head + b"a" * (size - len(head) - 2) + b'"}'


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_small_request_succeeds_while_a_30mb_body_is_rejected(cluster: Cluster, chunked: bool) -> None:
    """The issue's case: a 30 MB completion used to be read, then tokenized with the GIL
    held for 46 s, so heartbeats expired and every other request got 503 meanwhile."""
    body = _huge_completion_body(30 * MiB)
    sent = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), MiB):
            yield body[i : i + MiB]
            sent.set()
            await asyncio.sleep(0.01)

    async def big() -> tuple[int, dict]:
        data = chunks() if chunked else body
        async with aiohttp.ClientSession() as http:
            async with http.post(cluster.url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json()

    big_task = asyncio.create_task(big())
    if chunked:
        await asyncio.wait_for(sent.wait(), 10)
    assert await asyncio.wait_for(_small_request(cluster), 10) == script_text(0, 3)
    status, error = await asyncio.wait_for(big_task, 60)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    assert str(8 * MiB) in error["error"]["message"]
    assert cluster.decodes[0].requests[-1].prompt_token_ids == tokenizer().encode("Once")  # the only one
    assert len(cluster.decodes[0].requests) == 1


async def test_body_limit_is_a_setting() -> None:
    c = await start_cluster(max_body_bytes=1000)
    try:
        async with c.http() as http:
            async with http.post("/v1/completions", data=_huge_completion_body(1001)) as resp:
                assert resp.status == 413
            async with http.post("/v1/completions", data=_huge_completion_body(1000)) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        await c.close()


async def test_a_body_that_trickles_in_is_408_and_frees_its_slot() -> None:
    c = await start_cluster(body_timeout_s=0.5, max_running_requests=1, max_waiting_requests=0)
    try:

        async def trickle() -> AsyncIterator[bytes]:
            yield b'{"prompt": "'
            await asyncio.sleep(5)
            yield b'x"}'

        async with aiohttp.ClientSession() as http:
            async with http.post(c.url + "/v1/completions", data=trickle(), headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 408 and (await resp.json())["error"]["code"] == "request_timeout"
        assert c.state.admission.running == 0
        assert await _small_request(c) == script_text(0, 3)
    finally:
        await c.close()


async def _post_raw(cluster: Cluster, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    async with cluster.http() as http:
        async with http.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json()


async def test_a_100000_deep_json_body_is_400_not_500(cluster: Cluster) -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        status, error = await _post_raw(cluster, body)
        assert status == 400 and error["error"]["code"] == "json_too_deep", error
    assert await _small_request(cluster) == script_text(0, 3)


async def test_json_depth_limit_is_a_setting() -> None:
    c = await start_cluster(max_json_depth=5)
    try:
        ok = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 1}
        assert (await _post_raw(c, json.dumps(ok).encode(), "/v1/chat/completions"))[0] == 200  # depth 5
        ok["messages"][0]["content"][0]["text"] = ["hi"]  # type: ignore[index]
        status, error = await _post_raw(c, json.dumps(ok).encode(), "/v1/chat/completions")  # depth 6
        assert status == 400 and error["error"]["code"] == "json_too_deep"
    finally:
        await c.close()


async def test_a_lone_surrogate_is_400(cluster: Cluster) -> None:
    status, error = await _post_raw(cluster, b'{"prompt": "abc \\ud800 def", "max_tokens": 1}')
    assert status == 400 and error["error"]["code"] == "invalid_unicode"
    status, error = await _post_raw(
        cluster, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "/v1/chat/completions"
    )
    assert status == 400 and error["error"]["code"] == "invalid_unicode"


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = cluster.state.tokenizer
    calls: list[int] = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: calls.append(len(text)) or encode(text, **kw))
    limit = cluster.decodes[0].max_model_len
    too_long = "a" * (limit * tok.max_token_chars)  # at least `limit` tokens: no room for one more
    for path, body in (
        ("/v1/completions", {"prompt": too_long, "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["short", too_long], "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": too_long}]}),
    ):
        status, error = await _post_raw(cluster, json.dumps(body).encode(), path)
        assert status == 400 and error["error"]["code"] == "context_length_exceeded", error
        assert "at least" in error["error"]["message"]
    assert calls == [len("short")]  # only "short" reached the tokenizer
    # Just under the bound the tokenizer decides: the exact count, still too long here.
    just_under = "a" * (len(too_long) - tok.max_token_chars)
    status, error = await _post_raw(cluster, json.dumps({"prompt": just_under, "max_tokens": 1}).encode())
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    assert "at least" not in error["error"]["message"] and calls == [len("short"), len(just_under)]


def test_tokenizer_encode_releases_the_gil() -> None:
    """The executor only keeps the loop free if the tokenizer lets go of the GIL: the
    tokenizers binding's ``encode`` holds it for the whole call, ``encode_batch`` does not."""
    tok = tokenizer()
    text = "hello world " * 300_000
    done = threading.Event()
    ticks = 0

    def work() -> None:
        tok.encode(text)
        done.set()

    thread = threading.Thread(target=work)
    start = time.perf_counter()
    thread.start()
    while not done.is_set():
        time.sleep(0.005)  # Python code: needs the GIL back after each sleep
        ticks += 1
    thread.join()
    elapsed = time.perf_counter() - start
    assert elapsed > 0.1  # the text is long enough to tell
    assert ticks >= elapsed / 0.005 / 4, f"{ticks} ticks in {elapsed:.2f} s: the GIL was held"


async def test_heartbeats_keep_flowing_while_a_long_prompt_is_tokenized() -> None:
    """A prompt under every limit but slow to tokenize (decode accepts a huge context):
    instances stay registered and other requests are served meanwhile."""
    c = await start_cluster(prefills=0, decodes=0, heartbeat_timeout_s=1.5)
    try:
        await c.add_decode(max_model_len=1 << 20)
        long = "hello world " * 400_000  # 4.8 M characters, 800 k tokens: seconds of tokenizing here
        expected = await asyncio.to_thread(lambda: len(tokenizer().encode(long)))  # not on this loop
        task = asyncio.create_task(c.openai(timeout=120).completions.create(model=MODEL, prompt=long, max_tokens=1))
        await asyncio.sleep(0.2)
        for _ in range(3):
            assert await asyncio.wait_for(_small_request(c), 20) == script_text(0, 3)
        r = await task
        assert r.usage is not None and r.usage.prompt_tokens == expected
        async with c.http() as http, http.get("/v1/workers") as resp:
            workers = (await resp.json())["data"]
        assert [w["id"] for w in workers if w["usable"]] == ["decode-0"]
        assert (await c.metrics()).get('tidepool_router_instances_dropped_total{role="decode"}', 0) == 0
    finally:
        await c.close()
