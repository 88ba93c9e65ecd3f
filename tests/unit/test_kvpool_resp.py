"""The RESP codec of the bulk path: frames reference large values instead of copying them,
and the parser gives the same replies however the bytes are cut, lands sink payloads
straight in the sink's memory, and rejects what is not RESP2."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.kvpool.header import HEADER_NBYTES, PendingValue
from libs.kvpool.resp import (
    INLINE_MAX,
    ConnectionClosed,
    Discarded,
    Frames,
    ProtocolError,
    ReplyError,
    ReplyParser,
    pack,
)


def feed(parser: ReplyParser, data: bytes, cuts: list[int]) -> None:
    """Deliver ``data`` through the parser's own buffers in pieces of the given sizes."""
    pos, i = 0, 0
    while pos < len(data):
        buf = parser.get_buffer()
        n = min(len(buf), len(data) - pos, cuts[i % len(cuts)] if cuts else len(data))
        n = max(n, 1)
        buf[:n] = data[pos : pos + n]
        parser.feed(n)
        pos += n
        i += 1


# -- frames ---------------------------------------------------------------------------------


def test_small_commands_pack_as_resp_arrays() -> None:
    assert pack("SET", "k", b"v", 12) == b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\n12\r\n"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["EVALSHA", "EXISTS", "GET", "HLEN", "INFO", "SCRIPT", "CLUSTER", "PING"]),
                           st.lists(st.one_of(st.text(max_size=40), st.binary(max_size=64), st.integers(-(2**63), 2**63 - 1)),
                                    max_size=12)).map(lambda c: [c[0], *c[1]]), min_size=1, max_size=8))
def test_control_commands_pack_to_the_bytes_redis_py_packs(commands: list[list]) -> None:
    """The control plane packs its commands with ``Frames`` (libs/kvpool/control.py) where
    redis-py's ``pack_commands`` did: for its argument types (str, bytes, int) the bytes
    on the wire are the same."""
    from redis.asyncio.connection import Connection

    frames = Frames()
    for c in commands:
        frames.command(*c)
    ours = b"".join(bytes(b) for b in frames.finish())
    theirs = b"".join(bytes(b) for b in Connection().pack_commands([tuple(c) for c in commands]))
    assert ours == theirs


def test_a_large_value_is_referenced_not_copied() -> None:
    value = np.arange(INLINE_MAX * 2, dtype=np.uint8)
    frames = Frames().command("SET", "key", value).command("GET", "key")
    iov = frames.finish()
    assert len(iov) == 3
    assert np.shares_memory(np.frombuffer(iov[1], dtype=np.uint8), value)  # the value itself
    assert b"".join(bytes(b) for b in iov) == pack("SET", "key", value.tobytes()) + pack("GET", "key")
    assert frames.commands == 2 and frames.nbytes == sum(memoryview(b).nbytes for b in iov)


def test_a_value_in_parts_goes_out_back_to_back() -> None:
    header = b"H" * 24
    runs = [np.full(INLINE_MAX, i, dtype=np.uint8) for i in range(3)]
    iov = Frames().command("SET", "k", [header, *runs]).finish()
    joined = b"".join(bytes(b) for b in iov)
    assert joined == pack("SET", "k", header + b"".join(r.tobytes() for r in runs))
    assert any(np.shares_memory(np.frombuffer(b, dtype=np.uint8), runs[1]) for b in iov if not isinstance(b, bytes))


def test_a_pending_value_goes_out_unsealed_with_its_seal_for_the_sender() -> None:
    runs = [np.full(INLINE_MAX, i, dtype=np.uint8) for i in range(2)]
    header = memoryview(bytearray(HEADER_NBYTES))
    header[:4] = b"TPKV"
    pending = PendingValue(header, [memoryview(r) for r in runs])
    frames = Frames().command("SET", "k", pending)
    iov = frames.finish()
    assert frames.seals == [pending.seal] and bytes(header[16:]) == bytes(8), "building frames must not hash"
    for seal in frames.seals:  # what the bulk path does on its thread, right before sendmsg
        seal()
    sealed = bytes(header)
    assert sealed[16:] == struct.pack("<Q", xxhash.xxh3_64_intdigest(b"".join(r.tobytes() for r in runs)))
    assert b"".join(bytes(b) for b in iov) == pack("SET", "k", sealed + b"".join(r.tobytes() for r in runs))
    # A value small enough to be copied into the frame is sealed right away.
    small = PendingValue(memoryview(bytearray(HEADER_NBYTES)), [memoryview(np.ones(64, dtype=np.uint8))])
    frames = Frames().command("SET", "k", small)
    assert frames.seals == [] and bytes(small.parts[0][16:]) == struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(64 * [1])))


# -- parser: every reply type, cut anywhere --------------------------------------------------

_scalars = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126, exclude_characters="\r\n"), max_size=20).map(
        lambda t: ("simple", t)
    ),
    st.integers(min_value=-(2**62), max_value=2**62).map(lambda i: ("int", i)),
    st.binary(max_size=300).map(lambda b: ("bulk", b)),
    st.just(("nil", None)),
    st.text(alphabet="ABCDEFGH xyz", min_size=1, max_size=20).map(lambda t: ("error", "ERR " + t)),
)
_replies = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4).map(lambda xs: ("array", xs)), max_leaves=12)


def encode(reply: tuple) -> tuple[bytes, object]:
    kind, value = reply
    if kind == "simple":
        return b"+" + value.encode() + b"\r\n", value
    if kind == "int":
        return b":%d\r\n" % value, value
    if kind == "bulk":
        return b"$%d\r\n" % len(value) + value + b"\r\n", value
    if kind == "nil":
        return b"$-1\r\n", None
    if kind == "error":
        return b"-" + value.encode() + b"\r\n", ReplyError(value)
    parts = [encode(x) for x in value]
    return b"*%d\r\n" % len(parts) + b"".join(p for p, _ in parts), [e for _, e in parts]


@settings(max_examples=150, deadline=None)
@given(st.lists(_replies, min_size=1, max_size=8), st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_generic_replies_parse_the_same_however_they_are_cut(replies: list[tuple], cuts: list[int]) -> None:
    encoded = [encode(r) for r in replies]
    parser = ReplyParser(bufsize=64, head_read=8)  # tiny buffers: every boundary case
    parser.expect_many([None] * len(encoded))
    feed(parser, b"".join(e for e, _ in encoded), cuts)
    assert parser.pending == 0
    assert parser.take() == [value for _, value in encoded]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.one_of(st.binary(min_size=0, max_size=20000), st.none()), min_size=1, max_size=6),
    st.lists(st.integers(1, 9000), min_size=1, max_size=6),
    st.integers(1, 4),
)
def test_sink_payloads_land_in_the_sink_memory(values: list[bytes | None], cuts: list[int], nviews: int) -> None:
    """Bulk replies with a sink: payloads land in caller memory split over several views."""
    parser = ReplyParser(bufsize=4096, head_read=64)
    dests: list[np.ndarray] = []

    def sink(n: int) -> list[memoryview]:
        arr = np.zeros(n, dtype=np.uint8)
        dests.append(arr)
        bounds = sorted({0, n, *(n * k // nviews for k in range(1, nviews))})
        return [memoryview(arr[a:b]) for a, b in zip(bounds, bounds[1:])]

    data = b"".join(b"$-1\r\n" if v is None else b"$%d\r\n" % len(v) + v + b"\r\n" for v in values)
    parser.expect_many([sink] * len(values))
    feed(parser, data, cuts)
    results = parser.take()
    assert results == [None if v is None else len(v) for v in values]
    assert [d.tobytes() for d in dests] == [v for v in values if v is not None]


def test_a_large_payload_is_received_into_the_sink_itself() -> None:
    """Past the header line, get_buffer() hands out the sink's memory: no copy on the way."""
    value = np.random.default_rng(0).integers(0, 255, 100_000, dtype=np.uint8).tobytes()
    dest = np.zeros(len(value), dtype=np.uint8)
    parser = ReplyParser(head_read=4096)
    parser.expect(lambda n: [memoryview(dest)])
    data = b"$%d\r\n" % len(value) + value + b"\r\n"
    first = parser.get_buffer()
    assert len(first) == 4096  # the header read is capped: little of the payload is copied
    first[:4096] = data[:4096]
    parser.feed(4096)
    direct = parser.get_buffer()
    assert np.shares_memory(np.frombuffer(direct, dtype=np.uint8), dest)
    rest = data[4096:]
    direct[: len(value) - (4096 - len(b"$100000\r\n"))] = rest[: len(direct)]
    parser.feed(len(direct))
    tail = parser.get_buffer()
    tail[:2] = b"\r\n"
    parser.feed(2)
    assert parser.take() == [len(value)] and dest.tobytes() == value


def test_a_sink_may_refuse_a_value_which_is_then_discarded() -> None:
    parser = ReplyParser(bufsize=64)
    parser.expect_many([lambda n: None, None])
    feed(parser, b"$300\r\n" + b"x" * 300 + b"\r\n+OK\r\n", [17])
    assert [type(r) for r in parser.take()] == [Discarded, str]


def test_an_error_reply_in_place_of_a_bulk_is_a_value() -> None:
    parser = ReplyParser()
    parser.expect_many([lambda n: pytest.fail("no payload"), lambda n: pytest.fail("no payload")])
    feed(parser, b"-MOVED 3999 127.0.0.1:6381\r\n$-1\r\n", [5])
    moved, nil = parser.take()
    assert moved.code == "MOVED" and nil is None


# -- parser: what is not RESP -----------------------------------------------------------------


@pytest.mark.parametrize(
    "data, sink",
    [
        (b"?what\r\n", None),  # unknown type byte
        (b"$abc\r\n", None),  # length that is not a number
        (b"$3\r\nabcXY", None),  # bulk not terminated by CRLF
        (b":12x\r\n", None),  # integer that is not one
        (b"*-2\r\n", None),
        (b"+OK\r\n", lambda n: None),  # a simple string where a bulk (GET) reply must be
        (b"$3\r\nabcXY", lambda n: [memoryview(bytearray(3))]),  # sink payload without CRLF
        (b"x" * 70_000, None),  # no line end within the limit
    ],
)
def test_bytes_that_are_not_resp_raise_protocol_error(data: bytes, sink) -> None:
    parser = ReplyParser(bufsize=1 << 16)
    parser.expect(sink)
    with pytest.raises(ProtocolError):
        feed(parser, data, [len(data)])


def test_bytes_nobody_asked_for_are_a_protocol_error() -> None:
    parser = ReplyParser()
    parser.expect(None)
    with pytest.raises(ProtocolError):
        feed(parser, b"+OK\r\n+SURPRISE\r\n", [100])


def test_eof_with_replies_outstanding_is_a_short_read() -> None:
    parser = ReplyParser()
    parser.expect(lambda n: [memoryview(bytearray(n))])
    feed(parser, b"$10\r\n01234", [100])
    with pytest.raises(ConnectionClosed):
        parser.feed(0)


def test_a_sink_giving_the_wrong_amount_of_memory_is_a_bug() -> None:
    parser = ReplyParser()
    parser.expect(lambda n: [memoryview(bytearray(n - 1))])
    with pytest.raises(ValueError):
        feed(parser, b"$10\r\n0123456789\r\n", [100])


def test_pipelined_values_are_copied_at_most_a_header_read_each() -> None:
    """With the kernel always holding more than asked (the worst case), at most ``head_read``
    bytes of each value pass through the parser's own buffer; the rest is received in place."""
    values = [np.random.default_rng(i).integers(0, 255, 368_664, dtype=np.uint8).tobytes() for i in range(8)]
    stream = b"".join(b"$%d\r\n" % len(v) + v + b"\r\n" for v in values) + b":8\r\n"
    dests = [np.zeros(len(v), dtype=np.uint8) for v in values]
    parser = ReplyParser(head_read=4096)
    parser.expect_many([lambda n, d=d: [memoryview(d)] for d in dests] + [None])
    pos = copied = 0
    while parser.pending:
        buf = parser.get_buffer()
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        if not any(np.shares_memory(np.frombuffer(buf, dtype=np.uint8), d) for d in dests):
            copied += n
        parser.feed(n)
        pos += n
    assert parser.take() == [len(v) for v in values] + [8]
    assert [d.tobytes() for d in dests] == values
    assert copied <= 8 * 4096 + 64, f"{copied} bytes went through the parser's buffer"
