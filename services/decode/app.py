"""Decode: load a prompt's KV from the pool and stream the completion.

``POST /v1/decode`` (DecodeRequest → a stream of TokenEvent), per DESIGN.md:

1. Decode computes the prompt's block keys itself (the same function prefill used) and
   loads, after whatever its own prefix cache already holds, the leading run of blocks
   the pool has: fetched in pipelined batches into staging and checked (header and
   checksum) before the engine scatters them into its cache. With ``await_handoff``
   (the streamed handoff, services/decode/handoff.py) prefill is still running: the
   blocks are loaded as the router's ``POST /v1/handoff`` updates say they are durable,
   and the request waits for the last update, which brings the first token.
2. The handoff lease is released once the first token is out (or the request ends).
3. Whatever could not be loaded (missing, evicted, corrupt, or never written because
   prefill died) is recomputed by the engine as a chunked prefill: slower, never wrong.
   Every block not loaded is counted with its reason in the metrics and the request's
   trace. Without a first token (no prefill answered), decode serves the whole request.
4. Tokens stream back as they are sampled; a client that goes away aborts the request
   and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from libs.engine import DuplicateRequestError, InvalidRequestError
from libs.engine.async_engine import EngineStepError
from libs.kvpool.pool import PoolError
from libs.protocol import MessageStreamResponse, read_message
from libs.protocol.messages import DecodeRequest, TokenEvent
from services.worker.app import RUNTIME, full, rejected
from services.worker.convert import sampling_params, wall_clock, wire_logprob, wire_prompt_logprobs
from services.worker.grammar import start_grammar
from services.worker.runtime import WorkerRuntime
from services.decode.handoff import HandoffAborted, HandoffStats, HandoffWait, handle_handoff, load_streamed
from services.worker.transfer import LoadResult, load_blocks

log = logging.getLogger(__name__)


async def handle_decode(request: web.Request) -> web.StreamResponse:
    rt: WorkerRuntime = request.app[RUNTIME]
    refused = full(rt)
    if refused is not None:
        return refused
    msg = await read_message(request, DecodeRequest)
    t0 = time.perf_counter()
    prompt = msg.prompt_token_ids
    prefix = [] if msg.first_token_id is None else [msg.first_token_id]
    resumed = prompt[len(prompt) - msg.num_resumed_tokens :] if msg.num_resumed_tokens else []
    try:
        params = sampling_params(msg.sampling)
        maybe = [0] if msg.await_handoff else prefix  # a streamed handoff may bring a first token
        rt.llm.validate(prompt + maybe, params, num_output_tokens=len(maybe))
        if msg.await_handoff and msg.request_id in rt.handoffs:
            raise DuplicateRequestError(f"request id {msg.request_id!r} is already waiting for a handoff", param="request_id")
        # Decode owns the grammar state: a fresh one replays everything generated before
        # (in a streamed handoff, prefill's first token is replayed once it arrives).
        grammar = await start_grammar(rt, msg.sampling.structured, resumed + prefix)
    except InvalidRequestError as e:
        return rejected(rt, e)

    rt.in_flight += 1
    try:
        keys = rt.keys(prompt)
        local = rt.cached_prefix_blocks(prompt)
        resp: MessageStreamResponse | None = None
        handoff: HandoffStats | None = None
        lease_id = msg.lease_id
        if msg.await_handoff:
            wait = HandoffWait(msg.request_id)
            rt.handoffs[msg.request_id] = wait
            try:
                resp = MessageStreamResponse()
                await resp.prepare(request)  # the router posts updates once it has the headers
                load, handoff = await load_streamed(rt, wait, keys, local, len(prompt))
            except HandoffAborted as e:
                rt.metrics.requests.labels("aborted").inc()
                reason = "abort" if wait.aborted else "error"
                return await _end(resp, TokenEvent(request_id=msg.request_id, finish_reason=reason, error=str(e)))
            except asyncio.CancelledError:  # the router closed the stream (handler cancellation)
                rt.metrics.requests.labels("disconnected").inc()
                raise
            finally:
                rt.handoffs.pop(msg.request_id, None)
            lease_id = wait.lease_id or lease_id
            if wait.first_token_id is not None:
                prefix = [wait.first_token_id]
        else:
            # With a first token the whole prompt may come from the pool; without one the
            # engine must compute the last prompt token itself to sample. A prompt to score
            # (prompt_logprobs) is computed whole: nothing is loaded.
            if msg.sampling.prompt_logprobs is not None:
                load = LoadResult(None)
            else:
                load = await load_blocks(rt, keys, local, max_tokens=len(prompt) if prefix else len(prompt) - 1)
        # The lease is released once the first token is out (or the request ends): its
        # Lua calls on every partition would otherwise run on this loop while the engine
        # thread prepares the first step, and the GIL they hold delays that step. Decode
        # holds the blocks in staging by then; the lease only keeps the pool's copy pinned.
        releasing = _LeaseRelease(rt, lease_id)
        try:
            if msg.await_handoff and prefix and grammar is not None:
                grammar = await start_grammar(rt, msg.sampling.structured, prefix)  # prefill's first token, replayed
            stream = rt.engine.add_request(msg.request_id, prompt, params, output_prefix=prefix, kv_import=load.kv_import, grammar=grammar)
        except InvalidRequestError as e:
            if load.kv_import is not None:
                load.kv_import.release()
            releasing.now()
            if resp is None:
                return rejected(rt, e)
            rt.metrics.requests.labels("invalid").inc()
            return await _end(resp, TokenEvent(request_id=msg.request_id, finish_reason="error", error=str(e)))
        t_queued = time.perf_counter()

        if resp is None:
            resp = MessageStreamResponse()
            await resp.prepare(request)
        first_token_at = last_token_at = None
        n_out = 0
        outcome = "ok"
        try:
            async for out in stream:
                event = _event(msg, out, load, rt)
                now = time.perf_counter()
                new = sum(len(c.new_token_ids) for c in out.outputs)
                if new:
                    if first_token_at is None:
                        first_token_at = now
                        rt.metrics.ttft_seconds.observe(now - t0)
                    elif n_out:
                        rt.metrics.tpot_seconds.observe((now - last_token_at) / new)
                    last_token_at, n_out = now, n_out + new
                if out.finished and msg.want_trace:
                    event.trace = _trace(rt, load, local, out, t0, t_queued, first_token_at, n_out)
                    if handoff is not None:
                        event.trace.update(handoff.trace())
                await resp.send(event)
                if new:
                    releasing.now()
            if stream.aborted:
                outcome = "aborted"
        except EngineStepError as e:
            outcome = "error"
            await resp.send(TokenEvent(request_id=msg.request_id, finish_reason="error", error=str(e)))
        except (ConnectionResetError, asyncio.CancelledError):
            outcome = "disconnected"
            stream.abort()
            raise
        finally:
            releasing.now()
            rt.metrics.requests.labels(outcome).inc()
            rt.metrics.request_seconds.observe(time.perf_counter() - t0)
        await resp.write_eof()
        return resp
    finally:
        rt.in_flight -= 1


async def _end(resp: MessageStreamResponse, event: TokenEvent) -> MessageStreamResponse:
    """End a prepared stream with one final event (the router may be gone already)."""
    try:
        await resp.send(event)
        await resp.write_eof()
    except ConnectionResetError:
        pass
    return resp


def _event(msg: DecodeRequest, out, load, rt: WorkerRuntime) -> TokenEvent:
    ids, lps, reason = [], [], None
    for c in out.outputs:  # n == 1: one sequence
        ids.extend(c.new_token_ids)
        lps.extend(wire_logprob(lp) for lp in c.new_logprobs)
        reason = c.finish_reason or reason
    return TokenEvent(
        request_id=msg.request_id,
        token_ids=ids,
        logprobs=lps if msg.sampling.logprobs is not None else None,
        finish_reason=reason if out.finished else None,
        num_cached_tokens=out.num_cached_tokens + out.num_imported_tokens,
        prompt_logprobs=wire_prompt_logprobs(out.prompt_logprobs),
    )


def _trace(rt, load, local_blocks, out, t0, t_queued, first_token_at, n_out) -> dict:
    now = time.perf_counter()
    return {
        "instance": rt.instance_id,
        "local_cached_tokens": out.num_cached_tokens,
        "pool_hit_blocks": load.hit_blocks,
        "pool_loaded_tokens": out.num_imported_tokens,
        "pool_miss_reasons": load.miss_reasons,
        "bytes_read": load.bytes_read,
        "load_s": load.seconds,
        "load_done_at": load.done_at,
        "queue_s": out.metrics.get("queue_s", 0.0),
        "first_token_s": (first_token_at - t0) if first_token_at else None,
        # Phases in wall time (one host: comparable with prefill's and the client's).
        "received_at": wall_clock(t0),
        "engine_at": wall_clock(t_queued),
        "first_token_at": wall_clock(first_token_at) if first_token_at else None,
        # the engine thread had the id on the host (the rest, to first_token_at, is the hand-over to this loop)
        "engine_first_token_at": wall_clock(t, time.monotonic) if (t := out.metrics.get("first_token_monotonic")) else None,
        "decode_s": now - t_queued,
        "output_tokens": n_out,
        "total_s": now - t0,
    }


class _LeaseRelease:
    """Releases a handoff lease once, in the background, when :meth:`now` is first called."""

    def __init__(self, rt: WorkerRuntime, lease_id: str | None) -> None:
        self.rt, self.lease_id = rt, lease_id
        self.task: asyncio.Task[None] | None = None

    def now(self) -> None:
        if self.lease_id and self.task is None:
            self.task = asyncio.create_task(_release_lease(self.rt, self.lease_id), name=f"release {self.lease_id}")


async def _release_lease(rt: WorkerRuntime, lease_id: str) -> None:
    try:
        await rt.pool.release_lease(lease_id)
    except (PoolError, OSError, ValueError) as e:
        log.info("could not release lease %s: %s (its TTL will)", lease_id, e)


def add_routes(app: web.Application, runtime: WorkerRuntime) -> None:
    app.router.add_post("/v1/decode", handle_decode)
    app.router.add_post("/v1/handoff", handle_handoff)
