"""Steady load for the chaos matrix: closed-loop clients streaming completions (bench/loadgen.py).

Each client sends one request after another, each a streaming completion of random token
ids with ``ignore_eos`` (bench/loadgen.py's ``HttpTarget``), so every request must end
with exactly ``max_tokens`` tokens and a finish reason. An outcome is one of:

- completed: the whole completion arrived;
- rejected: a 429 (load shedding is allowed; the client backs off ``retry_after_s``);
- failed: anything else, a 5xx, an error event, a stream that ended short, a hang past
  ``timeout_s``, a dropped connection. With ``retry_connection_errors`` (only the row that
  kills the router, the client's own endpoint) a request whose connection failed is sent
  again, as a client would (backing off 0.25 s doubling to 4 s), and counted in
  ``client_retries``; it fails after ``_TRIES`` tries (about 30 s).

The load runs on its own thread and event loop, so a row injects its faults with plain
blocking calls meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from bench.loadgen import HttpStatusError, HttpTarget, Request, StreamError, sse_chunks, workload


_TRIES = 10


@dataclass
class LoadStats:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0  # 429
    client_retries: int = 0
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def add(self, other: "LoadStats") -> None:
        for name in ("sent", "completed", "failed", "rejected", "client_retries"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.latencies_s += other.latencies_s
        self.errors.update(other.errors)


class SteadyLoad:
    def __init__(
        self,
        url: str,
        *,
        concurrency: int,
        prompt_len: str = "uniform:16-96",
        output_len: str = "uniform:12-32",
        seed: int = 0,
        timeout_s: float = 180.0,
        retry_connection_errors: bool = False,
        retry_after_s: float = 0.5,
    ) -> None:
        self.url = url
        self.concurrency = concurrency
        self.requests = workload(4096, prompt_len, output_len, seed)
        self.timeout_s = timeout_s
        self.retry_connection_errors = retry_connection_errors
        self.retry_after_s = retry_after_s
        self.stats = LoadStats()
        self._next = 0
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def start(self) -> "SteadyLoad":
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="chaos-load", daemon=True)
        self._thread.start()
        self._started.wait(30)
        return self

    def stop(self, drain_s: float = 180.0) -> LoadStats:
        """Send nothing new; wait up to ``drain_s`` for requests in flight (then they fail)."""
        assert self._loop is not None and self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(drain_s + 30)
        return self.stats

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        target = await _connect(self.url)
        self._started.set()
        try:
            await asyncio.gather(*(self._client() for _ in range(self.concurrency)))
        finally:
            await target.close()

    async def _client(self) -> None:
        target = await _connect(self.url)
        try:
            while not self._stop.is_set():
                req = self.requests[self._next % len(self.requests)]
                self._next += 1
                await self._one(target, req)
        finally:
            await target.close()

    async def _one(self, target: HttpTarget, req: Request) -> None:
        s = self.stats
        s.sent += 1
        t0 = time.monotonic()
        for attempt in range(_TRIES):
            try:
                res = await asyncio.wait_for(target.send(req), self.timeout_s)
            except HttpStatusError as e:
                if e.status == 429:
                    s.rejected += 1
                    await asyncio.sleep(self.retry_after_s)
                    return
                return self._fail(f"http_{e.status}")
            except StreamError as e:
                return self._fail("stream_error" if "error event" in str(e) else "no_finish")
            except asyncio.TimeoutError:
                return self._fail("timeout")
            except aiohttp.ClientError as e:
                if self.retry_connection_errors and attempt < _TRIES - 1:
                    s.client_retries += 1
                    await asyncio.sleep(min(4.0, 0.25 * 2**attempt))
                    continue
                return self._fail(f"connection:{type(e).__name__}")
            if res.output_tokens != req.max_tokens or res.finish_reason != "length":
                return self._fail("short")
            s.completed += 1
            s.latencies_s.append(time.monotonic() - t0)
            return
        self._fail("retries_exhausted")

    def _fail(self, reason: str) -> None:
        self.stats.failed += 1
        self.stats.errors[reason] += 1


async def _connect(url: str) -> HttpTarget:
    """An ``HttpTarget`` (one connection pool per client); retries until the router answers."""
    for _ in range(600):
        try:
            return await HttpTarget.connect(url)
        except (aiohttp.ClientError, KeyError, IndexError):
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never answered /v1/models")


async def abandon_streams(url: str, clients: int, *, chunks: int = 2, give_up_s: float = 20.0, max_tokens: int = 200) -> dict[str, int]:
    """``clients`` streaming requests at once, each closed by the client after ``chunks``
    chunks (or after ``give_up_s`` without them): clients that go away mid-stream."""
    target = await _connect(url)
    streamed = Counter[str]()

    async def one(i: int) -> None:
        req = target_request(i, max_tokens)
        try:
            async with target.session.post(url + "/v1/completions", json={**req, "model": target.model}) as r:
                if r.status != 200:
                    streamed[f"status_{r.status}"] += 1
                    return
                seen = 0
                async for _ in sse_chunks(r):
                    seen += 1
                    if seen >= chunks:
                        streamed["abandoned_mid_stream"] += 1
                        return  # leaving the block closes the connection
                streamed["finished_before_abandon"] += 1
        except asyncio.TimeoutError:
            streamed["abandoned_before_first_chunk"] += 1

    async def bounded(i: int) -> None:
        try:
            await asyncio.wait_for(one(i), give_up_s)
        except asyncio.TimeoutError:
            streamed["abandoned_before_first_chunk"] += 1
        except aiohttp.ClientError as e:
            streamed[f"connection:{type(e).__name__}"] += 1

    try:
        await asyncio.gather(*(bounded(i) for i in range(clients)))
    finally:
        await target.close()
    return dict(streamed)


def target_request(i: int, max_tokens: int) -> dict:
    """A streaming completion body: prompts long enough for prefill on every other one."""
    prompt = [100 + (i * 7919 + j * 104729) % 40000 for j in range(24 if i % 2 else 48)]
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
