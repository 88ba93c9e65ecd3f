"""cache_store's HTTP API: blocks, queries, leases and statistics over the KV pool.

Blocks are raw encoded values (libs/kvpool/header.py); a block is named in paths by its
block id ``<namespace hex>:<block key>``. Request bodies that list blocks name the
namespace once: ``{"namespace": "<hex>", "keys": ["<block key>", ...]}`` (a prompt's keys
always share one namespace, and that is what ``exists_prefix`` and leases take).

==========================  ====================================================================
``GET /v1/blocks/{id}``     the value (``application/octet-stream``); 404 if absent
``HEAD /v1/blocks/{id}``    200 or 404, no body; not counted as a read
``PUT /v1/blocks/{id}``     store a value; ``?lease=<id>`` pins it under that lease. The body must
                            be a valid block (header, length, checksum; a partial key's token
                            count) and at most ``--max-value-bytes``. 201, or 400/409/413/507
``DELETE /v1/blocks/{id}``  delete (even if leased); 404 if absent
``POST /v1/blocks/query``   ``{"namespace", "keys"}`` -> ``{"exists": [bool], "prefix": n}``; with
                            ``"prefix_only": true`` just ``{"prefix": n}``, which a new prompt
                            answers from its first key alone (the router's question)
``POST /v1/leases``         ``{"namespace", "keys", "ttl_s"?}`` -> 201 ``{"lease_id", "ttl_s", "blocks"}``
``DELETE /v1/leases/{id}``  release; 404 if unknown (never existed, released, or reaped)
``GET /v1/stats``           pool-wide statistics (same as ``/stats``)
==========================  ====================================================================

Errors are JSON ``{"error": {"message", "type", "param", "code"}}``. Bad input is a 4xx whose
``code`` names the reason (``malformed_key``, ``invalid_block`` with the decode reason in
``param``, ``too_large``, ``not_found``, ...); a pool that cannot be reached is a 503
(``pool_unavailable``), so that callers retry elsewhere. Nothing a client sends produces a 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from libs.kvpool.header import BlockDecodeError, inspect_block
from libs.kvpool.pool import LEASE_ID_RE, BlockPool, PoolError, PoolUnavailable, key_text, leading_run, namespace_hex, parse_block_id
from libs.kvpool.redis_pool import RedisPool
from libs.protocol.errors import ProtocolError
from libs.protocol.http import json_error, read_body
from services.cache_store.metrics import PoolCollector
from services.cache_store.policy import PolicyLoop
from services.cache_store.settings import CacheStoreSettings
from services.common.app import create_app

_PUT_ERROR_STATUS = {"oom": 507, "lease": 409, "rejected": 502}


class RequestRejected(Exception):
    """A 4xx to answer: ``code`` is the JSON reason (and the metric label)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


class CacheStoreApi:
    """The handlers, over one pool and its policy loop."""

    def __init__(self, settings: CacheStoreSettings, pool: BlockPool, policy: PolicyLoop, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.pool = pool
        self.policy = policy
        self.rejected = Counter(
            "tidepool_cache_store_rejected_requests",
            "requests refused with a 4xx, by reason",
            ["reason"],
            registry=registry,
        )
        for code in ("malformed_key", "invalid_block", "too_large", "not_found", "malformed_body", "malformed_lease"):
            self.rejected.labels(code)  # exported at zero from the start

    # -- helpers ----------------------------------------------------------------------------

    def _block_id(self, request: web.Request) -> tuple[str, str]:
        try:
            return parse_block_id(request.match_info["id"])
        except ValueError as exc:
            raise RequestRejected(400, "malformed_key", str(exc), "id") from None

    async def _json_object(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestRejected(400, "malformed_body", f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestRejected(400, "malformed_body", "body must be a JSON object")
        return body

    def _namespace_keys(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        ns, keys = body.get("namespace"), body.get("keys")
        if not isinstance(ns, str):
            raise RequestRejected(400, "malformed_body", "'namespace' must be a string", "namespace")
        if not isinstance(keys, list):
            raise RequestRejected(400, "malformed_body", "'keys' must be a list of block keys", "keys")
        if len(keys) > self.settings.max_query_keys:
            raise RequestRejected(400, "too_large", f"{len(keys)} keys, at most {self.settings.max_query_keys}", "keys")
        try:
            ns = namespace_hex(ns)
        except ValueError as exc:
            raise RequestRejected(400, "malformed_key", str(exc), "namespace") from None
        checked = []
        for i, key in enumerate(keys):
            try:
                if not isinstance(key, str):
                    raise ValueError("a block key must be a string")
                checked.append(key_text(key))
            except ValueError as exc:
                raise RequestRejected(400, "malformed_key", str(exc), f"keys[{i}]") from None
        return ns, checked

    # -- blocks -------------------------------------------------------------------------------

    async def get_block(self, request: web.Request) -> web.Response:
        ns, key = self._block_id(request)
        (value,) = await self.pool.get_blocks(ns, [key])
        if value is None:
            raise RequestRejected(404, "not_found", f"no block {ns}:{key}", "id")
        return web.Response(body=value, content_type="application/octet-stream")

    async def head_block(self, request: web.Request) -> web.Response:
        ns, key = self._block_id(request)
        (exists,) = await self.pool.exists_blocks(ns, [key])
        return web.Response(status=200 if exists else 404)

    async def put_block(self, request: web.Request) -> web.Response:
        ns, key = self._block_id(request)
        lease_id = request.query.get("lease")
        if lease_id is not None and not LEASE_ID_RE.match(lease_id):
            raise RequestRejected(400, "malformed_lease", f"malformed lease id {lease_id!r}", "lease")
        try:
            body = await read_body(request.content, request.content_length, self.settings.max_value_bytes)
        except ProtocolError as exc:
            raise RequestRejected(413, "too_large", str(exc)) from None
        try:
            header = inspect_block(body)
        except BlockDecodeError as exc:
            raise RequestRejected(400, "invalid_block", f"not a valid block: {exc}", exc.reason) from None
        _, partial, tail = key.partition(":partial:")
        if partial and header.num_tokens != int(tail):
            raise RequestRejected(
                400, "invalid_block", f"key names {tail} tokens, the block holds {header.num_tokens}", "tokens"
            )
        (error,) = await self.pool.put_blocks(ns, [(key, body)], lease_id=lease_id)
        if error is not None:
            return _error(_PUT_ERROR_STATUS[error.reason], error.reason, str(error))
        return web.json_response({"id": f"{ns}:{key}", "bytes": len(body), "tokens": header.num_tokens}, status=201)

    async def delete_block(self, request: web.Request) -> web.Response:
        ns, key = self._block_id(request)
        if not await self.pool.delete_blocks(ns, [key]):
            raise RequestRejected(404, "not_found", f"no block {ns}:{key}", "id")
        return web.json_response({"deleted": f"{ns}:{key}"})

    async def query_blocks(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        ns, keys = self._namespace_keys(body)
        prefix_only = body.get("prefix_only", False)
        if not isinstance(prefix_only, bool):
            raise RequestRejected(400, "malformed_body", "'prefix_only' must be a boolean", "prefix_only")
        if prefix_only:
            return web.json_response({"prefix": await self.pool.exists_prefix(ns, keys)})
        exists = await self.pool.exists_blocks(ns, keys)
        return web.json_response({"exists": exists, "prefix": leading_run(exists)})

    # -- leases -------------------------------------------------------------------------------

    async def create_lease(self, request: web.Request) -> web.Response:
        body = await self._json_object(request)
        ns, keys = self._namespace_keys(body)
        ttl = body.get("ttl_s", self.settings.lease_ttl_s)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= self.settings.max_lease_ttl_s:
            raise RequestRejected(
                400, "malformed_body", f"'ttl_s' must be a number in (0, {self.settings.max_lease_ttl_s}]", "ttl_s"
            )
        lease_id = await self.pool.create_lease(ns, keys, float(ttl))
        return web.json_response({"lease_id": lease_id, "ttl_s": float(ttl), "blocks": len(set(keys))}, status=201)

    async def release_lease(self, request: web.Request) -> web.Response:
        lease_id = request.match_info["id"]
        if not LEASE_ID_RE.match(lease_id):
            raise RequestRejected(400, "malformed_lease", f"malformed lease id {lease_id!r}", "id")
        if not await self.pool.release_lease(lease_id):
            raise RequestRejected(404, "not_found", f"no lease {lease_id} (released, expired or never created)", "id")
        return web.json_response({"released": lease_id})

    # -- ops ----------------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Live pool statistics; while Redis is down, the last snapshot marked ``stale``."""
        try:
            snapshot = await self.pool.stats()
            stale = False
        except PoolError:
            snapshot, stale = self.policy.snapshot, True
        pool = snapshot.to_dict() if snapshot is not None else {}
        return {
            **pool,
            "budget_bytes": self.settings.budget_bytes,
            "redis_up": not stale,
            "stale": stale,
            "policy": dataclasses.asdict(self.policy.counters),
        }

    async def stats_handler(self, request: web.Request) -> web.Response:
        return web.json_response(await self.stats())

    async def health(self) -> bool:
        await asyncio.wait_for(self.pool.ping(), self.settings.redis_timeout_s)
        return True


def _error(status: int, code: str, message: str, param: str | None = None) -> web.Response:
    return json_error(status, message, code=code, param=param)


def _rejections(api: CacheStoreApi) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Turn :class:`RequestRejected` and pool failures into JSON answers, counting rejections."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestRejected as exc:
            api.rejected.labels(exc.code).inc()
            response = _error(exc.status, exc.code, str(exc), exc.param)
            if exc.status == 413:
                # The body was refused unread: close the connection rather than drain
                # megabytes nobody wants.
                response.force_close()
            return response
        except PoolUnavailable as exc:
            return _error(503, "pool_unavailable", str(exc))
        except PoolError as exc:
            return _error(502, "pool_error", str(exc))

    return middleware


def build_app(settings: CacheStoreSettings, *, pool: BlockPool | None = None) -> web.Application:
    """The cache_store application; ``pool`` defaults to Redis from ``settings`` (tests pass a twin)."""
    pool = pool if pool is not None else RedisPool(settings.pool_config())
    policy = PolicyLoop(
        pool,
        budget_bytes=settings.budget_bytes,
        interval_s=settings.maintenance_interval_s,
        pressure_interval_s=settings.pressure_interval_s,
        memory_high_watermark=settings.memory_high_watermark,
        evict_batch=settings.evict_batch,
    )
    registry = CollectorRegistry()
    registry.register(PoolCollector(policy))
    api = CacheStoreApi(settings, pool, policy, registry)
    app = create_app(
        "cache_store",
        settings,
        stats=api.stats,
        health=api.health,
        registry=registry,
        client_max_size=max(settings.max_value_bytes, 1 << 20) + (1 << 16),
    )
    app.middlewares.append(_rejections(api))
    app.router.add_post("/v1/blocks/query", api.query_blocks)  # before /v1/blocks/{id}
    app.router.add_get("/v1/blocks/{id}", api.get_block, allow_head=False)
    app.router.add_route("HEAD", "/v1/blocks/{id}", api.head_block)
    app.router.add_put("/v1/blocks/{id}", api.put_block)
    app.router.add_delete("/v1/blocks/{id}", api.delete_block)
    app.router.add_post("/v1/leases", api.create_lease)
    app.router.add_delete("/v1/leases/{id}", api.release_lease)
    app.router.add_get("/v1/stats", api.stats_handler)

    async def start(app: web.Application) -> None:
        policy.start()

    async def stop(app: web.Application) -> None:
        await policy.stop()
        await pool.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app
