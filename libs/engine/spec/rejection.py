"""Verification: the target's logits at ``k + 1`` positions → the tokens a sequence emits.

A verify step's sample rows are laid out by the step builder (libs/engine/step_inputs.py):
plain decode rows first, then every position of every speculating sequence (its last
token's row and one per draft), then the prompts' rows. Each position is a sample row of
its own, so it gets its sequence's sampling parameters, logit bias and ``min_tokens`` bans
exactly as plain decoding would at that point (the builder bans stop ids while
``num_output_tokens + i < min_tokens``). What the builder cannot know is added here:

- penalties at position ``i`` count the output so far *plus* drafts ``0..i-1``;

then every row goes through the engine's own ``Sampler.process`` and ``Sampler.probs``, so
the target distribution ``p`` is what decoding without speculation samples from, and the
rejection sampler (kernels/rejection) decides. Plain rows are sampled by the same call as
in a plain step. The noise comes from each request's own generator (a seeded request's
draws do not depend on its batch) or the global one. Logprobs of the emitted tokens are the
raw model distribution at their positions, as without speculation.

The result is one token per sample row, as a plain step returns: a verify position holds
the token emitted there, or ``PLACEHOLDER`` past the sequence's emitted burst. Stops (EOS,
stop ids, ``max_tokens``) are the engine's: it appends the emitted tokens one by one and
cuts the burst at the first stop. The device state of each sequence (its last token, the
next step's input id, and its penalty counts) is updated on the device, as a plain step
does: nothing waits for the host.

``build_verify_batch`` is pure (immutable rows in, fresh tensors out) so that async prepare
can run it on the AsyncRunner's thread while the device runs the verify forward
(libs/engine/spec/verify.py).

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
from libs.engine.sampler import DeviceSamples, Sampler, SamplingTensors


@dataclass(frozen=True)
class VerifyRow:
    """One speculating sequence, snapshotted on the engine thread."""

    drafts: tuple[int, ...]
    greedy: bool
    penalized: bool  # penalties count the drafts before each position
    forced_accepts: int | None = None  # forced-acceptance mode: drafts taken as they are


@dataclass(frozen=True)
class VerifyBatch:
    """The verification's inputs on the device (``B`` sequences, ``K`` = most drafts)."""

    first_rows: torch.Tensor  # [B] int64: sample row of each sequence's position 0
    position_rows: torch.Tensor  # [B, K + 1] int64: sample row of each position (padding: position 0's)
    draft_ids: torch.Tensor  # [B, K] int64 (padding 0)
    num_drafts: torch.Tensor  # [B] int32
    is_greedy: torch.Tensor  # [B] bool
    emitted_index: torch.Tensor  # [rows] int64: flat ``[B, K + 1]`` index of each verify row
    count_rows: torch.Tensor | None  # penalties: (row, draft) pairs the row also counts
    count_cols: torch.Tensor | None
    forced_accepts: torch.Tensor | None  # [B] int64
    num_drafts_list: tuple[int, ...]
    first_rows_list: tuple[int, ...]
    K: int


def build_verify_batch(rows: tuple[VerifyRow, ...], first_row: int, device: torch.device) -> VerifyBatch:
    """Lay out the verification of ``rows``, whose positions are the sample rows from
    ``first_row`` on, sequence by sequence. Pure: reads only its arguments."""
    B = len(rows)
    K = max(len(r.drafts) for r in rows)
    first_rows, position_rows, emitted_index = [], [], []
    draft_ids = torch.zeros((B, K), dtype=torch.long)
    count_rows: list[int] = []
    count_cols: list[int] = []
    row = first_row
    for b, r in enumerate(rows):
        n = len(r.drafts)
        first_rows.append(row)
        position_rows.append([row + min(i, n) if i <= n else row for i in range(K + 1)])
        emitted_index.extend(b * (K + 1) + i for i in range(n + 1))
        draft_ids[b, :n] = torch.tensor(r.drafts, dtype=torch.long)
        if r.penalized:
            for i in range(1, n + 1):
                count_rows.extend([row + i] * i)
                count_cols.extend(r.drafts[:i])
        row += n + 1
    forced = [r.forced_accepts for r in rows]
    to = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    return VerifyBatch(
        first_rows=to(first_rows),
        position_rows=to(position_rows),
        draft_ids=draft_ids.to(device),
        num_drafts=to([len(r.drafts) for r in rows], torch.int32),
        is_greedy=to([r.greedy for r in rows], torch.bool),
        emitted_index=to(emitted_index),
        count_rows=to(count_rows) if count_rows else None,
        count_cols=to(count_cols) if count_cols else None,
        forced_accepts=None if forced[0] is None else to(forced),
        num_drafts_list=tuple(len(r.drafts) for r in rows),
        first_rows_list=tuple(first_rows),
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


def verify_sample(
    sampler: Sampler,
    state,
    logits: torch.Tensor,
    st: SamplingTensors,
    slots: torch.Tensor,
    *,
    first_row: int,
    num_rows: int,
    batch: VerifyBatch | None,
    draft_probs: torch.Tensor | None,
    generators: list[torch.Generator | None],
) -> DeviceSamples:
    """Sample a verify step's rows (``[first_row, first_row + num_rows)`` are the
    speculating sequences' positions) and update the slots' device state. ``batch`` None:
    the verification's inputs could not be built; those rows get ``PLACEHOLDER`` and the
    plain rows are sampled as usual. ``state``: the runner's ``SlotState``."""
    raw = logits[:, : sampler.vocab_size]
    S, device = raw.shape[0], raw.device
    lo, hi = first_row, first_row + num_rows
    plain = torch.cat([torch.arange(lo, device=device), torch.arange(hi, S, device=device)])
    # Seeded sequences draw from their own generators: plain rows per row, a verifying
    # sequence once per round (its recovered or bonus token's noise, below).
    gens = [(i, g) for i, g in st.generators if not lo <= i < hi]
    if batch is not None:
        gens += [(batch.first_rows_list[b], g) for b, g in enumerate(generators) if g is not None]
        if st.counts is not None and batch.count_rows is not None:
            w = torch.ones(batch.count_rows.shape[0], dtype=st.counts.dtype, device=device)
            st.counts = st.counts.index_put((batch.count_rows, batch.count_cols), w, accumulate=True)
    st.generators = gens
    processed = sampler.process(raw, st)
    probs = None if st.all_greedy else sampler.probs(processed, st)
    noise = None if probs is None else sampler.noise(probs, st)
    tokens = sampler.pick(processed, st, probs, noise)
    if batch is None:
        tokens[lo:hi] = PLACEHOLDER
        state.record(slots[plain], tokens[plain])
        return DeviceSamples(tokens, sampler.logprobs(raw, tokens.clamp(min=0), st))

    B, K = batch.draft_ids.shape
    pr = batch.position_rows
    target_argmax = (tokens if st.all_greedy else processed.argmax(dim=-1))[pr]
    target_probs = None if probs is None else probs[pr]
    exp_noise = noise.index_select(0, batch.first_rows) if noise is not None else torch.ones((B, 1), device=device)
    if batch.forced_accepts is not None:
        out = forced_accept(batch.draft_ids, batch.forced_accepts, target_probs, target_argmax, batch.is_greedy, exp_noise)
    else:
        # A seeded sequence draws exactly its own drafts' uniforms (not the batch's K):
        # what it consumes from its generator must not depend on what it is batched with.
        uniform = torch.zeros((B, K), device=device)
        unseeded = [b for b, g in enumerate(generators) if g is None]
        if unseeded and target_probs is not None:
            uniform[unseeded] = torch.rand((len(unseeded), K), device=device)
        for b, g in enumerate(generators):
            n = batch.num_drafts_list[b]
            if g is not None and n:
                uniform[b, :n] = torch.rand(n, generator=g, device=device)
        q = None if draft_probs is None or target_probs is None else draft_probs[:, :K].float()
        out = rejection_kernel(device.type)(batch.draft_ids, batch.num_drafts, q, target_probs, target_argmax, batch.is_greedy, uniform, exp_noise)
    tokens[lo:hi] = out.reshape(-1).index_select(0, batch.emitted_index)
    # Device state: plain rows as a plain step; a verifying sequence's last emitted token
    # is its next input id, and every emitted token counts for its penalties.
    state.record(slots[plain], tokens[plain])
    last = out.gather(1, ((out != PLACEHOLDER).sum(dim=1, keepdim=True) - 1)).squeeze(1)
    state.last_sampled.index_copy_(0, slots.index_select(0, batch.first_rows), last)
    emitted = tokens[lo:hi]
    state.count(slots[lo:hi], emitted.clamp(min=0), (emitted != PLACEHOLDER).to(torch.float32))
    return DeviceSamples(tokens, sampler.logprobs(raw, tokens.clamp(min=0), st))
