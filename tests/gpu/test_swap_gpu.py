"""Swap kernels on a real GPU: Triton against the torch reference (device and pinned host
staging), and the BlockSwapper's pinned buffers, stream-ordered semantics and lifetime."""

from __future__ import annotations

import pytest
import torch

from kernels.swap import BlockSwapper, StagingStateError, SwapShapeError, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_BLOCKS = 64
SMALL = (2, 2, 4, 2, 8)
SMOLLM2 = (30, 2, 16, 3, 64)  # layers, K/V, block size, kv heads, head dim
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ID_KINDS = ["consecutive", "reversed", "random", "single", "runs"]
# About 50 ms of GPU time at H100/H200 clocks: keeps a later copy in flight for a while.
SLEEP_CYCLES = 100_000_000


def _triton():
    from kernels.swap import triton_swap

    return triton_swap


def random_cache(block_shape, dtype, num_blocks=NUM_BLOCKS):
    return torch.randn(num_blocks, *block_shape, device="cuda").to(dtype)


def make_ids(kind: str) -> list[int]:
    if kind == "consecutive":
        return list(range(10, 26))
    if kind == "reversed":
        return list(range(40, 20, -1))
    if kind == "random":
        return torch.randperm(NUM_BLOCKS)[:24].tolist()
    if kind == "single":
        return [int(torch.randint(NUM_BLOCKS, ()))]
    if kind == "runs":
        return [2, 3, 4, 50, 51, 7, 30, 31, 32, 33]
    raise AssertionError(kind)


@pytest.fixture(params=[SMALL, SMOLLM2], ids=["small", "smollm2"])
def block_shape(request) -> tuple[int, ...]:
    return request.param


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=ID_KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(params=["device", "pinned"])
def where(request) -> str:
    return request.param


def staging(n, cache, where):
    out = torch.full((n, *cache.shape[1:]), float("nan"), dtype=cache.dtype)
    return out.pin_memory() if where == "pinned" else out.to(cache.device)


def test_gather_matches_reference(block_shape, dtype, kind, where):
    cache = random_cache(block_shape, dtype)
    ids = make_ids(kind)
    got, want = staging(len(ids), cache, where), staging(len(ids), cache, "device")
    _triton().gather_blocks(cache, ids, got)
    reference.gather_blocks(cache, ids, want)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got.cpu(), cache[ids].cpu())


def test_scatter_matches_reference(block_shape, dtype, kind, where):
    cache = random_cache(block_shape, dtype)
    ids = make_ids(kind)
    src = staging(len(ids), cache, where)
    src.copy_(torch.randn(src.shape).to(dtype))
    got, want = cache.clone(), cache.clone()
    _triton().scatter_blocks(src, ids, got)
    reference.scatter_blocks(src.to("cuda"), ids, want)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    expected = cache.clone()
    expected[ids] = src.to("cuda")
    assert torch.equal(got, expected)


def test_triton_rejects_pageable_host_memory():
    cache = random_cache(SMALL, torch.float32)
    out = torch.empty(2, *SMALL)
    with pytest.raises(SwapShapeError, match="pinned"):
        _triton().gather_blocks(cache, [3, 9], out)


SWAPPERS = [
    pytest.param({"scattered": "staged"}, id="staged"),
    pytest.param({"scattered": "mapped"}, id="mapped"),
    pytest.param({"scattered": "staged", "max_direct_runs": 4}, id="runs"),
    pytest.param({"backend": "torch", "scattered": "staged"}, id="torch"),
]


@pytest.mark.parametrize("config", SWAPPERS)
def test_swapper_round_trip(config, kind, dtype):
    cache = random_cache(SMOLLM2, dtype)
    ids = make_ids(kind)
    with BlockSwapper(cache, max_blocks=32, **config) as swapper:
        with swapper.swap_out(ids) as buf:
            host = buf.host
            assert host.is_pinned() and host.device.type == "cpu"
            assert torch.equal(host, cache[ids].cpu())
        targets = torch.randperm(NUM_BLOCKS)[: len(ids)]
        fresh = torch.randn(len(ids), *SMOLLM2).to(dtype)
        expected = cache.clone()
        expected[targets.cuda()] = fresh.cuda()
        with swapper.acquire(len(ids)) as buf:
            buf.host.copy_(fresh)
            swapper.swap_in(buf, targets)
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("config", SWAPPERS)
def test_swap_out_is_asynchronous_and_stream_ordered(config):
    cache = random_cache(SMOLLM2, torch.bfloat16)
    ids = make_ids("random")
    original = cache[ids].cpu()
    with BlockSwapper(cache, max_blocks=32, **config) as swapper:
        torch.cuda._sleep(SLEEP_CYCLES)
        buf = swapper.swap_out(ids)
        assert not buf.ready()  # returned while the copy waits behind the sleep
        cache.zero_()  # enqueued after the swap: must not leak into the host copy
        assert torch.equal(buf.host, original)  # host waits for the copy to land
        assert buf.ready()
        buf.release()


@pytest.mark.parametrize("config", SWAPPERS)
def test_host_buffer_is_not_handed_back_before_swap_in_read_it(config):
    cache = random_cache(SMOLLM2, torch.bfloat16)
    ids = make_ids("random")
    fresh = torch.randn(len(ids), *SMOLLM2).to(torch.bfloat16)
    with BlockSwapper(cache, max_blocks=32, **config) as swapper:
        with swapper.acquire(len(ids)) as buf:
            buf.host.copy_(fresh)
            torch.cuda._sleep(SLEEP_CYCLES)
            swapper.swap_in(buf, ids)
            buf.host.zero_()  # waits until the swap has read the buffer
        torch.cuda.synchronize()
        assert torch.equal(cache[ids].cpu(), fresh)


def test_swaps_allocate_no_device_memory():
    cache = random_cache(SMOLLM2, torch.bfloat16)
    ids = make_ids("random")
    with BlockSwapper(cache, max_blocks=32) as swapper:
        swapper.swap_out(ids).release()  # warm up: Triton compiles, CUDA contexts settle
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(5):
            with swapper.swap_out(ids) as buf:
                swapper.swap_in(buf, ids)
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_close_waits_for_copies_in_flight_and_frees_buffers():
    cache = random_cache(SMOLLM2, torch.bfloat16)
    swapper = BlockSwapper(cache, max_blocks=32)
    torch.cuda._sleep(SLEEP_CYCLES)
    buf = swapper.swap_out(make_ids("random"))
    swapper.close()
    assert torch.cuda.current_stream().query()  # close returned only after the copy landed
    with pytest.raises(StagingStateError, match="closed"):
        buf.host
    buf.release()
    with pytest.raises(StagingStateError, match="closed"):
        swapper.acquire(1)


def test_swapper_on_a_side_stream():
    cache = random_cache(SMOLLM2, torch.bfloat16)
    ids = make_ids("random")
    original = cache[ids].cpu()
    side = torch.cuda.Stream()
    with BlockSwapper(cache, max_blocks=32) as swapper:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            buf = swapper.swap_out(ids)
        with buf:
            assert torch.equal(buf.host, original)
            torch.cuda.current_stream().wait_stream(side)
            targets = list(range(NUM_BLOCKS - len(ids), NUM_BLOCKS))
            swapper.swap_in(buf, targets)  # on the default stream, after the side stream
        assert torch.equal(cache[targets].cpu(), original)
