"""The slice of a worker's runtime that services/worker/transfer.py uses, over a given
pool and swapper: for tests of the transfer code without a model or a service."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from kernels.swap import BlockSwapper
from libs.blocks.keys import Namespace
from libs.kvpool.codec import BlockCodec
from libs.kvpool.layout import KVLayout
from libs.kvpool.pool import BlockPool
from libs.kvpool.writer import AsyncWriter
from services.worker.runtime import WorkerMetrics


def transfer_runtime(pool: BlockPool, swapper: BlockSwapper, layout: KVLayout, namespace: Namespace, role: str = "prefill") -> SimpleNamespace:
    rt = SimpleNamespace(
        llm=SimpleNamespace(config=SimpleNamespace(block_size=namespace.block_size), swapper=swapper),
        codec=BlockCodec(layout),
        pool=pool,
        namespace=namespace,
        settings=SimpleNamespace(load_timeout_s=5.0),
        writer=AsyncWriter(pool, workers=2, queue_size=16, batch_blocks=4),
        # Every transfer must try the pool, also right after a connection was killed: the
        # worker's outage tracking (services/worker/pool_health.py) is tested on its own.
        pool_health=SimpleNamespace(usable=True, report_failure=lambda exc: None),
        role=role,  # (decode's metrics add speculative decoding's, which read an engine)
    )
    rt.metrics = WorkerMetrics.create(CollectorRegistry(), rt)
    return rt
