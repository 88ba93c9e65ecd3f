"""The router's aiohttp application: the OpenAI API, instance registration, operations.

=================================  =============================================================
``POST /v1/completions``           OpenAI completions (generate.py)
``POST /v1/chat/completions``      OpenAI chat completions (generate.py)
``GET /v1/models``                 the served model
``POST /tokenize /detokenize``     vLLM's utility endpoints (tokenize.py)
``GET /v1/workers``                registered instances: role, url, load, last seen, usable
``GET /openapi.json``              the OpenAPI document of the public API (openapi.py)
``POST /internal/v1/register``     ``RegisterInstance`` -> ``InstanceAck`` (msgpack)
``POST /internal/v1/heartbeat``    ``Heartbeat`` -> ``InstanceAck``; 404 from an unknown instance
``POST /internal/v1/deregister``   ``DeregisterInstance`` -> ``InstanceAck``; 404 from an unknown instance
``GET /ready``                      readiness: 200 once a decode instance is registered, else 503
``GET /health /metrics /stats``    services/common (``/health`` is liveness only)
=================================  =============================================================

With ``api_key`` set, every ``/v1/`` route and ``/tokenize`` and ``/detokenize`` need
``Authorization: Bearer <key>`` (401 otherwise), compared in constant time (vLLM leaves
its utility endpoints open; here they run the tokenizer, which is work worth a key). The
internal routes are not behind it: instances do not hold the client key. They are behind
the services' shared ``internal_token`` when one is set (services/common/app.py), and
like every service the router binds to localhost unless told otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from libs.model.tokenizer import Tokenizer
from libs.structured import GrammarCompiler
from libs.protocol import msgpack_response, read_message
from libs.protocol.messages import DeregisterInstance, Heartbeat, InstanceAck, RegisterInstance
from services.common import create_app
from services.router.detok import TokenRenderer
from services.router.errors import ApiError
from services.router.generate import handle
from services.router.metrics import RouterMetrics
from services.router.openapi import openapi_document
from services.router.registry import IncompatibleInstance, Registry
from services.router.settings import RouterSettings
from services.router.state import STATE, RouterState
from services.router.tokenize import detokenize, tokenize
from services.router.workers import WorkerClient

log = logging.getLogger("tidepool.router")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})  # behind the API key, besides /v1/


def _auth_middleware(api_key: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in KEYED_PATHS:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token:
                return _unauthorized("You didn't provide an API key (Authorization: Bearer <key>).")
            if not hmac.compare_digest(token.strip().encode(), expected):
                return _unauthorized("Incorrect API key provided.")
        return await handler(request)

    return auth


def _unauthorized(message: str) -> web.Response:
    response = ApiError(401, message, code="invalid_api_key").response()
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def _completions(request: web.Request) -> web.StreamResponse:
    return await handle(request, "completion")


async def _chat(request: web.Request) -> web.StreamResponse:
    return await handle(request, "chat")


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(request.app[_STARTED]),
        "owned_by": "tidepool",
        "max_model_len": state.registry.max_model_len("decode"),
    }
    return web.json_response({"object": "list", "data": [card]})


async def _ready(request: web.Request) -> web.Response:
    """Readiness, as opposed to ``/health`` (liveness: the process answers).

    A request can succeed once one decode instance is registered with current heartbeats:
    decode serves a whole request by itself when no prefill instance is there. Until then
    (start-up, or every decode gone) this answers 503, so load balancers, compose's
    healthcheck and ``make run`` wait instead of sending requests that would get 503."""
    registry = request.app[STATE].registry
    live = {role: len(registry.live(role)) for role in ("prefill", "decode")}
    usable = {role: len(registry.usable(role)) for role in ("prefill", "decode")}
    body: dict[str, object] = {"ready": live["decode"] > 0, "live": live, "usable": usable}
    if not body["ready"]:
        body["reason"] = "no decode instance is registered"
    return web.json_response(body, status=200 if body["ready"] else 503)


async def _workers(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[STATE].registry.describe()})


async def _register(request: web.Request) -> web.Response:
    state = request.app[STATE]
    msg = await read_message(request, RegisterInstance)
    if msg.model not in request.app[_MODEL_NAMES]:
        return ApiError(
            400,
            f"instance serves model {msg.model!r}, this router serves {state.model_name!r}",
            code="model_mismatch",
            param="model",
        ).response()
    if not msg.url.startswith(("http://", "https://")):
        return ApiError(400, f"url must be an http(s) URL, got {msg.url!r}", code="invalid_value", param="url").response()
    try:
        state.registry.register(msg)
    except IncompatibleInstance as exc:
        return ApiError(400, str(exc), code="quantization_mismatch", param="quantization").response()
    except ValueError as exc:
        return ApiError(400, str(exc), code="invalid_value", param="namespace").response()
    state.metrics.registrations.labels(msg.role).inc()
    return msgpack_response(InstanceAck(instance_id=msg.instance_id, heartbeat_timeout_s=state.settings.heartbeat_timeout_s))


async def _heartbeat(request: web.Request) -> web.Response:
    state = request.app[STATE]
    msg = await read_message(request, Heartbeat)
    if state.registry.heartbeat(msg) is None:
        return ApiError(
            404, f"unknown {msg.role} instance {msg.instance_id!r}; register again", code="unknown_instance"
        ).response()
    return msgpack_response(InstanceAck(instance_id=msg.instance_id, heartbeat_timeout_s=state.settings.heartbeat_timeout_s))


async def _deregister(request: web.Request) -> web.Response:
    state = request.app[STATE]
    msg = await read_message(request, DeregisterInstance)
    if state.registry.deregister(msg.instance_id, msg.role, msg.reason) is None:
        return ApiError(404, f"unknown {msg.role} instance {msg.instance_id!r}", code="unknown_instance").response()
    return msgpack_response(InstanceAck(instance_id=msg.instance_id, heartbeat_timeout_s=state.settings.heartbeat_timeout_s))


async def _reap(state: RouterState) -> None:
    """Drop instances whose heartbeats stopped, a few times per timeout."""
    interval = min(1.0, max(0.05, state.settings.heartbeat_timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        for inst in state.registry.expire():
            state.metrics.instances_dropped.labels(inst.role).inc()


def _read_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text when it names a file, else the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "\n" not in value and len(value) < 4096 and path.is_file():
        return path.read_text()
    return value


_STARTED = web.AppKey("router_started", float)
_MODEL_NAMES = web.AppKey("router_model_names", frozenset)


def create_router_app(settings: RouterSettings, tokenizer: Tokenizer | None = None, model_name: str | None = None) -> web.Application:
    """The router app. ``tokenizer``/``model_name`` default to loading ``settings.model``
    (tests pass a tokenizer they loaded once); the served name is ``served_model_name`` or
    the model's own name, and instances may register under either."""
    if tokenizer is None or model_name is None:
        from libs.model.source import load_tokenizer, model_name as name_of, resolve_model_path
        from libs.model.weight_cache import resolve_cache_dir

        tokenizer = tokenizer or load_tokenizer(settings.model, resolve_cache_dir(settings.cache_dir))
        model_name = model_name or name_of(resolve_model_path(settings.model))
    served = settings.served_model_name or model_name
    metrics_registry = CollectorRegistry()
    instances = Registry(heartbeat_timeout_s=settings.heartbeat_timeout_s)
    state = RouterState(
        settings=settings,
        tokenizer=tokenizer,
        model_name=served,
        registry=instances,
        metrics=RouterMetrics.create(metrics_registry, instances),
        renderer=TokenRenderer(tokenizer),
        grammars=GrammarCompiler(tokenizer, cache_size=settings.grammar_cache_size),
        chat_template=_read_template(settings.chat_template),
    )

    def stats() -> dict[str, object]:
        return {
            "model": served,
            "instances": {
                role: {"live": len(instances.live(role)), "usable": len(instances.usable(role))}
                for role in ("prefill", "decode")
            },
            "prefill_threshold_tokens": settings.prefill_threshold_tokens,
            "cache_store_url": settings.cache_store_url,
            "api_key_required": settings.api_key is not None,
            "admission": {
                "running": state.admission.running,
                "waiting": state.admission.waiting,
                "max_running": settings.max_running_requests,
                "max_waiting": settings.max_waiting_requests,
            },
            "prepare": {"pending": state.executor.pending, "max_pending": settings.prepare_queue},
        }

    RouterMetrics.watch_limits(metrics_registry, state.admission, state.executor)
    app = create_app(
        "router",
        settings,
        stats=stats,
        health=lambda: True,
        registry=metrics_registry,
        client_max_size=settings.max_body_bytes,
        internal=lambda path: path.startswith("/internal/"),
    )
    if settings.api_key is not None:
        app.middlewares.append(_auth_middleware(settings.api_key))
    app[STATE] = state
    app[_STARTED] = time.time()
    app[_MODEL_NAMES] = frozenset({served, model_name})

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        state.workers = WorkerClient(settings)
        reaper = asyncio.create_task(_reap(state), name="router reaper")
        try:
            yield
        finally:
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
            await state.client.close()
            state.executor.shutdown()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/workers", _workers)
    app.router.add_get("/ready", _ready)
    document = openapi_document(served_model=served, vocab_size=tokenizer.vocab_size, api_key=settings.api_key is not None)

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/internal/v1/register", _register)
    app.router.add_post("/internal/v1/heartbeat", _heartbeat)
    app.router.add_post("/internal/v1/deregister", _deregister)
    return app
