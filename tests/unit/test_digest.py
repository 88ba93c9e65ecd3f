"""Block digests on the device (kernels/digest): the torch reference against python-xxhash,
the Triton kernel (under TRITON_INTERPRET=1) against the reference on fresh random caches,
the operand checks, the swapper's digests on a swap-out, and an engine's exported blocks
carrying them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

from kernels.digest import DigestShapeError, reference, supports, xxh3
from kernels.digest.probe import xxhash_digests
from kernels.digest.reference import xxh3_words
from kernels.swap import BlockSwapper, SwapShapeError
from libs.engine import SamplingParams
from libs.kvpool.codec import BlockCodec
from libs.kvpool.header import unpack_header
from tests.models import tiny_engine

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
)

U64 = (1 << 64) - 1


def unsigned(out: torch.Tensor) -> list[int]:
    return [v & U64 for v in out.tolist()]


@pytest.mark.parametrize("nbytes", [248, 256, 1016, 1024, 1032, 1088, 2048, 4096 + 64, 16 * 1024 + 8, 100_000])
def test_the_reference_is_xxh3_at_every_boundary(nbytes):
    """Lengths around XXH3's 1 KiB blocks and 64-byte stripes: an exact multiple of a block
    (whose last block is handled as a partial one), one word more, a stripe more."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    words = torch.from_numpy(data.copy()).view(torch.int64)
    assert xxh3_words(words) == xxhash.xxh3_64_intdigest(data.tobytes())


def test_a_short_input_is_refused():
    with pytest.raises(ValueError, match="at least 241"):
        xxh3_words(torch.zeros(30, dtype=torch.int64))


def test_the_key_table_is_read_from_the_secret():
    assert len(xxh3.SECRET) == 192 and len(xxh3.TABLE) == xxh3.TABLE_SIZE
    first = int.from_bytes(xxh3.SECRET[:8], "little")
    assert xxh3.TABLE[xxh3.STRIPE_KEYS] & U64 == first
    assert xxh3.TABLE[xxh3.LAST_KEYS] & U64 == int.from_bytes(xxh3.SECRET[121:129], "little")


# [num_blocks, layers, 2, block_size, kv_heads, head_dim]
CACHES = [
    pytest.param((5, 2, 2, 16, 3, 64), torch.bfloat16, id="bf16-smollm2-row"),
    pytest.param((4, 3, 2, 8, 1, 16), torch.float32, id="fp32-small"),
    pytest.param((3, 1, 2, 4, 2, 32), torch.float16, id="fp16-one-layer"),
]


def random_case(shape, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(shape, generator=g).to(dtype)
    n = int(torch.randint(1, 2 * shape[0], (1,), generator=g))
    ids = torch.randint(0, shape[0], (n,), generator=g).tolist()  # repeats allowed
    tokens = torch.randint(1, shape[3] + 1, (n,), generator=g).tolist()
    tokens[0] = shape[3]  # at least one whole block
    return cache, ids, tokens


@pytest.mark.parametrize("shape, dtype", CACHES)
def test_reference_digests_equal_xxhash_over_the_payload(shape, dtype):
    cache, ids, tokens = random_case(shape, dtype, seed=torch.seed() % 2**31)
    out = torch.empty(len(ids), dtype=torch.int64)
    reference.block_digests(cache, ids, tokens, out)
    assert unsigned(out) == xxhash_digests(cache, ids, tokens)


@interpreted
@pytest.mark.parametrize("shape, dtype", CACHES)
def test_triton_digests_equal_the_reference(shape, dtype):
    from kernels.digest import triton_digest

    cache, ids, tokens = random_case(shape, dtype, seed=torch.seed() % 2**31)
    want, got = (torch.full((len(ids),), 7, dtype=torch.int64) for _ in range(2))
    reference.block_digests(cache, ids, tokens, want)
    triton_digest.block_digests(cache, ids, tokens, got)
    assert torch.equal(got, want)
    assert unsigned(got) == xxhash_digests(cache, ids, tokens)


@interpreted
def test_triton_digests_see_a_single_flipped_bit():
    from kernels.digest import triton_digest

    cache = torch.randn(2, 2, 2, 8, 2, 16)
    before = torch.empty(1, dtype=torch.int64)
    triton_digest.block_digests(cache, [1], [5], before)
    cache.view(torch.int32)[1, 1, 1, 4, 1, 3] ^= 1 << 9  # the last run, inside the 5 tokens
    after = torch.empty(1, dtype=torch.int64)
    triton_digest.block_digests(cache, [1], [5], after)
    assert before.item() != after.item()
    cache.view(torch.int32)[1, 1, 1, 6, 1, 3] ^= 1  # past the 5 tokens: not in the payload
    again = torch.empty(1, dtype=torch.int64)
    triton_digest.block_digests(cache, [1], [5], again)
    assert again.item() == after.item()


def test_operands_are_checked():
    cache = torch.zeros(2, 2, 2, 4, 1, 16)
    out = torch.empty(1, dtype=torch.int64)
    with pytest.raises(DigestShapeError, match="outside the cache"):
        reference.block_digests(cache, [2], [4], out)
    with pytest.raises(DigestShapeError, match="token counts"):
        reference.block_digests(cache, [0], [5], out)
    with pytest.raises(DigestShapeError, match="int64"):
        reference.block_digests(cache, [0], [4], torch.empty(1, dtype=torch.int32))
    with pytest.raises(DigestShapeError, match="token counts"):
        reference.block_digests(cache, [0, 1], [4], torch.empty(2, dtype=torch.int64))
    # A token row of 6 bytes is not whole words; a one-token payload of 4 x 16 bytes is short.
    assert not supports(torch.zeros(2, 2, 2, 4, 1, 3, dtype=torch.float16))
    assert not supports(torch.zeros(2, 1, 2, 4, 1, 8, dtype=torch.float16))
    assert supports(cache) and not supports(cache[:, :, :, :2])  # a slice is not contiguous
    with pytest.raises(DigestShapeError, match="cannot digest"):
        reference.block_digests(torch.zeros(2, 1, 2, 4, 1, 8, dtype=torch.float16), [0], [1], out)


# -- the swapper ---------------------------------------------------------------------------


def test_a_swap_out_with_token_counts_carries_the_blocks_digests():
    cache = torch.randn(6, 2, 2, 16, 3, 64).to(torch.bfloat16)
    with BlockSwapper(cache, 4, digests=True) as sw:
        assert sw.digests_on
        buf = sw.swap_out([5, 1, 2], num_tokens=[16, 16, 3])
        assert [d & U64 for d in buf.digests.tolist()] == xxhash_digests(cache, [5, 1, 2], [16, 16, 3])
        buf.release()
        # No token counts: no digests (the writer hashes the rows itself).
        buf = sw.swap_out([5, 1])
        assert buf.digests is None
        buf.release()
        with pytest.raises(SwapShapeError, match="token counts"):
            sw.swap_out([5, 1], num_tokens=[16, 17])
        with pytest.raises(SwapShapeError, match="2 token counts for 1 blocks"):
            sw.swap_out([5], num_tokens=[16, 16])
        assert sw.in_use == 0


def test_digests_are_off_by_default_on_the_cpu_and_refused_where_impossible():
    cache = torch.randn(6, 2, 2, 16, 3, 64)
    with BlockSwapper(cache, 4) as sw:
        assert not sw.digests_on
        with sw.swap_out([1], num_tokens=[16]) as buf:
            assert buf.digests is None
    with pytest.raises(SwapShapeError, match="digests asked for"):
        BlockSwapper(torch.zeros(4, 1, 2, 4, 1, 8, dtype=torch.float16), 2, digests=True)


def test_the_probe_tells_a_wrong_or_failing_implementation(caplog):
    from kernels.digest.probe import disagreement

    cache = torch.randn(3, 2, 2, 8, 2, 16)
    assert disagreement(cache, reference.block_digests) is None

    def zeros(cache, ids, tokens, out):
        out.zero_()

    def broken(cache, ids, tokens, out):
        raise RuntimeError("no kernel for this GPU")

    assert "differ from python-xxhash" in disagreement(cache, zeros)
    assert disagreement(cache, broken) == "RuntimeError: no kernel for this GPU"


@interpreted
def test_the_probe_passes_the_triton_kernel():
    from kernels.digest import triton_digest
    from kernels.digest.probe import disagreement

    assert disagreement(torch.randn(3, 2, 2, 8, 2, 16).to(torch.bfloat16), triton_digest.block_digests) is None


def test_a_swapper_whose_digests_disagree_turns_them_off_and_says_so(monkeypatch, caplog):
    """The writer then hashes the rows itself, as without digests: a bad kernel costs the
    CPU time it would have saved, never the pool's blocks."""
    monkeypatch.setattr(reference, "block_digests", lambda cache, ids, tokens, out: out.fill_(1))
    cache = torch.randn(6, 2, 2, 16, 3, 64)
    with BlockSwapper(cache, 4, digests=True) as sw, caplog.at_level("WARNING", logger="kernels.swap.digests"):
        assert sw.digests_on
        with sw.swap_out([1, 2], num_tokens=[16, 4]) as buf:
            assert buf.digests is None and torch.equal(buf.host, cache[[1, 2]])
        assert not sw.digests_on
        assert "block digests off" in caplog.text and "differ from python-xxhash" in caplog.text
        with sw.swap_out([3], num_tokens=[16]) as buf:  # asked once only
            assert buf.digests is None
    assert caplog.text.count("block digests off") == 1


def test_a_digest_launch_that_fails_later_costs_the_digests_not_the_swap(monkeypatch, caplog):
    real = reference.block_digests
    calls = []

    def fails_after_the_probe(cache, ids, tokens, out):
        calls.append(len(out))
        if len(calls) > 1:
            raise RuntimeError("launch failed")
        real(cache, ids, tokens, out)

    monkeypatch.setattr(reference, "block_digests", fails_after_the_probe)
    cache = torch.randn(6, 2, 2, 16, 3, 64)
    with BlockSwapper(cache, 4, digests=True) as sw, caplog.at_level("WARNING", logger="kernels.swap.digests"):
        with sw.swap_out([4, 0], num_tokens=[16, 16]) as buf:
            assert buf.digests is None and torch.equal(buf.host, cache[[4, 0]])
        assert calls == [2, 2] and not sw.digests_on
        assert "after a failed launch" in caplog.text and "launch failed" in caplog.text
        with sw.swap_out([1], num_tokens=[16]) as buf:
            assert buf.digests is None and len(calls) == 2
    assert sw.in_use == 0


# -- the engine's export -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_exported_blocks_carry_the_digests_their_pool_values_need(stream):
    """What a prefill writes: each exported block's digest is the checksum its pool value
    gets when hashed on the CPU (the codec's pending value, sealed), partial tail included."""
    eng = tiny_engine(max_num_batched_tokens=40, enable_prefix_caching=False, swap_digests=True)
    ids = [300 + 3 * i for i in range(150)]  # 9 full blocks and a 6-token tail
    eng.add_request("r", ids, SamplingParams(temperature=0, max_tokens=1), export_kv=True, stream_export=stream)
    codec = BlockCodec(eng.layout)
    seen = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            e = o.exported_kv
            if e is None:
                continue
            digests = e.digests()
            assert None not in digests
            for (block, n), digest in zip(e.blocks(), digests):
                assert digest == unpack_header(codec.encode_pending(block, n).seal()[0]).checksum
                seen += 1
            e.release()
    assert seen == 10


# -- the workers' flag ---------------------------------------------------------------------


@pytest.mark.parametrize("flag, engine_value", [([], None), (["--swap-digests", "on"], True), (["--swap-digests", "off"], False)])
def test_the_worker_flag_reaches_the_engine(flag, engine_value):
    from services.common.settings import parse_settings
    from services.worker.runtime import engine_config
    from services.worker.settings import WorkerSettings

    settings = parse_settings(WorkerSettings, flag)
    assert engine_config(settings, "prefill").swap_digests is engine_value
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--swap-digests", "maybe"])
