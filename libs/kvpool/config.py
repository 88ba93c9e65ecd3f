"""How to reach the pool's Redis: one frozen, validated value, passed explicitly."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# How the bulk path (libs/kvpool/bulk.py) drives its sockets.
BULK_MODELS = ("threads", "asyncio")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class PoolConfig:
    """Connection, batching and retry settings of a :class:`~libs.kvpool.redis_pool.RedisPool`.

    ``key_prefix`` separates pools sharing one Redis (tests, staging): every key the pool
    touches starts with ``<key_prefix>:``. ``pipeline_blocks`` blocks go in one pipelined
    round trip, and one call runs up to ``max_parallel`` such pipelines at once on separate
    pooled connections (``max_connections`` bounds the whole process). A dropped
    connection or a timeout is retried ``retries`` times with exponential backoff from
    ``retry_backoff_s``: every pool operation is idempotent, so a retry after a lost reply
    is safe.

    Block values travel on the bulk path (libs/kvpool/bulk.py): ``max_parallel`` sockets
    per Redis node, driven by ``bulk_model``: ``"threads"`` (blocking ``recv_into`` on a
    thread pool, the GIL released) or ``"asyncio"`` (a ``BufferedProtocol`` on the loop).
    The URL may name a standalone Redis or any node of a Redis Cluster: the mode is
    detected from the server (libs/kvpool/control.py).
    """

    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = None
    key_prefix: str = "tidepool"
    max_connections: int = 32
    connect_timeout_s: float = 2.0
    socket_timeout_s: float = 5.0
    retries: int = 2
    retry_backoff_s: float = 0.05
    pipeline_blocks: int = 16
    max_parallel: int = 4
    socket_read_size: int = 1 << 20
    bulk_model: str = "threads"

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if not _PREFIX_RE.match(self.key_prefix):
            raise ValueError(f"key_prefix must be 1-64 of [A-Za-z0-9_.-], got {self.key_prefix!r}")
        for name in ("max_connections", "pipeline_blocks", "max_parallel", "socket_read_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        for name in ("connect_timeout_s", "socket_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        if self.bulk_model not in BULK_MODELS:
            raise ValueError(f"bulk_model must be one of {BULK_MODELS}, got {self.bulk_model!r}")
        if self.max_parallel > self.max_connections:
            raise ValueError("max_parallel cannot exceed max_connections")

    def __repr__(self) -> str:
        # Never print a password (configs end up in logs), neither the field nor one in the URL.
        secret = None if self.password is None else "***"
        return (
            f"PoolConfig(url={redact_url(self.url)!r}, password={secret}, key_prefix={self.key_prefix!r}, "
            f"max_connections={self.max_connections}, pipeline_blocks={self.pipeline_blocks}, "
            f"max_parallel={self.max_parallel}, retries={self.retries}, bulk_model={self.bulk_model!r})"
        )
