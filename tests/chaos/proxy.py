"""A TCP proxy that adds latency: the "Redis 50 ms away" of the chaos matrix.

Every chunk the upstream sends is delivered ``delay_s`` later, in order (as ``tc netem
delay`` on Redis's host would do): each round trip takes ``delay_s`` longer. Delaying
chunks, not serialising round trips, keeps pipelining intact, as a long network path
would: a pipeline of 16 GETs costs one added delay, not sixteen. The delay
can be changed while connections are open (``set_delay``). ``request_delay_s`` delays the
other direction too: commands reach Redis that much later (the corrupt and evicted block
rows use it to keep a handoff's blocks in Redis long enough to be hit before decode reads
them). A connection the upstream
refuses (Redis down) is closed at once, so clients see the outage as they would without
the proxy. The proxy runs its own event loop on a daemon thread, so synchronous test code
and any asyncio code can use it alike.
"""

from __future__ import annotations

import asyncio
import threading
import time

from services.launch.processes import free_port


class LatencyProxy:
    def __init__(self, upstream_port: int, *, delay_s: float = 0.0, request_delay_s: float = 0.0, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.upstream = (host, upstream_port)
        self.host = host
        self.port = port or free_port(host)
        self.delay_s = delay_s
        self.request_delay_s = request_delay_s
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="latency-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> "LatencyProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, self.host, self.port), self._loop
        ).result(10)
        return self

    def set_delay(self, delay_s: float, request_delay_s: float = 0.0) -> None:
        self.delay_s, self.request_delay_s = delay_s, request_delay_s

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        self.connections += 1
        pumps = [asyncio.create_task(self._pump(client_r, up_w, reply=False)), asyncio.create_task(self._pump(up_r, client_w, reply=True))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the proxy is stopping (a connection handler's end, not an error)
        finally:
            for p in pumps:
                p.cancel()
            for w in (client_w, up_w):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, reply: bool) -> None:
        """Forward chunks in order, each no earlier than its direction's delay after it arrived."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.write_eof() if writer.can_write_eof() else writer.close()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(1 << 16)
                queue.put_nowait((time.monotonic() + (self.delay_s if reply else self.request_delay_s), data))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
