"""Swap kernels on the CPU: Triton (under TRITON_INTERPRET=1) against the torch reference
and a per-block loop, the input checks, and the staging pool's lifetime rules."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from kernels.swap import (
    BlockIdError,
    BlockSwapper,
    StagingStateError,
    SwapAlignmentError,
    SwapShapeError,
    SwapValidationError,
    reference,
)
from kernels.swap.runs import Run, block_runs, count_runs, single_run

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
)

NUM_BLOCKS = 12
# [layers, 2, block_size, kv_heads, head_dim]: one block of 256 elements (a single, masked
# kernel chunk), and one of 4608 (two chunks in float32, the second one partial).
SMALL = (2, 2, 4, 2, 8)
MULTI_CHUNK = (3, 2, 4, 3, 64)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ID_KINDS = ["consecutive", "reversed", "random", "single", "runs"]


def _triton():
    from kernels.swap import triton_swap

    return triton_swap


def random_cache(block_shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.randn(num_blocks, *block_shape).to(dtype)


def make_ids(kind: str) -> list[int]:
    if kind == "consecutive":
        return [3, 4, 5, 6, 7]
    if kind == "reversed":
        return list(range(9, 1, -1))
    if kind == "random":
        return torch.randperm(NUM_BLOCKS)[:7].tolist()
    if kind == "single":
        return [int(torch.randint(NUM_BLOCKS, ()))]
    if kind == "runs":
        return [2, 3, 4, 9, 10, 0]
    raise AssertionError(kind)


def poisoned(n: int, cache: torch.Tensor) -> torch.Tensor:
    """A staging buffer full of NaN, so a row the kernel misses cannot pass as written."""
    return torch.full((n, *cache.shape[1:]), float("nan"), dtype=cache.dtype)


# -- kernels against the reference ---------------------------------------------------


@pytest.fixture(params=[SMALL, MULTI_CHUNK], ids=["small", "multichunk"])
def block_shape(request) -> tuple[int, ...]:
    return request.param


@pytest.fixture(params=DTYPES, ids=str)
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=ID_KINDS)
def kind(request) -> str:
    return request.param


@interpreted
def test_gather_matches_reference(block_shape, dtype, kind):
    cache = random_cache(block_shape, dtype)
    ids = make_ids(kind)
    got, want = poisoned(len(ids), cache), poisoned(len(ids), cache)
    _triton().gather_blocks(cache, ids, got)
    reference.gather_blocks(cache, ids, want)
    assert torch.equal(got, want)
    for row, block in enumerate(ids):
        assert torch.equal(got[row], cache[block])


@interpreted
def test_scatter_matches_reference(block_shape, dtype, kind):
    cache = random_cache(block_shape, dtype)
    ids = make_ids(kind)
    src = torch.randn(len(ids), *block_shape).to(dtype)
    got, want = cache.clone(), cache.clone()
    _triton().scatter_blocks(src, ids, got)
    reference.scatter_blocks(src, ids, want)
    assert torch.equal(got, want)
    expected = cache.clone()
    for row, block in enumerate(ids):
        expected[block] = src[row]
    assert torch.equal(got, expected)


@interpreted
def test_kernel_launch_on_consecutive_ids():
    """The run path skips the kernel, so check the kernel itself on consecutive ids too."""
    cache = random_cache(SMALL, torch.bfloat16)
    ids = torch.arange(2, 9)
    out = poisoned(ids.numel(), cache)
    _triton().launch_gather(cache, ids, out)
    assert torch.equal(out, cache[2:9])
    target = cache.clone()
    src = torch.randn(ids.numel(), *SMALL).to(torch.bfloat16)
    _triton().launch_scatter(src, ids, target)
    assert torch.equal(target[2:9], src) and torch.equal(target[:2], cache[:2])


def both_backends():
    return [pytest.param(reference, id="reference"), pytest.param("triton", id="triton", marks=interpreted)]


def backend_module(backend):
    return _triton() if backend == "triton" else backend


@pytest.mark.parametrize("backend", both_backends())
def test_gather_allows_repeated_ids(backend):
    cache = random_cache(SMALL, torch.float32)
    out = poisoned(4, cache)
    backend_module(backend).gather_blocks(cache, torch.tensor([5, 1, 5, 5], dtype=torch.int32), out)
    assert torch.equal(out, cache[[5, 1, 5, 5]])


@pytest.mark.parametrize("backend", both_backends())
def test_empty_ids_are_a_no_op(backend):
    cache = random_cache(SMALL, torch.float32)
    before = cache.clone()
    module = backend_module(backend)
    module.gather_blocks(cache, [], poisoned(0, cache))
    module.scatter_blocks(poisoned(0, cache), torch.empty(0, dtype=torch.int64), cache)
    assert torch.equal(cache, before)


# -- input checks --------------------------------------------------------------------


BAD_CALLS = {
    "cache_5d": (lambda c, o: (c[:, 0], [1], o[:1, 0]), SwapShapeError, "6-D"),
    "cache_not_kv": (lambda c, o: (c[:, :, :1].contiguous(), [1], o[:1, :, :1].contiguous()), SwapShapeError, "K and V"),
    "cache_strided": (lambda c, o: (c.transpose(3, 4), [1], o[:1].transpose(3, 4)), SwapAlignmentError, "contiguous"),
    "staging_rows": (lambda c, o: (c, [1, 2], o[:3]), SwapShapeError, "shape"),
    "staging_layout": (lambda c, o: (c, [1], o[:1, :1].contiguous()), SwapShapeError, "shape"),
    "staging_dtype": (lambda c, o: (c, [1], o[:1].double()), SwapShapeError, "dtype"),
    "staging_strided": (lambda c, o: (c, [1, 2], o[::2]), SwapAlignmentError, "contiguous"),
    "id_too_big": (lambda c, o: (c, [1, NUM_BLOCKS], o[:2]), BlockIdError, "out of range"),
    "id_negative": (lambda c, o: (c, [-1], o[:1]), BlockIdError, "out of range"),
    "ids_2d": (lambda c, o: (c, torch.tensor([[1, 2]]), o[:2]), BlockIdError, "1-D"),
    "ids_float_tensor": (lambda c, o: (c, torch.tensor([1.0]), o[:1]), BlockIdError, "integers"),
    "ids_float_list": (lambda c, o: (c, [1.5], o[:1]), BlockIdError, "integers"),
    "ids_bool_tensor": (lambda c, o: (c, torch.tensor([True]), o[:1]), BlockIdError, "integers"),
    "ids_bf16_tensor": (lambda c, o: (c, torch.tensor([1], dtype=torch.bfloat16), o[:1]), BlockIdError, "integers"),
}


@pytest.mark.parametrize("backend", both_backends())
@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_are_rejected_before_any_copy(backend, direction, case):
    build, error, message = BAD_CALLS[case]
    cache = random_cache(SMALL, torch.float32)
    staging = torch.randn(4, *SMALL)
    cache_arg, ids, staging_arg = build(cache, staging)
    cache_before, staging_before = cache.clone(), staging.clone()
    module = backend_module(backend)
    with pytest.raises(error, match=message):
        if direction == "gather":
            module.gather_blocks(cache_arg, ids, staging_arg)
        else:
            module.scatter_blocks(staging_arg, ids, cache_arg)
    assert torch.equal(cache, cache_before) and torch.equal(staging, staging_before)


@pytest.mark.parametrize("backend", both_backends())
def test_scatter_rejects_repeated_ids(backend):
    cache = random_cache(SMALL, torch.float32)
    with pytest.raises(BlockIdError, match="block id 4 appears 2 times"):
        backend_module(backend).scatter_blocks(poisoned(3, cache), [4, 1, 4], cache)


def test_validation_errors_are_value_errors():
    for error in (SwapShapeError, SwapAlignmentError, BlockIdError):
        assert issubclass(error, SwapValidationError) and issubclass(error, ValueError)
    assert not issubclass(StagingStateError, ValueError)


@interpreted
def test_triton_rejects_misaligned_staging():
    cache = random_cache(SMALL, torch.float32)
    numel = cache[0].numel() * 2
    shifted = torch.empty(numel + 1)[1:].view(2, *SMALL)  # 4 bytes past an aligned start
    with pytest.raises(SwapAlignmentError, match="16-byte aligned"):
        _triton().gather_blocks(cache, [3, 1], shifted)
    with pytest.raises(SwapAlignmentError, match="16-byte aligned"):
        _triton().scatter_blocks(shifted, [3, 1], cache)


@interpreted
def test_triton_rejects_blocks_of_odd_size_that_reference_accepts():
    odd = (1, 2, 1, 1, 3)  # 6 float16 elements: 12 bytes a block
    cache = random_cache(odd, torch.float16)
    out = poisoned(2, cache)
    with pytest.raises(SwapAlignmentError, match="not a multiple of 16"):
        _triton().gather_blocks(cache, [3, 1], out)
    reference.gather_blocks(cache, [3, 1], out)
    assert torch.equal(out, cache[[3, 1]])


def test_triton_refuses_cpu_cache_without_interpreter(monkeypatch):
    triton_swap = pytest.importorskip("kernels.swap.triton_swap")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SwapShapeError, match="need a CUDA cache"):
        triton_swap.check_device(random_cache(SMALL, torch.float32))


# -- runs ----------------------------------------------------------------------------


def test_block_runs():
    ids = np.array([3, 4, 5, 9, 10, 2])
    assert count_runs(ids) == 3
    assert block_runs(ids) == [Run(3, 0, 3), Run(9, 3, 2), Run(2, 5, 1)]
    assert single_run(np.array([7, 8, 9])) == Run(7, 0, 3)
    assert single_run(np.array([9, 8])) is None
    assert count_runs(np.empty(0, dtype=np.int64)) == 0 and block_runs(np.array([4])) == [Run(4, 0, 1)]


# -- the staging pool ----------------------------------------------------------------

SWAPPER_CONFIGS = [
    pytest.param({"backend": "torch", "scattered": "mapped"}, id="torch-mapped"),
    pytest.param({"backend": "torch", "scattered": "staged"}, id="torch-staged"),
    pytest.param({"backend": "triton", "scattered": "mapped"}, id="triton-mapped", marks=interpreted),
    pytest.param({"backend": "triton", "scattered": "staged"}, id="triton-staged", marks=interpreted),
    pytest.param({"backend": "triton", "scattered": "staged", "max_direct_runs": 3}, id="triton-runs", marks=interpreted),
]


@pytest.mark.parametrize("config", SWAPPER_CONFIGS)
@pytest.mark.parametrize("kind", ID_KINDS)
def test_swapper_round_trip(config, kind):
    cache = random_cache(MULTI_CHUNK, torch.bfloat16)
    ids = make_ids(kind)
    with BlockSwapper(cache, max_blocks=8, **config) as swapper:
        with swapper.swap_out(ids) as buf:
            assert torch.equal(buf.host, cache[ids])
            assert buf.ready()
        target_ids = torch.randperm(NUM_BLOCKS)[: len(ids)]
        with swapper.acquire(len(ids)) as buf:
            fresh = torch.randn(len(ids), *MULTI_CHUNK).to(torch.bfloat16)
            buf.host.copy_(fresh)
            expected = cache.clone()
            expected[target_ids] = fresh
            swapper.swap_in(buf, target_ids)
            buf.wait()
        assert torch.equal(cache, expected)
        assert swapper.in_use == 0


def test_swapper_takes_one_copy_per_run_without_a_kernel(monkeypatch):
    cache = random_cache(SMALL, torch.float32)
    swapper = BlockSwapper(cache, max_blocks=8, max_direct_runs=2)

    def no_kernel(*args):
        raise AssertionError("the kernel path ran for ids that form few runs")

    monkeypatch.setattr(swapper, "_kernel_gather", no_kernel)
    monkeypatch.setattr(swapper, "_kernel_scatter", no_kernel)
    with swapper.swap_out([4, 5, 6, 0, 1]) as buf:
        assert torch.equal(buf.host, cache[[4, 5, 6, 0, 1]])
        swapper.swap_in(buf, [7, 8, 9, 10, 11])
    assert torch.equal(cache[7:12], cache[[4, 5, 6, 0, 1]])
    with pytest.raises(AssertionError, match="kernel path"):
        swapper.swap_out([1, 3, 5])
    assert swapper.in_use == 0  # the failed swap gave its buffer back
    swapper.close()


def test_swapper_lends_at_most_num_buffers():
    swapper = BlockSwapper(random_cache(SMALL, torch.float32), max_blocks=4, num_buffers=2)
    first, second = swapper.acquire(1), swapper.acquire(4)
    assert swapper.in_use == 2
    with pytest.raises(StagingStateError, match="all 2 staging buffers are in use"):
        swapper.acquire(1)
    first.release()
    third = swapper.acquire(2)
    assert third.host.shape[0] == 2 and swapper.in_use == 2
    second.release()
    third.release()
    assert swapper.in_use == 0


def test_released_buffer_is_unusable():
    swapper = BlockSwapper(random_cache(SMALL, torch.float32), max_blocks=4)
    buf = swapper.swap_out([1, 2])
    buf.release()
    for use in (lambda: buf.host, buf.wait, buf.ready, buf.release, lambda: swapper.swap_in(buf, [1, 2])):
        with pytest.raises(StagingStateError, match="released"):
            use()


def test_context_manager_releases_on_error():
    swapper = BlockSwapper(random_cache(SMALL, torch.float32), max_blocks=4, num_buffers=1)
    with pytest.raises(RuntimeError, match="boom"):
        with swapper.swap_out([3, 0]):
            raise RuntimeError("boom")
    assert swapper.in_use == 0
    swapper.acquire(4).release()


def test_closed_swapper_refuses_everything():
    cache = random_cache(SMALL, torch.float32)
    with BlockSwapper(cache, max_blocks=4) as swapper:
        held = swapper.swap_out([2, 7])
        kept = held.host  # a tensor taken before close keeps its memory
    assert swapper.closed
    assert torch.equal(kept, cache[[2, 7]])
    for use in (lambda: held.host, held.wait, lambda: swapper.acquire(1), lambda: swapper.swap_out([1])):
        with pytest.raises(StagingStateError, match="closed"):
            use()
    with pytest.raises(StagingStateError, match="closed"):
        swapper.swap_in(held, [2, 7])
    held.release()  # allowed after close, so shutdown order does not matter
    swapper.close()  # idempotent


def test_swapper_checks_its_inputs():
    cache = random_cache(SMALL, torch.float32)
    with pytest.raises(SwapShapeError, match="6-D"):
        BlockSwapper(cache[0], max_blocks=4)
    with pytest.raises(SwapShapeError, match="max_blocks"):
        BlockSwapper(cache, max_blocks=0)
    swapper = BlockSwapper(cache, max_blocks=4)
    other = BlockSwapper(cache, max_blocks=4)
    with pytest.raises(SwapShapeError, match="5 blocks requested"):
        swapper.swap_out([0, 1, 2, 3, 4])
    with pytest.raises(BlockIdError, match="out of range"):
        swapper.swap_out([NUM_BLOCKS])
    assert swapper.in_use == 0
    with swapper.acquire(2) as buf:
        with pytest.raises(SwapShapeError, match="3 block ids for a staging buffer of 2"):
            swapper.swap_in(buf, [1, 2, 3])
        with pytest.raises(BlockIdError, match="appears 2 times"):
            swapper.swap_in(buf, [1, 1])
        with pytest.raises(StagingStateError, match="another swapper"):
            other.swap_in(buf, [1, 2])


def test_swap_of_no_blocks():
    cache = random_cache(SMALL, torch.float32)
    before = cache.clone()
    with BlockSwapper(cache, max_blocks=4) as swapper:
        with swapper.swap_out([]) as buf:
            assert buf.host.shape == (0, *SMALL)
            swapper.swap_in(buf, [])
    assert torch.equal(cache, before)


def test_pool_survives_concurrent_acquire_and_release():
    swapper = BlockSwapper(random_cache(SMALL, torch.float32), max_blocks=2, num_buffers=3)
    failures: list[BaseException] = []

    def worker() -> None:
        for _ in range(200):
            try:
                buf = swapper.acquire(1)
            except StagingStateError:
                continue
            try:
                buf.host.fill_(1.0)
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)
            buf.release()

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures and swapper.in_use == 0
    held = [swapper.acquire(1) for _ in range(3)]
    assert len({id(b._slot) for b in held}) == 3  # no slot was lent twice or lost
