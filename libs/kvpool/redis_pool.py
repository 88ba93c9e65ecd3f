"""The pool client on Redis (redis.asyncio + hiredis), and the pool's Redis schema.

Schema. With ``P`` the configured key prefix and a *block id* ``<namespace hex>:<block key>``
(libs/kvpool/pool.py)::

    P:kv:<block id>    string  the encoded block (libs/kvpool/header.py)
    P:lru              zset    block id -> last write/read, ms of Redis TIME
    P:size             hash    block id -> value bytes; the blocks the pool accounts for
    P:bytes            string  sum of P:size (value bytes, not Redis overhead)
    P:stats            hash    counters: hits, misses:<reason>, puts, bytes_written,
                               bytes_read, evictions, evicted_bytes, write_errors:<reason>
    P:pins             hash    block id -> number of live leases pinning it (absent = 0)
    P:leases           zset    lease id -> expiry, ms of Redis TIME
    P:lease:<lease id> set     the block ids the lease pins

Bookkeeping is maintained by every client in the same atomic step as the data, so
cache_store sees every block although no bytes pass through it:

- put: per block ``MULTI; SET P:kv:<id> <value>; EVAL account; EXEC``. The account script
  counts the block's bytes only on creation (``P:size`` has no entry yet), stamps the LRU,
  counts the write, and pins the block under the lease if one is given. Under
  ``maxmemory`` + ``noeviction`` Redis refuses the queued SET, the transaction aborts
  (EXECABORT), and that one block fails with reason ``"oom"``; nothing half-done remains.
  An unknown or expired lease makes the script undo a SET that created the key and fail
  the block with reason ``"lease"``. The account script is sent with EVAL, not EVALSHA,
  because a NOSCRIPT inside EXEC (after a Redis restart) would leave the SET applied
  without its bookkeeping; the script is 1 kB against a value of hundreds of kB.
- get: the GETs of a batch are pipelined (no MULTI: one batch's replies must not hold up
  other clients), then one ``touch`` script bumps the LRU of the blocks actually received
  (``ZADD XX``: never re-inserts one evicted in between) and counts hits, ``bytes_read``
  and ``misses:absent``.
- evict, reap, leases, delete, exists_prefix, counters: one script each, run with EVALSHA
  and reloaded on NOSCRIPT. Scripts that must work when Redis is full (evict, reap,
  release, touch, counters) carry ``#!lua flags=allow-oom``.

A lease pins each block id once (the set ``P:lease:<id>``), and ``P:pins`` counts the
leases, so two leases on one block both hold it. The evict script skips pinned blocks.
Expired leases keep pinning until reaped (cache_store reaps before it evicts).

The evict and reap scripts build key names at run time (``P:kv:`` + member), which
standalone Redis allows; the pool is not meant for Redis Cluster. Script flags
(``#!lua flags=...``) need Redis >= 7.0.

Replies are read raw (RESP2, no redis-py response callbacks) from pooled connections, and
values are sent without copying (redis-py passes large arguments to the socket as they
are). Reading is where the client spends its CPU: redis-py's asyncio reader copies every
byte several times (transport buffer, StreamReader, hiredis buffer, the result object);
bench/pool_throughput.py measures what that costs against redis-benchmark.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable, Sequence, TypeVar

from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, OutOfMemoryError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from libs.kvpool.header import Buffer
from libs.kvpool.config import PoolConfig, redact_url
from libs.kvpool.pool import BlockPool, EvictResult, PoolError, PoolStats, PoolUnavailable, PutError

T = TypeVar("T")

_NOW_MS = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# KEYS: data, lru, size, bytes, stats, pins, leases, lease set; ARGV: block id, lease id or "".
ACCOUNT_LUA = _NOW_MS + """
local id = ARGV[1]
local len = redis.call('STRLEN', KEYS[1])
local old = tonumber(redis.call('HGET', KEYS[3], id) or '-1')
if ARGV[2] ~= '' then
  local expiry = tonumber(redis.call('ZSCORE', KEYS[7], ARGV[2]) or '-1')
  if expiry <= now then
    if old < 0 then redis.call('DEL', KEYS[1]) end
    return redis.error_reply('NOLEASE lease ' .. ARGV[2] .. ' is unknown or expired')
  end
  if redis.call('SADD', KEYS[8], id) == 1 then redis.call('HINCRBY', KEYS[6], id, 1) end
end
if old ~= len then
  redis.call('HSET', KEYS[3], id, len)
  redis.call('INCRBY', KEYS[4], len - math.max(old, 0))
end
redis.call('ZADD', KEYS[2], now, id)
redis.call('HINCRBY', KEYS[5], 'puts', 1)
redis.call('HINCRBY', KEYS[5], 'bytes_written', len)
if old < 0 then return 1 end
return 0
"""

# KEYS: lru, stats; ARGV: bytes read, absent count, ids received...
TOUCH_LUA = "#!lua flags=allow-oom\n" + _NOW_MS + """
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i]) end
local hits = #ARGV - 2
if hits > 0 then
  redis.call('HINCRBY', KEYS[2], 'hits', hits)
  redis.call('HINCRBY', KEYS[2], 'bytes_read', ARGV[1])
end
if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[2], 'misses:absent', ARGV[2]) end
return hits
"""

# KEYS: data keys in order.
EXISTS_PREFIX_LUA = """#!lua flags=no-writes,allow-oom
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""

# KEYS: lru, size, bytes, data keys...; ARGV: the block ids of those data keys.
DELETE_LUA = """#!lua flags=allow-oom
local n, freed = 0, 0
for i = 1, #ARGV do
  local id = ARGV[i]
  n = n + redis.call('DEL', KEYS[i + 3])
  local sz = redis.call('HGET', KEYS[2], id)
  if sz then
    redis.call('HDEL', KEYS[2], id)
    freed = freed + tonumber(sz)
  end
  redis.call('ZREM', KEYS[1], id)
end
if freed > 0 then redis.call('DECRBY', KEYS[3], freed) end
return n
"""

# KEYS: lru, size, bytes, stats, pins; ARGV: "P:kv:", budget bytes, max blocks.
EVICT_LUA = """#!lua flags=allow-oom
local bytes = tonumber(redis.call('GET', KEYS[3]) or '0')
local budget, max_n = tonumber(ARGV[2]), tonumber(ARGV[3])
local evicted, freed, skipped = 0, 0, 0
while bytes > budget and evicted < max_n do
  local batch = redis.call('ZRANGE', KEYS[1], skipped, skipped + 99)
  if #batch == 0 then break end
  for _, id in ipairs(batch) do
    if bytes <= budget or evicted >= max_n then break end
    if tonumber(redis.call('HGET', KEYS[5], id) or '0') > 0 then
      skipped = skipped + 1
    else
      local sz = tonumber(redis.call('HGET', KEYS[2], id) or '0')
      redis.call('DEL', ARGV[1] .. id)
      redis.call('HDEL', KEYS[2], id)
      redis.call('ZREM', KEYS[1], id)
      bytes = bytes - sz
      freed = freed + sz
      evicted = evicted + 1
    end
  end
end
if evicted > 0 then
  redis.call('DECRBY', KEYS[3], freed)
  redis.call('HINCRBY', KEYS[4], 'evictions', evicted)
  redis.call('HINCRBY', KEYS[4], 'evicted_bytes', freed)
end
return {evicted, freed, bytes}
"""

_RELEASE_FN = """
local function release(lid)
  local gone = redis.call('ZREM', KEYS[1], lid)
  local set = ARGV[1] .. lid
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    if redis.call('HINCRBY', KEYS[2], id, -1) <= 0 then redis.call('HDEL', KEYS[2], id) end
  end
  redis.call('DEL', set)
  return gone
end
"""

# KEYS: leases, pins; ARGV: "P:lease:", lease ids...
RELEASE_LUA = "#!lua flags=allow-oom\n" + _RELEASE_FN + """
local n = 0
for i = 2, #ARGV do n = n + release(ARGV[i]) end
return n
"""

# KEYS: leases, pins; ARGV: "P:lease:", max leases.
REAP_LUA = "#!lua flags=allow-oom\n" + _NOW_MS + _RELEASE_FN + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, lid in ipairs(due) do release(lid) end
return #due
"""

# KEYS: leases, lease set, pins; ARGV: lease id, ttl ms, block ids...
CREATE_LEASE_LUA = "#!lua flags=allow-oom\n" + _NOW_MS + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
for i = 3, #ARGV do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then redis.call('HINCRBY', KEYS[3], ARGV[i], 1) end
end
return #ARGV - 2
"""

# KEYS: stats; ARGV: field, n, field, n, ...
COUNT_LUA = """#!lua flags=allow-oom
for i = 1, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

_EVALSHA_SCRIPTS = (
    TOUCH_LUA, EXISTS_PREFIX_LUA, DELETE_LUA, EVICT_LUA, RELEASE_LUA, REAP_LUA, CREATE_LEASE_LUA, COUNT_LUA,
)
_SHA = {script: hashlib.sha1(script.encode()).hexdigest() for script in _EVALSHA_SCRIPTS}

_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)


def _classify_put(replies: Sequence[Any]) -> PutError | None:
    """The outcome of one block's ``MULTI; SET; EVAL; EXEC`` replies."""
    exec_reply = replies[3]
    if isinstance(exec_reply, ResponseError):
        queued = [r for r in replies[1:3] if isinstance(r, ResponseError)]
        cause = queued[0] if queued else exec_reply
        if isinstance(cause, OutOfMemoryError):
            return PutError("oom", str(cause))
        return PutError("rejected", str(cause))
    account = exec_reply[1]
    if isinstance(account, ResponseError):
        if str(account).startswith("NOLEASE"):
            return PutError("lease", str(account))
        return PutError("rejected", str(account))
    return None


class RedisPool(BlockPool):
    """:class:`BlockPool` on Redis. Construct with a :class:`PoolConfig`; no I/O until first use."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._pool = BlockingConnectionPool.from_url(
            config.url,
            password=config.password,
            max_connections=config.max_connections,
            timeout=config.connect_timeout_s + config.socket_timeout_s,
            socket_connect_timeout=config.connect_timeout_s,
            socket_timeout=config.socket_timeout_s,
            socket_read_size=config.socket_read_size,
            retry_on_timeout=False,
            retry=None,  # retries are ours (_roundtrip): whole idempotent batches
            protocol=2,  # replies are read raw, so their shapes are pinned to RESP2
        )
        p = config.key_prefix
        self._kv = f"{p}:kv:"
        self._lease_prefix = f"{p}:lease:"
        self._lru, self._size, self._bytes = f"{p}:lru", f"{p}:size", f"{p}:bytes"
        self._stats, self._pins, self._leases = f"{p}:stats", f"{p}:pins", f"{p}:leases"

    # -- transport ------------------------------------------------------------------------

    async def _roundtrip(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` pipelined on one pooled connection; replies in order.

        Error replies come back as ``ResponseError`` values. A dropped connection or a
        timeout is retried (every caller's commands are idempotent); after the last
        retry it becomes :class:`PoolUnavailable`.
        """
        last: BaseException | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            try:
                conn = await self._pool.get_connection()
            except _TRANSIENT as exc:
                last = exc
                continue
            try:
                return await self._exchange(conn, commands)
            except _TRANSIENT as exc:
                last = exc
                await conn.disconnect(nowait=True)
            except BaseException:
                # Cancelled (or worse) mid-exchange: replies may still be in flight, so
                # the connection's state is unknown and it must not be reused.
                await conn.disconnect(nowait=True)
                raise
            finally:
                await self._pool.release(conn)
        raise PoolUnavailable(f"redis at {redact_url(self.config.url)}: {type(last).__name__}: {last}") from last

    @staticmethod
    async def _exchange(conn: AbstractConnection, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        await conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies

    async def _scripts(self, calls: Sequence[tuple[str, Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """Run ``(script, keys, args)`` calls pipelined with EVALSHA; load and retry on NOSCRIPT."""
        commands = [("EVALSHA", _SHA[s], len(keys), *keys, *args) for s, keys, args in calls]
        replies = await self._roundtrip(commands)
        if any(isinstance(r, NoScriptError) for r in replies):
            # Redis restarted or flushed its script cache. Every script here is
            # idempotent or, for NOSCRIPT replies, never ran: loading and re-running is safe.
            await self._roundtrip([("SCRIPT", "LOAD", s) for s in {s for s, _, _ in calls}])
            replies = await self._roundtrip(commands)
        for r in replies:
            if isinstance(r, ResponseError):
                raise PoolError(f"redis script failed: {r}") from r
        return replies

    async def _script(self, script: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        return (await self._scripts([(script, keys, args)]))[0]

    async def _chunked(self, items: Sequence[T], run: Callable[[Sequence[T]], Awaitable[list[Any]]]) -> list[Any]:
        """Run ``run`` on ``pipeline_blocks``-sized chunks, ``max_parallel`` at a time; concatenate."""
        size = self.config.pipeline_blocks
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        if len(chunks) <= 1:
            return await run(items) if items else []
        gate = asyncio.Semaphore(self.config.max_parallel)

        async def bounded(chunk: Sequence[T]) -> list[Any]:
            async with gate:
                return await run(chunk)

        tasks = [asyncio.ensure_future(bounded(c)) for c in chunks]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            # On failure or cancellation, stop the other chunks and wait for them, so no
            # orphan task keeps using a connection after this call returned.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [r for chunk in results for r in chunk]

    # -- data plane -------------------------------------------------------------------------

    async def _exists_prefix(self, ids: list[str]) -> int:
        return int(await self._script(EXISTS_PREFIX_LUA, [self._kv + i for i in ids], []))

    async def _exists_blocks(self, ids: list[str]) -> list[bool]:
        async def run(chunk: Sequence[str]) -> list[Any]:
            return await self._roundtrip([("EXISTS", self._kv + i) for i in chunk])

        return [bool(r) for r in await self._chunked(ids, run)]

    async def _get_blocks(self, ids: list[str]) -> list[bytes | None]:
        return await self._chunked(ids, self._get_chunk)

    async def _get_chunk(self, ids: Sequence[str]) -> list[bytes | None]:
        values = await self._roundtrip([("GET", self._kv + i) for i in ids])
        for v in values:
            if isinstance(v, ResponseError):
                raise PoolError(f"redis GET failed: {v}") from v
        hit_ids = [i for i, v in zip(ids, values) if v is not None]
        nbytes = sum(len(v) for v in values if v is not None)
        await self._script(TOUCH_LUA, [self._lru, self._stats], [nbytes, len(ids) - len(hit_ids), *hit_ids])
        return values

    async def _put_blocks(self, pairs: list[tuple[str, Buffer]], lease_id: str | None) -> list[PutError | None]:
        async def run(chunk: Sequence[tuple[str, Buffer]]) -> list[Any]:
            return await self._put_chunk(chunk, lease_id or "")

        results = await self._chunked(pairs, run)
        failed: dict[str, int] = {}
        for r in results:
            if r is not None:
                failed[f"write_errors:{r.reason}"] = failed.get(f"write_errors:{r.reason}", 0) + 1
        if failed:
            await self._count(failed)
        return results

    async def _put_chunk(self, pairs: Sequence[tuple[str, Buffer]], lease_id: str) -> list[PutError | None]:
        lease_set = self._lease_prefix + lease_id
        fixed = (self._lru, self._size, self._bytes, self._stats, self._pins, self._leases, lease_set)
        commands: list[tuple[Any, ...]] = []
        for bid, value in pairs:
            data = self._kv + bid
            commands += [
                ("MULTI",),
                ("SET", data, value),
                ("EVAL", ACCOUNT_LUA, 8, data, *fixed, bid, lease_id),
                ("EXEC",),
            ]
        replies = await self._roundtrip(commands)
        return [_classify_put(replies[i : i + 4]) for i in range(0, len(replies), 4)]

    async def _delete_blocks(self, ids: list[str]) -> int:
        keys = [self._lru, self._size, self._bytes, *(self._kv + i for i in ids)]
        return int(await self._script(DELETE_LUA, keys, ids))

    # -- leases -------------------------------------------------------------------------------

    async def _create_lease(self, lease_id: str, ids: list[str], ttl_s: float) -> None:
        keys = [self._leases, self._lease_prefix + lease_id, self._pins]
        await self._script(CREATE_LEASE_LUA, keys, [lease_id, max(1, round(ttl_s * 1000)), *ids])

    async def _release_lease(self, lease_id: str) -> bool:
        n = await self._script(RELEASE_LUA, [self._leases, self._pins], [self._lease_prefix, lease_id])
        return bool(n)

    async def reap_leases(self, max_leases: int = 1000) -> int:
        return int(await self._script(REAP_LUA, [self._leases, self._pins], [self._lease_prefix, max_leases]))

    # -- accounting and policy ---------------------------------------------------------------

    async def _count(self, counters: dict[str, int]) -> None:
        args = [x for name, n in counters.items() for x in (name, n)]
        await self._script(COUNT_LUA, [self._stats], args)

    async def stats(self) -> PoolStats:
        blocks, nbytes, leases, pinned, raw = await self._roundtrip(
            [
                ("HLEN", self._size),
                ("GET", self._bytes),
                ("ZCARD", self._leases),
                ("HLEN", self._pins),
                ("HGETALL", self._stats),
            ]
        )
        # Raw replies (no redis-py callbacks): HGETALL is a flat [field, value, ...] list.
        counters = {raw[i].decode(): int(raw[i + 1]) for i in range(0, len(raw), 2)}
        return PoolStats.from_counters(
            blocks=int(blocks), bytes=int(nbytes or 0), leases=int(leases), pinned_blocks=int(pinned),
            counters=counters,
        )

    async def evict(self, budget_bytes: int, max_blocks: int) -> EvictResult:
        keys_ = [self._lru, self._size, self._bytes, self._stats, self._pins]
        evicted, freed, after = await self._script(EVICT_LUA, keys_, [self._kv, budget_bytes, max_blocks])
        return EvictResult(int(evicted), int(freed), int(after))

    # -- lifecycle ------------------------------------------------------------------------------

    async def ping(self) -> None:
        (reply,) = await self._roundtrip([("PING",)])
        if isinstance(reply, ResponseError):
            raise PoolUnavailable(f"redis PING failed: {reply}") from reply

    async def close(self) -> None:
        await self._pool.aclose()
