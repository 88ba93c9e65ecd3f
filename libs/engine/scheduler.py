"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget (``max_num_batched_tokens``) and a cap on running
sequences (``max_num_seqs``). Running sequences are served first, in arrival order:
each gets what it still needs (one token while decoding, the next chunk of its prompt
while prefilling). Waiting sequences are admitted with what budget is left, after a
prefix-cache lookup that skips blocks already in the cache. When a running sequence
needs a block and none is free, the most recently arrived running sequence is
preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later (its full blocks usually survive in the prefix cache, so the
recompute is mostly cache hits).

The step's batch is laid out decode-first (one query token each), then prefill chunks,
which is the layout the attention backends expect.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from libs.engine.block_manager import BlockManager
from libs.engine.sequence import KVImport, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens fed this step, from seq.num_computed_tokens on
    num_samples: int  # 0 when this chunk does not reach the end of the sequence


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decode-first order
    num_decodes: int = 0
    imports: list[tuple[KVImport, list[int], list[int]]] = field(default_factory=list)  # (import, staging rows, block ids)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def block_size(self) -> int:
        return self.bm.block_size

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq.num_uncomputed_tokens, budget)
            if n == 0:
                i += 1
                continue
            need = self.bm.blocks_needed(seq, n)
            while need > self.bm.num_free_blocks and self.running[-1] is not seq:
                self._preempt(self.running.pop(), out)
            if need > self.bm.num_free_blocks:
                self.running.pop()  # seq itself is last: nothing left to take from
                self._preempt(seq, out)
                break
            self.bm.allocate_slots(seq, n)
            (decodes if _is_decode(seq, n) else prefills).append(self._scheduled(seq, n))
            budget -= n
            i += 1

        # Admit waiting sequences unless this step had to preempt (no room to grow).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            admitted = self._admit(seq, budget, out)
            if admitted is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            (decodes if _is_decode(seq, admitted.num_tokens) else prefills).append(admitted)
            budget -= admitted.num_tokens

        out.scheduled = decodes + prefills
        out.num_decodes = len(decodes)
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        reaches_end = seq.num_computed_tokens + n == seq.num_tokens
        return ScheduledSeq(seq, n, (1 + seq.pending_forks) if reaches_end else 0)

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledSeq | None:
        """Prefix hits, imported KV, then fresh blocks for the first chunk; None if it
        does not fit this step (nothing is changed then)."""
        bs = self.block_size
        hits = self.bm.cached_prefix_blocks(seq)
        imp = seq.kv_import
        import_rows: list[int] = []
        end = len(hits) * bs
        if imp is not None and imp.first_block <= len(hits) < imp.first_block + imp.num_blocks:
            # Imported blocks continue the cached prefix; keep >= 1 token to compute.
            last = imp.first_block + imp.num_blocks
            while last > len(hits) and min(last * bs, imp.num_tokens) > seq.num_tokens - 1:
                last -= 1
            import_rows = list(range(len(hits) - imp.first_block, last - imp.first_block))
            end = min(last * bs, imp.num_tokens) if import_rows else end
        n = self._chunk(seq.num_tokens - end, budget)
        if n == 0:
            return None
        reusable = sum(1 for b in hits if self.bm.ref_counts[b] == 0)  # leave the free list on ref
        fresh = len(import_rows) + max(0, -(-(end + n) // bs) - len(hits) - len(import_rows))
        if fresh > self.bm.num_free_blocks - reusable:
            return None
        self.bm.admit(seq, hits)
        if import_rows:
            blocks = self.bm.allocate_blocks(seq, len(import_rows))
            out.imports.append((imp, import_rows, blocks))
            seq.num_imported_tokens = end - seq.num_computed_tokens
            seq.num_computed_tokens = end
        elif imp is not None:
            imp.release()
        seq.kv_import = None
        self.bm.allocate_slots(seq, n)
        seq.status = SequenceStatus.RUNNING
        return self._scheduled(seq, n)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.was_preempted = True
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    # -- lifecycle ----------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and drop from the queues; the caller frees (or exports) blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of ``request_id`` wherever it is; blocks are freed now."""
        aborted = [s for s in self.running if s.request_id == request_id]
        aborted += [s for s in self.waiting if s.request_id == request_id]
        for seq in aborted:
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            self.bm.free(seq)
            if seq.kv_import is not None:
                seq.kv_import.release()
                seq.kv_import = None
        return aborted


def _is_decode(seq: Sequence, n: int) -> bool:
    """One generated token (never a prompt's last token, even alone in a chunk): the batch's
    decode-first part, which every attention backend and the quantized path rely on."""
    return n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
