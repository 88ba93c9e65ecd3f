"""Fake prefill and decode instances for router tests: real aiohttp servers speaking the
msgpack protocol of libs/protocol, with a deterministic "model" and switchable faults.

The fake model is a bigram table over a script of distinct tokens: the token after ``t``
is the script's next token, and the script's last token is followed by EOS. So any way
of producing a continuation (prefill's first token then decode, decode alone, a stream
resumed elsewhere from ``prompt + generated[:-1]`` and ``first_token_id``) yields the
same text, which is what lets tests compare a broken-and-resumed stream with a clean one.
Where a completion starts depends on the seed: choice ``i`` of a request with seed ``s``
starts at script position ``(s + i) % 5`` (prefill samples all ``n`` first tokens that
way; decode alone uses its request's seed, which the router derives as ``s + i``).

Faults, set as attributes between requests: ``status`` (answer with that HTTP status),
``delay_s`` (before answering), ``event_delay_s`` (decode: between events), ``die_after``
(decode: cut the connection after that many events, mid-stream), ``hang`` (never answer).
``kill()`` stops the server and its heartbeats abruptly.

Streamed handoff: a prefill with ``streams=True`` answers ``stream_progress`` with
``PrefillProgress`` events (``progress_steps`` of them, ``progress_delay_s`` apart; the first
tokens ride on the event of step ``first_at_step``, or on the last one before the result;
``release`` set, the last event and the result wait for it; with ``die_mid_stream`` it cuts
the connection after the steps instead of sending its result); a
decode asked to ``await_handoff`` answers its headers at once, records every
``HandoffUpdate`` posted to ``/v1/handoff`` (``updates``), and generates after the last one
(from its first token, or alone when prefill failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from libs.blocks import NamespaceRoot, block_keys
from libs.protocol import (
    INTERNAL_TOKEN_HEADER,
    MessageStreamResponse,
    encode,
    internal_headers,
    msgpack_response,
    read_message,
)
from libs.protocol.messages import (
    AbortRequest,
    DecodeRequest,
    HandoffUpdate,
    Heartbeat,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    PromptLogprobs,
    RegisterInstance,
    SamplingSpec,
    TokenEvent,
    TokenLogprobs,
)

NAMESPACE = "ab" * 16
BLOCK_SIZE = 16
HEADERS = {"Content-Type": "application/msgpack"}


@dataclass
class FakeModel:
    """The bigram "model": ``script`` must not repeat a token."""

    script: list[int]
    eos: int
    starts: int = 5

    def __post_init__(self) -> None:
        if len(set(self.script)) != len(self.script) or self.eos in self.script:
            raise ValueError("the script must be distinct tokens, without EOS")
        self._next = dict(zip(self.script, self.script[1:]))
        self._next[self.script[-1]] = self.eos

    def start(self, seed: int | None, i: int = 0) -> int:
        return self.script[((seed or 0) + i) % self.starts]

    def after(self, token: int) -> int:
        return self._next.get(token, self.script[0])

    def logprobs(self, token: int, k: int) -> TokenLogprobs:
        alternatives = [t for t in (self.script[-1], self.script[-2], self.script[-3], 1, 3, 4) if t != token]
        top = [token, *alternatives][:k]
        return TokenLogprobs(
            token_id=token,
            logprob=-0.25,
            top_ids=top,
            top_logprobs=[-0.25 - j for j in range(len(top))],
        )

    def prompt_logprobs(self, prompt: list[int], k: int) -> PromptLogprobs:
        """A made-up scored prompt: token i (from 1) has logprob -i/10, alternatives below it."""
        rest = prompt[1:]
        tops = [[t, *(a for a in (1, 3, 4) if a != t)][:k] for t in rest]
        return PromptLogprobs(
            token_ids=rest,
            logprobs=[-(i + 1) / 10 for i in range(len(rest))],
            top_ids=tops,
            top_logprobs=[[-(i + 1) / 10 - j for j in range(len(top))] for i, top in enumerate(tops)],
        )

    def text_from(self, tokenizer: Any, start_index: int, max_tokens: int | None = None) -> str:
        """The completion text starting at script position ``start_index`` (EOS is not text)."""
        ids = self.script[start_index:]
        if max_tokens is not None:
            ids = ids[:max_tokens]
        return tokenizer.decode(ids)


@dataclass
class FakeInstance:
    """Shared by both roles: the server, registration, heartbeats and fault switches."""

    role: str
    model: FakeModel
    model_name: str
    instance_id: str
    max_model_len: int = 2048
    namespace: str = NAMESPACE
    block_size: int = BLOCK_SIZE
    quantization: str = "none"
    # load reported in heartbeats
    running: int = 0
    waiting: int = 0
    queue_depth: int = 0
    free_blocks: int = 1000
    total_blocks: int = 1000
    # faults
    status: int | None = None
    delay_s: float = 0.0
    hang: bool = False
    # records
    aborts: list[str] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    tokens_seen: list[str | None] = field(default_factory=list)  # internal token of each call
    url: str = ""
    internal_token: str | None = None  # sent with registration and heartbeats

    def __post_init__(self) -> None:
        self.app = web.Application()
        self.app.router.add_post("/v1/abort", self._abort)
        self._runner: web.AppRunner | None = None
        self._beats: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self.heartbeats_sent = 0

    async def start(self) -> "FakeInstance":
        self._runner = web.AppRunner(self.app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._http = aiohttp.ClientSession(headers=internal_headers(self.internal_token))
        return self

    async def stop(self) -> None:
        await self.stop_heartbeats()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def kill(self) -> None:
        """Die like a killed process: connections cut mid-stream, heartbeats stop."""
        for transport in list(self._transports):
            transport.abort()
        await self.stop()

    # -- registration ------------------------------------------------------------------------

    def registration(self) -> RegisterInstance:
        return RegisterInstance(
            instance_id=self.instance_id,
            role=self.role,  # type: ignore[arg-type]
            url=self.url,
            model=self.model_name,
            namespace=self.namespace,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            quantization=self.quantization,
        )

    def heartbeat_message(self) -> Heartbeat:
        return Heartbeat(
            instance_id=self.instance_id,
            role=self.role,  # type: ignore[arg-type]
            running=self.running,
            waiting=self.waiting,
            free_blocks=self.free_blocks,
            total_blocks=self.total_blocks,
            queue_depth=self.queue_depth,
        )

    async def _post(self, router: str, path: str, body: bytes) -> tuple[int, bytes]:
        assert self._http is not None
        async with self._http.post(router + path, data=body, headers=HEADERS) as resp:
            return resp.status, await resp.read()

    async def register(self, router: str) -> tuple[int, bytes]:
        return await self._post(router, "/internal/v1/register", encode(self.registration()))

    async def heartbeat(self, router: str) -> int:
        status, _ = await self._post(router, "/internal/v1/heartbeat", encode(self.heartbeat_message()))
        self.heartbeats_sent += 1
        return status

    async def join(self, router: str, interval_s: float = 0.1) -> "FakeInstance":
        """Register and keep heartbeating (re-registering on 404), as a real instance does."""
        status, body = await self.register(router)
        assert status == 200, body
        await self.heartbeat(router)
        self._beats = asyncio.create_task(self._beat(router, interval_s))
        return self

    async def _beat(self, router: str, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self.heartbeat(router) == 404:
                    await self.register(router)
            except aiohttp.ClientError:
                pass

    async def stop_heartbeats(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            await asyncio.gather(self._beats, return_exceptions=True)
            self._beats = None

    # -- handlers ------------------------------------------------------------------------------

    async def _abort(self, request: web.Request) -> web.Response:
        self.tokens_seen.append(request.headers.get(INTERNAL_TOKEN_HEADER))
        msg = await read_message(request, AbortRequest)
        self.aborts.append(msg.request_id)
        return web.json_response({"aborted": msg.request_id})

    async def _fault(self) -> web.Response | None:
        if self.hang:
            await asyncio.sleep(3600)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.status is not None:
            body = {"error": {"message": f"fake {self.role} says {self.status}", "type": "server_error", "param": None, "code": None}}
            return web.Response(status=self.status, text=json.dumps(body), content_type="application/json")
        return None


@dataclass
class FakePrefill(FakeInstance):
    """``POST /v1/prefill``: n first tokens, keys of the prompt, made-up transfer numbers."""

    cached_tokens: int = 0
    in_flight: int = 0
    streams: bool = False  # answer stream_progress with progress events
    progress_steps: int = 3
    progress_delay_s: float = 0.02
    die_mid_stream: bool = False
    first_at_step: int | None = None  # the progress event that carries the first tokens (None: the last one)
    release: asyncio.Event | None = None  # set: the last progress and the result wait for it

    def __post_init__(self) -> None:
        super().__post_init__()
        self.app.router.add_post("/v1/prefill", self._prefill)

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        req = await read_message(request, PrefillRequest)
        self.tokens_seen.append(request.headers.get(INTERNAL_TOKEN_HEADER))
        self.requests.append(req)
        self.in_flight += 1
        try:
            fault = await self._fault()
        finally:
            self.in_flight -= 1
        if fault is not None:
            return fault
        result = self._result(req)
        if not (req.stream_progress and self.streams):
            return msgpack_response(result)
        stream = MessageStreamResponse()
        await stream.prepare(request)
        transport = request.transport
        assert transport is not None
        self._transports.add(transport)
        n = len(result.block_keys)

        def progress(durable: int, step: int | None) -> PrefillProgress:
            first = step == self.first_at_step
            return PrefillProgress(
                request_id=req.request_id, num_blocks=n, durable_blocks=durable, lease_id=result.lease_id,
                first_token_ids=result.first_token_ids if first else None, first_logprobs=result.first_logprobs if first else None,
            )

        try:
            for step in range(self.progress_steps + 1):
                await stream.send(progress(n * step // (self.progress_steps + 1), step))
                await asyncio.sleep(self.progress_delay_s)
            if self.die_mid_stream:
                transport.abort()
                return stream
            if self.release is not None:
                await self.release.wait()
            await stream.send(progress(n, None))
            await stream.send(result)
            await stream.write_eof()
        finally:
            self._transports.discard(transport)
        return stream

    def _result(self, req: PrefillRequest) -> PrefillResult:
        s = req.sampling
        firsts = [self.model.start(s.seed, i) for i in range(s.n)]
        keys = [str(k) for k in block_keys(NamespaceRoot.from_hex(self.namespace, self.block_size), req.prompt_token_ids)]
        n_keys = len(keys)
        return (
            PrefillResult(
                request_id=req.request_id,
                first_token_ids=firsts,
                first_logprobs=None if s.logprobs is None else [self.model.logprobs(t, s.logprobs) for t in firsts],
                prompt_logprobs=None if s.prompt_logprobs is None else self.model.prompt_logprobs(req.prompt_token_ids, s.prompt_logprobs),
                block_keys=keys,
                lease_id="lease-" + req.request_id,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=min(self.cached_tokens, len(req.prompt_token_ids)),
                num_computed_tokens=len(req.prompt_token_ids) - min(self.cached_tokens, len(req.prompt_token_ids)),
                bytes_written=1000 * n_keys,
                blocks_written=n_keys,
                timings={"queue_s": 0.001, "compute_s": 0.01, "write_s": 0.004},
                trace={"pool_hit_blocks": 1, "pool_miss_reasons": {"absent": 2}, "bytes_read": 500, "load_s": 0.001}
                if req.want_trace
                else None,
            )
        )


@dataclass
class FakeDecode(FakeInstance):
    """``POST /v1/decode``: streams the fake model's continuation as ``TokenEvent``s."""

    die_after: int | None = None  # events sent before the connection is cut
    event_delay_s: float = 0.0
    tokens_per_event: int = 1
    miss_reasons: dict[str, int] = field(default_factory=lambda: {"expired": 1})
    disconnected: list[str] = field(default_factory=list)  # streams the router closed
    active: set[str] = field(default_factory=set)
    updates: dict[str, list[HandoffUpdate]] = field(default_factory=dict)  # streamed handoffs, by request
    die_awaiting_handoff: bool = False  # cut the stream after the first HandoffUpdate

    def __post_init__(self) -> None:
        super().__post_init__()
        self.app.router.add_post("/v1/decode", self._decode)
        self.app.router.add_post("/v1/handoff", self._handoff)
        self._waiting: dict[str, asyncio.Event] = {}

    async def _handoff(self, request: web.Request) -> web.Response:
        msg = await read_message(request, HandoffUpdate)
        event = self._waiting.get(msg.request_id)
        if event is None:
            return web.json_response({"error": {"message": "not waiting", "type": "invalid_request_error", "param": None, "code": None}}, status=404)
        self.updates.setdefault(msg.request_id, []).append(msg)
        event.set()
        return web.json_response({"ok": True})

    async def _await_handoff(self, req: DecodeRequest, transport: asyncio.BaseTransport) -> DecodeRequest | None:
        """Wait for the last HandoffUpdate; the request as if it had come with its outcome
        (None when the connection was cut on purpose)."""
        event = self._waiting[req.request_id] = asyncio.Event()
        try:
            while True:
                await asyncio.wait_for(event.wait(), 10)
                event.clear()
                got = self.updates[req.request_id]
                if self.die_awaiting_handoff:
                    await self.stop_heartbeats()
                    transport.abort()
                    return None
                if got[-1].done:
                    last = got[-1]
                    return dataclasses.replace(req, await_handoff=False, first_token_id=last.first_token_id, lease_id=last.lease_id)
        finally:
            del self._waiting[req.request_id]

    def continuation(self, req: DecodeRequest) -> tuple[list[int], str]:
        """The tokens decode streams (after ``first_token_id`` if given) and the finish reason."""
        s: SamplingSpec = req.sampling
        out: list[int] = []
        count = 0
        if req.first_token_id is None:
            token = self.model.start(s.seed)
        else:
            count = 1
            last = req.first_token_id
            if self._ends(last, count, s) is not None:
                return [], self._ends(last, count, s) or "stop"
            token = self.model.after(last)
        while True:
            if token == self.model.eos and count < s.min_tokens:
                token = self.model.script[0]
            out.append(token)
            count += 1
            end = self._ends(token, count, s)
            if end is not None:
                return out, end
            token = self.model.script[0] if token == self.model.eos else self.model.after(token)

    def _ends(self, token: int, count: int, s: SamplingSpec) -> str | None:
        if (token == self.model.eos and not s.ignore_eos) or token in s.stop_token_ids:
            return "stop"
        if count >= s.max_tokens:
            return "length"
        return None

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        req = await read_message(request, DecodeRequest)
        self.tokens_seen.append(request.headers.get(INTERNAL_TOKEN_HEADER))
        self.requests.append(req)
        fault = await self._fault()
        if fault is not None:
            return fault
        stream = MessageStreamResponse()
        await stream.prepare(request)
        transport = request.transport
        assert transport is not None
        self._transports.add(transport)
        if req.await_handoff:
            try:
                waited = await self._await_handoff(req, transport)
            finally:
                self._transports.discard(transport)
            if waited is None:
                return stream
            req = waited
            self._transports.add(transport)
        tokens, finish = self.continuation(req)
        self.active.add(req.request_id)
        k = self.tokens_per_event
        batches = [tokens[i : i + k] for i in range(0, len(tokens), k)] or [[]]
        hits = sum(1 for key in req.block_keys if ":partial:" not in key)
        try:
            for i, batch in enumerate(batches):
                if self.die_after is not None and i >= self.die_after:
                    await self.stop_heartbeats()  # a crashing process stops heartbeating too
                    transport.abort()  # mid-stream: the chunked body never ends
                    return stream
                last = i == len(batches) - 1
                s = req.sampling
                await stream.send(
                    TokenEvent(
                        request_id=req.request_id,
                        token_ids=batch,
                        logprobs=None if s.logprobs is None else [self.model.logprobs(t, s.logprobs) for t in batch],
                        finish_reason=finish if last else None,
                        num_cached_tokens=len(req.prompt_token_ids) - 1 if hits else 0,
                        prompt_logprobs=None
                        if i or s.prompt_logprobs is None
                        else self.model.prompt_logprobs(req.prompt_token_ids, s.prompt_logprobs),
                        trace={
                            "pool_hit_blocks": hits,
                            "pool_miss_reasons": self.miss_reasons,
                            "bytes_read": 1000 * hits,
                            "load_s": 0.002,
                            "queue_s": 0.0005,
                        }
                        if last and req.want_trace
                        else None,
                    )
                )
                if self.event_delay_s and not last:
                    await asyncio.sleep(self.event_delay_s)
            await stream.write_eof()
        except ConnectionResetError:  # the router closed the stream
            self.disconnected.append(req.request_id)
        except asyncio.CancelledError:
            self.disconnected.append(req.request_id)
            raise
        finally:
            self.active.discard(req.request_id)
            self._transports.discard(transport)
        return stream
