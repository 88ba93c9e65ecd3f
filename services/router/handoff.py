"""The prefill -> decode path of one prompt, and the decode stream of each of its choices.

A :class:`PromptJob` decides whether prefill runs (placement.py), calls it for all ``n``
first tokens at once, then runs ``n`` :class:`ChoiceJob` in parallel. The pool query
(are all of the prompt's blocks in the pool already?) runs beside the prefill call, which
it abandons when they are, rather than in front of it. Each choice streams
from its own decode instance, turns tokens into text (detok.py) and puts
:class:`ChoiceUpdate` items into the request's outbox; an unrecoverable failure is put
there as an :class:`ApiError`.

Faults cost latency, never a request:

- no prefill instance, or the prefill call fails (refused, 503, timeout, killed): the
  choices go to decode with ``first_token_id=None`` and decode computes the prompt;
- a decode stream breaks (connection error, truncated stream, silence, a final event with
  ``abort``/``error``, a 5xx): the instance is marked unusable until its next heartbeat and
  the choice resumes on the best usable instance, waiting up to ``retry_wait_s`` for one
  to (re)appear, at most ``decode_retries`` times. A resumed stream asks for
  ``prompt + generated[:-1]`` with ``first_token_id = generated[-1]``, ``max_tokens`` and
  ``min_tokens`` reduced by the tokens already counted and the same seed, so the client's
  stream just continues. With greedy sampling the text is identical to an unbroken run;
  with sampling it is a valid continuation (the seeded generator restarts, and tokens
  generated so far count as prompt for the penalties).
- a decode that refuses the request (4xx) is not retried: the router validated it, so
  another instance would refuse it too; the client gets a 502 naming decode's reason.
- an instance at its queue bound answers 429: it is marked full until its next heartbeat
  (registry.py) and the choice goes to another instance, or waits for one to have room,
  for at most ``queue_timeout_s`` in all; then the client gets a 429 with
  ``Retry-After``. A prefill that answers 429 costs only the handoff: decode computes.

Streamed handoff (``--stream-handoff``, on by default; docs/HANDOFF.md): prefill is asked
for ``stream_progress`` and answers with ``PrefillProgress`` events before its result.
As soon as the first one arrives (prefill has asked the pool), the choices start their decode
attempts with ``await_handoff``; each attempt forwards every change of the prompt's
:class:`~services.router.progress.HandoffProgress` to its decode instance as a
``HandoffUpdate``, so decode loads durable blocks while prefill computes the rest. Prefill
sends the first tokens in a progress event as soon as it has sampled them, while its last
writes are still on their way: each choice streams its first token to the client then,
and forwards it in the last update (at the result); decode generates after it. A prefill
that fails mid-way is forwarded as a last update with its error: decode loads what is
durable and computes the tail, and the first token too unless prefill had sent it (the
choice's stream then carries every token). A prefill that answers without progress
events (an older instance) takes the classic path.

Prompt logprobs (``echo`` with ``logprobs``): the instance that computes the prompt scores
it, so the prompt must be computed, never loaded: prefill is asked for them (and the pool
is not consulted for a skip), with the classic handoff (the choices need them before their
first token, and a streamed handoff whose prefill fails would leave decode a prompt it
partly loads). When prefill does not answer them (no prefill, a short prompt, a failed
call), decode is asked instead and sends them on its first event; the engine computes the
whole prompt for such a request (no prefix-cache hit, no import). They reach the client on
each choice's first update, before its first token.

Contract with decode (as libs/engine's ``output_prefix``): when ``first_token_id`` is set,
decode's stream carries only the tokens *after* it, since the router already has it from
prefill (and streamed it to the client as soon as it came). ``max_tokens`` counts it.

Abort paths all end in ``AbortRequest`` to the instance that holds the work, in the
background so a cancelled request still sends it: a stop string matching (the decode
stream is also closed), the client going away (the request's tasks are cancelled), a
decode attempt that broke, and a prefill call abandoned mid-way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from libs.protocol.messages import (
    DecodeRequest,
    HandoffUpdate,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    PromptLogprobs,
    TokenLogprobs,
)
from services.router import placement
from services.router.api import GenerateRequest, choice_seed
from services.router.detok import Piece, TextAssembler, TokenLogprob, render_prompt_logprobs
from services.router.errors import ApiError, no_decode_instance, overloaded
from services.router.progress import HandoffProgress
from services.router.registry import Instance
from services.router.state import RouterState
from services.router.trace import AttemptTrace, PromptTrace
from services.router.workers import WorkerError

log = logging.getLogger("tidepool.router.handoff")

_PARTIAL = ":partial:"


@dataclass
class ChoiceUpdate:
    """New output of one choice; ``finish_reason`` is set on its last update only."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    logprob_sum: float = 0.0  # of these tokens' sampled logprobs (best_of ranks by the total)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # on a choice's first update


Outbox = asyncio.Queue  # of ChoiceUpdate | ApiError


@dataclass
class Handoff:
    """What the choices start from: prefill's first tokens and blocks, or nothing."""

    namespace: str | None
    first_token_ids: list[int] | None = None
    first_logprobs: list[TokenLogprobs] | None = None
    block_keys: list[str] = field(default_factory=list)
    lease_id: str | None = None
    progress: HandoffProgress | None = None  # a streamed handoff: prefill's progress

    @property
    def streaming(self) -> bool:
        """Prefill is still running: decode attempts start with ``await_handoff``."""
        return self.progress is not None and not self.progress.final

    def take_first(self, ids: list[int], logprobs: list[TokenLogprobs] | None) -> None:
        """Prefill's first tokens (once: the ones a client may have seen stand)."""
        if self.first_token_ids is None:
            self.first_token_ids, self.first_logprobs = ids, logprobs
        elif ids != self.first_token_ids:
            log.warning("prefill's result has first tokens %s, its progress had %s: the earlier stand", ids, self.first_token_ids)

    def take_result(self, result: PrefillResult) -> None:
        self.take_first(result.first_token_ids, result.first_logprobs)
        self.block_keys = result.block_keys
        self.lease_id = result.lease_id


_FULL = "status_429"  # an instance at its queue bound (services/worker/app.py)


def _marks_unusable(reason: str) -> bool:
    """Whether a failure says something about the instance (rather than the request)."""
    return not reason.startswith("status_4")


class PromptJob:
    """One prompt: the prefill decision and call, then its ``n`` choices in parallel."""

    def __init__(
        self,
        state: RouterState,
        req: GenerateRequest,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        max_tokens: int,
        trace: PromptTrace,
        outbox: Outbox,
    ) -> None:
        self.state = state
        self.req = req
        self.index = index
        self.id = request_id if req.num_prompts == 1 else f"{request_id}-{index}"
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.trace = trace
        self.outbox = outbox
        self.choices = [ChoiceJob(self, i) for i in range(req.candidates)]
        self.prompt_logprobs: list[TokenLogprob] | None = None  # scored prompt, once an instance sent it
        self._prefill_task: asyncio.Task[None] | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a cache: prefill's count when it ran, else decode's."""
        result = self.trace.prefill.result
        if result is not None:
            cached = result.num_cached_tokens
        else:
            attempts = self.trace.choices.get(0) or []
            cached = attempts[0].num_cached_tokens if attempts else 0
        return min(cached, len(self.prompt_ids))

    async def run(self) -> None:
        try:
            handoff = await self._prefill()
            await asyncio.gather(*(choice.run(handoff) for choice in self.choices))
        finally:
            await self._abandon_prefill()  # the choices ended first (cancelled): prefill too

    def _decide(self, decision: str, reason: str | None = None) -> None:
        self.trace.prefill.decision = decision
        self.trace.prefill.reason = reason
        self.state.metrics.prefill_decisions.labels(decision).inc()

    async def _prefill(self) -> Handoff:
        s, registry = self.state.settings, self.state.registry
        n_prompt = len(self.prompt_ids)
        target = placement.pick_decode(registry.usable("decode"), n_prompt) or placement.pick_decode(
            registry.live("decode"), n_prompt
        )
        handoff = Handoff(namespace=target.namespace if target else None)
        if n_prompt < s.prefill_threshold_tokens:
            self._decide(placement.SKIP_SHORT_PROMPT, f"{n_prompt} < {s.prefill_threshold_tokens} tokens")
            return handoff
        prefill = placement.pick_prefill(registry.usable("prefill"), handoff.namespace) if target else None
        if prefill is None or target is None:
            self._decide(placement.NO_PREFILL_INSTANCE)
            return handoff
        # The pool query and the prefill call start together: a fresh prompt, the usual
        # case, then pays no cache_store round trip (~2 ms, measured) in front of its
        # compute. A prompt the query finds whole in the pool abandons the call (prefill
        # gets an abort, decode loads every block). A scored prompt must be computed.
        # The call is started first and the query yields once before its Python (the
        # prompt's block keys hashed, a JSON body), so the call's request, body included,
        # is on its socket first (aiohttp writes a body from a task of its own before
        # Python 3.12). Router's prefill decision -> prefill has the request: 1.95-2.48
        # -> 1.27-1.59 ms for 2048 tokens on the 2-core VM (bench/RESULTS.md, issue 8, round 11).
        stream = self.req.stream_handoff if self.req.stream_handoff is not None else s.stream_handoff
        if stream and self.req.prompt_logprobs is None:
            # Streamed: the choices start once prefill has announced its progress (or is done).
            handoff.progress = HandoffProgress()
            call = self._prefill_in_background(prefill, handoff)
        else:
            call = self._prefill_serial(prefill, handoff)
        self.trace.prefill.called_at = time.time()
        self._prefill_task = asyncio.create_task(call, name=f"prefill {self.id}")
        query = None
        if s.cache_store_url and self.req.prompt_logprobs is None:
            query = asyncio.create_task(self._pool_query(target), name=f"pool query {self.id}")
        try:
            in_pool = await query if query is not None else None
        finally:
            if query is not None and not query.done():  # this job was cancelled
                query.cancel()
        if in_pool is not None and handoff.first_token_ids is None:  # (prefill may have answered first)
            await self._abandon_prefill()
            handoff.progress = None
            handoff.block_keys = in_pool
            self._decide(placement.SKIP_IN_POOL, f"all {len(in_pool)} blocks in the pool")
            return handoff
        if handoff.progress is not None:
            await handoff.progress.wait_started()
        else:
            await self._prefill_task
        return handoff

    async def _pool_query(self, target: Instance) -> list[str] | None:
        """The prompt's keys when every block is in the pool (cache_store says), else None."""
        await asyncio.sleep(0)  # the prefill call's request first (see _prefill)
        t_query = time.perf_counter()
        complete, keys, note = await self.state.client.pool_has_all(target.root, self.prompt_ids)
        note["s"] = round(time.perf_counter() - t_query, 6)
        self.trace.prefill.pool_query = note
        return keys if complete else None

    async def _abandon_prefill(self) -> None:
        """Cancel the prefill call (its cancellation sends prefill the abort)."""
        task = self._prefill_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _prefill_serial(self, inst: Instance, handoff: Handoff) -> None:
        result = await self._call_prefill(inst, None)
        if result is not None:
            handoff.take_result(result)

    async def _prefill_in_background(self, inst: Instance, handoff: Handoff) -> None:
        assert handoff.progress is not None
        try:
            await self._call_prefill(inst, handoff)
        finally:
            if not handoff.progress.final:  # a bug, not a prefill failure: never leave the choices waiting
                handoff.progress.fail("internal")

    async def _call_prefill(self, inst: Instance, handoff: Handoff | None) -> PrefillResult | None:
        """Prefill's result, or None (decided and traced) when decode must do it all.

        With ``handoff`` (streamed) progress goes into ``handoff.progress`` as it arrives,
        and the outcome too: the result (after ``handoff`` took it) or the failure."""
        state, t = self.state, self.trace.prefill
        progress = handoff.progress if handoff is not None else None
        req = PrefillRequest(
            request_id=self.id,
            prompt_token_ids=self.prompt_ids,
            sampling=self.req.sampling(max_tokens=self.max_tokens, n=self.req.candidates, seed=self.req.seed, score_prompt=True),
            lease_ttl_s=state.settings.lease_ttl_s,
            want_trace=True,
            stream_progress=progress is not None,
        )
        t.instance, t.request_id = inst.id, self.id
        inst.dispatched += 1
        inst.in_flight += 1
        started = time.perf_counter()
        result: PrefillResult | None = None
        try:
            async with aclosing(state.client.prefill(inst.url, req)) as messages:
                async for msg in messages:
                    if msg.request_id != self.id:
                        raise WorkerError("protocol", f"prefill answered for {msg.request_id}")
                    if isinstance(msg, PrefillResult):
                        result = msg
                        break
                    if progress is not None:
                        if msg.first_token_ids is not None and handoff is not None:
                            self._check_first(msg.first_token_ids)
                            handoff.take_first(msg.first_token_ids, msg.first_logprobs)
                        progress.update(msg)
            if result is None:
                raise WorkerError("truncated", "prefill's answer ended without a PrefillResult")
            self._check(result)
        except WorkerError as exc:
            if exc.reason == _FULL:
                state.registry.mark_full(inst)
                state.metrics.instance_full.labels("prefill").inc()
            elif _marks_unusable(exc.reason):
                state.registry.mark_unusable(inst, f"prefill {exc}")
            state.client.abort(inst.url, self.id)  # it may still be working (a timeout)
            log.warning("prefill of %s on %s failed (%s); decode computes what it lacks", self.id, inst.id, exc)
            self._decide(placement.PREFILL_FAILED, exc.reason)
            if progress is not None:
                progress.fail(exc.reason)
            return None
        except asyncio.CancelledError:
            state.client.abort(inst.url, self.id)
            t.decision = "cancelled"  # the trace says where it was; not a placement decision
            if progress is not None:
                progress.fail("cancelled")
            raise
        finally:
            inst.in_flight -= 1
            t.call_s = time.perf_counter() - started
        t.result = result
        self._decide(placement.PREFILL)
        if handoff is not None and progress is not None:
            handoff.take_result(result)
            progress.finish(result)
        return result

    def _check(self, result: PrefillResult) -> None:
        if result.request_id != self.id:
            raise WorkerError("protocol", f"PrefillResult for {result.request_id}")
        self._check_first(result.first_token_ids)
        if self.req.prompt_logprobs is not None:
            self.take_prompt_logprobs(result.prompt_logprobs, "prefill")

    def _check_first(self, ids: list[int]) -> None:
        if len(ids) != self.req.candidates:
            raise WorkerError("protocol", f"prefill sent {len(ids)} first tokens for {self.req.candidates} completions")
        if max(ids) >= self.state.tokenizer.vocab_size:
            raise WorkerError("protocol", f"first token id {max(ids)} outside the vocabulary")

    def take_prompt_logprobs(self, wire: PromptLogprobs | None, who: str) -> None:
        """Keep an instance's scored prompt (the first one; later ones are the same)."""
        if wire is None:
            raise WorkerError("protocol", f"{who} sent no prompt logprobs")
        try:
            rendered = render_prompt_logprobs(self.state.renderer, self.prompt_ids, wire)
        except ValueError as exc:
            raise WorkerError("protocol", f"{who}: {exc}") from None
        if self.prompt_logprobs is None:
            self.prompt_logprobs = rendered


class ChoiceJob:
    """One choice: its first token (from prefill, if any), then a decode stream, resumed
    elsewhere when it breaks."""

    def __init__(self, job: PromptJob, i: int) -> None:
        self.job = job
        self.state = job.state
        self.i = i
        self.index = job.index * job.req.candidates + i  # among candidates (best_of.py picks)
        self.id = job.id if job.req.candidates == 1 else f"{job.id}-{i}"
        self.seed = choice_seed(job.req.seed, i)
        self.generated: list[int] = []
        self.text = TextAssembler(
            job.state.renderer, job.prompt_ids, job.req.stop, logprobs=job.req.logprobs is not None
        )
        self.attempts: list[AttemptTrace] = job.trace.choices.setdefault(i, [])
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._first_taken = False  # prefill's first token (if any) is in ``generated``
        self._prompt_sent = False  # the scored prompt went out on this choice's first update
        self._final_sent = False  # this attempt forwarded the handoff's last update

    async def run(self, handoff: Handoff) -> None:
        """Generate until done; never raises but for cancellation (errors go to the outbox)."""
        try:
            reason = await self._generate(handoff)
        except ApiError as exc:
            self.job.outbox.put_nowait(exc)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("choice %s failed", self.id)
            self.job.outbox.put_nowait(ApiError(500, "internal error while generating", code="internal_error"))
            return
        self._emit(Piece(text=self.text.finish()), reason)

    def _take_first(self, handoff: Handoff) -> bool:
        """Stream prefill's first token of this choice to the client (once); whether a stop
        string already matched. Nothing to take when prefill did not answer."""
        if self._first_taken:
            return False
        self._first_taken = True
        if handoff.first_token_ids is None:
            return False
        first = handoff.first_token_ids[self.i]
        first_lp = handoff.first_logprobs[self.i] if handoff.first_logprobs else None
        piece = self.text.add([first], [first_lp] if first_lp else None)
        self.generated.append(first)
        self._emit(piece)
        return self.text.stopped

    async def _generate(self, handoff: Handoff) -> str:
        failures = 0
        full_until: float | None = None  # the deadline once an instance answered 429
        while True:
            if not handoff.streaming and self._take_first(handoff):
                return "stop"  # nothing sent to decode yet; the lease simply expires
            inst = await self._pick_decode(handoff.namespace)
            if handoff.streaming:
                req = self._streamed_request(failures)
            elif self._take_first(handoff):  # prefill finished while an instance was picked
                return "stop"
            else:
                req = self._decode_request(handoff, failures)
            try:
                return await self._stream(inst, req, handoff if req.await_handoff else None)
            except WorkerError as exc:
                if exc.reason == _FULL:
                    full_until = full_until or time.monotonic() + self.state.settings.queue_timeout_s
                    await self._wait_for_room(inst, full_until)
                    continue
                failures += 1
                if _marks_unusable(exc.reason):
                    self.state.registry.mark_unusable(inst, f"decode {exc}")
                if exc.reason.startswith("status_4"):
                    raise ApiError(502, f"decode refused the request: {exc.detail}", code="decode_refused") from None
                if failures > self.state.settings.decode_retries:
                    raise ApiError(
                        503, f"decode failed {failures} times (last: {exc}); retry later", code="decode_failed"
                    ) from None
                done = self._finished_without_decode()
                if done is not None:
                    return done
                self.state.metrics.resumptions.labels(exc.reason).inc()
                log.warning(
                    "decode of %s on %s broke after %d tokens (%s); resuming elsewhere",
                    self.id,
                    inst.id,
                    len(self.generated),
                    exc,
                )

    async def _wait_for_room(self, inst: Instance, deadline: float) -> None:
        """After a 429 from ``inst``: return at once if another instance may have room, else
        when an instance heartbeats (clearing its full mark); a 429 past ``deadline``."""
        registry, s = self.state.registry, self.state.settings
        registry.mark_full(inst)
        self.state.metrics.instance_full.labels("decode").inc()
        need = len(self.job.prompt_ids) + self.job.max_tokens
        while not any(not i.full and i.info.max_model_len >= need for i in registry.usable("decode")):
            left = deadline - time.monotonic()
            if left <= 0:
                raise overloaded(
                    f"every decode instance is at its queue limit (waited {s.queue_timeout_s:g} s)",
                    s.retry_after_s,
                    code="instances_full",
                )
            await registry.wait_for_change(left)

    def _finished_without_decode(self) -> str | None:
        """A stream that broke right after its last token leaves nothing to resume."""
        if len(self.generated) < self.job.max_tokens:
            return None
        req = self.job.req
        last = self.generated[-1]
        eos = last in self.state.tokenizer.eos_token_ids and not req.ignore_eos
        return "stop" if eos or last in req.stop_token_ids else "length"

    async def _pick_decode(self, namespace: str | None) -> Instance:
        registry = self.state.registry
        need = len(self.job.prompt_ids) + self.job.max_tokens
        context = len(self.job.prompt_ids) + len(self.generated)

        def pick() -> Instance | None:
            fits = [i for i in registry.usable("decode") if i.info.max_model_len >= need]
            return placement.pick_decode(fits, context, namespace)

        inst = await registry.wait_for(pick, self.state.settings.retry_wait_s)
        if inst is None:
            raise no_decode_instance(f"no usable decode instance for a {need}-token request")
        return inst

    @property
    def _score_prompt(self) -> bool:
        """Decode must score the prompt: asked for, and no instance has sent it yet."""
        return self.job.req.prompt_logprobs is not None and self.job.prompt_logprobs is None

    def _decode_request(self, handoff: Handoff, attempt: int) -> DecodeRequest:
        job, g = self.job, self.generated
        request_id = self.id if attempt == 0 else f"{self.id}.r{attempt}"
        if not g:  # decode computes the prompt and samples every token
            return DecodeRequest(
                request_id=request_id,
                prompt_token_ids=job.prompt_ids,
                sampling=job.req.sampling(max_tokens=job.max_tokens, n=1, seed=self.seed, score_prompt=self._score_prompt),
                block_keys=handoff.block_keys,
                lease_id=handoff.lease_id if attempt == 0 else None,
                want_trace=True,
            )
        counted = len(g) - 1  # tokens before the one sent as first_token_id
        first_lp = None
        if counted == 0 and handoff.first_logprobs:
            first_lp = handoff.first_logprobs[self.i]
        keys = handoff.block_keys if counted == 0 else [k for k in handoff.block_keys if _PARTIAL not in k]
        return DecodeRequest(
            request_id=request_id,
            prompt_token_ids=job.prompt_ids + g[:-1],
            num_resumed_tokens=counted,  # a constrained request replays them into its grammar
            first_token_id=g[-1],
            first_logprobs=first_lp,
            sampling=job.req.sampling(max_tokens=job.max_tokens - counted, n=1, seed=self.seed),
            block_keys=keys,
            lease_id=handoff.lease_id if attempt == 0 else None,
            want_trace=True,
        )

    def _streamed_request(self, attempt: int) -> DecodeRequest:
        """A decode attempt that starts before prefill's result (``await_handoff``)."""
        job = self.job
        return DecodeRequest(
            request_id=self.id if attempt == 0 else f"{self.id}.r{attempt}",
            prompt_token_ids=job.prompt_ids,
            sampling=job.req.sampling(max_tokens=job.max_tokens, n=1, seed=self.seed),
            want_trace=True,
            await_handoff=True,
        )

    async def _stream(self, inst: Instance, req: DecodeRequest, handoff: Handoff | None = None) -> str:
        """Run one decode attempt to its end; the finish reason, or ``WorkerError``.

        With ``handoff`` (a streamed attempt) prefill's progress is forwarded to decode
        alongside reading its stream."""
        state = self.state
        a = AttemptTrace(
            instance=inst.id,
            request_id=req.request_id,
            tokens_before=len(self.generated),
            with_first_token=req.first_token_id is not None,
            streamed=handoff is not None,
        )
        self.attempts.append(a)
        inst.dispatched += 1
        inst.in_flight += 1
        self._ended_by_decode = False
        self._final_sent = False
        try:
            async with state.client.decode(inst.url, req) as events:
                if handoff is None:
                    return await self._read(events, a, streamed=False)
                return await self._relay(inst, req, events, handoff, a)
        except WorkerError as exc:
            a.outcome = exc.reason
            raise
        except asyncio.CancelledError:
            a.outcome = "cancelled"
            raise
        finally:
            a.seconds = time.perf_counter() - a.started
            inst.in_flight -= 1
            if not self._ended_by_decode:
                state.client.abort(inst.url, req.request_id)

    async def _read(self, events, a: AttemptTrace, *, streamed: bool) -> str:
        """Consume one decode stream: emit its tokens; the finish reason, or ``WorkerError``."""
        state = self.state
        async for ev in events:
            if a.first_event_s is None:
                a.first_event_s = time.perf_counter() - a.started
            if streamed and ev.token_ids and not self._final_sent:
                raise WorkerError("protocol", "decode generated before the handoff's last update")
            a.num_cached_tokens = max(a.num_cached_tokens, ev.num_cached_tokens)
            if ev.prompt_logprobs is not None and self.job.req.prompt_logprobs is not None:
                self.job.take_prompt_logprobs(ev.prompt_logprobs, "decode")
            elif ev.token_ids and self._score_prompt:
                raise WorkerError("protocol", "decode sent tokens before the prompt logprobs it was asked for")
            piece = self.text.add(ev.token_ids, ev.logprobs)
            self.generated.extend(ev.token_ids[: piece.num_tokens])
            a.tokens += piece.num_tokens
            self._emit(piece)
            if ev.finish_reason is not None:
                self._ended_by_decode = True
                a.worker = ev.trace
            if self.text.stopped:
                a.outcome = "stop_string"
                state.metrics.aborts.labels("stop_string").inc()
                return "stop"
            if ev.finish_reason in ("stop", "length"):
                a.outcome = ev.finish_reason
                return ev.finish_reason
            if ev.finish_reason is not None:
                raise WorkerError(f"decode_{ev.finish_reason}", ev.error or "")
        raise WorkerError("truncated", "the stream ended without a final event")

    async def _relay(self, inst: Instance, req: DecodeRequest, events, handoff: Handoff, a: AttemptTrace) -> str:
        """A streamed attempt: read decode's stream while forwarding prefill's progress."""
        read = asyncio.ensure_future(self._read(events, a, streamed=True))
        forward = asyncio.ensure_future(self._forward(inst, req.request_id, handoff, a, lease=req.request_id == self.id))
        try:
            done, _ = await asyncio.wait({read, forward}, return_when=asyncio.FIRST_COMPLETED)
            if forward in done and forward.result():  # raises if forwarding failed
                a.outcome = "stop_string"  # prefill's first token matched a stop string
                self.state.metrics.aborts.labels("stop_string").inc()
                return "stop"
            return await read
        finally:
            for t in (read, forward):
                t.cancel()
            await asyncio.gather(read, forward, return_exceptions=True)

    async def _forward(self, inst: Instance, request_id: str, handoff: Handoff, a: AttemptTrace, *, lease: bool) -> bool:
        """Post every change of prefill's progress to decode as a ``HandoffUpdate``, until
        the last one, and stream prefill's first token to the client as soon as it has
        come. Returns True when that token already ended the choice (a stop string):
        nothing more is forwarded then."""
        progress = handoff.progress
        assert progress is not None
        sent: tuple[int, str | None] | None = None
        # One progress post at a time; the final one does not wait for it: updates are
        # cumulative, so a progress post still on its way is cut off (decode keeps the
        # latest state whatever order they land in). Waiting cost the 2nd token a round
        # trip to a decode busy loading (~3 ms on the H100 host).
        posting: asyncio.Task[None] | None = None
        try:
            while True:
                version = progress.version
                lease_id = progress.lease_id if lease else None
                if handoff.first_token_ids is not None and self._take_first(handoff):
                    return True  # prefill's first token, streamed to the client before its result
                if progress.final:
                    await _cut_off(posting)
                    posting = None
                    if self._take_first(handoff):
                        return True
                    first = handoff.first_token_ids[self.i] if handoff.first_token_ids is not None else None
                    first_lp = handoff.first_logprobs[self.i] if first is not None and handoff.first_logprobs else None
                    a.with_first_token = first is not None
                    self._final_sent = True
                    update = HandoffUpdate(
                        request_id=request_id, durable_blocks=progress.durable_blocks, lease_id=lease_id, done=True,
                        first_token_id=first, first_logprobs=first_lp, error=progress.error,
                    )
                    await self._post_update(inst, update, a, "failed" if progress.error is not None else "final")
                    return False
                if posting is not None and posting.done():
                    posting.result()  # raises if decode could not take it: the attempt is broken
                    posting = None
                if posting is None and (progress.durable_blocks, lease_id) != sent:
                    sent = (progress.durable_blocks, lease_id)
                    update = HandoffUpdate(request_id=request_id, durable_blocks=progress.durable_blocks, lease_id=lease_id)
                    posting = asyncio.create_task(self._post_update(inst, update, a, "progress"))
                newer = asyncio.ensure_future(progress.wait_newer(version))
                try:
                    await asyncio.wait({newer} if posting is None else {newer, posting}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    newer.cancel()
        finally:
            await _cut_off(posting)

    async def _post_update(self, inst: Instance, update: HandoffUpdate, a: AttemptTrace, kind: str) -> None:
        try:
            await self.state.client.handoff_update(inst.url, update)
        except WorkerError as exc:  # decode cannot follow the handoff: the attempt is broken
            raise WorkerError(f"handoff_{exc.reason}", exc.detail) from None
        a.updates += 1
        self.state.metrics.handoff_updates.labels(kind).inc()

    def _emit(self, piece: Piece, finish_reason: str | None = None) -> None:
        if piece.num_tokens:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        prompt: list[TokenLogprob] = []
        if not self._prompt_sent and self.job.prompt_logprobs is not None:
            prompt, self._prompt_sent = self.job.prompt_logprobs, True
        if piece.text or piece.logprobs or piece.num_tokens or finish_reason or prompt:
            self.job.outbox.put_nowait(
                ChoiceUpdate(self.index, piece.text, piece.logprobs, piece.num_tokens, finish_reason, piece.logprob_sum, prompt)
            )

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, for the metric."""
        n = len(self.generated)
        if n < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (n - 1)


async def _cut_off(post: "asyncio.Task[None] | None") -> None:
    """Cancel a progress post still on its way (if any) and wait for it to end."""
    if post is not None:
        post.cancel()
        await asyncio.gather(post, return_exceptions=True)
