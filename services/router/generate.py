"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one request, end to end.

1. Take an admission slot (admission.py; 429 when the router is full), read the body
   within its size limit (body.py; 413), then prepare the request on the bounded
   executor (prepare.py: JSON, validation, output constraints compiled, chat template,
   length precheck, tokenizer, context check). Nothing goes downstream before all of it
   passed; no decode instance at all is a 503.
2. Run one :class:`~services.router.handoff.PromptJob` per prompt; their choices put
   updates into one outbox, merged in arrival order.
3. Stream SSE chunks (ending in ``data: [DONE]``) or build the JSON response; then log the
   request's one line and observe its metrics.

A client that goes away cancels the request's tasks, which abort their work downstream
(handoff.py). aiohttp does not cancel handlers on disconnect (``handler_cancellation``
is off by default and services/common's runner leaves it off), and a request waiting on a
slow prefill writes nothing that could fail, so :func:`_client_gone` watches the
connection itself.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from services.router.api import GenerateRequest, Kind
from services.router.body import read_body
from services.router.errors import ApiError
from services.router.handoff import ChoiceUpdate, PromptJob
from services.router.prepare import Prompt, prepare
from services.router.responses import Formatter, usage
from services.router.state import STATE, RouterState
from services.router.trace import PromptTrace, RequestTrace

log = logging.getLogger("tidepool.router.requests")

_DISCONNECT_POLL_S = 0.1
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


async def _client_gone(request: web.Request) -> None:
    """Return once the client's connection is closed."""
    while True:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(_DISCONNECT_POLL_S)


class RequestRun:
    """One accepted request: its prompt jobs, merged updates, usage, trace and metrics."""

    def __init__(self, state: RouterState, req: GenerateRequest, trace: RequestTrace, prompts: list[Prompt], budgets: list[int]) -> None:
        self.state = state
        self.req = req
        self.trace = trace
        self.outbox: asyncio.Queue[ChoiceUpdate | ApiError] = asyncio.Queue()
        self.jobs = []
        for i, (p, budget) in enumerate(zip(prompts, budgets)):
            pt = PromptTrace(index=i, prompt_tokens=len(p.token_ids))
            trace.prompts.append(pt)
            self.jobs.append(PromptJob(state, req, trace.request_id, i, p.token_ids, budget, pt, self.outbox))
        self.prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self.completion_tokens = 0
        self.first_token = False

    @property
    def cached_tokens(self) -> int:
        return sum(job.cached_tokens for job in self.jobs)

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Every choice's updates as they come; raises the first :class:`ApiError`."""
        tasks = [asyncio.create_task(self._guard(job), name=f"prompt {job.id}") for job in self.jobs]
        remaining = self.req.num_prompts * self.req.candidates
        try:
            while remaining:
                item = await self.outbox.get()
                if isinstance(item, ApiError):
                    raise item
                self.completion_tokens += item.num_tokens
                if item.num_tokens and not self.first_token:
                    self.first_token = True
                    self.trace.ttft_s = self.trace.elapsed()
                    self.state.metrics.waiting.dec()
                    self.state.metrics.running.inc()
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _guard(self, job: PromptJob) -> None:
        try:
            await job.run()
        except asyncio.CancelledError:
            raise
        except ApiError as exc:
            self.outbox.put_nowait(exc)
        except Exception:
            log.exception("prompt %s failed", job.id)
            self.outbox.put_nowait(ApiError(500, "internal error while generating", code="internal_error"))

    def finish(self, outcome: str) -> None:
        """Log the request's line and observe its metrics (once, whatever the outcome)."""
        m = self.state.metrics
        self.trace.total_s = self.trace.elapsed()
        (m.running if self.first_token else m.waiting).dec()
        m.requests.labels(self.trace.endpoint, outcome).inc()
        m.prompt_tokens.inc(self.prompt_tokens)
        m.completion_tokens.inc(self.completion_tokens)
        m.cached_tokens.inc(self.cached_tokens)
        m.observe_trace(self.trace)
        if outcome == "ok":
            if self.trace.ttft_s is not None:
                m.ttft.observe(self.trace.ttft_s)
            m.e2e.observe(self.trace.total_s)
            for job in self.jobs:
                for choice in job.choices:
                    if choice.tpot_s is not None:
                        m.tpot.observe(choice.tpot_s)
        elif outcome == "client_disconnect":
            m.aborts.labels("client_disconnect").inc()
        log.info(self.trace.log_line(outcome, self.prompt_tokens, self.completion_tokens, self.cached_tokens))

    def extension(self) -> dict[str, Any] | None:
        if not self.req.want_trace:
            return None
        self.trace.total_s = self.trace.elapsed()
        return {"trace": self.trace.to_dict()}


async def handle(request: web.Request, kind: Kind) -> web.StreamResponse:
    state = request.app[STATE]
    endpoint = "chat" if kind == "chat" else "completions"
    try:
        async with state.admission.slot():
            return await _serve(request, state, kind, endpoint)
    except ApiError as exc:  # no slot: refused before anything was read
        state.metrics.overloaded.labels(exc.code or "").inc()
        state.metrics.requests.labels(endpoint, str(exc.status)).inc()
        return exc.response()


async def _serve(request: web.Request, state: RouterState, kind: Kind, endpoint: str) -> web.StreamResponse:
    s = state.settings
    trace = RequestTrace(request_id=secrets.token_hex(12), endpoint=endpoint)
    try:
        raw = await read_body(request, s.max_body_bytes, s.body_timeout_s)
        max_model_len = await state.registry.wait_for(lambda: state.registry.max_model_len("decode"), s.retry_wait_s)
        job = functools.partial(
            prepare,
            raw,
            kind,
            tokenizer=state.tokenizer,
            served_model=state.model_name,
            max_model_len=max_model_len,
            max_json_depth=s.max_json_depth,
            grammars=state.grammars,
            chat_template=state.chat_template,
        )
        ready = await state.executor.run(job)
        trace.tokenize_s = trace.elapsed()
    except ApiError as exc:
        if exc.status == 429:
            state.metrics.overloaded.labels(exc.code or "").inc()
        state.metrics.requests.labels(endpoint, str(exc.status)).inc()
        return exc.response()
    req = ready.req
    state.metrics.waiting.inc()
    run = RequestRun(state, req, trace, ready.prompts, ready.budgets)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    formatter = Formatter(req, prefix + trace.request_id, int(time.time()), [p.text for p in ready.prompts])
    writer = _stream if req.stream else _whole
    outcome = "ok"
    try:
        return await _until_client_gone(request, lambda: writer(request, run, formatter))
    except ClientGone:
        outcome = "client_disconnect"
        return web.Response(status=499, text="client closed request")  # nobody reads it; the access log does
    except ApiError as exc:
        outcome = str(exc.status)
        return exc.response()
    except BaseException:
        outcome = "error"
        raise
    finally:
        run.finish(outcome)


async def _until_client_gone(request: web.Request, work: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Run ``work``, cancelling it (and raising :class:`ClientGone`) if the client leaves."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise


async def _whole(request: web.Request, run: RequestRun, formatter: Formatter) -> web.StreamResponse:
    async with aclosing(run.updates()) as updates:
        async for u in updates:
            formatter.choices[u.index].add(u)
    return web.json_response(formatter.response(run.usage(), run.extension()))


async def _stream(request: web.Request, run: RequestRun, formatter: Formatter) -> web.StreamResponse:
    """SSE; the response starts with the first update, so an error before it is a plain
    JSON error with its status, and one after it is an error event before ``[DONE]``."""
    response: web.StreamResponse | None = None
    pending = run.req.num_prompts * run.req.candidates
    include_usage = run.req.include_usage

    async def send(payload: bytes) -> None:
        nonlocal response
        if response is None:
            response = web.StreamResponse(headers=_SSE_HEADERS)
            await response.prepare(request)
        try:
            await response.write(payload)
        except ConnectionResetError:
            raise ClientGone() from None

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    try:
        async with aclosing(run.updates()) as updates:
            async for u in updates:
                chunks = formatter.chunks(u)
                if u.finish_reason is not None:
                    pending -= 1
                    if pending == 0 and not include_usage and run.req.want_trace and chunks:
                        chunks[-1]["tidepool"] = run.extension()
                await send(b"".join(event(c) for c in chunks))
    except ApiError as exc:
        if response is None:
            raise
        await send(exc.sse() + _DONE)
        return response
    if include_usage:
        chunk = formatter.usage_chunk(run.usage())
        if run.req.want_trace:
            chunk["tidepool"] = run.extension()
        await send(event(chunk))
    await send(_DONE)
    assert response is not None
    try:
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client read [DONE] and hung up first: the request completed
    return response
