"""Typed msgpack messages, stream framing and decode limits (DESIGN.md, "Protocol").

Encode and decode one message::

    body = encode(PrefillRequest(request_id="r1", prompt_token_ids=[1, 2], sampling=SamplingSpec(max_tokens=8)))
    req = decode(body, PrefillRequest)          # ProtocolError names any problem

In an aiohttp handler::

    req = await read_message(request, PrefillRequest)   # HTTP 400 with a JSON error on bad input
    return msgpack_response(result)

Streams: ``MessageStreamResponse.send`` on the server, ``async for ev in iter_messages(resp,
TokenEvent)`` on the client. There is no pickle anywhere and msgpack ext types are refused.
"""

from libs.protocol.errors import ErrorCode, ProtocolError, TruncatedStreamError
from libs.protocol.http import (
    INTERNAL_TOKEN_HEADER,
    MSGPACK_CONTENT_TYPE,
    bad_request,
    error_body,
    internal_headers,
    json_error,
    msgpack_response,
    read_message,
    read_response,
)
from libs.protocol.limits import DEFAULT_LIMITS, Limits
from libs.protocol.message import Message, check, decode, encode, from_wire, message_types
from libs.protocol.messages import (
    AbortRequest,
    DecodeRequest,
    DeregisterInstance,
    ErrorMessage,
    HandoffUpdate,
    Heartbeat,
    InstanceAck,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    PromptLogprobs,
    RegisterInstance,
    SamplingSpec,
    StructuredSpec,
    TokenEvent,
    TokenLogprobs,
)
from libs.protocol.stream import MessageStreamResponse, StreamDecoder, iter_messages

__all__ = [
    "DEFAULT_LIMITS",
    "INTERNAL_TOKEN_HEADER",
    "MSGPACK_CONTENT_TYPE",
    "AbortRequest",
    "DecodeRequest",
    "DeregisterInstance",
    "ErrorCode",
    "ErrorMessage",
    "HandoffUpdate",
    "Heartbeat",
    "InstanceAck",
    "Limits",
    "Message",
    "MessageStreamResponse",
    "PrefillProgress",
    "PrefillRequest",
    "PrefillResult",
    "PromptLogprobs",
    "ProtocolError",
    "RegisterInstance",
    "SamplingSpec",
    "StructuredSpec",
    "StreamDecoder",
    "TokenEvent",
    "TokenLogprobs",
    "TruncatedStreamError",
    "bad_request",
    "check",
    "decode",
    "encode",
    "error_body",
    "from_wire",
    "internal_headers",
    "iter_messages",
    "json_error",
    "message_types",
    "msgpack_response",
    "read_message",
    "read_response",
]
