"""Verification: the target's logits at ``k + 1`` positions → the tokens a sequence emits.

For every speculating sequence the verify forward gives logits at its last token and at
each of its drafts. Position ``i`` is processed exactly as plain decoding would process the
step after ``i`` accepted drafts (``Sampler.process`` and ``Sampler.probs``):

- penalties count the output so far *plus* drafts ``0..i-1``;
- the ``min_tokens`` ban holds while ``num_output_tokens + i < min_tokens``;
- temperature, top-k, top-p and min-p shape ``p``; greedy rows take the argmax;

then the rejection sampler (kernels/rejection) decides. The noise comes from each
request's own generator (seeded requests stay reproducible) or the global one. Logprobs of
the emitted tokens are the raw model distribution at their positions, as without
speculation. Stops (EOS, stop ids, ``max_tokens``) are the engine's: it appends the
emitted tokens one by one and cuts the burst at the first stop.

``build_verify_batch`` is pure (immutable rows in, fresh tensors out) so that async prepare
can run it on the AsyncRunner's thread while the device runs the verify forward.

Forced acceptance (a test and benchmark mode, seed 001's ``forceSpAccept``): the first
``round(r * k)`` drafts are taken as they are and the target samples the next token from
its ``p`` at that position; nothing else changes, so every counter downstream moves exactly
as a real round with that acceptance would move it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.rejection import PLACEHOLDER
from libs.engine.params import SamplingParams
from libs.engine.sampler import Sampler, SamplingBatch, exponential_noise
from libs.engine.sequence import TokenLogprob


@dataclass(frozen=True)
class VerifyRow:
    """One speculating sequence, snapshotted on the engine thread."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]  # for the repetition penalty (empty when not needed)
    output_ids: tuple[int, ...]  # output so far (empty when no penalty needs it)
    drafts: tuple[int, ...]
    num_output_tokens: int
    min_tokens_ban: tuple[int, ...]  # stop ids (and EOS) banned while output < min_tokens


@dataclass
class VerifyBatch:
    sampling: SamplingBatch  # one row per position: sum(k_i + 1) rows, sequence by sequence
    row_start: list[int]  # first flat row of each sequence
    position_rows: torch.Tensor  # [B, K + 1] int64 flat row of each position (padding: 0)
    draft_ids: torch.Tensor  # [B, K] int64
    num_drafts: torch.Tensor  # [B] int32
    is_greedy: torch.Tensor  # [B] bool
    num_drafts_list: list[int]
    greedy_list: list[bool]
    K: int


@dataclass
class Verified:
    """What one sequence emits: accepted drafts then one sampled token (before stops)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    num_drafts: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def build_verify_batch(rows: tuple[VerifyRow, ...], device: torch.device) -> VerifyBatch:
    """Expand each sequence to its ``k + 1`` positions. Pure: reads only ``rows``."""
    K = max((len(r.drafts) for r in rows), default=0)
    params: list[SamplingParams] = []
    prompt_ids: list[list[int]] = []
    output_ids: list[list[int]] = []
    banned: list[list[int]] = []
    row_start: list[int] = []
    position_rows = torch.zeros((len(rows), K + 1), dtype=torch.long)
    draft_ids = torch.zeros((len(rows), K), dtype=torch.long)
    for b, r in enumerate(rows):
        row_start.append(len(params))
        for i in range(len(r.drafts) + 1):
            position_rows[b, i] = len(params)
            params.append(r.params)
            prompt_ids.append(list(r.prompt_ids))
            output_ids.append([*r.output_ids, *r.drafts[:i]] if r.params.has_penalties else [])
            banned.append(list(r.min_tokens_ban) if r.num_output_tokens + i < r.params.min_tokens else [])
        draft_ids[b, : len(r.drafts)] = torch.tensor(r.drafts, dtype=torch.long)
    num = [len(r.drafts) for r in rows]
    greedy = [r.params.greedy for r in rows]
    return VerifyBatch(
        sampling=SamplingBatch(params, [None] * len(params), prompt_ids, output_ids, banned),
        row_start=row_start,
        position_rows=position_rows.to(device),
        draft_ids=draft_ids.to(device),
        num_drafts=torch.tensor(num, dtype=torch.int32, device=device),
        is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        num_drafts_list=num,
        greedy_list=greedy,
        K=K,
    )


@functools.lru_cache(maxsize=None)
def rejection_kernel(device_type: str) -> Callable[..., torch.Tensor]:
    """The Triton kernel on CUDA, the torch reference elsewhere (same signature)."""
    if device_type == "cuda":
        from kernels.rejection import triton_rejection

        return triton_rejection.rejection_sample
    from kernels.rejection import reference

    return reference.rejection_sample


def forced_accept(
    draft_ids: torch.Tensor,
    accepts: torch.Tensor,
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    """Forced acceptance: the first ``accepts[b]`` drafts, then the target's own sample at
    that position (argmax, or the race over ``p``). Same output layout as the kernel."""
    B, K = draft_ids.shape
    a = accepts.long()
    rows = torch.arange(B, device=draft_ids.device)
    final = target_argmax[rows, a]
    if target_probs is not None:
        sampled = (target_probs[rows, a] / exp_noise).argmax(dim=1)
        final = torch.where(is_greedy, final, sampled)
    out = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.long, device=draft_ids.device)
    pos = torch.arange(K + 1, device=draft_ids.device).unsqueeze(0)
    out[:, :K] = torch.where(pos[:, :K] < a.unsqueeze(1), draft_ids, out[:, :K])
    return torch.where(pos == a.unsqueeze(1), final.unsqueeze(1), out)


class RejectionSampler:
    def __init__(self, sampler: Sampler, *, forced_acceptance: Callable[[int], int] | None = None):
        self.sampler = sampler
        self.forced_acceptance = forced_acceptance  # num drafts -> forced accepts, or None

    @torch.no_grad()
    def __call__(
        self,
        logits: torch.Tensor,
        batch: VerifyBatch,
        generators: list[torch.Generator | None],
        draft_probs: torch.Tensor | None,
    ) -> list[Verified]:
        """``logits``: ``[sum(k_i + 1), vocab]`` fp32, laid out as ``batch``; ``draft_probs``:
        ``[B, K', V]`` (``K' >= K``) over the target vocabulary, or None (one-hot drafts)."""
        B, K = len(batch.row_start), batch.K
        if B == 0:
            return []
        device = logits.device
        raw = logits[:, : self.sampler.vocab_size]
        processed = self.sampler.process(raw, batch.sampling)
        target_argmax = processed.argmax(dim=-1)[batch.position_rows]  # [B, K + 1]
        V = raw.shape[1]
        target_probs = None
        if not all(batch.greedy_list):
            flat = torch.zeros_like(processed)
            sampled_rows = [i for i, p in enumerate(batch.sampling.params) if not p.greedy]
            idx = torch.tensor(sampled_rows, device=device)
            flat[idx] = self.sampler.probs(processed[idx], [batch.sampling.params[i] for i in sampled_rows])
            target_probs = flat[batch.position_rows]  # [B, K + 1, V]
        q = None if draft_probs is None or target_probs is None else draft_probs[:, :K].float()
        # A seeded row draws exactly its own drafts' uniforms (not the batch's K): what it
        # consumes from its generator must not depend on what it is batched with.
        uniform = torch.zeros((B, K), device=device)
        unseeded = [b for b, g in enumerate(generators) if g is None]
        if unseeded and K:
            uniform[unseeded] = torch.rand((len(unseeded), K), device=device)
        for b, g in enumerate(generators):
            n = batch.num_drafts_list[b]
            if g is not None and n:
                uniform[b, :n] = torch.rand(n, generator=g, device=device)
        noise = exponential_noise(generators, V, device)

        if self.forced_acceptance is not None:
            accepts = torch.tensor([self.forced_acceptance(n) for n in batch.num_drafts_list], device=device)
            out = forced_accept(batch.draft_ids, accepts, target_probs, target_argmax, batch.is_greedy, noise)
        else:
            kernel = rejection_kernel(device.type)
            out = kernel(batch.draft_ids, batch.num_drafts, q, target_probs, target_argmax, batch.is_greedy, uniform, noise)
        emitted = [[t for t in row if t != PLACEHOLDER] for row in out.tolist()]  # the host sync
        return [
            Verified(tokens, self._logprobs(raw, batch, b, tokens), batch.num_drafts_list[b])
            for b, tokens in enumerate(emitted)
        ]

    def _logprobs(self, raw: torch.Tensor, batch: VerifyBatch, b: int, tokens: list[int]) -> list[TokenLogprob | None]:
        """Raw-distribution logprobs of the emitted tokens at their own positions."""
        params = batch.sampling.params[batch.row_start[b]]
        k = params.logprobs
        if k is None:
            return [None] * len(tokens)
        start = batch.row_start[b]
        lp = torch.log_softmax(raw[start : start + len(tokens)], dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        return [TokenLogprob(t, c, ids, vals) for t, c, ids, vals in zip(tokens, chosen, top_ids.tolist(), top_vals.tolist())]
