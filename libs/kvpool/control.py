"""The pool's control plane: redis-py connections per node, routed by the slot map.

Everything that is not a block's bytes goes here: the Lua bookkeeping (leases, reaping,
eviction, deletes, counters), existence queries, statistics, PING, and the discovery of
the topology itself. The bulk path (libs/kvpool/bulk.py) routes with the same
:class:`~libs.kvpool.topology.SlotMap`, so a ``MOVED`` seen by either plane refreshes one map.

Discovery. The configured URL names any node. On first use ``INFO cluster`` says whether
it runs in cluster mode (``cluster_enabled:1``); if so ``CLUSTER SLOTS`` gives the map,
otherwise the map is that one server for every slot. The map is fetched again after a
``MOVED``, and after a node could not be reached (a failover may have moved its slots),
asking each known node in turn.

Why not ``redis.asyncio.cluster.RedisCluster``: it keeps its own slot map and connection
pools (a second map for the bulk path to disagree with), applies response callbacks to
every reply (the pool reads raw RESP2 replies, the same in both modes), and retries by its
own policy. A standalone Redis is then a different client with different replies. Here
one code path serves both: per node a redis-py ``BlockingConnectionPool`` (redis-py still
does the protocol, AUTH, TLS and reconnection), and commands are grouped by the node that
serves their routing key, pipelined per node, the nodes in parallel.

Redirections. ``MOVED`` refreshes the map and resends the command; ``ASK`` (a slot being
migrated, the key already moved) resends it to the named node behind ``ASKING``;
``TRYAGAIN`` (a multi-key command during a migration), ``CLUSTERDOWN`` and ``LOADING``
are resent after a backoff.
After ``retries`` of either, the reply stands (callers turn it into an error). Transport
failures are retried per node (every command the pool sends here is idempotent) and end
as :class:`~libs.kvpool.pool.PoolUnavailable`.

Lost nodes. With ``partial=True`` a node that cannot be reached does not fail the call:
its commands get the :class:`PoolUnavailable` as their reply, and the caller works with
the nodes that answered (the pool is a cache: a lost node costs its share of the blocks,
and the policy keeps running on the others). Only when no node answers does the call
raise, which is also what a standalone Redis that is down does.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, Sequence

from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import AbstractConnection, SSLConnection, UnixDomainSocketConnection
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.kvpool.config import PoolConfig, redact_url
from libs.kvpool.pool import PoolError, PoolUnavailable
from libs.kvpool.resp import Frames
from libs.kvpool.scripts import SHA
from libs.kvpool.topology import Node, SlotMap

_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)
# Error codes that mean "ask again, maybe elsewhere": a redirect or a cluster in transition.
RETRY_CODES = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN"})

Command = tuple[Any, ...]


def error_code(reply: Any) -> str | None:
    """The code of an error reply (``MOVED``, ``OOM``...), from redis-py's exceptions or raw text."""
    if isinstance(reply, ResponseError):
        # redis-py strips the code of the errors it knows into the exception's class.
        for code, cls in _KNOWN.items():
            if type(reply) is cls:
                return code
        return str(reply).split(" ", 1)[0]
    return None


def ask_target(reply: Any) -> Node:
    """The node an ``ASK <slot> <host:port>`` error names (a redis-py AskError or raw text)."""
    text = reply.message if hasattr(reply, "message") and isinstance(reply.message, str) else str(reply)
    host, _, port = text.split()[-1].rpartition(":")
    return Node(host, int(port))


def _known_errors() -> dict[str, type]:
    from redis._parsers.base import BaseParser

    return {code: cls for code, cls in BaseParser.EXCEPTION_CLASSES.items() if isinstance(cls, type)}


_KNOWN = _known_errors()


def url_node(url: str) -> tuple[Node, dict[str, Any]]:
    """The node a URL names, and the connection settings (auth, db, TLS) it carries."""
    kwargs = parse_url(url)
    if "path" in kwargs:
        return Node("", 0, kwargs.pop("path")), kwargs
    return Node(kwargs.pop("host", "127.0.0.1"), int(kwargs.pop("port", 6379))), kwargs


class ControlPlane:
    """Routed, pipelined redis-py traffic for one pool. Construct with a PoolConfig; no I/O until used."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.seed, self._url_kwargs = url_node(config.url)
        if config.password is not None:
            self._url_kwargs["password"] = config.password
        self._pools: dict[Node, BlockingConnectionPool] = {}
        self.slots: SlotMap | None = None
        self._known: list[Node] = []  # every node of the last map: who to ask when the seed is gone
        self._refreshing: asyncio.Future[SlotMap] | None = None
        self.refreshes = 0

    # -- connections ------------------------------------------------------------------------

    def connection_kwargs(self) -> dict[str, Any]:
        """Auth, db and TLS settings of the URL (and the config's password), for any node."""
        return dict(self._url_kwargs)

    def _pool(self, node: Node) -> BlockingConnectionPool:
        pool = self._pools.get(node)
        if pool is None:
            kwargs = self.connection_kwargs()
            kwargs.pop("connection_class", None)  # parse_url's are redis-py's sync classes
            if node.path is not None:
                kwargs["path"], kwargs["connection_class"] = node.path, UnixDomainSocketConnection
            else:
                kwargs["host"], kwargs["port"] = node.host, node.port
                if self.config.url.startswith("rediss://"):
                    kwargs["connection_class"] = SSLConnection
            cfg = self.config
            pool = BlockingConnectionPool(
                max_connections=cfg.max_connections,
                timeout=cfg.connect_timeout_s + cfg.socket_timeout_s,
                socket_connect_timeout=cfg.connect_timeout_s,
                socket_timeout=cfg.socket_timeout_s,
                socket_read_size=cfg.socket_read_size,
                retry_on_timeout=False,
                retry=None,  # retries are ours: whole idempotent batches
                protocol=2,  # replies are read raw, so their shapes are pinned to RESP2
                **kwargs,
            )
            self._pools[node] = pool
        return pool

    async def roundtrip(self, node: Node, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` pipelined on one pooled connection to ``node``; replies in order.

        Error replies come back as ``ResponseError`` values. A dropped connection or a
        timeout is retried (every caller's commands are idempotent); after the last
        retry it becomes :class:`PoolUnavailable`.
        """
        pool = self._pool(node)
        last: BaseException | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            try:
                conn = await pool.get_connection()
            except _TRANSIENT as exc:
                last = exc
                continue
            try:
                return await _exchange(conn, commands)
            except _TRANSIENT as exc:
                last = exc
                await conn.disconnect(nowait=True)
            except BaseException:
                # Cancelled (or worse) mid-exchange: replies may still be in flight, so
                # the connection's state is unknown and it must not be reused.
                await conn.disconnect(nowait=True)
                raise
            finally:
                await pool.release(conn)
        if self.slots is not None and self.slots.cluster:
            self.invalidate()  # the node may be gone for good: look again next time
        where = redact_url(self.config.url) if node == self.seed else node.name
        raise PoolUnavailable(f"redis at {where}: {type(last).__name__}: {last}") from last

    # -- topology ---------------------------------------------------------------------------

    async def topology(self) -> SlotMap:
        """The current slot map, discovered on first use."""
        if self.slots is not None:
            return self.slots
        return await self.refresh()

    def invalidate(self) -> None:
        self.slots = None

    async def refresh(self) -> SlotMap:
        """Fetch the map again (one fetch at a time; concurrent callers share it)."""
        if self._refreshing is not None:
            return await asyncio.shield(self._refreshing)
        fut: asyncio.Future[SlotMap] = asyncio.get_running_loop().create_future()
        self._refreshing = fut
        try:
            slots = await self._discover()
            self.slots = slots
            self._known = list(slots.nodes)
            self.refreshes += 1
            fut.set_result(slots)
            return slots
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                fut.cancel()
            else:
                fut.set_exception(exc)
                fut.exception()  # retrieved: a refresh nobody else awaited must not warn
            raise
        finally:
            self._refreshing = None

    async def _discover(self) -> SlotMap:
        candidates = [self.seed] + [n for n in self._known if n != self.seed]
        last: BaseException | None = None
        for node in candidates:
            try:
                (info,) = await self.roundtrip(node, [("INFO", "cluster")])
                if isinstance(info, ResponseError):
                    raise PoolUnavailable(f"INFO cluster failed on {node}: {info}")
                if b"cluster_enabled:1" not in info:
                    return SlotMap.standalone(node)
                (reply,) = await self.roundtrip(node, [("CLUSTER", "SLOTS")])
                if isinstance(reply, ResponseError):
                    raise PoolUnavailable(f"CLUSTER SLOTS failed on {node}: {reply}")
                slots = SlotMap.from_cluster_slots(reply, node)
                if not slots.nodes:
                    raise PoolUnavailable(f"the cluster at {node} has no slots assigned yet")
                if self._url_kwargs.get("db", 0):
                    raise PoolError("a Redis Cluster has only database 0; drop the /<db> from the URL")
                return slots
            except PoolUnavailable as exc:
                last = exc
        raise last if last is not None else PoolUnavailable("no Redis node to ask")

    # -- routed commands ----------------------------------------------------------------------

    async def _node_run(self, node: Node, commands: list[Command], partial: bool) -> list[Any]:
        try:
            return await self.roundtrip(node, commands)
        except PoolUnavailable as exc:
            if not partial:
                raise
            return [exc] * len(commands)

    async def run(self, calls: Sequence[tuple[str | None, Command]], *, partial: bool = False) -> list[Any]:
        """Run ``(routing key, command)`` pairs; each goes to the node serving its key.

        Commands for one node are pipelined on one connection, nodes in parallel; replies
        come back in call order. Redirects are followed (module docstring); a reply that
        still is an error after that is returned as the ``ResponseError`` value. With
        ``partial``, an unreachable node's replies are its :class:`PoolUnavailable`.
        """
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        asking: dict[int, Node] = {}  # call -> the node an ASK sent it to
        for attempt in range(self.config.retries + 2):
            slots = await self.topology()
            by_node: dict[Node, list[int]] = defaultdict(list)
            for i in todo:
                key = calls[i][0]
                node = asking.get(i) or (slots.node_for(key) if key is not None else self.seed)
                if node is None:
                    lost = PoolUnavailable(f"no node serves the slot of {key!r}")
                    if not partial:
                        raise lost
                    replies[i] = lost
                    continue
                by_node[node].append(i)
            results = await gather_all([
                self._node_run(node, [c for i in idx for c in ((("ASKING",),) if i in asking else ()) + (calls[i][1],)], partial)
                for node, idx in by_node.items()
            ])
            moved = wait = False
            again = []
            for idx, got in zip(by_node.values(), results):
                pos = 0
                for i in idx:
                    pos += i in asking  # skip the ASKING reply
                    reply = replies[i] = got[pos]
                    pos += 1
                    code = error_code(reply)
                    if code in RETRY_CODES:
                        again.append(i)
                        moved |= code == "MOVED"
                        wait |= code not in ("MOVED", "ASK")
                        if code == "ASK":
                            asking[i] = ask_target(reply)
                        else:
                            asking.pop(i, None)
            if not again or attempt > self.config.retries:
                break
            todo = again
            if moved:
                await self.refresh()
            if wait:
                await asyncio.sleep(self.config.retry_backoff_s * 2**attempt)
        if replies and all(isinstance(r, PoolUnavailable) for r in replies):
            raise replies[0]
        return replies

    async def scripts(self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]], *, partial: bool = False) -> list[Any]:
        """Run ``(script, keys, args)`` with EVALSHA, each routed by its first key; load and retry on NOSCRIPT.

        A script error raises :class:`PoolError`; with ``partial`` an unreachable node's
        calls get its :class:`PoolUnavailable` as their reply (see ``run``).
        """
        routed = [(keys[0] if keys else None, ("EVALSHA", SHA[s], len(keys), *keys, *args)) for s, keys, args in calls]
        replies = await self.run(routed, partial=partial)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # Redis restarted or flushed its script cache. Every script here is idempotent
            # or, for NOSCRIPT replies, never ran: loading and re-running is safe.
            slots = await self.topology()
            for node in {slots.node_for(routed[i][0]) if routed[i][0] else self.seed for i in missing}:
                await self.roundtrip(node, [("SCRIPT", "LOAD", s) for s in {calls[i][0] for i in missing}])  # type: ignore[arg-type]
            again = await self.run([routed[i] for i in missing], partial=partial)
            for i, r in zip(missing, again):
                replies[i] = r
        for r in replies:
            if isinstance(r, ResponseError):
                raise PoolError(f"redis script failed: {r}") from r
        return replies

    async def ping(self) -> list[Node]:
        """PING every node; the nodes that did not answer. Raises if none answered."""
        slots = await self.topology()
        replies = await gather_all([self._node_run(n, [("PING",)], True) for n in slots.nodes])
        down = [node for node, (reply,) in zip(slots.nodes, replies) if isinstance(reply, (PoolUnavailable, ResponseError))]
        if len(down) == len(slots.nodes):
            first = replies[0][0]
            raise first if isinstance(first, PoolUnavailable) else PoolUnavailable(f"redis PING failed: {first}")
        return down

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


async def _exchange(conn: AbstractConnection, commands: Sequence[Command]) -> list[Any]:
    # Packed by the bulk path's RESP framer, not redis-py's ``pack_commands``: a lease's 16
    # scripts carry ~170 arguments, and redis-py's per-argument encoder was the largest
    # share of the Python a lease costs the event loop (which the engine thread competes
    # with for the GIL). Arguments are str, bytes or int here.
    frames = Frames()
    for command in commands:
        frames.command(*command)
    await conn.send_packed_command(frames.finish())
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await conn.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


async def gather_all(coros: Sequence[Any]) -> list[Any]:
    """Run coroutines in parallel; on a failure or cancellation stop and await the rest first,
    so that no orphan keeps a connection after the call returned."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
