"""The KV block pool. One module per job; import from the module (nothing is re-exported, so
that a process which only needs the pool client, like cache_store, never loads torch):

- layout.py      KVLayout: the byte layout of one block, shared with the engine and kernels
- header.py      the value format: header fields, inspect_block, BlockDecodeError (no torch)
- codec.py       BlockCodec: encode/decode a block between staging tensors and values
- pool.py        BlockPool: the interface, block ids, errors, stats
- config.py      PoolConfig: URL, password, key prefix, batching, timeouts, retries, bulk model
- redis_pool.py  RedisPool: the client on Redis or Redis Cluster, and the pool's Redis schema
- topology.py    slot maps, key slots, partitions and their hash tags (no I/O)
- control.py     the control plane: redis-py per node, routed; cluster detection
- bulk.py        the zero-copy bulk path: sockets, concurrency models, faults
- resp.py        RESP2 frames and the reply parser that fills caller memory
- scripts.py     the Lua scripts
- memory.py      MemoryPool: the in-memory twin with fault injection, for unit tests
- writer.py      AsyncWriter: begin -> submit* -> wait_all_done
"""
