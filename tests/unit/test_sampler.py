"""Sampler statistics and semantics, checked against definitions computed here in float64.

Two levels: the ``Sampler`` on fresh random logits (many draws in one batch, global RNG
seeded so every run is the same), and the engine on the tiny random model, where the
reference distribution comes from ``first_step_logits``. Every expectation is derived
from the definition of the parameter, never from a previous run of our code:

- min-p keeps tokens with ``p >= min_p * p_max``; top-k keeps the k most likely; top-p
  keeps, in the distribution renormalised over what is left, the tokens whose strictly
  greater mass is below ``top_p`` (the smallest set reaching ``top_p``); the most likely
  token always survives (vLLM's order: temperature, min-p, top-k, top-p).
- penalties (vLLM / OpenAI / HF): repetition over prompt + output (positive logits
  divided, negative multiplied), then ``- frequency * count - presence * [count > 0]``
  over the output; then temperature.
- logprobs are the raw model distribution: ``log_softmax(logits)``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from libs.engine import SamplingParams
from libs.engine.sampler import Sampler, SamplingBatch
from tests.models import tiny_engine

V = 64
N_DRAWS = 20000
TV_TOL = 0.04  # expected total variation for 20k draws over 64 tokens is ~0.02


# -- references (float64 numpy, from the definitions) ---------------------------------


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64) - z.max()
    return z - np.log(np.exp(z).sum())


def penalized(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    z = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(z)).astype(np.float64)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[np.asarray(prompt, dtype=np.int64)] = True
        z[seen] = np.where(z[seen] > 0, z[seen] / p.repetition_penalty, z[seen] * p.repetition_penalty)
    return z - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def reference_distribution(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, float]:
    """The distribution a non-greedy request samples from, and how far the nearest
    filter boundary is (so a test can insist that float32 rounding cannot decide it)."""
    probs = softmax(logits.astype(np.float64) / p.temperature)
    keep = np.ones(len(probs), dtype=bool)
    margin = math.inf
    if p.min_p > 0:
        ratio = probs / probs.max()
        keep &= ratio >= p.min_p
        margin = min(margin, np.abs(ratio - p.min_p).min())
    if p.top_k > 0:
        rank = np.empty(len(probs), dtype=np.int64)
        rank[np.argsort(-probs, kind="stable")] = np.arange(len(probs))
        keep &= rank < p.top_k
    if p.top_p < 1:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        above = np.cumsum(q[order]) - q[order]
        inside = np.zeros(len(q), dtype=bool)
        inside[order] = above < p.top_p
        keep &= inside
        margin = min(margin, np.abs(above[q[order] > 0] - p.top_p).min())
    keep[probs.argmax()] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum(), margin


def excluded_mass(logits: np.ndarray, p: SamplingParams, allowed: set[int]) -> float:
    """How much of the unfiltered ``softmax(logits / T)`` the filter removes."""
    probs = softmax(logits.astype(np.float64) / p.temperature)
    return 1.0 - probs[sorted(allowed)].sum()


def total_variation(tokens: list[int], probs: np.ndarray) -> float:
    emp = np.bincount(np.asarray(tokens), minlength=len(probs)) / len(tokens)
    return 0.5 * np.abs(emp - probs).sum()


# -- helpers ------------------------------------------------------------------------------


def random_logits(seed: int, rows: int = 1, vocab: int = V, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int = N_DRAWS, *, seed: int = 0, prompt=(), output=()) -> list[int]:
    """``n`` independent draws: one batch of ``n`` identical rows (unseeded)."""
    torch.manual_seed(seed)
    batch = SamplingBatch([params] * n, [None] * n, [list(prompt)] * n, [list(output)] * n)
    return Sampler(logits_row.shape[-1], torch.device("cpu"))(logits_row.reshape(1, -1).expand(n, -1).clone(), batch).token_ids


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators=None, prompts=None, outputs=None):
    n = len(params)
    batch = SamplingBatch(params, generators or [None] * n, prompts or [[]] * n, outputs or [[]] * n)
    return Sampler(logits.shape[-1], torch.device("cpu"))(logits.clone(), batch)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- filters and temperature on the Sampler ---------------------------------------------

FILTERS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=5),
    SamplingParams(top_k=20, temperature=0.7),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.8),
    SamplingParams(top_p=0.95, temperature=1.5),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.3, temperature=0.8),
    SamplingParams(top_k=10, top_p=0.7),
    SamplingParams(min_p=0.15, top_p=0.9, temperature=1.3),
    SamplingParams(min_p=0.02, top_k=12, top_p=0.85, temperature=2.0),
]


@pytest.mark.parametrize("case", range(len(FILTERS)))
def test_filters_never_emit_excluded_tokens_and_match_the_distribution(case):
    params = FILTERS[case]
    logits = random_logits(100 + case)[0]
    ref, margin = reference_distribution(logits.numpy(), params)
    assert margin > 1e-4, "pick another seed: a boundary this close is decided by rounding"
    allowed = set(np.flatnonzero(ref).tolist())
    assert excluded_mass(logits.numpy(), params, allowed) > 0.03  # a broken filter would show
    tokens = draw(logits, params, seed=case)
    emitted = set(tokens)
    assert emitted <= allowed, f"excluded tokens emitted: {sorted(emitted - allowed)}"
    assert {t for t in allowed if ref[t] > 0.002} <= emitted  # and the allowed ones do appear
    assert total_variation(tokens, ref) < TV_TOL


@pytest.mark.parametrize("case", [1, 4, 7, 10])
def test_filters_hold_for_seeded_rows_too(case):
    """Seeded rows draw their noise from per-row generators (another code path)."""
    params = FILTERS[case]
    logits = random_logits(100 + case)[0]
    ref, _ = reference_distribution(logits.numpy(), params)
    n = 3000
    out = sample_rows(logits.expand(n, -1), [replace(params, seed=i) for i in range(n)], [generator(i) for i in range(n)])
    assert set(out.token_ids) <= set(np.flatnonzero(ref).tolist())
    assert total_variation(out.token_ids, ref) < 0.08  # ~0.05 expected at 3k draws


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_frequencies_match_softmax_over_temperature(temperature):
    logits = random_logits(7)[0]
    ref = softmax(logits.double().numpy() / temperature)
    # The check can tell temperatures apart: T=1 is far from the other two here.
    assert 0.5 * np.abs(softmax(logits.double().numpy()) - softmax(logits.double().numpy() / 0.5)).sum() > 0.15
    tokens = draw(logits, SamplingParams(temperature=temperature), seed=int(temperature * 10))
    assert total_variation(tokens, ref) < TV_TOL


@pytest.mark.parametrize("temperature", [0.0, 1e-7, 1e-40, 1e-300])
def test_greedy_and_vanishing_temperature_pick_the_argmax(temperature):
    logits = random_logits(3, rows=200)
    out = sample_rows(logits, [SamplingParams(temperature=temperature)] * 200)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_1_is_greedy_at_any_temperature():
    logits = random_logits(4, rows=300)
    out = sample_rows(logits, [SamplingParams(temperature=2.0, top_k=1)] * 300)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_a_row_is_unaffected_by_its_neighbours_filters():
    """Mixed batch: each row's allowed set is its own, whatever the other rows ask for."""
    rng = np.random.default_rng(0)
    rows = 600
    logits = random_logits(5, rows=rows)
    params = [FILTERS[i] for i in rng.integers(0, len(FILTERS), rows)]
    params = [p if i % 5 else SamplingParams(temperature=0) for i, p in enumerate(params)]
    torch.manual_seed(1)
    out = sample_rows(logits, params)
    for i, (t, p) in enumerate(zip(out.token_ids, params)):
        if p.greedy:
            assert t == int(logits[i].argmax())
        else:
            ref, _ = reference_distribution(logits[i].numpy(), p)
            assert ref[t] > 0, (i, p)


# -- penalties ---------------------------------------------------------------------------


def penalty_case(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    logits = random_logits(seed, rows=rows, vocab=24, scale=1.5)
    params, prompts, outputs = [], [], []
    for _ in range(rows):
        params.append(
            SamplingParams(
                temperature=0,
                presence_penalty=float(rng.choice([0.0, rng.uniform(-2, 2)])),
                frequency_penalty=float(rng.choice([0.0, rng.uniform(-1, 1)])),
                repetition_penalty=float(rng.choice([1.0, rng.uniform(0.5, 3.0)])),
            )
        )
        prompts.append(rng.integers(0, 24, rng.integers(1, 8)).tolist())
        outputs.append(rng.integers(0, 24, rng.integers(0, 10)).tolist())
    return logits, params, prompts, outputs


def test_penalties_match_the_definitions_greedy():
    logits, params, prompts, outputs = penalty_case(11, 800)
    out = sample_rows(logits, params, prompts=prompts, outputs=outputs)
    expected = [int(np.argmax(penalized(logits[i].numpy(), p, prompts[i], outputs[i]))) for i, p in enumerate(params)]
    assert out.token_ids == expected
    # The check is sharp: the penalties move the argmax in many rows (the sign convention
    # and what counts as "seen" are pinned by the crafted cases below).
    raw = logits.argmax(dim=-1).tolist()
    assert sum(a != b for a, b in zip(expected, raw)) > 100


def test_repetition_penalty_sign_convention():
    """HF semantics: a seen token's positive logit is divided, a negative one multiplied,
    so a repeated token always becomes less likely; unseen tokens are untouched."""
    logits = torch.tensor([[-1.0, -3.0, -5.0, -5.0], [3.0, 2.0, -5.0, -5.0]])
    p = SamplingParams(temperature=0, repetition_penalty=4.0)
    out = sample_rows(logits, [p, p], prompts=[[0], [2]], outputs=[[], [0]])
    # row 0: token 0 -> -4 < -3 (dividing would give -0.25 and keep it on top)
    # row 1: token 0 (output) -> 0.75 < 2; token 2 (prompt) -> -20
    assert out.token_ids == [1, 1]


def test_presence_and_frequency_count_only_the_output():
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0, presence_penalty=1.0)] * 2 + [SamplingParams(temperature=0, frequency_penalty=0.3)]
    out = sample_rows(logits, params, prompts=[[0, 0, 0], [], []], outputs=[[], [0], [0, 0]])
    # prompt repeats do not count; one output occurrence: 2 - 1 < 1.5; two * 0.3: 1.4 < 1.5
    assert out.token_ids == [0, 1, 1]


def test_penalised_sampling_distribution():
    """Penalties shape the distribution that temperature then scales."""
    logits = random_logits(21, vocab=16)[0]
    p = SamplingParams(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.6)
    prompt, output = [1, 2, 3, 9], [3, 3, 5, 12, 12, 12]
    ref = softmax(penalized(logits.numpy(), p, prompt, output) / p.temperature)
    assert 0.5 * np.abs(ref - softmax(logits.double().numpy() / p.temperature)).sum() > 0.1
    tokens = draw(logits, p, seed=2, prompt=prompt, output=output)
    assert total_variation(tokens, ref) < TV_TOL


# -- seeds ---------------------------------------------------------------------------------


def test_seeded_row_ignores_its_batch_companions():
    """20 steps of one seeded row alone vs in a batch of 6 (unseeded and other seeds)."""
    logits = random_logits(31, rows=20)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone_gen, mixed_gen, other_gen = generator(1234), generator(1234), generator(99)
    alone, mixed, other = [], [], []
    for step in range(20):
        row = logits[step : step + 1]
        alone.append(sample_rows(row, [p], [alone_gen]).token_ids[0])
        companions = random_logits(1000 + step, rows=4)
        batch = torch.cat([companions[:3], row, row, companions[3:]])  # our row is 4th of 6
        params = [SamplingParams(), SamplingParams(seed=5, top_k=3), SamplingParams(temperature=0), replace(p, seed=99), p, SamplingParams(top_p=0.5)]
        gens = [None, generator(5), None, other_gen, mixed_gen, None]
        out = sample_rows(batch, params, gens).token_ids
        mixed.append(out[4])
        other.append(out[3])
    assert mixed == alone
    assert other != alone  # the seed matters


def test_seeded_request_ignores_its_batch_companions_in_the_engine():
    eng = tiny_engine()
    prompt = list(range(300, 340))
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = eng.generate([prompt], p)[0].token_ids
    assert eng.generate([prompt], p)[0].token_ids == alone  # reproducible
    companions = [list(range(500 + 10 * i, 530 + 10 * i)) for i in range(5)]
    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.2, top_p=0.9, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True),  # same seed, other prompt
    ]
    batch = eng.generate(companions[:2] + [prompt] + companions[2:], others[:2] + [p] + others[2:])
    assert batch[2].token_ids == alone
    other_seed = eng.generate([prompt], replace(p, seed=43))[0].token_ids
    assert other_seed != alone


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution_top_k_sorted():
    rows = 21 * 8
    logits = random_logits(41, rows=rows)
    ks = [i % 21 for i in range(rows)]
    params = [SamplingParams(temperature=1.0, logprobs=k) for k in ks]
    torch.manual_seed(0)
    out = sample_rows(logits, params)
    for i, (k, t, lp) in enumerate(zip(ks, out.token_ids, out.logprobs)):
        ref = log_softmax(logits[i].numpy())
        assert lp.token_id == t
        assert math.isfinite(lp.logprob) and lp.logprob == pytest.approx(ref[t], abs=1e-5)
        assert len(lp.top_ids) == len(lp.top_logprobs) == k
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_ids == np.argsort(-ref, kind="stable")[:k].tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[lp.top_ids], atol=1e-5)


def test_chosen_logprob_is_finite_outside_the_top_k():
    """Penalties and filters push the sample away from the raw top tokens; the chosen
    token's logprob is still its raw logprob, finite, whether or not it is listed."""
    logits = random_logits(51, rows=400)
    top2 = logits.topk(2, dim=-1).indices
    params = [SamplingParams(temperature=1.5, logprobs=1, presence_penalty=2.0, repetition_penalty=5.0)] * 400
    out = sample_rows(logits, params, prompts=[r.tolist() for r in top2], outputs=[r.tolist() for r in top2])
    outside = 0
    for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = log_softmax(logits[i].numpy())
        outside += t not in lp.top_ids
        assert math.isfinite(lp.logprob) and lp.logprob == pytest.approx(ref[t], abs=1e-5)
        assert lp.top_ids == [int(top2[i, 0])]
    assert outside > 300


def test_rows_without_logprobs_get_none():
    logits = random_logits(61, rows=3)
    out = sample_rows(logits, [SamplingParams(logprobs=None), SamplingParams(logprobs=3), SamplingParams(temperature=0)])
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert len(out.logprobs[1].top_ids) == 3


# -- through the engine (tiny model) -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    eng = tiny_engine(num_blocks=256)
    yield eng
    assert not eng.has_unfinished_requests()


PROMPT = [101, 2002, 303, 4004, 505, 6006, 707]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=4, temperature=1.5), SamplingParams(top_p=0.5, temperature=0.5), SamplingParams(min_p=0.1, temperature=1.2)],
    ids=["top_k", "top_p", "min_p"],
)
def test_engine_first_tokens_stay_inside_the_filter(tiny, params):
    raw = tiny.first_step_logits(PROMPT).double().numpy()
    ref, margin = reference_distribution(raw, params)
    assert margin > 1e-5
    allowed = set(np.flatnonzero(ref).tolist())
    assert len(allowed) >= 2
    assert excluded_mass(raw, params, allowed) > 0.3  # 256 draws would hit the excluded tokens
    n = 256
    results = tiny.generate([PROMPT] * n, [replace(params, seed=s, max_tokens=1) for s in range(n)])
    firsts = [r.token_ids[0] for r in results]
    assert set(firsts) <= allowed
    assert len(set(firsts)) >= 2


def test_engine_logprobs_match_log_softmax_of_the_logits(tiny):
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=5, ignore_eos=True)
    r = tiny.generate([PROMPT], p)[0]
    assert len(r.logprobs) == len(r.token_ids) == 6
    for i, (t, lp) in enumerate(zip(r.token_ids, r.logprobs)):
        ref = log_softmax(tiny.first_step_logits(PROMPT + r.token_ids[:i]).double().numpy())
        assert lp.token_id == t
        assert lp.logprob == pytest.approx(ref[t], abs=1e-4)
        assert lp.top_ids == np.argsort(-ref, kind="stable")[:5].tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[lp.top_ids], atol=1e-4)


# -- stopping ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_run(tiny):
    """A greedy continuation and a token in it to stop on (first seen at position >= 3)."""
    tokens = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    pos = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    return tokens, pos


def test_max_tokens_finishes_with_length(tiny, greedy_run):
    tokens, _ = greedy_run
    r = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert r.token_ids == tokens[:7] and r.finish_reason == "length"


def test_stop_token_ids_finish_with_stop(tiny, greedy_run):
    tokens, pos = greedy_run
    r = tiny.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[pos], 3]))[0]
    assert r.token_ids == tokens[: pos + 1]  # the stop token is the last one returned
    assert r.finish_reason == "stop"


@pytest.fixture()
def eos_engine(tiny, greedy_run):
    """The tiny engine with the greedy run's stop token as its EOS."""
    tokens, pos = greedy_run
    eos = tokens[pos]
    original = tiny.tokenizer
    tiny.tokenizer = replace(original, eos_token_ids=(eos,))
    yield tiny, tokens, pos
    tiny.tokenizer = original


def test_eos_stops_and_ignore_eos_does_not(eos_engine):
    eng, tokens, pos = eos_engine
    r = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    assert r.token_ids == tokens[: pos + 1] and r.finish_reason == "stop"
    r = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert r.token_ids == tokens and r.finish_reason == "length"


def test_min_tokens_keeps_eos_and_stop_tokens_out_until_reached(eos_engine):
    """Before ``min_tokens`` outputs, EOS and stop tokens cannot be sampled (vLLM); after,
    they stop generation as usual."""
    eng, tokens, pos = eos_engine
    eos = tokens[pos]
    stop = 3 if 3 not in tokens else 4
    m = pos + 3
    r = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, min_tokens=m, stop_token_ids=[stop]))[0]
    assert len(r.token_ids) >= m
    assert eos not in r.token_ids[:m] and stop not in r.token_ids[:m]
    assert r.token_ids[:pos] == tokens[:pos]  # identical up to where EOS was banned
    assert r.token_ids[pos] != eos
    if r.finish_reason == "stop":
        assert r.token_ids[-1] in (eos, stop)
    else:
        assert r.finish_reason == "length" and len(r.token_ids) == 40
    # A sampled request with min_tokens never emits EOS early either.
    rs = eng.generate([PROMPT] * 16, [SamplingParams(temperature=1.0, seed=s, max_tokens=12, min_tokens=12) for s in range(16)])
    for x in rs:
        assert len(x.token_ids) == 12 and eos not in x.token_ids and x.finish_reason == "length"
