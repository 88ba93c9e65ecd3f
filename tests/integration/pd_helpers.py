"""Helpers for the end-to-end tests: talking to instances directly, reading their stats."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator

import aiohttp
import redis

from libs.engine import SamplingParams
from libs.kvpool.scripts import SHA
from libs.protocol import decode, encode, iter_messages
from libs.protocol.messages import DecodeRequest, PrefillRequest, PrefillResult, SamplingSpec, TokenEvent

TRACE = {"tidepool": {"trace": True}}
MSGPACK = {"Content-Type": "application/msgpack"}
# Long enough that the router sends them through prefill (short prompts skip it).
CHAT = [{"role": "user", "content": "Write two short sentences about the sea and the wind at night."}]
PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening to light the great lamp. The ships "
    "passing the rocks below trusted that light with their lives, and on the last night of the year he"
)


def metrics(url: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value} (samples only)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


def engine_tokens(engine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0].token_ids


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def trace_of(resp) -> dict:
    extra = resp.model_extra or {}
    return extra["tidepool"]["trace"]


def assert_went_through_pd(trace: dict) -> None:
    p = trace["prompts"][0]
    assert p["prefill"]["decision"] == "prefill", p["prefill"]
    totals = trace["totals"]
    assert totals["bytes_written"] > 0 and totals["blocks_written"] > 0  # prefill wrote the prompt's blocks
    assert totals["blocks_hit"] >= totals["blocks_written"]  # decode loaded them from the pool
    assert totals["bytes_read"] > 0 and not totals["blocks_missed"]


def prefill_then_decode(
    cluster, prompt: list[int], max_tokens: int, between=None, *, prefill_url: str | None = None, decode_url: str | None = None
) -> tuple[list[int], dict]:
    """Drive one handoff by hand (no router): prefill on ``prefill_url`` (default: the
    first prefill), ``between(result)``, then decode on ``decode_url`` (default: the first
    decode) from the pool. The tokens (prefill's first included) and decode's trace."""
    prefill_url = prefill_url or cluster.prefills[0].url
    decode_url = decode_url or cluster.decodes[0].url

    async def go():
        spec = SamplingSpec(temperature=0, max_tokens=max_tokens)
        rid = f"handoff-{time.monotonic_ns()}"
        async with aiohttp.ClientSession(headers=cluster.internal_headers()) as s:
            req = PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=spec)
            async with s.post(prefill_url + "/v1/prefill", data=encode(req), headers=MSGPACK) as r:
                assert r.status == 200, await r.text()
                result = decode(await r.read(), PrefillResult)
            if between is not None:
                between(result)
            req = DecodeRequest(request_id=rid, prompt_token_ids=prompt, first_token_id=result.first_token_ids[0], sampling=spec,
                                block_keys=result.block_keys, lease_id=result.lease_id, want_trace=True)
            tokens, trace = [result.first_token_ids[0]], None
            async with s.post(decode_url + "/v1/decode", data=encode(req), headers=MSGPACK) as r:
                assert r.status == 200, await r.text()
                async for ev in iter_messages(r, TokenEvent):
                    tokens += ev.token_ids
                    trace = ev.trace or trace
            return tokens, trace

    return asyncio.run(go())


@contextmanager
def script_calls(redis_url: str, script: str) -> Iterator[list[tuple[float, list]]]:
    """The (Redis clock, command) of every EVALSHA of ``script`` one Redis runs inside the
    block, from ``MONITOR`` (its clock is the host's: comparable with the traces' stamps)."""
    calls: list[tuple[float, list]] = []
    watching, done = threading.Event(), threading.Event()
    sha = SHA[script]

    def watch() -> None:
        with redis.Redis.from_url(redis_url).monitor() as m:
            watching.set()
            for cmd in m.listen():
                if done.is_set():
                    return
                if sha in cmd["command"]:
                    calls.append((cmd["time"], cmd["command"]))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(10), "MONITOR did not start"
    try:
        yield calls
    finally:
        done.set()
        with redis.Redis.from_url(redis_url) as r:
            r.ping()  # wakes the monitor up to see ``done``
        watcher.join(10)
