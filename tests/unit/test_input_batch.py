"""The persistent batch, the step layout built from it, and the scheduler's per-step cost.

- ``InputBatch`` under random arrivals, prompt completions and departures keeps its
  invariants: decode rows first, every row's sequence knows its row, slots unique, and
  each row's arrays equal to what its sequence says.
- Every step the engine lays out equals what a per-sequence reference computes from the
  sequences themselves (positions, cache slots, lengths, block tables, query starts,
  which logits rows are sampled and with which parameters).
- In steady decoding the scheduler touches a sequence only when it crosses a block
  boundary, not once per step.
"""

from __future__ import annotations

import random

import numpy as np

from libs.engine import SamplingParams
from libs.engine.input_batch import InputBatch
from libs.engine.sequence import Sequence
from tests.models import tiny_engine


def _check_rows(batch: InputBatch, live: set[Sequence], decoding: set[Sequence]) -> None:
    rows = batch.seqs[: batch.num_rows]
    assert set(rows) == live and len(rows) == len(live)
    assert set(rows[: batch.num_decodes]) == decoding
    for r, s in enumerate(rows):
        assert s.row == r and s.batch is batch
        assert batch.num_computed[r] == s.num_computed_tokens
        assert batch.temperature[r] == np.float32(s.params.temperature)
        assert list(batch.block_table[r, : batch.num_blocks[r]]) == s.block_table
    slots = batch.slot[: batch.num_rows].tolist()
    assert len(set(slots)) == len(slots)


def test_rows_stay_consistent_under_random_changes():
    rng = random.Random(0)
    batch = InputBatch(capacity=2, max_blocks_per_seq=8)  # grows on the way
    live: set[Sequence] = set()
    decoding: set[Sequence] = set()
    for step in range(400):
        op = rng.random()
        if op < 0.4 or not live:
            s = Sequence("r", 0, [1] * rng.randint(1, 30), SamplingParams(temperature=rng.choice([0, 0.5, 1.0])))
            s.block_table = [rng.randint(0, 99) for _ in range(rng.randint(0, 8))]
            s.num_computed_tokens = rng.randint(0, 20)
            batch.add(s, decode=rng.random() < 0.3)
            live.add(s)
            if s.row < batch.num_decodes:
                decoding.add(s)
        elif op < 0.7:
            s = rng.choice(sorted(live, key=id))
            computed = s.num_computed_tokens
            batch.remove(s)
            assert s.batch is None and s.num_computed_tokens == computed  # counters come back
            live.discard(s)
            decoding.discard(s)
        elif op < 0.85:
            s = rng.choice(sorted(live, key=id))
            batch.to_decode(s)
            decoding.add(s)
        else:
            s = rng.choice(sorted(live, key=id))
            s.block_table.append(rng.randint(0, 99)) if len(s.block_table) < 8 else None
            s.num_computed_tokens += 1
            batch.sync_blocks(s)
        _check_rows(batch, live, decoding)
    assert batch.capacity >= max(2, len(live))


def _reference(step, bs: int) -> dict:
    """The step's inputs recomputed from the sequences (before the step ran)."""
    nd = step.num_decodes
    seqs = step.sample_seqs[:nd] + [c.seq for c in step.chunks]
    starts = [s.num_computed_tokens for s in step.sample_seqs[:nd]] + [c.start for c in step.chunks]
    counts = [1] * nd + [c.num_tokens for c in step.chunks]
    pos, slots = [], []
    for s, st, n in zip(seqs, starts, counts):
        for p in range(st, st + n):
            pos.append(p)
            slots.append(s.block_table[p // bs] * bs + p % bs)
    ends = list(np.cumsum(counts) - 1)
    logits = list(range(nd))
    for c, end in zip(step.chunks, ends[nd:]):
        if c.num_samples:
            logits += [end] * (1 + len(c.children))
    qsl = [0] + list(np.cumsum(counts[nd:]))
    return {"positions": pos, "slot_mapping": slots, "seq_lens": [st + n for st, n in zip(starts, counts)], "logits": logits, "qsl": qsl, "seqs": seqs}


def test_every_step_is_laid_out_as_its_sequences_say():
    eng = tiny_engine(num_blocks=200, max_num_batched_tokens=48, max_num_seqs=8)
    bs = eng.config.block_size
    rng = random.Random(3)
    advance = eng._in_flight.advance
    checked = {"decode": 0, "mixed": 0, "fork": 0}

    def check(step):
        v = step.layout.views(*step.pack.arrays)
        ref = _reference(step, bs)
        T, B, S = step.num_tokens, step.num_seqs, step.num_samples
        assert v.positions[:T].tolist() == ref["positions"]
        assert v.slot_mapping[:T].tolist() == ref["slot_mapping"]
        assert v.seq_lens[:B].tolist() == ref["seq_lens"]
        assert v.logits_indices[:S].tolist() == ref["logits"]
        assert v.query_start_loc[: step.num_prefill_seqs + 1].tolist() == ref["qsl"]
        for j, s in enumerate(ref["seqs"]):
            nb = -(-ref["seq_lens"][j] // bs)
            assert v.block_tables[j, :nb].tolist() == s.block_table[:nb]
        t = step.num_decodes
        for c in step.chunks:  # prompt tokens come from the host, decode ids from the device
            assert v.input_ids[t : t + c.num_tokens].tolist() == c.seq.token_ids[c.start : c.start + c.num_tokens]
            t += c.num_tokens
        assert v.decode_slots[: step.num_decodes].tolist() == [s.batch.slot[s.row] for s in step.sample_seqs[: step.num_decodes]]
        assert v.sample_slots[:S].tolist() == [s.batch.slot[s.row] for s in step.sample_seqs]
        b = eng.batch  # parameters are laid out when some stage will read them
        if b.num_random or b.num_penalized:
            assert v.temperature[:S].tolist() == [np.float32(s.params.temperature) for s in step.sample_seqs]
            checked["params"] = checked.get("params", 0) + 1
        if b.num_top_k:
            assert v.top_k[:S].tolist() == [max(s.params.top_k, 0) for s in step.sample_seqs]
        kind = "decode" if not step.chunks else "mixed" if step.num_decodes else "prefill"
        checked[kind] = checked.get(kind, 0) + 1
        checked["fork"] += any(c.children for c in step.chunks)

    def spy_advance(step):
        check(step)  # the batch still holds the step's "before" state here
        advance(step)

    eng._in_flight.advance = spy_advance
    for i in range(10):
        prompt = [rng.randint(5, 3000) for _ in range(rng.randint(5, 60))]
        p = SamplingParams(temperature=rng.choice([0, 0.7]), top_k=rng.choice([-1, 20]), n=rng.choice([1, 1, 2]), seed=i, max_tokens=rng.randint(3, 20), ignore_eos=True)
        eng.add_request(f"r{i}", prompt, p)
        for _ in range(rng.randint(0, 3)):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    assert checked["decode"] > 5 and checked["mixed"] > 3 and checked["fork"] > 0 and checked["params"] > 5
    eng.close()


def test_a_refilled_positions_tensor_is_rotated_by_its_new_positions():
    """Steps reuse their staging views: the model must not cache rotary rows across
    forwards by the identity of the positions tensor."""
    import torch

    from libs.model.attention import AttentionMetadata
    from tests.models import tiny_loaded

    model = tiny_loaded().model
    cache = torch.zeros(8, 2, 2, 16, 2, 16)  # [blocks, layers, K/V, block, kv heads, head dim]
    model.bind_kv_cache(cache)
    ids = torch.tensor([5, 6, 7])
    meta = lambda: AttentionMetadata(torch.tensor([0, 1, 2]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 0, 3, 3)  # noqa: E731
    with torch.no_grad():
        pos = torch.tensor([0, 1, 2])
        model(ids, pos, meta())
        pos[:] = torch.tensor([3, 4, 5])  # the same tensor object, refilled
        cache.zero_()
        reused = model(ids, pos, meta())
        cache.zero_()
        fresh = model(ids, torch.tensor([3, 4, 5]), meta())
    assert torch.equal(reused, fresh)


def test_steady_decoding_costs_the_scheduler_one_visit_per_block_boundary():
    eng = tiny_engine(num_blocks=400, max_num_seqs=48)
    bs = eng.config.block_size
    for i in range(48):
        eng.add_request(f"r{i}", list(range(100 + i, 117 + i + i % 9)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    eng.step()  # every prompt in one step
    eng.step()
    assert len(eng.scheduler.decoding) == 48
    bm = eng.block_manager
    calls = {"blocks_needed": 0, "allocate_slots": 0}

    def counting(name):
        real = getattr(bm, name)

        def counted(*a):
            calls[name] += 1
            return real(*a)

        setattr(bm, name, counted)

    counting("blocks_needed")
    counting("allocate_slots")
    before = sum(len(s.block_table) for fam in eng._requests.values() for s in fam)
    steps = 2 * bs
    for _ in range(steps):
        eng.step()
    grown = sum(len(s.block_table) for fam in eng._requests.values() for s in fam) - before
    assert grown == 2 * 48  # every sequence crossed two block boundaries...
    # ...and was looked at then (a check and an allocation, which checks again), not every
    # step: once per step would be 48 * 32 looks.
    assert calls["allocate_slots"] == grown
    assert calls["blocks_needed"] <= 2 * grown
    eng.close()
