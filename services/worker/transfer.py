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

A :class:`StagedRun` holds the staging rows of one such run and is filled in order: by one
fetch (:func:`load_blocks`), or by several as prefill makes more blocks durable (the
streamed handoff, services/decode/handoff.py). What is loaded when is the callers' flow;
:meth:`StagedRun.fetch` is where the bytes move from the pool into staging.

Storing (prefill): the exported blocks go to the pool as they lie in the export's staging
(``BlockCodec.encode_pending``: a fresh 24-byte header, then views of the staging rows),
under the handoff lease, through the async writer. On a GPU the swap that staged the
blocks computed each one's checksum there (kernels/digest, ``ExportedKV.digests``), so the
value goes out with it (``encode_digested``) and no CPU reads the payload but the socket;
elsewhere each value is checksummed in place by the bulk thread that sends it, right
before its ``sendmsg`` (no hop of its own, the GIL released). Nothing copies the payload
before the socket does. The staging therefore goes back to the engine only
once every write is done or given up, also when the request is cancelled meanwhile. A
block the pool refuses is an error for that block only; the request goes on. A streamed
prefill stores each exported piece as the engine hands it out (``ExportedKV.first_block``
says where it starts); the request's store time is the caller's to observe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kernels.swap import StagingBuffer, StagingStateError
from libs.blocks import BlockKey
from libs.engine import ExportedKV, KVImport
from libs.kvpool.header import HEADER_NBYTES, BlockDecodeError
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
    done_at: float = 0.0  # wall clock (time.time()) when the load ended: traces compare it across processes

    def trace(self) -> dict:
        return {"hit_blocks": self.hit_blocks, "miss_reasons": dict(self.miss_reasons), "bytes_read": self.bytes_read, "load_s": round(self.seconds, 6)}


@dataclass
class StoreResult:
    blocks_written: int = 0
    blocks_failed: int = 0
    bytes_written: int = 0
    fail_reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    written: set[str] = field(default_factory=set)  # str(BlockKey) of each block written

    def add(self, other: "StoreResult") -> None:
        """Fold another piece's result into this one (``seconds`` is the caller's)."""
        self.blocks_written += other.blocks_written
        self.blocks_failed += other.blocks_failed
        self.bytes_written += other.bytes_written
        self.fail_reasons = dict(Counter(self.fail_reasons) + Counter(other.fail_reasons))
        self.written |= other.written


def wanted_blocks(rt: WorkerRuntime, keys: list[BlockKey], start: int, max_tokens: int) -> list[BlockKey]:
    """``keys[start:]`` that end within the first ``max_tokens`` tokens."""
    bs = rt.llm.config.block_size
    return [k for i, k in enumerate(keys) if i >= start and i * bs + k.num_tokens <= max_tokens]


class StagedRun:
    """Staging rows for the blocks ``first_block, first_block + 1, ...`` (at most
    ``capacity`` of them), filled in order by :meth:`fetch`; staging is acquired as rows
    are needed, one buffer of ``swap_max_blocks`` rows at a time.

    The first block that cannot be used (absent, corrupt, pool or staging unavailable)
    breaks the run: nothing after it is loaded. ``misses`` counts every block of the
    capacity not loaded, by reason, once :meth:`finish` is called.
    """

    def __init__(self, rt: WorkerRuntime, first_block: int, capacity: int) -> None:
        self.rt = rt
        self.first_block = first_block
        self.capacity = capacity
        self.buffers: list[StagingBuffer] = []
        self._hosts: list[np.ndarray] = []  # each buffer's byte rows (BlockCodec.byte_rows; taken once: .host waits for copies)
        self.filled = 0
        self.end_tokens = 0  # prompt tokens covered by the filled rows
        self.bytes_read = 0
        self.fetch_s = 0.0  # time spent in fetch (pool reads and checks)
        self.misses: Counter[str] = Counter()
        self.broken: str | None = None  # why the run ended early
        self._counted = 0  # blocks already counted in misses

    def _miss(self, reason: str, n: int = 1) -> None:
        self.misses[reason] += n
        self._counted += n
        self.broken = self.broken or reason

    async def fetch(self, keys: list[BlockKey]) -> int:
        """Load ``keys``, the next blocks of the run, into the next rows; returns how many
        were loaded. Never raises for pool trouble: that breaks the run with a reason."""
        keys = keys[: self.capacity - self.filled]
        if self.broken or not keys:
            return 0
        rt = self.rt
        if not rt.pool_health.usable:  # known down: do not wait for its timeouts
            self._miss("unavailable", len(keys))
            return 0
        t0 = time.perf_counter()
        try:
            slots = await self._rows(len(keys))
            rows = len(slots)
            headers = np.empty((rows, HEADER_NBYTES), dtype=np.uint8)
            dests = [rt.codec.value_views(memoryview(headers[i]), slots[i], keys[i].num_tokens) for i in range(rows)]
            verdicts: list[str | None] = ["unavailable"] * rows  # per block: None once landed and verified

            def verify(i: int) -> None:  # on a bulk thread as each value lands, overlapped with the rest
                try:
                    rt.codec.verify_landed(memoryview(headers[i]), slots[i], keys[i].num_tokens)
                    verdicts[i] = None
                except BlockDecodeError as e:
                    verdicts[i] = f"corrupt:{e.reason}"

            try:
                outcomes = await asyncio.wait_for(
                    rt.pool.get_blocks_into(rt.namespace, keys[:rows], dests, on_landed=verify), rt.settings.load_timeout_s
                )
                reasons = [verdicts[i] if o is None else _miss_reason(o) for i, o in enumerate(outcomes)]
            except asyncio.TimeoutError as e:  # what landed (and was verified) before the timeout is good
                rt.pool_health.report_failure(e)
                reasons = [None if v is None else "unavailable:timeout" for v in verdicts]
            except (PoolError, OSError) as e:
                log.info("pool read failed (%s): recomputing from block %d", e, self.first_block + self.filled)
                rt.pool_health.report_failure(e)
                reasons = [None if v is None else "unavailable" for v in verdicts]
            ok = 0
            while ok < rows and reasons[ok] is None:
                ok += 1
            if ok < rows:
                self._miss(reasons[ok])  # type: ignore[arg-type]
            if ok:
                self.filled += ok
                self.end_tokens = (self.first_block + self.filled - 1) * rt.llm.config.block_size + keys[ok - 1].num_tokens
                self.bytes_read += sum(rt.codec.value_nbytes(k.num_tokens) for k in keys[:ok])
            return ok
        finally:
            self.fetch_s += time.perf_counter() - t0

    async def _rows(self, n: int) -> list[np.ndarray]:
        """Host rows for the next ``n`` blocks, acquiring staging as needed (waiting up to
        ``load_timeout_s`` for a free buffer; past that the rest counts ``staging_busy``:
        the engine recomputes them)."""
        swapper = self.rt.llm.swapper
        m = swapper.max_blocks
        deadline = time.monotonic() + self.rt.settings.load_timeout_s
        rows = []
        for i in range(self.filled, self.filled + n):
            while i // m >= len(self.buffers):
                try:
                    buf = swapper.acquire(min(m, self.capacity - len(self.buffers) * m))
                except StagingStateError:
                    if time.monotonic() > deadline:
                        self._miss("staging_busy", self.capacity - i)
                        return rows
                    await asyncio.sleep(0.005)
                    continue
                self.buffers.append(buf)
                self._hosts.append(self.rt.codec.byte_rows(buf.host))
            rows.append(self._hosts[i // m][i % m])
        return rows

    def finish(self) -> KVImport | None:
        """Count what was not loaded (``after_gap`` behind a break) and hand the filled
        rows over as a ``KVImport``, releasing staging nothing was loaded into."""
        left = self.capacity - self.filled - self._counted
        if left > 0 and self.broken:
            self.misses["after_gap"] += left
            self._counted += left
        keep = -(-self.filled // self.rt.llm.swapper.max_blocks)
        for b in self.buffers[keep:]:
            b.release()
        self.buffers, self._hosts = self.buffers[:keep], self._hosts[:keep]
        if not self.filled:
            return None
        return KVImport(self.buffers, first_block=self.first_block, num_tokens=self.end_tokens, num_blocks=self.filled)

    def release(self) -> None:
        """Give every buffer back (a cancelled load: get_blocks_into has stopped writing)."""
        buffers, self.buffers, self._hosts = self.buffers, [], []
        for b in buffers:
            b.release()


async def load_blocks(rt: WorkerRuntime, keys: list[BlockKey], start: int, *, max_tokens: int) -> LoadResult:
    """Load blocks ``keys[start:]`` into staging, stopping at the first unusable one.

    ``max_tokens``: no block past this many tokens is wanted (the engine must compute
    at least the last token itself). Never raises for pool trouble: that is a miss.
    """
    t0 = time.perf_counter()
    wanted = wanted_blocks(rt, keys, start, max_tokens)
    if not wanted:
        return LoadResult(None)
    run = StagedRun(rt, start, len(wanted))
    try:
        await run.fetch(wanted)
    except BaseException:
        run.release()
        raise
    return finish_load(rt, run, time.perf_counter() - t0)


def _miss_reason(outcome: str) -> str:
    """A get_blocks_into miss reason as the metric label: absent, corrupt:length, unavailable:<why>."""
    if outcome == "absent":
        return "absent"
    if outcome == "length":
        return "corrupt:length"
    return "unavailable" if outcome == "unavailable" else f"unavailable:{outcome}"


def finish_load(rt: WorkerRuntime, run: StagedRun, seconds: float) -> LoadResult:
    """Close a load that took ``seconds``: its ``KVImport``, counted misses and metrics
    (one load per request)."""
    result = LoadResult(run.finish(), hit_blocks=run.filled, bytes_read=run.bytes_read)
    result.miss_reasons = dict(run.misses)
    result.seconds = seconds
    result.done_at = time.time()
    m = rt.metrics
    m.pool_hits.inc(result.hit_blocks)
    m.pool_bytes_read.inc(result.bytes_read)
    for reason, n in run.misses.items():
        m.pool_misses.labels(reason).inc(n)
    m.handoff_seconds.labels("load").observe(result.seconds)
    # Reasons the pool cannot see itself go into its pool-wide counters too.
    reported = {r: n for r, n in run.misses.items() if r.startswith("corrupt:")}
    if reported:
        asyncio.create_task(_record(rt, reported))
    return result


async def _record(rt: WorkerRuntime, reasons: dict[str, int]) -> None:
    for reason, n in reasons.items():
        try:
            await rt.pool.record_misses(reason, n)
        except (PoolError, OSError):
            pass


async def store_blocks(
    rt: WorkerRuntime, exported: ExportedKV, keys: list[BlockKey], skip: int, lease_id: str | None,
    on_written: Callable[[str], None] | None = None,
) -> StoreResult:
    """Write the exported blocks (``keys[exported.first_block:]`` on) that are not among the
    first ``skip`` (those already in the pool) under ``lease_id``; releases the staging
    once every write settled. ``on_written(str(key))`` hears of each block as soon as it is
    written (the streamed handoff announces it durable from there).

    Each block goes to the writer at once: header and views of its staging row, with the
    checksum the GPU computed, or as a pending value that the bulk thread sending it
    checksums first (so later blocks' checksums overlap with earlier blocks' writes and
    cost the event loop nothing).
    Counts what it wrote in the metrics; the request's store time is the caller's to observe.
    """
    t0 = time.perf_counter()
    result = StoreResult()
    first = max(skip, exported.first_block)
    if not rt.pool_health.usable:  # known down: decode recomputes these blocks
        n = max(0, exported.end_block - first)
        await asyncio.to_thread(lambda: [b.host for b in exported.buffers])  # device copies land first
        exported.release()
        result.blocks_failed = n
        result.fail_reasons = {"unavailable": n} if n else {}
        return _stored(rt, result, t0)
    sizes: dict[str, int] = {}
    try:
        # Waits for the device copies; then one numpy view per staging buffer (no torch call per block).
        blocks = (await asyncio.to_thread(_slots, rt.codec, exported))[first - exported.first_block :]
        assert rt.writer is not None
        session = rt.writer.begin(lease_id=lease_id, on_written=on_written)
        try:
            for key, (slot, n, digest) in zip(keys[first:], blocks):
                # Digested on the GPU by the swap that staged it, or sealed by the bulk thread that sends it.
                value = rt.codec.encode_pending(slot, n) if digest is None else rt.codec.encode_digested(slot, n, digest)
                sizes[str(key)] = rt.codec.value_nbytes(n)
                await session.submit(rt.namespace, key, value)
            report = await session.wait_all_done()
        except WriteFailed as e:
            report = e.report
        except PoolError as e:  # writer stopped: nothing more gets written
            session.cancel()
            await session.settled()
            log.warning("pool writer unavailable: %s", e)
            rt.pool_health.report_failure(e)
            result.blocks_failed = len(blocks)
            result.fail_reasons = {"unavailable": len(blocks)}
            return _stored(rt, result, t0)
        except BaseException:
            # Cancelled: the values are views of the export's staging, so no write may
            # still be reading (or checksumming) them when it goes back to the engine.
            session.cancel()
            await session.settled()
            raise
    finally:
        exported.release()
    result.written = set(report.written)
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
    return result


def _slots(codec, exported: ExportedKV) -> list[tuple[np.ndarray, int, int | None]]:
    """``(slot, tokens, digest)`` of every block of ``exported``, slots as byte rows, digests
    where the swap computed them (blocks until its device copies landed)."""
    rows = [row for buf in exported.buffers for row in codec.byte_rows(buf.host)]
    bs, first = exported.block_size, exported.first_block
    digests = exported.digests()
    return [(row, min(bs, exported.num_tokens - (first + j) * bs), digests[j]) for j, row in enumerate(rows)]
