"""Moving a request's KV blocks between the pool and the engine's staging buffers.

Loading (prefill's pool hits, decode's handoff): fetch the values in pipelined batches,
check each against our own layout and its key's token count, and copy it into staging.
Only the leading run of good blocks is usable (each key covers the whole prefix before
it), so the first missing or corrupt block ends the load; everything after it is
recomputed by the engine. Every block not loaded is counted with its reason.

Storing (prefill): encode the exported blocks (a copy, so staging goes back to the
engine at once) and write them under the handoff lease through the async writer. A
block the pool refuses is an error for that block only; the request goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from kernels.swap import StagingStateError
from libs.blocks import BlockKey
from libs.engine import ExportedKV, KVImport
from libs.kvpool.header import BlockDecodeError
from libs.kvpool.pool import PoolError
from libs.kvpool.writer import WriteFailed
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass
class LoadResult:
    kv_import: KVImport | None
    hit_blocks: int = 0
    miss_reasons: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    seconds: float = 0.0

    def trace(self) -> dict:
        return {"hit_blocks": self.hit_blocks, "miss_reasons": dict(self.miss_reasons), "bytes_read": self.bytes_read, "load_s": round(self.seconds, 6)}


@dataclass
class StoreResult:
    blocks_written: int = 0
    blocks_failed: int = 0
    bytes_written: int = 0
    fail_reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


async def load_blocks(rt: WorkerRuntime, keys: list[BlockKey], start: int, *, max_tokens: int) -> LoadResult:
    """Load blocks ``keys[start:]`` into staging, stopping at the first unusable one.

    ``max_tokens``: no block past this many tokens is wanted (the engine must compute
    at least the last token itself). Never raises for pool trouble: that is a miss.
    """
    t0 = time.perf_counter()
    bs = rt.llm.config.block_size
    wanted = [k for i, k in enumerate(keys) if i >= start and i * bs + k.num_tokens <= max_tokens]
    result = LoadResult(None)
    misses: Counter[str] = Counter()
    if not wanted:
        return result
    try:
        values = await asyncio.wait_for(rt.pool.get_blocks(rt.namespace, wanted), rt.settings.load_timeout_s)
    except (PoolError, asyncio.TimeoutError, OSError) as e:
        log.info("pool read failed (%s): recomputing %d blocks", e, len(wanted))
        misses["unavailable"] += len(wanted)
        return _finish(rt, result, misses, t0)
    run = 0
    while run < len(values) and values[run] is not None:
        run += 1
    if run < len(values):
        misses["absent"] += 1
        misses["after_gap"] += len(values) - run - 1
    buffers, rows_ok = await _decode_into_staging(rt, wanted[:run], values[:run], misses)
    if rows_ok:
        last = wanted[rows_ok - 1]
        end_tokens = (start + rows_ok - 1) * bs + last.num_tokens
        result.kv_import = KVImport(buffers, first_block=start, num_tokens=end_tokens, num_blocks=rows_ok)
        result.hit_blocks = rows_ok
        result.bytes_read = sum(len(v) for v in values[:rows_ok])
    else:
        for b in buffers:
            b.release()
    return _finish(rt, result, misses, t0)


def _finish(rt: WorkerRuntime, result: LoadResult, misses: Counter[str], t0: float) -> LoadResult:
    result.miss_reasons = dict(misses)
    result.seconds = time.perf_counter() - t0
    m = rt.metrics
    m.pool_hits.inc(result.hit_blocks)
    m.pool_bytes_read.inc(result.bytes_read)
    for reason, n in misses.items():
        m.pool_misses.labels(reason).inc(n)
    m.handoff_seconds.labels("load").observe(result.seconds)
    # Reasons the pool cannot see itself go into its pool-wide counters too.
    reported = {r: n for r, n in misses.items() if r.startswith("corrupt:")}
    if reported:
        asyncio.create_task(_record(rt, reported))
    return result


async def _record(rt: WorkerRuntime, reasons: dict[str, int]) -> None:
    for reason, n in reasons.items():
        try:
            await rt.pool.record_misses(reason, n)
        except (PoolError, OSError):
            pass


async def _decode_into_staging(rt, keys, values, misses: Counter[str]):
    """Acquire staging and decode values into it; returns (buffers, rows decoded OK)."""
    swapper = rt.llm.swapper
    buffers = []
    deadline = time.monotonic() + rt.settings.load_timeout_s
    for i in range(0, len(values), swapper.max_blocks):
        n = min(swapper.max_blocks, len(values) - i)
        while True:
            try:
                buffers.append(swapper.acquire(n))
                break
            except StagingStateError:
                if time.monotonic() > deadline:  # staging starved: recompute the rest
                    misses["staging_busy"] += len(values) - i
                    return buffers, i
                await asyncio.sleep(0.005)
    ok = await asyncio.to_thread(_decode_all, rt.codec, buffers, keys, values, misses)
    return buffers, ok


def _decode_all(codec, buffers, keys, values, misses: Counter[str]) -> int:
    row = 0
    for buf in buffers:
        host = buf.host
        for j in range(buf.n):
            try:
                codec.decode(values[row], host[j], expected_tokens=keys[row].num_tokens)
            except BlockDecodeError as e:
                misses[f"corrupt:{e.reason}"] += 1
                misses["after_gap"] += len(values) - row - 1
                return row
            row += 1
    return row


async def store_blocks(rt: WorkerRuntime, exported: ExportedKV, keys: list[BlockKey], skip: int, lease_id: str | None) -> StoreResult:
    """Write exported blocks ``skip:`` (those not already in the pool) under ``lease_id``."""
    t0 = time.perf_counter()
    result = StoreResult()
    try:
        values = await asyncio.to_thread(_encode_all, rt.codec, exported, skip)
    finally:
        exported.release()
    assert rt.writer is not None
    session = rt.writer.begin(lease_id=lease_id)
    try:
        for key, value in zip(keys[skip:], values):
            await session.submit(rt.namespace, key, value)
        report = await session.wait_all_done()
    except WriteFailed as e:
        report = e.report
    except PoolError as e:  # writer stopped: nothing more gets written
        session.cancel()
        log.warning("pool writer unavailable: %s", e)
        result.blocks_failed = len(values)
        result.fail_reasons = {"unavailable": len(values)}
        return _stored(rt, result, t0)
    sizes = {str(k): len(v) for k, v in zip(keys[skip:], values)}
    result.blocks_written = len(report.written)
    result.bytes_written = sum(sizes[k] for k in report.written)
    result.blocks_failed = len(report.failed)
    reasons: Counter[str] = Counter(getattr(err, "reason", type(err).__name__) for err in report.failed.values())
    result.fail_reasons = dict(reasons)
    return _stored(rt, result, t0)


def _stored(rt: WorkerRuntime, result: StoreResult, t0: float) -> StoreResult:
    result.seconds = time.perf_counter() - t0
    m = rt.metrics
    m.pool_blocks_written.inc(result.blocks_written)
    m.pool_bytes_written.inc(result.bytes_written)
    m.pool_write_failures.inc(result.blocks_failed)
    m.handoff_seconds.labels("store").observe(result.seconds)
    return result


def _encode_all(codec, exported: ExportedKV, skip: int) -> list[bytearray]:
    return [codec.encode(block, n) for i, (block, n) in enumerate(exported.blocks()) if i >= skip]
