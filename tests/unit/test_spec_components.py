"""The parts of speculative decoding that need no model: n-gram lookup, acceptance metrics,
the adaptive switch, the pruned vocabulary and its build command, KV trimming, and the
verification sampler (per-position processing, forced acceptance, and the output
distribution over a small vocabulary slice with real sampling parameters)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from libs.blocks import Namespace
from libs.engine.block_manager import BlockManager
from libs.engine.params import SamplingParams
from libs.engine.model_runner import SlotState
from libs.engine.sampler import Sampler, SamplingTensors
from libs.engine.sequence import Sequence
from libs.engine.spec.adaptive import AdaptiveSpeculation
from libs.engine.spec.metrics import SpecDecodeMetrics
from libs.engine.spec.ngram import NgramProposer, ngram_lookup
from libs.engine.spec.proposer import DraftRequest
from libs.engine.spec.rejection import VerifyRow, build_verify_batch, forced_accept, verify_sample
from libs.engine.spec.vocab import DraftVocab, main as vocab_main
from tests.unit.test_rejection_kernel import chi2_pvalue


def lookup(tokens, lo, hi, k):
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), lo, hi, k)


# -- n-gram lookup ----------------------------------------------------------------------------


def test_ngram_copies_what_followed_the_most_recent_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(tokens, 2, 3, 2) == [7, 8]  # the later "1 2 3" is followed by 7 8
    assert lookup(tokens, 2, 3, 5) == [7, 8, 1, 2, 3]  # up to k, may run into the suffix itself


def test_ngram_prefers_the_longest_match():
    tokens = [5, 1, 2, 4, 0, 2, 6, 0, 1, 2]
    assert lookup(tokens, 1, 3, 1) == [4]  # "1 2" (n=2) beats the more recent "2" (n=1)
    assert lookup(tokens, 1, 1, 1) == [6]


def test_ngram_no_match_and_short_sequences():
    assert lookup([1, 2, 3, 4], 1, 3, 3) == []
    assert lookup([7], 1, 3, 3) == []
    assert lookup([4, 4], 1, 3, 3) == [4]  # a repeat: the only earlier "4" is followed by 4


def test_ngram_proposer_reports_a_failure_per_request():
    class Seq:
        def __init__(self, ids):
            self.token_ids = ids

    prop = NgramProposer(1, 2)
    out = prop.propose([DraftRequest(Seq([1, 2, 1]), 2), DraftRequest(Seq(None), 2), DraftRequest(Seq([3, 3, 3]), 1)])
    assert out.token_ids == [[2, 1], [], [3]]
    assert set(out.errors) == {1} and out.probs is None


# -- metrics ----------------------------------------------------------------------------------


def test_metrics_count_every_round():
    m = SpecDecodeMetrics(4)
    assert m.mean_acceptance_length == 0.0 and m.num_accepted_tokens_per_pos == [0, 0, 0, 0]
    m.observe(4, 4)
    m.observe(3, 1)
    m.observe(0, 0)  # no drafts: not a round
    m.observe(2, 0)
    snap = m.snapshot()
    assert (snap["num_drafts"], snap["num_draft_tokens"], snap["num_accepted_tokens"]) == (3, 9, 5)
    assert snap["num_accepted_tokens_per_pos"] == [2, 1, 1, 1]
    assert snap["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    snap["num_accepted_tokens_per_pos"][0] = 99  # a copy
    assert m.num_accepted_tokens_per_pos[0] == 2
    with pytest.raises(ValueError):
        m.observe(2, 3)


# -- adaptive switch --------------------------------------------------------------------------


def test_a_sequence_that_never_accepts_is_paused_then_reprobed_with_growing_waits():
    a = AdaptiveSpeculation(window=4, min_acceptance_length=1.5, reprobe_interval=3)
    for _ in range(4):
        assert a.should_speculate(1)
        a.observe(1, 4, 0)
    waits = []
    for _ in range(3):
        n = 0
        while not a.should_speculate(1):
            n += 1
        waits.append(n)
        for _ in range(2):  # a probe is judged on a quarter window, at least 2 rounds
            a.observe(1, 4, 0)
    assert waits == [3, 6, 12]
    assert a.num_disabled == 4


def test_a_good_sequence_keeps_speculating_and_is_independent_of_a_bad_one():
    a = AdaptiveSpeculation(window=4, min_acceptance_length=1.5, reprobe_interval=3)
    for _ in range(20):
        a.observe(1, 4, 3)
        a.observe(2, 4, 0)
        a.observe(3, 0, 0)  # rounds without drafts count for nothing
    assert a.should_speculate(1) and a.should_speculate(3)
    assert not a.should_speculate(2)


def test_adaptive_off():
    a = AdaptiveSpeculation(window=1, min_acceptance_length=0, reprobe_interval=1)
    for _ in range(10):
        a.observe(1, 4, 0)
        assert a.should_speculate(1)


# -- pruned vocabulary -----------------------------------------------------------------------


def test_vocab_from_counts_keeps_the_most_frequent_and_eos():
    counts = torch.tensor([5, 0, 9, 1, 9, 0, 3, 0])
    v = DraftVocab.from_counts(counts, 4, always=[7])
    assert v.target_ids.tolist() == [0, 2, 4, 7]  # 2 and 4 (9), 0 (5), and EOS 7
    # EAGLE-3 format: draft id j is target id j + d2t[j]; t2d marks the kept target ids.
    assert (torch.arange(4) + v.d2t).tolist() == [0, 2, 4, 7]
    assert v.t2d.tolist() == [True, False, True, False, True, False, False, True]


def test_vocab_maps_draft_probs_and_ids_into_the_target_vocabulary():
    v = DraftVocab(torch.tensor([1, 4, 6]), 8)
    q = torch.tensor([[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]])
    mapped = v.to_target_probs(q)
    assert mapped.shape == (2, 8)
    assert mapped[0].tolist() == pytest.approx([0, 0.2, 0, 0, 0.5, 0, 0.3, 0])
    assert mapped[1, 1] == 1.0 and mapped.sum(dim=1).tolist() == pytest.approx([1.0, 1.0])
    assert v.to_target_ids(torch.tensor([2, 0, 1])).tolist() == [6, 1, 4]
    head = torch.arange(16.0).view(8, 2)
    assert v.prune_head(head).tolist() == [[2.0, 3.0], [8.0, 9.0], [12.0, 13.0]]


def test_vocab_save_load_and_bad_files(tmp_path):
    v = DraftVocab(torch.tensor([0, 3, 5]), 6)
    path = tmp_path / "v.safetensors"
    v.save(path)
    assert torch.equal(DraftVocab.load(path, 6).target_ids, v.target_ids)
    with pytest.raises(ValueError, match="vocabulary of 6 tokens, the target has 7"):
        DraftVocab.load(path, 7)
    with pytest.raises(ValueError, match="does not exist"):
        DraftVocab.load(tmp_path / "nope.safetensors", 6)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unreadable"):
        DraftVocab.load(tmp_path / "junk.safetensors", 6)
    with pytest.raises(ValueError):
        DraftVocab(torch.tensor([3, 1]), 6)


def test_vocab_build_command_from_a_corpus(tmp_path, capsys):
    from tests.models import _tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 50 + "a dog barked.")
    out = tmp_path / "vocab.safetensors"
    assert vocab_main(["--corpus", str(corpus), "--size", "12", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    tok = _tokenizer()
    v = DraftVocab.load(out, 49152)
    assert v.size == 12
    ids = set(v.target_ids.tolist())
    assert set(tok.eos_token_ids) <= ids
    assert set(tok.encode("the cat sat on the mat.", add_special_tokens=False)) <= ids
    assert vocab_main(["--corpus", str(tmp_path / "missing.txt"), "--size", "12", "--out", str(out)]) == 2


# -- KV trimming --------------------------------------------------------------------------------


def test_trim_releases_trailing_blocks_only():
    bm = BlockManager(8, 4, Namespace("w", "float32", 4, 1, "tp1"))
    seq = Sequence("r", 0, list(range(5)), SamplingParams())
    bm.allocate_slots(seq, 5 + 6)  # 11 slots: 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    tail = seq.block_table[-1]
    bm.trim(seq, 6)  # 6 tokens fit in 2 blocks
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6 and bm.ref_counts[tail] == 0
    assert bm._allocate() == tail  # a keyless block is reused first
    bm.trim(seq, 8)
    assert len(seq.block_table) == 2
    bm.free(seq)
    assert bm.num_free_blocks == 7


# -- the verification sampler ----------------------------------------------------------------------


CPU = torch.device("cpu")


def verify(sampler, logits, params, drafts, *, output=(), generators=None, q=None):
    """Verify one round per sequence on a batch laid out as the engine lays it out (a row
    per position, sequence by sequence), with a fresh device state: the emitted tokens of
    each sequence, and the state."""
    V = sampler.vocab_size
    rows = tuple(VerifyRow(tuple(d), p.greedy, p.has_penalties) for p, d in zip(params, drafts))
    row_params = [p for p, d in zip(params, drafts) for _ in range(len(d) + 1)]
    st = SamplingTensors.from_params(row_params, CPU, V, output_ids=[list(output)] * len(row_params))
    state = SlotState(CPU, V)
    state.reserve(len(drafts))
    slots = torch.tensor([b for b, d in enumerate(drafts) for _ in range(len(d) + 1)])
    if st.any_penalties:
        state.init_penalties(0, [], [])  # (allocates the counts for every slot)
    batch = build_verify_batch(rows, 0, CPU)
    samples = verify_sample(sampler, state, logits, st, slots, first_row=0, num_rows=len(row_params), batch=batch,
                            draft_probs=q, generators=generators or [None] * len(drafts))
    tokens, out, r = samples.tokens.tolist(), [], 0
    for d in drafts:
        out.append([t for t in tokens[r : r + len(d) + 1] if t >= 0])
        r += len(d) + 1
    return out, state


def test_positions_count_the_drafts_before_them():
    rows = (VerifyRow((4, 5), True, True), VerifyRow((6,), True, False))
    b = build_verify_batch(rows, 3, CPU)
    assert b.first_rows.tolist() == [3, 6] and b.position_rows.tolist() == [[3, 4, 5], [6, 7, 6]]
    # Position 1 also counts draft 0; position 2 drafts 0 and 1; the unpenalized row nothing.
    assert list(zip(b.count_rows.tolist(), b.count_cols.tolist())) == [(4, 4), (5, 4), (5, 5)]
    assert b.emitted_index.tolist() == [0, 1, 2, 3, 4] and b.num_drafts_list == (2, 1)


def test_greedy_verification_applies_penalties_per_position():
    """Token 3 leads at every position, token 5 is a close second; a frequency penalty makes
    3 lose right after a position that emitted it, exactly as plain decoding would."""
    V = 8
    sampler = Sampler(V, CPU)
    logits = torch.zeros(3, V)
    logits[:, 3], logits[:, 5] = 2.0, 1.5
    out, state = verify(sampler, logits, [SamplingParams(temperature=0, frequency_penalty=1.0)], [[3, 3]])
    assert out == [[3, 5]]
    # The device state: the next input id is the last emitted token, both were counted.
    assert int(state.last_sampled[0]) == 5 and state.counts[0, 3] == 1 and state.counts[0, 5] == 1


def test_a_verify_batch_beside_plain_rows_samples_them_as_a_plain_step():
    V = 8
    sampler = Sampler(V, CPU)
    logits = torch.randn(6, V)
    p = SamplingParams(temperature=0)
    st = SamplingTensors.from_params([p] * 6, CPU, V)
    state = SlotState(CPU, V)
    slots = torch.tensor([7, 1, 1, 1, 9, 4])  # plain, a sequence with 2 drafts, plain, plain
    drafts = [int(logits[1].argmax()), (int(logits[2].argmax()) + 1) % V]  # the first is right
    batch = build_verify_batch((VerifyRow(tuple(drafts), True, False),), 1, CPU)
    s = verify_sample(sampler, state, logits, st, slots, first_row=1, num_rows=3, batch=batch, draft_probs=None, generators=[None])
    want = logits.argmax(-1).tolist()
    assert s.tokens.tolist() == [want[0], drafts[0], want[2], -1, want[4], want[5]]
    assert state.last_sampled[[7, 1, 9, 4]].tolist() == [want[0], want[2], want[4], want[5]]


def test_forced_accept_takes_drafts_then_the_targets_token():
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6]])
    argmax = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 0]])
    out = forced_accept(drafts, torch.tensor([2, 0]), None, argmax, torch.tensor([True, True]), torch.ones(2, 8))
    assert out.tolist() == [[4, 5, 3, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5),
    ],
    ids=["top_k", "top_p", "min_p+penalty"],
)
def test_emitted_tokens_follow_plain_sampling_on_a_vocabulary_slice(params):
    """A 12-token slice of a vocabulary, a draft ``q`` unlike the target, many seeded
    sequences: the first emitted token must follow exactly the distribution plain sampling
    draws from (the engine's own ``Sampler.probs`` after its ``process``)."""
    V, N = 12, 6000
    g = torch.Generator().manual_seed(7)
    sampler = Sampler(V, CPU)
    logits1 = torch.randn(V, generator=g) * 2
    q = torch.softmax(torch.randn(V, generator=g), dim=-1)
    drafts = [[d] for d in torch.multinomial(q, N, replacement=True, generator=g).tolist()]
    gens = lambda n: [torch.Generator().manual_seed(1000 + i) for i in range(n)]  # noqa: E731
    out, _ = verify(sampler, logits1.expand(2 * N, V), [params] * N, drafts, output=[0], generators=gens(N), q=q.expand(N, 1, V).contiguous())
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=V)
    single = SamplingTensors.from_params([params], CPU, V, output_ids=[[0]])
    p = sampler.probs(sampler.process(logits1.unsqueeze(0), single), single)[0]
    assert chi2_pvalue(first, p) > 1e-3, (first, p)
    # Seeded: the same generators give the same tokens.
    again, _ = verify(sampler, logits1.expand(40, V), [params] * 20, drafts[:20], output=[0], generators=gens(20), q=q.expand(20, 1, V).contiguous())
    assert again == out[:20]
