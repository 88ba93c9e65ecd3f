"""RESP2, the part the bulk path needs: commands as scatter-gather frames, and an
incremental reply parser that lands bulk payloads straight in the caller's memory.

Why our own. redis-py (with hiredis) reads a 368 kB value through three buffers before it
becomes a ``bytes`` object, and the codec then copies it a fourth time into staging; on a
GPU host that is where the handoff's time goes (issue 8). The bulk path (libs/kvpool/bulk.py)
needs just two things redis-py does not offer:

- :class:`Frames` packs pipelined commands into an iovec list. Small arguments (command
  names, keys, scripts) are packed together into one ``bytes``; a large argument (a block
  value, itself a buffer or a list of buffers) is appended to the list as it is, so a
  socket's ``sendmsg`` sends it straight from staging memory. A
  :class:`~libs.kvpool.header.PendingValue` goes in unsealed and its ``seal`` into
  ``Frames.seals``, which the sender runs before sending.
- :class:`ReplyParser` is a state machine fed from a socket by whoever owns it: a blocking
  thread (``recv_into(parser.get_buffer())`` then ``parser.feed(n)``) or an asyncio
  ``BufferedProtocol`` (the same two calls are its ``get_buffer`` / ``buffer_updated``).
  Each expected reply has an optional *sink*: called with a bulk reply's length, it
  returns the memory the payload goes to (a list of writable views, filled in order) or
  ``None`` to discard it. A sink with a ``landed(length)`` method hears right away when
  its payload is complete, from whatever thread feeds the parser (the pool verifies
  blocks there, while the other sockets keep receiving). While a payload is being filled, ``get_buffer`` hands out the
  sink's memory itself, so the kernel copies the bytes straight there. Only what arrives
  in the same read as the reply's header line is copied from the parser's own buffer:
  header reads are capped at ``head_read`` bytes (4 kB, about 1% of a block value).

Replies are values, never exceptions: ``-ERR ...`` is a :class:`ReplyError` in the results
(one failed command of a pipeline says nothing about the others). Bytes that are not
RESP2 raise :class:`ProtocolError`; the connection's state is then unknown and its owner
must close it. ``feed(0)`` (EOF) raises :class:`ConnectionClosed`.

Result types: simple string -> ``str``, integer -> ``int``, bulk -> ``bytes``, array ->
``list``, nil -> ``None``, error -> :class:`ReplyError`. A reply with a sink yields the
payload's length (``int``) once it has landed, :class:`Discarded` if the sink refused it,
``None`` for nil, or a :class:`ReplyError`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Sequence, Union

from libs.kvpool.header import Buffer, PendingValue, Value, value_parts

CRLF = b"\r\n"
# A bulk argument at least this large goes out as its own iovec instead of being packed.
INLINE_MAX = 16 * 1024
MAX_LINE = 64 * 1024  # a header line (type, length, simple string, error) longer than this is garbage
MAX_GENERIC = 64 << 20  # a reply without a sink is buffered whole; this bounds it
MIN_DIRECT = 4096  # a sink view smaller than this is filled from the parser's buffer instead

Arg = Union[bytes, str, int, Value]
Sink = Callable[[int], "Sequence[memoryview] | None"]


class ReplyError:
    """A ``-CODE message`` reply. ``code`` is the first word (``ERR``, ``MOVED``, ``OOM``...)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplyError) and other.message == self.message

    def __hash__(self) -> int:
        return hash(self.message)


class Discarded:
    """A bulk reply of ``length`` bytes whose sink refused it (read and dropped)."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __repr__(self) -> str:
        return f"Discarded({self.length})"


class ProtocolError(Exception):
    """The peer sent bytes that are not a RESP2 reply (or one nobody asked for)."""


class ConnectionClosed(ConnectionError):
    """EOF before every expected reply arrived (a short read)."""


class Frames:
    """Pipelined commands as one iovec list; large arguments are referenced, not copied."""

    def __init__(self) -> None:
        self.iov: list[Buffer] = []
        self.commands = 0
        self.nbytes = 0
        # PendingValue.seal of each pending value referenced by the iovecs: the sender
        # calls them before the bytes go out (on its own thread: hashing releases the GIL).
        self.seals: list[Callable[[], object]] = []
        self._small = bytearray()

    def command(self, *args: Arg) -> "Frames":
        small = self._small
        small += b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, bytes):
                small += b"$%d\r\n" % len(arg)
                small += arg
                small += CRLF
            elif isinstance(arg, str):
                data = arg.encode()
                small += b"$%d\r\n" % len(data)
                small += data
                small += CRLF
            elif isinstance(arg, int):
                data = b"%d" % arg
                small += b"$%d\r\n" % len(data)
                small += data
                small += CRLF
            else:  # a value: one buffer, a list/tuple of parts, or a PendingValue
                if isinstance(arg, PendingValue) and arg.nbytes >= INLINE_MAX:
                    parts = arg.parts  # sealed by the sender, just before it goes out
                    self.seals.append(arg.seal)
                else:
                    parts = value_parts(arg)
                size = sum(p.nbytes for p in parts)
                small += b"$%d\r\n" % size
                if size < INLINE_MAX:
                    for p in parts:
                        small += p
                else:
                    self._flush()
                    self.iov.extend(p for p in parts if p.nbytes)
                    self.nbytes += size
                small += CRLF
        self.commands += 1
        return self

    def _flush(self) -> None:
        if self._small:
            data = bytes(self._small)
            self.iov.append(data)
            self.nbytes += len(data)
            self._small.clear()

    def finish(self) -> list[Buffer]:
        """The iovec list to send (call once every command is in)."""
        self._flush()
        return self.iov


def pack(*args: Arg) -> bytes:
    """One small command as bytes (handshakes, tests)."""
    return b"".join(bytes(b) for b in Frames().command(*args).finish())


class _Incomplete(Exception):
    pass


class ReplyParser:
    """Parse the replies to pipelined commands as bytes arrive (see the module docstring).

    ``expect(sink)`` once per command sent, in order; then, until ``pending`` is 0,
    ``feed(n)`` after ``n`` bytes were received into ``get_buffer()``. ``take()`` returns
    the finished replies in order. The parser is reusable for the connection's next
    pipeline once nothing is pending.
    """

    def __init__(self, bufsize: int = 1 << 16, head_read: int = 4096) -> None:
        self._buf = bytearray(bufsize)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._head_read = head_read
        self._expect: deque[Sink | None] = deque()
        self._results: list[Any] = []
        # Payload fill state: the views still to fill, the bytes they need, the result.
        self._targets: deque[memoryview] = deque()
        self._remaining = 0
        self._skip = 0
        self._filling = False
        self._fill_result: Any = None
        self._fill_sink: Any = None
        self._direct = False  # whether the last get_buffer() was a sink view

    # -- the caller's side -----------------------------------------------------------------

    def expect(self, sink: Sink | None = None) -> None:
        self._expect.append(sink)

    def expect_many(self, sinks: Iterable[Sink | None]) -> None:
        self._expect.extend(sinks)

    @property
    def pending(self) -> int:
        return len(self._expect)

    @property
    def direct(self) -> bool:
        """Whether the last ``get_buffer()`` was a sink's memory: all of it belongs to one
        payload, so a blocking reader may wait until it is full (``MSG_WAITALL``)."""
        return self._direct

    def take(self) -> list[Any]:
        results, self._results = self._results, []
        return results

    def reset(self) -> None:
        """Forget everything (the connection is being thrown away)."""
        self._expect.clear()
        self._results = []
        self._targets.clear()
        self._filling = False
        self._remaining = self._skip = 0
        self._start = self._end = 0

    # -- the socket's side -----------------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go: a sink's memory while a payload is being filled."""
        # While a payload is being filled the parser's buffer is empty: _fill moved
        # everything buffered into the sink's memory.
        if self._filling and self._remaining and self._targets and self._start == self._end:
            target = self._targets[0]
            if target.nbytes >= MIN_DIRECT:
                self._direct = True
                return target
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            self._compact()
        room = len(self._buf) - self._end
        discarding = self._filling and self._remaining and not self._targets
        if not discarding and (self._filling or (self._expect and self._expect[0] is not None)):
            # Around a sink's payload (its header line, a small first view, the CRLF after
            # it, the next reply's header) read a little: what lands here is copied.
            room = min(room, self._head_read)
        return self._mv[self._end : self._end + room]

    def feed(self, n: int) -> None:
        """``n`` bytes were received into the last ``get_buffer()``; parse what is complete."""
        if n <= 0:
            raise ConnectionClosed(f"connection closed with {len(self._expect)} replies outstanding")
        if self._direct:
            self._direct = False
            self._advance_target(n)
        else:
            self._end += n
        self._parse()

    # -- parsing ---------------------------------------------------------------------------

    def _compact(self) -> None:
        live = self._end - self._start
        if self._start:
            self._buf[:live] = self._buf[self._start : self._end]
            self._start, self._end = 0, live
        if self._end == len(self._buf):
            if len(self._buf) >= MAX_GENERIC:
                raise ProtocolError(f"a reply larger than {MAX_GENERIC} bytes without a sink")
            # A new buffer: the old one may still be exported (memoryviews handed out).
            bigger = bytearray(2 * len(self._buf))
            bigger[: self._end] = self._buf[: self._end]
            self._buf, self._mv = bigger, memoryview(bigger)

    def _advance_target(self, n: int) -> None:
        self._remaining -= n
        while n:
            target = self._targets[0]
            if n >= target.nbytes:
                n -= target.nbytes
                self._targets.popleft()
            else:
                self._targets[0] = target[n:]
                n = 0

    def _complete(self, value: Any) -> None:
        self._expect.popleft()
        self._results.append(value)

    def _parse(self) -> None:
        while True:
            if self._filling:
                if not self._fill():
                    return
                continue
            if self._start == self._end:
                return
            if not self._expect:
                raise ProtocolError(f"{self._end - self._start} bytes nobody asked for")
            sink = self._expect[0]
            try:
                if sink is None:
                    value, self._start = self._value(self._start)
                    self._complete(value)
                else:
                    self._bulk_header(sink)
            except _Incomplete:
                return

    def _fill(self) -> bool:
        """Move buffered bytes into the current payload; True once it and its CRLF are done."""
        avail = self._end - self._start
        if self._remaining and avail:
            if self._targets:
                take = min(avail, self._remaining)
                pos = self._start
                left = take
                while left:
                    target = self._targets[0]
                    n = min(left, target.nbytes)
                    target[:n] = self._mv[pos : pos + n]
                    pos += n
                    left -= n
                    if n == target.nbytes:
                        self._targets.popleft()
                    else:
                        self._targets[0] = target[n:]
            else:  # discarding
                take = min(avail, self._remaining)
            self._start += take
            self._remaining -= take
        if self._remaining:
            return False
        if self._end - self._start < 2:
            return False
        if self._buf[self._start : self._start + 2] != CRLF:
            raise ProtocolError("bulk reply not terminated by CRLF")
        self._start += 2
        self._filling = False
        self._complete(self._fill_result)
        landed = getattr(self._fill_sink, "landed", None)
        if landed is not None and isinstance(self._fill_result, int):
            landed(self._fill_result)
        return True

    def _line(self, pos: int) -> tuple[int, bytes, int]:
        """(type byte, line content, position after CRLF) of the line at ``pos``."""
        idx = self._buf.find(CRLF, pos, self._end)
        if idx < 0:
            if self._end - pos > MAX_LINE:
                raise ProtocolError(f"no CRLF within {MAX_LINE} bytes")
            raise _Incomplete
        return self._buf[pos], bytes(self._buf[pos + 1 : idx]), idx + 2

    @staticmethod
    def _int(text: bytes) -> int:
        if not text or not (text.isdigit() or (text[:1] == b"-" and text[1:].isdigit())):
            raise ProtocolError(f"not an integer: {text[:32]!r}")
        return int(text)

    def _bulk_header(self, sink: Sink) -> None:
        kind, text, pos = self._line(self._start)
        if kind == 0x24:  # $
            length = self._int(text)
            self._start = pos
            if length == -1:
                self._complete(None)
                return
            if length < 0:
                raise ProtocolError(f"bulk length {length}")
            views = sink(length)
            self._fill_sink = sink
            self._filling = True
            self._remaining = length
            self._targets.clear()
            if views is None:
                self._fill_result = Discarded(length)
            else:
                flat = [v for v in value_parts(list(views)) if v.nbytes]
                if sum(v.nbytes for v in flat) != length:
                    raise ValueError(f"sink gave {sum(v.nbytes for v in flat)} bytes of memory for a {length}-byte reply")
                self._targets.extend(flat)
                self._fill_result = length
        elif kind == 0x2D:  # -
            self._start = pos
            self._complete(ReplyError(text.decode(errors="replace")))
        else:
            raise ProtocolError(f"expected a bulk reply, got {chr(kind)!r}{text[:32]!r}")

    def _value(self, pos: int) -> tuple[Any, int]:
        """A whole reply from ``pos`` (raises _Incomplete if not all there yet)."""
        kind, text, pos = self._line(pos)
        if kind == 0x2B:  # +
            return text.decode(errors="replace"), pos
        if kind == 0x2D:  # -
            return ReplyError(text.decode(errors="replace")), pos
        if kind == 0x3A:  # :
            return self._int(text), pos
        if kind == 0x24:  # $
            length = self._int(text)
            if length == -1:
                return None, pos
            if length < 0:
                raise ProtocolError(f"bulk length {length}")
            if length > MAX_GENERIC:
                raise ProtocolError(f"bulk reply of {length} bytes without a sink")
            if self._end - pos < length + 2:
                raise _Incomplete
            if self._buf[pos + length : pos + length + 2] != CRLF:
                raise ProtocolError("bulk reply not terminated by CRLF")
            return bytes(self._buf[pos : pos + length]), pos + length + 2
        if kind == 0x2A:  # *
            count = self._int(text)
            if count == -1:
                return None, pos
            if count < 0:
                raise ProtocolError(f"array length {count}")
            items = []
            for _ in range(count):
                item, pos = self._value(pos)
                items.append(item)
            return items, pos
        raise ProtocolError(f"unknown reply type {chr(kind)!r}")
