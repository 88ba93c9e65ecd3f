"""Speculative decoding in the engine's step loop, on the tiny random model (fast).

A random model copies nothing, so most tests draft with an *oracle*: the target itself as
a self-draft over all its layers, whose greedy drafts are exactly what plain greedy
decoding produces (every draft is accepted) — optionally with the draft at one depth
corrupted, which makes the acceptance of every round known exactly. Bursts of ``k + 1``
tokens then meet every stop condition mid-burst. The real model's tests (each proposer,
n-gram on a repeating prompt) are in test_spec_greedy.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from libs.engine import SamplingParams
from libs.engine.async_engine import AsyncEngine, EngineStepError
from libs.engine.spec.model_proposer import DraftNetwork, ModelProposer
from libs.engine.spec.ngram import NgramProposer
from libs.engine.spec.proposer import DraftRequest, Drafts
from libs.engine.spec.vocab import DraftVocab
from tests.models import tiny_engine
from tests.spec_expectations import expected_forced, expected_rounds, metrics_match

K = 4
PROMPTS = ["one two three four five", "the quick brown fox jumps", "a b c d e f g"]


def spec_cfg(**kw) -> str:
    return json.dumps({"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": K, "min_acceptance_length": 0, **kw})


class Corrupting:
    """Wraps a proposer: the draft at ``depth`` is replaced by another token, so a greedy
    round accepts exactly ``depth`` drafts (when it has more than ``depth``)."""

    def __init__(self, inner, depth: int):
        self.inner, self.depth, self.name = inner, depth, "corrupting"

    def propose(self, requests):
        d = self.inner.propose(requests)
        for row in d.token_ids:
            if len(row) > self.depth:
                row[self.depth] = (row[self.depth] + 1) % 49152
        return d

    def forget(self, seq_id):
        self.inner.forget(seq_id)

    def enable_graphs(self, **kw):
        self.inner.enable_graphs(**kw)


def with_oracle(eng, corrupt_at: int | None = None):
    """Draft with the target itself (every greedy draft is what decoding produces)."""
    model = eng.loaded.model
    net = DraftNetwork(model, len(model.layers), model.embed_tokens.weight)
    oracle = ModelProposer("oracle", net, vocab=None, block_size=eng.config.block_size, device=eng.device, shares_target_cache=True, bind=eng.runner._bind)
    eng.spec.proposer = oracle if corrupt_at is None else Corrupting(oracle, corrupt_at)
    return eng


@pytest.fixture(scope="module")
def plain():
    torch.set_num_threads(1)
    return tiny_engine(num_blocks=128)


@pytest.fixture(scope="module")
def prompts(plain):
    return [plain.tokenizer.encode(p) for p in PROMPTS]


def spec_engine(**cfg):
    return tiny_engine(num_blocks=128, speculative_config=spec_cfg(**cfg.pop("spec", {})), **cfg)


def assert_no_leaks(eng):
    assert not eng.has_unfinished_requests()
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


# -- greedy equality with stops inside bursts -----------------------------------------------------


STOP_CASES = {
    "max_tokens": dict(max_tokens=11, ignore_eos=True),
    "stop_id": dict(max_tokens=30, ignore_eos=True, stop_at=7),  # the token at output index 7
    "stop_id_before_min_tokens": dict(max_tokens=30, ignore_eos=True, stop_at=3, min_tokens=9),
    "penalties": dict(max_tokens=20, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3),
}


@pytest.mark.parametrize("case", list(STOP_CASES))
@pytest.mark.parametrize("corrupt_at", [None, 2])
def test_greedy_equals_plain_decoding_with_stops_inside_bursts(plain, prompts, case, corrupt_at):
    kw = dict(STOP_CASES[case])
    stop_at = kw.pop("stop_at", None)
    base = SamplingParams(temperature=0, **kw)
    if stop_at is not None:
        free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        params = [SamplingParams(temperature=0, stop_token_ids=(r.token_ids[stop_at],), **kw) for r in free]
    else:
        params = [base] * len(prompts)
    want = plain.generate(prompts, params)
    eng = with_oracle(spec_engine(), corrupt_at)
    got = eng.generate(prompts, params)
    for w, g in zip(want, got):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
    m = eng.spec.metrics
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0  # bursts really happened
    if case == "stop_id":
        assert all(len(g.token_ids) <= 8 and g.finish_reason == "stop" for g in got)
    if case == "stop_id_before_min_tokens":
        assert all(len(g.token_ids) >= 9 for g in got)
    if case == "max_tokens":
        assert all(len(g.token_ids) == 11 for g in got)
    assert_no_leaks(eng)


def test_known_acceptance_with_a_corrupted_oracle_counts_exactly(plain, prompts):
    """Depth-2 corruption: every round with more than 2 drafts accepts exactly 2."""
    eng = with_oracle(spec_engine(), corrupt_at=2)
    M = 23
    eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=M, ignore_eos=True))
    exp = expected_rounds(M, k=K, accepts=lambda n: min(n, 2))
    assert metrics_match(eng.spec.metrics.snapshot(), exp), (eng.spec.metrics.snapshot(), exp)


# -- forced acceptance ----------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_forced_acceptance_counts_exactly_and_never_overshoots(prompts, rate):
    """The test mode seed 001 lost: a 1-layer self-draft of a random model is almost never
    right, yet the forced rate decides what is accepted, round by round."""
    eng = spec_engine(spec={"forced_acceptance": rate})
    for M in (23, 2, 5):
        before = dict(eng.spec.metrics.snapshot())
        steps0 = eng.num_steps
        r = eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=M, ignore_eos=True))[0]
        assert len(r.token_ids) == M and r.finish_reason == "length"
        exp = expected_forced(M, k=K, rate=rate)
        now = eng.spec.metrics.snapshot()
        delta = {k: now[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        delta["num_accepted_tokens_per_pos"] = [a - b for a, b in zip(now["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])]
        assert metrics_match(delta, exp), (M, delta, exp)
        assert eng.num_steps - steps0 == 1 + exp["rounds"] + exp["plain_steps"]  # the prompt's step, then one per round
    assert_no_leaks(eng)


def test_forced_acceptance_cuts_a_burst_at_a_stop_token(prompts):
    eng = spec_engine(spec={"forced_acceptance": 1.0})
    free = eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    # Token 3 is the 3rd draft of the first round (token 0 comes from the prompt's step).
    stop = free[3]
    first = free.index(stop)
    r = eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop,)))[0]
    assert r.token_ids == free[: first + 1] and r.finish_reason == "stop"


# -- KV rollback and the prefix cache ----------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_rejected_slots_are_released_and_only_accepted_blocks_are_cached(plain, prompts, rate):
    """With drafts rejected every round, verification wrote their KV into slots past the
    accepted tokens. Every step must leave a running sequence with exactly the blocks of
    its computed tokens, and every cached block must hold the KV of its key's tokens:
    reusing them through the prefix cache gives the logits of a cold computation."""
    eng = spec_engine(spec={"forced_acceptance": rate})
    bs = eng.config.block_size
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    outs = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].extend(o.outputs[0].new_token_ids)
        for seq in eng.scheduler.running.values():
            assert seq.num_computed_tokens == seq.num_tokens - 1
            assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / bs)
            # The persistent batch's row agrees (its block table is what the next step reads).
            b, r = eng.batch, seq.row
            assert b.num_tokens[r] == seq.num_tokens and b.num_blocks[r] == len(seq.block_table)
            assert b.block_table[r, : len(seq.block_table)].tolist() == seq.block_table
    assert_no_leaks(eng)
    assert eng.spec.metrics.num_draft_tokens > eng.spec.metrics.num_accepted_tokens  # rejections happened
    for i, p in enumerate(prompts):
        full = p + outs[f"r{i}"]
        cached = eng.first_step_logits(full)
        hit = eng.block_manager.prefix_hit_blocks
        plain.block_manager.reset_prefix_cache()
        cold = plain.first_step_logits(full)
        assert torch.allclose(cached, cold, atol=1e-4, rtol=0), (cached - cold).abs().max()
    assert hit >= len(prompts) * 2  # the checks above read through the prefix cache


# -- async prepare -------------------------------------------------------------------------------


def test_async_prepare_gives_the_same_tokens_and_counts(prompts):
    params = [SamplingParams(temperature=0, max_tokens=17, ignore_eos=True), SamplingParams(temperature=0.9, seed=5, max_tokens=17, ignore_eos=True)]
    results = []
    for mode in ("off", "on"):
        eng = with_oracle(spec_engine(spec={"async_prepare": mode}), corrupt_at=1)
        results.append(([r.token_ids for r in eng.generate(prompts[:2], params)], eng.spec.metrics.snapshot()))
        assert (eng.spec.prepare_runner is not None) == (mode == "on")
        eng.close()
    assert results[0] == results[1]


# -- sampling ----------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(prompts):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    eng = with_oracle(spec_engine())
    alone = eng.generate(prompts[:1], p)[0].token_ids
    mixed = eng.generate(prompts, [p, SamplingParams(temperature=0, max_tokens=9), SamplingParams(temperature=1.2, seed=3, max_tokens=25)])[0].token_ids
    other = eng.generate(prompts[:1], SamplingParams(temperature=0.9, top_p=0.95, seed=12, max_tokens=16, ignore_eos=True))[0].token_ids
    assert alone == mixed and alone != other
    assert eng.spec.metrics.num_accepted_tokens > 0


def test_logprobs_are_reported_for_every_emitted_token(plain, prompts):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = plain.generate(prompts[:2], params)
    eng = with_oracle(spec_engine(), corrupt_at=2)
    got = eng.generate(prompts[:2], params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


# -- the adaptive switch ----------------------------------------------------------------------------


def test_a_sequence_whose_drafts_fail_stops_speculating(prompts):
    """A 1-layer self-draft of a random model is (almost) never accepted: after one window
    of such rounds the sequence decodes plainly until its re-probe."""
    eng = spec_engine(spec={"min_acceptance_length": 1.5, "acceptance_window": 4, "reprobe_interval": 1000})
    eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    m = eng.spec.metrics
    assert m.num_drafts == 4 and m.num_accepted_tokens <= 1
    assert eng.spec.adaptive.num_disabled == 1


# -- pruned draft vocabulary ------------------------------------------------------------------------


def test_pruned_vocab_drafts_are_the_masked_argmax_mapped_to_target_ids(plain, prompts):
    """Reference: the full head over the early-exit hidden state, masked to the draft
    vocabulary, argmax — fed back as *target* ids. Applying the map anywhere else (feeding
    draft ids to the embeddings, comparing draft ids with target ids) changes the chain."""
    model = plain.loaded.model
    counts = torch.zeros(49152, dtype=torch.long)
    counts[torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:3000]] = 1
    vocab = DraftVocab.from_counts(counts, 3000)
    eng = spec_engine()
    from libs.engine.spec.self_draft import self_draft_proposer

    prop = self_draft_proposer(model, 1, vocab, block_size=eng.config.block_size, device=eng.device, bind=eng.runner._bind)
    eng.add_request("x", prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.spec.proposer = NgramProposer(9, 9)  # the engine itself does not speculate here
    eng.step()
    seq = eng._requests["x"][0]
    k = eng.spec._reserve(seq, K)
    drafts = prop.propose([DraftRequest(seq, k)]).token_ids[0]

    from libs.model.attention import AttentionMetadata

    ctx, ref = list(seq.token_ids), []
    head = model.embed_tokens.weight
    mask = vocab.t2d
    for _ in range(k):
        n = len(ctx)
        scratch = tiny_engine(num_blocks=16)  # a cold cache for the reference forward
        scratch.runner._bind()
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(16, dtype=torch.int32).view(1, 16),
            seq_lens=torch.tensor([n], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            num_decodes=0, num_prefill_tokens=n, max_seq_len=n,
        )
        with torch.inference_mode():
            h = model(torch.tensor(ctx), torch.arange(n), meta, num_layers=1)[-1]
        logits = torch.nn.functional.linear(h, head).float().masked_fill(~mask, float("-inf"))
        ref.append(int(logits.argmax()))
        ctx.append(ref[-1])
    eng.runner._bind()
    assert drafts == ref
    assert all(vocab.t2d[t] for t in drafts)
    eng.spec.release(seq)
    eng.abort_request("x")
    eng.step()


def test_pruned_vocab_q_lives_on_the_target_vocabulary(prompts):
    eng = spec_engine()
    counts = torch.arange(49152) % 7
    vocab = DraftVocab.from_counts(counts, 500)
    from libs.engine.spec.self_draft import self_draft_proposer

    prop = self_draft_proposer(eng.loaded.model, 1, vocab, block_size=eng.config.block_size, device=eng.device, bind=eng.runner._bind)
    eng.spec.proposer = prop
    eng.add_request("x", prompts[1], SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    seen = []
    real = prop.propose

    def spy(requests):
        d = real(requests)
        seen.append(d)
        return d

    prop.propose = spy
    while eng.has_unfinished_requests():
        eng.step()
    assert seen
    for d in seen:
        q = d.probs
        assert q is not None and q.shape[-1] == 49152
        n = len(d.token_ids[0])
        assert torch.allclose(q[0, :n].sum(-1), torch.ones(n), atol=1e-5)
        assert float(q[0, :n][:, ~vocab.t2d].abs().sum()) == 0.0
        assert all(q[0, j, t] > 0 for j, t in enumerate(d.token_ids[0]))  # each draft was drawn from its q


# -- faults -----------------------------------------------------------------------------------------


class Failing:
    """Proposes like ``inner`` but fails, per request, for sequences whose prompt is ``bad``
    (``batch=True``: the whole call fails when it includes one)."""

    def __init__(self, inner, bad: list[int], *, batch: bool = False):
        self.inner, self.bad, self.batch, self.name = inner, bad, batch, "failing"

    def propose(self, requests):
        hit = [i for i, r in enumerate(requests) if r.seq.prompt_token_ids == self.bad]
        if hit and self.batch:
            raise RuntimeError("the draft model fell over")
        d = self.inner.propose(requests)
        for i in hit:
            d.errors[i] = RuntimeError("cannot draft this one")
        return d

    def forget(self, seq_id):
        self.inner.forget(seq_id)


def run_all(eng, reqs):
    outs = {rid: [] for rid, *_ in reqs}
    errors = {}
    for rid, p, params in reqs:
        eng.add_request(rid, p, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:
                outs[o.request_id].extend(c.new_token_ids)
            if o.error is not None:
                errors[o.request_id] = (o.error, [c.finish_reason for c in o.outputs])
    return outs, errors


@pytest.mark.parametrize("batch", [False, True], ids=["per-request", "whole-batch"])
def test_a_proposer_failure_fails_that_request_and_the_engine_goes_on(plain, prompts, batch):
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    want = plain.generate(prompts, params)
    eng = with_oracle(spec_engine())
    eng.spec.proposer = Failing(eng.spec.proposer, prompts[0], batch=batch)
    if batch:  # keep the good requests out of the failing batch: they wait a step
        outs, errors = run_all(eng, [("bad", prompts[0], params)])
        outs2, errors2 = run_all(eng, [("good1", prompts[1], params), ("good2", prompts[2], params)])
        outs.update(outs2)
        errors.update(errors2)
    else:
        outs, errors = run_all(eng, [("bad", prompts[0], params), ("good1", prompts[1], params), ("good2", prompts[2], params)])
    assert set(errors) == {"bad"} and errors["bad"][1] == ["error"]
    assert "cannot draft" in errors["bad"][0] or "fell over" in errors["bad"][0]
    assert outs["good1"] == want[1].token_ids and outs["good2"] == want[2].token_ids
    assert eng.spec.num_proposer_errors >= 1
    assert_no_leaks(eng)
    eng.spec.proposer = eng.spec.proposer.inner
    assert eng.generate(prompts[:1], params)[0].token_ids == want[0].token_ids  # still serving


@pytest.mark.parametrize("mode", ["on", "off"], ids=["async-prepare", "inline"])
def test_a_prepare_failure_fails_the_speculating_request_only(plain, prompts, mode, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    want = plain.generate(prompts, params)
    eng = with_oracle(spec_engine(spec={"async_prepare": mode}))
    oracle = eng.spec.proposer

    class OnlyBad:  # only the first prompt gets drafts: the others decode plainly alongside
        name = "only-bad"

        def propose(self, requests):
            d = oracle.propose(requests)
            d.token_ids = [t if r.seq.prompt_token_ids == prompts[0] else [] for t, r in zip(d.token_ids, requests)]
            return d

        def forget(self, seq_id):
            oracle.forget(seq_id)

    eng.spec.proposer = OnlyBad()
    import libs.engine.spec.rejection as rejection

    real = rejection.build_verify_batch
    calls = []

    def broken(rows, first_row, device):
        calls.append(1)
        raise RuntimeError("prepare broke")

    monkeypatch.setattr(rejection, "build_verify_batch", broken)
    outs, errors = run_all(eng, [("bad", prompts[0], params), ("good1", prompts[1], params), ("good2", prompts[2], params)])
    assert calls and set(errors) == {"bad"} and "prepare broke" in errors["bad"][0]
    assert outs["good1"] == want[1].token_ids and outs["good2"] == want[2].token_ids
    assert eng.spec.num_prepare_errors == 1
    if eng.spec.prepare_runner is not None:
        assert not eng.spec.prepare_runner.pending  # nothing stuck on the worker
    assert_no_leaks(eng)
    monkeypatch.setattr(rejection, "build_verify_batch", real)
    eng.spec.proposer = oracle
    assert eng.generate(prompts[:1], params)[0].token_ids == want[0].token_ids
    eng.close()


def test_the_async_engine_reports_a_failed_request_and_serves_the_rest(plain, prompts):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = plain.generate(prompts[1:2], params)[0].token_ids
    eng = with_oracle(spec_engine())
    eng.spec.proposer = Failing(eng.spec.proposer, prompts[0])

    async def main():
        ae = AsyncEngine(eng)
        ae.start()
        try:
            bad = ae.add_request("bad", prompts[0], params)
            good = ae.add_request("good", prompts[1], params)
            with pytest.raises(EngineStepError, match="cannot draft"):
                async for _ in bad:
                    pass
            toks = []
            async for o in good:
                toks.extend(o.outputs[0].new_token_ids)
            return toks
        finally:
            await ae.stop()

    assert asyncio.run(main()) == want
    assert_no_leaks(eng)


def test_a_prompt_beside_verifying_sequences_gets_its_own_logits_row(plain, prompts):
    """Rows of a verify step are not one per sequence: a prompt computed in the same step
    must still read its own row (first_step_logits captures it)."""
    eng = with_oracle(spec_engine())
    eng.add_request("busy", prompts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    eng.step()  # the prompt's step; from the next one on it verifies
    got = eng.first_step_logits(prompts[2])
    assert eng.spec.metrics.num_drafts > 0
    assert torch.allclose(got, plain.first_step_logits(prompts[2]), atol=1e-4, rtol=0)
    eng.abort_request("busy")
    eng.step()


# -- graphs ------------------------------------------------------------------------------------------


def test_verify_steps_run_the_prefill_graph_layout(plain, prompts):
    """On CUDA a verify step replays a prefill graph (its speculating sequences are chunks
    of k + 1 tokens over a padded token bucket), and the draft network's decode steps
    replay its own decode graphs. Run eagerly on exactly those layouts here (``emulate``),
    greedy output must still be plain decoding's; tests/gpu replays them."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (14, 9, 17)]
    want = [r.token_ids for r in plain.generate(prompts, params)]
    eng = with_oracle(spec_engine(max_num_batched_tokens=64, max_num_seqs=8), corrupt_at=2)
    eng.enable_graphs(emulate=True)
    paths, build = [], eng.builder.build

    def spy(*a):
        step = build(*a)
        if step.num_verify_tokens:
            paths.append((step.path, step.num_decodes, step.layout.tokens, step.num_tokens))
        return step

    eng.builder.build = spy
    assert [r.token_ids for r in eng.generate(prompts, params)] == want
    assert paths and all(p == "prefill_graph" and tokens >= t for p, _, tokens, t in paths)
    assert any(tokens > t for _, _, tokens, t in paths)  # padded buckets really ran
    assert eng.runner.graphs.replays["prefill"] >= len(paths)
    assert eng.spec.proposer.inner.graphs.replays["decode"] > 0  # padded draft steps (3 rows in a graph of 4)
    assert_no_leaks(eng)
