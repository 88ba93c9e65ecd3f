"""What every request handler shares: settings, tokenizer, instances, clients, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from libs.model.tokenizer import Tokenizer
from libs.structured import GrammarCompiler
from services.router.admission import Admission
from services.router.detok import TokenRenderer
from services.router.executor import BoundedExecutor
from services.router.metrics import RouterMetrics
from services.router.registry import Registry
from services.router.settings import RouterSettings
from services.router.workers import WorkerClient


@dataclass
class RouterState:
    settings: RouterSettings
    tokenizer: Tokenizer
    model_name: str
    registry: Registry
    metrics: RouterMetrics
    renderer: TokenRenderer
    grammars: GrammarCompiler  # validates structured-output constraints (cached)
    executor: BoundedExecutor = field(init=False)
    admission: Admission = field(init=False)
    chat_template: str | None = None  # --chat-template's text, replacing the model's
    workers: WorkerClient | None = None  # made on startup, inside the event loop

    def __post_init__(self) -> None:
        s = self.settings
        self.executor = BoundedExecutor(s.prepare_threads, s.prepare_queue, s.retry_after_s)
        self.admission = Admission(s.max_running_requests, s.max_waiting_requests, s.queue_timeout_s, s.retry_after_s)

    @property
    def client(self) -> WorkerClient:
        if self.workers is None:
            raise RuntimeError("the router app has not started")
        return self.workers


STATE = web.AppKey("router_state", RouterState)
