"""A load generator: concurrent streaming requests, TTFT / TPOT percentiles and throughput.

Two targets, driven by the same workload so they can be compared in one run:

- ``HttpTarget``: an OpenAI-compatible endpoint (the router), streaming completions with
  token-id prompts (``ignore_eos`` so every request produces exactly its output length);
- ``EngineTarget``: the engine in this process (``AsyncEngine``), no HTTP, no handoff.

A workload is a seeded list of (prompt length, output length) pairs drawn from the given
distributions (``fixed:N``, ``uniform:A-B``); prompts are random token ids, distinct per
request so no prefix is shared by accident.

    python -m bench.loadgen --url http://127.0.0.1:8000 --concurrency 16 --requests 64 \\
        --prompt-len uniform:128-512 --output-len uniform:64-128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import aiohttp


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


class HttpStatusError(RuntimeError):
    """The server answered with an error status (a 429 is load shedding, not a failure)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class StreamError(RuntimeError):
    """The stream carried an error event, or ended without its final chunk."""


@dataclass
class Result:
    ttft_s: float
    token_times: list[float] = field(default_factory=list)  # arrival of each token (s since send)
    output_tokens: int = 0
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.ttft_s) / (self.output_tokens - 1)


def distribution(spec: str, rng: random.Random) -> int:
    kind, _, arg = spec.partition(":")
    if kind == "fixed":
        return int(arg)
    if kind == "uniform":
        lo, hi = (int(x) for x in arg.split("-"))
        return rng.randint(lo, hi)
    raise ValueError(f"unknown distribution {spec!r} (fixed:N or uniform:A-B)")


def workload(n: int, prompt_len: str, output_len: str, seed: int = 0, vocab: int = 49152) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        p = distribution(prompt_len, rng)
        reqs.append(Request([rng.randrange(100, vocab) for _ in range(p)], distribution(output_len, rng)))
    return reqs


async def sse_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI server-sent-event stream, up to ``[DONE]``."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


class Target(Protocol):
    async def send(self, req: Request) -> Result: ...


class HttpTarget:
    """``extra``: more body fields for every request (e.g. ``{"tidepool": {"stream_handoff": False}}``)."""

    def __init__(self, url: str, model: str, session: aiohttp.ClientSession, extra: dict | None = None):
        self.url, self.model, self.session, self.extra = url.rstrip("/"), model, session, extra or {}

    @classmethod
    async def connect(cls, url: str, extra: dict | None = None) -> "HttpTarget":
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=aiohttp.TCPConnector(limit=0))
        async with session.get(url.rstrip("/") + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        return cls(url, model, session, extra)

    async def send(self, req: Request) -> Result:
        body = {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}, **self.extra}
        t0 = time.perf_counter()
        res = Result(ttft_s=float("nan"))
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise HttpStatusError(r.status, await r.text())
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    raise StreamError(f"error event: {chunk['error']}")
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    if choice.get("text"):
                        now = time.perf_counter() - t0
                        if not res.token_times:
                            res.ttft_s = now
                        res.token_times.append(now)
        if res.finish_reason is None:
            raise StreamError("the stream ended without a finish reason")
        # A text chunk can carry several tokens: the count comes from the usage chunk.
        return res

    async def close(self) -> None:
        await self.session.close()


class EngineTarget:
    def __init__(self, engine) -> None:
        from libs.engine.async_engine import AsyncEngine

        self.engine = AsyncEngine(engine)
        self.engine.start()
        self._n = 0

    async def send(self, req: Request) -> Result:
        from libs.engine import SamplingParams

        self._n += 1
        t0 = time.perf_counter()
        res = Result(ttft_s=float("nan"))
        stream = self.engine.add_request(f"load-{self._n}", req.prompt, SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True))
        async for out in stream:
            for c in out.outputs:
                for _ in c.new_token_ids:
                    now = time.perf_counter() - t0
                    if not res.token_times:
                        res.ttft_s = now
                    res.token_times.append(now)
                    res.output_tokens += 1
        return res

    async def close(self) -> None:
        await self.engine.stop()


@dataclass
class Report:
    requests: int
    wall_s: float
    output_tokens: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s

    def row(self, name: str) -> list[str]:
        ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
        return [name, str(self.requests), f"{self.throughput:.1f}", ms(self.ttft_p50), ms(self.ttft_p99), ms(self.tpot_p50), ms(self.tpot_p99)]


HEADERS = ["target", "requests", "output tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def run(target: Target, reqs: list[Request], concurrency: int) -> Report:
    queue = list(reversed(reqs))
    results: list[Result] = []

    async def worker() -> None:
        while queue:
            results.append(await target.send(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    return Report(
        requests=len(results), wall_s=wall, output_tokens=sum(r.output_tokens for r in results),
        ttft_p50=percentile([r.ttft_s for r in results], 0.5), ttft_p99=percentile([r.ttft_s for r in results], 0.99),
        tpot_p50=percentile(tpots, 0.5) if tpots else float("nan"), tpot_p99=percentile(tpots, 0.99) if tpots else float("nan"),
    )


def main() -> None:
    from bench.common import table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="router base URL (OpenAI API)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", default="uniform:128-512")
    ap.add_argument("--output-len", default="uniform:64-128")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    async def go() -> Report:
        target = await HttpTarget.connect(args.url)
        try:
            return await run(target, workload(args.requests, args.prompt_len, args.output_len, args.seed), args.concurrency)
        finally:
            await target.close()

    report = asyncio.run(go())
    print(table(HEADERS, [report.row(args.url)]))


if __name__ == "__main__":
    main()
