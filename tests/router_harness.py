"""A router in this process, in front of fake prefill/decode instances (tests/fake_workers.py).

``Cluster`` starts the real router app on a free port with the real tokenizer (loaded
once per process: reading the GGUF metadata takes seconds) and any number of fake
instances that register and heartbeat like real ones. Clients talk to it over real
sockets: the official ``openai`` client for the public API, aiohttp for the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Awaitable, Callable, TypeVar

import aiohttp
import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from libs.model.tokenizer import Tokenizer
from services.router.app import create_router_app
from services.router.settings import RouterSettings
from services.router.state import STATE, RouterState
from tests.fake_workers import FakeDecode, FakeInstance, FakeModel, FakePrefill

F = TypeVar("F", bound=FakeInstance)

MODEL = "fake-model"
SCRIPT = " The quick brown fox jumps over a lazy dog. Zebras éclair 😀 end"


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    from libs.model.source import load_tokenizer

    return load_tokenizer(None)


@lru_cache(maxsize=1)
def fake_model() -> FakeModel:
    tok = tokenizer()
    return FakeModel(script=tok.encode(SCRIPT), eos=tok.eos_token_ids[0])


def script_text(start: int = 0, max_tokens: int | None = None) -> str:
    """The fake model's completion from script position ``start``."""
    return fake_model().text_from(tokenizer(), start, max_tokens)


def long_prompt(words: int = 40) -> str:
    """A prompt well over the default prefill threshold (32 tokens)."""
    return " ".join(f"word{i}" for i in range(words))


@dataclass
class Cluster:
    router: web.AppRunner
    url: str
    prefills: list[FakePrefill] = field(default_factory=list)
    decodes: list[FakeDecode] = field(default_factory=list)
    _clients: list[Any] = field(default_factory=list)

    @property
    def app(self) -> web.Application:
        return self.router.app  # type: ignore[return-value]

    @property
    def state(self) -> RouterState:
        return self.app[STATE]

    def openai(self, api_key: str = "unused", **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 20)
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)
        self._clients.append(client)
        return client

    def http(self) -> aiohttp.ClientSession:
        session = aiohttp.ClientSession(base_url=self.url)
        self._clients.append(session)
        return session

    async def add_prefill(self, instance_id: str | None = None, *, join: bool = True, **kwargs: Any) -> FakePrefill:
        inst = await self._add(FakePrefill, "prefill", instance_id or f"prefill-{len(self.prefills)}", join, kwargs)
        self.prefills.append(inst)
        return inst

    async def add_decode(self, instance_id: str | None = None, *, join: bool = True, **kwargs: Any) -> FakeDecode:
        inst = await self._add(FakeDecode, "decode", instance_id or f"decode-{len(self.decodes)}", join, kwargs)
        self.decodes.append(inst)
        return inst

    async def _add(self, cls: type[F], role: str, instance_id: str, join: bool, kwargs: dict[str, Any]) -> F:
        kwargs.setdefault("internal_token", self.state.settings.internal_token)  # as real instances share it
        inst = cls(role=role, model=fake_model(), model_name=MODEL, instance_id=instance_id, **kwargs)
        await inst.start()
        if join:
            await inst.join(self.url)
        return inst

    async def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as ``name{label="v",...}`` -> value."""
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as resp:
            text = await resp.text()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    async def close(self) -> None:
        for c in self._clients:
            await c.close()
        for inst in [*self.prefills, *self.decodes]:
            await inst.stop()
        await self.router.cleanup()


async def start_cluster(*, prefills: int = 1, decodes: int = 1, **settings: Any) -> Cluster:
    """A router (settings overridden by keyword) with ``prefills`` and ``decodes`` fakes joined."""
    defaults: dict[str, Any] = dict(port=0, heartbeat_timeout_s=2.0, retry_wait_s=1.0, decode_read_timeout_s=5.0)
    fields = {f.name for f in dataclasses.fields(RouterSettings)}
    unknown = set(settings) - fields
    assert not unknown, f"unknown router settings {unknown}"
    app = create_router_app(RouterSettings(**{**defaults, **settings}), tokenizer(), MODEL)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    cluster = Cluster(runner, f"http://{host}:{port}")
    for _ in range(prefills):
        await cluster.add_prefill()
    for _ in range(decodes):
        await cluster.add_decode()
    return cluster


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 3.0, what: str = "condition") -> None:
    """Wait until ``check()`` holds (polling), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
