"""The aiohttp application shared by prefill and decode: lifecycle, errors, abort."""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from libs.engine import InvalidRequestError
from libs.protocol import json_error, read_message
from libs.protocol.messages import AbortRequest
from services.common import create_app
from services.worker.runtime import Role, WorkerRuntime
from services.worker.settings import WorkerSettings

RUNTIME = web.AppKey("runtime", WorkerRuntime)


def rejected(rt: WorkerRuntime, e: InvalidRequestError) -> web.Response:
    """A 400 naming the problem (the engine's typed error), counted as an invalid request."""
    rt.metrics.requests.labels("invalid").inc()
    return json_error(400, str(e), code=e.code, param=e.param)


def full(rt: WorkerRuntime) -> web.Response | None:
    """A 429 with ``Retry-After`` when the instance already holds ``max_queue_depth``
    requests: the queue is bounded, so overload costs a retry elsewhere, never memory."""
    s = rt.settings
    if rt.in_flight < s.max_queue_depth:
        return None
    rt.metrics.requests.labels("full").inc()
    return json_error(
        429,
        f"{rt.role} instance {rt.instance_id} holds {rt.in_flight} requests, its limit; retry after {s.retry_after_s} s",
        type="overloaded_error",
        code="instance_full",
        headers={"Retry-After": str(s.retry_after_s)},
    )


def create_worker_app(settings: WorkerSettings, role: Role, routes: Callable[[web.Application, WorkerRuntime], None]) -> web.Application:
    """Load the engine, then build the app; the runtime starts and stops with the app."""
    runtime = WorkerRuntime(settings, role)
    app = create_app(role, settings, stats=runtime.stats, health=runtime.healthy, registry=runtime.registry)
    app[RUNTIME] = runtime

    async def on_startup(app: web.Application) -> None:
        await runtime.start()

    async def on_cleanup(app: web.Application) -> None:
        await runtime.stop()

    async def abort(request: web.Request) -> web.Response:
        msg = await read_message(request, AbortRequest)
        runtime.abort(msg.request_id)
        return web.json_response({"aborted": msg.request_id})

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/abort", abort)
    routes(app, runtime)
    return app


def announce_with(runtime_app: web.Application) -> Callable[[str], None]:
    """The runner's ready line, also telling the runtime its URL (for port 0)."""

    def announce(line: str) -> None:
        runtime = runtime_app[RUNTIME]
        if runtime.url is None:
            runtime.url = reachable_url(line.rsplit(" ", 1)[-1])
        print(line, flush=True)

    return announce


def reachable_url(url: str) -> str:
    """``url`` with a wildcard bind address (0.0.0.0, ::) replaced by this host's address,
    so the router can reach an instance that listens on every interface (containers)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::", ""):
        return url
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    return f"{parts.scheme}://{addr}:{parts.port}"



def run_worker(role: Role, routes: Callable[[web.Application, WorkerRuntime], None]) -> None:
    """``python -m services.<role>``: parse settings, load the engine, serve until signalled."""
    from services.common import parse_settings, run_service
    from services.common.runner import configure_logging

    settings = parse_settings(WorkerSettings, prog=f"python -m services.{role}")
    configure_logging(settings.log_level)  # before the engine loads: its log says where weights came from
    app = create_worker_app(settings, role, routes)
    run_service(app, settings, announce=announce_with(app))
