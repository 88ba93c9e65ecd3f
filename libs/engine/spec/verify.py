"""The speculative step, as the engine's step loop runs it (libs/engine/engine.py).

Speculation needs synchronous scheduling: a verify step's emitted tokens (1 to ``k + 1``
per sequence) decide the next step's positions and block tables, so the next step cannot
be laid out before they are read back. ``EngineConfig.resolve_async_scheduling`` turns
``auto`` off and refuses ``on`` when a speculative config is given.

Per step, after the scheduler has chosen the batch and the persistent batch holds it:

1. ``propose``: every decoding row of the step that may speculate (adaptive switch, room
   left before its length limit, the step's token budget; not a structured-output row)
   gets slots for ``k`` more tokens (``BlockManager.allocate_slots``, never preempting
   anything), and the proposer drafts up to ``k`` tokens for it. Sequences with fewer
   drafts give the extra slots back at once (``BlockManager.trim``). A proposer's exception
   fails the requests it concerns (the whole call's for a batched one) and nothing else.
2. The engine lays the step out with each speculating sequence as a *verify chunk*
   (libs/engine/step_inputs.py): its last token and its drafts, fed as a prefill-shaped
   chunk over its paged context, with a sample row at every position, after the plain
   decode rows and before the prompt chunks. So the target scores every speculating
   sequence in the same forward as everything else, and a verify step replays the prefill
   CUDA graphs like any step with chunks.
3. ``Verification`` rides on the step to the device queue: its inputs
   (``build_verify_batch``) are built on the AsyncRunner's thread while the forward runs
   when async prepare is on, from immutable rows (nothing shared with the engine thread),
   and collected before sampling; an exception there reaches the collector and fails the
   speculating requests of that step only (the plain rows are sampled as usual). Then
   libs/engine/spec/rejection.py samples every row.
4. ``settle`` (after the engine appended the emitted tokens, cutting at the first stop):
   the sequence's computed tokens are its last token plus the accepted drafts; blocks
   holding nothing but rejected positions are released (``BlockManager.trim``), and only
   then are its full blocks committed to the prefix cache, so a cached block is made of
   accepted tokens only. The scheduler re-files the sequence by its new position (its
   next block boundary moved). Metrics and the adaptive switch see the sampler's result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from libs.engine.async_runner import AsyncRunner
from libs.engine.block_manager import BlockManager
from libs.engine.sampler import DeviceSamples, Sampler, SamplingTensors
from libs.engine.sequence import Sequence
from libs.engine.spec.adaptive import AdaptiveSpeculation
from libs.engine.spec.config import SpeculativeConfig
from libs.engine.spec.metrics import SpecDecodeMetrics
from libs.engine.spec.proposer import DraftRequest, Proposer
from libs.engine.spec import rejection
from libs.engine.spec.rejection import VerifyBatch, VerifyRow

log = logging.getLogger(__name__)


class SpecPrepareError(RuntimeError):
    """Building the verification inputs failed; the speculating requests of the step fail."""


@dataclass
class SpecStep:
    """What one step speculates: the verifying sequences (in verify order) and their drafts."""

    seqs: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [B, K, V] over the target vocabulary, rows in ``seqs`` order
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request id, error)


@dataclass
class Verification:
    """The device side of one verify step (``Step.spec``): what ``ModelRunner.execute`` calls
    to sample the step. Immutable once submitted, except for collecting its prepared inputs."""

    first_row: int
    num_rows: int
    draft_probs: torch.Tensor | None
    generators: list[torch.Generator | None]
    prepare: AsyncRunner | None  # builds ``batch`` on its thread, or None (built inline)
    batch: VerifyBatch | None = None
    error: BaseException | None = None

    def sample(self, sampler: Sampler, state, logits: torch.Tensor, st: SamplingTensors, slots: torch.Tensor) -> tuple[DeviceSamples, BaseException | None]:
        if self.prepare is not None:
            try:
                self.batch = self.prepare.sync()  # re-raises the task's exception here
            except Exception as e:  # noqa: BLE001 - those requests fail, the step goes on
                self.error = e
        if self.error is not None:
            log.error("building verification inputs failed: %s", self.error, exc_info=self.error)
            self.batch = None
        samples = rejection.verify_sample(
            sampler, state, logits, st, slots, first_row=self.first_row, num_rows=self.num_rows,
            batch=self.batch, draft_probs=self.draft_probs, generators=self.generators,
        )
        err = None if self.error is None else SpecPrepareError(f"speculative verification failed: {type(self.error).__name__}: {self.error}")
        return samples, err


class SpecDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        block_manager: BlockManager,
        *,
        device: torch.device,
        async_prepare: bool,
    ):
        self.config = config
        self.proposer = proposer
        self.bm = block_manager
        self.device = device
        self.metrics = SpecDecodeMetrics(config.k)
        self.adaptive = AdaptiveSpeculation(
            window=config.acceptance_window,
            min_acceptance_length=config.min_acceptance_length,
            reprobe_interval=config.reprobe_interval,
        )
        self.prepare_runner = AsyncRunner("spec-prepare") if async_prepare else None
        self.num_proposer_errors = 0
        self.num_prepare_errors = 0

    # -- 1. propose ---------------------------------------------------------------------------

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts ``seq`` may verify: the emitted burst (drafts + 1) must fit its length
        limit (``max_tokens`` and the context), so no burst ever overshoots either."""
        return min(self.config.k, seq.max_len - seq.num_tokens - 1)

    def propose(self, candidates: list[Sequence], budget: int) -> SpecStep:
        """Drafts for those of ``candidates`` (decoding rows of this step) that speculate,
        within ``budget`` extra tokens."""
        step = SpecStep()
        requests: list[DraftRequest] = []
        for seq in candidates:
            if budget <= 0:
                break
            k = min(self.max_drafts(seq), budget)
            if k < 1 or not self.adaptive.should_speculate(seq.seq_id):
                continue
            k = self._reserve(seq, k)
            if k < 1:
                continue
            budget -= k
            requests.append(DraftRequest(seq, k))
        if not requests:
            return step
        try:
            drafts = self.proposer.propose(requests)
        except Exception as e:  # noqa: BLE001 - the proposer's batch fails, the step goes on
            log.exception("%s proposer failed for %d sequences", self.proposer.name, len(requests))
            self.num_proposer_errors += 1
            for r in requests:
                self.release(r.seq)
                step.failed.append((r.seq.request_id, e))
            return step
        verifying: list[int] = []
        for i, (r, d) in enumerate(zip(requests, drafts.token_ids)):
            err = drafts.errors.get(i)
            if err is not None:
                self.num_proposer_errors += 1
                log.warning("%s proposer failed for request %s: %s", self.proposer.name, r.seq.request_id, err)
                step.failed.append((r.seq.request_id, err))
            d = list(d[: r.max_drafts])
            if err is not None or not d:
                self.release(r.seq)
                continue
            if len(d) < r.max_drafts:
                self.bm.trim(r.seq, r.seq.num_computed_tokens + 1 + len(d))
            verifying.append(i)
        failed = {rid for rid, _ in step.failed}
        verifying = [i for i in verifying if requests[i].seq.request_id not in failed]  # a sibling failed
        step.seqs = [requests[i].seq for i in verifying]
        step.drafts = [list(drafts.token_ids[i][: requests[i].max_drafts]) for i in verifying]
        if drafts.probs is not None and verifying:
            step.draft_probs = drafts.probs[torch.tensor(verifying, device=drafts.probs.device)]
        return step

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Allocate slots for ``k`` drafts (beyond the scheduled token), fewer if blocks are
        short: speculation never preempts anything."""
        while k >= 1:
            need = self.bm.blocks_needed(seq, 1 + k)
            if self.bm.can_allocate(need):
                self.bm.allocate_slots(seq, 1 + k)
                return k
            k -= 1
        return 0

    def release(self, seq: Sequence) -> None:
        """Give back the draft slots of a sequence that will not verify this step."""
        self.bm.trim(seq, seq.num_computed_tokens + 1)

    # -- 2, 3. the verification on the device -----------------------------------------------------

    def verification(self, step: SpecStep, first_row: int) -> Verification:
        """The device side of ``step``, whose positions are the sample rows from
        ``first_row`` on; its inputs start building now (on the prepare thread if on)."""
        forced = self.config.forced_accepts if self.config.forced_acceptance is not None else None
        rows = tuple(
            VerifyRow(tuple(d), s.params.greedy, s.params.has_penalties, None if forced is None else forced(len(d)))
            for s, d in zip(step.seqs, step.drafts)
        )
        v = Verification(first_row, sum(len(d) + 1 for d in step.drafts), step.draft_probs, [s.generator for s in step.seqs], self.prepare_runner)
        if self.prepare_runner is not None:
            self.prepare_runner.submit(rejection.build_verify_batch, rows, first_row, self.device)
        else:
            try:
                v.batch = rejection.build_verify_batch(rows, first_row, self.device)
            except Exception as e:  # noqa: BLE001 - handled as the threaded one is
                v.error = e
        return v

    def drain(self) -> None:
        """A step failed before its verification was collected: drop the prepare task."""
        while self.prepare_runner is not None and self.prepare_runner.pending:
            try:
                self.prepare_runner.sync()
            except Exception:  # noqa: BLE001 - the step's own error is the one reported
                pass

    # -- 4. settle ------------------------------------------------------------------------------

    def settle(self, seq: Sequence, num_emitted: int, num_drafts: int, batch, scheduler) -> None:
        """After ``seq``'s emitted tokens were appended (``num_emitted`` before any stop
        cut): computed tokens, rejected slots, the prefix cache, the scheduler's wheel."""
        accepted = num_emitted - 1
        self.metrics.observe(num_drafts, accepted)
        self.adaptive.observe(seq.seq_id, num_drafts, accepted)
        if seq.batch is None:  # it stopped inside the burst: its blocks are gone already
            return
        # The last token and the accepted drafts have KV now; the token after them has not.
        seq.num_computed_tokens += num_emitted
        batch.num_tokens[seq.row] = seq.num_tokens
        self.bm.trim(seq, seq.num_computed_tokens)
        batch.sync_blocks(seq)
        self.bm.commit(seq)
        scheduler.start_decoding(seq)

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq.seq_id)
        self.adaptive.forget(seq.seq_id)

    def close(self) -> None:
        if self.prepare_runner is not None:
            self.prepare_runner.close()
