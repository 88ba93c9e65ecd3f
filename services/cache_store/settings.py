"""cache_store's knobs: CLI flags and ``TIDEPOOL_*`` variables (services/common/settings.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from libs.kvpool.config import PoolConfig, redact_url
from services.common.settings import BaseSettings, setting


@dataclass(frozen=True, kw_only=True)
class CacheStoreSettings(BaseSettings):
    """Tidepool cache_store: the KV pool's budget, LRU eviction, leases and statistics."""

    port: int = setting(8300, help="TCP port to bind; 0 picks a free one")
    redis_url: str = setting("redis://127.0.0.1:6379/0", help="the pool's Redis")
    redis_password: str | None = setting(None, help="Redis password (prefer the env variable)", secret=True)
    key_prefix: str = setting("tidepool", help="prefix of every Redis key of this pool")
    redis_timeout_s: float = setting(2.0, help="Redis connect and socket timeout, seconds")
    budget_bytes: int = setting(
        1 << 30,
        help="block bytes the pool may hold; least recently used unleased blocks are evicted "
        "above it. Keep it below Redis' maxmemory (Redis adds per-key overhead)",
    )
    max_value_bytes: int = setting(64 << 20, help="largest block value accepted by PUT /v1/blocks/{key}")
    maintenance_interval_s: float = setting(
        0.5, help="seconds between policy passes (reap expired leases, evict to the budget, refresh stats)"
    )
    pressure_interval_s: float = setting(
        0.02, help="seconds between policy passes after one that had to evict (the pool is filled at its budget): "
        "eviction keeps pace with the writes instead of Redis refusing them (OOM) between passes"
    )
    memory_high_watermark: float = setting(
        0.8, help="fraction of Redis' maxmemory (the fullest server's) above which blocks are evicted below the budget: "
        "values' allocator overhead and clients' buffers count there, and Redis refuses writes (OOM) at maxmemory"
    )
    evict_batch: int = setting(256, help="most blocks one eviction script deletes (bounds Redis' pause)")
    lease_ttl_s: float = setting(30.0, help="lease TTL when POST /v1/leases names none")
    max_lease_ttl_s: float = setting(600.0, help="longest lease TTL a client may ask for")
    max_query_keys: int = setting(4096, help="most keys in one /v1/blocks/query or /v1/leases request")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")
        for name in ("max_value_bytes", "evict_batch", "max_query_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("maintenance_interval_s", "pressure_interval_s", "lease_ttl_s", "max_lease_ttl_s", "redis_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.memory_high_watermark <= 1:
            raise ValueError(f"memory_high_watermark must be in (0, 1], got {self.memory_high_watermark}")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ValueError("lease_ttl_s cannot exceed max_lease_ttl_s")
        self.pool_config()  # a bad URL or prefix fails at startup, with the usage line

    def __repr__(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}  # no secrets
        fields["redis_url"] = redact_url(self.redis_url)
        return f"CacheStoreSettings({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def pool_config(self) -> PoolConfig:
        return PoolConfig(
            url=self.redis_url,
            password=self.redis_password,
            key_prefix=self.key_prefix,
            connect_timeout_s=self.redis_timeout_s,
            socket_timeout_s=self.redis_timeout_s,
        )
