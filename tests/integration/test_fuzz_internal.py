"""Hypothesis against the internal msgpack endpoints of real processes: the router's
register/heartbeat/deregister, prefill's /v1/prefill, decode's /v1/decode and /v1/handoff, and both
/v1/abort.

Bodies are drawn from five families: valid messages (kept cheap: a few tokens to
generate), valid messages with one field broken (a wrong type, a missing or extra key,
a wrong type name or version), another message type, arbitrary msgpack values, and
arbitrary bytes, sometimes under the wrong Content-Type. Pass bar: never a 5xx, every
4xx a typed JSON error (``{"error": {"message", "type", "param", "code"}}`` with a
code), every 200 a well-formed answer (a ``PrefillResult``, after ``PrefillProgress``
events when ``stream_progress`` asked for them; a decode stream that ends with a final
event), and every service healthy and serving afterwards. Valid decode requests do not
``await_handoff`` (no prefill would ever send the handoff: each would wait out decode's
``handoff_timeout_s``); /v1/handoff gets updates for requests that wait for none.

``TIDEPOOL_FUZZ_EXAMPLES`` examples per endpoint (``make test``: 60; ``make fuzz``: 2000).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Any, Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libs.protocol import INTERNAL_TOKEN_HEADER, Message, StreamDecoder, encode
from libs.protocol.messages import (
    AbortRequest,
    DecodeRequest,
    DeregisterInstance,
    Heartbeat,
    HandoffUpdate,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    RegisterInstance,
    SamplingSpec,
    TokenEvent,
)
from tests.integration.service_process import ServiceProcess
from tests.unit.test_protocol import STRATEGIES

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("TIDEPOOL_FUZZ_EXAMPLES", "60"))
VOCAB = 49152
MSGPACK = "application/msgpack"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))

# -- bodies ----------------------------------------------------------------------------------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def _cheap(msg: Message, model: str = "") -> Message:
    """A valid message that costs the engine little: at most 4 tokens to generate, and
    (mostly) token ids inside the vocabulary, so the engine runs rather than refuses; a
    registration of the served model at an http URL with dense weights, so the router takes
    it (a random quantization would clash with an earlier registration of the other role,
    and the router rightly refuses every later one until it expires)."""
    if isinstance(msg, RegisterInstance):
        msg = replace(
            msg, model=model, url=f"http://127.0.0.1:{1 + msg.max_model_len % 60000}", namespace="ab" * 16,
            quantization="none",
        )
    if isinstance(msg, (PrefillRequest, DecodeRequest)):
        s: SamplingSpec = msg.sampling
        max_tokens = 1 + s.max_tokens % 4
        msg = replace(msg, sampling=replace(s, max_tokens=max_tokens, min_tokens=min(s.min_tokens, max_tokens)))
        if msg.prompt_token_ids[0] % 4:  # three in four: real token ids
            msg = replace(msg, prompt_token_ids=[t % VOCAB for t in msg.prompt_token_ids])
            if isinstance(msg, DecodeRequest) and msg.first_token_id is not None:
                msg = replace(msg, first_token_id=msg.first_token_id % VOCAB)
    if isinstance(msg, DecodeRequest):
        msg = replace(msg, await_handoff=False)
    return msg


@st.composite
def broken(draw: st.DrawFn, valid: st.SearchStrategy[Message]) -> bytes:
    """A valid message's wire map with one thing wrong."""
    wire = msgpack.unpackb(encode(draw(valid)), raw=False)
    key = draw(st.sampled_from(sorted(wire)))
    how = draw(st.sampled_from(["retype", "drop", "extra", "version", "type"]))
    if how == "retype":
        wire[key] = draw(json_like)
    elif how == "drop":
        del wire[key]
    elif how == "extra":
        wire[draw(st.text(min_size=1, max_size=10))] = draw(json_like)
    elif how == "version":
        wire["version"] = draw(st.integers(-5, 5) | st.text(max_size=3))
    else:
        wire["type"] = draw(st.sampled_from(["TokenEvent", "Nope", "", "AbortRequest"]))
    return msgpack.packb(wire, use_bin_type=True)


def bodies(cls: type[Message], model: str = "") -> st.SearchStrategy[tuple[bytes, str]]:
    valid = STRATEGIES[cls].map(lambda m: _cheap(m, model))
    other = st.sampled_from([c for c in STRATEGIES if c is not cls]).flatmap(lambda c: STRATEGIES[c])
    body = st.one_of(
        valid.map(encode),
        broken(valid),
        other.map(encode),
        json_like.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        st.binary(max_size=200),
    )
    content_type = st.sampled_from([MSGPACK] * 9 + ["application/json"])
    return st.tuples(body, content_type)


# -- calls -------------------------------------------------------------------------------------


def post(url: str, body: bytes, content_type: str, token: str | None) -> tuple[int, str, bytes]:
    headers = {"Content-Type": content_type}
    if token:
        headers[INTERNAL_TOKEN_HEADER] = token
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get_content_type(), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get_content_type(), err.read()


def check_error(status: int, content_type: str, raw: bytes) -> None:
    assert status < 500, f"{status}: {raw[:500]!r}"
    assert content_type == "application/json", (status, content_type, raw[:200])
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert isinstance(error["code"], str) and error["code"], error


def check(url: str, expected: type[Message], body: bytes, content_type: str, token: str | None) -> int:
    """Post one body and check the answer; returns its status."""
    status, ctype, raw = post(url, body, content_type, token)
    if status != 200:
        check_error(status, ctype, raw)
        return status
    if expected is PrefillRequest:
        *progress, result = StreamDecoder().feed(raw)
        assert isinstance(result, PrefillResult) and all(isinstance(m, PrefillProgress) for m in progress), (progress, result)
    elif expected is DecodeRequest:
        events = list(StreamDecoder(TokenEvent).feed(raw))
        assert events and events[-1].finish_reason is not None, events[-3:]
    elif expected in (RegisterInstance, Heartbeat):
        assert ctype == MSGPACK
    else:
        assert json.loads(raw)  # abort: {"aborted": id}
    return status


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# -- the router (a process of its own: fuzzed registrations must not reach the shared stack) --


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[str, str]]:
    token = "fuzz-internal-token-0123456789"
    with ServiceProcess("router", ["--heartbeat-timeout-s", "30"], env={"TIDEPOOL_INTERNAL_TOKEN": token}) as proc:
        yield proc.url, token


@pytest.mark.parametrize(
    ("path", "cls"),
    [("/internal/v1/register", RegisterInstance), ("/internal/v1/heartbeat", Heartbeat), ("/internal/v1/deregister", DeregisterInstance)],
)
def test_router_internal_endpoints(router: tuple[str, str], path: str, cls: type[Message]) -> None:
    url, token = router
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    registered: list[int] = []
    # One valid registration always runs first (hypothesis's explicit example): whether a
    # random run draws one the router accepts is chance (a run of 60 drew none once).
    valid = encode(_cheap(RegisterInstance(instance_id="fuzz-valid", role="prefill", url="", model="", namespace="", max_model_len=2048), model))

    @FUZZ
    @given(body=bodies(cls, model), with_token=st.booleans() | st.just(True))
    @example(body=(valid, MSGPACK), with_token=True)
    def run(body: tuple[bytes, str], with_token: bool) -> None:
        status, ctype, raw = post(url + path, *body, token if with_token else None)
        if not with_token:
            assert status == 401
        if status != 200:
            check_error(status, ctype, raw)
        else:
            assert ctype == MSGPACK
            registered.append(status)

    run()
    assert healthy(url)
    if cls is RegisterInstance:
        assert registered  # the valid family really reaches the success path


# -- prefill and decode (the shared stack's real processes, on the real model) --------------


@pytest.mark.parametrize(
    ("role", "path", "cls"),
    [
        ("prefill", "/v1/prefill", PrefillRequest),
        ("decode", "/v1/decode", DecodeRequest),
        ("decode", "/v1/handoff", HandoffUpdate),
        ("prefill", "/v1/abort", AbortRequest),
        ("decode", "/v1/abort", AbortRequest),
    ],
)
def test_worker_internal_endpoints(cluster: Any, client: Any, role: str, path: str, cls: type[Message]) -> None:
    child = (cluster.prefills if role == "prefill" else cluster.decodes)[0]
    token = cluster.config.internal_token

    statuses: list[int] = []

    @FUZZ
    @given(body=bodies(cls))
    def run(body: tuple[bytes, str]) -> None:
        statuses.append(check(child.url + path, cls, *body, token))

    run()
    # A handoff update answers a waiting request; none waits here, so every one is a 4xx.
    assert (200 in statuses or cls is HandoffUpdate) and any(400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert healthy(child.url) and healthy(cluster.url)
    messages = [{"role": "user", "content": "Say hello."}]
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=2)
    assert resp.choices[0].message.content is not None and resp.usage.completion_tokens >= 1
