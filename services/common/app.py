"""The aiohttp application every service starts from: ops endpoints, errors, request log.

``create_app`` gives a service ``GET /health``, ``GET /metrics`` and ``GET /stats``, a JSON
error middleware, per-request logging and metrics, and the internal-token check, so each
service only adds its own routes. ``/metrics`` also carries the garbage collector's pauses
and the size of the frozen startup heap (services/common/gc_heap.py).

Internal token: with ``settings.internal_token`` set, every request to an internal route
must carry it in ``X-Tidepool-Internal-Token`` (libs/protocol/http.py), or it is answered
401 before its handler runs. Which routes are internal is the service's call
(``internal``): by default all but the operations endpoints; the router exempts its
public ``/v1`` API (behind the API key instead). The comparison is constant-time
(``hmac.compare_digest``), so response timing does not leak how much of a guess was right. Metrics go to a :class:`prometheus_client.CollectorRegistry` owned by the app (never
the process-global one), so several apps can live in one test process without clashing.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest

from libs.protocol.http import INTERNAL_TOKEN_HEADER, json_error
from services.common.gc_heap import GcPauses
from services.common.settings import BaseSettings

SERVICE_NAME = web.AppKey("service_name", str)
SETTINGS = web.AppKey("settings", BaseSettings)
METRICS_REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)

StatsFn = Callable[[], "Mapping[str, Any] | Awaitable[Mapping[str, Any]]"]
HealthFn = Callable[[], "bool | Awaitable[bool]"]

OPS_ROUTES = frozenset({"/health", "/ready", "/metrics", "/stats"})
# Scraped and polled constantly: logged at DEBUG so the INFO log shows real traffic.
_OPS_PATHS = OPS_ROUTES | {"/internal/v1/heartbeat"}
DEFAULT_CLIENT_MAX_SIZE = 64 * 1024 * 1024


async def _call(fn: Callable[[], Any]) -> Any:
    """Call a sync-or-async callback."""
    result = fn()
    if inspect.isawaitable(result):
        result = await result
    return result


def _route_label(request: web.Request) -> str:
    """The matched route's pattern (``/blocks/{key}``), not the raw path, to bound cardinality."""
    route = request.match_info.route
    resource = route.resource
    if resource is None or isinstance(request.match_info.http_exception, web.HTTPException):
        return "unmatched"
    return resource.canonical


def _error_middleware(log: logging.Logger) -> Any:
    """Turn every failure into a JSON error response; the process never goes down for a request.

    - ``HTTPException`` with a plain-text body (aiohttp's own 404/405/413, a handler's
      ``HTTPBadRequest(text=...)``) is re-shaped as a JSON error with the same status and
      headers; JSON ones (e.g. from ``read_message``) pass through untouched.
    - ``json.JSONDecodeError`` is a malformed body (from ``await request.json()``): 400.
    - Anything else is a bug: logged with its traceback, answered with a 500.
    - If the handler already started a streamed response, no second response can be sent:
      the error is logged and re-raised, and aiohttp closes the connection, which the peer
      sees as a truncated stream.
    """

    @web.middleware
    async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400 or exc.content_type == "application/json":
                raise
            headers = {
                k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")
            }
            return json_error(
                exc.status,
                exc.text or exc.reason,
                code=exc.reason.lower().replace(" ", "_"),
                headers=headers,
            )
        except json.JSONDecodeError as exc:
            return json_error(400, f"malformed JSON body: {exc}", code="malformed_json")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("unhandled error in %s %s", request.method, request.path)
            if request.writer is not None and request.writer.output_size > 0:
                raise
            return json_error(500, f"internal error: {type(exc).__name__}", code="internal_error")

    return errors


def _internal_token_middleware(token: str, internal: Callable[[str], bool]) -> Any:
    expected = token.encode()

    @web.middleware
    async def check_token(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if internal(request.path):
            given = request.headers.get(INTERNAL_TOKEN_HEADER)
            if given is None:
                return json_error(401, f"this endpoint needs the services' internal token ({INTERNAL_TOKEN_HEADER})", code="missing_internal_token")
            if not hmac.compare_digest(given.encode(), expected):
                return json_error(401, "wrong internal token", code="invalid_internal_token")
        return await handler(request)

    return check_token


def not_ops(path: str) -> bool:
    """The default notion of an internal route: everything but the operations endpoints."""
    return path not in OPS_ROUTES


def _access_middleware(log: logging.Logger, registry: CollectorRegistry) -> Any:
    """Log one line per request and count it in ``tidepool_http_*`` metrics."""
    requests = Counter(
        "tidepool_http_requests",
        "HTTP requests served, by route, method and status",
        ["route", "method", "status"],
        registry=registry,
    )
    latency = Histogram(
        "tidepool_http_request_duration_seconds",
        "time from request to handler return (for streams: to end of stream)",
        ["route", "method"],
        registry=registry,
    )

    @web.middleware
    async def access(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # client went away (nginx's convention)
            raise
        finally:
            elapsed = time.perf_counter() - start
            route = _route_label(request)
            requests.labels(route, request.method, str(status)).inc()
            latency.labels(route, request.method).observe(elapsed)
            level = logging.DEBUG if request.path in _OPS_PATHS else logging.INFO
            log.log(level, "%s %s %d %.1fms", request.method, request.path_qs, status, elapsed * 1e3)

    return access


def create_app(
    name: str,
    settings: BaseSettings,
    *,
    stats: StatsFn,
    health: HealthFn,
    registry: CollectorRegistry | None = None,
    client_max_size: int = DEFAULT_CLIENT_MAX_SIZE,
    internal: Callable[[str], bool] = not_ops,
) -> web.Application:
    """A service's application with ``/health``, ``/metrics``, ``/stats`` and error handling.

    ``stats`` returns the JSON-able dict served at ``/stats``; ``health`` says whether the
    service can take traffic (``/health`` answers 200 or 503; an exception counts as
    unhealthy). Both may be sync or async. Pass the ``registry`` the service registered its
    own metrics on; without one a fresh registry is made (``app[METRICS_REGISTRY]``).
    ``client_max_size`` bounds ``request.read()/json()`` bodies (aiohttp answers 413 above).
    ``internal`` says which paths need the internal token when ``settings.internal_token``
    is set.
    """
    log = logging.getLogger(f"tidepool.{name}")
    registry = registry if registry is not None else CollectorRegistry()
    middlewares = [_access_middleware(log, registry), _error_middleware(log)]
    if settings.internal_token is not None:
        middlewares.append(_internal_token_middleware(settings.internal_token, internal))
    app = web.Application(middlewares=middlewares, client_max_size=client_max_size)
    app[SERVICE_NAME] = name
    app[SETTINGS] = settings
    app[METRICS_REGISTRY] = registry
    started = time.monotonic()
    gc_pauses = GcPauses(registry)  # services/common/gc_heap.py

    async def watch_gc(app: web.Application) -> None:
        gc_pauses.install()

    async def unwatch_gc(app: web.Application) -> None:
        gc_pauses.remove()

    app.on_startup.append(watch_gc)
    app.on_cleanup.append(unwatch_gc)

    async def health_handler(request: web.Request) -> web.Response:
        body: dict[str, Any] = {"service": name, "uptime_s": round(time.monotonic() - started, 3)}
        try:
            ok = bool(await _call(health))
        except Exception as exc:
            log.warning("health check failed: %r", exc)
            ok = False
            body["reason"] = f"{type(exc).__name__}: {exc}"
        body["status"] = "ok" if ok else "unhealthy"
        return web.json_response(body, status=200 if ok else 503)

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats_handler(request: web.Request) -> web.Response:
        return web.json_response(dict(await _call(stats)))

    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/stats", stats_handler)
    return app
