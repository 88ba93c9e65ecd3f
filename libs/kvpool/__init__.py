"""The KV block pool: block layout and codec, the pool client (Redis, and an in-memory twin), the async writer.

- layout.py      KVLayout: the byte layout of one block, shared with the engine and kernels
- codec.py       BlockCodec: one value per block, header + checksummed payload
- pool.py        BlockPool: the interface, block ids, errors, stats
- config.py      PoolConfig: URL, password, key prefix, batching, timeouts, retries
- redis_pool.py  RedisPool: the client on Redis, and the pool's Redis schema
- memory.py      MemoryPool: the in-memory twin with fault injection, for unit tests
- writer.py      AsyncWriter: begin -> submit* -> wait_all_done
"""

from libs.kvpool.codec import DECODE_REASONS, BlockCodec, BlockDecodeError, BlockHeader, inspect_block
from libs.kvpool.config import PoolConfig
from libs.kvpool.layout import LAYOUT_VERSION, KVLayout
from libs.kvpool.memory import MemoryPool
from libs.kvpool.pool import (
    BlockPool,
    EvictResult,
    PoolError,
    PoolStats,
    PoolUnavailable,
    PutError,
    block_id,
    parse_block_id,
)
from libs.kvpool.redis_pool import RedisPool
from libs.kvpool.writer import AsyncWriter, SessionCancelled, WriteFailed, WriteReport, WriterClosed, WriteSession

__all__ = [
    "DECODE_REASONS",
    "LAYOUT_VERSION",
    "AsyncWriter",
    "BlockCodec",
    "BlockDecodeError",
    "BlockHeader",
    "BlockPool",
    "EvictResult",
    "KVLayout",
    "MemoryPool",
    "PoolConfig",
    "PoolError",
    "PoolStats",
    "PoolUnavailable",
    "PutError",
    "RedisPool",
    "SessionCancelled",
    "WriteFailed",
    "WriteReport",
    "WriteSession",
    "WriterClosed",
    "block_id",
    "inspect_block",
    "parse_block_id",
]
