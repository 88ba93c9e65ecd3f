"""What every request handler shares: settings, tokenizer, instances, clients, metrics."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from aiohttp import web

from libs.model.tokenizer import Tokenizer
from libs.structured import GrammarCompiler
from services.router.detok import TokenRenderer
from services.router.metrics import RouterMetrics
from services.router.registry import Registry
from services.router.settings import RouterSettings
from services.router.workers import WorkerClient

T = TypeVar("T")


@dataclass
class RouterState:
    settings: RouterSettings
    tokenizer: Tokenizer
    model_name: str
    registry: Registry
    metrics: RouterMetrics
    renderer: TokenRenderer
    # Chat templates and long prompts take milliseconds to render and tokenize; a thread
    # keeps the event loop (and every other request's stream) moving meanwhile.
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))
    workers: WorkerClient | None = None  # made on startup, inside the event loop
    grammars: GrammarCompiler | None = None  # validates structured-output constraints (cached)
    chat_template: str | None = None  # --chat-template's text, replacing the model's

    @property
    def client(self) -> WorkerClient:
        if self.workers is None:
            raise RuntimeError("the router app has not started")
        return self.workers

    async def in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)


STATE = web.AppKey("router_state", RouterState)
