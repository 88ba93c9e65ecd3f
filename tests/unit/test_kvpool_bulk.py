"""The bulk transport against a fake Redis that misbehaves on cue: faults a real server
cannot be made to produce on demand (a value cut in the middle, garbage, silence, a slow
trickle while the caller gives up). Every one must end as a TransportError with a reason,
the finished replies, a closed socket, and no write into caller memory afterwards.
Both concurrency models run every test."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from typing import Callable

import numpy as np
import pytest
import xxhash

from libs.kvpool.bulk import BulkClient, Endpoint, TransportError
from libs.kvpool.header import HEADER_NBYTES, PendingValue
from libs.kvpool.resp import Frames
from libs.kvpool.topology import Node

Script = Callable[[socket.socket, Callable[[], list[bytes]]], None]


class FakeRedis:
    """A TCP server that answers the bulk client's handshake, then runs ``script`` per connection."""

    def __init__(self, script: Script, *, handshake_reply: bytes = b"+OK\r\n") -> None:
        self.script = script
        self.handshake_reply = handshake_reply
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        rfile = conn.makefile("rb")

        def read_command() -> list[bytes]:
            head = rfile.readline()
            if not head.startswith(b"*"):
                raise ConnectionError(f"not a command: {head!r}")
            args = []
            for _ in range(int(head[1:])):
                size = int(rfile.readline()[1:])
                args.append(rfile.read(size + 2)[:-2])
            return args

        try:
            with conn:
                while True:  # AUTH / SELECT / CLIENT SETNAME
                    cmd = read_command()
                    conn.sendall(self.handshake_reply if cmd[0].upper() == b"AUTH" else b"+OK\r\n")
                    if cmd[0].upper() == b"CLIENT":
                        break
                self.script(conn, read_command)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


def endpoint(port: int, **kwargs: object) -> Callable[[Node], Endpoint]:
    return lambda node: Endpoint(node, dict(kwargs), tls=False, connect_timeout_s=1.0, socket_timeout_s=0.5)


def gets(n: int) -> Frames:
    frames = Frames()
    for i in range(n):
        frames.command("GET", f"k{i}")
    return frames


def into(dests: list[np.ndarray]):
    def sink(n: int):
        arr = np.zeros(n, dtype=np.uint8)
        dests.append(arr)
        return [memoryview(arr)]

    return sink


@pytest.fixture(params=["threads", "asyncio"])
def model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def servers():
    made: list[FakeRedis] = []

    def make(script: Script, **kw: object) -> FakeRedis:
        server = FakeRedis(script, **kw)  # type: ignore[arg-type]
        made.append(server)
        return server

    yield make
    for s in made:
        s.close()


VALUES = [np.random.default_rng(i).integers(0, 255, 200_000, dtype=np.uint8).tobytes() for i in range(3)]


def answer_values(conn: socket.socket, read: Callable[[], list[bytes]]) -> None:
    while True:
        for v in VALUES:
            read()
            conn.sendall(b"$%d\r\n" % len(v) + v + b"\r\n")


async def test_values_land_in_the_sinks_and_the_socket_is_reused(servers, model: str) -> None:
    server = servers(answer_values)
    client = BulkClient(endpoint(server.port), model=model, sockets_per_node=1)
    node = Node("127.0.0.1", server.port)
    for _ in range(2):
        dests: list[np.ndarray] = []
        replies = await client.exchange(node, gets(3), [into(dests)] * 3)
        assert replies == [len(v) for v in VALUES]
        assert [d.tobytes() for d in dests] == VALUES
    assert server.connections == 1 and client.open_sockets == 1
    await client.close()


async def test_pending_values_are_sealed_by_the_sender_before_they_go_out(servers, model: str) -> None:
    got: list[bytes] = []

    def store(conn: socket.socket, read: Callable[[], list[bytes]]) -> None:
        while True:
            got.append(read()[2])
            conn.sendall(b"+OK\r\n")

    server = servers(store)
    client = BulkClient(endpoint(server.port), model=model, sockets_per_node=1)
    payload = np.random.default_rng(5).integers(0, 255, 100_000, dtype=np.uint8)
    pending = PendingValue(memoryview(bytearray(HEADER_NBYTES)), [memoryview(payload)])
    assert await client.exchange(Node("127.0.0.1", server.port), Frames().command("SET", "k", pending), [None]) == ["OK"]
    assert got == [struct.pack("<16xQ", xxhash.xxh3_64_intdigest(payload)) + payload.tobytes()]
    await client.close()


async def test_a_value_cut_short_fails_with_the_finished_replies_and_closes(servers, model: str) -> None:
    def cut(conn: socket.socket, read: Callable[[], list[bytes]]) -> None:
        read(), read(), read()
        conn.sendall(b"$%d\r\n" % len(VALUES[0]) + VALUES[0] + b"\r\n")
        conn.sendall(b"$%d\r\n" % len(VALUES[1]) + VALUES[1][:50_000])  # then close mid-value

    server = servers(cut)
    client = BulkClient(endpoint(server.port), model=model)
    dests: list[np.ndarray] = []
    with pytest.raises(TransportError) as info:
        await client.exchange(Node("127.0.0.1", server.port), gets(3), [into(dests)] * 3)
    assert info.value.reason == "closed"
    assert info.value.replies == [len(VALUES[0])]  # the first landed whole; the second never counts
    assert dests[0].tobytes() == VALUES[0]
    assert client.open_sockets == 0  # never reused mid-reply
    await client.close()


async def test_garbage_is_a_protocol_error(servers, model: str) -> None:
    def garbage(conn: socket.socket, read: Callable[[], list[bytes]]) -> None:
        read()
        conn.sendall(b"%\x00\xffnot resp at all\r\n")
        time.sleep(1)

    server = servers(garbage)
    client = BulkClient(endpoint(server.port), model=model)
    with pytest.raises(TransportError) as info:
        await client.exchange(Node("127.0.0.1", server.port), gets(1), [into([])])
    assert info.value.reason == "protocol" and client.open_sockets == 0
    await client.close()


async def test_a_silent_server_is_a_timeout_not_a_hang(servers, model: str) -> None:
    server = servers(lambda conn, read: (read(), time.sleep(3)))
    client = BulkClient(endpoint(server.port), model=model)
    start = time.monotonic()
    with pytest.raises(TransportError) as info:
        await client.exchange(Node("127.0.0.1", server.port), gets(1), [into([])])
    assert info.value.reason == "timeout"
    assert time.monotonic() - start < 2.0  # socket_timeout_s is 0.5
    assert client.open_sockets == 0
    await client.close()


async def test_a_refused_password_is_auth_and_never_echoed(servers, model: str) -> None:
    server = servers(answer_values, handshake_reply=b"-WRONGPASS invalid username-password pair\r\n")
    client = BulkClient(endpoint(server.port, password="hunter2"), model=model)
    with pytest.raises(TransportError) as info:
        await client.exchange(Node("127.0.0.1", server.port), gets(1), [into([])])
    assert info.value.reason == "auth" and "hunter2" not in str(info.value)
    await client.close()


async def test_nobody_listening_is_connect(model: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = BulkClient(endpoint(port), model=model)
    with pytest.raises(TransportError) as info:
        await client.exchange(Node("127.0.0.1", port), gets(1), [into([])])
    assert info.value.reason == "connect"
    await client.close()


async def test_cancelled_mid_value_nothing_writes_into_the_sink_afterwards(servers, model: str) -> None:
    value = np.random.default_rng(7).integers(1, 255, 1 << 20, dtype=np.uint8).tobytes()

    def trickle(conn: socket.socket, read: Callable[[], list[bytes]]) -> None:
        read()
        conn.sendall(b"$%d\r\n" % len(value))
        for i in range(0, len(value), 8192):
            conn.sendall(value[i : i + 8192])
            time.sleep(0.002)

    server = servers(trickle)
    client = BulkClient(endpoint(server.port), model=model)
    dest = np.zeros(len(value), dtype=np.uint8)
    task = asyncio.ensure_future(client.exchange(Node("127.0.0.1", server.port), gets(1), [lambda n: [memoryview(dest)]]))
    while not dest[100_000:].any():  # the value is arriving
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snapshot = dest.copy()
    await asyncio.sleep(0.3)  # the server keeps sending
    assert np.array_equal(dest, snapshot), "bytes landed in the sink after the cancelled call returned"
    assert not dest[-8192:].any()  # it was cut mid-value
    assert client.open_sockets == 0
    await client.close()
