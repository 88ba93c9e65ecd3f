"""Step inputs: an immutable plan of a step, and the pure function that turns it into tensors.

``StepPlan`` is a snapshot of what the scheduler decided (which tokens of which sequence
go where in the cache), taken on the engine thread. ``build_inputs(plan, ...)`` reads only
the plan and allocates fresh tensors, so it can run on another thread while the device
executes the previous step (async prepare): the two sides share no mutable state.

For a decode-only step, ``plan.next_decode()`` predicts the following step (every
sequence feeds the token it is about to sample, one position further on), so its inputs
can be built ahead. The engine uses them only if the real next plan ``matches`` the
prediction; any difference (a sequence finished, arrived, was preempted or needs a new
block) falls back to building inputs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from libs.engine.scheduler import SchedulerOutput
from libs.model.attention import AttentionMetadata


@dataclass(frozen=True)
class SeqPlan:
    seq_id: int
    token_ids: tuple[int, ...]  # fed this step (empty when predicted: comes from the device)
    start: int  # position of the first fed token
    num_tokens: int
    block_table: tuple[int, ...]
    num_samples: int
    verify: bool = False  # speculative verification: logits at every fed position


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[SeqPlan, ...]  # decode-first
    num_decodes: int
    block_size: int

    @classmethod
    def from_schedule(
        cls, out: SchedulerOutput, sample_counts: list[int], block_size: int, drafts: dict[int, list[int]] | None = None
    ) -> "StepPlan":
        """``drafts``: speculating sequences (by seq id) feed their last token and their
        drafts, and get logits at each (libs/engine/spec/verify.py)."""
        seqs = []
        for s, k in zip(out.scheduled, sample_counts):
            seq, start = s.seq, s.seq.num_computed_tokens
            d = drafts.get(seq.seq_id) if drafts else None
            if d is not None:
                seqs.append(SeqPlan(seq.seq_id, (seq.token_ids[start], *d), start, 1 + len(d), tuple(seq.block_table), k, verify=True))
                continue
            seqs.append(SeqPlan(seq.seq_id, tuple(seq.token_ids[start : start + s.num_tokens]), start, s.num_tokens, tuple(seq.block_table), k))
        return cls(tuple(seqs), out.num_decodes, block_size)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == len(self.seqs) and all(s.num_samples == 1 for s in self.seqs)

    def next_decode(self) -> "StepPlan | None":
        """The step after this decode-only one if nothing changes, or None when it cannot
        be predicted (a sequence would need a block that is not allocated yet)."""
        if not self.is_decode_only or not self.seqs:
            return None
        nxt = []
        for s in self.seqs:
            pos = s.start + 1
            if pos // self.block_size >= len(s.block_table):
                return None
            nxt.append(SeqPlan(s.seq_id, (), pos, 1, s.block_table, 1))
        return StepPlan(tuple(nxt), len(nxt), self.block_size)

    def matches(self, predicted: "StepPlan") -> bool:
        """Whether ``predicted`` (from ``next_decode``) is exactly this plan, tokens aside."""
        if len(self.seqs) != len(predicted.seqs) or not self.is_decode_only:
            return False
        for a, b in zip(self.seqs, predicted.seqs):
            if a.seq_id != b.seq_id or a.start != b.start:
                return False
            used = a.start // self.block_size + 1
            if a.block_table[:used] != b.block_table[:used]:
                return False
        return True


@dataclass
class StepInputs:
    """Device-side inputs of one step (built fresh for every step)."""

    input_ids: torch.Tensor | None  # [T] int64; None when they come from the previous step's samples
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [P + 1] int32 over the prefill part
    logits_indices: torch.Tensor  # [S] int64
    num_decodes: int
    num_prefill_tokens: int
    max_seq_len: int
    max_blocks: int  # host copy of block_tables.shape[1]
    num_verify_tokens: int = 0  # tokens of speculative verification (logits at each)

    def metadata(self) -> AttentionMetadata:
        """What every layer's attention reads."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            num_decodes=self.num_decodes,
            num_prefill_tokens=self.num_prefill_tokens,
            max_seq_len=self.max_seq_len,
            num_verify_tokens=self.num_verify_tokens,
        )


def build_inputs(plan: StepPlan, device: torch.device) -> StepInputs:
    """Tensors for ``plan`` on ``device``: built on the host, then one pinned, non-blocking
    copy each (no host sync). Pure: reads only the plan."""
    bs = plan.block_size
    n = len(plan.seqs)
    max_blocks = max((len(s.block_table) for s in plan.seqs), default=1) or 1
    tables = np.zeros((n, max_blocks), dtype=np.int32)
    pos_chunks, slot_chunks, ids = [], [], []
    seq_lens = np.empty(n, dtype=np.int32)
    qsl = [0]
    logits_indices: list[int] = []
    t = verify_tokens = 0
    for i, s in enumerate(plan.seqs):
        pos = np.arange(s.start, s.start + s.num_tokens, dtype=np.int64)
        table = np.asarray(s.block_table, dtype=np.int64)
        pos_chunks.append(pos)
        slot_chunks.append(table[pos // bs] * bs + pos % bs)
        tables[i, : len(s.block_table)] = s.block_table
        seq_lens[i] = s.start + s.num_tokens
        ids.extend(s.token_ids)
        if i >= plan.num_decodes:
            qsl.append(qsl[-1] + s.num_tokens)
        t += s.num_tokens
        if s.verify:
            logits_indices.extend(range(t - s.num_tokens, t))
            verify_tokens += s.num_tokens
        else:
            logits_indices.extend([t - 1] * s.num_samples)
    cat = np.concatenate if pos_chunks else (lambda _: np.zeros(0, dtype=np.int64))
    move = _mover(device)
    return StepInputs(
        input_ids=move(torch.tensor(ids, dtype=torch.long)) if ids else None,
        positions=move(torch.from_numpy(cat(pos_chunks))),
        slot_mapping=move(torch.from_numpy(cat(slot_chunks))),
        block_tables=move(torch.from_numpy(tables)),
        seq_lens=move(torch.from_numpy(seq_lens)),
        query_start_loc=move(torch.tensor(qsl, dtype=torch.int32)),
        logits_indices=move(torch.tensor(logits_indices, dtype=torch.long)),
        num_decodes=plan.num_decodes,
        num_prefill_tokens=t - plan.num_decodes,
        max_seq_len=int(seq_lens.max()) if n else 0,
        max_blocks=max_blocks,
        num_verify_tokens=verify_tokens,
    )


def _mover(device: torch.device):
    if device.type == "cpu":
        return lambda x: x
    return lambda x: x.pin_memory().to(device, non_blocking=True)
