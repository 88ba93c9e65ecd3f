"""The KV block pool. One module per job; import from the module (nothing is re-exported, so
that a process which only needs the pool client, like cache_store, never loads torch):

- layout.py      KVLayout: the byte layout of one block, shared with the engine and kernels
- header.py      the value format: header fields, inspect_block, BlockDecodeError (no torch)
- codec.py       BlockCodec: encode/decode a block between staging tensors and values
- pool.py        BlockPool: the interface, block ids, errors, stats
- config.py      PoolConfig: URL, password, key prefix, batching, timeouts, retries
- redis_pool.py  RedisPool: the client on Redis, and the pool's Redis schema
- memory.py      MemoryPool: the in-memory twin with fault injection, for unit tests
- writer.py      AsyncWriter: begin -> submit* -> wait_all_done
"""
