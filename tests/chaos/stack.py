"""The real stack the chaos matrix breaks: Redis, cache_store, router, one prefill, two decodes.

It is ``make run``'s own ``LocalCluster`` (supervised: whatever the matrix kills comes back
by itself), with the services reaching Redis through a :class:`LatencyProxy` (no delay
unless a row adds one). This module also answers the two questions every row asks:

- ``problems()``: what keeps the stack from being fully healthy now (a process down or
  restarting, the router not ready, an instance missing or unusable, Redis unreachable
  from cache_store or a worker); ``[]`` when healthy. Time to recover is measured on it.
- ``leaks()``: what is still held once the load has stopped, read from cache_store's and
  each worker's ``/stats`` (and the router's ``/v1/workers``): KV blocks, staging buffers,
  requests, leases, pinned blocks, and pool blocks without bookkeeping.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.processes import free_port
from tests.chaos.proxy import LatencyProxy

KEY_PREFIX = "tidepool"  # the services' default --key-prefix


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(status, body); (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


@dataclass
class Leaks:
    """What is still held after the load stopped; every number must be 0."""

    worker_blocks: dict[str, int] = field(default_factory=dict)  # KV blocks in use, per worker
    worker_requests: dict[str, int] = field(default_factory=dict)  # running + waiting + in flight
    staging: dict[str, int] = field(default_factory=dict)  # staging buffers in use
    router_in_flight: int = 0
    leases: int = 0
    pinned_blocks: int = 0
    pool_orphans: int = 0  # block values without bookkeeping, or bookkeeping without a value
    unreadable: list[str] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return sum(self.worker_blocks.values()) + sum(self.staging.values()) + self.pinned_blocks + self.pool_orphans

    @property
    def total(self) -> int:
        return self.blocks + self.leases + sum(self.worker_requests.values()) + self.router_in_flight + len(self.unreadable)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (
            ("worker_blocks", sum(self.worker_blocks.values())), ("staging", sum(self.staging.values())),
            ("requests", sum(self.worker_requests.values())), ("router_in_flight", self.router_in_flight),
            ("leases", self.leases), ("pinned", self.pinned_blocks), ("orphans", self.pool_orphans),
        ) if v]
        return ", ".join(parts + [f"unreadable {u}" for u in self.unreadable]) or "none"


class ChaosStack:
    def __init__(self, log_dir: Path, *, lease_ttl_s: float = 10.0, num_blocks: int = 512) -> None:
        self.redis_port = free_port()
        self.proxy = LatencyProxy(self.redis_port)
        self.lease_ttl_s = lease_ttl_s
        self.cluster = LocalCluster(ClusterConfig(
            router_port=free_port(), device="cpu", threads=1, num_prefill=1, num_decode=2,
            redis_port=self.redis_port, pool_url=self.proxy.url, log_dir=log_dir,
            worker_args=["--num-blocks", str(num_blocks)],
            router_args=["--lease-ttl-s", str(lease_ttl_s)],
        ))

    def start(self) -> "ChaosStack":
        self.proxy.start()
        try:
            self.cluster.start()
        except BaseException:
            self.proxy.stop()
            raise
        return self

    def stop(self) -> None:
        self.cluster.stop()
        self.proxy.stop()

    def __enter__(self) -> "ChaosStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- handles ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.cluster.url

    @property
    def workers(self):
        return self.cluster.prefills + self.cluster.decodes

    def redis(self) -> redis.Redis:
        """A client on Redis itself (not through the proxy), for faults and checks."""
        # No retries: redis-py would send a SHUTDOWN again to the restarted server.
        return redis.Redis(port=self.redis_port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    # -- health -----------------------------------------------------------------------------

    def problems(self) -> list[str]:
        out = []
        restarting = {e.name for e in self.cluster.supervisor.events if e.back_at is None}
        for c in self.cluster.children():
            if not c.running or c.name in restarting:
                out.append(f"{c.name} down")
        if out:
            return out
        status, _ = get_json(self.url + "/ready")
        if status != 200:
            out.append(f"router not ready ({status})")
        _, body = get_json(self.url + "/v1/workers")
        usable = [w["id"] for w in body.get("data", []) if w.get("usable")]
        for c in self.workers:
            if c.name not in usable:
                out.append(f"{c.name} not registered or not usable")
        status, stats = get_json(self.cluster.cache_store.url + "/stats")
        if not stats.get("redis_up"):
            out.append("cache_store cannot reach Redis")
        for c in self.workers:
            _, stats = get_json(c.url + "/stats")
            if not (stats.get("pool") or {}).get("up"):
                out.append(f"{c.name} cannot reach Redis")
        return out

    def wait_healthy(self, timeout_s: float) -> float | None:
        """Seconds until healthy, or None if it is not within ``timeout_s``."""
        t0 = time.monotonic()
        while self.problems():
            if time.monotonic() - t0 > timeout_s:
                return None
            time.sleep(0.1)
        return time.monotonic() - t0

    # -- leaks ------------------------------------------------------------------------------

    def leaks(self) -> Leaks:
        leaks = Leaks()
        for c in self.workers:
            status, stats = get_json(c.url + "/stats")
            if status != 200:
                leaks.unreadable.append(c.name)
                continue
            e = stats["engine"]
            leaks.worker_blocks[c.name] = e["total_blocks"] - e["free_blocks"]
            leaks.worker_requests[c.name] = e["running"] + e["waiting"] + stats["in_flight"]
            leaks.staging[c.name] = stats["staging_in_use"]
        _, body = get_json(self.url + "/v1/workers")
        leaks.router_in_flight = sum(w.get("router_in_flight", 0) for w in body.get("data", []))
        status, stats = get_json(self.cluster.cache_store.url + "/stats")
        if status != 200 or not stats.get("redis_up"):
            leaks.unreadable.append("cache_store")
        else:
            leaks.leases, leaks.pinned_blocks = stats["leases"], stats["pinned_blocks"]
        try:
            leaks.pool_orphans = self._pool_orphans()
        except redis.RedisError:
            leaks.unreadable.append("redis")
        return leaks

    def _pool_orphans(self) -> int:
        """Block values the pool does not account for, and accounting without a value:
        either is a block no eviction will ever free (or a budget that lies)."""
        r = self.redis()
        prefix = f"{KEY_PREFIX}:kv:".encode()
        stored = {k[len(prefix):] for k in r.scan_iter(match=prefix + b"*", count=1000)}
        accounted = set(r.hkeys(f"{KEY_PREFIX}:size"))
        return len(stored ^ accounted)

    def wait_no_leaks(self, timeout_s: float) -> Leaks:
        """Poll until nothing is held (leases may take their TTL to expire); the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            leaks = self.leaks()
            if leaks.total == 0 or time.monotonic() > deadline:
                return leaks
            time.sleep(0.25)
