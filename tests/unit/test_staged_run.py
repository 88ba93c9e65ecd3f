"""StagedRun with overlapping fetches (services/worker/transfer.py): the streamed handoff
starts the next run's fetch while one is in flight, so fetches may end out of order.
``filled`` must only ever cover the leading rows whose fetches are done and good."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Sequence

import torch

from kernels.swap import BlockSwapper
from libs.blocks.keys import Namespace, block_keys
from libs.engine import ExportedKV
from libs.kvpool.layout import KVLayout
from libs.kvpool.memory import MemoryPool
from libs.kvpool.pool import block_ids
from services.worker.transfer import StagedRun, store_blocks
from tests.transfer_runtime import transfer_runtime

LAYOUT = KVLayout(2, 2, 8, 16, torch.float32)
NS = Namespace(model_digest="staged-run", dtype="float32", block_size=16)
BLOCKS = 8


class Gates:
    """A pool fault hook: a read of a gated block waits for its gate."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, block_id: str) -> asyncio.Event:
        return self.gates.setdefault(block_id, asyncio.Event())

    async def __call__(self, op: str, ids: Sequence[str]) -> None:
        if op in ("get_blocks", "get_blocks_into"):
            for bid in ids:
                if bid in self.gates:
                    await self.gates[bid].wait()


async def setup(gates: Gates, swapper: BlockSwapper) -> tuple[SimpleNamespace, list, torch.Tensor]:
    pool = MemoryPool(fault=gates)
    rt = transfer_runtime(pool, swapper, LAYOUT, NS, role="decode")
    keys = block_keys(NS, list(range(16 * BLOCKS)))
    exporter = BlockSwapper(LAYOUT.allocate(BLOCKS), max_blocks=BLOCKS, num_buffers=1)  # prefill's side
    buf = exporter.acquire(BLOCKS)
    data = torch.randn(BLOCKS, *LAYOUT.block_shape, generator=torch.Generator().manual_seed(3))
    buf.host.copy_(data)
    stored = await store_blocks(rt, ExportedKV([buf], 16 * BLOCKS, 16), keys, 0, None)
    assert stored.blocks_written == BLOCKS
    exporter.close()
    return rt, keys, data


async def test_a_later_fetch_ending_first_waits_for_the_rows_before_it() -> None:
    swapper = BlockSwapper(LAYOUT.allocate(BLOCKS), max_blocks=4, num_buffers=4)
    gates = Gates()
    rt, keys, data = await setup(gates, swapper)
    try:
        held = gates.gate(block_ids(NS, keys[:1])[0])  # the first fetch waits
        run = StagedRun(rt, 0, BLOCKS)
        first = asyncio.create_task(run.fetch(keys[:3]))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(run.fetch(keys[3:]))
        assert await asyncio.wait_for(second, 5) == BLOCKS - 3
        assert run.requested == BLOCKS and run.filled == 0  # its rows are loaded, but not the ones before them
        held.set()
        assert await asyncio.wait_for(first, 5) == 3
        assert run.filled == BLOCKS and run.end_tokens == 16 * BLOCKS and not run.broken
        kv = run.finish()
        assert kv is not None and kv.num_blocks == BLOCKS and run.misses == {}
        got = torch.cat([b.host for b in kv.buffers])[:BLOCKS]
        assert torch.equal(got, data)
        kv.release()
    finally:
        await rt.writer.close()
        swapper.close()


async def test_an_earlier_fetch_that_misses_breaks_the_run_before_a_later_good_one() -> None:
    swapper = BlockSwapper(LAYOUT.allocate(BLOCKS), max_blocks=4, num_buffers=4)
    gates = Gates()
    rt, keys, _ = await setup(gates, swapper)
    try:
        await rt.pool.delete_blocks(NS, keys[1:2])  # block 1 is gone
        held = gates.gate(block_ids(NS, keys[:1])[0])
        run = StagedRun(rt, 0, BLOCKS)
        first = asyncio.create_task(run.fetch(keys[:3]))
        await asyncio.sleep(0.01)
        assert await asyncio.wait_for(run.fetch(keys[3:]), 5) == BLOCKS - 3
        held.set()
        assert await asyncio.wait_for(first, 5) == 1
        assert run.filled == 1 and run.broken == "absent"
        assert await run.fetch(keys[3:]) == 0  # a broken run fetches nothing more
        kv = run.finish()
        assert kv is not None and kv.num_blocks == 1
        assert dict(run.misses) == {"absent": 1, "after_gap": BLOCKS - 2}  # the later fetch's rows are not used
        kv.release()
        assert swapper.in_use == 0
    finally:
        await rt.writer.close()
        swapper.close()

