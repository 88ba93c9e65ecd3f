"""A worker runtime for services/worker/transfer.py without an engine: the pool, a codec,
an async writer and metrics around a given swapper (the transfer tests' harness)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from prometheus_client import CollectorRegistry

from kernels.swap import BlockSwapper
from libs.blocks.keys import Namespace
from libs.kvpool.codec import BlockCodec
from libs.kvpool.layout import KVLayout
from libs.kvpool.redis_pool import RedisPool
from libs.kvpool.writer import AsyncWriter
from services.worker.runtime import WorkerMetrics

LAYOUT = KVLayout(2, 2, 32, 16, torch.float32)
NS = Namespace(model_digest="leaks", dtype="float32", block_size=16)


def runtime(pool: RedisPool, swapper: BlockSwapper) -> SimpleNamespace:
    rt = SimpleNamespace(
        llm=SimpleNamespace(config=SimpleNamespace(block_size=16), swapper=swapper),
        codec=BlockCodec(LAYOUT),
        pool=pool,
        namespace=NS,
        settings=SimpleNamespace(load_timeout_s=5.0),
        writer=AsyncWriter(pool, workers=2, queue_size=16, batch_blocks=4),
        # Every handoff must try the pool, also right after a connection was killed: the
        # worker's outage tracking (services/worker/pool_health.py) is tested on its own.
        pool_health=SimpleNamespace(usable=True, report_failure=lambda exc: None),
        role="prefill",  # (decode's metrics add speculative decoding's, which read an engine)
    )
    rt.metrics = WorkerMetrics.create(CollectorRegistry(), rt)
    return rt
