"""The messages services exchange (DESIGN.md, "One request, storage-pool mode").

Router -> prefill: :class:`PrefillRequest`, answered by :class:`PrefillResult` (with
``stream_progress``: a stream of :class:`PrefillProgress`, then the :class:`PrefillResult`).
Router -> decode: :class:`DecodeRequest`, answered by a stream of :class:`TokenEvent`; with
``await_handoff`` the router then posts :class:`HandoffUpdate` messages as prefill
progresses (the streamed handoff, docs/HANDOFF.md).
Router -> prefill/decode: :class:`AbortRequest`.
Prefill/decode -> router: :class:`RegisterInstance` once, then :class:`Heartbeat` (and
:class:`DeregisterInstance` when going down); the router
answers both with :class:`InstanceAck`.
Anyone: :class:`ErrorMessage` where a msgpack peer needs an error it can decode.

Every class documents each field; ``validate`` holds the value rules a receiver relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from libs.protocol.message import Message, check

MAX_LOGPROBS = 20
# The longest context an instance may register: a prompt travels as one array, and arrays
# are bounded by the decode limits (limits.py, ``max_array_len``).
MAX_MODEL_LEN = 1 << 20

Role = Literal["prefill", "decode"]
FinishReason = Literal["stop", "length", "abort", "error"]


def _check_token_ids(ids: list[int], name: str, *, non_empty: bool = False) -> None:
    check(not non_empty or len(ids) > 0, name, "must not be empty")
    check(not ids or min(ids) >= 0, name, "token ids must be >= 0")


def _check_first_logprobs(ids: list[int] | None, logprobs: list | None) -> None:
    check(logprobs is None or (ids is not None and len(logprobs) == len(ids)), "first_logprobs", "must have one entry per first token")


StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
MAX_LOGIT_BIAS = 1024


@dataclass(kw_only=True)
class StructuredSpec(Message, version=1):
    """An output constraint (structured outputs), as libs.structured.GrammarSpec.

    Attributes:
        kind: ``json_schema``, ``json_object``, ``regex``, ``choice``, ``grammar``
            (EBNF/GBNF or Lark) or ``lark`` (llguidance Lark, as tool calling builds it).
        value: the constraint's text (a schema as JSON, a JSON array of choices, ...).
        strict: JSON schemas: refuse keywords that cannot be enforced instead of ignoring them.
    """

    kind: StructuredKind
    value: str = ""
    strict: bool = False


@dataclass(kw_only=True)
class SamplingSpec(Message, version=1):
    """How to sample tokens; the OpenAI sampling parameters in engine terms.

    Attributes:
        temperature: softmax temperature, >= 0; 0 means greedy.
        top_p: nucleus sampling mass, in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; -1 is off, otherwise >= 1.
        min_p: drop tokens below ``min_p`` times the top probability, in [0, 1]; 0 is off.
        presence_penalty: OpenAI presence penalty, in [-2, 2].
        frequency_penalty: OpenAI frequency penalty, in [-2, 2].
        repetition_penalty: multiplicative penalty on seen tokens, > 0; 1 is off.
        seed: per-request RNG seed for reproducible sampling; None draws from the engine.
        max_tokens: most tokens to generate, >= 1 (counting the first token).
        min_tokens: generate at least this many tokens before EOS or a stop token may end
            the completion, in 0..max_tokens (counting the first token, like max_tokens).
        stop_token_ids: token ids that end generation (besides EOS), each >= 0.
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: number of top alternatives to return per token, 0..20; None returns none
            (0 returns only the sampled token's logprob).
        n: number of completions sampled from one prompt, >= 1.
        logit_bias_ids: token ids whose logits are biased (OpenAI ``logit_bias``), each >= 0.
        logit_bias_values: their biases, one per id, in [-100, 100]; -100 bans the token.
        structured: constrain the output to a grammar; None leaves it free. Prefill
            constrains the first token with it, decode everything after.
        prompt_logprobs: also score the prompt (``echo`` with ``logprobs``): the logprob of
            each prompt token after the first, with this many top alternatives, 0..20;
            None scores nothing. The instance that computes the prompt answers it
            (:class:`PromptLogprobs`), computing every prompt token (no cache hit).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    logit_bias_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    structured: StructuredSpec | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", "must be finite and >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        check(
            self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
            "repetition_penalty",
            "must be finite and > 0",
        )
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in 0..max_tokens")
        _check_token_ids(self.stop_token_ids, "stop_token_ids")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in 0..{MAX_LOGPROBS}")
        check(self.n >= 1, "n", "must be >= 1")
        _check_token_ids(self.logit_bias_ids, "logit_bias_ids")
        check(len(self.logit_bias_ids) <= MAX_LOGIT_BIAS, "logit_bias_ids", f"at most {MAX_LOGIT_BIAS} entries")
        check(len(self.logit_bias_values) == len(self.logit_bias_ids), "logit_bias_values", "must have one entry per logit_bias_ids entry")
        check(all(math.isfinite(b) and -100 <= b <= 100 for b in self.logit_bias_values), "logit_bias_values", "must be in [-100, 100]")
        check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be in 0..{MAX_LOGPROBS}",
        )


@dataclass(kw_only=True)
class TokenLogprobs(Message, version=1):
    """The log-probability of one sampled token and of its top alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (may be ``-inf``).
        top_ids: the most likely tokens, most likely first (``SamplingSpec.logprobs`` of them).
        top_logprobs: their log-probabilities, same length as ``top_ids``.
    """

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def validate(self) -> None:
        check(self.token_id >= 0, "token_id", "must be >= 0")
        check(len(self.top_logprobs) == len(self.top_ids), "top_logprobs", "must have one entry per top_ids entry")
        check(len(self.top_ids) <= MAX_LOGPROBS, "top_ids", f"at most {MAX_LOGPROBS} alternatives")
        _check_token_ids(self.top_ids, "top_ids")


@dataclass(kw_only=True)
class PromptLogprobs(Message, version=1):
    """The log-probability of each prompt token given the tokens before it (vLLM's
    ``prompt_logprobs``), position by position from the second token (the first has none).

    Columns rather than one :class:`TokenLogprobs` per token: a long prompt is one compact
    message.

    Attributes:
        token_ids: the scored prompt tokens, ``prompt[1:]``.
        logprobs: ``log p(prompt[i] | prompt[:i])``, one per entry of ``token_ids``.
        top_ids: per position, the most likely tokens (``SamplingSpec.prompt_logprobs`` of
            them), most likely first.
        top_logprobs: their log-probabilities, shaped as ``top_ids``.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def validate(self) -> None:
        _check_token_ids(self.token_ids, "token_ids")
        n = len(self.token_ids)
        for name in ("logprobs", "top_ids", "top_logprobs"):
            check(len(getattr(self, name)) == n, name, "must have one entry per token")
        for i, (ids, lps) in enumerate(zip(self.top_ids, self.top_logprobs)):
            check(len(ids) == len(lps) and len(ids) <= MAX_LOGPROBS, f"top_ids[{i}]", f"at most {MAX_LOGPROBS}, one logprob each")
            _check_token_ids(ids, f"top_ids[{i}]")


@dataclass(kw_only=True)
class PrefillRequest(Message, version=1):
    """Router -> prefill: compute a prompt's KV, write its blocks to the pool, sample token 1.

    Attributes:
        request_id: the router's id for the request, unique while it runs.
        prompt_token_ids: the tokenized prompt, non-empty.
        sampling: how to sample the first token(s); ``n`` first tokens are sampled.
        lease_ttl_s: seconds the handoff lease pins the written blocks for decode, > 0.
        want_trace: return the handoff trace (timings and decisions) with the result.
        stream_progress: answer with a message stream: :class:`PrefillProgress` whenever
            more of the prompt's blocks are durable in the pool (the first one as soon as
            the lease exists), then the :class:`PrefillResult`; blocks are written as the
            prompt's chunks are computed. Off: one :class:`PrefillResult` after all writes.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    lease_ttl_s: float = 30.0
    want_trace: bool = False
    stream_progress: bool = False

    def validate(self) -> None:
        check(len(self.request_id) > 0, "request_id", "must not be empty")
        _check_token_ids(self.prompt_token_ids, "prompt_token_ids", non_empty=True)
        check(self.lease_ttl_s > 0 and math.isfinite(self.lease_ttl_s), "lease_ttl_s", "must be finite and > 0")


@dataclass(kw_only=True)
class PrefillResult(Message, version=1):
    """Prefill -> router: the first token(s) and where the prompt's KV blocks are.

    Sent once every block write has been acknowledged (or has failed).

    Attributes:
        request_id: as in the request.
        first_token_ids: the first sampled token of each of the ``n`` completions.
        first_logprobs: their logprobs, one per first token, when the request asked for them.
        prompt_logprobs: the prompt's, when ``sampling.prompt_logprobs`` asked for them.
        block_keys: the pool keys of the prompt's blocks in order (the last may be partial).
        lease_id: the handoff lease pinning the blocks, for decode to release; None when
            nothing was written under a lease.
        num_prompt_tokens: tokens in the prompt.
        num_cached_tokens: prompt tokens found already computed (local prefix cache + pool).
        num_computed_tokens: prompt tokens computed by this prefill.
        bytes_written: KV bytes written to the pool.
        blocks_written: blocks written to the pool.
        blocks_failed: blocks whose write failed (e.g. no room); decode recomputes them.
        timings: named durations in seconds (``queue_s``, ``compute_s``, ``write_s``, ...).
        trace: the handoff trace, when ``want_trace`` was set.
    """

    request_id: str
    first_token_ids: list[int]
    first_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    block_keys: list[str] = field(default_factory=list)
    lease_id: str | None = None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    blocks_failed: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    trace: dict[str, Any] | None = None

    def validate(self) -> None:
        _check_token_ids(self.first_token_ids, "first_token_ids", non_empty=True)
        _check_first_logprobs(self.first_token_ids, self.first_logprobs)
        for name in (
            "num_prompt_tokens",
            "num_cached_tokens",
            "num_computed_tokens",
            "bytes_written",
            "blocks_written",
            "blocks_failed",
        ):
            check(getattr(self, name) >= 0, name, "must be >= 0")


@dataclass(kw_only=True)
class PrefillProgress(Message, version=1):
    """Prefill -> router, streamed before the :class:`PrefillResult` (``stream_progress``):
    how much of the prompt's KV decode may load already.

    Attributes:
        request_id: as in the request.
        num_blocks: blocks of the prompt (its keys; the last may be partial).
        durable_blocks: the leading blocks, from the first, that are in the pool and pinned
            by the lease (written and acknowledged, or there before); never decreases.
        lease_id: the handoff lease pinning the blocks (created before the first write);
            None when the pool is unavailable.
        computed_tokens: prompt tokens whose KV prefill has computed (or found) so far.
        first_token_ids: the first sampled token of each of the ``n`` completions, on the
            one event sent as soon as they are sampled (before the last writes end; the
            :class:`PrefillResult` repeats them); None on every other event.
        first_logprobs: their logprobs, one per first token, when the request asked for them.
    """

    request_id: str
    num_blocks: int
    durable_blocks: int
    lease_id: str | None = None
    computed_tokens: int = 0
    first_token_ids: list[int] | None = None
    first_logprobs: list[TokenLogprobs] | None = None

    def validate(self) -> None:
        check(self.num_blocks >= 0, "num_blocks", "must be >= 0")
        check(0 <= self.durable_blocks <= self.num_blocks, "durable_blocks", "must be in 0..num_blocks")
        check(self.computed_tokens >= 0, "computed_tokens", "must be >= 0")
        if self.first_token_ids is not None:
            _check_token_ids(self.first_token_ids, "first_token_ids", non_empty=True)
        _check_first_logprobs(self.first_token_ids, self.first_logprobs)


@dataclass(kw_only=True)
class DecodeRequest(Message, version=1):
    """Router -> decode: load the prompt's blocks (or compute them) and stream the completion.

    Attributes:
        request_id: the router's id for the request.
        prompt_token_ids: the tokenized prompt, non-empty.
        first_token_id: the first token sampled by prefill; None means decode does the
            prefill itself (no prefill answered, or the router skipped it).
        first_logprobs: logprobs of the first token, when prefill computed them.
        sampling: how to sample; ``n`` must be 1 (the router fans out n > 1).
        block_keys: pool keys of the prompt's blocks, from :class:`PrefillResult`.
        lease_id: the handoff lease to release once the blocks are loaded.
        want_trace: send the handoff trace on the final :class:`TokenEvent`.
        num_resumed_tokens: the last ``num_resumed_tokens`` of ``prompt_token_ids`` were
            generated by an earlier, broken decode stream that the router resumes here; a
            constrained request replays them (and ``first_token_id``) into a fresh grammar
            state. 0 for a first attempt.
        await_handoff: prefill is still running: load the prompt's blocks as
            :class:`HandoffUpdate` messages (``POST /v1/handoff``) say they are durable, and
            generate only after the final one (it brings the first token, or says prefill
            failed and decode computes the rest). Decode answers the stream's headers at
            once, so the router knows it may post updates. ``first_token_id`` must be None.
    """

    request_id: str
    prompt_token_ids: list[int]
    num_resumed_tokens: int = 0
    first_token_id: int | None = None
    first_logprobs: TokenLogprobs | None = None
    sampling: SamplingSpec
    block_keys: list[str] = field(default_factory=list)
    lease_id: str | None = None
    want_trace: bool = False
    await_handoff: bool = False

    def validate(self) -> None:
        check(len(self.request_id) > 0, "request_id", "must not be empty")
        _check_token_ids(self.prompt_token_ids, "prompt_token_ids", non_empty=True)
        check(self.first_token_id is None or self.first_token_id >= 0, "first_token_id", "must be >= 0")
        check(self.sampling.n == 1, "sampling.n", "must be 1 for decode")
        check(0 <= self.num_resumed_tokens < len(self.prompt_token_ids), "num_resumed_tokens", "must be in 0..len(prompt_token_ids)-1")
        check(self.num_resumed_tokens == 0 or self.first_token_id is not None, "num_resumed_tokens", "given without first_token_id")
        check(
            self.first_logprobs is None or self.first_token_id is not None,
            "first_logprobs",
            "given without first_token_id",
        )
        check(
            not self.await_handoff or self.first_token_id is None,
            "first_token_id",
            "must be None with await_handoff (the first token comes in the final HandoffUpdate)",
        )


@dataclass(kw_only=True)
class HandoffUpdate(Message, version=1):
    """Router -> decode (``POST /v1/handoff``), for a :class:`DecodeRequest` with
    ``await_handoff``: prefill's progress on the prompt's blocks, and at the end its outcome.

    Attributes:
        request_id: the decode request's id.
        durable_blocks: leading blocks of the prompt that are durable in the pool.
        lease_id: the handoff lease, for decode to release once it has loaded the blocks.
        done: the last update: prefill finished (``first_token_id`` set) or failed
            (``error`` set: decode loads what it can and computes the rest, sampling the
            first token itself unless prefill had sent it before failing).
        first_token_id: prefill's first token; only on the last update.
        first_logprobs: its logprobs, when the request asked for them.
        error: why prefill failed, for the trace.
    """

    request_id: str
    durable_blocks: int = 0
    lease_id: str | None = None
    done: bool = False
    first_token_id: int | None = None
    first_logprobs: TokenLogprobs | None = None
    error: str | None = None

    def validate(self) -> None:
        check(len(self.request_id) > 0, "request_id", "must not be empty")
        check(self.durable_blocks >= 0, "durable_blocks", "must be >= 0")
        check(self.first_token_id is None or self.done, "first_token_id", "only on the last update (done)")
        check(self.first_token_id is None or self.first_token_id >= 0, "first_token_id", "must be >= 0")
        check(
            self.first_logprobs is None or self.first_token_id is not None,
            "first_logprobs",
            "given without first_token_id",
        )


@dataclass(kw_only=True)
class TokenEvent(Message, version=1):
    """Decode -> router, streamed: newly generated tokens of one request.

    Attributes:
        request_id: the request the tokens belong to.
        token_ids: tokens generated since the previous event (may be empty on the final one).
        logprobs: one entry per token in ``token_ids``, when logprobs were requested.
        finish_reason: None while generating; on the final event ``stop`` (EOS or a stop
            token), ``length`` (max_tokens or context), ``abort`` or ``error``.
        num_cached_tokens: prompt tokens decode loaded instead of computing.
        prompt_logprobs: the prompt's, when ``sampling.prompt_logprobs`` asked for them:
            on the first event, which carries the first token too (or ends the request).
        error: what went wrong, on a final event with ``finish_reason="error"``.
        trace: the handoff trace, on the final event when ``want_trace`` was set.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None
    trace: dict[str, Any] | None = None

    def validate(self) -> None:
        _check_token_ids(self.token_ids, "token_ids")
        check(
            self.logprobs is None or len(self.logprobs) == len(self.token_ids),
            "logprobs",
            "must have one entry per token",
        )
        check(self.num_cached_tokens >= 0, "num_cached_tokens", "must be >= 0")


@dataclass(kw_only=True)
class AbortRequest(Message, version=1):
    """Router -> prefill/decode: stop working on a request and free its blocks.

    Attributes:
        request_id: the request to abort; unknown ids are ignored (it may have just finished).
    """

    request_id: str


@dataclass(kw_only=True)
class RegisterInstance(Message, version=1):
    """Prefill/decode -> router on start-up: an instance announces itself.

    Attributes:
        instance_id: unique id of the instance (stable across its heartbeats).
        role: ``prefill`` or ``decode``.
        url: base URL the router reaches it at.
        model: the served model's name.
        namespace: the block-key namespace (hex); instances share blocks only within one.
        max_model_len: longest prompt + completion the instance accepts, in 1..MAX_MODEL_LEN.
        block_size: tokens per KV block; with ``namespace`` it lets the router compute
            block keys (libs.blocks.NamespaceRoot) without loading the model.
        quantization: how the weights run (``none`` or ``fp8``); prefill and decode must
            agree, and the router refuses an instance that does not.

    Compatibility: a field added after version 1 shipped is left off the wire while it has
    its default, so an unquantized instance sends exactly what it sent before the field
    existed (an older router accepts it), and an older instance's message decodes here.
    """

    instance_id: str
    role: Role
    url: str
    model: str
    namespace: str
    max_model_len: int
    block_size: int = 16
    quantization: str = "none"

    def validate(self) -> None:
        check(len(self.instance_id) > 0, "instance_id", "must not be empty")
        check(1 <= self.max_model_len <= MAX_MODEL_LEN, "max_model_len", f"must be in 1..{MAX_MODEL_LEN}")
        check(self.block_size >= 1, "block_size", "must be >= 1")
        check(0 < len(self.quantization) <= 32, "quantization", "must be 1 to 32 characters")

    def to_wire(self) -> dict[str, Any]:
        out = super().to_wire()
        if self.quantization == "none":
            del out["quantization"]
        return out


@dataclass(kw_only=True)
class DeregisterInstance(Message, version=1):
    """Prefill/decode -> router when it goes down (a stop, or a tensor-parallel rank that
    died): stop sending it work now, not after missed heartbeats. Its open streams end;
    the router resumes them elsewhere.

    Attributes:
        instance_id: as registered.
        role: as registered.
        reason: why it leaves (logged by the router).
    """

    instance_id: str
    role: Role
    reason: str = ""

    def validate(self) -> None:
        check(len(self.instance_id) > 0, "instance_id", "must not be empty")
        check(len(self.reason) <= 1000, "reason", "must be at most 1000 characters")


@dataclass(kw_only=True)
class Heartbeat(Message, version=1):
    """Prefill/decode -> router, periodically: load, so the router can balance.

    Attributes:
        instance_id: as registered.
        role: as registered.
        running: requests in the running batch.
        waiting: requests admitted but waiting for the batch.
        free_blocks: free KV cache blocks.
        total_blocks: all KV cache blocks.
        queue_depth: requests queued in front of the scheduler (HTTP side).
    """

    instance_id: str
    role: Role
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    queue_depth: int = 0

    def validate(self) -> None:
        for name in ("running", "waiting", "free_blocks", "total_blocks", "queue_depth"):
            check(getattr(self, name) >= 0, name, "must be >= 0")
        check(self.free_blocks <= self.total_blocks, "free_blocks", "must be <= total_blocks")


@dataclass(kw_only=True)
class InstanceAck(Message, version=1):
    """Router -> prefill/decode: the answer to :class:`RegisterInstance` and :class:`Heartbeat`.

    An unknown instance's heartbeat is answered 404 (a JSON error) instead, which tells
    it to register again (the router restarted or dropped it for missed heartbeats).

    Attributes:
        instance_id: the instance acknowledged.
        heartbeat_timeout_s: seconds without a heartbeat after which the router drops the
            instance, > 0; heartbeat well within it.
    """

    instance_id: str
    heartbeat_timeout_s: float

    def validate(self) -> None:
        check(
            self.heartbeat_timeout_s > 0 and math.isfinite(self.heartbeat_timeout_s),
            "heartbeat_timeout_s",
            "must be finite and > 0",
        )


@dataclass(kw_only=True)
class ErrorMessage(Message, version=1):
    """An error for a msgpack-speaking peer (HTTP endpoints answer JSON errors instead).

    Attributes:
        code: the HTTP status that best describes the error.
        message: what went wrong, for a human.
    """

    code: int
    message: str
