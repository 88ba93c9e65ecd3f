"""Triton paged attention on CUDA at realistic sizes, against the torch reference, and the
decode kernels captured in a CUDA graph and replayed on changing inputs.

Shapes: SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64) and a Llama-style 32/8 x 128,
block size 16, in the engine's block-major cache.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

triton = pytest.importorskip("triton")

from kernels.attention import reference as ref  # noqa: E402
from kernels.attention import triton_attention as tri  # noqa: E402
from kernels.attention.problems import PagedProblem, make_decode_problem, make_problem  # noqa: E402

SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
MODELS = [SMOLLM2, LLAMA]
MODEL_IDS = ["smollm2", "llama"]
# bf16 feeds the tensor cores (probabilities rounded to bf16 for P @ V, as flash attention
# does); fp32 multiplies in IEEE fp32.
TOLERANCE = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


def _lens(n: int, low: int, high: int, seed: int) -> list[int]:
    return torch.randint(low, high + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_decode_batch_64_matches_reference(model, dtype):
    context = _lens(64, 1, 2048, seed=1)
    context[:4] = [1, 16, 17, 2048]
    p = make_decode_problem(context, dtype=dtype, device="cuda", **model)
    torch.testing.assert_close(
        tri.paged_decode_attention(*p.decode_args()),
        ref.paged_decode_attention(*p.decode_args()),
        **TOLERANCE[dtype],
    )


@pytest.mark.parametrize("context", [[4096], [2048, 3000, 5], [8191]], ids=["1x4096", "3-mixed", "1x8191"])
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_decode_split_k_long_context_matches_reference(model, context):
    p = make_decode_problem(context, dtype=torch.bfloat16, device="cuda", **model)
    width = p.block_tables.shape[1] * p.block_size
    assert tri.decode_num_splits(len(context), model["num_kv_heads"], width, p.q.device) > 1
    torch.testing.assert_close(
        tri.paged_decode_attention(*p.decode_args()),
        ref.paged_decode_attention(*p.decode_args()),
        **TOLERANCE[torch.bfloat16],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_prefill_mixed_chunks_match_reference(model, dtype):
    # 16 sequences: whole prompts, chunks after longer prefixes, single tokens, empty entries.
    query_lens = _lens(16, 1, 1024, seed=2)
    prefixes = _lens(16, 0, 1500, seed=3)
    query_lens[:4] = [1024, 0, 1, 0]
    prefixes[:4] = [0, 700, 2000, 0]
    context = [q + pre for q, pre in zip(query_lens, prefixes)]
    p = make_problem(query_lens, context, dtype=dtype, device="cuda", **model)
    torch.testing.assert_close(
        tri.paged_prefill_attention(*p.prefill_args()),
        ref.paged_prefill_attention(*p.prefill_args()),
        **TOLERANCE[dtype],
    )


def _fresh_problem(model, dtype, seed):
    # 16 sequences, every other one fresh (nothing cached before this chunk), including a
    # 2048-token prompt and a one-token one; the rest chunks after a cached prefix. Every
    # sequence holds blocks for at least 16 more keys than its queries, so any of them can
    # become a cached one (its length raised by 16) without leaving its own blocks.
    query_lens = _lens(16, 1, 1024, seed=seed)
    prefixes = _lens(16, 16, 600, seed=seed + 1)
    query_lens[:4] = [2048, 300, 1, 64]
    p = make_problem(query_lens, [q + pre for q, pre in zip(query_lens, prefixes)], dtype=dtype, device="cuda", **model)
    lens = p.seq_lens.tolist()
    lens[::2] = query_lens[::2]
    p.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    return p


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "row-loads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_prefill_fresh_prompts_from_new_kv_match_reference(model, dtype, tma, monkeypatch):
    # The fresh prompts' kernel on the GPU: TMA (what Hopper takes by itself) or row loads,
    # against the reference; then their cache rows poisoned, which it must not read.
    from kernels.attention import triton_prefill

    if tma and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    p = _fresh_problem(model, dtype, seed=5)
    new_kv = p.new_kv()
    assert triton_prefill._use_tma(p.q, *new_kv)  # the model's views take TMA here
    if not tma:
        monkeypatch.setattr(triton_prefill, "_use_tma", lambda q, k, v: False)
    expected = ref.paged_prefill_attention(*p.prefill_args())
    got = tri.paged_prefill_attention(*p.prefill_args(), new_kv)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    starts, lens = p.query_start_loc.tolist(), p.seq_lens.tolist()
    tables = p.block_tables.tolist()
    for i in range(0, 16, 2):
        for pos in range(lens[i]):
            p.k_cache[tables[i][pos // p.block_size], pos % p.block_size] = float("nan")
    torch.testing.assert_close(tri.paged_prefill_attention(*p.prefill_args(), new_kv), got, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("model", MODELS, ids=MODEL_IDS)
def test_prefill_fresh_prompts_ignore_nan_padding_rows(model, dtype):
    # A CUDA graph's token bucket has rows past the last sequence that hold whatever its
    # memory held. With NaN there, every real row still matches the reference: a TP=2
    # engine sampled only token 0 when a fresh prompt's diagonal TMA box fed them to P @ V.
    lens = [6, 70, 1, 130]
    p = make_problem(lens, lens, dtype=dtype, device="cuda", padding_rows=37, **model)
    k, v = p.new_kv()
    real = sum(lens)
    k[real:], v[real:] = float("nan"), float("nan")
    got = tri.paged_prefill_attention(*p.prefill_args(), (k, v))[:real]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref.paged_prefill_attention(*p.prefill_args())[:real], **TOLERANCE[dtype])


def test_prefill_with_new_kv_replays_from_a_graph_as_the_mix_changes():
    # One capture serves any mix of fresh and cached sequences: which kernel serves a
    # sequence is decided on the device from its lengths. Replayed after sequences switch
    # between fresh and cached (their lengths, slots and K/V rewritten in place).
    p = _fresh_problem(SMOLLM2, torch.bfloat16, seed=7)
    new_kv = p.new_kv()
    tri.paged_prefill_attention(*p.prefill_args(), new_kv)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.paged_prefill_attention(*p.prefill_args(), new_kv)
    for step in range(3):
        lens = p.seq_lens.tolist()
        q_lens = (p.query_start_loc[1:] - p.query_start_loc[:-1]).tolist()
        for i in range(step, 16, 2):  # half the sequences swap between fresh and cached
            lens[i] = q_lens[i] + 16 if lens[i] == q_lens[i] else q_lens[i]
        p.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        p.q.normal_()
        new_kv[0].normal_()
        new_kv[1].normal_()
        assert p.new_kv()[0].data_ptr() == new_kv[0].data_ptr()  # rewrites the cache from the same rows
        graph.replay()
        torch.testing.assert_close(out, ref.paged_prefill_attention(*p.prefill_args()), **TOLERANCE[torch.bfloat16])


def test_store_kv_matches_reference_exactly():
    p = make_decode_problem([4096] * 4, dtype=torch.bfloat16, device="cuda", **SMOLLM2)
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(p.k_cache.shape[0] * p.block_size, generator=gen)[:3000]
    slots[::7] = -1
    slots = slots.cuda()
    key = torch.randn((3000, 3, 64), device="cuda", dtype=torch.bfloat16)
    value = torch.randn((3000, 3, 64), device="cuda", dtype=torch.bfloat16)
    expected = p.cache.clone()
    ref.store_kv(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)
    tri.store_kv(key, value, p.k_cache, p.v_cache, slots)
    assert torch.equal(p.cache, expected)


def _graph_step(p: PagedProblem, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor):
    """One layer of a decode step: write this token's K/V, then attend."""
    tri.store_kv(key, value, p.k_cache, p.v_cache, slots)
    return tri.paged_decode_attention(*p.decode_args())


@pytest.mark.parametrize("batch,max_context", [(32, 2048), (1, 4096)], ids=["batch32", "batch1-split"])
def test_decode_cuda_graph_replays_with_new_inputs(batch, max_context):
    """Capture store_kv + decode once, then replay with new seq_lens, block tables, queries
    and K/V written into the static input tensors: each replay matches the reference."""
    p = make_decode_problem([max_context] * batch, dtype=torch.bfloat16, device="cuda", seed=5,
                            spare_blocks=2 * batch + 8, **SMOLLM2)
    width = p.block_tables.shape[1]
    splits = tri.decode_num_splits(batch, 3, width * p.block_size, p.q.device)
    if batch == 1:
        assert splits > 1  # the graph covers the split-K path and its reduce kernel
    key = torch.zeros((batch, 3, 64), dtype=torch.bfloat16, device="cuda")
    value = torch.zeros_like(key)
    slots = torch.full((batch,), -1, dtype=torch.int64, device="cuda")
    num_blocks = p.k_cache.shape[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        _graph_step(p, key, value, slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _graph_step(p, key, value, slots)

    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        lens = torch.randint(1, max_context + 1, (batch,), generator=gen)
        # Distinct blocks everywhere, so no two sequences write the same slot.
        tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
        # This token's slot: its position lens-1 in the block the table maps it to.
        pos = lens - 1
        new_slots = tables.gather(1, (pos // p.block_size).unsqueeze(1)).squeeze(1) * p.block_size
        new_slots += pos % p.block_size
        p.seq_lens.copy_(lens)
        p.block_tables.copy_(tables)
        slots.copy_(new_slots)
        p.q.copy_(torch.randn(p.q.shape, generator=gen))
        key.copy_(torch.randn(key.shape, generator=gen))
        value.copy_(torch.randn(value.shape, generator=gen))
        expected_cache = p.cache.clone()
        ref.store_kv(key, value, expected_cache[:, 1, 0], expected_cache[:, 1, 1], slots)
        expected = ref.paged_decode_attention(
            p.q, expected_cache[:, 1, 0], expected_cache[:, 1, 1], p.block_tables, p.seq_lens,
            p.scale,
        )
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(p.cache, expected_cache)
        torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])


def test_rotary_store_kv_and_argmax_cuda_graphs_replay_new_inputs():
    """The decode step's fused rotary + KV store and the sampler's argmax, captured once and
    replayed on new positions, slots, K/V and logits: each replay equals the references."""
    from kernels.argmax import reference as argmax_ref
    from kernels.argmax import triton_argmax as argmax_tri
    from kernels.split_counters import all_counters_zero

    gen = torch.Generator().manual_seed(11)
    T, heads, kv_heads, d, block_size, num_blocks = 8, 9, 3, 64, 16, 64
    cos = torch.randn((4096, d), generator=gen).cuda()
    sin = torch.randn((4096, d), generator=gen).cuda()
    qkv = torch.zeros((T, (heads + 2 * kv_heads) * d), dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.view(T, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1))
    positions = torch.zeros(T, dtype=torch.int64, device="cuda")
    slots = torch.full((T,), -1, dtype=torch.int64, device="cuda")
    cache = torch.zeros((num_blocks, 1, 2, block_size, kv_heads, d), dtype=torch.bfloat16, device="cuda")
    logits = torch.zeros((4, 128256), device="cuda")

    def step():
        tri.rotary_store_kv(q, k, v, positions, cos, sin, cache[:, 0, 0], cache[:, 0, 1], slots)
        return argmax_tri.argmax(logits)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = step()
    for _ in range(3):
        fresh = torch.randn(qkv.shape, generator=gen).to(torch.bfloat16).cuda()
        qkv.copy_(fresh)
        positions.copy_(torch.randint(0, 4096, (T,), generator=gen))
        new_slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
        new_slots[3] = -1
        slots.copy_(new_slots)
        logits.copy_(torch.randn(logits.shape, generator=gen))
        logits[1, 70000] = logits[1, 9] = 99.0  # a tie across chunks: the first index
        expected_cache = cache.clone()
        eq, ek = ref.rotary_store_kv(*(t.view(T, -1, d) for t in fresh.cuda().split([heads * d, kv_heads * d, kv_heads * d], -1)),
                                     positions, cos, sin, expected_cache[:, 0, 0], expected_cache[:, 0, 1], slots)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(q, eq) and torch.equal(k, ek) and torch.equal(cache, expected_cache)
        assert torch.equal(tokens, argmax_ref.argmax(logits))
    assert all_counters_zero()
