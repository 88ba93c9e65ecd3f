"""Scheduler and block manager behaviour, on a tiny random model (fast, deterministic)."""

import pytest

from libs.engine import SamplingParams
from tests.models import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompts(n: int, length: int, offset: int = 100) -> list[list[int]]:
    return [[offset + 7 * i + j for j in range(length + 3 * i)] for i in range(n)]


def test_preemption_recomputes_and_leaks_nothing():
    ps = prompts(6, 40)
    reference = [tiny_engine(num_blocks=256).generate([p], GREEDY)[0].token_ids for p in ps]
    eng = tiny_engine(num_blocks=24)  # 384 token slots for ~6 * 100 tokens: must preempt
    results = eng.generate(ps, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == reference
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(c == 0 for c in bm.ref_counts)


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding", "after_fork"])
def test_abort_frees_blocks_at_once(when):
    eng = tiny_engine(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=1 if when == "waiting" else 8)
    bm = eng.block_manager
    if when == "waiting":
        eng.add_request("other", prompts(1, 20)[0], GREEDY)
    n = 3 if when == "after_fork" else 1
    eng.add_request("victim", prompts(1, 100, offset=900)[0], SamplingParams(temperature=0.5, n=n, max_tokens=50, seed=1))
    steps = {"waiting": 1, "mid_prefill": 1, "decoding": 8, "after_fork": 6}[when]
    for _ in range(steps):
        eng.step()
    held = [s for s in eng._requests["victim"]]
    if when == "mid_prefill":
        assert 0 < held[0].num_computed_tokens < held[0].num_prompt_tokens
    if when == "decoding":
        assert held[0].num_output_tokens > 0
    if when == "after_fork":
        assert len(held) == 3
    assert eng.abort_request("victim")
    others = sum(len(s.block_table) for fam in eng._requests.values() for s in fam if s.request_id != "victim")
    assert bm.num_used_blocks == others  # the victim's blocks are free before the next step
    outs = [o for o in eng.step() if o.request_id == "victim"]
    assert outs and outs[0].finished and all(c.finish_reason == "abort" for c in outs[0].outputs)
    while eng.has_unfinished_requests():
        eng.step()
    assert bm.num_free_blocks == bm.num_blocks
    assert not eng.abort_request("victim")


def test_n_sequences_share_the_prompt_blocks():
    eng = tiny_engine(num_blocks=64)
    prompt = prompts(1, 50)[0]  # 3 full blocks + a partial one
    eng.add_request("r", prompt, SamplingParams(temperature=1.0, n=4, max_tokens=8, seed=5))
    eng.step()  # prefill + fork
    fam = eng._requests["r"]
    assert len(fam) == 4
    full = len(prompt) // 16
    shared = fam[0].block_table[:full]
    for s in fam[1:]:
        assert s.block_table[:full] == shared
        assert s.block_table[full] != fam[0].block_table[full]  # partial block copied
    assert all(eng.block_manager.ref_counts[b] == 4 for b in shared)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks == 64


def test_n_samples_are_distinct_and_reproducible():
    params = SamplingParams(temperature=1.0, n=3, max_tokens=12, seed=7)
    a = tiny_engine().generate([prompts(1, 30)[0]], params)
    b = tiny_engine().generate([prompts(1, 30)[0]], params)
    assert [r.index for r in a] == [0, 1, 2]
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) == 3


def test_token_budget_and_seq_cap_are_respected():
    eng = tiny_engine(num_blocks=128, max_num_batched_tokens=40, max_num_seqs=3)
    for i, p in enumerate(prompts(5, 30)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=5))
    schedule, seen = eng.scheduler.schedule, []

    def spy():
        out = schedule()
        seen.append((out.num_batched_tokens, len(eng.scheduler.running)))
        return out

    eng.scheduler.schedule = spy
    while eng.has_unfinished_requests():
        eng.step()
    assert seen and max(tokens for tokens, _ in seen) == 40  # the budget was filled, never exceeded
    assert max(running for _, running in seen) == 3
    assert eng.block_manager.num_free_blocks == 128


def test_prefix_cache_shares_blocks_between_requests():
    eng = tiny_engine(num_blocks=64)
    prompt = prompts(1, 64)[0]
    eng.generate([prompt], GREEDY)
    second = eng.generate([prompt + [5, 6, 7]], GREEDY)[0]
    assert second.num_cached_tokens == 64


def test_admission_hashes_only_what_the_prefix_lookup_needs():
    """A prompt's block keys are computed at admission only as far as the cache hits (a
    new prompt: one hash), the rest once its step is launched (before the GPU finishes),
    and the full chain is what ``commit`` publishes: the next request still hits it."""
    from libs.blocks import block_keys

    eng = tiny_engine(num_blocks=64)
    bm = eng.block_manager
    cold = prompts(1, 16 * 8)[0]  # 8 full blocks
    seq_keys = {}
    real = bm.cached_prefix_blocks

    def spy(seq):
        hits = real(seq)
        seq_keys[seq.request_id] = (len(hits), len(seq.block_keys))
        return hits

    bm.cached_prefix_blocks = spy
    eng.add_request("cold", cold, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    assert seq_keys["cold"] == (0, 1)
    seq = eng._requests["cold"][0]
    assert seq.block_keys == [k.digest for k in block_keys(bm.namespace, cold, include_partial=False)]
    while eng.has_unfinished_requests():
        eng.step()
    warm = cold[: 16 * 5] + [3] * 200  # 5 cached blocks, then 12 new ones
    eng.add_request("warm", warm, SamplingParams(temperature=0, max_tokens=1))
    outs = eng.step()
    hits, hashed = seq_keys["warm"]
    assert hits == 5 and hashed < (len(warm) - 1) // 16  # stopped hashing soon after the first miss
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.num_cached_tokens for o in outs if o.finished] == [16 * 5]
