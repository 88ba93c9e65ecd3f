"""Prefill's writes with the checksums computed on the device (kernels/digest through the
swapper), on a real Redis: the values are exactly what a CPU-hashed write stores (cache_store's
integrity check and decode's in-place check pass), and a byte that changes in staging after
the device hashed the block is caught by decode as a corrupt block, never loaded."""

from __future__ import annotations

import pytest
import redis
import torch

from kernels.swap import BlockSwapper
from libs.blocks.keys import block_keys
from libs.engine import ExportedKV
from libs.kvpool.config import PoolConfig
from libs.kvpool.header import inspect_block
from libs.kvpool.pool import block_id
from libs.kvpool.redis_pool import RedisPool, data_key
from services.worker.transfer import load_blocks, store_blocks
from tests.integration.conftest import unique_prefix
from tests.integration.transfer_runtime import LAYOUT, NS, runtime

pytestmark = pytest.mark.integration

TOKENS = 16 * 3 + 5  # three whole blocks and a 5-token tail


def digested_export(swapper: BlockSwapper, cache_ids: list[int]) -> ExportedKV:
    """What the engine hands prefill: the blocks swapped out of the cache, digests computed."""
    bs = LAYOUT.block_size
    tokens = [min(bs, TOKENS - j * bs) for j in range(len(cache_ids))]
    buf = swapper.swap_out(cache_ids, num_tokens=tokens)
    assert buf.digests is not None
    return ExportedKV([buf], TOKENS, bs)


@pytest.fixture
async def rig(redis_server):
    cache = LAYOUT.allocate(8)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(3)))
    swapper = BlockSwapper(cache, max_blocks=4, num_buffers=4, digests=True)
    pool = RedisPool(PoolConfig(url=redis_server.url, key_prefix=unique_prefix()))
    rt = runtime(pool, swapper)
    yield rt, cache, redis_server.url
    await rt.writer.close()
    await pool.close()
    swapper.close()


async def test_device_digested_values_pass_every_reader_check(rig):
    rt, cache, url = rig
    keys = block_keys(NS, list(range(1000, 1000 + TOKENS)))
    ids = [6, 2, 5, 0]
    stored = await store_blocks(rt, digested_export(rt.llm.swapper, ids), keys, 0, None)
    assert stored.blocks_written == 4 and not stored.fail_reasons
    with redis.Redis.from_url(url) as r:  # cache_store's check: header, length, xxh3 on the CPU
        for k in keys:
            header = inspect_block(r.get(data_key(rt.pool.config.key_prefix, block_id(NS, k), cluster=False)))
            assert header.num_tokens == k.num_tokens
    load = await load_blocks(rt, keys, 0, max_tokens=TOKENS)
    assert load.hit_blocks == 4, load.miss_reasons
    try:
        got = torch.cat([b.host for b in load.kv_import.buffers])
        for j, (b, k) in enumerate(zip(ids, keys)):
            assert torch.equal(got[j, :, :, : k.num_tokens], cache[b, :, :, : k.num_tokens])
    finally:
        load.kv_import.release()


async def test_a_byte_changed_after_the_device_hashed_it_is_caught_by_decode(rig):
    """The device digest covers the copy to staging too: staging that differs from the cache
    the digest was taken from (a bad copy, a stray write) reaches the pool with a checksum
    that does not match, and decode stops its load there."""
    rt, _, _ = rig
    keys = block_keys(NS, list(range(5000, 5000 + TOKENS)))
    exported = digested_export(rt.llm.swapper, [1, 3, 4, 7])
    exported.buffers[0].host[2].view(torch.int32)[1, 0, 0, 0, 5] ^= 1 << 20  # block 2, inside its tokens
    stored = await store_blocks(rt, exported, keys, 0, None)
    assert stored.blocks_written == 4  # the pool stores it: only a reader can tell
    load = await load_blocks(rt, keys, 0, max_tokens=TOKENS)
    try:
        assert load.hit_blocks == 2
        assert load.miss_reasons == {"corrupt:checksum": 1, "after_gap": 1}
    finally:
        if load.kv_import is not None:
            load.kv_import.release()
