"""OpenAI request bodies -> one validated :class:`GenerateRequest`, before any downstream call.

Both endpoints (``/v1/completions`` and ``/v1/chat/completions``) parse into the same
request, so the request path after this module does not care which one the client used.
Everything a client can get wrong is caught here and answered 400 (404 for an unknown
model) with an OpenAI-shaped error naming the field in ``param``; what needs the tokenizer
or the instances' context length is checked in :func:`resolve_max_tokens` and by the
tokenizing step, still before anything is sent downstream.

Rules worth knowing:

- ``null`` means "not given" for every optional field, as in OpenAI's API.
- Every field is honoured or refused with a 400 naming it. A field no endpoint knows is
  ``unknown_parameter`` (as OpenAI answers "Unrecognized request argument supplied");
  known fields the router does not implement are ``unsupported_parameter`` when they
  would change the result (``suffix``, ``store``, non-text ``modalities``) and accepted at
  their no-op value. The OpenAPI document (openapi.py)
  lists the same fields.
- ``best_of`` (completions): ``best_of`` candidates are generated per prompt and the ``n``
  with the highest cumulative logprob are returned (best_of.py); ``best_of < n`` is a
  400, and so is ``best_of > n`` with ``stream`` (as OpenAI: the best are known only at
  the end).
- ``echo`` with ``logprobs`` (completions) scores the prompt too: the instance that
  computes it returns prompt logprobs (``GenerateRequest.prompt_logprobs``, handoff.py).
- Output constraints (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``,
  llama.cpp's ``grammar`` and ``json_schema``; both endpoints) are read by constraints.py,
  tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, legacy ``functions`` /
  ``function_call``; chat only) by tools.py; ``logit_bias`` maps token ids (as strings,
  OpenAI's form) to biases in [-100, 100]. Whether a schema, regex or grammar compiles is
  decided by the grammar engine, off the event loop (prepare.py).
- Chat messages are checked as OpenAI checks them: roles, keys per role, content parts,
  tool calls and the tool messages answering them (chat_messages.py).
- Types are JSON's: ``"temperature": "0.5"`` is a 400, as is ``true`` for a number (JSON
  booleans are not numbers) and ``"n": 2.5``; ``"n": 2.0`` is 2 (fields.py).
- Completions default ``max_tokens`` to 16 (OpenAI's default, capped to the context left);
  chat defaults to the whole context left.
- vLLM extensions: ``top_k`` (-1 or 0 = off), ``min_p``, ``repetition_penalty``,
  ``ignore_eos``, ``min_tokens``, ``stop_token_ids``. Tidepool's own: ``"tidepool":
  {"trace": true}`` asks for the handoff trace in the response; ``{"stream_handoff":
  false}`` (or true) overrides the router's ``--stream-handoff`` for this request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from libs.protocol.messages import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingSpec, StructuredSpec
from libs.structured import GrammarSpec
from services.router.chat_messages import parse_messages
from services.router.constraints import CONSTRAINT_FIELDS, Constraint, conflict, parse_constraint
from services.router.errors import ApiError, bad_request
from services.router.fields import Fields, as_int, json_type, missing
from services.router.tools import TOOL_REQUEST_FIELDS, ToolRequest, parse_tools

Kind = Literal["completion", "chat"]

MAX_N = 128
MAX_CHOICES = 1024  # prompts x n in one request
MAX_STOP_STRINGS = 32
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOP_K_MAX = 2**31 - 1  # larger means "keep every token" anyway; bounded so it fits every integer type downstream


@dataclass(frozen=True)
class GenerateRequest:
    """A validated request of either endpoint, in the router's terms.

    ``prompts`` holds the completions prompts (text, or token ids); chat requests carry
    ``messages`` instead and have exactly one prompt. ``logprobs`` is the number of top
    alternatives per token (``None``: no logprobs at all).
    """

    kind: Kind
    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    messages: tuple[dict[str, Any], ...]
    n: int
    max_tokens: int | None
    min_tokens: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    ignore_eos: bool
    logprobs: int | None
    echo: bool
    want_trace: bool
    user: str | None
    constraint: Constraint | None = None
    tools: ToolRequest | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    stream_handoff: bool | None = None  # None: the router's setting
    best_of: int = 0  # candidates per prompt (completions); 0: ``n``

    @property
    def num_prompts(self) -> int:
        return 1 if self.kind == "chat" else len(self.prompts)

    @property
    def candidates(self) -> int:
        """Completions generated per prompt: ``best_of`` (the ``n`` best are returned)."""
        return max(self.best_of, self.n)

    @property
    def prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token when the prompt is scored (``echo`` with
        ``logprobs``), else None."""
        return self.logprobs if self.echo else None

    @property
    def wire_logprobs(self) -> int | None:
        """Logprobs asked of the instances: the client's, or the sampled token's alone when
        ``best_of`` ranks candidates by cumulative logprob without the client asking."""
        if self.logprobs is None and self.candidates > self.n:
            return 0
        return self.logprobs

    @property
    def grammar(self) -> GrammarSpec | None:
        """What the output is constrained to: a forced tool call, or the asked constraint."""
        forced = self.tools.constraint() if self.tools is not None else None
        return forced if forced is not None else (self.constraint.spec if self.constraint else None)

    def sampling(self, *, max_tokens: int, n: int, seed: int | None, score_prompt: bool = False) -> SamplingSpec:
        """The wire sampling spec of one prefill (``n`` first tokens) or one decode stream;
        ``score_prompt``: this instance computes the prompt logprobs."""
        return SamplingSpec(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.wire_logprobs,
            n=n,
            logit_bias_ids=[t for t, _ in self.logit_bias],
            logit_bias_values=[b for _, b in self.logit_bias],
            structured=_wire(self.grammar),
            prompt_logprobs=self.prompt_logprobs if score_prompt else None,
        )


def _wire(spec: GrammarSpec | None) -> StructuredSpec | None:
    return None if spec is None else StructuredSpec(kind=spec.kind, value=spec.value, strict=spec.strict)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of ``n``: the request's seed for choice 0 (so ``n=1``
    passes it through unchanged), then ``seed + index`` mod 2**64 as the engine derives its
    own n > 1 children (libs/engine/params.py), so the choices differ but each reproduces."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % 2**64


# Every field each endpoint reads; any other is a 400 naming it (fields.py). Fields the
# server cannot honour are listed too, and refused with a 400 unless they hold their
# no-op value (an empty ``tools``, ``"response_format": {"type": "text"}``, ...).
COMMON_FIELDS = frozenset(
    {
        "model", "n", "stream", "stream_options", "max_tokens", "stop", "temperature", "top_p",
        "presence_penalty", "frequency_penalty", "seed", "logprobs", "logit_bias", "user",
        # vLLM's sampling extensions
        "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
        # Tidepool's own
        "tidepool",
    }
) | CONSTRAINT_FIELDS  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | TOOL_REQUEST_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "store", "modalities",
}  # fmt: skip
STREAM_OPTIONS_FIELDS = frozenset({"include_usage"})
TIDEPOOL_FIELDS = frozenset({"trace", "stream_handoff"})


def parse_request(body: Any, kind: Kind, *, served_model: str, vocab_size: int) -> GenerateRequest:
    """Validate a decoded JSON body of ``kind``; raise :class:`ApiError` naming the problem."""
    if type(body) is not dict:
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}", None, "invalid_type")
    f = Fields(body)
    if kind == "completion":
        for name in sorted(TOOL_REQUEST_FIELDS & body.keys()):
            raise bad_request(f"'{name}' is only supported by /v1/chat/completions", name, "unsupported_parameter")
    f.only(CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    model = f.string("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")

    n = f.integer("n", 1, 1, MAX_N)
    assert n is not None
    stream = f.boolean("stream", False)
    options = f.obj("stream_options")
    options.only(STREAM_OPTIONS_FIELDS)
    if f.given("stream_options") and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = options.boolean("include_usage", False)
    ext = f.obj("tidepool")
    ext.only(TIDEPOOL_FIELDS)
    want_trace = ext.boolean("trace", False)
    stream_handoff = ext.boolean("stream_handoff", None)

    best_of = 0
    if kind == "chat":
        messages = parse_messages(f.raw("messages"))
        prompts: tuple[str | tuple[int, ...], ...] = ()
        max_tokens = f.integer("max_completion_tokens", None, 1)
        if max_tokens is None:
            max_tokens = f.integer("max_tokens", None, 1)
        logprobs = _chat_logprobs(f)
        echo = False
        tools = parse_tools(body)
        _refuse_chat_extras(f)
    else:
        messages = ()
        tools = None
        prompts = _prompts(f.raw("prompt"), vocab_size)
        max_tokens = f.integer("max_tokens", None, 1)
        logprobs = f.integer("logprobs", None, 0, MAX_LOGPROBS)
        echo = f.boolean("echo", False)
        suffix = f.string("suffix", None)
        if suffix:
            raise bad_request("'suffix' is not supported", "suffix", "unsupported_parameter")
        best_of = _best_of(f, n, stream)
    constraint = parse_constraint(body)
    if constraint is not None and tools is not None and tools.constraint() is not None:
        raise conflict(
            f"'{constraint.param}' cannot be combined with tool_choice '{tools.choice}' (it constrains the output too)",
            constraint.param,
        )

    num_prompts = 1 if kind == "chat" else len(prompts)
    if num_prompts * max(n, best_of) > MAX_CHOICES:
        what, param = (f"best_of={best_of}", "best_of") if best_of > n else (f"n={n}", "n")
        raise bad_request(f"{num_prompts} prompts x {what} exceeds {MAX_CHOICES} choices per request", param)

    top_k = f.integer("top_k", -1, -1, TOP_K_MAX)
    assert top_k is not None
    min_tokens = f.integer("min_tokens", 0, 0)
    assert min_tokens is not None
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed 'max_tokens' ({max_tokens})", "min_tokens")
    return GenerateRequest(
        kind=kind,
        model=served_model,
        prompts=prompts,
        messages=messages,
        n=n,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stream=stream,
        include_usage=include_usage,
        stop=_stop(f.raw("stop")),
        stop_token_ids=token_ids(f.raw("stop_token_ids"), "stop_token_ids", vocab_size, allow_empty=True),
        temperature=f.number("temperature", 1.0, 0.0, 2.0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=-1 if top_k == 0 else top_k,
        min_p=f.number("min_p", 0.0, 0.0, 1.0),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=f.number("repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        seed=f.integer("seed", None, SEED_MIN, SEED_MAX),
        ignore_eos=f.boolean("ignore_eos", False),
        logprobs=logprobs,
        echo=echo,
        want_trace=want_trace,
        user=f.string("user", None),
        constraint=constraint,
        tools=tools,
        logit_bias=_logit_bias(f, vocab_size),
        stream_handoff=stream_handoff,
        best_of=best_of,
    )


def _best_of(f: Fields, n: int, stream: bool) -> int:
    """``best_of``: at least ``n``; above it, not with ``stream`` (the best are known only
    once every candidate finished), as OpenAI refuses it."""
    best_of = f.integer("best_of", None, 1, MAX_N)
    if best_of is None:
        return 0
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n})", "best_of")
    if best_of > n and stream:
        raise bad_request(f"'best_of' ({best_of}) greater than 'n' ({n}) cannot be streamed", "best_of")
    return best_of


def _chat_logprobs(f: Fields) -> int | None:
    """Chat: ``logprobs: true`` turns them on, ``top_logprobs: k`` adds k alternatives."""
    enabled = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not enabled:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    if not enabled:
        return None
    return top or 0


def _refuse_chat_extras(f: Fields) -> None:
    """OpenAI chat fields this server cannot honour: a 400 unless they hold their no-op value."""
    if f.boolean("store", False):
        raise bad_request("'store' is not supported (this server keeps no completions)", "store", "unsupported_parameter")
    modalities = f.array("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("only 'modalities': [\"text\"] is supported", "modalities", "unsupported_parameter")


def _logit_bias(f: Fields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: ``{"token id": bias}`` with biases in [-100, 100]."""
    bias = f.obj("logit_bias")
    if len(bias.body) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has {len(bias.body)} entries, at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = []
    for key in bias.body:
        if not key.isdigit() or not key.isascii():
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise bad_request(f"'logit_bias' token id {token} is not in the vocabulary (size {vocab_size})", "logit_bias")
        value = bias.raw(key)
        if type(value) not in (int, float) or not math.isfinite(value) or not -100 <= value <= 100:
            raise bad_request(f"'logit_bias[{key}]' must be a number in [-100, 100], got {value!r}", "logit_bias")
        out.append((token, float(value)))
    return tuple(out)


def _prompts(value: Any, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if value is None:
        raise missing("prompt")
    if type(value) is str:
        return (value,)
    if type(value) is not list:
        raise bad_request(f"'prompt' must be a string or an array, got {json_type(value)}", "prompt", "invalid_type")
    if not value:
        raise bad_request("'prompt' must not be an empty array", "prompt")
    if set(map(type, value)) == {int}:  # the common array: token ids, checked at C speed
        return (token_ids(value, "prompt", vocab_size),)
    if all(type(v) is str for v in value):
        return tuple(value)
    if all(as_int(v) is not None for v in value):
        return (token_ids(value, "prompt", vocab_size),)
    if all(type(v) is list for v in value):
        return tuple(token_ids(v, f"prompt[{i}]", vocab_size) for i, v in enumerate(value))
    raise bad_request(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of token id arrays",
        "prompt",
        "invalid_type",
    )


def token_ids(value: Any, name: str, vocab_size: int, *, allow_empty: bool = False) -> tuple[int, ...]:
    if value is None and allow_empty:
        return ()
    if type(value) is not list:
        raise bad_request(f"'{name}' must be an array of token ids, got {json_type(value)}", name, "invalid_type")
    if not value and not allow_empty:
        raise bad_request(f"'{name}' must not be empty", name)
    if value and set(map(type, value)) == {int} and 0 <= min(value) and max(value) < vocab_size:
        return tuple(value)  # exact ints in range (C speed); anything else gets the per-id check and its message
    ids = [as_int(t) for t in value]
    for i, t in enumerate(ids):
        if t is None:
            raise bad_request(f"'{name}[{i}]' must be an integer token id, got {json_type(value[i])}", name, "invalid_type")
        if not 0 <= t < vocab_size:
            raise bad_request(f"'{name}[{i}]' = {t} is not a token id (vocabulary size {vocab_size})", name)
    return tuple(ids)  # type: ignore[arg-type]


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if type(value) is str else value
    if type(stops) is not list:
        raise bad_request(f"'stop' must be a string or an array of strings, got {json_type(value)}", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' has {len(stops)} strings, at most {MAX_STOP_STRINGS}", "stop")
    for s in stops:
        if type(s) is not str:
            raise bad_request(f"'stop' entries must be strings, got {json_type(s)}", "stop", "invalid_type")
        if not s:
            raise bad_request("'stop' strings must not be empty", "stop")
    return tuple(dict.fromkeys(stops))


def prompt_too_long(req: GenerateRequest, max_model_len: int, prompt_index: int, size: str) -> ApiError:
    """The 400 for a prompt of ``size`` (its length, in words) that leaves no room for a completion."""
    where = "" if req.num_prompts == 1 else f" (prompt {prompt_index})"
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens; the prompt{where} has {size}, "
        "leaving no room for a completion.",
        code="context_length_exceeded",
        param="messages" if req.kind == "chat" else "prompt",
    )


def resolve_max_tokens(req: GenerateRequest, prompt_len: int, max_model_len: int, prompt_index: int = 0) -> int:
    """The completion budget of one prompt, or a 400 when the prompt does not fit.

    ``max_model_len`` bounds prompt + completion, and the completion needs at least one
    token. An explicit ``max_tokens`` that does not fit is an error (the client asked for
    more than the model can give); the defaults are capped to what is left.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise prompt_too_long(req, max_model_len, prompt_index, f"{prompt_len} tokens")
    if req.max_tokens is not None:
        if req.max_tokens > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens; you requested "
                f"{prompt_len + req.max_tokens} tokens ({prompt_len} in the prompt, {req.max_tokens} for the "
                "completion).",
                code="context_length_exceeded",
                param="max_tokens",
            )
        return req.max_tokens
    budget = room if req.kind == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if req.min_tokens > budget:
        raise bad_request(
            f"'min_tokens' ({req.min_tokens}) exceeds the {budget} tokens left in the context", "min_tokens"
        )
    return budget
