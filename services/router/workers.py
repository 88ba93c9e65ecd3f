"""Talking to prefill, decode and cache_store: one pooled HTTP session, typed failures.

Every way a call can fail becomes a :class:`WorkerError` whose ``reason`` is a short,
bounded label (``connect``, ``timeout``, ``status_503``, ``truncated``, ...). The request
path decides what a failure costs (fall back to decode-only, resume elsewhere); this module
only says what happened. Aborts are fire-and-forget but tracked, so a request being
cancelled still gets its ``AbortRequest`` out, and shutdown waits for them briefly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Iterator

import aiohttp

from libs.blocks import NamespaceRoot, block_keys
from libs.protocol import (
    MSGPACK_CONTENT_TYPE,
    ProtocolError,
    TruncatedStreamError,
    encode,
    internal_headers,
    iter_messages,
)
from libs.protocol.messages import (
    AbortRequest,
    DecodeRequest,
    HandoffUpdate,
    PrefillProgress,
    PrefillRequest,
    PrefillResult,
    TokenEvent,
)
from services.router.settings import RouterSettings

log = logging.getLogger("tidepool.router.workers")

_HEADERS = {"Content-Type": MSGPACK_CONTENT_TYPE}
_ABORT_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


class WorkerError(Exception):
    """A call to an instance failed; ``reason`` is a metric-safe label, ``detail`` for logs."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _status_error(status: int, body: bytes) -> WorkerError:
    detail = body[:300].decode("utf-8", "replace")
    try:
        detail = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return WorkerError(f"status_{status}", detail)


@contextmanager
def _failures(timeout: str) -> Iterator[None]:
    """Translate what a call to an instance can raise into :class:`WorkerError`."""
    try:
        yield
    except TruncatedStreamError as exc:
        raise WorkerError("truncated", str(exc)) from None
    except asyncio.TimeoutError:
        raise WorkerError("timeout", timeout) from None
    except aiohttp.ClientError as exc:
        raise WorkerError("connect", str(exc)) from None
    except ProtocolError as exc:
        raise WorkerError("protocol", str(exc)) from None


class WorkerClient:
    """The router's HTTP client for instances and the pool; one per app."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        # No connection cap: every running decode stream holds one connection. Every call
        # carries the internal token, when there is one.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=internal_headers(settings.internal_token)
        )
        self._background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        await self.session.close()

    async def prefill(self, url: str, req: PrefillRequest) -> AsyncIterator[PrefillProgress | PrefillResult]:
        """Prefill's answer as messages: ``PrefillProgress`` events (with
        ``stream_progress``), then the ``PrefillResult``; a plain answer is a stream of one.
        The whole answer must come within ``prefill_timeout_s``."""
        timeout = aiohttp.ClientTimeout(total=self.settings.prefill_timeout_s)
        with _failures(f"no PrefillResult within {self.settings.prefill_timeout_s} s"):
            async with self.session.post(url + "/v1/prefill", data=encode(req), headers=_HEADERS, timeout=timeout) as resp:
                if resp.status != 200:
                    raise _status_error(resp.status, await resp.read())
                async for msg in iter_messages(resp):
                    if not isinstance(msg, (PrefillProgress, PrefillResult)):
                        raise WorkerError("protocol", f"prefill sent a {msg.TYPE}")
                    yield msg

    async def handoff_update(self, url: str, update: HandoffUpdate) -> None:
        """Post one ``HandoffUpdate`` to a decode instance (a streamed handoff)."""
        timeout = aiohttp.ClientTimeout(total=self.settings.decode_connect_timeout_s)
        with _failures("decode did not take the handoff update in time"):
            async with self.session.post(url + "/v1/handoff", data=encode(update), headers=_HEADERS, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise _status_error(resp.status, body)

    @asynccontextmanager
    async def decode(self, url: str, req: DecodeRequest) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        """Open a decode stream; the body yields its events. Leaving the block early closes
        the connection, which decode takes as an abort."""
        s = self.settings
        timeout = aiohttp.ClientTimeout(
            total=None, connect=s.decode_connect_timeout_s, sock_read=s.decode_read_timeout_s
        )
        with _failures("decode did not connect or answer in time"):
            resp = await self.session.post(url + "/v1/decode", data=encode(req), headers=_HEADERS, timeout=timeout)
        try:
            if resp.status != 200:
                raise _status_error(resp.status, await resp.read())
            yield self._events(resp)
        finally:
            resp.close()

    async def _events(self, resp: aiohttp.ClientResponse) -> AsyncIterator[TokenEvent]:
        with _failures(f"decode stream silent for {self.settings.decode_read_timeout_s} s"):
            async for event in iter_messages(resp, TokenEvent):
                yield event

    def abort(self, url: str, request_id: str) -> None:
        """Send ``AbortRequest`` in the background; it survives the caller's cancellation."""
        task = asyncio.get_running_loop().create_task(self._abort(url, request_id), name=f"abort {request_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, url: str, request_id: str) -> None:
        body = encode(AbortRequest(request_id=request_id))
        try:
            async with self.session.post(url + "/v1/abort", data=body, headers=_HEADERS, timeout=_ABORT_TIMEOUT) as resp:
                await resp.read()
                if resp.status >= 400:
                    log.info("abort of %s at %s answered %d", request_id, url, resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.info("abort of %s at %s failed: %r", request_id, url, exc)

    async def pool_has_all(self, root: NamespaceRoot, prompt: list[int]) -> tuple[bool, list[str], dict[str, Any]]:
        """Ask cache_store whether every block of ``prompt`` is in the pool.

        Returns (all present, the prompt's keys, what to record in the trace). Any failure
        is "no": the request is prefilled as usual, never failed.
        """
        keys = [str(k) for k in block_keys(root, prompt)]
        note: dict[str, Any] = {"keys": len(keys)}
        url = (self.settings.cache_store_url or "").rstrip("/") + "/v1/blocks/query"
        timeout = aiohttp.ClientTimeout(total=self.settings.cache_store_timeout_s)
        try:
            async with self.session.post(url, json={"namespace": root.hex, "keys": keys, "prefix_only": True}, timeout=timeout) as resp:
                if resp.status != 200:
                    raise _status_error(resp.status, await resp.read())
                body = await resp.json()
            prefix = body["prefix"]
            if type(prefix) is not int:
                raise WorkerError("protocol", f"'prefix' is {type(prefix).__name__}")
        except WorkerError as exc:
            note["error"] = exc.reason
            log.info("pool query failed (%s); prefilling", exc)
            return False, keys, note
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            note["error"] = type(exc).__name__
            log.info("pool query failed (%r); prefilling", exc)
            return False, keys, note
        note["present"] = prefix
        return bool(keys) and prefix >= len(keys), keys, note
