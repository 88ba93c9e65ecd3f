"""Prometheus view of the pool: pool-wide counters from Redis, and the policy loop's own.

The pool-wide numbers (hits, misses by reason, evictions, bytes...) are kept in Redis by
every client (libs/kvpool/redis_pool.py); this collector serves the policy loop's latest
snapshot of them, so a scrape never waits on Redis. Every family is always emitted, with
zeros before the first snapshot (a metric that is missing cannot be told from one that is
broken), and the reasons every deployment has are emitted even at zero.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from libs.kvpool.pool import PUT_ERROR_REASONS, PoolStats
from services.cache_store.policy import PolicyLoop

_EMPTY = PoolStats(blocks=0, bytes=0, leases=0, pinned_blocks=0, hits=0)
ALWAYS_MISS_REASONS = ("absent",)


def _labelled(name: str, doc: str, label: str, values: dict[str, int], always: Iterable[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key in sorted(set(always) | set(values)):
        family.add_metric([key], values.get(key, 0))
    return family


class PoolCollector(Collector):
    def __init__(self, policy: PolicyLoop) -> None:
        self.policy = policy

    def collect(self) -> Iterable[Metric]:
        s = self.policy.snapshot or _EMPTY
        c = self.policy.counters
        yield GaugeMetricFamily("tidepool_pool_blocks", "blocks in the pool", value=s.blocks)
        yield GaugeMetricFamily("tidepool_pool_bytes", "block bytes in the pool", value=s.bytes)
        yield GaugeMetricFamily("tidepool_pool_budget_bytes", "the byte budget eviction keeps to", value=self.policy.budget_bytes)
        yield GaugeMetricFamily("tidepool_pool_leases", "live leases (expired ones until reaped)", value=s.leases)
        yield GaugeMetricFamily("tidepool_pool_pinned_blocks", "blocks pinned by at least one lease", value=s.pinned_blocks)
        yield CounterMetricFamily("tidepool_pool_hits", "blocks read from the pool", value=s.hits)
        yield _labelled("tidepool_pool_misses", "blocks asked for but unusable, by reason", "reason", s.misses, ALWAYS_MISS_REASONS)
        yield CounterMetricFamily("tidepool_pool_evictions", "blocks evicted by the budget", value=s.evictions)
        yield CounterMetricFamily("tidepool_pool_evicted_bytes", "bytes evicted by the budget", value=s.evicted_bytes)
        yield CounterMetricFamily("tidepool_pool_puts", "block writes", value=s.puts)
        yield CounterMetricFamily("tidepool_pool_written_bytes", "bytes written", value=s.bytes_written)
        yield CounterMetricFamily("tidepool_pool_read_bytes", "bytes read", value=s.bytes_read)
        yield _labelled("tidepool_pool_write_errors", "refused block writes, by reason", "reason", s.write_errors, PUT_ERROR_REASONS)
        yield GaugeMetricFamily("tidepool_cache_store_redis_up", "1 if the last policy pass reached Redis", value=1 if self.policy.redis_up else 0)
        yield CounterMetricFamily("tidepool_cache_store_policy_passes", "policy passes run", value=c.passes)
        yield CounterMetricFamily("tidepool_cache_store_policy_failed_passes", "policy passes that failed", value=c.failed_passes)
        yield CounterMetricFamily("tidepool_cache_store_reaped_leases", "expired leases reaped", value=c.reaped_leases)
        yield CounterMetricFamily("tidepool_cache_store_outages", "times Redis became unreachable", value=c.outages)
        yield CounterMetricFamily(
            "tidepool_cache_store_memory_evictions", "policy passes that evicted below the budget for Redis' memory", value=c.memory_evictions
        )
        yield GaugeMetricFamily("tidepool_pool_memory_fill", "the fullest Redis server's used / max memory", value=c.memory_fill)
