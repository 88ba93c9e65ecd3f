"""One request uses the pool's full parallelism (issue 8): its blocks spread over every
socket of the node, each write acknowledged on its own, and decode's overlapping fetches
committed in order, with a missing block still ending the run. Real Redis (and a real
Redis Cluster), the worker's transfer code."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kernels.swap import BlockSwapper
from libs.blocks.keys import block_keys
from libs.kvpool.config import PoolConfig
from libs.kvpool.pool import PutError
from libs.kvpool.redis_pool import RedisPool
from services.worker.transfer import StagedRun, finish_load, store_blocks
from tests.integration.conftest import unique_prefix
from tests.integration.test_pool_handoff_leaks import LAYOUT, NS, export, runtime

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model", ["threads", "asyncio"])
async def test_one_call_spreads_over_every_socket_and_acknowledges_each_block(pool_url: str, model: str) -> None:
    keys = block_keys(NS, list(range(16 * 24)))
    vals = [os.urandom(4096 + i) for i in range(len(keys))]
    cfg = PoolConfig(url=pool_url, key_prefix=unique_prefix(), pipeline_blocks=16, max_parallel=4, bulk_model=model)
    async with RedisPool(cfg) as pool:
        acked: list[int] = []
        returned = False

        def written(i: int) -> None:
            assert not returned, "an acknowledgement after the call returned"
            acked.append(i)

        assert await pool.put_blocks(NS, list(zip(keys, vals)), on_written=written) == [None] * len(keys)
        returned = True
        assert sorted(acked) == list(range(len(keys)))
        # 24 blocks fit two pipelines of 16: striped, they use every socket of each node.
        assert pool.bulk.open_sockets == cfg.max_parallel * len(pool.bulk._nodes)
        assert await pool.get_blocks(NS, keys) == vals

        lease = await pool.create_lease(NS, keys[:4], ttl_s=30)
        await pool.release_lease(lease)  # a write under it is refused: no acknowledgement
        acked.clear()
        returned = False
        results = await pool.put_blocks(NS, list(zip(keys[:4], vals[:4])), lease_id=lease, on_written=written)
        assert all(isinstance(r, PutError) and r.reason == "lease" for r in results) and acked == []


async def test_overlapping_fetches_commit_in_order_and_a_gap_ends_the_run(pool_url: str) -> None:
    swapper = BlockSwapper(LAYOUT.allocate(16), max_blocks=4, num_buffers=4)  # a run spans several buffers
    exporter = BlockSwapper(LAYOUT.allocate(16), max_blocks=16, num_buffers=1)
    pool = RedisPool(PoolConfig(url=pool_url, key_prefix=unique_prefix()))
    rt = runtime(pool, swapper)
    try:
        tokens = 16 * 10
        keys = block_keys(NS, list(range(7, 7 + tokens)))
        exported, data = export(exporter, tokens, 1)
        stored = await store_blocks(rt, exported, keys, 0, None)
        assert stored.blocks_written == len(keys)

        # All fetches of the run in flight at once; the last finishes first.
        run = StagedRun(rt, 0, len(keys))
        pieces = [run.start_fetch(keys[0:3]), run.start_fetch(keys[3:6]), run.start_fetch(keys[6:10])]
        assert run.requested == len(keys)
        assert await asyncio.gather(*pieces) == [3, 3, 4]
        load = finish_load(rt, run, run.fetch_s)
        assert load.hit_blocks == len(keys) and not load.miss_reasons
        got = torch.cat([b.host for b in load.kv_import.buffers])[: len(keys)]
        assert torch.equal(got, data)
        load.kv_import.release()

        # Block 4 missing: the second fetch breaks the run there; the third, although it
        # read all of its blocks, lies after the gap and is not committed.
        await pool.delete_blocks(NS, keys[4:5])
        run = StagedRun(rt, 0, len(keys))
        pieces = [run.start_fetch(keys[0:3]), run.start_fetch(keys[3:6]), run.start_fetch(keys[6:10])]
        assert await asyncio.gather(*pieces) == [3, 1, 0]
        load = finish_load(rt, run, run.fetch_s)
        assert load.hit_blocks == 4 and load.miss_reasons == {"absent": 1, "after_gap": 5}
        got = torch.cat([b.host for b in load.kv_import.buffers])[:4]
        assert torch.equal(got, data[:4])
        load.kv_import.release()

        # Cancelled mid-flight: every fetch settles, nothing is committed past the cancel,
        # and the staging goes back.
        run = StagedRun(rt, 0, len(keys))
        pieces = [run.start_fetch(keys[0:5]), run.start_fetch(keys[5:10])]
        pieces[0].cancel()
        results = await asyncio.gather(*pieces, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError) and results[1] == 0 and run.filled == 0
        run.release()
        assert swapper.in_use == 0
        await pool.delete_blocks(NS, keys)
    finally:
        await rt.writer.close()
        await pool.close()
        swapper.close()
        exporter.close()
