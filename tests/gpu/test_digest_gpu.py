"""Block digests on a real GPU (kernels/digest): the Triton kernel against the torch reference
and python-xxhash on fresh random caches, the swapper computing them on by default, stream
ordered with a later write to the same blocks (an engine's exports: tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.digest import reference
from kernels.digest.probe import xxhash_digests
from kernels.swap import BlockSwapper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

U64 = (1 << 64) - 1
SHAPES = [
    pytest.param((30, 2, 16, 3, 64), torch.bfloat16, id="smollm2-bf16"),
    pytest.param((16, 2, 16, 8, 64), torch.bfloat16, id="llama-3.2-1b-bf16"),
    pytest.param((2, 2, 8, 1, 16), torch.float32, id="small-fp32"),
    pytest.param((4, 2, 16, 2, 128), torch.float16, id="fp16"),
]


@pytest.mark.parametrize("block_shape, dtype", SHAPES)
def test_triton_digests_equal_the_reference_and_xxhash(block_shape, dtype):
    from kernels.digest import triton_digest

    cache = torch.randn(24, *block_shape, device="cuda").to(dtype)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids = torch.randint(0, 24, (20,), generator=g).tolist()
    tokens = torch.randint(1, block_shape[2] + 1, (20,), generator=g).tolist()
    tokens[:3] = [block_shape[2]] * 3
    got = torch.empty(20, dtype=torch.int64, device="cuda")
    triton_digest.block_digests(cache, ids, tokens, got)
    want = torch.empty(20, dtype=torch.int64)
    reference.block_digests(cache, ids, tokens, want)
    assert torch.equal(got.cpu(), want)
    assert [v & U64 for v in got.tolist()] == xxhash_digests(cache, ids, tokens)


def test_the_swapper_digests_by_default_in_stream_order():
    """A swap-out's digests are taken where the copy is: a write to the blocks enqueued
    right after it (on the same stream) changes neither the rows nor the digests."""
    cache = torch.randn(64, 30, 2, 16, 3, 64, device="cuda").to(torch.bfloat16)
    ids, tokens = list(range(40, 8, -1)), [16] * 31 + [7]
    with BlockSwapper(cache, 32) as sw:
        assert sw.digests_on
        before = cache[ids].cpu()
        torch.cuda._sleep(50_000_000)  # keep the swap queued behind some GPU work
        buf = sw.swap_out(ids, num_tokens=tokens)
        cache[ids] = 0
        assert torch.equal(buf.host, before)
        assert [d & U64 for d in buf.digests.tolist()] == xxhash_digests(before, range(32), tokens)
        buf.release()

