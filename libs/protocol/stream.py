"""Message streams: a chunked HTTP body of consecutive msgpack messages.

The writer (:class:`MessageStreamResponse`) sends one message per HTTP chunk. The reader
does not rely on that: TCP and proxies may split or merge chunks, so
:class:`StreamDecoder` reassembles messages from arbitrary byte pieces with
``msgpack.Unpacker.feed`` and :func:`iter_messages` feeds it from an aiohttp response.

Each message of a stream is bounded by ``Limits.max_body_bytes``; the stream as a whole is
not (a long generation is a long stream). A stream that ends inside a message, or whose
connection breaks before the chunked body is complete, raises
:class:`TruncatedStreamError`: the peer died mid-stream. Whether the last complete message
was the final one (e.g. a :class:`TokenEvent` with a ``finish_reason``) is for the caller to
check, since only it knows what "final" means.
"""

from __future__ import annotations

from typing import AsyncIterator, Generic, Mapping, TypeVar, overload

import aiohttp
import msgpack
from aiohttp import web

from libs.protocol.errors import ErrorCode, ProtocolError, TruncatedStreamError
from libs.protocol.http import MSGPACK_CONTENT_TYPE, check_content_type
from libs.protocol.limits import DEFAULT_LIMITS, Limits, unpack_error
from libs.protocol.message import Message, encode, from_wire

M = TypeVar("M", bound=Message)


class StreamDecoder(Generic[M]):
    """Incremental decoder: feed bytes in pieces of any size, get whole typed messages.

    After an error the decoder is broken (the byte stream has lost its framing) and
    every further call raises the same error.
    """

    def __init__(self, expected: type[M] | None = None, *, limits: Limits = DEFAULT_LIMITS) -> None:
        self._expected = expected
        self._limits = limits
        self._unpacker = msgpack.Unpacker(max_buffer_size=limits.max_body_bytes, **limits.unpack_options())
        self._fed = 0  # bytes fed so far
        self._boundary = 0  # stream offset where the current (incomplete) message starts
        self._error: ProtocolError | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[M]:
        """Add bytes; return the messages they complete, in order."""
        if self._error is not None:
            raise self._error
        try:
            return self._feed(memoryview(data))
        except ProtocolError as exc:
            self._error = exc
            raise

    def _feed(self, view: memoryview) -> list[M]:
        limit = self._limits.max_body_bytes
        out: list[M] = []
        # Feed at most what keeps the pending message within the limit, then drain, so one
        # network chunk holding many small messages never trips the buffer limit.
        while view:
            room = limit - (self._fed - self._boundary)
            if room <= 0:
                raise ProtocolError(ErrorCode.TOO_LARGE, f"stream message exceeds {limit} bytes")
            piece, view = view[:room], view[room:]
            self._unpacker.feed(piece)
            self._fed += len(piece)
            self._drain(out)
        return out

    def _drain(self, out: list[M]) -> None:
        while True:
            try:
                obj = next(self._unpacker)
            except StopIteration:
                return
            except (ValueError, msgpack.exceptions.UnpackException) as exc:
                raise unpack_error(exc) from None
            self._boundary = self._unpacker.tell()
            out.append(from_wire(obj, self._expected, limits=self._limits))

    @property
    def pending_bytes(self) -> int:
        """Bytes of a message received only in part."""
        return self._fed - self._boundary

    def finish(self) -> None:
        """Declare the end of the stream; raise if it ended inside a message."""
        if self._error is not None:
            raise self._error
        if self.pending_bytes:
            self._error = TruncatedStreamError(f"stream ended inside a message ({self.pending_bytes} bytes pending)")
            raise self._error


@overload
def iter_messages(
    response: aiohttp.ClientResponse, expected: type[M], *, limits: Limits = ...
) -> AsyncIterator[M]: ...
@overload
def iter_messages(
    response: aiohttp.ClientResponse, expected: None = None, *, limits: Limits = ...
) -> AsyncIterator[Message]: ...
async def iter_messages(
    response: aiohttp.ClientResponse,
    expected: type[Message] | None = None,
    *,
    limits: Limits = DEFAULT_LIMITS,
) -> AsyncIterator[Message]:
    """Yield the messages of a streamed response as they arrive.

    Check ``response.status`` first: an error answer is JSON, and this raises
    ``bad_content_type`` for it. Raises :class:`TruncatedStreamError` when the peer dies
    mid-stream and :class:`ProtocolError` on anything malformed or over the limits.
    """
    check_content_type(response.content_type, status=response.status)
    decoder: StreamDecoder[Message] = StreamDecoder(expected, limits=limits)
    try:
        async for chunk in response.content.iter_any():
            for message in decoder.feed(chunk):
                yield message
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
        raise TruncatedStreamError(f"connection broke mid-stream: {exc}") from exc
    decoder.finish()


class MessageStreamResponse(web.StreamResponse):
    """A chunked ``application/msgpack`` response that sends one message per chunk::

        stream = MessageStreamResponse()
        await stream.prepare(request)
        async for event in events:
            await stream.send(event)
        await stream.write_eof()
        return stream
    """

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status=status, headers=headers)
        self.content_type = MSGPACK_CONTENT_TYPE
        self.enable_chunked_encoding()

    async def send(self, message: Message) -> None:
        """Encode and write ``message`` as one chunk (waits for the transport to drain)."""
        await self.write(encode(message))
