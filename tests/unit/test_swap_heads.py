"""Head-slice swaps (tensor parallelism): each rank moves only its KV heads between its
cache and staging rows of whole blocks, and the rows the ranks fill together are the very
pool values a TP=1 instance writes (and the reverse).

Triton kernels run under TRITON_INTERPRET=1 against the torch reference on fresh random
inputs; the staging pool runs in heads mode over shared memory, as a TP instance's ranks
do (here two swappers in one process stand for two ranks).
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from kernels.swap import BlockSwapper, SwapShapeError, reference
from kernels.swap.heads import HeadSlice
from kernels.swap.shared import SharedStaging
from libs.kvpool.codec import BlockCodec
from libs.kvpool.layout import KVLayout
from libs.model.config import ModelConfig
from libs.model.parallel import TPShard

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (no CUDA)")

NUM_BLOCKS = 9


def _cfg(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="qwen2", vocab_size=64, hidden_size=8 * heads, intermediate_size=32, num_layers=3,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=8, max_position_embeddings=64,
    )


def _slices(heads: int, kv_heads: int, tp: int) -> list[HeadSlice]:
    shards = [TPShard.plan(_cfg(heads, kv_heads), tp, r) for r in range(tp)]
    return [HeadSlice(s.kv_heads[0], s.num_kv_heads, kv_heads, s.kv_written) for s in shards]


# (q heads, KV heads, TP): an even split, SmolLM2's uneven one, replicated heads.
LAYOUTS = [(4, 2, 2), (9, 3, 2), (6, 3, 4), (4, 1, 4)]


@pytest.mark.parametrize("heads,kv_heads,tp", LAYOUTS)
def test_every_head_is_written_by_exactly_one_rank(heads, kv_heads, tp):
    written = [h for s in _slices(heads, kv_heads, tp) for h in range(*s.written)]
    assert sorted(written) == list(range(kv_heads))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,tp", LAYOUTS)
def test_triton_head_slices_match_the_reference(dtype, heads, kv_heads, tp):
    from kernels.swap import triton_swap

    block = (3, 2, 4, kv_heads, 8)
    full = torch.randn(NUM_BLOCKS, *block).to(dtype)
    ids = torch.randperm(NUM_BLOCKS)[:5].tolist()
    for hs in _slices(heads, kv_heads, tp):
        cache = full[..., hs.first : hs.first + hs.count, :].contiguous()
        ref_out, tri_out = torch.randn(5, *block).to(dtype), None
        tri_out = ref_out.clone()
        reference.gather_heads(cache, ids, ref_out, hs)
        triton_swap.gather_heads(cache, ids, tri_out, hs)
        assert torch.equal(ref_out, tri_out)
        a, b = hs.written
        assert torch.equal(ref_out[..., a:b, :], full[ids][..., a:b, :])
        src = torch.randn(5, *block).to(dtype)
        ref_cache, tri_cache = cache.clone(), cache.clone()
        reference.scatter_heads(src, ids, ref_cache, hs)
        triton_swap.scatter_heads(src, ids, tri_cache, hs)
        assert torch.equal(ref_cache, tri_cache)
        assert torch.equal(ref_cache[ids], src[..., hs.first : hs.first + hs.count, :])


def test_head_slice_checks():
    cache = torch.zeros(NUM_BLOCKS, 2, 2, 4, 2, 8)
    with pytest.raises(SwapShapeError, match="do not fit"):
        HeadSlice(2, 2, 3, (2, 4))
    with pytest.raises(SwapShapeError, match="not among"):
        HeadSlice(0, 2, 3, (1, 3))
    with pytest.raises(SwapShapeError, match="cache has 2 KV heads"):
        reference.gather_heads(cache, [0], torch.zeros(1, 2, 2, 4, 3, 8), HeadSlice(0, 1, 3, (0, 1)))
    with pytest.raises(SwapShapeError, match="whole blocks"):
        reference.gather_heads(cache, [0, 1], torch.zeros(1, 2, 2, 4, 3, 8), HeadSlice(0, 2, 3, (0, 2)))


@pytest.fixture
def shared_rows():
    """Two mappings of one shared staging file, as rank 0 and another rank hold them."""
    name = f"tidepool-test-{secrets.token_hex(4)}"
    shape, made = (4, 3, 2, 4, 3, 8), []

    def make(create: bool) -> SharedStaging:
        made.append(SharedStaging(name, shape, torch.float32, 2, create=create))
        return made[-1]

    yield make
    for s in made:
        s.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_ranks_fill_one_shared_row_that_encodes_as_the_tp1_value(shared_rows):
    """TP=2 over SmolLM2's 3 KV heads (1 + 2): rank 0 lends a buffer and gathers its
    head, rank 1 gathers its two into the same rows; the rows then encode to exactly the
    bytes a TP=1 swapper's rows encode to, and decoding a TP=1 value into a row and
    scattering gives each rank its heads."""
    layout = KVLayout(num_layers=3, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32)
    codec = BlockCodec(layout)
    full = torch.randn(NUM_BLOCKS, *layout.block_shape)
    rank0, rank1 = shared_rows(True), shared_rows(False)
    rank0.unlink()  # every rank has attached: the name can go
    s0, s1 = _slices(9, 3, 2)
    assert (s0.count, s1.count) == (1, 2)
    part = lambda t, s: t[..., s.first : s.first + s.count, :].contiguous()  # noqa: E731
    sw0 = BlockSwapper(part(full, s0), 4, num_buffers=2, heads=s0, host_buffers=rank0.buffers)
    sw1 = BlockSwapper(part(full, s1), 4, num_buffers=2, heads=s1, host_buffers=rank1.buffers)
    whole = BlockSwapper(full.clone(), 4, num_buffers=1)
    ids = [7, 2, 5]
    with sw0.swap_out(ids) as buf, whole.swap_out(ids) as ref:
        sw1.gather_into(buf.index, ids)
        sw1.wait_buffer(buf.index)
        for row, want in zip(buf.host, ref.host):
            for tokens in (4, 3):  # a full block and a partial tail
                assert b"".join(codec.encode_views(row, tokens)) == b"".join(codec.encode_views(want, tokens))
    # The reverse: TP=1 values land in a shared row, each rank scatters its own heads.
    values = [codec.encode(full[i], 4) for i in (1, 6)]
    c0, c1 = torch.zeros_like(sw0._cache), torch.zeros_like(sw1._cache)
    r0 = BlockSwapper(c0, 4, num_buffers=2, heads=s0, host_buffers=rank0.buffers)
    r1 = BlockSwapper(c1, 4, num_buffers=2, heads=s1, host_buffers=rank1.buffers)
    with r0.acquire(2) as buf:
        for row, value in zip(buf.host, values):
            codec.decode(value, row)
        r0.swap_in(buf, [3, 4])
        r1.scatter_from(buf.index, [8], first_row=1)  # a partial import: only the second row
    assert torch.equal(c0[[3, 4]], part(full[[1, 6]], s0))
    assert torch.equal(c1[8], part(full[6:7], s1)[0]) and not c1[3].any()
    for sw in (sw0, sw1, whole, r0, r1):
        sw.close()


def test_a_replica_writes_nothing(shared_rows):
    """TP=4 over 1 KV head: rank 0 writes the head, ranks 1-3 hold replicas and write none."""
    rank0 = shared_rows(True)
    replica = HeadSlice(0, 1, 1, (0, 0))
    cache = torch.randn(NUM_BLOCKS, 3, 2, 4, 1, 8)
    rank0_buffers = [b[..., :1, :] for b in rank0.buffers]  # a 1-head view for this layout
    with pytest.raises(SwapShapeError, match="contiguous CPU"):
        BlockSwapper(cache, 4, num_buffers=2, heads=replica, host_buffers=rank0_buffers)
    rows = [torch.full((4, 3, 2, 4, 1, 8), -1.0) for _ in range(2)]
    sw = BlockSwapper(cache, 4, num_buffers=2, heads=replica, host_buffers=rows)
    with sw.swap_out([1, 2]) as buf:
        assert (buf.host == -1).all()
    sw.close()
