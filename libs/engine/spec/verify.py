"""The speculative step, as the engine's step loop sees it (kept in this one module so that
it ports to a restructured step loop unchanged).

Per step, after the scheduler has chosen the batch:

1. ``propose``: every decoding sequence that may speculate (adaptive switch, room left in
   ``max_tokens``, the context and the step's token budget) gets slots for ``k`` more
   tokens, and the proposer drafts up to ``k`` tokens for it. Sequences with no drafts
   give their extra slots back at once. The step's batch is reordered to plain decodes,
   then verifying sequences, then prefill chunks: a verifying sequence is a ``k + 1``-token
   chunk (its last token and its drafts) with logits at every position, which the
   attention backends run as a chunked prefill over the paged context. So the target
   scores every speculating sequence in the same forward as everything else.
2. ``prepare`` / ``collect``: the rejection sampler's per-position inputs are built from an
   immutable snapshot, on the AsyncRunner's thread while the device runs the forward when
   async prepare is on (its exception reaches ``collect``, and fails the speculating
   requests of that step, nothing else).
3. ``sample``: plain rows go through the engine's sampler, verifying rows through the
   rejection sampler; each sequence gets its list of emitted tokens.
4. ``settle`` (after the engine appended the emitted tokens, cutting at the first stop):
   the sequence's computed tokens are its last token plus the accepted drafts; blocks
   holding nothing but rejected positions are released (``BlockManager.trim``); only
   then are its full blocks committed to the prefix cache, so a cached block is made of
   accepted tokens only. Metrics and the adaptive switch see the sampler's result.

A proposer's exception fails the requests it concerns (the whole proposer batch for a
batched one) before anything runs; the step goes on with the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from libs.engine.async_runner import AsyncRunner
from libs.engine.block_manager import BlockManager
from libs.engine.inputs import StepPlan
from libs.engine.scheduler import SchedulerOutput
from libs.engine.sequence import Sequence, TokenLogprob
from libs.engine.spec.adaptive import AdaptiveSpeculation
from libs.engine.spec.config import SpeculativeConfig
from libs.engine.spec.metrics import SpecDecodeMetrics
from libs.engine.spec.proposer import DraftRequest, Proposer
from libs.engine.spec.rejection import RejectionSampler, VerifyBatch, VerifyRow, Verified, build_verify_batch

log = logging.getLogger(__name__)

Emitted = list[tuple[int, "TokenLogprob | None"]]


class SpecPrepareError(RuntimeError):
    """Building the verification inputs failed; the speculating requests of the step fail."""


@dataclass
class SpecStep:
    """What one step speculates: drafts by seq id (verify order), and what failed."""

    drafts: dict[int, list[int]] = field(default_factory=dict)
    seqs: list[Sequence] = field(default_factory=list)  # verifying sequences, in batch order
    rows: tuple[VerifyRow, ...] = ()
    draft_probs: torch.Tensor | None = None  # [B, K, V] rows in ``seqs`` order
    failed: list[tuple[str, BaseException]] = field(default_factory=list)  # (request id, error)
    verified: dict[int, Verified] = field(default_factory=dict)
    base_computed: dict[int, int] = field(default_factory=dict)  # num_computed before the step
    prepared: VerifyBatch | None = None
    pending: bool = False  # a prepare task runs on the AsyncRunner

    @property
    def verifying(self) -> bool:
        return bool(self.seqs)

    def take_failed(self) -> list[tuple[str, BaseException]]:
        failed, self.failed = self.failed, []
        return failed


class SpecDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        rejection: RejectionSampler,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
    ):
        self.config = config
        self.proposer = proposer
        self.rejection = rejection
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = device
        self.metrics = SpecDecodeMetrics(config.k)
        self.adaptive = AdaptiveSpeculation(
            window=config.acceptance_window,
            min_acceptance_length=config.min_acceptance_length,
            reprobe_interval=config.reprobe_interval,
        )
        self.num_proposer_errors = 0
        self.num_prepare_errors = 0

    # -- 1. propose ---------------------------------------------------------------------------

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts ``seq`` may verify: the emitted burst (drafts + 1) must fit ``max_tokens``
        and the context, so no burst ever overshoots either."""
        k = self.config.k
        p = seq.params
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        return min(k, self.max_model_len - seq.num_tokens - 1)

    def propose(self, out: SchedulerOutput) -> SpecStep:
        step = SpecStep()
        for seq in out.preempted:  # their blocks are gone: so is any draft KV
            self.proposer.forget(seq.seq_id)
            self.adaptive.forget(seq.seq_id)
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        requests: list[DraftRequest] = []
        for s in out.scheduled[: out.num_decodes]:
            seq = s.seq
            if budget <= 0:
                break
            if s.num_tokens != 1 or s.num_samples != 1 or seq.pending_forks:
                continue
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
                self._release(r.seq)
                step.failed.append((r.seq.request_id, e))
            _drop(out, {rid for rid, _ in step.failed})
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
                self._release(r.seq)
                continue
            if len(d) < r.max_drafts:
                self.bm.trim(r.seq, r.seq.num_computed_tokens + 1 + len(d))
            step.drafts[r.seq.seq_id] = d
            verifying.append(i)
        failed_ids = {rid for rid, _ in step.failed}
        if failed_ids:
            _drop(out, failed_ids)
            for i in list(verifying):
                if requests[i].seq.request_id in failed_ids:  # a sibling failed: its blocks go
                    step.drafts.pop(requests[i].seq.seq_id, None)
                    verifying.remove(i)
        if not verifying:
            return step
        # Decode part: plain decodes first, then the verifying ones (prefill-shaped chunks).
        spec_ids = set(step.drafts)
        decodes = out.scheduled[: out.num_decodes]
        plain = [s for s in decodes if s.seq.seq_id not in spec_ids]
        spec = [s for s in decodes if s.seq.seq_id in spec_ids]
        for s in spec:
            s.num_tokens = 1 + len(step.drafts[s.seq.seq_id])
        out.scheduled = plain + spec + out.scheduled[out.num_decodes :]
        out.num_decodes = len(plain)
        step.seqs = [s.seq for s in spec]
        step.base_computed = {s.seq_id: s.num_computed_tokens for s in step.seqs}
        order = {requests[i].seq.seq_id: i for i in verifying}
        if drafts.probs is not None:
            idx = torch.tensor([order[s.seq_id] for s in step.seqs], device=drafts.probs.device)
            step.draft_probs = drafts.probs[idx]
        step.rows = tuple(_row(s, step.drafts[s.seq_id]) for s in step.seqs)
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

    def _release(self, seq: Sequence) -> None:
        """Give back the draft slots of a sequence that will not verify this step."""
        self.bm.trim(seq, seq.num_computed_tokens + 1)

    # -- 2. prepare -----------------------------------------------------------------------------

    def prepare(self, step: SpecStep, runner: AsyncRunner | None) -> None:
        """Start building the verification inputs (on ``runner``'s thread if given)."""
        if not step.verifying:
            return
        if runner is not None:
            runner.submit(build_verify_batch, step.rows, self.device)
            step.pending = True
            return
        try:
            step.prepared = build_verify_batch(step.rows, self.device)
        except Exception as e:  # noqa: BLE001 - handled as the threaded one is
            self._prepare_failed(step, e)

    def collect(self, step: SpecStep, runner: AsyncRunner | None) -> None:
        if step.pending:
            step.pending = False
            try:
                step.prepared = runner.sync()  # re-raises the task's exception here
            except Exception as e:  # noqa: BLE001
                self._prepare_failed(step, e)

    def _prepare_failed(self, step: SpecStep, error: Exception) -> None:
        log.error("building verification inputs failed: %s", error, exc_info=error)
        self.num_prepare_errors += 1
        err = SpecPrepareError(f"speculative verification failed: {type(error).__name__}: {error}")
        step.failed.extend((s.request_id, err) for s in step.seqs)

    # -- 3. sample ------------------------------------------------------------------------------

    def sample(self, step: SpecStep, logits: torch.Tensor, plan: StepPlan, sample_seqs: list[Sequence], sample_plain) -> list[Emitted | None]:
        """Per sampled sequence (``sample_seqs``, the plan's order): the tokens it emits, or
        None when its request failed. ``sample_plain(logits, seqs)`` is the engine's sampler."""
        plain_rows: list[int] = []
        plain_seqs: list[Sequence] = []
        spec_rows: list[int] = []
        for sp, row, seq in zip(self._sampled_plans(plan), self.sample_rows(plan), sample_seqs):
            if sp.verify:
                assert seq.seq_id == sp.seq_id
                spec_rows.extend(range(row, row + sp.num_tokens))
            else:
                plain_rows.append(row)
                plain_seqs.append(seq)
        emitted: dict[int, Emitted | None] = {}
        if plain_seqs:
            rows = torch.tensor(plain_rows, device=logits.device)
            sampled = sample_plain(logits[rows], plain_seqs)
            for seq, tok, lp in zip(plain_seqs, sampled.token_ids, sampled.logprobs):
                emitted[id(seq)] = [(tok, lp)]
        if step.prepared is not None:
            rows = torch.tensor(spec_rows, device=logits.device)
            verified = self.rejection(logits[rows], step.prepared, [s.generator for s in step.seqs], step.draft_probs)
            for seq, v in zip(step.seqs, verified):
                step.verified[seq.seq_id] = v
                emitted[id(seq)] = list(zip(v.token_ids, v.logprobs))
        for seq in step.seqs:
            emitted.setdefault(id(seq), None)
        return [emitted[id(s)] for s in sample_seqs]

    @staticmethod
    def _sampled_plans(plan: StepPlan) -> list:
        """The plan entry of each sampled sequence (a parent's once per fork)."""
        return [sp for sp in plan.seqs for _ in range(1 if sp.verify else sp.num_samples)]

    @staticmethod
    def sample_rows(plan: StepPlan) -> list[int]:
        """The logits row of each sampled sequence (a verifying one's first row): a verifying
        sequence has a row per fed token, the others one per sample."""
        rows, row = [], 0
        for sp in plan.seqs:
            if sp.verify:
                rows.append(row)
                row += sp.num_tokens
            else:
                rows.extend(range(row, row + sp.num_samples))
                row += sp.num_samples
        return rows

    # -- 4. settle ------------------------------------------------------------------------------

    def settle(self, step: SpecStep, seq: Sequence) -> None:
        """After the emitted tokens were appended: computed tokens, rejected slots, cache."""
        v = step.verified.pop(seq.seq_id, None)
        if v is None:
            return
        base = step.base_computed[seq.seq_id]
        # The last token and the accepted drafts have KV; the token after them does not.
        seq.num_computed_tokens = min(base + 1 + v.num_accepted, seq.num_tokens - 1)
        self.bm.trim(seq, seq.num_computed_tokens)
        self.bm.commit(seq)
        self.metrics.observe(v.num_drafts, v.num_accepted)
        self.adaptive.observe(seq.seq_id, v.num_drafts, v.num_accepted)

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq.seq_id)
        self.adaptive.forget(seq.seq_id)


def _row(seq: Sequence, drafts: list[int]) -> VerifyRow:
    p = seq.params
    return VerifyRow(
        params=p,
        prompt_ids=tuple(seq.prompt_token_ids) if p.repetition_penalty != 1 else (),
        output_ids=tuple(seq.output_token_ids) if p.has_penalties else (),
        drafts=tuple(drafts),
        num_output_tokens=seq.num_output_tokens,
        min_tokens_ban=(*p.stop_token_ids, *(() if p.ignore_eos else seq.eos_token_ids)),
    )


def _drop(out: SchedulerOutput, request_ids: set[str]) -> None:
    """Remove failed requests' sequences from the step (the engine aborts them)."""
    decodes = [s for s in out.scheduled[: out.num_decodes] if s.seq.request_id not in request_ids]
    rest = [s for s in out.scheduled[out.num_decodes :] if s.seq.request_id not in request_ids]
    out.scheduled = decodes + rest
    out.num_decodes = len(decodes)
