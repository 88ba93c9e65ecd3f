"""Prefill: compute a prompt's KV, sample its first token(s), hand the KV to the pool.

``POST /v1/prefill`` (PrefillRequest → PrefillResult), per DESIGN.md's request path:

1. A handoff lease is taken on every block key of the prompt first, so blocks that
   already exist cannot be evicted between here and decode.
2. Leading blocks already in the pool (and not in our own prefix cache) are loaded
   instead of computed.
3. The engine computes the rest (batched with other prompts, in chunks), samples the
   first token of each of the ``n`` completions, and gathers the prompt's blocks into
   staging.
4. The blocks the pool lacks, the partial tail included, are written under the lease.
   The answer goes out once every write is acknowledged or has failed; a failed block
   only costs decode a recompute.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from libs.engine import InvalidRequestError
from libs.kvpool.pool import PoolError
from libs.protocol import msgpack_response, read_message
from libs.protocol.messages import PrefillRequest, PrefillResult
from services.worker.app import RUNTIME, full, rejected
from services.worker.convert import sampling_params, wire_logprob
from services.worker.grammar import start_grammar
from services.worker.runtime import WorkerRuntime
from services.worker.transfer import LoadResult, load_blocks, store_blocks

log = logging.getLogger(__name__)


async def handle_prefill(request: web.Request) -> web.Response:
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
        return msgpack_response(await _prefill(rt, msg, params, t0, grammar))
    except InvalidRequestError as e:
        return rejected(rt, e)
    finally:
        rt.in_flight -= 1


async def _prefill(rt: WorkerRuntime, msg: PrefillRequest, params, t0: float, grammar=None) -> PrefillResult:
    prompt = msg.prompt_token_ids
    keys = rt.keys(prompt)
    full = [k for k in keys if not k.partial]
    lease_id = None
    pool_run = 0
    try:
        lease_id = await rt.pool.create_lease(rt.namespace, keys, msg.lease_ttl_s)
        pool_run = await rt.pool.exists_prefix(rt.namespace, full)
    except (PoolError, OSError) as e:
        log.info("pool unavailable for %s (%s): computing everything", msg.request_id, e)
    local = rt.cached_prefix_blocks(prompt)
    load = LoadResult(None)
    if pool_run > local:
        load = await load_blocks(rt, keys[:pool_run], local, max_tokens=len(prompt) - 1)

    t_engine = time.perf_counter()
    stream = rt.engine.add_request(msg.request_id, prompt, params, kv_import=load.kv_import, export_kv=True, grammar=grammar)
    first: dict[int, int] = {}
    first_lp: dict[int, object] = {}
    final = None
    try:
        async for out in stream:
            for c in out.outputs:
                if c.new_token_ids and c.index not in first:
                    first[c.index] = c.new_token_ids[0]
                    if c.new_logprobs:
                        first_lp[c.index] = wire_logprob(c.new_logprobs[0])
            if out.finished:
                final = out
    finally:
        if final is None:
            stream.abort()  # the handler was cancelled (client gone) or the engine failed
    if final is None or final.exported_kv is None or len(first) != params.n:
        rt.metrics.requests.labels("aborted").inc()
        raise web.HTTPServiceUnavailable(reason="request aborted")
    t_computed = time.perf_counter()

    store = await store_blocks(rt, final.exported_kv, keys, min(pool_run, len(full)), lease_id)
    cached = final.num_cached_tokens + final.num_imported_tokens
    timings = {
        "queue_s": final.metrics.get("queue_s", 0.0),
        "compute_s": t_computed - t_engine,
        "load_s": load.seconds,
        "write_s": store.seconds,
        "total_s": time.perf_counter() - t0,
    }
    trace = {
        "instance": rt.instance_id,
        "local_cached_tokens": final.num_cached_tokens,
        "pool_hit_blocks": load.hit_blocks,
        "pool_miss_reasons": load.miss_reasons,
        "bytes_read": load.bytes_read,
        "bytes_written": store.bytes_written,
        "blocks_written": store.blocks_written,
        "blocks_already_in_pool": min(pool_run, len(full)),
        "blocks_failed": store.blocks_failed,
        "write_fail_reasons": store.fail_reasons,
        **timings,
    }
    rt.metrics.requests.labels("ok").inc()
    rt.metrics.request_seconds.observe(timings["total_s"])
    if "ttft_s" in final.metrics:
        rt.metrics.ttft_seconds.observe(final.metrics["ttft_s"])
    log.info(
        "prefill %s: %d tokens (%d cached), wrote %d blocks (%d failed) in %.1f ms, compute %.1f ms",
        msg.request_id, len(prompt), cached, store.blocks_written, store.blocks_failed,
        store.seconds * 1e3, timings["compute_s"] * 1e3,
    )
    return PrefillResult(
        request_id=msg.request_id,
        first_token_ids=[first[i] for i in range(params.n)],
        first_logprobs=[first_lp[i] for i in range(params.n)] if params.logprobs is not None and len(first_lp) == params.n else None,
        block_keys=[str(k) for k in keys],
        lease_id=lease_id,
        num_prompt_tokens=len(prompt),
        num_cached_tokens=cached,
        num_computed_tokens=len(prompt) - cached,
        bytes_written=store.bytes_written,
        blocks_written=store.blocks_written,
        blocks_failed=store.blocks_failed,
        timings=timings,
        trace=trace if msg.want_trace else None,
    )


def add_routes(app: web.Application, runtime: WorkerRuntime) -> None:
    app.router.add_post("/v1/prefill", handle_prefill)
