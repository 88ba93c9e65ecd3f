"""The faults of the chaos matrix, one function each, injected into a running :class:`ChaosStack`.

Each ``inject(stack, ctx)`` blocks while its fault lasts and returns a short note for the
report (which pid, how many blocks were hit). What brings the stack back is never the
matrix: the launcher's supervisor restarts what was killed, the services reconnect,
re-register and resume by themselves.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

import redis

from tests.chaos.load import LoadStats, SteadyLoad, abandon_streams
from tests.chaos.stack import KEY_PREFIX, ChaosStack


@dataclass
class Context:
    """What a fault may use besides the stack: the steady load's size and the fault's length."""

    concurrency: int
    fault_s: float
    extra: LoadStats  # requests a fault sends itself (overload) count in the row
    landed: int | None = None  # how many times a fault that can miss hit its target


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[ChaosStack, Context], str]
    client_retries_allowed: bool = False  # only when the client's own endpoint (the router) dies
    must_miss: str | None = None  # a pool miss reason the fault must cause, or it did not land


def _child(stack: ChaosStack, name: str):
    return next(c for c in stack.cluster.children() if c.name == name)


def kill(name: str) -> Callable[[ChaosStack, Context], str]:
    def inject(stack: ChaosStack, ctx: Context) -> str:
        c = _child(stack, name)
        pid = c.pid
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL {name} (pid {pid})"

    return inject


def pause_decode(stack: ChaosStack, ctx: Context) -> str:
    c = stack.cluster.decodes[-1]
    os.kill(c.pid, signal.SIGSTOP)
    try:
        time.sleep(10.0)
    finally:
        os.kill(c.pid, signal.SIGCONT)
    return f"SIGSTOP {c.name} for 10 s, then SIGCONT"


def restart_redis(stack: ChaosStack, ctx: Context) -> str:
    """Redis shuts down cleanly (SHUTDOWN NOSAVE, exit status 0); the supervisor starts it again."""
    try:
        stack.redis().shutdown(nosave=True)
    except redis.ConnectionError:
        pass  # the server closes the connection as it exits
    return "SHUTDOWN NOSAVE; restarted empty by the supervisor"


def redis_latency(stack: ChaosStack, ctx: Context) -> str:
    stack.proxy.set_delay(0.050)
    try:
        time.sleep(ctx.fault_s)
    finally:
        stack.proxy.set_delay(0.0)
    return f"+50 ms per Redis round trip for {ctx.fault_s:.0f} s"


def _on_new_blocks(stack: ChaosStack, ctx: Context, act: Callable[[redis.Redis, bytes], bool], at_least: int = 4) -> int:
    """For ``fault_s`` (longer, up to 6x, until ``act`` succeeded ``at_least`` times: on a
    slow box few prompts are written in a few seconds), call ``act(redis, key)`` on every
    other block value as soon as it is written (Redis keyspace notifications). The window between prefill's write and decode's
    read is milliseconds, and a fault that lands after the read proves nothing: so the
    services' commands reach Redis 30 ms late meanwhile (the proxy), which this client,
    talking to Redis directly, does not."""
    r = stack.redis()
    stack.proxy.set_delay(0.0, request_delay_s=0.030)
    r.config_set("notify-keyspace-events", "K$")  # keyspace events of string commands
    sub = r.pubsub()
    sub.psubscribe(f"__keyspace@0__:{KEY_PREFIX}:kv:*")
    seen: set[bytes] = set()
    hit = 0
    try:
        start = time.monotonic()
        while True:
            elapsed = time.monotonic() - start
            if (elapsed >= ctx.fault_s and hit >= at_least) or elapsed >= 6 * ctx.fault_s:
                break
            msg = sub.get_message(timeout=0.1)
            if not msg or msg["type"] != "pmessage" or msg["data"] != b"set":
                continue
            key = msg["channel"].split(b"__:", 1)[1]
            if key not in seen:  # (our own SET notifies too)
                seen.add(key)
                if len(seen) % 2 and act(r, key):
                    hit += 1
    finally:
        stack.proxy.set_delay(0.0)
        sub.close()
        r.config_set("notify-keyspace-events", "")
    ctx.landed = hit
    return hit


def corrupt_blocks(stack: ChaosStack, ctx: Context) -> str:
    """Flip one payload bit of every other block prefill writes, before decode reads it."""
    rng = random.Random(0)

    def corrupt(r: redis.Redis, key: bytes) -> bool:
        value = r.get(key)
        if value is None or len(value) < 128:
            return False
        damaged = bytearray(value)
        damaged[rng.randrange(64, len(damaged))] ^= 1 << rng.randrange(8)
        return bool(r.set(key, bytes(damaged), xx=True))  # never re-create one deleted meanwhile

    return f"{_on_new_blocks(stack, ctx, corrupt)} block values corrupted as they were written"


def evict_blocks(stack: ChaosStack, ctx: Context) -> str:
    """Delete every other block prefill writes through cache_store (with its bookkeeping,
    as an eviction does), before decode reads it."""
    prefix = f"{KEY_PREFIX}:kv:".encode()

    def evict(r: redis.Redis, key: bytes) -> bool:
        url = f"{stack.cluster.cache_store.url}/v1/blocks/{key[len(prefix):].decode()}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="DELETE", headers=stack.cluster.internal_headers()), timeout=5):
                return True
        except OSError:
            return False  # already gone

    return f"{_on_new_blocks(stack, ctx, evict)} blocks deleted from the pool as they were written"


def disconnect_clients(stack: ChaosStack, ctx: Context) -> str:
    outcome = asyncio.run(abandon_streams(stack.url, 200, chunks=1, give_up_s=90.0))
    return "200 clients gone mid-stream: " + ", ".join(f"{k} {v}" for k, v in sorted(outcome.items()))


def overload(stack: ChaosStack, ctx: Context) -> str:
    """Four times the steady clients on top of it (5x in all) for ``fault_s``."""
    extra = SteadyLoad(stack.url, concurrency=4 * ctx.concurrency, seed=99).start()
    time.sleep(ctx.fault_s)
    ctx.extra.add(extra.stop())
    return f"{5 * ctx.concurrency} clients for {ctx.fault_s:.0f} s"


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("no fault", lambda stack, ctx: (time.sleep(ctx.fault_s), "baseline")[1]),
    Fault("SIGKILL redis", kill("redis")),
    Fault("SIGKILL cache_store", kill("cache_store")),
    Fault("SIGKILL router", kill("router"), client_retries_allowed=True),
    Fault("SIGKILL prefill", kill("prefill-0")),
    Fault("SIGKILL decode", kill("decode-1")),
    Fault("SIGSTOP decode 10 s", pause_decode),
    Fault("Redis restart", restart_redis),
    Fault("Redis +50 ms latency", redis_latency),
    Fault("corrupt blocks", corrupt_blocks, must_miss="corrupt"),
    Fault("evicted blocks", evict_blocks),
    Fault("200 clients disconnect", disconnect_clients),
    Fault("overload 5x", overload),
]}

FULL = list(FAULTS)
# One row per process kind: what `make test-slow` runs (tests/integration/test_chaos.py).
REDUCED = ["SIGKILL redis", "SIGKILL cache_store", "SIGKILL router", "SIGKILL prefill", "SIGKILL decode"]
