"""The router's Prometheus metrics, on the app's own registry (services/common).

Latency histograms are observed once per request (TTFT, end-to-end) or per choice (time
per output token); pool numbers come from the merged handoff trace, so they count what
the instances reported for this router's requests. Instance load is read from the
registry at scrape time by :class:`InstanceCollector`, so a dropped instance's series
disappear with it instead of freezing at their last value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.registry import Registry
from services.router.trace import RequestTrace

if TYPE_CHECKING:
    from services.router.admission import Admission
    from services.router.executor import BoundedExecutor

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class InstanceCollector(Collector):
    """Per-instance load as last reported by heartbeats, plus live instance counts."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["instance", "role"]
        families = {
            "running": GaugeMetricFamily("tidepool_instance_running", "requests in the instance's running batch", labels=labels),
            "waiting": GaugeMetricFamily("tidepool_instance_waiting", "requests waiting in the instance's scheduler", labels=labels),
            "queue_depth": GaugeMetricFamily("tidepool_instance_queue_depth", "requests inside the instance (HTTP side)", labels=labels),
            "free_blocks": GaugeMetricFamily("tidepool_instance_free_kv_blocks", "free KV cache blocks", labels=labels),
            "total_blocks": GaugeMetricFamily("tidepool_instance_total_kv_blocks", "KV cache blocks", labels=labels),
        }
        in_flight = GaugeMetricFamily(
            "tidepool_instance_router_in_flight", "this router's requests running on the instance", labels=labels
        )
        live = GaugeMetricFamily("tidepool_router_instances", "live registered instances", labels=["role", "usable"])
        counts = {(role, usable): 0 for role in ("prefill", "decode") for usable in ("true", "false")}
        for role in ("prefill", "decode"):
            for inst in self.registry.live(role):  # type: ignore[arg-type]
                counts[(role, "true" if inst.unusable is None else "false")] += 1
                in_flight.add_metric([inst.id, role], inst.in_flight)
                if inst.load is not None:
                    for name, family in families.items():
                        family.add_metric([inst.id, role], getattr(inst.load, name))
        for (role, usable), n in counts.items():
            live.add_metric([role, usable], n)
        yield from families.values()
        yield in_flight
        yield live


@dataclass
class RouterMetrics:
    """Every metric the router exports; each is moved by code on the request path."""

    requests: Counter
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    running: Gauge
    waiting: Gauge
    prompt_tokens: Counter
    completion_tokens: Counter
    cached_tokens: Counter
    prefill_decisions: Counter
    resumptions: Counter
    aborts: Counter
    pool_hits: Counter
    pool_misses: Counter
    pool_bytes: Counter
    handoff: Histogram
    handoff_updates: Counter
    registrations: Counter
    instances_dropped: Counter
    overloaded: Counter
    instance_full: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, instances: Registry) -> "RouterMetrics":
        registry.register(InstanceCollector(instances))
        return cls(
            requests=Counter("tidepool_router_requests", "finished API requests, by endpoint and outcome", ["endpoint", "outcome"], registry=registry),
            ttft=Histogram("tidepool_router_ttft_seconds", "request arrival to its first completion token sent", buckets=_LATENCY, registry=registry),
            tpot=Histogram("tidepool_router_time_per_output_token_seconds", "per choice: (last token - first token) / (tokens - 1)", buckets=_PER_TOKEN, registry=registry),
            e2e=Histogram("tidepool_router_e2e_latency_seconds", "request arrival to its last byte", buckets=_LATENCY, registry=registry),
            running=Gauge("tidepool_router_requests_running", "requests streaming tokens now", registry=registry),
            waiting=Gauge("tidepool_router_requests_waiting", "accepted requests without their first token yet", registry=registry),
            prompt_tokens=Counter("tidepool_router_prompt_tokens", "prompt tokens of finished requests", registry=registry),
            completion_tokens=Counter("tidepool_router_completion_tokens", "completion tokens of finished requests", registry=registry),
            cached_tokens=Counter("tidepool_router_cached_prompt_tokens", "prompt tokens served from a cache instead of computed", registry=registry),
            prefill_decisions=Counter("tidepool_router_prefill_decisions", "what happened to each prompt's prefill", ["decision"], registry=registry),
            resumptions=Counter("tidepool_router_decode_resumptions", "broken decode streams resumed elsewhere, by reason", ["reason"], registry=registry),
            aborts=Counter("tidepool_router_aborts", "requests aborted downstream, by reason", ["reason"], registry=registry),
            pool_hits=Counter("tidepool_router_pool_hit_blocks", "KV blocks instances loaded from the pool for this router's requests", registry=registry),
            pool_misses=Counter("tidepool_router_pool_miss_blocks", "KV blocks instances could not load from the pool, by reason", ["reason"], registry=registry),
            pool_bytes=Counter("tidepool_router_pool_bytes", "KV bytes moved through the pool, by direction", ["direction"], registry=registry),
            handoff=Histogram("tidepool_router_handoff_seconds", "pool time of a handoff not overlapped with prefill's compute (prefill's writes after compute + decode's loads after prefill's result)", buckets=_LATENCY, registry=registry),
            handoff_updates=Counter("tidepool_router_handoff_updates", "streamed handoff: prefill progress updates forwarded to decode, by kind (progress, final, failed)", ["kind"], registry=registry),
            registrations=Counter("tidepool_router_registrations", "instance registrations, by role", ["role"], registry=registry),
            instances_dropped=Counter("tidepool_router_instances_dropped", "instances dropped for missed heartbeats, by role", ["role"], registry=registry),
            instance_full=Counter("tidepool_router_instance_full", "429s from instances at their queue bound, by role", ["role"], registry=registry),
            overloaded=Counter("tidepool_router_overloaded", "requests answered 429, by reason (queue_full, queue_timeout, router_busy, instances_full)", ["reason"], registry=registry),
        )

    @staticmethod
    def watch_limits(registry: CollectorRegistry, admission: "Admission", executor: "BoundedExecutor") -> None:
        """Gauges read at scrape time from the admission queue and the prepare executor."""
        Gauge("tidepool_router_slots_running", "requests holding an admission slot", registry=registry).set_function(lambda: admission.running)
        Gauge("tidepool_router_slots_waiting", "requests waiting for an admission slot", registry=registry).set_function(lambda: admission.waiting)
        Gauge("tidepool_router_prepare_pending", "requests being prepared or waiting for a prepare thread", registry=registry).set_function(lambda: executor.pending)

    def observe_trace(self, trace: RequestTrace) -> None:
        """Pool and handoff numbers of a finished request."""
        t = trace.totals()
        self.pool_hits.inc(t.blocks_hit)
        for reason, n in t.blocks_missed.items():
            self.pool_misses.labels(reason).inc(n)
        self.pool_bytes.labels("written").inc(t.bytes_written)
        self.pool_bytes.labels("read").inc(t.bytes_read)
        for seconds in t.handoffs_s:
            self.handoff.observe(seconds)
