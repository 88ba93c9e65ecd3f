"""The persistent batch: one row per running sequence, updated incrementally (vLLM v1's InputBatch).

A step's inputs are not rebuilt from per-sequence Python objects: every running sequence
owns a row of preallocated numpy arrays (computed and total token counts, block table,
sampling parameters), and rows change only when something happens to their sequence
(it arrives, finishes its prompt, gets a block, leaves). Building a decode step is then a
handful of vectorised operations over the first rows (libs/engine/step_inputs.py).

Layout: rows ``[0, num_decodes)`` are decoding sequences (one query token each), rows
``[num_decodes, num_rows)`` the rest (prompts being prefilled, and ``n > 1`` siblings
waiting for their first step). That is the decode-first order the attention backends
expect, so a decode step reads rows ``[0, num_decodes)`` as plain slices. A sequence
that finishes its prompt is swapped to the end of the decode region; a row that leaves
is filled by the last row of its region. Each change moves at most two rows.

Each row also has a stable ``slot``: the index of the sequence's state on the device
(its last sampled token, penalty counts), which never moves while the sequence runs;
the device gathers by slot, so moving a row here costs no device work.

``num_tokens`` counts tokens known on the host plus those still in flight (async
scheduling: sampled on the device, not read back yet). Sequences read and write their
``num_computed_tokens`` through their row (libs/engine/sequence.py).
"""

from __future__ import annotations

import numpy as np

from libs.engine.sequence import Sequence

# Per-row sampling parameters: the columns of ``sampling_params``, in the order of the
# step's float32 sampling block (libs/engine/step_inputs.py), each also a named view.
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class InputBatch:
    def __init__(self, capacity: int, max_blocks_per_seq: int):
        self.capacity = 0
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_rows = 0
        self.num_decodes = 0
        self.seqs: list[Sequence | None] = []
        self._free_slots: list[int] = []
        self.num_slots = 0
        # Rows needing each optional sampler stage: a stage runs when any row of the batch
        # needs it (it leaves the other rows as they are), and costs nothing otherwise.
        self.num_greedy = 0
        self.num_random = 0
        self.num_top_k = 0
        self.num_top_p = 0
        self.num_min_p = 0
        self.num_penalized = 0
        self.num_repetition = 0
        self.num_seeded = 0
        self.num_logprobs = 0
        self.num_min_tokens = 0
        self.num_bias = 0
        self.num_constrained = 0  # structured outputs: grammar masks to fill
        self._grow(max(1, capacity))

    # -- storage ------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        """(Re)allocate every per-row array for ``capacity`` rows, keeping the rows."""
        old, n = self.capacity, self.num_rows

        def arr(name: str, dtype, *shape: int, fill=0):
            new = np.full((capacity, *shape), fill, dtype=dtype)
            if old:
                new[:n] = getattr(self, name)[:n]
            setattr(self, name, new)

        arr("slot", np.int64)
        arr("num_computed", np.int64)
        arr("num_tokens", np.int64)
        arr("max_len", np.int64)  # num_tokens at which the sequence stops for length
        arr("num_blocks", np.int64)
        arr("block_table", np.int32, self.max_blocks_per_seq)
        arr("sampling_params", np.float32, len(FLOAT_PARAMS))
        for i, name in enumerate(FLOAT_PARAMS):
            setattr(self, name, self.sampling_params[:, i])
        arr("top_k", np.int64)
        arr("logprobs", np.int64, fill=-1)
        self.seqs.extend([None] * (capacity - old))
        self.capacity = capacity

    # -- membership ---------------------------------------------------------------------

    def add(self, seq: Sequence, *, decode: bool) -> int:
        """Give ``seq`` a row (in the decode region if ``decode``) and a device slot.
        Its block table and counters are copied in; from now on the row is their home."""
        assert seq.batch is None, "sequence already has a row"
        if self.num_rows == self.capacity:
            self._grow(2 * self.capacity)
        row = self.num_rows
        self.num_rows += 1
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self.num_slots
            self.num_slots += 1
        self.slot[row] = slot
        self.seqs[row] = seq
        p = seq.params
        self.num_computed[row] = seq._num_computed
        self.num_tokens[row] = len(seq.token_ids) + seq.num_pending
        seq.num_pending = 0
        self.max_len[row] = seq.max_len
        self.sampling_params[row] = [getattr(p, name) for name in FLOAT_PARAMS]
        self.top_k[row] = p.top_k if p.top_k > 0 else 0
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self._count(seq, +1)
        seq.batch, seq.row = self, row
        self.num_blocks[row] = 0
        self.sync_blocks(seq)
        if decode:
            self._to_decode_row(row)
        return slot

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq``'s row; its counters go back onto the sequence."""
        assert seq.batch is self, "sequence has no row here"
        row = seq.row
        seq._num_computed = int(self.num_computed[row])
        seq.num_pending = int(self.num_tokens[row]) - len(seq.token_ids)
        seq.batch, seq.row = None, -1
        self._count(seq, -1)
        self._free_slots.append(int(self.slot[row]))
        if row < self.num_decodes:  # keep the decode region contiguous
            last_decode = self.num_decodes - 1
            self._move(last_decode, row)
            row = last_decode
            self.num_decodes -= 1
        last = self.num_rows - 1
        self._move(last, row)
        self.seqs[last] = None
        self.num_rows -= 1

    def to_decode(self, seq: Sequence) -> None:
        """``seq`` finished its prompt (or was forked): it decodes from the next step on."""
        if seq.row >= self.num_decodes:
            self._to_decode_row(seq.row)

    def _to_decode_row(self, row: int) -> None:
        first = self.num_decodes
        if row != first:
            self._swap(row, first)
        self.num_decodes += 1

    def sync_blocks(self, seq: Sequence) -> None:
        """Copy the block ids ``seq`` got since the last sync into its row."""
        row, have, table = seq.row, int(self.num_blocks[seq.row]), seq.block_table
        if len(table) > self.max_blocks_per_seq:
            raise ValueError(f"sequence needs {len(table)} blocks, rows hold {self.max_blocks_per_seq}")
        if len(table) < have:  # the table was replaced (fork): rewrite it
            have = 0
        if len(table) > have:
            self.block_table[row, have : len(table)] = table[have:]
        self.num_blocks[row] = len(table)

    @property
    def decode_seqs(self) -> list[Sequence]:
        return self.seqs[: self.num_decodes]  # type: ignore[return-value]

    # -- internals ----------------------------------------------------------------------

    _ROW_ARRAYS = ("slot", "num_computed", "num_tokens", "max_len", "num_blocks", "block_table", "sampling_params", "top_k", "logprobs")

    def _move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        for name in self._ROW_ARRAYS:
            a = getattr(self, name)
            a[dst] = a[src]
        seq = self.seqs[src]
        self.seqs[dst] = seq
        seq.row = dst

    def _swap(self, a: int, b: int) -> None:
        for name in self._ROW_ARRAYS:
            x = getattr(self, name)
            x[[a, b]] = x[[b, a]]
        sa, sb = self.seqs[a], self.seqs[b]
        self.seqs[a], self.seqs[b] = sb, sa
        sa.row, sb.row = b, a

    def _count(self, seq: Sequence, d: int) -> None:
        p = seq.params
        self.num_greedy += d * p.greedy
        self.num_random += d * (not p.greedy)
        self.num_top_k += d * (p.top_k > 0)
        self.num_top_p += d * (p.top_p < 1)
        self.num_min_p += d * (p.min_p > 0)
        self.num_penalized += d * p.has_penalties
        self.num_repetition += d * (p.repetition_penalty != 1)
        self.num_seeded += d * (seq.generator is not None)
        self.num_logprobs += d * (p.logprobs is not None)
        self.num_min_tokens += d * (p.min_tokens > 0)
        self.num_bias += d * bool(p.logit_bias)
        self.num_constrained += d * (seq.grammar is not None)
