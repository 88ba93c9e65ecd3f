"""Drives an ``LLMEngine`` on a worker thread so an asyncio service never runs the model.

The event loop only does I/O: it puts commands (add, abort) into a thread-safe inbox and
reads each request's outputs from an asyncio queue. The worker thread owns the engine
outright (nothing else touches it), steps it while there is work, and hands outputs back
with ``call_soon_threadsafe``. An exception inside a step fails the requests of that
step with the error instead of killing the thread or hanging their streams.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from libs.engine.engine import LLMEngine
from libs.engine.outputs import RequestOutput
from libs.engine.errors import DuplicateRequestError
from libs.engine.params import SamplingParams
from libs.engine.sequence import KVImport
from libs.engine.step_inputs import Step
from libs.structured import GrammarMatcher

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while running this request (the request is over)."""


@dataclass
class EngineSnapshot:
    """Load figures, refreshed by the worker after every step (read from any thread)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    pending_exports: int = 0
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens_computed: int = 0
    prefix_hit_blocks: int = 0
    prefix_queried_blocks: int = 0
    preemptions: int = 0
    busy_s: float = 0.0  # wall time spent inside engine.step()
    spec_decode: dict | None = None  # speculative decoding counters (libs/engine/spec/metrics.py)


class _Aborted:
    """Sentinel that ends a stream's iteration after an abort."""


_ABORTED = _Aborted()


class RequestStream:
    """The outputs of one request, as an async iterator. ``abort()`` stops the request and
    ends the iteration (a consumer blocked on the next output wakes up)."""

    def __init__(self, engine: "AsyncEngine", request_id: str):
        self._engine = engine
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException | _Aborted] = asyncio.Queue()
        self.finished = False
        self.aborted = False
        # Set once the request's first step is on the device, or once it ended without one
        # (only for ``add_request(..., notify_launch=True)``): work the caller must do anyway
        # can then run while the device computes, not while the engine thread prepares the
        # step (both need the GIL).
        self.launched = asyncio.Event()

    def _put(self, item: RequestOutput | BaseException | _Aborted) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if item is _ABORTED:
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item

    def abort(self) -> None:
        """Abort the request if it is still running (idempotent, never blocks)."""
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.5, on_step: Callable[[float, int], None] | None = None):
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._idle_wait_s = idle_wait_s
        self._on_step = on_step
        self._launch_waiters: set[str] = set()  # request ids whose stream waits for ``launched``
        engine.on_launch = self._on_launch
        self.snapshot = EngineSnapshot(total_blocks=engine.block_manager.num_blocks, free_blocks=engine.block_manager.num_free_blocks)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the worker after its current step; pending requests end with an error."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        for stream in list(self._streams.values()):
            stream._put(EngineStepError("the engine is shutting down"))
            stream.launched.set()
        self._streams.clear()
        self._launch_waiters.clear()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests (event loop side) -----------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        output_prefix: Sequence[int] = (),
        kv_import: KVImport | None = None,
        export_kv: bool = False,
        grammar: GrammarMatcher | None = None,
        stream_export: bool = False,
        notify_launch: bool = False,
    ) -> RequestStream:
        """Validate (raising a typed error now, nothing queued) and queue a request.

        ``grammar``: a fresh matcher (``LLMEngine.start_grammar``, run off the event loop)
        that has accepted ``output_prefix``. ``notify_launch``: set the stream's
        ``launched`` when the request's first step is on the device."""
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already running", param="request_id")
        self.engine.validate(list(prompt_token_ids) + list(output_prefix), params, num_output_tokens=len(output_prefix))
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        if notify_launch:
            self._launch_waiters.add(request_id)
        kwargs = dict(output_prefix=list(output_prefix), kv_import=kv_import, export_kv=export_kv, grammar=grammar, stream_export=stream_export)
        self._inbox.put(("add", (request_id, list(prompt_token_ids), params, kwargs)))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown ids are ignored); its stream ends without more output."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.aborted = True
            stream._put(_ABORTED)
            self._ended(stream)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # the consumer went away: hand staging back
                if out.exported_kv is not None:
                    out.exported_kv.release()
                continue
            if out.error is not None:  # the engine failed this request alone
                self._streams.pop(out.request_id, None)
                stream._put(EngineStepError(f"engine failed the request: {out.error}"))
                self._ended(stream)
                continue
            stream._put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._ended(stream)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(error)
                self._ended(stream)

    def _ended(self, stream: RequestStream) -> None:
        """No step of this request will launch any more: nobody may wait for one."""
        self._launch_waiters.discard(stream.request_id)
        stream.launched.set()

    def _on_launch(self, step: Step) -> None:
        """(Engine thread) A step is on the device: tell the requests in it that wait for that."""
        waiters = self._launch_waiters
        if not waiters:
            return
        ids = {c.seq.request_id for c in step.chunks} | {s.request_id for s in step.sample_seqs}
        launched = [rid for rid in ids if rid in waiters]
        if launched:
            waiters.difference_update(launched)
            self._post(self._mark_launched, launched)

    def _mark_launched(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.launched.set()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown
            pass

    # -- worker thread ------------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain_inbox()
            if not eng.has_unfinished_requests():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - a bad step must not kill the worker
                log.exception("engine step failed")
                self._recover(e)
                continue
            dt = time.perf_counter() - t0
            self._refresh(dt)
            if outputs:
                self._post(self._deliver, outputs)
            elif eng.num_running == 0 and eng.num_waiting == 0 and not eng.num_steps_in_flight:
                # Only exports waiting for staging: don't spin while the consumer writes. (A
                # step in flight is read at once: with async scheduling a request's last
                # token is in flight after its sequence retired, and would wait here.)
                self._wake.wait(0.002)
                self._wake.clear()
        self._drain_inbox()

    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                rid, prompt, params, kwargs = payload
                try:
                    eng.add_request(rid, prompt, params, **kwargs)
                except Exception as e:  # noqa: BLE001 - delivered to the request's stream
                    if kwargs.get("kv_import") is not None:
                        kwargs["kv_import"].release()
                    self._post(self._fail, [rid], e)
            elif kind == "abort":
                eng.abort_request(payload)

    def _recover(self, error: Exception) -> None:
        """Abort everything the failed step touched (we cannot tell which), report it."""
        eng = self.engine
        victims = list(eng._requests)
        for rid in victims:
            try:
                eng.abort_request(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step failed for %s", rid)
        try:
            eng.step()  # flush the aborts
        except Exception:  # noqa: BLE001
            log.exception("flushing aborts failed")
        self._post(self._fail, victims, EngineStepError(f"engine step failed: {type(error).__name__}: {error}"))
        self._refresh(0.0)

    def _refresh(self, busy: float) -> None:
        eng, bm, s = self.engine, self.engine.block_manager, self.snapshot
        self.snapshot = EngineSnapshot(
            running=eng.num_running,
            waiting=eng.num_waiting,
            free_blocks=bm.num_free_blocks,
            total_blocks=bm.num_blocks,
            pending_exports=eng.num_pending_exports,
            steps=eng.num_steps,
            generated_tokens=eng.num_generated_tokens,
            prompt_tokens_computed=eng.num_prompt_tokens_computed,
            prefix_hit_blocks=bm.prefix_hit_blocks,
            prefix_queried_blocks=bm.prefix_queried_blocks,
            preemptions=eng.scheduler.num_preemptions,
            busy_s=s.busy_s + busy,
            spec_decode=eng.spec.metrics.snapshot() if eng.spec is not None else None,
        )
        if self._on_step is not None and busy:
            self._on_step(busy, eng.num_running)
