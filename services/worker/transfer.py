"""Moving a request's KV blocks between the pool and the engine's staging buffers.

Loading (prefill's pool hits, decode's handoff): take staging first, then receive the
values straight into it (``BlockPool.get_blocks_into``: the header of each value into a
small side buffer, the payload into the block's staging row, with no copy on the way),
and verify each in place against our own layout and its key's token count as soon as it
has landed (``BlockCodec.verify_landed``, from ``on_landed`` on the bulk thread that
received it, while the other blocks are still arriving: header fields and the checksum
of the payload where it lies). A load that times out keeps the leading blocks that had
landed and passed. Only the leading run of good blocks is usable (each key covers the whole prefix
before it), so the first missing or corrupt block ends the load; everything after it is
recomputed by the engine. Every block not loaded is counted with its reason: ``absent``,
``corrupt:<reason>`` (``corrupt:length`` for a value of the wrong size, never received),
``unavailable:<transport reason>`` (a timeout, a dropped connection, a lost node...),
``staging_busy``, then ``after_gap`` for the rest.

Storing (prefill): the exported blocks go to the pool as they lie in the export's staging
(``BlockCodec.encode_views``: a fresh 24-byte header, then views of the staging rows,
checksummed in place, in chunks on worker threads that overlap with the writes), under
the handoff lease, through the async writer; nothing copies the payload before the
socket does. The staging therefore goes back to the engine only
once every write is done or given up, also when the request is cancelled meanwhile. A
block the pool refuses is an error for that block only; the request goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kernels.swap import StagingStateError
from libs.blocks import BlockKey
from libs.engine import ExportedKV, KVImport
from libs.kvpool.bulk import settle
from libs.kvpool.header import HEADER_NBYTES, BlockDecodeError, value_nbytes
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
    buffers = await _acquire_staging(rt, len(wanted), misses)
    try:
        rows = sum(b.n for b in buffers)
        slots = [row for b in buffers for row in b.host]  # .host waits for copies once per buffer
        headers = np.empty((rows, HEADER_NBYTES), dtype=np.uint8)
        dests = [rt.codec.value_views(memoryview(headers[i]), slots[i], wanted[i].num_tokens) for i in range(rows)]
        verdicts: list[str | None] = ["unavailable"] * rows  # per block: None once landed and verified

        def verify(i: int) -> None:  # on a bulk thread as each value lands, overlapped with the rest
            try:
                rt.codec.verify_landed(memoryview(headers[i]), slots[i], wanted[i].num_tokens)
                verdicts[i] = None
            except BlockDecodeError as e:
                verdicts[i] = f"corrupt:{e.reason}"

        try:
            outcomes = await asyncio.wait_for(
                rt.pool.get_blocks_into(rt.namespace, wanted[:rows], dests, on_landed=verify), rt.settings.load_timeout_s
            )
            reasons = [verdicts[i] if o is None else _miss_reason(o) for i, o in enumerate(outcomes)]
        except asyncio.TimeoutError:  # what landed (and was verified) before the timeout is good
            reasons = [None if v is None else "unavailable:timeout" for v in verdicts]
        except (PoolError, OSError) as e:
            log.info("pool read failed (%s): recomputing %d blocks", e, rows)
            reasons = [None if v is None else "unavailable" for v in verdicts]
        ok = 0
        while ok < rows and reasons[ok] is None:
            ok += 1
        if ok < rows:
            misses[reasons[ok]] += 1  # type: ignore[index]
            misses["after_gap"] += rows - ok - 1
        if ok:
            last = wanted[ok - 1]
            end_tokens = (start + ok - 1) * bs + last.num_tokens
            result.kv_import = KVImport(buffers, first_block=start, num_tokens=end_tokens, num_blocks=ok)
            result.hit_blocks = ok
            result.bytes_read = sum(rt.codec.value_nbytes(k.num_tokens) for k in wanted[:ok])
        else:
            for b in buffers:
                b.release()
    except BaseException:
        # Cancelled (the client went away): get_blocks_into has stopped writing by now.
        for b in buffers:
            b.release()
        raise
    return _finish(rt, result, misses, t0)


def _miss_reason(outcome: str) -> str:
    """A get_blocks_into miss reason as the metric label: absent, corrupt:length, unavailable:<why>."""
    if outcome == "absent":
        return "absent"
    if outcome == "length":
        return "corrupt:length"
    return "unavailable" if outcome == "unavailable" else f"unavailable:{outcome}"


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


async def _acquire_staging(rt: WorkerRuntime, n: int, misses: Counter[str]) -> list:
    """Staging for ``n`` blocks, or for as many as it can get before the load timeout (the
    rest counted ``staging_busy``: the engine recomputes them)."""
    swapper = rt.llm.swapper
    buffers = []
    deadline = time.monotonic() + rt.settings.load_timeout_s
    for i in range(0, n, swapper.max_blocks):
        want = min(swapper.max_blocks, n - i)
        while True:
            try:
                buffers.append(swapper.acquire(want))
                break
            except StagingStateError:
                if time.monotonic() > deadline:
                    misses["staging_busy"] += n - i
                    return buffers
                await asyncio.sleep(0.005)
    return buffers


async def store_blocks(rt: WorkerRuntime, exported: ExportedKV, keys: list[BlockKey], skip: int, lease_id: str | None) -> StoreResult:
    """Write exported blocks ``skip:`` (those not already in the pool) under ``lease_id``.

    The blocks are encoded (checksummed in place) in chunks on worker threads, all chunks
    at once, and each chunk is handed to the writer as soon as it is ready: the
    checksums of later blocks overlap with the writes of earlier ones.
    """
    t0 = time.perf_counter()
    result = StoreResult()
    encodes: list[asyncio.Future[list[list[memoryview]]]] = []
    sizes: dict[str, int] = {}
    try:
        blocks = await asyncio.to_thread(lambda: list(exported.blocks())[skip:])  # waits for device copies
        encodes = [
            asyncio.ensure_future(asyncio.to_thread(_encode, rt.codec, blocks[i : i + _ENCODE_CHUNK]))
            for i in range(0, len(blocks), _ENCODE_CHUNK)
        ]
        assert rt.writer is not None
        session = rt.writer.begin(lease_id=lease_id)
        try:
            for c, encoded in enumerate(encodes):
                for key, value in zip(keys[skip + c * _ENCODE_CHUNK :], await encoded):
                    sizes[str(key)] = value_nbytes(value)
                    await session.submit(rt.namespace, key, value)
            report = await session.wait_all_done()
        except WriteFailed as e:
            report = e.report
        except PoolError as e:  # writer stopped: nothing more gets written
            session.cancel()
            await session.settled()
            log.warning("pool writer unavailable: %s", e)
            result.blocks_failed = len(blocks)
            result.fail_reasons = {"unavailable": len(blocks)}
            return _stored(rt, result, t0)
        except BaseException:
            # Cancelled: the values are views of the export's staging, so no write may
            # still be reading them when it goes back to the engine.
            session.cancel()
            await session.settled()
            raise
    finally:
        for encoded in encodes:  # a thread may still be checksumming staging
            await settle(encoded)
        exported.release()
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


_ENCODE_CHUNK = 8  # blocks checksummed per worker-thread task


def _encode(codec, blocks) -> list[list[memoryview]]:
    return [codec.encode_views(block, n) for block, n in blocks]
