"""``LocalCluster``: Redis, cache_store, router, prefill and decode as local, supervised processes.

Used by ``make run`` (``python -m services.launch``) and by the integration tests, so the
tests start the system exactly the way users do. Workers bind to ports the kernel picks
and register with the router themselves, as they would under ``docker compose --scale``;
Redis, cache_store and the router get a port chosen once (the router's is the user's), so
that a restarted one is found where the others expect it.

``start()`` returns once the router is *ready* (``GET /ready``: a decode instance is
registered, so a request would succeed) and every instance has registered. From then on
the :class:`~services.launch.supervisor.Supervisor` restarts any process that dies.

The services share an internal token (services/common/app.py): ``TIDEPOOL_INTERNAL_TOKEN``
from the launcher's environment, or a fresh random one. Secrets (the token, the Redis URL,
which may hold a password) reach the children through their environment, never their
command line, which any user of the machine can read; a restarted child gets the same.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.launch.processes import Child, ServiceStartError, child_env, free_port, python_argv
from services.launch.redis_cluster import LocalRedisCluster
from services.launch.redis import redis_child
from services.launch.supervisor import RestartPolicy, Supervisor


@dataclass
class ClusterConfig:
    host: str = "127.0.0.1"
    router_port: int = 8000
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    num_prefill: int = 1
    num_decode: int = 1
    threads: int | None = None  # per model process; default: the cores split between them
    redis_url: str | None = None  # an existing Redis; default: start one
    redis_cluster: int = 0  # start a local Redis Cluster of this many nodes instead of one Redis
    redis_port: int | None = None  # the port of the Redis started here; default: a free one
    pool_url: str | None = None  # where services reach Redis (e.g. a proxy in front of it); default: Redis itself
    pool_gb: float = 1.0  # Redis maxmemory; cache_store's budget is 80% of it
    redis_args: list[str] = field(default_factory=list)  # more flags for the Redis (or each cluster node) started here
    api_key: str | None = None  # the router requires it when set
    # the services' shared secret; default: TIDEPOOL_INTERNAL_TOKEN, else a random one
    internal_token: str = field(default_factory=lambda: os.environ.get("TIDEPOOL_INTERNAL_TOKEN") or secrets.token_urlsafe(32))
    log_dir: Path = Path(".run/logs")
    ready_timeout_s: float = 180.0
    supervise: bool = True  # restart any process that dies (services/launch/supervisor.py)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    router_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    instance_args: dict[str, list[str]] = field(default_factory=dict)  # one instance's own, by name ("decode-1")
    cache_store_args: list[str] = field(default_factory=list)
    echo: IO[str] | None = None  # copy every service's stdout here (make run)

    def worker_threads(self) -> int:
        if self.threads is not None:
            return self.threads
        return max(1, (os.cpu_count() or 1) // max(1, self.num_prefill + self.num_decode))


class LocalCluster:
    def __init__(self, config: ClusterConfig | None = None):
        self.config = config or ClusterConfig()
        self.redis: Child | None = None
        self.redis_nodes: LocalRedisCluster | None = None
        self.redis_url = self.config.redis_url
        self.cache_store: Child | None = None
        self.router: Child | None = None
        self.prefills: list[Child] = []
        self.decodes: list[Child] = []
        self.supervisor = Supervisor(self.config.restart_policy)
        self._redis_port: int | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> "LocalCluster":
        cfg = self.config
        try:
            if self.redis_url is None and cfg.redis_cluster:
                self.start_redis_cluster(cfg.redis_cluster)
            elif self.redis_url is None:
                self.start_redis()
            self.cache_store = self._child("cache_store", "services.cache_store", [
                "--port", str(free_port()), "--budget-bytes", str(int(cfg.pool_gb * 0.8 * 2**30)),
                *cfg.cache_store_args,
            ])
            self.cache_store.start()
            self.router = self._child("router", "services.router", [
                "--host", cfg.host, "--port", str(cfg.router_port), "--cache-store-url", self.cache_store.wait_ready(30),
                *(["--model", cfg.model] if cfg.model else []), *(["--api-key", cfg.api_key] if cfg.api_key else []),
                *cfg.router_args,
            ])
            self.router.start()
            router_url = self.router.wait_ready(60)
            self.prefills = [self._worker("prefill", i, router_url) for i in range(cfg.num_prefill)]
            self.decodes = [self._worker("decode", i, router_url) for i in range(cfg.num_decode)]
            for c in self.prefills + self.decodes:
                c.start()
            for c in self.prefills + self.decodes:
                c.wait_ready(cfg.ready_timeout_s)
            self.wait_registered(cfg.num_prefill, cfg.num_decode)
            self.wait_ready()
            if cfg.supervise:
                for c in self.children():
                    self.supervisor.watch(c)
                self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self

    def start_redis(self) -> None:
        """Start (or, with the same port, start again) the pool's Redis."""
        self._redis_port = self._redis_port or self.config.redis_port or free_port()
        if self.redis is None:
            self.redis = redis_child(
                "redis", self._redis_port, maxmemory_bytes=int(self.config.pool_gb * 2**30),
                log_dir=self.config.log_dir, echo=self.config.echo, extra_args=self.config.redis_args,
            )
        self.redis.start()
        self.redis_url = self.redis.wait_ready(10)

    @property
    def pool_url(self) -> str:
        """The Redis URL the services are given."""
        url = self.config.pool_url or self.redis_url
        assert url is not None
        return url

    def start_redis_cluster(self, nodes: int) -> None:
        """A local Redis Cluster (services/launch/redis_cluster.py); ``pool_gb`` is split between its nodes."""
        self.redis_nodes = LocalRedisCluster(
            nodes, maxmemory=int(self.config.pool_gb * 2**30 / nodes), log_dir=self.config.log_dir,
            extra_args=self.config.redis_args,
        ).start()
        self.redis_url = self.redis_nodes.url

    def stop(self) -> None:
        """Stop supervising, then everything, front to back; no process is left running."""
        self.supervisor.stop()
        for c in [self.router, *self.prefills, *self.decodes, self.cache_store, self.redis]:
            if c is not None:
                c.stop()
        if self.redis_nodes is not None:
            self.redis_nodes.close()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- pieces -------------------------------------------------------------------------

    def children(self) -> list[Child]:
        """Every process this cluster started, back to front."""
        nodes = self.redis_nodes.nodes if self.redis_nodes is not None else []
        return [c for c in [self.redis, *nodes, self.cache_store, self.router, *self.prefills, *self.decodes] if c is not None]

    def _child(self, name: str, module: str, args: list[str], threads: int | None = None) -> Child:
        env = {**child_env(threads), "TIDEPOOL_INTERNAL_TOKEN": self.config.internal_token}
        if self.redis_url is not None:
            env["TIDEPOOL_REDIS_URL"] = self.pool_url
        return Child(name, python_argv(module, *args), env=env, log_path=self.config.log_dir / f"{name}.log", echo=self.config.echo)

    def _worker(self, role: str, index: int, router_url: str) -> Child:
        cfg = self.config
        extra = cfg.prefill_args if role == "prefill" else cfg.decode_args
        args = [
            "--port", "0", "--router-url", router_url,
            "--device", cfg.device, "--dtype", cfg.dtype, "--threads", str(cfg.worker_threads()),
            "--instance-id", f"{role}-{index}",
            *(["--model", cfg.model] if cfg.model else []), *cfg.worker_args, *extra, *cfg.instance_args.get(f"{role}-{index}", []),
        ]
        return self._child(f"{role}-{index}", f"services.{role}", args, threads=cfg.worker_threads())

    def restart(self, child: Child) -> None:
        """Start a stopped or killed service again with the same arguments."""
        with child.lock:
            child.stop()
            child.start()
        child.wait_ready(self.config.ready_timeout_s)

    # -- queries ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.router is not None and self.router.url is not None
        return self.router.url

    def internal_headers(self) -> dict[str, str]:
        """What a call to an internal endpoint (prefill, decode, the pool's REST API) needs."""
        return {"X-Tidepool-Internal-Token": self.config.internal_token}

    def get_json(self, url: str, timeout: float = 5.0) -> dict:
        req = urllib.request.Request(url, headers=self.internal_headers())
        if self.config.api_key:
            req.add_header("Authorization", f"Bearer {self.config.api_key}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def workers(self) -> list[dict]:
        body = self.get_json(self.url + "/v1/workers")
        return body.get("data", body.get("workers", []))

    def ready(self) -> bool:
        """Whether the router answers ``/ready`` with 200 (a request would succeed)."""
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise ServiceStartError(f"the router is not ready after {timeout:.0f} s; see {self.config.log_dir}")
            time.sleep(0.1)

    def wait_registered(self, num_prefill: int, num_decode: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            roles = [w.get("role") for w in self.workers()]
            if roles.count("prefill") >= num_prefill and roles.count("decode") >= num_decode:
                return
            if time.monotonic() > deadline:
                raise ServiceStartError(f"instances did not register with the router: {roles}")
            time.sleep(0.1)
