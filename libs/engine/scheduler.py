"""Continuous batching with chunked prefill and preemption by recompute, O(changes) per step.

Every step has a token budget (``max_num_batched_tokens``) and a cap on running
sequences (``max_num_seqs``). Decoding sequences come first, one token each; then
sequences still prefilling get the next chunk of their prompt, in arrival order; then
waiting sequences are admitted with what budget is left, after a prefix-cache lookup
that skips blocks already in the cache. When a sequence needs a block and none is free,
the most recently admitted running sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed later (its full blocks usually
survive in the prefix cache, so the recompute is mostly cache hits).

The per-step cost does not grow with the number of running sequences. A decoding
sequence needs nothing from the scheduler except a new block every ``block_size``
steps, and which ones need one at step ``s`` is known in advance: a sequence that feeds
position ``p`` at step ``s`` keeps ``(p - s) mod block_size`` constant while it decodes,
so decoding sequences sit in ``block_size`` buckets by that phase (a timing wheel) and
step ``s`` visits only the bucket whose sequences reach a block boundary. The output
lists changes only (blocks appended, chunks scheduled, sequences admitted or
preempted); the engine applies them to its persistent batch, whose decode region is
exactly the decoding set.

Async scheduling (libs/engine/engine.py) schedules step N + 1 before step N's tokens are
on the host. A decoding sequence then simply goes on (its input id comes from the
device); one that the last step took to its length limit is ``retire``d here without
waiting to be read back; one that stops on a token is found one step late, and its extra
token is discarded. A waiting sequence with a token still in flight is not admitted
until that token is read back (its prompt to recompute is not known yet).
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
    is_decode: bool = False  # one generated token: laid out with the decoding rows


@dataclass
class SchedulerOutput:
    """What changed this step. The decoding sequences not in ``skipped`` all run one token."""

    num_decodes: int = 0  # decoding sequences that run this step (admitted decode-type ones included)
    chunks: list[ScheduledSeq] = field(default_factory=list)  # prompt chunks and admissions, in order
    admitted: list[Sequence] = field(default_factory=list)  # need a row in the batch
    grown: list[Sequence] = field(default_factory=list)  # block tables that got new blocks
    skipped: list[Sequence] = field(default_factory=list)  # decoding, but not run this step (budget)
    preempted: list[Sequence] = field(default_factory=list)
    imports: list[tuple[KVImport, list[int], list[int]]] = field(default_factory=list)  # (import, staging rows, block ids)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_decodes + sum(s.num_tokens for s in self.chunks if not s.is_decode)

    @property
    def is_empty(self) -> bool:
        return self.num_decodes == 0 and not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # admission order (the preemption order)
        self.prefilling: dict[int, Sequence] = {}  # running, with prompt tokens left to compute
        self.decoding: dict[int, Sequence] = {}
        self.retired: dict[int, Sequence] = {}  # done computing, last tokens still in flight
        self._wheel: list[dict[int, Sequence]] = [{} for _ in range(block_manager.block_size)]
        self._phase: dict[int, int] = {}  # seq_id -> wheel bucket
        self.step = 0  # index of the next step to schedule
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
        s, bs = self.step, self.block_size
        self.step += 1
        budget = self.config.max_num_batched_tokens

        if len(self.decoding) > budget:  # rare: the newest decodes wait a step
            for seq in list(self.decoding.values())[budget:]:
                out.skipped.append(seq)
                self._rekey(seq, (self._phase[seq.seq_id] - 1) % bs)
        for seq in list(self._wheel[-s % bs].values()):  # the ones at a block boundary now
            if seq.seq_id not in self.decoding or seq in out.skipped:
                continue  # preempted meanwhile, or not running this step
            need = self.bm.blocks_needed(seq, 1)
            if need and self._make_room(seq, need, out):
                self.bm.allocate_slots(seq, 1)
                out.grown.append(seq)
        budget -= len(self.decoding) - len(out.skipped)

        for seq in list(self.prefilling.values()):
            if budget <= 0:
                break
            if seq.seq_id not in self.prefilling:  # preempted by an earlier one this step
                continue
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if n == 0:
                continue
            if not self._make_room(seq, self.bm.blocks_needed(seq, n), out):
                break
            grew = self.bm.blocks_needed(seq, n) > 0
            self.bm.allocate_slots(seq, n)
            if grew:
                out.grown.append(seq)
            out.chunks.append(self._scheduled(seq, n, decode_ok=False))
            budget -= n

        # Admit waiting sequences unless this step had to preempt (no room to grow).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # its last token is still in flight: its prompt is not known yet
                break
            admitted = self._admit(seq, budget, out)
            if admitted is None:
                break
            self.waiting.popleft()
            self.running[seq.seq_id] = seq
            out.admitted.append(seq)
            out.chunks.append(admitted)
            if not admitted.is_decode:
                self.prefilling[seq.seq_id] = seq
            budget -= admitted.num_tokens
        out.num_decodes = len(self.decoding) - len(out.skipped) + sum(c.is_decode for c in out.chunks)
        return out

    def _make_room(self, seq: Sequence, need: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until ``need`` blocks are free; False
        (and ``seq`` preempted) when ``seq`` itself is the newest left."""
        while need > self.bm.num_free_blocks:
            victim = next(reversed(self.running.values()))
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _chunk(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _scheduled(self, seq: Sequence, n: int, *, decode_ok: bool = True) -> ScheduledSeq:
        """``decode_ok``: an admitted sequence whose one token to compute is a generated
        one joins the decoding rows (never a prompt's last token, even alone in a chunk:
        the quantized path runs decode rows on 4-bit weights). A prefilling sequence stays
        in the prefill rows for its last chunk, whatever its size."""
        reaches_end = seq.num_computed_tokens + n == seq.num_tokens
        is_decode = decode_ok and n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens and reaches_end
        return ScheduledSeq(seq, n, (1 + seq.pending_forks) if reaches_end else 0, is_decode)

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
        self._drop(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.was_preempted = True
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        if seq in out.admitted:  # admitted earlier this step: undo
            out.admitted.remove(seq)
        if seq in out.skipped:
            out.skipped.remove(seq)
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        self.num_preemptions += 1

    # -- transitions the engine reports -------------------------------------------------

    def start_decoding(self, seq: Sequence) -> None:
        """``seq`` was just launched with the step that samples its next token: from the
        next step on it decodes, feeding position ``num_computed_tokens``."""
        self.prefilling.pop(seq.seq_id, None)
        self.running.setdefault(seq.seq_id, seq)
        self.decoding[seq.seq_id] = seq
        self._rekey(seq, (seq.num_computed_tokens - self.step) % self.block_size)

    def retire(self, seq: Sequence) -> None:
        """``seq`` reached its length limit with its last token still in flight: it needs
        no more steps and finishes when that token is read back."""
        self._drop(seq)
        self.retired[seq.seq_id] = seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and drop from the queues; the caller frees (or exports) blocks."""
        if seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)  # preempted with its last token in flight
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._drop(seq)
        self.retired.pop(seq.seq_id, None)

    def abort(self, seqs: list[Sequence]) -> list[Sequence]:
        """Abort these sequences wherever they are; their blocks are freed now."""
        aborted = []
        for seq in seqs:
            if seq.is_finished:
                continue
            if seq.seq_id in self.running or seq.seq_id in self.retired:
                self._drop(seq)
                self.retired.pop(seq.seq_id, None)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            self.bm.free(seq)
            if seq.kv_import is not None:
                seq.kv_import.release()
                seq.kv_import = None
            aborted.append(seq)
        return aborted

    # -- internals ----------------------------------------------------------------------

    def _drop(self, seq: Sequence) -> None:
        sid = seq.seq_id
        self.running.pop(sid, None)
        self.prefilling.pop(sid, None)
        if self.decoding.pop(sid, None) is not None:
            del self._wheel[self._phase.pop(sid)][sid]

    def _rekey(self, seq: Sequence, phase: int) -> None:
        sid = seq.seq_id
        old = self._phase.get(sid)
        if old is not None:
            del self._wheel[old][sid]
        self._phase[sid] = phase
        self._wheel[phase][sid] = seq

