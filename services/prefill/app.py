"""Prefill: compute a prompt's KV, sample its first token(s), hand the KV to the pool.

``POST /v1/prefill`` (PrefillRequest → PrefillResult), per DESIGN.md's request path:

1. A handoff lease is taken on every block key of the prompt before anything relies on
   them: before loading, where the pool holds leading blocks (they cannot be evicted
   between here and decode), else while the engine's first step runs; every block is
   written under it, pinned from its first byte.
2. Leading blocks already in the pool (and not in our own prefix cache) are loaded
   instead of computed, unless the prompt is to be scored (``prompt_logprobs``: every
   position computed; the result carries the scores).
3. The engine computes the rest (batched with other prompts, in chunks), samples the
   first token of each of the ``n`` completions, and gathers the prompt's blocks into
   staging.
4. The blocks the pool lacks, the partial tail included, are written under the lease.
   The answer goes out once every write is acknowledged or has failed; a failed block
   only costs decode a recompute.

With ``stream_progress`` (the streamed handoff, docs/HANDOFF.md) the engine hands out
each chunk's full blocks as soon as the chunk is computed (libs/engine/kv_export.py) and
they are written while the next chunk computes; the answer is a message stream of
:class:`PrefillProgress` (the leading run of blocks durable in the pool and the lease,
sent whenever they change: first right after the pool's prefix query, with the blocks that
were there already, under the lease where there are any; a fresh prompt's lease comes in
a later one), ending in the :class:`PrefillResult`. The partial tail goes last, when the
prompt is done. The first tokens go out in a progress event as soon as they are sampled,
before the last writes are acknowledged: the router streams them to the client at once,
so the client's time to its first token is the compute's, not the handoff's. A stream
that ends without a result means prefill failed: decode recomputes what is not durable
(after the first tokens, which stand: decode continues from them).

Timings: ``compute_s`` is the engine's (queue included); ``write_s`` is the pool write
time *not* overlapped with compute (from the end of compute to the last acknowledgement),
which is all of it without streaming.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from libs.blocks import BlockKey
from libs.engine import InvalidRequestError, SamplingParams
from libs.structured import GrammarMatcher
from libs.engine.async_engine import EngineStepError, RequestStream
from libs.kvpool.pool import PoolError
from libs.protocol import MessageStreamResponse, msgpack_response, read_message
from libs.protocol.messages import PrefillProgress, PrefillRequest, PrefillResult, PromptLogprobs
from services.worker.app import RUNTIME, full, rejected
from services.worker.convert import sampling_params, wall_clock, wire_logprob, wire_prompt_logprobs
from services.worker.grammar import start_grammar
from services.worker.runtime import WorkerRuntime
from services.worker.transfer import LoadResult, StoreResult, load_blocks, store_blocks

log = logging.getLogger(__name__)


class PrefillAborted(Exception):
    """The engine ended the request without a result (aborted, or a failed step)."""


async def handle_prefill(request: web.Request) -> web.StreamResponse:
    rt: WorkerRuntime = request.app[RUNTIME]
    refused = full(rt)
    if refused is not None:
        return refused
    msg = await read_message(request, PrefillRequest)
    t0 = time.perf_counter()
    prompt = msg.prompt_token_ids
    try:
        rt.llm.validate(prompt, sampling_params(msg.sampling))  # the whole request must fit
        params = sampling_params(msg.sampling, max_tokens=1)
        grammar = await start_grammar(rt, msg.sampling.structured)  # the first token is constrained too
    except InvalidRequestError as e:
        return rejected(rt, e)
    rt.in_flight += 1
    try:
        if msg.stream_progress:
            return await _prefill_streamed(request, rt, msg, params, t0, grammar)
        job = PrefillJob(rt, msg, params, t0, grammar)
        try:
            return msgpack_response(await job.run())
        except (PrefillAborted, EngineStepError) as e:
            raise web.HTTPServiceUnavailable(reason=f"request aborted: {e}") from None
    except InvalidRequestError as e:
        return rejected(rt, e)
    finally:
        rt.in_flight -= 1


async def _prefill_streamed(
    request: web.Request, rt: WorkerRuntime, msg: PrefillRequest, params: SamplingParams, t0: float, grammar: GrammarMatcher | None
) -> web.StreamResponse:
    resp = MessageStreamResponse()
    await resp.prepare(request)
    job = PrefillJob(rt, msg, params, t0, grammar)
    sender = asyncio.create_task(job.send_progress(resp), name=f"progress {msg.request_id}")
    try:
        result = await job.run()
    except (PrefillAborted, EngineStepError, InvalidRequestError) as e:
        log.info("streamed prefill of %s ended without a result: %s", msg.request_id, e)
        result = None
    finally:
        job.progress_done = True
        job.changed.set()
        await asyncio.gather(sender, return_exceptions=True)
    try:
        if result is not None:
            await resp.send(result)  # after the last PrefillProgress: the sender is done
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the router went away (it aborts the request itself)
    return resp


@dataclass
class PrefillJob:
    """One prompt: lease, pool hits, compute, and the writes of its blocks (streamed or not)."""

    rt: WorkerRuntime
    msg: PrefillRequest
    params: SamplingParams
    t0: float
    grammar: GrammarMatcher | None = None  # the request's grammar state (structured outputs)
    keys: list[BlockKey] = field(init=False)
    lease_id: str | None = None
    durable: list[bool] = field(init=False)  # per block: in the pool under the lease
    _index: dict[str, int] = field(init=False, repr=False)  # str(key) -> block index
    watermark: int = 0  # leading durable blocks
    computed_tokens: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    progress_done: bool = False
    first_token_ids: list[int] | None = None  # the n first tokens, once sampled (streamed: sent in a progress)
    first_logprobs: list | None = None
    streamed_blocks: int = 0  # blocks durable before compute finished
    compute_done_at: float = 0.0  # wall clock when compute ended (decode's ``load_done_at`` is comparable on one host)
    leased_at: float = 0.0  # wall clock when the lease was taken (or given up: the pool is down)
    started_at: float = 0.0  # wall clock when the job started (request validated, stream headers sent)
    queried_at: float = 0.0  # wall clock when the pool answered which leading blocks it holds
    lease_started_at: float = 0.0  # wall clock when taking the lease began (a fresh prompt: its first step is on the device)
    _lease: "asyncio.Task[None] | None" = field(default=None, init=False, repr=False)  # taking the lease
    prompt_scores: PromptLogprobs | None = None  # the prompt's logprobs, when asked (echo with logprobs)
    engine_time: dict[str, float] = field(default_factory=dict)  # _engine_clock's advance while this prompt computed

    def __post_init__(self) -> None:
        self.keys = self.rt.keys(self.msg.prompt_token_ids)
        self.durable = [False] * len(self.keys)
        self._index = {str(k): i for i, k in enumerate(self.keys)}

    @property
    def streamed(self) -> bool:
        return self.msg.stream_progress

    def _mark_durable(self, first: int, end: int) -> None:
        for i in range(first, end):
            self.durable[i] = True
        w = self.watermark
        while w < len(self.durable) and self.durable[w]:
            w += 1
        if w != self.watermark:
            self.watermark = w
            self.changed.set()

    async def send_progress(self, resp: MessageStreamResponse) -> None:
        """Send :class:`PrefillProgress` whenever the durable run grows (coalesced), until
        the job is done; the last one carries the final watermark."""
        sent = -1
        first_sent = False
        while True:
            await self.changed.wait()
            self.changed.clear()
            first = self.first_token_ids is not None and not first_sent
            if self.watermark != sent or self.progress_done or first:
                sent = self.watermark
                first_sent = first_sent or first
                try:
                    await resp.send(PrefillProgress(
                        request_id=self.msg.request_id, num_blocks=len(self.keys), durable_blocks=sent,
                        lease_id=self.lease_id, computed_tokens=self.computed_tokens,
                        first_token_ids=self.first_token_ids if first else None,
                        first_logprobs=self.first_logprobs if first else None,
                    ))
                except ConnectionResetError:
                    return
            if self.progress_done:
                return

    async def run(self) -> PrefillResult:
        self.started_at = time.time()
        rt, msg, keys = self.rt, self.msg, self.keys
        prompt = msg.prompt_token_ids
        full = [k for k in keys if not k.partial]
        # The pool's prefix query first, alone. A prompt with nothing in the pool goes to the
        # engine without the lease, which is taken once the engine has put the prompt's
        # first step on the device: only the writes need it, and they wait for it
        # (``_store``). The lease is ~1.3 ms of Python on this loop (16 partitions' Lua
        # calls, packed and parsed by redis-py) on the H100 host. Before the query it
        # delayed the answer by that much; beside the engine thread preparing the step, it
        # slowed the step as much (both need the GIL); while the device computes, it
        # costs nothing (bench/RESULTS.md, issue 8 round 10).
        pool_run = 0
        try:
            if rt.pool_health.usable:  # known down: compute everything without waiting for it
                pool_run = await rt.pool.exists_prefix(rt.namespace, full)
        except (PoolError, OSError) as e:
            log.info("pool unavailable for %s (%s): computing everything", msg.request_id, e)
            rt.pool_health.report_failure(e)
        self.queried_at = time.time()
        skip = min(pool_run, len(full))
        if skip:  # blocks already in the pool are pinned before anything relies on them
            self._lease = asyncio.create_task(self._take_lease(), name=f"lease {msg.request_id}")
            await asyncio.shield(self._lease)
        # The first progress: the blocks already in the pool (pinned by now), or none and no
        # lease yet (a later progress brings it). It starts decode, which must not wait for
        # the lease: a decode that joins late fetches larger runs and acts on the last
        # update later (2 ms on the H100: bench/RESULTS.md, issue 8 round 10).
        self._mark_durable(0, skip)
        self.changed.set()
        local = rt.cached_prefix_blocks(prompt)
        load = LoadResult(None)
        if pool_run > local and self.params.prompt_logprobs is None:  # a prompt to score is computed whole
            load = await load_blocks(rt, keys[:pool_run], local, max_tokens=len(prompt) - 1)

        t_engine = time.perf_counter()
        engine0 = _engine_clock(rt)
        stream = rt.engine.add_request(
            msg.request_id, prompt, self.params, kv_import=load.kv_import, export_kv=True, stream_export=self.streamed,
            grammar=self.grammar, notify_launch=self._lease is None,
        )
        if self._lease is None:
            self._lease = asyncio.create_task(self._take_lease(after=stream), name=f"lease {msg.request_id}")
        n = self.params.n
        first: dict[int, int] = {}
        first_lp: dict[int, object] = {}
        final = None
        writes: list[asyncio.Task[StoreResult]] = []
        try:
            async for out in stream:
                if out.prompt_logprobs is not None:
                    self.prompt_scores = wire_prompt_logprobs(out.prompt_logprobs)
                for c in out.outputs:
                    if c.new_token_ids and c.index not in first:
                        first[c.index] = c.new_token_ids[0]
                        if c.new_logprobs:
                            first_lp[c.index] = wire_logprob(c.new_logprobs[0])
                if out.exported_kv is not None and not out.finished:
                    piece = out.exported_kv
                    self.computed_tokens = max(self.computed_tokens, piece.end_block * rt.llm.config.block_size)
                    writes.append(asyncio.create_task(self._store(piece, skip)))
                if out.finished:
                    final = out
        finally:
            if final is None:
                stream.abort()  # the handler was cancelled (client gone) or the engine failed
        t_computed = time.perf_counter()
        self.compute_done_at = time.time()
        self.engine_time = {k: round(v - engine0[k], 6) for k, v in _engine_clock(rt).items()}
        self.streamed_blocks = self.watermark
        if final is not None and final.exported_kv is not None:
            self.computed_tokens = len(prompt)
            writes.append(asyncio.create_task(self._store(final.exported_kv, skip)))
        await asyncio.shield(self._lease)  # the lease id goes into the result
        if final is not None and len(first) == n:
            self.first_token_ids, self.first_logprobs = self._firsts(first, first_lp)
            self.changed.set()  # streamed: a progress carries them before the last writes end (the client's first token)
        store = StoreResult()
        for piece_result in await asyncio.gather(*writes):  # never raises: failures are per block
            store.add(piece_result)
        store.seconds = time.perf_counter() - t_computed
        rt.metrics.handoff_seconds.labels("store").observe(store.seconds)
        if final is None or final.exported_kv is None or self.first_token_ids is None:
            rt.metrics.requests.labels("aborted").inc()
            raise PrefillAborted("request aborted")
        if self.streamed:
            rt.metrics.streamed_blocks.inc(self.streamed_blocks)
        return self._result(final, self.first_token_ids, self.first_logprobs, load, store, skip, t_engine, t_computed)

    def _firsts(self, first: dict[int, int], first_lp: dict[int, object]) -> tuple[list[int], list | None]:
        """The first token of each completion in order, and their logprobs when asked for."""
        n = self.params.n
        lps = [first_lp[i] for i in range(n)] if self.params.logprobs is not None and len(first_lp) == n else None
        return [first[i] for i in range(n)], lps

    async def _take_lease(self, after: RequestStream | None = None) -> None:
        """The handoff lease on every key of the prompt (none if the pool is down); with
        ``after``, once that request's first step is on the device (none if it was aborted
        before: nothing will be written)."""
        rt = self.rt
        if after is not None:
            await after.launched.wait()
            if after.aborted:
                self.leased_at = time.time()
                return
        self.lease_started_at = time.time()
        try:
            if rt.pool_health.usable:
                self.lease_id = await rt.pool.create_lease(rt.namespace, self.keys, self.msg.lease_ttl_s)
        except (PoolError, OSError) as e:
            log.info("no lease for %s (%s): its blocks are written unpinned", self.msg.request_id, e)
            rt.pool_health.report_failure(e)
        self.leased_at = time.time()

    async def _store(self, piece, skip: int) -> StoreResult:
        # Each block is announced as soon as its write is acknowledged (not when the whole
        # piece is): decode reads the first blocks of a piece while the rest is written.
        # Every block is written under the lease. (Shielded: several writes wait on it.
        # Cancelled while waiting, the piece's staging goes back here.)
        try:
            await asyncio.shield(self._lease)
        except BaseException:
            piece.release()
            raise
        return await store_blocks(self.rt, piece, self.keys, skip, self.lease_id, on_written=self._written)

    def _written(self, key: str) -> None:
        i = self._index.get(key)
        if i is not None:
            self._mark_durable(i, i + 1)

    def _result(
        self, final, first_ids: list[int], first_lps: list | None, load: LoadResult, store: StoreResult, skip: int, t_engine: float, t_computed: float
    ) -> PrefillResult:
        rt, msg, prompt = self.rt, self.msg, self.msg.prompt_token_ids
        cached = final.num_cached_tokens + final.num_imported_tokens
        timings = {
            "queue_s": final.metrics.get("queue_s", 0.0),
            "compute_s": t_computed - t_engine,
            "load_s": load.seconds,
            "write_s": store.seconds,
            "total_s": time.perf_counter() - self.t0,
        }
        trace = {
            "instance": rt.instance_id,
            "local_cached_tokens": final.num_cached_tokens,
            "pool_hit_blocks": load.hit_blocks,
            "pool_miss_reasons": load.miss_reasons,
            "bytes_read": load.bytes_read,
            "bytes_written": store.bytes_written,
            "blocks_written": store.blocks_written,
            "blocks_already_in_pool": skip,
            "blocks_failed": store.blocks_failed,
            "write_fail_reasons": store.fail_reasons,
            "streamed": self.streamed,
            "streamed_blocks": self.streamed_blocks,
            "durable_blocks": self.watermark,
            # The request's phases in wall time (one host: comparable with decode's and the client's).
            "received_at": wall_clock(self.t0),
            "started_at": self.started_at,
            "pool_queried_at": self.queried_at,
            "lease_started_at": self.lease_started_at,
            "leased_at": self.leased_at,
            "engine_at": wall_clock(t_engine),
            "compute_done_at": self.compute_done_at,
            "written_at": time.time(),
            **self.engine_time,
            **timings,
        }
        rt.metrics.requests.labels("ok").inc()
        rt.metrics.request_seconds.observe(timings["total_s"])
        if "ttft_s" in final.metrics:
            rt.metrics.ttft_seconds.observe(final.metrics["ttft_s"])
        log.info(
            "prefill %s: %d tokens (%d cached), wrote %d blocks (%d failed, %d durable before compute ended), "
            "%.1f ms of writes after compute %.1f ms",
            msg.request_id, len(prompt), cached, store.blocks_written, store.blocks_failed, self.streamed_blocks,
            store.seconds * 1e3, timings["compute_s"] * 1e3,
        )
        return PrefillResult(
            request_id=msg.request_id,
            first_token_ids=first_ids,
            first_logprobs=first_lps,
            prompt_logprobs=self.prompt_scores,
            block_keys=[str(k) for k in self.keys],
            lease_id=self.lease_id,
            num_prompt_tokens=len(prompt),
            num_cached_tokens=cached,
            num_computed_tokens=len(prompt) - cached,
            bytes_written=store.bytes_written,
            blocks_written=store.blocks_written,
            blocks_failed=store.blocks_failed,
            timings=timings,
            trace=trace if msg.want_trace else None,
        )


def _engine_clock(rt: WorkerRuntime) -> dict[str, float]:
    """The engine's running totals: steps, wall seconds inside its steps (host work, launches
    and waits for the GIL included) and device-busy seconds (CUDA events; 0 off CUDA). Their
    advance over one prompt's compute, in its trace, tells the device's share of
    ``compute_s`` from the host's (exact when the prompt ran alone, as in bench/gpu_pd.py)."""
    snap = rt.engine.snapshot
    return {"engine_steps": float(snap.steps), "engine_step_s": snap.busy_s, "device_busy_s": rt.llm.timer.busy_s}


def add_routes(app: web.Application, runtime: WorkerRuntime) -> None:
    app.router.add_post("/v1/prefill", handle_prefill)
