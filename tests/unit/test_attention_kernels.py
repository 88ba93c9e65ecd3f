"""Triton paged attention against the torch reference.

On a machine without CUDA the kernels run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes stay small; with CUDA the same tests run the real kernels.
Every problem uses the engine's block-major cache (strided per-layer views), shuffled block
tables padded with valid ids, and queries that are a strided view of a fused QKV buffer.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.attention import reference as ref  # noqa: E402
from kernels.attention import triton_attention as tri  # noqa: E402
from kernels.attention.problems import PagedProblem, make_decode_problem, make_problem  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2's 9/3 GQA, MQA, plain MHA, and a
# head_dim that is not a power of two.
SHAPES = [(9, 3, 64, 16), (4, 1, 32, 8), (4, 4, 32, 16), (6, 2, 80, 16)]
SHAPE_IDS = ["gqa9-3-d64-bs16", "mqa4-1-d32-bs8", "mha4-4-d32-bs16", "gqa6-2-d80-bs16"]
# The kernels compute in fp32 and round once on store; the bf16 reference rounds inside SDPA.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _problem(query_lens, context_lens, shape, dtype, seed=0, padding_rows=0) -> PagedProblem:
    num_heads, num_kv_heads, head_dim, block_size = shape
    return make_problem(
        query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEVICE, seed=seed, padding_rows=padding_rows,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(shape, dtype):
    bs = shape[3]
    # One token, exactly one block, one past a block boundary, and several key tiles.
    p = _problem([1] * 5, [1, bs, bs + 1, 3 * bs - 1, 150], shape, dtype)
    expected = ref.paged_decode_attention(*p.decode_args())
    got = tri.paged_decode_attention(*p.decode_args())
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("prefetch_kv", [False, True], ids=["kv-after-wait", "kv-before-wait"])
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_split_k_matches_reference(num_splits, dtype, prefetch_kv):
    # A 1-token sequence leaves all but its first split empty; 300 tokens fill several.
    p = _problem([1] * 3, [1, 70, 300], SHAPES[0], dtype)
    expected = ref.paged_decode_attention(*p.decode_args())
    got = tri.paged_decode_attention_splits(*p.decode_args(), num_splits=num_splits, prefetch_kv=prefetch_kv)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert torch.equal(tri.paged_decode_attention_splits(*p.decode_args(), num_splits=num_splits, prefetch_kv=prefetch_kv), got)  # deterministic


def test_decode_picks_split_k_for_one_long_sequence():
    p = _problem([1], [700], SHAPES[0], torch.float32)
    width_tokens = p.block_tables.shape[1] * p.block_size
    assert tri.decode_num_splits(1, 3, width_tokens, p.q.device) > 1
    assert tri.decode_num_splits(1, 3, 64, p.q.device) == 1  # too short to be worth splitting
    torch.testing.assert_close(
        tri.paged_decode_attention(*p.decode_args()),
        ref.paged_decode_attention(*p.decode_args()),
        **TOLERANCE[torch.float32],
    )


def _poison_past_lengths(p: PagedProblem, value: float) -> None:
    """Fill every cache slot that no sequence reads (past its length in its blocks, and the
    blocks no table names) with ``value``; the cache is shared by all layers' views."""
    bs = p.block_size
    keep = torch.zeros(p.cache.shape[0], bs, dtype=torch.bool, device=p.cache.device)
    for table, n in zip(p.block_tables.tolist(), p.seq_lens.tolist()):
        for pos in range(n):
            keep[table[pos // bs], pos % bs] = True
    p.k_cache[~keep] = value
    p.v_cache[~keep] = value


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_what_lies_past_a_sequence_changes_nothing(impl, value):
    # An imported partial block brings a staging row's stale tail into the cache: a NaN
    # there once turned every later token of a CPU decode into token 0.
    kernels = ref if impl == "reference" else tri
    for make_args, run, queries in (
        (PagedProblem.decode_args, kernels.paged_decode_attention, [1] * 4),
        (PagedProblem.prefill_args, kernels.paged_prefill_attention, [1, 5, 16, 3]),
    ):
        p = _problem(queries, [5, 16, 21, 37], SHAPES[0], torch.float32, seed=int(torch.randint(1 << 30, ())))
        clean = run(*make_args(p))
        _poison_past_lengths(p, value)
        poisoned = run(*make_args(p))
        assert torch.isfinite(poisoned).all()
        torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_empty_sequence_gives_zeros_like_reference(num_splits):
    # CUDA-graph padding rows have seq_len 0: they must come out finite (zeros), not NaN.
    p = _problem([1] * 3, [40, 5, 90], SHAPES[0], torch.float32)
    p.seq_lens[1] = 0
    expected = ref.paged_decode_attention(*p.decode_args())
    got = tri.paged_decode_attention_splits(*p.decode_args(), num_splits=num_splits)
    assert torch.all(got[1] == 0)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill_matches_reference(shape, dtype):
    # Whole prompt; zero-length entry with a cached prefix; a chunk spanning two query tiles
    # after a longer prefix; a one-token chunk; a zero-length entry with no context at all.
    query_lens = [7, 0, 50, 1, 0, 33]
    context_lens = [7, 5, 140, 34, 0, 45]
    p = _problem(query_lens, context_lens, shape, dtype)
    expected = ref.paged_prefill_attention(*p.prefill_args())
    got = tri.paged_prefill_attention(*p.prefill_args())
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def _poison_fresh_rows(p: PagedProblem, value: float) -> list[int]:
    """Overwrite the cache rows of the sequences whose context is this step's queries (what
    ``new_kv`` also holds) with ``value``; returns those sequences' indices."""
    starts, lens, tables = p.query_start_loc.tolist(), p.seq_lens.tolist(), p.block_tables.tolist()
    fresh = [i for i, n in enumerate(lens) if n and n == starts[i + 1] - starts[i]]
    for i in fresh:
        for pos in range(lens[i]):
            p.k_cache[tables[i][pos // p.block_size], pos % p.block_size] = value
            p.v_cache[tables[i][pos // p.block_size], pos % p.block_size] = value
    return fresh


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the poisoned (NaN) cache rows
@pytest.mark.parametrize("tma", [False, True], ids=["row-loads", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill_reads_fresh_prompts_from_new_kv(shape, dtype, tma, monkeypatch):
    # Fresh prompts (context = this chunk: one token, one and several query tiles, 130 keys
    # over three key tiles) beside chunks after a cached prefix and zero-length entries.
    # With new_kv the fresh ones read this step's K/V rows (its own kernel, with TMA or
    # row loads), the rest the cache; either way the output is the cache-only one.
    from kernels.attention import triton_prefill

    monkeypatch.setattr(triton_prefill, "_use_tma", lambda q, k, v: tma)
    query_lens = [7, 0, 50, 1, 0, 33, 130, 1]
    context_lens = [7, 5, 140, 1, 0, 45, 130, 20]
    p = _problem(query_lens, context_lens, shape, dtype, seed=int(torch.randint(1 << 30, ())))
    new_kv = p.new_kv()
    expected = ref.paged_prefill_attention(*p.prefill_args())
    got = tri.paged_prefill_attention(*p.prefill_args(), new_kv)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(ref.paged_prefill_attention(*p.prefill_args(), new_kv), expected, **TOLERANCE[dtype])

    # Which source the fresh prompts read: their cache rows poisoned, new_kv intact.
    fresh = _poison_fresh_rows(p, float("nan"))
    poisoned = tri.paged_prefill_attention(*p.prefill_args(), new_kv)
    rows = torch.cat([torch.arange(p.query_start_loc[i], p.query_start_loc[i + 1]) for i in fresh]).to(got.device)
    if shape[2] == tri.head_block(shape[2]):  # whole-head tiles: the fresh kernel serves them
        torch.testing.assert_close(poisoned, got, atol=0, rtol=0)
        torch.testing.assert_close(ref.paged_prefill_attention(*p.prefill_args(), new_kv), expected, **TOLERANCE[dtype])
    else:  # a head size the fresh kernel does not take: everything reads the cache
        assert torch.isnan(poisoned[rows]).all()
        others = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
        others[rows] = False
        torch.testing.assert_close(poisoned[others], got[others], atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the poisoned (NaN) rows
@pytest.mark.parametrize("tma", [False, True], ids=["row-loads", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fresh_prefill_ignores_the_rows_past_the_last_sequence(dtype, tma, monkeypatch):
    # A CUDA graph's token bucket has rows past the last sequence's queries that belong to no
    # sequence and hold whatever the graph's memory held: NaN and inf here. A fresh prompt's
    # diagonal key tile spans them (a TMA box loads them whole); the masked keys' zero
    # probabilities must not meet them in P @ V (0 * NaN is NaN). Found on two H200s, where
    # a tensor-parallel rank's bucket held NaN and every sampled token came out 0.
    from kernels.attention import triton_prefill

    monkeypatch.setattr(triton_prefill, "_use_tma", lambda q, k, v: tma)
    query_lens = [7, 0, 50, 6]
    context_lens = [7, 5, 60, 6]
    p = _problem(query_lens, context_lens, SHAPES[0], dtype, padding_rows=10, seed=int(torch.randint(1 << 30, ())))
    k, v = p.new_kv()
    real = sum(query_lens)
    for t in (k, v):
        t[real:] = float("nan")
        t[real + 1 :: 3] = float("inf")
    expected = ref.paged_prefill_attention(*p.prefill_args())[:real]
    got = tri.paged_prefill_attention(*p.prefill_args(), (k, v))[:real]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_prefill_new_kv_of_another_dtype_is_not_read():
    # K/V rows of another dtype than the cache differ from what it holds (rounded on
    # store): the kernel and the reference then read the cache for every sequence.
    p = _problem([9, 4], [9, 4], SHAPES[0], torch.bfloat16)
    k, v = p.new_kv()
    expected = ref.paged_prefill_attention(*p.prefill_args())
    wrong = (k.float() + 1.0, v.float() + 1.0)
    torch.testing.assert_close(tri.paged_prefill_attention(*p.prefill_args(), wrong), expected, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(ref.paged_prefill_attention(*p.prefill_args(), wrong), expected, atol=0, rtol=0)


def test_prefill_causal_edge_at_key_tile_boundaries():
    # The kernel skips the causal mask for keys every row of a query tile sees; a tile whose
    # first query sits at positions 60..65 (around the 64-key tile edge) checks that split,
    # for the first query tile of a sequence and for a later one (GQA 9/3 packs 42 tokens per
    # tile, so the second tile of a 100-query chunk after a 20-token prefix starts at 62).
    query_lens = [3] * 6 + [100]
    context_lens = [prefix + 3 for prefix in range(60, 66)] + [120]
    p = _problem(query_lens, context_lens, SHAPES[0], torch.float32)
    torch.testing.assert_close(
        tri.paged_prefill_attention(*p.prefill_args()),
        ref.paged_prefill_attention(*p.prefill_args()),
        **TOLERANCE[torch.float32],
    )


def test_prefill_query_tiles_of_one_long_mha_sequence():
    # Without GQA packing a query tile holds 128 tokens: 300 queries span three tiles.
    p = _problem([300, 4], [310, 4], (2, 2, 32, 8), torch.float32)
    torch.testing.assert_close(
        tri.paged_prefill_attention(*p.prefill_args()),
        ref.paged_prefill_attention(*p.prefill_args()),
        **TOLERANCE[torch.float32],
    )


def test_prefill_of_single_tokens_equals_decode():
    p = _problem([1] * 4, [3, 16, 17, 90], SHAPES[0], torch.float32)
    torch.testing.assert_close(
        tri.paged_prefill_attention(*p.prefill_args()),
        tri.paged_decode_attention(*p.decode_args()),
        **TOLERANCE[torch.float32],
    )


@pytest.mark.parametrize(
    "key_dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16", "fp32-into-bf16"],
)
def test_store_kv_writes_exactly_its_slots(key_dtype, cache_dtype):
    num_heads, num_kv_heads, head_dim, block_size = SHAPES[0]
    gen = torch.Generator().manual_seed(3)
    p = make_decode_problem(
        [40, 70], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=cache_dtype, device=DEVICE, seed=3,
    )
    num_slots = p.k_cache.shape[0] * block_size
    slots = torch.randperm(num_slots, generator=gen)[:9]
    slots[4] = -1  # padding: writes nothing
    slots = slots.to(DEVICE)
    # K and V as the model produces them: strided views of one fused QKV buffer.
    qkv = torch.randn((9, (num_heads + 2 * num_kv_heads) * head_dim), generator=gen)
    qkv = qkv.to(dtype=key_dtype, device=DEVICE)
    kv = qkv[:, num_heads * head_dim :].view(9, 2, num_kv_heads, head_dim)
    key, value = kv[:, 0], kv[:, 1]

    expected = p.cache.clone()
    ref.store_kv(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    before = p.cache.clone()
    tri.store_kv(key, value, p.k_cache, p.v_cache, slots)
    if key_dtype == cache_dtype or DEVICE == "cuda":
        assert torch.equal(p.cache, expected)
    else:  # the interpreter truncates fp32 -> bf16 where CUDA rounds to nearest even
        torch.testing.assert_close(p.cache, expected, atol=0, rtol=2**-7)

    # Exactly the 8 real slots changed, in layer 1 only, K and V both.
    changed = (p.cache != before).flatten(4).any(-1)  # [blocks, layers, 2, block_size]
    written = torch.zeros_like(changed)
    real = slots[slots >= 0]
    written[real // block_size, 1, :, real % block_size] = True
    assert torch.equal(changed, written)


def _rope_tables(head_dim: int, max_pos: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("prefetch_kv", [False, True], ids=["kv-after-wait", "kv-before-wait"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rotary_decode_equals_rotary_store_then_decode(shape, num_splits, prefetch_kv):
    """The decode kernel with the rotation and the KV store folded in (the model's decode
    steps on CUDA): the cache gets exactly what rotary_store_kv writes, the output matches
    the reference, q and k are left as they were, a padding row (slot -1, length 0) writes
    nothing and reads zeros. With the first tile of cached keys loaded before the store
    (``prefetch_kv``), the new token's row must still be the one just stored."""
    num_heads, num_kv_heads, head_dim, bs = shape
    if prefetch_kv and head_dim != tri.head_block(head_dim):
        pytest.skip("head sizes that are not a power of two take the two kernels, whichever form")
    p = _problem([1] * 5, [1, bs, 3 * bs - 1, 150, 5], shape, torch.float32, seed=num_splits)
    seq_lens = p.seq_lens.clone()
    seq_lens[-1] = 0
    lens = seq_lens.tolist()
    tables = p.block_tables.cpu()
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs if n else -1 for i, n in enumerate(lens)], device=DEVICE)
    positions = (seq_lens.long() - 1).clamp_min(0)
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim + num_splits)
    kv = torch.empty((5, 2 * num_kv_heads * head_dim), device=DEVICE).normal_(generator=gen)
    k = kv[:, : num_kv_heads * head_dim].view(5, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim :].view(5, num_kv_heads, head_dim)
    cos, sin = _rope_tables(head_dim)
    q_before, kv_before = p.q.clone(), kv.clone()

    unfused_cache = p.cache.clone()
    uq, _ = tri.rotary_store_kv(p.q.clone(), k.clone(), v, positions, cos, sin, unfused_cache[:, 1, 0], unfused_cache[:, 1, 1], slots)
    expected = ref.paged_decode_attention(uq, unfused_cache[:, 1, 0], unfused_cache[:, 1, 1], p.block_tables, seq_lens, p.scale)

    rope = (k, v, positions, cos, sin, slots)
    if head_dim == tri.head_block(head_dim):
        got = tri.paged_decode_attention_splits(p.q, p.k_cache, p.v_cache, p.block_tables, seq_lens, p.scale, num_splits=num_splits, rope=rope,
                                                prefetch_kv=prefetch_kv)
    else:  # head sizes that are not a power of two take the two kernels
        got = tri.rotary_decode_attention(p.q, k, v, positions, cos, sin, p.k_cache, p.v_cache, slots, p.block_tables, seq_lens, p.scale)
    assert torch.equal(p.cache, unfused_cache)  # every slot, padding's included, as the unfused store left it
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    assert not got[-1].any()  # the padding row
    assert torch.equal(p.q, q_before) and torch.equal(kv, kv_before)
    ref_cache = p.cache.clone()
    torch.testing.assert_close(
        ref.rotary_decode_attention(p.q, k, v, positions, cos, sin, ref_cache[:, 1, 0], ref_cache[:, 1, 1], slots, p.block_tables, seq_lens, p.scale),
        expected, **TOLERANCE[torch.float32],
    )


def test_rotary_decode_builds_for_hopper_as_the_gpu_runs_it():
    """The fused decode kernel as a bf16 decode step launches it on an H100 (tensor-core
    dots, SmolLM2's 9/3 heads of 64, 1 to 64 sequences, with and without splits), compiled
    here for sm_90: it builds and does not spill (tests/sm90_compile.py)."""
    from pathlib import Path

    from tests import sm90_compile, triton_launches

    if not sm90_compile.tools_available() or not triton_launches.recording():
        pytest.skip("needs Triton's NVIDIA tools and the interpreter (a CPU run)")
    bf16 = dict(dtype=torch.bfloat16)
    cos, sin = torch.empty(4096, 64), torch.empty(4096, 64)
    cache = torch.empty(64, 2, 16, 3, 64, **bf16)
    with triton_launches.capture() as jobs:  # nothing runs
        for batch in (1, 64):
            qkv = torch.empty(batch, (9 + 6) * 64, **bf16)
            q, k, v = (t.view(batch, -1, 64) for t in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=1))
            args = (k, v, torch.zeros(batch, dtype=torch.long), cos, sin, torch.zeros(batch, dtype=torch.long))
            for splits in (1, 8):
                tri.paged_decode_attention_splits(q, cache[:, 0], cache[:, 1], torch.zeros(batch, 256, dtype=torch.int32),
                                                  torch.ones(batch, dtype=torch.int32), 0.125, num_splits=splits, rope=args)
    decode = [j for j in jobs if j["kernel"] == "_decode_kernel"]
    assert len(decode) == 4 and all(j["constexprs"]["ROPE"] for j in decode)
    assert [j["constexprs"]["PREFETCH_KV"] for j in decode] == [True, True, False, False]  # batch 1's first tile before the wait
    for job in decode:
        job["constexprs"]["NATIVE_DOT"] = True  # bf16 on CUDA feeds the tensor cores (the interpreter cannot)
    results = sm90_compile.compile_in_subprocess(jobs, cwd=Path(__file__).resolve().parents[2])
    for job, res in zip(jobs, results):
        assert "error" not in res, (job["kernel"], job["constexprs"], res)
        assert res["local"] == 0, (job["kernel"], job["constexprs"], res)


def test_backend_takes_the_fused_decode_only_where_asked(monkeypatch):
    """``PagedAttention`` sends a decode-only step with rotary tables to ``rotary_decode``
    when it has one (the Triton backend: by default; TIDEPOOL_FUSED_DECODE=0 turns it off),
    and every other step through the rotary store and the decode/prefill kernels."""
    from libs.model.attention import FUSED_DECODE_ENV, AttentionMetadata, PagedAttention, triton_backend

    calls = []

    def record(name, result=None):
        def call(*args):
            calls.append(name)
            return name if result is None else result

        return call

    def meta(prefill_tokens):
        z = torch.zeros(2, dtype=torch.int32)
        return AttentionMetadata(z, z[:, None], z, z, num_decodes=2 - (prefill_tokens > 0), num_prefill_tokens=prefill_tokens)

    fused = PagedAttention("t", record("store"), record("decode"), record("prefill"), record("rotary_store", (None, None)), record("fused"))
    plain = PagedAttention("t", record("store"), record("decode"), record("prefill"), record("rotary_store", (None, None)))
    rope = (torch.zeros(2), torch.zeros(4, 2), torch.zeros(4, 2))
    assert fused(None, None, None, None, None, meta(0), 1.0, rope) == "fused" and calls == ["fused"]
    calls.clear()
    assert plain(None, None, None, None, None, meta(0), 1.0, rope) == "decode" and calls == ["rotary_store", "decode"]
    calls.clear()
    fused(None, None, None, None, None, meta(0), 1.0, None)  # already rotated (the CPU path)
    assert calls == ["store", "decode"]
    monkeypatch.delenv(FUSED_DECODE_ENV, raising=False)
    assert triton_backend()._rotary_decode is tri.rotary_decode_attention
    monkeypatch.setenv(FUSED_DECODE_ENV, "0")
    assert triton_backend()._rotary_decode is None
    assert triton_backend(fused_decode=True)._rotary_decode is tri.rotary_decode_attention
    monkeypatch.setenv(FUSED_DECODE_ENV, "yes")
    with pytest.raises(ValueError, match="TIDEPOOL_FUSED_DECODE"):
        triton_backend()


@pytest.mark.parametrize("tma", [False, True], ids=["row-loads", "tma"])
def test_fresh_prefill_builds_for_hopper_as_the_gpu_runs_it(tma, monkeypatch):
    """The fresh prompts' prefill kernel as a bf16 or fp32 step launches it on Hopper
    (SmolLM2's 9/3 heads of 64 and Qwen2.5-7B's 28/4 of 128, K/V as views of the qkv
    projection's output), with the paged kernel beside it skipping those sequences,
    compiled here for sm_90: both build, do not spill, and fit Hopper's 227 KB of shared
    memory a block (tests/sm90_compile.py; fp32 at the 16-bit tiles did not)."""
    from pathlib import Path

    from kernels.attention import triton_prefill
    from tests import sm90_compile, triton_launches

    if not sm90_compile.tools_available() or not triton_launches.recording():
        pytest.skip("needs Triton's NVIDIA tools and the interpreter (a CPU run)")
    monkeypatch.setattr(triton_prefill, "_use_tma", lambda q, k, v: tma)
    with triton_launches.capture() as jobs:  # nothing runs
        for dtype in (torch.bfloat16, torch.float32):
            for heads, kv_heads, dim in ((9, 3, 64), (28, 4, 128)):
                qkv = torch.empty(4096, (heads + 2 * kv_heads) * dim, dtype=dtype)
                q, k, v = (t.view(4096, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
                cache = torch.empty(512, 2, 16, kv_heads, dim, dtype=dtype)
                starts = torch.tensor([0, 1024, 4096], dtype=torch.int32)
                tri.paged_prefill_attention(q, cache[:, 0], cache[:, 1], torch.zeros(2, 256, dtype=torch.int32), starts,
                                            torch.tensor([1024, 3072], dtype=torch.int32), 0.125, (k, v))
    kernels = sorted(j["kernel"] for j in jobs)
    assert kernels == ["_fresh_prefill_kernel"] * 4 + ["_prefill_kernel"] * 4
    for job in jobs:
        # 16-bit operands on CUDA feed the tensor cores (the interpreter cannot); fp32 stays IEEE.
        job["constexprs"]["NATIVE_DOT"] = job["types"]["q_ptr"] != "*fp32"
        if job["kernel"] == "_fresh_prefill_kernel":
            assert job["constexprs"]["TMA"] is tma
        else:
            assert job["constexprs"]["SKIP_FRESH"] is True
    results = sm90_compile.compile_in_subprocess(jobs, cwd=Path(__file__).resolve().parents[2])
    for job, res in zip(jobs, results):
        assert "error" not in res, (job["kernel"], job["constexprs"], res)
        assert res["local"] == 0, (job["kernel"], job["constexprs"], res)
        assert res["shared"] <= sm90_compile.HOPPER_SHARED_BYTES, (job["kernel"], job["types"]["q_ptr"], job["constexprs"], res)


def test_backend_hands_prefill_the_stored_rows_where_they_equal_the_cache(monkeypatch):
    """``PagedAttention`` gives the prefill kernel this step's K/V (``new_kv``) when the cache
    holds them unchanged (same dtype) and the backend has it on (the Triton backend: by
    default; TIDEPOOL_FRESH_PREFILL=0 turns it off); with decode rows first, their rows are
    cut off as the queries are."""
    from libs.model.attention import FRESH_PREFILL_ENV, AttentionMetadata, PagedAttention, triton_backend

    seen = []

    def prefill(q, k_cache, v_cache, tables, starts, lens, scale, new_kv=None):
        seen.append(new_kv)
        return torch.zeros_like(q)

    def decode(q, *args):
        return torch.zeros_like(q)

    k, v, q = torch.randn(5, 1, 4), torch.randn(5, 1, 4), torch.randn(5, 2, 4)
    cache = torch.zeros(2, 4, 1, 4)
    z = torch.zeros(3, dtype=torch.int32)
    mixed = AttentionMetadata(torch.zeros(5, dtype=torch.long), z[:, None], z, z[:2], num_decodes=2, num_prefill_tokens=3)
    only = AttentionMetadata(torch.zeros(5, dtype=torch.long), z[:, None], z, z[:2], num_decodes=0, num_prefill_tokens=5)
    store = lambda *args: None  # noqa: E731
    on = PagedAttention("t", store, decode, prefill, None)
    on(q, k, v, cache, cache, only, 1.0)
    on(q, k, v, cache, cache, mixed, 1.0)
    assert seen[0][0] is k and seen[0][1] is v
    assert torch.equal(seen[1][0], k[2:]) and torch.equal(seen[1][1], v[2:])
    seen.clear()
    on(q, k.double(), v.double(), cache, cache, only, 1.0)  # the cache would round them
    PagedAttention("t", store, decode, prefill, None, fresh_prefill=False)(q, k, v, cache, cache, only, 1.0)
    assert seen == [None, None]
    monkeypatch.delenv(FRESH_PREFILL_ENV, raising=False)
    assert triton_backend().fresh_prefill is True
    monkeypatch.setenv(FRESH_PREFILL_ENV, "0")
    assert triton_backend().fresh_prefill is False
    assert triton_backend(fresh_prefill=True).fresh_prefill is True
    monkeypatch.setenv(FRESH_PREFILL_ENV, "no")
    with pytest.raises(ValueError, match="TIDEPOOL_FRESH_PREFILL"):
        triton_backend()
