"""Async scheduling: step N + 1 is launched before step N's tokens are read back.

It must change nothing a client can see: the same tokens (greedy and seeded), finish
reasons and logprobs as synchronous scheduling, under arrivals, chunked prefill,
preemption, prefix hits, ``n > 1``, penalties, min_tokens and aborts; and a sequence
that stopped or was aborted never emits a token after its end, although the device
computed one more for it.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

import torch

from libs.engine import EngineConfig, SamplingParams
from tests.models import tiny_engine
from tests.unit.test_sampler import penalized

STOPS = tuple(range(0, 49152, 7))  # ~1 in 7 tokens stops: most sampled requests stop early


def mixed_workload(seed: int) -> list[tuple[int, list[int], SamplingParams]]:
    """(arrival step, prompt, params) covering every sampler feature."""
    rng = random.Random(seed)
    kinds = [
        lambda i, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
        lambda i, m: SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=i, max_tokens=m, ignore_eos=True),
        lambda i, m: SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, max_tokens=m, ignore_eos=True),
        lambda i, m: SamplingParams(temperature=0.7, seed=100 + i, max_tokens=m, stop_token_ids=STOPS),
        lambda i, m: SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=m, ignore_eos=True),
        lambda i, m: SamplingParams(temperature=0, logprobs=3, max_tokens=m, ignore_eos=True),
        lambda i, m: SamplingParams(temperature=0.8, min_p=0.01, seed=i, min_tokens=min(5, m), max_tokens=m, stop_token_ids=STOPS),
    ]
    out = []
    for i in range(21):
        prompt = [rng.randint(5, 3000) for _ in range(rng.randint(3, 70))]
        out.append((rng.randint(0, 25), prompt, kinds[i % len(kinds)](i, rng.randint(1, 30))))
    return out


def drive(eng, reqs, aborts: dict[int, str] | None = None):
    """Run to completion; collect per (request, index) tokens, logprobs, finish reason.
    Fails on any output for a request after its final one."""
    outs: dict[tuple[str, int], dict] = {}
    finished: set[str] = set()
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, p) = pending.pop(0)
            eng.add_request(f"r{i}", prompt, p)
        if aborts and step in aborts:
            eng.abort_request(aborts[step])
        for o in eng.step():
            assert o.request_id not in finished, f"output for {o.request_id} after it finished"
            for c in o.outputs:
                d = outs.setdefault((o.request_id, c.index), {"ids": [], "lps": [], "reason": None})
                d["ids"] += c.new_token_ids
                d["lps"] += [(lp.token_id, lp.logprob, tuple(lp.top_ids)) for lp in c.new_logprobs]
                d["reason"] = c.finish_reason or d["reason"]
            if o.finished:
                finished.add(o.request_id)
        step += 1
    return outs


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_async_scheduling_equals_sync_token_for_token(tight):
    reqs = mixed_workload(1)
    cfg = dict(num_blocks=40, max_num_batched_tokens=64, max_num_seqs=12) if tight else dict(num_blocks=400, max_num_batched_tokens=256)
    aborts = {10: "r3", 18: "r8"}
    runs = {}
    for mode in ("off", "on"):
        eng = tiny_engine(async_scheduling=mode, **cfg)
        runs[mode] = drive(eng, reqs, aborts)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        if tight:
            assert eng.scheduler.num_preemptions > 0
        if mode == "on":
            assert eng.num_discarded_tokens > 0  # the one-step-late path was taken
        eng.close()
    sync, asyn = runs["off"], runs["on"]
    assert sync.keys() == asyn.keys()
    for key in sync:
        a, b = sync[key], asyn[key]
        assert a["ids"] == b["ids"] and a["reason"] == b["reason"], key
        assert [(t, ids) for t, _, ids in a["lps"]] == [(t, ids) for t, _, ids in b["lps"]], key
        # Batch composition differs between the modes: logprobs agree to rounding.
        np.testing.assert_allclose([x for _, x, _ in a["lps"]], [x for _, x, _ in b["lps"]], atol=1e-4)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_stopped_or_aborted_sequence_never_emits_past_its_end(mode, min_stopped=8):
    eng = tiny_engine(async_scheduling=mode, num_blocks=256)
    stopping = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, stop_token_ids=STOPS) for s in range(12)]
    for i, p in enumerate(stopping):
        eng.add_request(f"s{i}", list(range(200 + 10 * i, 230 + 10 * i)), p)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    eng.add_request("victim", list(range(50, 90)), long)
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    finished: set[str] = set()
    known_at_abort = None
    step = 0
    while eng.has_unfinished_requests():
        if step == 8:
            seq = eng._requests["victim"][0]
            known_at_abort = seq.output_token_ids  # what exists on the host when aborting
            assert eng.abort_request("victim")
        for o in eng.step():
            assert o.request_id not in finished
            for c in o.outputs:
                got.setdefault(o.request_id, []).extend(c.new_token_ids)
                if c.finish_reason:
                    reasons[o.request_id] = c.finish_reason
            if o.finished:
                finished.add(o.request_id)
        step += 1
    stopped = 0
    for i in range(12):
        ids, reason = got[f"s{i}"], reasons[f"s{i}"]
        assert not any(t in STOPS for t in ids[:-1]), "tokens emitted after a stop token"
        if reason == "stop":
            stopped += 1
            assert ids[-1] in STOPS
        else:
            assert reason == "length" and len(ids) == 40
    assert stopped >= min_stopped  # the stop path was taken (the tiny CPU model stops often)
    assert reasons["victim"] == "abort" and got["victim"] == known_at_abort  # nothing sampled after the abort
    if mode == "on":
        assert eng.num_discarded_tokens >= stopped  # each stop cost one discarded token
    else:
        assert eng.num_discarded_tokens == 0
    assert eng.block_manager.num_free_blocks == 256
    eng.close()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_penalties_on_the_device_follow_the_definition(mode):
    """The output-token counts live on the device and are updated by each step's sampled
    ids: every greedy token must be the argmax of the penalised reference logits."""
    eng = tiny_engine(async_scheduling=mode, num_blocks=128)
    prompt = [101, 2002, 303, 4004, 505, 6006, 707, 303, 303]
    # Negative penalties reward repeats, so the counts grow and keep mattering.
    p = SamplingParams(temperature=0, max_tokens=10, presence_penalty=-1.0, frequency_penalty=-0.4, repetition_penalty=0.7, ignore_eos=True)
    companion = replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    res = eng.generate([prompt, list(range(900, 940))], [p, companion])[0].token_ids
    moved = 0
    for i, t in enumerate(res):
        raw = eng.first_step_logits(prompt + res[:i]).double().numpy()
        ref = penalized(raw, p, prompt, res[:i])
        assert t == int(np.argmax(ref)), i
        moved += int(np.argmax(raw)) != t
    assert moved >= 3  # the penalties changed the outcome, so the check is sharp
    eng.close()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_request_that_ends_with_its_prompt_still_caches_the_prompt(mode):
    """A prefill-only request (max_tokens 1) finishes in the step that completes its
    prompt: its full blocks must still join the prefix cache."""
    eng = tiny_engine(async_scheduling=mode, max_num_batched_tokens=32)  # two chunks
    prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
    first = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert eng.block_manager.count_cached_prefix(prompt) == 3
    again = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
    eng.close()


def test_structured_outputs_and_logit_bias_equal_sync():
    """Grammar-constrained rows (their next mask needs the token in flight, so the engine
    reads it before scheduling) and logit_bias rows, batched with free ones."""
    from libs.structured import GrammarSpec

    choices = ["red", "green", "blue", "yellow"]
    runs = {}
    for mode in ("off", "on"):
        eng = tiny_engine(async_scheduling=mode, num_blocks=256)
        grammar = eng.start_grammar(GrammarSpec.choice(choices))
        eng.add_request("g", list(range(300, 340)), SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True), grammar=grammar)
        eng.add_request("b", list(range(500, 530)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 100, 9: -100}))
        eng.add_request("f", list(range(700, 720)), SamplingParams(temperature=0.8, seed=2, max_tokens=20, ignore_eos=True))
        got: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                for c in o.outputs:
                    got.setdefault(o.request_id, []).extend(c.new_token_ids)
                    reasons[o.request_id] = c.finish_reason or reasons.get(o.request_id)
        assert eng.tokenizer.decode(got["g"]) in choices and reasons["g"] == "stop"
        assert got["b"] == [7] * 12  # +100 forces, greedily, every step
        runs[mode] = (got, reasons)
        eng.close()
    assert runs["off"] == runs["on"]


def test_auto_turns_async_scheduling_on_where_it_was_measured_faster():
    """bench/RESULTS.md: faster on the H100 at every SmolLM2 batch size, not on the CPU."""
    cfg = EngineConfig(async_scheduling="auto")
    assert cfg.resolve_async_scheduling(torch.device("cuda")) is True
    assert cfg.resolve_async_scheduling(torch.device("cpu")) is False
    assert EngineConfig(async_scheduling="off").resolve_async_scheduling(torch.device("cuda")) is False
