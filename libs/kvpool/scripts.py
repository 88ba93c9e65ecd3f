"""The pool's Lua scripts. Each touches the keys of ONE partition only, all passed in KEYS
(Redis Cluster forbids a script to name keys at run time or span slots; the schema and
why it is partitioned are in libs/kvpool/redis_pool.py).

Every script carries ``#!lua flags=allow-oom``: the pool's bookkeeping must work when
Redis is full (reads, leases, eviction, and the accounting of values already written);
read-only ones also ``no-writes``. Flags need Redis >= 7.0.
"""

from __future__ import annotations

import hashlib

_NOW_MS = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""

# KEYS: lru, size, bytes, stats, pins, leases, lease set, data keys...; ARGV: lease id or "",
# then the block ids of those data keys. Sent right after the SETs of those blocks (one
# partition's blocks of one pipeline; libs/kvpool/redis_pool.py, "put"), which wrote each
# value with a TTL: the script makes the values it accounts persistent. A block whose SET
# was refused (no value) is skipped. Returns how many of the blocks are new.
ACCOUNT_LUA = "#!lua flags=allow-oom\n" + _NOW_MS + """
local lease = ARGV[1]
local n = #ARGV - 1
if lease ~= '' then
  local expiry = tonumber(redis.call('ZSCORE', KEYS[6], lease) or '-1')
  if expiry <= now then
    for i = 1, n do
      if not redis.call('HGET', KEYS[2], ARGV[i + 1]) then redis.call('DEL', KEYS[i + 7]) end
    end
    return redis.error_reply('NOLEASE lease ' .. lease .. ' is unknown or expired')
  end
end
local created, written, delta, puts = 0, 0, 0, 0
for i = 1, n do
  local id, key = ARGV[i + 1], KEYS[i + 7]
  local len = redis.call('STRLEN', key)
  if len > 0 then
    redis.call('PERSIST', key)
    local old = tonumber(redis.call('HGET', KEYS[2], id) or '-1')
    if lease ~= '' and redis.call('SADD', KEYS[7], id) == 1 then redis.call('HINCRBY', KEYS[5], id, 1) end
    if old ~= len then
      redis.call('HSET', KEYS[2], id, len)
      delta = delta + len - math.max(old, 0)
    end
    redis.call('ZADD', KEYS[1], now, id)
    puts = puts + 1
    written = written + len
    if old < 0 then created = created + 1 end
  end
end
if delta ~= 0 then redis.call('INCRBY', KEYS[3], delta) end
if puts > 0 then
  redis.call('HINCRBY', KEYS[4], 'puts', puts)
  redis.call('HINCRBY', KEYS[4], 'bytes_written', written)
end
return created
"""

# KEYS: lru, stats, data keys...; ARGV: the block ids of those data keys.
# Sent after the GETs of one partition on the same connection: counts a hit (and its
# bytes) for each block that exists, a miss for each that does not, and bumps the LRU of
# the hits (ZADD XX: never re-inserts a block evicted in between).
TOUCH_LUA = "#!lua flags=allow-oom\n" + _NOW_MS + """
local hits, bytes = 0, 0
for i = 1, #ARGV do
  local n = redis.call('STRLEN', KEYS[i + 2])
  if n > 0 then
    redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i])
    hits = hits + 1
    bytes = bytes + n
  end
end
if hits > 0 then
  redis.call('HINCRBY', KEYS[2], 'hits', hits)
  redis.call('HINCRBY', KEYS[2], 'bytes_read', bytes)
end
if #ARGV > hits then redis.call('HINCRBY', KEYS[2], 'misses:absent', #ARGV - hits) end
return hits
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

# KEYS: lru, pins, size, bytes; ARGV: how many candidates, how many entries to scan at most.
# The oldest unpinned blocks: {more, bytes, id, stamp, size, id, stamp, size, ...}; ``more``
# is 1 when the scan stopped early (older-first order: the ones not returned are newer).
EVICT_CANDIDATES_LUA = """#!lua flags=no-writes,allow-oom
local want, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {0, tonumber(redis.call('GET', KEYS[4]) or '0')}
local found, pos = 0, 0
while found < want and pos < budget do
  local batch = redis.call('ZRANGE', KEYS[1], pos, pos + 99, 'WITHSCORES')
  if #batch == 0 then return out end
  for i = 1, #batch, 2 do
    local id = batch[i]
    pos = pos + 1
    if tonumber(redis.call('HGET', KEYS[2], id) or '0') <= 0 then
      out[#out + 1] = id
      out[#out + 1] = batch[i + 1]
      out[#out + 1] = tonumber(redis.call('HGET', KEYS[3], id) or '0')
      found = found + 1
      if found >= want then break end
    end
  end
end
if found >= want or pos >= budget then out[1] = 1 end
return out
"""

# KEYS: lru, size, bytes, stats, pins, data keys...; ARGV: id, stamp, id, stamp, ...
# Evicts the named blocks unless pinned since, or read or written since (their LRU stamp
# moved on, or they are gone). Returns {evicted, freed bytes, partition bytes after}.
EVICT_LUA = """#!lua flags=allow-oom
local evicted, freed = 0, 0
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local stamp = redis.call('ZSCORE', KEYS[1], id)
  if stamp and tonumber(stamp) <= tonumber(ARGV[i + 1])
     and tonumber(redis.call('HGET', KEYS[5], id) or '0') <= 0 then
    local sz = tonumber(redis.call('HGET', KEYS[2], id) or '0')
    redis.call('DEL', KEYS[5 + (i + 1) / 2])
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[1], id)
    freed = freed + sz
    evicted = evicted + 1
  end
end
if evicted > 0 then
  redis.call('DECRBY', KEYS[3], freed)
  redis.call('HINCRBY', KEYS[4], 'evictions', evicted)
  redis.call('HINCRBY', KEYS[4], 'evicted_bytes', freed)
end
return {evicted, freed, tonumber(redis.call('GET', KEYS[3]) or '0')}
"""

# KEYS: leases; ARGV: max leases. The ids of leases whose TTL has passed (Redis' clock).
DUE_LEASES_LUA = "#!lua flags=no-writes,allow-oom\n" + _NOW_MS + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
"""

# KEYS: leases, pins, lease sets...; ARGV: the lease ids of those sets.
# Per lease 1 if it was live here (released now), else 0.
RELEASE_LUA = """#!lua flags=allow-oom
local out = {}
for i = 1, #ARGV do
  local gone = redis.call('ZREM', KEYS[1], ARGV[i])
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[i + 2])) do
    if redis.call('HINCRBY', KEYS[2], id, -1) <= 0 then redis.call('HDEL', KEYS[2], id) end
  end
  redis.call('DEL', KEYS[i + 2])
  out[i] = gone
end
return out
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

# Run with EVALSHA by the control plane (reloaded on NOSCRIPT). ACCOUNT and TOUCH are sent
# whole with EVAL by the bulk path: a NOSCRIPT there would cost a block write a round trip
# (or leave its values to their TTL), and both are small next to the values they travel with.
EVALSHA_SCRIPTS = (
    DELETE_LUA, EVICT_CANDIDATES_LUA, EVICT_LUA, DUE_LEASES_LUA, RELEASE_LUA, CREATE_LEASE_LUA, COUNT_LUA,
)
SHA = {script: hashlib.sha1(script.encode()).hexdigest() for script in EVALSHA_SCRIPTS}
