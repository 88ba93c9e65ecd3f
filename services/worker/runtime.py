"""One prefill or decode instance's moving parts, built once at start-up.

``WorkerRuntime`` owns the engine (on its worker thread, via ``AsyncEngine``), the pool
client and writer, the block codec, the Prometheus metrics, and the registration and
heartbeat loop with the router. The pool is optional at run time: while Redis is away
every transfer is a miss and the instance keeps serving by recomputing.

Going down, the instance deregisters first (``DeregisterInstance``), so the router stops
sending it work at once. Under tensor parallelism (``--tensor-parallel-size``) a rank
that dies takes the whole instance down that way: the engine's watcher reports it, the
instance deregisters and stops itself (SIGTERM: the usual graceful shutdown, whose open
streams end with an error the router resumes elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from libs.blocks import BlockKey, block_keys
from libs.engine import EngineConfig, LLMEngine
from libs.engine.async_engine import AsyncEngine
from libs.kvpool.codec import BlockCodec
from libs.kvpool.config import PoolConfig
from libs.kvpool.redis_pool import RedisPool
from libs.kvpool.writer import AsyncWriter
from libs.model.weight_cache import resolve_cache_dir
from libs.protocol import encode, internal_headers
from libs.protocol.messages import DeregisterInstance, Heartbeat, RegisterInstance
from services.common import configure_torch_threads
from services.worker.pool_health import PoolHealth
from services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class WorkerMetrics:
    """Every metric an instance exports. Each is moved by code on the request path."""

    requests: Counter
    request_seconds: Histogram
    step_seconds: Histogram
    pool_hits: Counter
    pool_misses: Counter
    pool_bytes_read: Counter
    pool_bytes_written: Counter
    pool_blocks_written: Counter
    pool_write_failures: Counter
    handoff_seconds: Histogram
    ttft_seconds: Histogram
    tpot_seconds: Histogram
    streamed_blocks: Counter
    early_blocks: Counter
    handoff_updates: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, runtime: "WorkerRuntime") -> "WorkerMetrics":
        snap = lambda name: (lambda: getattr(runtime.engine.snapshot, name))  # noqa: E731
        for name, help_, attr in (
            ("tidepool_requests_running", "requests in the running batch", "running"),
            ("tidepool_requests_waiting", "requests waiting for the batch", "waiting"),
            ("tidepool_kv_blocks_free", "free KV cache blocks", "free_blocks"),
            ("tidepool_kv_blocks_total", "KV cache blocks", "total_blocks"),
            ("tidepool_kv_exports_pending", "finished prompts waiting for staging", "pending_exports"),
        ):
            Gauge(name, help_, registry=registry).set_function(snap(attr))
        Gauge("tidepool_kv_blocks_used", "KV cache blocks in use", registry=registry).set_function(
            lambda: runtime.engine.snapshot.total_blocks - runtime.engine.snapshot.free_blocks
        )
        Gauge("tidepool_pool_up", "1 while the pool's Redis answers, 0 while it is known to be down", registry=registry).set_function(
            lambda: 1.0 if runtime.pool_health.up else 0.0
        )
        Gauge("tidepool_pool_outages", "times the pool became unreachable (cumulative)", registry=registry).set_function(
            lambda: runtime.pool_health.outages
        )
        Gauge("tidepool_prefix_cache_hit_blocks", "blocks served by the local prefix cache (cumulative)", registry=registry).set_function(snap("prefix_hit_blocks"))
        Gauge("tidepool_generated_tokens", "tokens generated (cumulative)", registry=registry).set_function(snap("generated_tokens"))
        Gauge("tidepool_prompt_tokens_computed", "prompt tokens computed (cumulative)", registry=registry).set_function(snap("prompt_tokens_computed"))
        Gauge("tidepool_preemptions", "sequences preempted (cumulative)", registry=registry).set_function(snap("preemptions"))
        if runtime.role == "decode":
            registry.register(SpecDecodeCollector(runtime))
        return cls(
            requests=Counter("tidepool_worker_requests", "requests handled, by outcome", ["outcome"], registry=registry),
            request_seconds=Histogram("tidepool_worker_request_seconds", "request latency inside this instance", buckets=_LATENCY_BUCKETS, registry=registry),
            step_seconds=Histogram("tidepool_engine_step_seconds", "engine step duration", buckets=_LATENCY_BUCKETS, registry=registry),
            pool_hits=Counter("tidepool_pool_hit_blocks", "blocks loaded from the pool", registry=registry),
            pool_misses=Counter("tidepool_pool_miss_blocks", "blocks not loaded from the pool, by reason", ["reason"], registry=registry),
            pool_bytes_read=Counter("tidepool_pool_read_bytes", "bytes read from the pool", registry=registry),
            pool_bytes_written=Counter("tidepool_pool_written_bytes", "bytes written to the pool", registry=registry),
            pool_blocks_written=Counter("tidepool_pool_written_blocks", "blocks written to the pool", registry=registry),
            pool_write_failures=Counter("tidepool_pool_write_failed_blocks", "blocks whose write failed", registry=registry),
            handoff_seconds=Histogram("tidepool_handoff_seconds", "pool transfer time of one request, by phase", ["phase"], buckets=_LATENCY_BUCKETS, registry=registry),
            ttft_seconds=Histogram("tidepool_worker_ttft_seconds", "arrival to first token produced here", buckets=_LATENCY_BUCKETS, registry=registry),
            tpot_seconds=Histogram("tidepool_worker_tpot_seconds", "time per output token after the first", buckets=_LATENCY_BUCKETS, registry=registry),
            streamed_blocks=Counter("tidepool_prefill_streamed_blocks", "prefill: blocks durable in the pool before their prompt finished computing (streamed handoff)", registry=registry),
            early_blocks=Counter("tidepool_handoff_early_blocks", "decode: blocks loaded before prefill finished (streamed handoff)", registry=registry),
            handoff_updates=Counter("tidepool_handoff_updates", "decode: prefill progress updates received, by kind (progress, final, failed)", ["kind"], registry=registry),
        )


class SpecDecodeCollector:
    """Speculative decoding counters under vLLM's names (``*_total`` as counters), read from
    the engine's snapshot at scrape time; zeros on a decode instance that does not speculate."""

    def __init__(self, runtime: "WorkerRuntime"):
        self._runtime = runtime

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._runtime.engine.snapshot.spec_decode or {}
        for name, help_ in (
            ("num_drafts", "speculative rounds with at least one draft token"),
            ("num_draft_tokens", "draft tokens verified"),
            ("num_accepted_tokens", "draft tokens accepted"),
        ):
            yield CounterMetricFamily(f"tidepool_spec_decode_{name}", help_, value=s.get(name, 0))
        per_pos = CounterMetricFamily("tidepool_spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by position", labels=["position"])
        for i, n in enumerate(s.get("num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        yield GaugeMetricFamily("tidepool_spec_decode_mean_acceptance_length", "1 + accepted / drafts", value=s.get("mean_acceptance_length", 0.0))


def engine_config(settings: WorkerSettings, role: Role) -> EngineConfig:
    """The engine a worker of ``role`` runs, from its settings (flags and environment)."""
    return EngineConfig(
        model=settings.model,
        device=settings.device,
        dtype=settings.dtype,
        block_size=settings.block_size,
        num_blocks=settings.num_blocks,
        kv_cache_gb=settings.kv_cache_gb,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        enable_prefix_caching=settings.enable_prefix_caching,
        attention_backend=settings.attention_backend,
        quantized_weights=settings.quantized_weights,
        packed_linears=settings.packed_linears,
        moe_strategy=settings.moe_strategy,
        moe_fake_balance=settings.moe_fake_balance,
        quantization=settings.quantization,
        async_scheduling=settings.async_scheduling,
        weight_cache_dir=str(cache) if (cache := resolve_cache_dir(settings.cache_dir)) else None,
        num_threads=settings.threads,
        swap_buffers=settings.swap_buffers,
        swap_max_blocks=settings.swap_max_blocks,
        swap_digests={"auto": None, "on": True, "off": False}[settings.swap_digests],
        # Decode speculates; prefill computes prompts and samples one token: unchanged.
        speculative_config=settings.speculative_config if role == "decode" else None,
        tensor_parallel_size=settings.tensor_parallel_size,
        tp_timeout_s=settings.tp_timeout_s,
        tp_all_reduce=settings.tp_all_reduce,
    )


class WorkerRuntime:
    def __init__(self, settings: WorkerSettings, role: Role):
        self.settings = settings
        self.role = role
        self.instance_id = settings.instance_id or f"{role}-{secrets.token_hex(4)}"
        configure_torch_threads(settings.threads)
        cfg = engine_config(settings, role)
        llm = LLMEngine(cfg)
        self.llm = llm
        self.namespace = llm.namespace
        self.codec = BlockCodec(llm.layout)
        self.registry = CollectorRegistry()
        self.engine = AsyncEngine(llm, on_step=self._on_step)
        self.metrics = WorkerMetrics.create(self.registry, self)
        self.pool = RedisPool(
            PoolConfig(
                url=settings.redis_url, password=settings.redis_password, key_prefix=settings.key_prefix,
                bulk_model=settings.pool_bulk_model, max_parallel=settings.pool_sockets,
            )
        )
        self.pool_health = PoolHealth(self.pool, check_s=settings.pool_check_s, timeout_s=settings.pool_check_s)
        self.writer: AsyncWriter | None = None
        self.in_flight = 0  # HTTP requests inside this instance (queue depth for the router)
        # decode: requests waiting on a streamed handoff, by id (services/decode/handoff.py)
        self.handoffs: dict[str, Any] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._http: aiohttp.ClientSession | None = None
        self.url: str | None = settings.advertise_url
        self.registered = False
        self.failure: str | None = None  # why the instance cannot serve (a dead TP rank)
        self._leaving = False  # deregistered or deregistering: no more heartbeats
        self._loop: asyncio.AbstractEventLoop | None = None
        if llm.tp is not None:
            llm.tp.on_failure(self._rank_failed)

    def _on_step(self, seconds: float, running: int) -> None:
        self.metrics.step_seconds.observe(seconds)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is: in the engine, or waiting on its handoff."""
        waiting = self.handoffs.get(request_id)
        if waiting is not None:
            waiting.abort()
        self.engine.abort(request_id)

    def keys(self, token_ids: list[int]) -> list[BlockKey]:
        return block_keys(self.namespace, token_ids)

    def cached_prefix_blocks(self, token_ids: list[int]) -> int:
        """Leading blocks the local prefix cache holds right now (a hint: it may change)."""
        return self.llm.block_manager.count_cached_prefix(token_ids)

    # -- lifecycle ----------------------------------------------------------------------

    def _rank_failed(self, reason: str) -> None:
        """A tensor-parallel rank died (on the watcher thread): deregister, then stop."""
        self.failure = reason
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._go_down(reason), loop)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    async def _go_down(self, reason: str) -> None:
        log.error("taking the instance down: %s", reason)
        await self.deregister(reason)
        os.kill(os.getpid(), signal.SIGTERM)

    async def deregister(self, reason: str) -> None:
        """Tell the router we are gone (best effort) and stop heartbeating."""
        if self._leaving:
            return
        self._leaving = True
        if self._http is None or not self.registered:
            return
        try:
            msg = DeregisterInstance(instance_id=self.instance_id, role=self.role, reason=reason)
            status, _ = await self._post("/internal/v1/deregister", encode(msg))
            log.info("deregistered from router %s (%d): %s", self.settings.router_url, status, reason)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.warning("could not deregister (%s); the router drops us after missed heartbeats", e)
        self.registered = False

    async def start(self, app_url: str | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self.writer = AsyncWriter(self.pool, workers=self.settings.pool_workers, batch_blocks=self.settings.pool_write_batch)
        if self.url is None and app_url is not None:
            self.url = app_url
        self._tasks.append(asyncio.create_task(self.pool_health.run(), name="pool health"))
        if self.settings.router_url:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=5), headers=internal_headers(self.settings.internal_token)
            )
            self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))

    async def stop(self) -> None:
        await self.deregister(self.failure or "stopping")
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.writer is not None:
            await self.writer.close()
        await self.engine.stop()
        if self._http is not None:
            await self._http.close()
        await self.pool.close()
        self.llm.close()  # staging, and under TP the other ranks

    def stats(self) -> dict[str, Any]:
        s = self.engine.snapshot
        return {
            "instance_id": self.instance_id,
            "role": self.role,
            "model": self.llm.loaded.name,
            "namespace": self.namespace.hex,
            "registered": self.registered,
            "engine": s.__dict__,
            "in_flight": self.in_flight,
            "staging_in_use": self.llm.swapper.in_use,
            "writer": self.writer.stats() if self.writer is not None else None,
            "pool": self.pool_health.stats(),
            "tensor_parallel": self._tp_stats(),
        }

    def _tp_stats(self) -> dict[str, Any]:
        tp = self.llm.tp
        if tp is None:
            return {"size": 1}
        return {"size": tp.size, "rank_pids": [os.getpid(), *tp.ranks.pids], "failure": tp.failure, "messages": tp.channel.messages,
                "all_reduce": tp.all_reduce}

    def healthy(self) -> bool:
        return self.engine.alive and self.failure is None

    # -- router registration --------------------------------------------------------------

    def registration(self) -> RegisterInstance:
        return RegisterInstance(
            instance_id=self.instance_id,
            role=self.role,
            url=self.url or "",
            model=self.llm.loaded.name,
            namespace=self.namespace.hex,
            max_model_len=self.llm.max_model_len,
            block_size=self.llm.config.block_size,
            quantization=self.namespace.quantization,
        )

    def heartbeat(self) -> Heartbeat:
        s = self.engine.snapshot
        return Heartbeat(
            instance_id=self.instance_id,
            role=self.role,
            running=s.running,
            waiting=s.waiting,
            free_blocks=min(s.free_blocks, s.total_blocks),
            total_blocks=s.total_blocks,
            queue_depth=self.in_flight,
        )

    async def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        assert self._http is not None and self.settings.router_url
        url = self.settings.router_url.rstrip("/") + path
        async with self._http.post(url, data=body, headers={"Content-Type": "application/msgpack"}) as resp:
            return resp.status, await resp.read()

    async def _heartbeat_loop(self) -> None:
        """Register, then heartbeat; re-register whenever the router forgets us (404) or
        restarts. A router that is down is retried quietly: the instance keeps serving."""
        while not self.url:  # known once the socket is bound (port 0 picks one)
            await asyncio.sleep(0.05)
        while not self._leaving:
            try:
                if not self.registered:
                    status, answer = await self._post("/internal/v1/register", encode(self.registration()))
                    self.registered = 200 <= status < 300
                    if self.registered:
                        log.info("registered with router %s as %s", self.settings.router_url, self.instance_id)
                    elif status == 401:
                        log.error("the router refused this instance's internal token: set the same "
                                  "TIDEPOOL_INTERNAL_TOKEN on every service")
                    elif 400 <= status < 500:  # refused (e.g. a quantization mismatch): say why, keep trying
                        log.warning("router %s refused registration (%d): %s", self.settings.router_url, status, answer.decode(errors="replace")[:500])
                else:
                    status, _ = await self._post("/internal/v1/heartbeat", encode(self.heartbeat()))
                    if status == 404:
                        self.registered = False
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if self.registered:
                    log.warning("router unreachable (%s); will re-register", e)
                self.registered = False
            await asyncio.sleep(self.settings.heartbeat_s)
