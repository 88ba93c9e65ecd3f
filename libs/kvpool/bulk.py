"""The zero-copy bulk path: block values between Redis sockets and staging memory.

A pipeline of commands goes out with ``sendmsg`` of the iovec list that
:class:`~libs.kvpool.resp.Frames` built (block values are views of staging memory,
never concatenated), and its replies come back through a
:class:`~libs.kvpool.resp.ReplyParser` whose sinks hand out staging memory, so ``recv_into``
lands each value where the codec verifies it in place. What is sent (GETs, SETs, the
bookkeeping scripts) and what the replies mean is the pool's business
(libs/kvpool/redis_pool.py); this module moves bytes and owns the sockets.

Concurrency models (``PoolConfig.bulk_model``), over ``max_parallel`` pooled sockets per node:

- ``"threads"``: blocking sockets driven from worker threads (libs/kvpool/threads.py). ``recv_into`` and ``sendmsg``
  release the GIL, so several pipelines (on several nodes, or several sockets of one)
  move bytes truly in parallel while the event loop stays free. Every return from a
  system call must take the GIL back, which in a busy process (the engine's thread
  launching kernels, other bulk threads) is where the time goes, so a plain TCP or Unix
  socket is truly blocking and the kernel does the waiting: one ``sendmsg`` sends a whole
  pipeline (up to ``IOV_MAX`` buffers), and a payload is received with ``MSG_WAITALL``
  straight into its staging row in one call, instead of one call per segment that
  happened to be there. The inactivity timeout is the kernel's (``SO_RCVTIMEO`` /
  ``SO_SNDTIMEO``: a call that moves no byte for ``socket_timeout_s`` fails with EAGAIN).
  TLS sockets keep Python's timeout mode (no ``MSG_WAITALL`` through OpenSSL).
- ``"asyncio"``: one ``asyncio.BufferedProtocol`` per socket on the event loop:
  ``get_buffer`` is the parser's, so the loop's reads land in staging memory too. Sends
  use ``transport.writelines``; uvloop (which the services run) sends the buffers it is
  given without copying them, the stdlib loop of Python 3.11 joins them first (a copy).

Faults. Every failure of a pipeline raises :class:`TransportError` with a short
``reason`` (``timeout``, ``closed``, ``connect``, ``protocol``, ``auth``) and the replies
that had fully arrived before it, in order, so the caller knows exactly which commands
finished; a reply cut short never counts, and its sink memory holds nothing anyone will
use. A socket that saw any error, or was cancelled mid-pipeline, is closed and never
reused: its next bytes might be the rest of a reply nobody reads. Timeouts are inactivity
timeouts (``socket_timeout_s`` without a byte moving), so a large transfer at any speed
completes and a hung server is detected.

Cancellation is safe for staging memory: when the awaiting task is cancelled, the
socket is shut down (threads) or the transport aborted (asyncio), and the call returns
only once nothing will write into the sinks' memory any more, so the caller may release
or reuse its staging at once.

AUTH (the URL's ``user:password``, or ``PoolConfig.password``), ``SELECT`` of the URL's
database and TLS (``rediss://``, with redis-py's ``ssl_*`` URL parameters) are done on
connect, like redis-py does them. TLS sockets cannot ``sendmsg``: with TLS each buffer
goes out with ``sendall`` (encryption copies anyway).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading
from collections import deque
from typing import Any, Callable, Literal, Sequence

from libs.kvpool.config import BULK_MODELS
from libs.kvpool.header import Buffer
from libs.kvpool.resp import ConnectionClosed, Frames, ProtocolError, ReplyError, ReplyParser, Sink
from libs.kvpool.threads import WorkerThreads
from libs.kvpool.topology import Node

BulkModel = Literal["threads", "asyncio"]
IOV_MAX = 1024  # Linux's limit on buffers per sendmsg
CLIENT_NAME = "tidepool-bulk"


class TransportError(Exception):
    """A pipeline failed; ``replies`` holds those that had fully arrived, in order."""

    def __init__(self, reason: str, message: str, replies: list[Any] | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.replies = replies or []


def tls_context(kwargs: dict[str, Any]) -> ssl.SSLContext:
    """An SSLContext from redis-py's URL parameters (``ssl_cert_reqs``, ``ssl_ca_certs``, ...)."""
    ctx = ssl.create_default_context(cafile=kwargs.get("ssl_ca_certs"), capath=kwargs.get("ssl_ca_path"))
    reqs = kwargs.get("ssl_cert_reqs", "required")
    if reqs in (None, "none", ssl.CERT_NONE):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif reqs in ("optional", ssl.CERT_OPTIONAL):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_OPTIONAL
    if str(kwargs.get("ssl_check_hostname", "")).lower() in ("false", "0", "no"):
        ctx.check_hostname = False
    if kwargs.get("ssl_certfile"):
        ctx.load_cert_chain(kwargs["ssl_certfile"], kwargs.get("ssl_keyfile"), kwargs.get("ssl_password"))
    return ctx


class Endpoint:
    """How to open and greet a connection: node address, TLS, AUTH, database."""

    def __init__(self, node: Node, kwargs: dict[str, Any], *, tls: bool, connect_timeout_s: float, socket_timeout_s: float) -> None:
        self.node = node
        self.tls = tls_context(kwargs) if tls else None
        self.connect_timeout_s = connect_timeout_s
        self.socket_timeout_s = socket_timeout_s
        hello = Frames()
        password, username = kwargs.get("password"), kwargs.get("username")
        if password is not None:
            hello.command("AUTH", *([username] if username else []), password)
        if kwargs.get("db", 0):
            hello.command("SELECT", int(kwargs["db"]))
        hello.command("CLIENT", "SETNAME", CLIENT_NAME)
        self.hello = b"".join(bytes(b) for b in hello.finish())
        self.hello_replies = hello.commands

    def check_hello(self, replies: list[Any]) -> None:
        # The last reply is CLIENT SETNAME's: a name is a courtesy (an ACL may forbid it).
        for r in replies[:-1]:
            if isinstance(r, ReplyError):
                # Never echo the command: it holds the password.
                raise TransportError("auth", f"{self.node} refused the connection handshake: {r.code}")


class _BlockingConnection:
    """A blocking socket, used by one worker thread at a time."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.parser = ReplyParser()
        self.sock: socket.socket | None = None
        self.broken = False
        self._waitall = 0  # MSG_WAITALL on a kernel-blocking socket, 0 on a TLS one
        self.syscalls = 0  # sends and receives, for the client's counters
        self._lock = threading.Lock()

    def _connect(self) -> None:
        ep = self.endpoint
        node = ep.node
        if node.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(ep.connect_timeout_s)
            sock.connect(node.path)
        else:
            sock = socket.create_connection((node.host, node.port), timeout=ep.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if ep.tls is not None:
                sock = ep.tls.wrap_socket(sock, server_hostname=node.host or None)
                sock.settimeout(ep.socket_timeout_s)
            else:
                sock.settimeout(None)  # blocking: the kernel waits, with its own timeouts
                secs = int(ep.socket_timeout_s)
                timeval = struct.pack("ll", secs, int((ep.socket_timeout_s - secs) * 1e6))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                self._waitall = socket.MSG_WAITALL
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.sock = sock
            if self.broken:  # aborted while connecting
                raise ConnectionClosed("aborted")
        self.parser.expect_many([None] * ep.hello_replies)
        self._send([ep.hello])
        ep.check_hello(self._receive())

    def exchange(self, iov: Sequence[Buffer], sinks: Sequence[Sink | None], seals: Sequence[Callable[[], object]] = ()) -> list[Any]:
        """Seal the pending values (checksums, here on this thread), send ``iov``, then read
        one reply per sink. Raises TransportError (and closes) on any failure."""
        for seal in seals:
            seal()
        try:
            if self.sock is None:
                try:
                    self._connect()
                except TransportError:
                    raise
                except (OSError, ConnectionClosed, TimeoutError) as exc:
                    raise _connect_error(exc, self.endpoint.node) from exc
            self.parser.expect_many(sinks)
            self._send(iov)
            return self._receive()
        except TransportError as exc:
            exc.replies = self.parser.take() if not exc.replies else exc.replies
            self.close()
            raise
        except BaseException as exc:
            replies = self.parser.take()
            self.close()
            raise _classify(exc, self.endpoint.node, replies) from exc

    def _send(self, iov: Sequence[Buffer]) -> None:
        sock = self.sock
        assert sock is not None
        if isinstance(sock, ssl.SSLSocket):
            for buf in iov:
                sock.sendall(buf)
                self.syscalls += 1
            return
        views = deque(memoryview(b).cast("B") if memoryview(b).format != "B" else memoryview(b) for b in iov)
        while views:
            batch = [views[i] for i in range(min(IOV_MAX, len(views)))]
            sent = sock.sendmsg(batch)  # blocking: all of the batch, unless cut by SO_SNDTIMEO
            self.syscalls += 1
            while sent:
                head = views[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    views.popleft()
                else:
                    views[0] = head[sent:]
                    sent = 0

    def _receive(self) -> list[Any]:
        sock, parser, waitall = self.sock, self.parser, self._waitall
        assert sock is not None
        while parser.pending:
            buf = parser.get_buffer()
            # A payload's memory is waited for whole (one call, one GIL round trip); other
            # reads take what is there (a reply's length decides what follows).
            parser.feed(sock.recv_into(buf, 0, waitall if parser.direct else 0))
            self.syscalls += 1
        return parser.take()

    def abort(self) -> None:
        """From another thread: make a blocked send or receive return now."""
        with self._lock:
            self.broken = True
            sock = self.sock
        if sock is not None:
            try:
                # The plain socket's shutdown: an SSLSocket's own would tear down its TLS
                # state under the thread still using it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.broken = True
        with self._lock:
            sock, self.sock = self.sock, None
        self.parser.reset()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class _ProtocolConnection(asyncio.BufferedProtocol):
    """A socket on the event loop whose reads go through the parser's buffers."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.parser = ReplyParser()
        self.transport: asyncio.Transport | None = None
        self.broken = False
        self.progress = 0
        self.syscalls = 0  # reads (buffer_updated) and writes, for the client's counters
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    # -- protocol callbacks ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.parser.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.progress += nbytes
        self.syscalls += 1
        try:
            self.parser.feed(nbytes)
        except BaseException as exc:  # noqa: BLE001 - the waiter re-raises it
            self._fail(exc)
            return
        if self._waiter is not None and not self.parser.pending and not self._waiter.done():
            self._waiter.set_result(None)

    def eof_received(self) -> bool:
        self._fail(ConnectionClosed("server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionClosed("connection lost"))

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        if self._error is None:
            self._error = exc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    # -- the caller's side --------------------------------------------------------------------

    async def _connect(self) -> None:
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        node = ep.node
        async with asyncio.timeout(ep.connect_timeout_s):
            if node.path is not None:
                await loop.create_unix_connection(lambda: self, node.path)
            else:
                await loop.create_connection(
                    lambda: self, node.host, node.port, ssl=ep.tls, server_hostname=node.host if ep.tls else None
                )
                sock = self.transport.get_extra_info("socket") if self.transport is not None else None
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ep.check_hello(await self._roundtrip([ep.hello], [None] * ep.hello_replies))

    async def _roundtrip(self, iov: Sequence[Buffer], sinks: Sequence[Sink | None]) -> list[Any]:
        if self.broken or self.transport is None:
            raise ConnectionClosed("connection is closed") from self._error
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        self.parser.expect_many(sinks)
        self.transport.writelines(iov)
        self.syscalls += 1
        try:
            while not waiter.done():
                before = self.progress
                await asyncio.wait({waiter}, timeout=self.endpoint.socket_timeout_s)
                if not waiter.done() and self.progress == before:
                    raise TimeoutError(f"no reply byte for {self.endpoint.socket_timeout_s}s")
            waiter.result()
        finally:
            self._waiter = None
            if not waiter.done():
                waiter.cancel()
        return self.parser.take()

    async def exchange(self, iov: Sequence[Buffer], sinks: Sequence[Sink | None]) -> list[Any]:
        try:
            if self.transport is None:
                try:
                    await self._connect()
                except TransportError:
                    raise
                except (OSError, ConnectionClosed, TimeoutError) as exc:
                    raise _connect_error(exc, self.endpoint.node) from exc
            return await self._roundtrip(iov, sinks)
        except TransportError as exc:
            exc.replies = exc.replies or self.parser.take()
            self.close()
            raise
        except BaseException as exc:
            replies = self.parser.take()
            self.close()  # cancelled or failed mid-pipeline: no further read lands in a sink
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            raise _classify(exc, self.endpoint.node, replies) from exc

    def close(self) -> None:
        self.broken = True
        if self.transport is not None:
            self.transport.abort()
        self.parser.reset()


def _timed_out(exc: BaseException) -> bool:
    # BlockingIOError: EAGAIN from a blocking socket's SO_RCVTIMEO / SO_SNDTIMEO.
    return isinstance(exc, (TimeoutError, socket.timeout, BlockingIOError))


def _connect_error(exc: BaseException, node: Node) -> TransportError:
    """A failed connect or handshake: ``timeout`` if the server went silent, else ``connect``."""
    reason = "timeout" if _timed_out(exc) else "connect"
    return TransportError(reason, f"{node}: connecting: {type(exc).__name__}: {exc}")


def _classify(exc: BaseException, node: Node, replies: list[Any]) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    if _timed_out(exc):
        reason = "timeout"
    elif isinstance(exc, ProtocolError):
        reason = "protocol"
    elif isinstance(exc, (ConnectionClosed, OSError, ssl.SSLError)):
        reason = "closed"
    else:
        reason = "error"
    return TransportError(reason, f"{node}: {type(exc).__name__}: {exc}", replies)


class _NodeSockets:
    """At most ``size`` sockets to one node; idle ones are reused, broken ones dropped."""

    def __init__(self, endpoint: Endpoint, size: int, factory: Callable[[Endpoint], Any]) -> None:
        self.endpoint = endpoint
        self.idle: list[Any] = []
        self.busy: set[Any] = set()
        self._gate = asyncio.Semaphore(size)
        self._factory = factory

    async def acquire(self) -> Any:
        await self._gate.acquire()
        conn = self.idle.pop() if self.idle else self._factory(self.endpoint)
        self.busy.add(conn)
        return conn

    def release(self, conn: Any) -> None:
        self.busy.discard(conn)
        if conn.broken:
            conn.close()
        else:
            self.idle.append(conn)
        self._gate.release()

    def drop_idle(self) -> None:
        """Close the idle sockets: after one failed, the others are suspect too (a restarted
        or killed server takes all of them), and a retry should not spend itself on them."""
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        for conn in self.idle + list(self.busy):
            conn.close()
        self.idle.clear()

    @property
    def open(self) -> int:
        return len(self.idle) + len(self.busy)


class BulkClient:
    """Pipelines of block transfers to any node, over pooled sockets (module docstring).

    Must be used from one event loop. ``endpoint(node)`` builds how to reach a node (the
    pool passes one that carries the URL's AUTH, db and TLS settings).
    """

    def __init__(
        self,
        endpoint: Callable[[Node], Endpoint],
        *,
        model: BulkModel = "threads",
        sockets_per_node: int = 4,
        threads: int = 32,
    ) -> None:
        if model not in BULK_MODELS:
            raise ValueError(f"bulk model must be one of {BULK_MODELS}, got {model!r}")
        self.model = model
        self._endpoint = endpoint
        self._size = sockets_per_node
        self._nodes: dict[Node, _NodeSockets] = {}
        self._executor = WorkerThreads(threads, "kvpool-bulk") if model == "threads" else None
        self._closed = False
        # syscalls: sends and receives (asyncio: reads and writelines), how often a transfer
        # goes back for the GIL; bench/pool_throughput.py reports them per MB.
        self.counters = {"pipelines": 0, "failures": 0, "bytes_sent": 0, "syscalls": 0}

    def _sockets(self, node: Node) -> _NodeSockets:
        pool = self._nodes.get(node)
        if pool is None:
            factory = _BlockingConnection if self.model == "threads" else _ProtocolConnection
            pool = _NodeSockets(self._endpoint(node), self._size, factory)
            self._nodes[node] = pool
        return pool

    @property
    def open_sockets(self) -> int:
        return sum(p.open for p in self._nodes.values())

    async def exchange(self, node: Node, frames: Frames, sinks: Sequence[Sink | None]) -> list[Any]:
        """Send ``frames`` to ``node`` and return one reply per sink, or raise :class:`TransportError`."""
        if self._closed:
            raise TransportError("closed", "bulk client is closed")
        if len(sinks) != frames.commands:
            raise ValueError(f"{len(sinks)} sinks for {frames.commands} commands")
        iov = frames.finish()
        pool = self._sockets(node)
        conn = await pool.acquire()
        self.counters["pipelines"] += 1
        self.counters["bytes_sent"] += frames.nbytes
        try:
            if self._executor is None:
                for seal in frames.seals:  # on the loop: hashing a pipeline's values (~15 us a block)
                    seal()
                return await conn.exchange(iov, sinks)
            return await _in_thread(self._executor, conn, lambda: conn.exchange(iov, sinks, frames.seals))
        except TransportError:
            self.counters["failures"] += 1
            pool.drop_idle()
            raise
        finally:
            self.counters["syscalls"] += conn.syscalls
            conn.syscalls = 0
            pool.release(conn)

    async def close(self) -> None:
        self._closed = True
        nodes, self._nodes = list(self._nodes.values()), {}
        for pool in nodes:
            pool.close()
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)


async def _in_thread(executor: WorkerThreads, conn: _BlockingConnection, fn: Callable[[], list[Any]]) -> list[Any]:
    """Run ``fn`` on the pool; if cancelled, abort the socket and wait until ``fn`` is out."""
    fut = executor.submit(fn)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        conn.abort()
        await settle(fut)
        raise


async def settle(fut: "asyncio.Future[Any]") -> None:
    """Wait until ``fut`` is done, through any number of cancellations of the caller.

    For code that must not return while an operation still touches memory it is about to
    give back (staging). The outcome is left in ``fut`` (retrieved, so it never warns).
    """
    while not fut.done():
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            continue
    if not fut.cancelled():
        fut.exception()
