"""Decode's side of the streamed handoff: load the prompt's blocks while prefill still runs.

A :class:`DecodeRequest` with ``await_handoff`` arrives as soon as prefill has taken its
lease (docs/HANDOFF.md). Decode registers a :class:`HandoffWait` under the request id and
answers the stream's headers; the router then posts :class:`HandoffUpdate` messages to
``POST /v1/handoff``, each carrying the leading run of blocks that are durable in the pool.
:func:`load_streamed` fetches each newly durable run into one :class:`StagedRun` (so the
loads of one request share staging rows in order), and stops waiting at the last update:

- with a first token: it loads the rest (the last chunk's blocks and the partial tail),
  and the request generates after that token;
- without one (prefill failed or died): it loads whatever the pool has after what it
  loaded (blocks written but not yet announced included) and the engine computes the
  missing tail and samples the first token itself.

Updates are cumulative (each carries the latest watermark), so a lost or coalesced one
costs nothing. Waiting is bounded: an abort (the router's ``AbortRequest``, or its
connection closing) or ``handoff_timeout_s`` without the last update ends the request
with an error event, and the router resumes it elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from libs.blocks import BlockKey
from libs.protocol import json_error, read_message
from libs.protocol.messages import HandoffUpdate, TokenLogprobs
from services.worker.app import RUNTIME
from services.worker.runtime import WorkerRuntime
from services.worker.transfer import LoadResult, StagedRun, finish_load, wanted_blocks


class HandoffAborted(Exception):
    """The request was aborted, or no last update came in time."""


@dataclass
class HandoffStats:
    """What the streamed handoff did, for the trace."""

    early_blocks: int = 0  # loaded before the last update arrived
    updates: int = 0
    wait_s: float = 0.0  # request arrival to the last update
    load_tail_s: float = 0.0  # the last update to the end of loading: not overlapped with prefill
    first_load_done_at: float | None = None  # wall clock when the first blocks were in staging
    final_update_at: float | None = None  # wall clock when the last update arrived
    prefill_error: str | None = None

    def trace(self) -> dict:
        out = {"streamed": True, "early_blocks": self.early_blocks, "handoff_updates": self.updates,
               "handoff_wait_s": self.wait_s, "load_tail_s": self.load_tail_s, "first_load_done_at": self.first_load_done_at,
               "final_update_at": self.final_update_at}
        if self.prefill_error is not None:
            out["prefill_error"] = self.prefill_error
        return out


class HandoffWait:
    """One request's mailbox for :class:`HandoffUpdate` (latest state wins)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.durable_blocks = 0
        self.lease_id: str | None = None
        self.done = False
        self.first_token_id: int | None = None
        self.first_logprobs: TokenLogprobs | None = None
        self.error: str | None = None
        self.updates = 0
        self.aborted = False
        self._changed = asyncio.Event()

    def update(self, msg: HandoffUpdate) -> None:
        self.updates += 1
        self.durable_blocks = max(self.durable_blocks, msg.durable_blocks)
        self.lease_id = msg.lease_id or self.lease_id
        if msg.done:
            self.done = True
            self.first_token_id = msg.first_token_id
            self.first_logprobs = msg.first_logprobs
            self.error = msg.error
        self._changed.set()

    def abort(self) -> None:
        self.aborted = True
        self._changed.set()

    async def changed(self, deadline: float) -> None:
        """Wait for the next update (or an abort); raise :class:`HandoffAborted` past ``deadline``."""
        left = deadline - time.monotonic()
        if self.aborted or left <= 0:
            raise HandoffAborted("aborted" if self.aborted else "no final handoff update in time")
        try:
            await asyncio.wait_for(self._changed.wait(), left)
        except asyncio.TimeoutError:
            raise HandoffAborted("no final handoff update in time") from None
        self._changed.clear()
        if self.aborted:
            raise HandoffAborted("aborted")


async def load_streamed(rt: WorkerRuntime, wait: HandoffWait, keys: list[BlockKey], start: int, prompt_len: int) -> tuple[LoadResult, HandoffStats]:
    """Load ``keys[start:]`` as they become durable, then the rest at the last update.

    Raises :class:`HandoffAborted` (staging released) if the request is aborted or times out.
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + rt.settings.handoff_timeout_s
    wanted = wanted_blocks(rt, keys, start, prompt_len)  # with a first token, the whole prompt may load
    run = StagedRun(rt, start, len(wanted))
    stats = HandoffStats()
    try:
        while not wait.done:
            target = min(wait.durable_blocks - start, len(wanted))
            if run.filled < target and not run.broken:
                if await run.fetch(wanted[run.filled : target]) and stats.first_load_done_at is None:
                    stats.first_load_done_at = time.time()
                continue
            await wait.changed(deadline)
        t_final = time.perf_counter()
        stats.final_update_at = time.time()
        stats.early_blocks = run.filled
        if wait.error is not None or wait.first_token_id is None:
            stats.prefill_error = wait.error or "prefill failed"
        if wait.first_token_id is None:  # prefill failed before its first token: the engine samples it
            wanted = wanted_blocks(rt, keys, start, prompt_len - 1)
            run.capacity = max(run.filled, min(run.capacity, len(wanted)))
        await run.fetch(wanted[run.filled :])
    except BaseException:
        run.release()
        raise
    stats.updates = wait.updates
    stats.wait_s = t_final - t0
    stats.load_tail_s = time.perf_counter() - t_final
    m = rt.metrics
    m.early_blocks.inc(stats.early_blocks)
    return finish_load(rt, run, run.fetch_s), stats  # load_s: time in pool reads, not waiting


async def handle_handoff(request: web.Request) -> web.Response:
    """``POST /v1/handoff``: a :class:`HandoffUpdate` for a request waiting on its handoff."""
    rt: WorkerRuntime = request.app[RUNTIME]
    msg = await read_message(request, HandoffUpdate)
    wait = rt.handoffs.get(msg.request_id)
    if wait is None or wait.done:
        return json_error(404, f"request {msg.request_id!r} is not waiting for a handoff", code="not_waiting", param="request_id")
    kind = "progress" if not msg.done else ("failed" if msg.error is not None else "final")
    rt.metrics.handoff_updates.labels(kind).inc()
    wait.update(msg)
    return web.json_response({"ok": True})
