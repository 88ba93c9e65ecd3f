"""libs/protocol: round trips, strict decoding, limits, stream framing, aiohttp helpers."""

from __future__ import annotations

import ast
import asyncio
import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import msgpack
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.protocol import (
    AbortRequest,
    DecodeRequest,
    ErrorCode,
    ErrorMessage,
    DeregisterInstance,
    Heartbeat,
    InstanceAck,
    Limits,
    HandoffUpdate,
    Message,
    MessageStreamResponse,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    ProtocolError,
    RegisterInstance,
    SamplingSpec,
    StructuredSpec,
    StreamDecoder,
    TokenEvent,
    TokenLogprobs,
    PromptLogprobs,
    TruncatedStreamError,
    decode,
    encode,
    from_wire,
    iter_messages,
    message_types,
    msgpack_response,
    read_message,
    read_response,
)
from libs.protocol import messages as messages_module

PROTOCOL_DIR = Path(__file__).resolve().parents[2] / "libs" / "protocol"

# --- strategies -------------------------------------------------------------------------

token_ids = st.integers(0, 2**32)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
logprob = st.floats(max_value=0.0, allow_nan=False)  # includes -inf
text = st.text(max_size=12)
ident = st.text(min_size=1, max_size=12)
counts = st.integers(0, 2**40)
json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | text | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
traces = st.none() | st.dictionaries(text, json_like, max_size=4)


structured_specs = st.builds(
    StructuredSpec,
    kind=st.sampled_from(["json_schema", "json_object", "regex", "choice", "grammar", "lark"]),
    value=text,
    strict=st.booleans(),
)


@st.composite
def sampling_specs(draw: st.DrawFn, n: st.SearchStrategy[int] = st.integers(1, 16)) -> SamplingSpec:
    max_tokens = draw(st.integers(1, 2**31))
    bias = draw(st.lists(st.tuples(token_ids, st.floats(-100, 100)), max_size=4))
    return draw(st.builds(
        SamplingSpec,
        temperature=st.floats(0, 100),
        top_p=st.floats(0, 1, exclude_min=True),
        top_k=st.just(-1) | st.integers(1, 1000),
        min_p=st.floats(0, 1),
        presence_penalty=st.floats(-2, 2),
        frequency_penalty=st.floats(-2, 2),
        repetition_penalty=st.floats(0, 10, exclude_min=True),
        seed=st.none() | st.integers(0, 2**64 - 1),
        max_tokens=st.just(max_tokens),
        min_tokens=st.integers(0, max_tokens),
        stop_token_ids=st.lists(token_ids, max_size=4),
        ignore_eos=st.booleans(),
        logprobs=st.none() | st.integers(0, 20),
        n=n,
        logit_bias_ids=st.just([t for t, _ in bias]),
        logit_bias_values=st.just([b for _, b in bias]),
        structured=st.none() | structured_specs,
        prompt_logprobs=st.none() | st.integers(0, 20),
    ))


@st.composite
def token_logprobs(draw: st.DrawFn) -> TokenLogprobs:
    k = draw(st.integers(0, 20))
    return TokenLogprobs(
        token_id=draw(token_ids),
        logprob=draw(logprob),
        top_ids=draw(st.lists(token_ids, min_size=k, max_size=k)),
        top_logprobs=draw(st.lists(logprob, min_size=k, max_size=k)),
    )


@st.composite
def prompt_logprobs(draw: st.DrawFn) -> PromptLogprobs:
    ids = draw(st.lists(token_ids, max_size=6))
    k = draw(st.integers(0, 20))
    return PromptLogprobs(
        token_ids=ids,
        logprobs=[draw(logprob) for _ in ids],
        top_ids=[draw(st.lists(token_ids, min_size=k, max_size=k)) for _ in ids],
        top_logprobs=[draw(st.lists(logprob, min_size=k, max_size=k)) for _ in ids],
    )


def logprobs_like(ids: list[int], draw: st.DrawFn) -> list[TokenLogprobs] | None:
    """None, or one TokenLogprobs per id (the length rule messages enforce)."""
    if draw(st.booleans()):
        return None
    return [draw(token_logprobs()) for _ in ids]


@st.composite
def prefill_results(draw: st.DrawFn) -> PrefillResult:
    firsts = draw(st.lists(token_ids, min_size=1, max_size=4))
    return PrefillResult(
        request_id=draw(ident),
        first_token_ids=firsts,
        first_logprobs=logprobs_like(firsts, draw),
        prompt_logprobs=draw(st.none() | prompt_logprobs()),
        block_keys=draw(st.lists(text, max_size=4)),
        lease_id=draw(st.none() | text),
        num_prompt_tokens=draw(counts),
        num_cached_tokens=draw(counts),
        num_computed_tokens=draw(counts),
        bytes_written=draw(counts),
        blocks_written=draw(counts),
        blocks_failed=draw(counts),
        timings=draw(st.dictionaries(text, finite, max_size=4)),
        trace=draw(traces),
    )


@st.composite
def prefill_progress(draw: st.DrawFn) -> PrefillProgress:
    total = draw(counts)
    firsts = draw(st.none() | st.lists(token_ids, min_size=1, max_size=4))
    return PrefillProgress(
        request_id=draw(ident),
        num_blocks=total,
        durable_blocks=draw(st.integers(0, total)),
        lease_id=draw(st.none() | text),
        computed_tokens=draw(counts),
        first_token_ids=firsts,
        first_logprobs=None if firsts is None else logprobs_like(firsts, draw),
    )


@st.composite
def handoff_updates(draw: st.DrawFn) -> HandoffUpdate:
    done = draw(st.booleans())
    first = draw(st.none() | token_ids) if done else None
    return HandoffUpdate(
        request_id=draw(ident),
        durable_blocks=draw(counts),
        lease_id=draw(st.none() | text),
        done=done,
        first_token_id=first,
        first_logprobs=None if first is None else draw(st.none() | token_logprobs()),
        error=draw(st.none() | text),
    )


@st.composite
def decode_requests(draw: st.DrawFn) -> DecodeRequest:
    first = draw(st.none() | token_ids)
    prompt = draw(st.lists(token_ids, min_size=1, max_size=40))
    return DecodeRequest(
        request_id=draw(ident),
        prompt_token_ids=prompt,
        num_resumed_tokens=0 if first is None else draw(st.integers(0, len(prompt) - 1)),
        first_token_id=first,
        first_logprobs=None if first is None else draw(st.none() | token_logprobs()),
        sampling=draw(sampling_specs(n=st.just(1))),
        block_keys=draw(st.lists(text, max_size=4)),
        lease_id=draw(st.none() | text),
        want_trace=draw(st.booleans()),
        await_handoff=first is None and draw(st.booleans()),
    )


@st.composite
def token_events(draw: st.DrawFn) -> TokenEvent:
    ids = draw(st.lists(token_ids, max_size=6))
    return TokenEvent(
        request_id=draw(ident),
        token_ids=ids,
        logprobs=logprobs_like(ids, draw),
        finish_reason=draw(st.sampled_from([None, "stop", "length", "abort", "error"])),
        num_cached_tokens=draw(counts),
        prompt_logprobs=draw(st.none() | prompt_logprobs()),
        error=draw(st.none() | text),
        trace=draw(traces),
    )


@st.composite
def heartbeats(draw: st.DrawFn) -> Heartbeat:
    total = draw(counts)
    return Heartbeat(
        instance_id=draw(ident),
        role=draw(st.sampled_from(["prefill", "decode"])),
        running=draw(counts),
        waiting=draw(counts),
        free_blocks=draw(st.integers(0, total)),
        total_blocks=total,
        queue_depth=draw(counts),
    )


STRATEGIES: dict[type[Message], st.SearchStrategy[Any]] = {
    StructuredSpec: structured_specs,
    SamplingSpec: sampling_specs(),
    TokenLogprobs: token_logprobs(),
    PromptLogprobs: prompt_logprobs(),
    PrefillRequest: st.builds(
        PrefillRequest,
        request_id=ident,
        prompt_token_ids=st.lists(token_ids, min_size=1, max_size=40),
        sampling=sampling_specs(),
        lease_ttl_s=st.floats(0, 1e6, exclude_min=True),
        want_trace=st.booleans(),
        stream_progress=st.booleans(),
    ),
    PrefillProgress: prefill_progress(),
    HandoffUpdate: handoff_updates(),
    PrefillResult: prefill_results(),
    DecodeRequest: decode_requests(),
    TokenEvent: token_events(),
    AbortRequest: st.builds(AbortRequest, request_id=text),
    RegisterInstance: st.builds(
        RegisterInstance,
        instance_id=ident,
        role=st.sampled_from(["prefill", "decode"]),
        url=text,
        model=text,
        namespace=text,
        max_model_len=st.integers(1, messages_module.MAX_MODEL_LEN),
        block_size=st.integers(1, 4096),
    ),
    Heartbeat: heartbeats(),
    DeregisterInstance: st.builds(DeregisterInstance, instance_id=ident, role=st.sampled_from(["prefill", "decode"]), reason=text),
    InstanceAck: st.builds(InstanceAck, instance_id=text, heartbeat_timeout_s=st.floats(0, 1e6, exclude_min=True)),
    ErrorMessage: st.builds(ErrorMessage, code=st.integers(100, 599), message=text),
}

PROTOCOL_MESSAGES = [c for c in message_types().values() if c.__module__ == messages_module.__name__]


def test_every_protocol_message_has_a_round_trip_strategy() -> None:
    assert set(PROTOCOL_MESSAGES) == set(STRATEGIES)


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(cls: type[Message], data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    body = encode(msg)
    assert decode(body, cls) == msg
    assert decode(body) == msg  # dispatch through the registry
    assert encode(decode(body, cls)) == body


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(), min_size=1, max_size=5))
def test_nan_and_inf_floats_survive_byte_for_byte(values: list[float]) -> None:
    msg = PrefillResult(request_id="r", first_token_ids=[1], num_prompt_tokens=1, timings={str(i): v for i, v in enumerate(values)})
    body = encode(msg)
    assert encode(decode(body, PrefillResult)) == body


def test_wire_format_is_a_map_with_type_and_version() -> None:
    msg = AbortRequest(request_id="r1")
    assert msgpack.unpackb(encode(msg)) == {"type": "AbortRequest", "version": 1, "request_id": "r1"}
    nested = msgpack.unpackb(encode(DecodeRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingSpec(max_tokens=1))))
    assert nested["sampling"]["type"] == "SamplingSpec" and nested["sampling"]["version"] == 1


def test_fields_with_defaults_may_be_left_out() -> None:
    wire = {"type": "PrefillRequest", "version": 1, "request_id": "r", "prompt_token_ids": [1],
            "sampling": {"type": "SamplingSpec", "version": 1, "max_tokens": 4}}
    msg = decode(msgpack.packb(wire), PrefillRequest)
    assert msg == PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingSpec(max_tokens=4))


def test_encode_converts_friendly_inputs() -> None:
    msg = SamplingSpec(max_tokens=np.int64(5), temperature=1, stop_token_ids=(1, 2))  # type: ignore[arg-type]
    assert decode(encode(msg), SamplingSpec) == SamplingSpec(max_tokens=5, temperature=1.0, stop_token_ids=[1, 2])
    ids = np.arange(4, dtype=np.int32)
    ev = TokenEvent(request_id="r", token_ids=list(ids))  # numpy scalars from an engine
    assert decode(encode(ev), TokenEvent).token_ids == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("msg", "code", "field"),
    [
        (SamplingSpec(max_tokens=1, temperature="hot"), ErrorCode.WRONG_TYPE, "temperature"),  # type: ignore[arg-type]
        (SamplingSpec(max_tokens=True), ErrorCode.WRONG_TYPE, "max_tokens"),
        (SamplingSpec(max_tokens=0), ErrorCode.INVALID_VALUE, "max_tokens"),
        (SamplingSpec(max_tokens=1, logit_bias_ids=[1], logit_bias_values=[101.0]), ErrorCode.INVALID_VALUE, "logit_bias_values"),
        (SamplingSpec(max_tokens=1, logit_bias_ids=[1, 2], logit_bias_values=[1.0]), ErrorCode.INVALID_VALUE, "logit_bias_values"),
        (SamplingSpec(max_tokens=1, structured=StructuredSpec(kind="yaml")), ErrorCode.INVALID_VALUE, "structured.kind"),  # type: ignore[arg-type]
        (DecodeRequest(request_id="r", prompt_token_ids=[1, 2], num_resumed_tokens=1, sampling=SamplingSpec(max_tokens=1)), ErrorCode.INVALID_VALUE, "num_resumed_tokens"),
        (SamplingSpec(max_tokens=2, min_tokens=3), ErrorCode.INVALID_VALUE, "min_tokens"),
        (RegisterInstance(instance_id="i", role="decode", url="u", model="m", namespace="n", max_model_len=8,
                          block_size=0), ErrorCode.INVALID_VALUE, "block_size"),
        (InstanceAck(instance_id="i", heartbeat_timeout_s=0.0), ErrorCode.INVALID_VALUE, "heartbeat_timeout_s"),
        (TokenEvent(request_id="r", token_ids=[1, "2"]), ErrorCode.WRONG_TYPE, "token_ids[1]"),  # type: ignore[list-item]
        (PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingSpec(max_tokens=1, top_p=2.0)),
         ErrorCode.INVALID_VALUE, "sampling.top_p"),
        (PrefillRequest(request_id="r", prompt_token_ids=[1], sampling=AbortRequest(request_id="x")),  # type: ignore[arg-type]
         ErrorCode.WRONG_TYPE, "sampling"),
        (PrefillResult(request_id="r", first_token_ids=[1], num_prompt_tokens=1, timings={1: 2.0}),  # type: ignore[dict-item]
         ErrorCode.WRONG_TYPE, "timings"),
        (TokenEvent(request_id="r", trace={"x": object()}), ErrorCode.WRONG_TYPE, "trace.x"),
        (Heartbeat(instance_id="i", role="router", running=0, waiting=0, free_blocks=0, total_blocks=0),  # type: ignore[arg-type]
         ErrorCode.INVALID_VALUE, "role"),
        (PrefillProgress(request_id="r", num_blocks=3, durable_blocks=4), ErrorCode.INVALID_VALUE, "durable_blocks"),
        (PrefillProgress(request_id="r", num_blocks=3, durable_blocks=1, first_token_ids=[]), ErrorCode.INVALID_VALUE, "first_token_ids"),
        (PrefillProgress(request_id="r", num_blocks=3, durable_blocks=1, first_logprobs=[TokenLogprobs(token_id=1, logprob=0.0)]),
         ErrorCode.INVALID_VALUE, "first_logprobs"),  # logprobs without their tokens
        (DecodeRequest(request_id="r", prompt_token_ids=[1], first_token_id=5, sampling=SamplingSpec(max_tokens=1),
                       await_handoff=True), ErrorCode.INVALID_VALUE, "first_token_id"),
        (HandoffUpdate(request_id="r", first_token_id=5), ErrorCode.INVALID_VALUE, "first_token_id"),  # not done yet
        (HandoffUpdate(request_id="r", done=True, first_logprobs=TokenLogprobs(token_id=1, logprob=0.0)),
         ErrorCode.INVALID_VALUE, "first_logprobs"),
        (SamplingSpec(max_tokens=1, prompt_logprobs=21), ErrorCode.INVALID_VALUE, "prompt_logprobs"),
        (TokenEvent(request_id="r", prompt_logprobs=PromptLogprobs(token_ids=[1, 2], logprobs=[0.0], top_ids=[[], []], top_logprobs=[[], []])),
         ErrorCode.INVALID_VALUE, "prompt_logprobs.logprobs"),
        (PrefillResult(request_id="r", first_token_ids=[1], num_prompt_tokens=2,
                       prompt_logprobs=PromptLogprobs(token_ids=[1], logprobs=[0.0], top_ids=[[3, 4]], top_logprobs=[[0.0]])),
         ErrorCode.INVALID_VALUE, "prompt_logprobs.top_ids[0]"),
    ],
)
def test_encode_rejects_invalid_messages(msg: Message, code: ErrorCode, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        encode(msg)
    assert (exc.value.code, exc.value.field) == (code, field)


# --- strict decoding --------------------------------------------------------------------


def _valid_prefill() -> dict[str, Any]:
    msg = PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=8))
    return msgpack.unpackb(encode(msg))


def _edit(path: str, value: Any = None, *, delete: bool = False) -> Callable[[dict[str, Any]], Any]:
    def apply(wire: dict[str, Any]) -> Any:
        *parents, last = path.split(".")
        target = wire
        for p in parents:
            target = target[p]
        if delete:
            del target[last]
        else:
            target[last] = value
        return wire

    return apply


MALFORMED_PREFILL = [
    # (description, edit of a valid PrefillRequest wire map, expected code, expected field)
    ("top level is an array", lambda w: list(w), ErrorCode.WRONG_TYPE, None),
    ("top level is an int", lambda w: 7, ErrorCode.WRONG_TYPE, None),
    ("no type", _edit("type", delete=True), ErrorCode.MISSING_FIELD, "type"),
    ("type not a str", _edit("type", 5), ErrorCode.WRONG_TYPE, "type"),
    ("unknown type", _edit("type", "Bogus"), ErrorCode.UNKNOWN_TYPE, "type"),
    ("another known type", _edit("type", "DecodeRequest"), ErrorCode.UNEXPECTED_TYPE, "type"),
    ("no version", _edit("version", delete=True), ErrorCode.MISSING_FIELD, "version"),
    ("version is a str", _edit("version", "1"), ErrorCode.WRONG_TYPE, "version"),
    ("version is a bool", _edit("version", True), ErrorCode.WRONG_TYPE, "version"),
    ("version from the future", _edit("version", 2), ErrorCode.WRONG_VERSION, "version"),
    ("nested version mismatch", _edit("sampling.version", 0), ErrorCode.WRONG_VERSION, "sampling.version"),
    ("missing required field", _edit("request_id", delete=True), ErrorCode.MISSING_FIELD, "request_id"),
    ("missing nested field", _edit("sampling.max_tokens", delete=True), ErrorCode.MISSING_FIELD, "sampling.max_tokens"),
    ("unknown extra field", _edit("priority", 1), ErrorCode.UNKNOWN_FIELD, "priority"),
    ("unknown nested field", _edit("sampling.beam_width", 4), ErrorCode.UNKNOWN_FIELD, "sampling.beam_width"),
    ("bin map key", lambda w: {**w, b"k": 1}, ErrorCode.WRONG_TYPE, None),
    ("int for str", _edit("request_id", 5), ErrorCode.WRONG_TYPE, "request_id"),
    ("bin for str", _edit("request_id", b"r1"), ErrorCode.WRONG_TYPE, "request_id"),
    ("str for list", _edit("prompt_token_ids", "abc"), ErrorCode.WRONG_TYPE, "prompt_token_ids"),
    ("map for list", _edit("prompt_token_ids", {}), ErrorCode.WRONG_TYPE, "prompt_token_ids"),
    ("float in int list", _edit("prompt_token_ids", [1, 2.0]), ErrorCode.WRONG_TYPE, "prompt_token_ids[1]"),
    ("bool in int list", _edit("prompt_token_ids", [1, 2, True]), ErrorCode.WRONG_TYPE, "prompt_token_ids[2]"),
    ("bool for int", _edit("sampling.top_k", True), ErrorCode.WRONG_TYPE, "sampling.top_k"),
    ("int for float", _edit("sampling.temperature", 1), ErrorCode.WRONG_TYPE, "sampling.temperature"),
    ("float for int", _edit("sampling.max_tokens", 8.0), ErrorCode.WRONG_TYPE, "sampling.max_tokens"),
    ("int for bool", _edit("sampling.ignore_eos", 1), ErrorCode.WRONG_TYPE, "sampling.ignore_eos"),
    ("nil for bool", _edit("want_trace", None), ErrorCode.WRONG_TYPE, "want_trace"),
    ("str for optional int", _edit("sampling.seed", "7"), ErrorCode.WRONG_TYPE, "sampling.seed"),
    ("array for nested message", _edit("sampling", [1, 2]), ErrorCode.WRONG_TYPE, "sampling"),
    ("wrong nested message", _edit("sampling", {"type": "AbortRequest", "version": 1, "request_id": "x"}),
     ErrorCode.UNEXPECTED_TYPE, "sampling.type"),
    ("top_p out of range", _edit("sampling.top_p", 0.0), ErrorCode.INVALID_VALUE, "sampling.top_p"),
    ("top_k zero", _edit("sampling.top_k", 0), ErrorCode.INVALID_VALUE, "sampling.top_k"),
    ("temperature nan", _edit("sampling.temperature", math.nan), ErrorCode.INVALID_VALUE, "sampling.temperature"),
    ("logprobs too many", _edit("sampling.logprobs", 21), ErrorCode.INVALID_VALUE, "sampling.logprobs"),
    ("empty prompt", _edit("prompt_token_ids", []), ErrorCode.INVALID_VALUE, "prompt_token_ids"),
    ("negative token", _edit("prompt_token_ids", [1, -1]), ErrorCode.INVALID_VALUE, "prompt_token_ids"),
    ("negative lease ttl", _edit("lease_ttl_s", -1.0), ErrorCode.INVALID_VALUE, "lease_ttl_s"),
    ("ext type", _edit("request_id", msgpack.ExtType(1, b"x")), ErrorCode.EXT_NOT_ALLOWED, None),
    ("empty ext type", _edit("request_id", msgpack.ExtType(3, b"")), ErrorCode.EXT_NOT_ALLOWED, None),
    ("timestamp ext", _edit("request_id", datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)),
     ErrorCode.EXT_NOT_ALLOWED, None),
]


@pytest.mark.parametrize(("edit", "code", "field"), [c[1:] for c in MALFORMED_PREFILL], ids=[c[0] for c in MALFORMED_PREFILL])
def test_malformed_prefill_request_is_rejected(
    edit: Callable[[dict[str, Any]], Any], code: ErrorCode, field: str | None
) -> None:
    body = msgpack.packb(edit(_valid_prefill()), use_bin_type=True, datetime=True)
    with pytest.raises(ProtocolError) as exc:
        decode(body, PrefillRequest)
    assert exc.value.code == code, exc.value
    assert exc.value.field == field, exc.value
    if field is not None:
        assert str(exc.value).startswith(field + ": ")


def _result_wire(**changes: Any) -> bytes:
    wire = msgpack.unpackb(encode(PrefillResult(
        request_id="r", first_token_ids=[5, 6], num_prompt_tokens=3, timings={"queue_s": 0.5},
        first_logprobs=[TokenLogprobs(token_id=5, logprob=-0.1, top_ids=[5, 7], top_logprobs=[-0.1, -2.0]),
                        TokenLogprobs(token_id=6, logprob=-0.2)],
    )))
    for path, value in changes.items():
        _edit(path.replace("__", "."), value)(wire)
    return msgpack.packb(wire, use_bin_type=True)


@pytest.mark.parametrize(
    ("body", "expected", "code", "field"),
    [
        (_result_wire(timings={"queue_s": 1}), PrefillResult, ErrorCode.WRONG_TYPE, "timings.queue_s"),
        (_result_wire(timings={"a": 0.1, b"k": 0.2}), PrefillResult, ErrorCode.WRONG_TYPE, "timings"),
        (_result_wire(first_logprobs=[{"type": "TokenLogprobs", "version": 1, "token_id": 5, "logprob": -0.1,
                                       "top_ids": [1, "x"], "top_logprobs": [0.0, 0.0]}, None]),
         PrefillResult, ErrorCode.WRONG_TYPE, "first_logprobs[0].top_ids[1]"),
        (_result_wire(first_logprobs=[]), PrefillResult, ErrorCode.INVALID_VALUE, "first_logprobs"),
        (msgpack.packb({"type": "Heartbeat", "version": 1, "instance_id": "i", "role": "router", "running": 0,
                        "waiting": 0, "free_blocks": 0, "total_blocks": 0}), Heartbeat, ErrorCode.INVALID_VALUE, "role"),
        (msgpack.packb({"type": "TokenEvent", "version": 1, "request_id": "r", "finish_reason": "done"}),
         TokenEvent, ErrorCode.INVALID_VALUE, "finish_reason"),
        (msgpack.packb({"type": "TokenEvent", "version": 1, "request_id": "r", "trace": {"t": [1, {"k": 2}, {b"k": 4}]}}),
         TokenEvent, ErrorCode.WRONG_TYPE, "trace.t[2]"),
        (encode(DecodeRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingSpec(max_tokens=1)))
         .replace(b"\xa1n\x01", b"\xa1n\x02"), DecodeRequest, ErrorCode.INVALID_VALUE, "sampling.n"),
    ],
)
def test_malformed_nested_values_name_their_path(body: bytes, expected: type[Message], code: ErrorCode, field: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode(body, expected)
    assert (exc.value.code, exc.value.field) == (code, field), exc.value


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b"", ErrorCode.MALFORMED, "ends inside"),
        (b"\xc1", ErrorCode.MALFORMED, "not valid msgpack"),
        (encode(AbortRequest(request_id="r"))[:-1], ErrorCode.MALFORMED, "ends inside"),
        (encode(AbortRequest(request_id="r")) + b"\x00", ErrorCode.MALFORMED, "trailing bytes"),
        (b"\x81\xa4type\xa3\xff\xfe\xfd", ErrorCode.MALFORMED, "UTF-8"),
        (b"\x81\x01\x02", ErrorCode.MALFORMED, "map key"),
        (b"\x91" * 5000 + b"\x01", ErrorCode.TOO_LARGE, "nesting"),
        (b"not msgpack at all", ErrorCode.MALFORMED, ""),
    ],
)
def test_garbage_bodies(body: bytes, code: ErrorCode, words: str) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode(body)
    assert exc.value.code == code, exc.value
    assert words in str(exc.value)


def test_decode_without_expected_dispatches_on_type() -> None:
    assert isinstance(decode(encode(ErrorMessage(code=500, message="x"))), ErrorMessage)
    with pytest.raises(ProtocolError) as exc:
        decode(msgpack.packb({"type": "Nope", "version": 1}))
    assert exc.value.code == ErrorCode.UNKNOWN_TYPE


# --- limits -----------------------------------------------------------------------------

SMALL = Limits(max_body_bytes=4096, max_str_len=64, max_bin_len=64, max_array_len=100, max_map_len=16, max_depth=6)


def _event(**kw: Any) -> bytes:
    return msgpack.packb({"type": "TokenEvent", "version": 1, "request_id": "r", **kw}, use_bin_type=True)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (_event(trace={"pad": "x" * 5000}), "exceeds 4096"),
        (_event(request_id="x" * 65), "max_str_len"),
        (_event(trace={"blob": b"x" * 65}), "max_bin_len"),
        (_event(token_ids=list(range(101))), "max_array_len"),
        (_event(trace={str(i): i for i in range(17)}), "max_map_len"),
        (_event(trace={"a": [[[[[1]]]]]}), "nested deeper than 6"),
    ],
)
def test_oversized_input_is_too_large(body: bytes, words: str) -> None:
    decode(body, TokenEvent)  # fine under the default limits...
    with pytest.raises(ProtocolError) as exc:
        decode(body, TokenEvent, limits=SMALL)  # ...refused under small ones
    assert exc.value.code == ErrorCode.TOO_LARGE
    assert words in str(exc.value)


def test_limits_at_the_boundary_are_accepted() -> None:
    body = _event(request_id="x" * 64, token_ids=list(range(100)), trace={"a": [[[[1]]]]})
    assert decode(body, TokenEvent, limits=SMALL).request_id == "x" * 64


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"type": "TokenEvent", "version": 1, "request_id": "é" * 65}, "request_id"),
        ({"type": "TokenEvent", "version": 1, "request_id": "r", "token_ids": [0] * 101}, "token_ids"),
        ({"type": "TokenEvent", "version": 1, "request_id": "r", "trace": {"b": b"x" * 65}}, "trace.b"),
        ({"type": "TokenEvent", "version": 1, "request_id": "r", "trace": {str(i): 0 for i in range(17)}}, "trace"),
    ],
)
def test_limits_are_validated_after_unpacking_too(wire: dict[str, Any], field: str) -> None:
    """from_wire checks lengths itself, for data that did not come through msgpack's limits."""
    with pytest.raises(ProtocolError) as exc:
        from_wire(wire, TokenEvent, limits=SMALL)
    assert (exc.value.code, exc.value.field) == (ErrorCode.TOO_LARGE, field)


def test_limits_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        Limits(max_depth=0)


# --- the generic mechanism --------------------------------------------------------------


def test_message_declarations_are_checked() -> None:
    with pytest.raises(TypeError, match="already taken"):

        @dataclass(kw_only=True)
        class AbortRequest(Message, version=1):  # noqa: F811 - the clash is the point
            request_id: str

    with pytest.raises(TypeError):

        class NoVersion(Message):  # type: ignore[call-arg]
            pass

    @dataclass(kw_only=True)
    class BadFieldForTests(Message, version=1):
        when: complex

    with pytest.raises(TypeError, match="BadFieldForTests.when: unsupported field type"):
        encode(BadFieldForTests(when=1j))

    @dataclass(kw_only=True)
    class ReservedForTests(Message, version=1):
        type: str

    with pytest.raises(TypeError, match="reserved"):
        encode(ReservedForTests(type="x"))


@dataclass(kw_only=True)
class BlobForTests(Message, version=3, type_name="test.blob"):
    """A message with a binary field, union-free nesting and a custom wire name."""

    data: bytes
    parts: list[list[int]] = field(default_factory=list)
    meta: dict[str, str | None] = field(default_factory=dict)


def test_custom_type_name_bytes_and_nested_containers() -> None:
    msg = BlobForTests(data=b"\x00\xff", parts=[[1], [2, 3]], meta={"a": None, "b": "c"})
    body = encode(msg)
    assert msgpack.unpackb(body)["type"] == "test.blob"
    assert decode(body) == msg
    bad = msgpack.packb({"type": "test.blob", "version": 3, "data": "str not bin"}, use_bin_type=True)
    with pytest.raises(ProtocolError) as exc:
        decode(bad, BlobForTests)
    assert (exc.value.code, exc.value.field, exc.value.message) == (ErrorCode.WRONG_TYPE, "data", "expected bin, got str")
    with pytest.raises(ProtocolError) as exc:
        decode(msgpack.packb({"type": "test.blob", "version": 3, "data": b"", "parts": [[1], [2, 2.5]]}), BlobForTests)
    assert exc.value.field == "parts[1][1]"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_pickle_anywhere_in_the_protocol() -> None:
    files = list(PROTOCOL_DIR.glob("*.py"))
    assert len(files) >= 7
    for path in files:
        assert not _imported_modules(path) & {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve"}, path


# --- stream framing ---------------------------------------------------------------------

STREAM = [
    TokenEvent(request_id="r", token_ids=[1]),
    TokenEvent(request_id="r", token_ids=[2, 3], logprobs=[TokenLogprobs(token_id=2, logprob=-0.5),
                                                          TokenLogprobs(token_id=3, logprob=-1.5)]),
    TokenEvent(request_id="r", finish_reason="stop", num_cached_tokens=32, trace={"decode": {"load_s": 0.01}}),
]
STREAM_BYTES = b"".join(encode(m) for m in STREAM)
BOUNDARIES = {sum(len(encode(m)) for m in STREAM[:i]) for i in range(len(STREAM) + 1)}


def test_stream_split_at_every_byte_boundary() -> None:
    for cut in range(len(STREAM_BYTES) + 1):
        decoder = StreamDecoder(TokenEvent)
        got = decoder.feed(STREAM_BYTES[:cut]) + decoder.feed(STREAM_BYTES[cut:])
        decoder.finish()
        assert got == STREAM, cut


def test_stream_fed_one_byte_at_a_time() -> None:
    decoder = StreamDecoder(TokenEvent)
    got = []
    for i in range(len(STREAM_BYTES)):
        got += decoder.feed(STREAM_BYTES[i : i + 1])
    decoder.finish()
    assert got == STREAM


def test_truncated_stream_at_every_cut() -> None:
    for cut in range(len(STREAM_BYTES)):
        decoder = StreamDecoder(TokenEvent)
        got = decoder.feed(STREAM_BYTES[:cut])
        if cut in BOUNDARIES:
            decoder.finish()  # ended between messages: a clean (if early) end
            assert got == STREAM[: sorted(BOUNDARIES).index(cut)]
        else:
            with pytest.raises(TruncatedStreamError) as exc:
                decoder.finish()
            assert exc.value.code == ErrorCode.TRUNCATED


def test_garbage_mid_stream_breaks_the_decoder() -> None:
    decoder = StreamDecoder(TokenEvent)
    assert decoder.feed(encode(STREAM[0])) == [STREAM[0]]
    with pytest.raises(ProtocolError) as exc:
        decoder.feed(b"\xc1" + encode(STREAM[1]))
    assert exc.value.code == ErrorCode.MALFORMED
    with pytest.raises(ProtocolError):
        decoder.feed(encode(STREAM[1]))  # framing is lost for good
    with pytest.raises(ProtocolError):
        decoder.finish()


def test_stream_of_the_wrong_message_type() -> None:
    decoder = StreamDecoder(TokenEvent)
    with pytest.raises(ProtocolError) as exc:
        decoder.feed(encode(AbortRequest(request_id="r")))
    assert exc.value.code == ErrorCode.UNEXPECTED_TYPE


def test_stream_message_over_the_limit() -> None:
    limits = Limits(max_body_bytes=100)
    big = encode(TokenEvent(request_id="r", token_ids=list(range(200))))
    decoder = StreamDecoder(TokenEvent, limits=limits)
    with pytest.raises(ProtocolError) as exc:
        for i in range(0, len(big), 7):
            decoder.feed(big[i : i + 7])
    assert exc.value.code == ErrorCode.TOO_LARGE


def test_many_small_messages_in_one_chunk_larger_than_the_limit() -> None:
    limits = Limits(max_body_bytes=200)
    events = [TokenEvent(request_id="r", token_ids=[i]) for i in range(50)]
    chunk = b"".join(encode(e) for e in events)
    assert max(len(encode(e)) for e in events) <= limits.max_body_bytes
    assert len(chunk) > 10 * limits.max_body_bytes
    decoder = StreamDecoder(TokenEvent, limits=limits)
    assert decoder.feed(chunk) == events
    decoder.finish()


# --- aiohttp helpers through a real server ----------------------------------------------

LIMITED = Limits(max_body_bytes=1024)


async def _prefill(request: web.Request) -> web.Response:
    req = await read_message(request, PrefillRequest, limits=LIMITED)
    return msgpack_response(
        PrefillResult(request_id=req.request_id, first_token_ids=[req.prompt_token_ids[-1] + 1],
                      num_prompt_tokens=len(req.prompt_token_ids))
    )


async def _decode(request: web.Request) -> web.StreamResponse:
    req = await read_message(request, DecodeRequest)
    stream = MessageStreamResponse()
    await stream.prepare(request)
    for tok in range(req.sampling.max_tokens):
        await stream.send(TokenEvent(request_id=req.request_id, token_ids=[tok]))
    await stream.send(TokenEvent(request_id=req.request_id, finish_reason="length"))
    await stream.write_eof()
    return stream


def _broken_stream(tail: bytes, *, peer_dies: bool) -> Callable[[web.Request], Any]:
    """A handler that sends one good event, then ``tail``, then ends the body cleanly
    (``peer_dies=False``) or drops the connection without the terminating chunk."""

    async def handler(request: web.Request) -> web.StreamResponse:
        stream = MessageStreamResponse()
        await stream.prepare(request)
        await stream.send(STREAM[0])
        await stream.write(tail)
        if peer_dies:
            assert request.transport is not None
            request.transport.close()
        else:
            await stream.write_eof()
        return stream

    return handler


async def _json_answer(request: web.Request) -> web.Response:
    return web.json_response({"error": "nope"}, status=503)


def _app() -> web.Application:
    app = web.Application()
    app.router.add_post("/prefill", _prefill)
    app.router.add_post("/decode", _decode)
    half = encode(STREAM[1])[:5]
    app.router.add_get("/half", _broken_stream(half, peer_dies=False))  # clean HTTP end inside a message
    app.router.add_get("/die", _broken_stream(half, peer_dies=True))
    app.router.add_get("/garbage", _broken_stream(b"\xc1\xc1", peer_dies=False))
    app.router.add_get("/json", _json_answer)
    return app


def _prefill_body(**kw: Any) -> bytes:
    return encode(PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=4), **kw))


MSGPACK = {"Content-Type": "application/msgpack"}


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


BAD_REQUESTS = [
    # (description, headers, body, code, param)
    ("no content type", {}, _prefill_body(), "bad_content_type", None),
    ("json content type", {"Content-Type": "application/json"}, b'{"request_id": "r1"}', "bad_content_type", None),
    ("empty body", MSGPACK, b"", "malformed", None),
    ("garbage", MSGPACK, b"\xc1\xc1\xc1", "malformed", None),
    ("truncated", MSGPACK, _prefill_body()[:-3], "malformed", None),
    ("trailing bytes", MSGPACK, _prefill_body() + b"\x01", "malformed", None),
    ("wrong message", MSGPACK, encode(AbortRequest(request_id="r1")), "unexpected_type", "type"),
    ("unknown type", MSGPACK, msgpack.packb({"type": "Bogus", "version": 1}), "unknown_type", "type"),
    ("wrong version", MSGPACK, msgpack.packb({**_valid_prefill(), "version": 9}), "wrong_version", "version"),
    ("missing field", MSGPACK, msgpack.packb({k: v for k, v in _valid_prefill().items() if k != "sampling"}),
     "missing_field", "sampling"),
    ("extra field", MSGPACK, msgpack.packb({**_valid_prefill(), "evil": 1}), "unknown_field", "evil"),
    ("wrong type", MSGPACK, msgpack.packb({**_valid_prefill(), "want_trace": "yes"}), "wrong_type", "want_trace"),
    ("bad value", MSGPACK, msgpack.packb({**_valid_prefill(), "prompt_token_ids": []}), "invalid_value", "prompt_token_ids"),
    ("ext type", MSGPACK, msgpack.packb({**_valid_prefill(), "request_id": msgpack.ExtType(1, b"x")}), "ext_not_allowed", None),
    ("too large", MSGPACK, _prefill_body() + b"\x00" * 2048, "too_large", None),
    ("too large, chunked", MSGPACK, "chunked", "too_large", None),
]


@pytest.mark.parametrize(("headers", "body", "code", "param"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_request_bodies_get_400_json(headers: dict[str, str], body: Any, code: str, param: str | None) -> None:
    async with TestClient(TestServer(_app())) as client:
        data = _chunks(b"\x00" * 4096, 512) if body == "chunked" else body
        resp = await client.post("/prefill", data=data, headers=headers)
        assert resp.status == 400
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == code
        assert error["param"] == param
        assert error["message"]
        if param:
            assert error["message"].startswith(param)
        # The server is still up and still answers good requests.
        ok = await client.post("/prefill", data=_prefill_body(), headers=MSGPACK)
        assert ok.status == 200
        result = await read_response(ok, PrefillResult)
        assert result.first_token_ids == [4]


async def test_request_sent_in_small_chunks_is_reassembled() -> None:
    async with TestClient(TestServer(_app())) as client:
        resp = await client.post("/prefill", data=_chunks(_prefill_body(), 3), headers=MSGPACK)
        assert resp.status == 200
        assert (await read_response(resp, PrefillResult)).num_prompt_tokens == 3


async def test_read_response_names_the_status_of_a_json_error() -> None:
    async with TestClient(TestServer(_app())) as client:
        resp = await client.get("/json")
        with pytest.raises(ProtocolError) as exc:
            await read_response(resp, PrefillResult)
        assert exc.value.code == ErrorCode.BAD_CONTENT_TYPE
        assert "application/json (HTTP 503)" in str(exc.value)


async def test_stream_round_trip_one_message_per_chunk() -> None:
    req = DecodeRequest(request_id="d1", prompt_token_ids=[1, 2], first_token_id=3, sampling=SamplingSpec(max_tokens=5))
    async with TestClient(TestServer(_app())) as client:
        resp = await client.post("/decode", data=encode(req), headers=MSGPACK)
        assert resp.status == 200 and resp.headers["Transfer-Encoding"] == "chunked"
        events = [ev async for ev in iter_messages(resp, TokenEvent)]
        assert [ev.token_ids for ev in events] == [[0], [1], [2], [3], [4], []]
        assert events[-1].finish_reason == "length"

        resp = await client.post("/decode", data=encode(req), headers=MSGPACK)
        chunks = []
        buffer = b""
        async for data, end_of_chunk in resp.content.iter_chunks():
            buffer += data
            if end_of_chunk:
                chunks.append(buffer)
                buffer = b""
        assert [decode(c, TokenEvent).token_ids for c in chunks] == [[0], [1], [2], [3], [4], []]


@pytest.mark.parametrize("path", ["/half", "/die"])
async def test_truncated_stream_over_http(path: str) -> None:
    async with TestClient(TestServer(_app())) as client:
        resp = await client.get(path)
        got = []
        with pytest.raises(TruncatedStreamError):
            async for ev in iter_messages(resp, TokenEvent):
                got.append(ev)
        assert got == [STREAM[0]]  # what arrived whole is delivered before the error
        assert (await client.post("/prefill", data=_prefill_body(), headers=MSGPACK)).status == 200


@pytest.mark.parametrize(("path", "code"), [("/garbage", ErrorCode.MALFORMED), ("/json", ErrorCode.BAD_CONTENT_TYPE)])
async def test_stream_reader_refuses_bad_streams(path: str, code: ErrorCode) -> None:
    async with TestClient(TestServer(_app())) as client:
        resp = await client.get(path)
        with pytest.raises(ProtocolError) as exc:
            async for _ in iter_messages(resp, TokenEvent):
                pass
        assert exc.value.code == code


async def test_many_bad_requests_concurrently_never_500() -> None:
    async with TestClient(TestServer(_app())) as client:
        bodies = [b[2] for b in BAD_REQUESTS if b[2] != "chunked"]
        responses = await asyncio.gather(
            *(client.post("/prefill", data=body, headers=MSGPACK) for body in bodies * 3)
        )
        statuses = {r.status for r in responses}
        for r in responses:
            json.loads(await r.text()) if r.status == 400 else await r.read()
        assert statuses <= {200, 400} and 500 not in statuses
