"""Turning logits into tokens: penalties, logit bias, grammar masks, temperature, top-k /
top-p / min-p, seeds, logprobs.

A step's sampling is a fixed handful of batched tensor ops over ``[rows, vocab]``, driven
by per-row parameter tensors (``SamplingTensors``), whatever mix of requests the batch
holds: no per-row Python, no host syncs, nothing read back but the ids (and the top-k
logprobs, k <= 20). Optional stages (penalties, min-p, top-k, top-p, the min_tokens ban,
logprobs) run only when some row needs them; a row that does not is left exactly as it
was by each of them (a penalty of 0 subtracts 0, a repetition penalty of 1 divides by 1).

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws
exactly from ``p`` and lets each row use its own generator: a seeded request draws its
noise from a generator seeded with its seed, so its tokens do not depend on what else is
in the batch. Seeded rows are the one per-row loop (one ``exponential_`` each): torch has
no batched per-row generator.

Order of the logits processing: penalties, ``logit_bias`` (OpenAI: added to the logits;
-100 bans), ``min_tokens`` bans, then the grammar bitmask of constrained rows
(libs/structured). The grammar has the last word: if a row's bias and bans leave no token
the grammar allows, the row falls back to the grammar's mask over the raw logits, so a
constrained row always samples a token that follows its grammar. Bias and bans come as
``(row, token)`` lists of the rows that have them, the bitmask as one packed row per
constrained row: what they cost grows with what they touch, not with the batch.
Speculative decoding samples ``k + 1`` rows per sequence through the same function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.argmax import argmax_op
from kernels.select import bitmask_op
from libs.engine.params import SamplingParams
from libs.engine.sequence import TokenLogprob

_GREEDY_TEMPERATURE = 1e-5  # SamplingParams.greedy's threshold


@dataclass
class SamplingTensors:
    """One step's per-row sampling parameters, on the logits' device (``rows`` = S)."""

    temperature: torch.Tensor  # [S] float32, raw (greedy rows below 1e-5)
    top_p: torch.Tensor  # [S] float32
    top_k: torch.Tensor  # [S] int64, 0 = off
    min_p: torch.Tensor  # [S] float32
    presence: torch.Tensor  # [S] float32
    frequency: torch.Tensor  # [S] float32
    repetition: torch.Tensor  # [S] float32
    # Host-side facts about the rows, so absent stages cost nothing.
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    any_repetition: bool
    counts: torch.Tensor | None = None  # [S, V] float32: output token counts (penalties)
    prompt_seen: torch.Tensor | None = None  # [S, V] bool: prompt tokens (repetition)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values) added
    ban: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) that may not be sampled
    bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32: the grammar masks of ...
    bitmask_rows: torch.Tensor | None = None  # [R] int64: ... these rows
    generators: list[tuple[int, torch.Generator]] = field(default_factory=list)  # seeded rows
    logprob_rows: torch.Tensor | None = None  # [L] int64: rows that want logprobs
    max_logprobs: int = 0

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        device: torch.device,
        vocab_size: int,
        *,
        generators: list[torch.Generator | None] | None = None,
        prompt_ids: list[list[int]] | None = None,
        output_ids: list[list[int]] | None = None,
        banned_ids: list[list[int]] | None = None,
        bitmask: torch.Tensor | None = None,
        bitmask_rows: list[int] | None = None,
    ) -> "SamplingTensors":
        """Tensors for a list of rows (tests, tools). The engine builds the same tensors
        from its persistent batch instead (libs/engine/step_inputs.py)."""
        f32 = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
        S, V = len(params), vocab_size
        greedy = [p.greedy for p in params]
        st = cls(
            temperature=f32([p.temperature for p in params]),
            top_p=f32([p.top_p for p in params]),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            min_p=f32([p.min_p for p in params]),
            presence=f32([p.presence_penalty for p in params]),
            frequency=f32([p.frequency_penalty for p in params]),
            repetition=f32([p.repetition_penalty for p in params]),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_penalties=any(p.has_penalties for p in params),
            any_repetition=any(p.repetition_penalty != 1 for p in params),
        )
        if st.any_penalties:
            st.counts = torch.zeros(S, V, dtype=torch.float32, device=device)
            st.prompt_seen = torch.zeros(S, V, dtype=torch.bool, device=device)
            for i in range(S):
                out = [t for t in (output_ids or [[]] * S)[i] if 0 <= t < V]
                if out:
                    st.counts[i].index_add_(0, torch.tensor(out, device=device), torch.ones(len(out), device=device))
                pr = [t for t in (prompt_ids or [[]] * S)[i] if 0 <= t < V]
                if pr:
                    st.prompt_seen[i, torch.tensor(pr, device=device)] = True
        adds, bans = bias_and_bans(params, V)
        bans += [(i, t) for i, ids in enumerate(banned_ids or []) for t in ids if 0 <= t < V]
        if adds:
            rows, cols, vals = zip(*adds)
            st.bias = (torch.tensor(rows, device=device), torch.tensor(cols, device=device), f32(vals))
        if bans:
            rows, cols = zip(*bans)
            st.ban = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        if bitmask is not None and bitmask_rows:
            st.bitmask = bitmask.to(device)
            st.bitmask_rows = torch.tensor(bitmask_rows, dtype=torch.long, device=device)
        st.generators = [(i, g) for i, g in enumerate(generators or []) if g is not None]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            st.logprob_rows = torch.tensor(want, dtype=torch.long, device=device)
            st.max_logprobs = max(params[i].logprobs for i in want)
        return st


@dataclass
class SamplingBatch:
    """One row per sample to draw, as lists (the ``Sampler.__call__`` convenience API)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_ids: list[list[int]]  # for the repetition penalty
    output_ids: list[list[int]]  # for presence / frequency penalties
    banned_ids: list[list[int]] | None = None  # per row, ids that may not be sampled (min_tokens)
    bitmask: torch.Tensor | None = None  # [len(bitmask_rows), words] int32 on the host: grammar masks
    bitmask_rows: list[int] | None = None  # the constrained rows, in bitmask order


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class DeviceSamples:
    """Sampled tokens (and logprob tensors) still on the device: the next step may feed
    ``tokens`` straight back as its input ids before the host has read them."""

    tokens: torch.Tensor  # [S] int64
    # (chosen token's logprob [L], top values [L, k], top ids [L, k]) for the logprob rows
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._apply_bitmask = bitmask_op(device)
        self._argmax = argmax_op(device)  # one launch over many SMs on CUDA (kernels/argmax)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample a list batch and read the results back (tests, tools)."""
        st = SamplingTensors.from_params(
            batch.params, logits.device, min(logits.shape[1], self.vocab_size), generators=batch.generators,
            prompt_ids=batch.prompt_ids, output_ids=batch.output_ids, banned_ids=batch.banned_ids,
            bitmask=batch.bitmask, bitmask_rows=batch.bitmask_rows,
        )
        ds = self.sample(logits, st)
        tokens = ds.tokens.tolist()
        want = [p.logprobs for p in batch.params]
        rows = [i for i, k in enumerate(want) if k is not None]
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if ds.logprobs is not None:
            for j, lp in enumerate(logprob_lists(ds.logprobs, [tokens[i] for i in rows], [want[i] for i in rows])):
                out[rows[j]] = lp
        return SamplerOutput(tokens, out)

    def sample(self, logits: torch.Tensor, st: SamplingTensors, *, greedy: torch.Tensor | None = None) -> DeviceSamples:
        """Launch sampling; nothing is read back. ``logits``: fp32 ``[S, vocab]``. Call under
        ``torch.inference_mode()`` (the runner's step is). ``greedy``: ``self.greedy(logits)``
        computed already (a decode CUDA graph's), used where no processing changes the
        logits."""
        raw = logits[:, : self.vocab_size]  # logprobs are the raw model distribution, before any processing
        processed = self.process(raw, st)
        tokens = self.pick(processed, st, greedy=greedy if processed is raw else None)
        return DeviceSamples(tokens, self.logprobs(raw, tokens, st))

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the vocabulary of unprocessed ``logits``: what ``pick``
        takes on a greedy row when nothing processes them (a decode graph computes it)."""
        return self._argmax(logits[:, : self.vocab_size])

    def process(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Penalties, logit bias, bans and grammar masks: the logits greedy rows take the
        argmax of and sampled rows draw from. Speculative verification (libs/engine/spec)
        processes every position through here, so its target distribution is this one.
        ``logits`` itself is never modified."""
        raw = logits
        if st.any_penalties:
            logits = apply_penalties(logits, st)
        if st.bias is not None:
            rows, cols, vals = st.bias
            logits = (logits.clone() if logits is raw else logits).index_put_((rows, cols), vals, accumulate=True)
        if st.ban is not None:
            logits = logits.index_put(st.ban, torch.tensor(float("-inf"), device=logits.device))
        if st.bitmask is not None:
            processed = logits is not raw  # bias and bans may have removed every allowed token
            logits = self._constrain(logits if processed else logits.clone(), raw if processed else None, st)
        return logits

    def pick(
        self, logits: torch.Tensor, st: SamplingTensors, probs: torch.Tensor | None = None, noise: torch.Tensor | None = None,
        greedy: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row of processed ``logits``: the argmax on greedy rows (``greedy``
        if given: that argmax, computed already), the exponential race over ``probs``
        (default ``self.probs``) with ``noise`` (default ``self.noise``) on the others."""
        greedy_tokens = (self._argmax(logits) if greedy is None else greedy) if st.any_greedy else None
        if st.all_greedy:
            return greedy_tokens
        probs = self.probs(logits, st) if probs is None else probs
        noise = self.noise(probs, st) if noise is None else noise
        tokens = self._argmax(probs / noise)
        if greedy_tokens is not None:
            tokens = torch.where(st.temperature < _GREEDY_TEMPERATURE, greedy_tokens, tokens)
        return tokens

    def probs(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """What a sampled row draws from: temperature, then top-k / top-p / min-p, softmax.
        (Greedy rows get temperature 1 here, so their math stays finite; they never draw.)"""
        temps = st.temperature
        if st.any_greedy:
            temps = torch.where(temps < _GREEDY_TEMPERATURE, torch.ones_like(temps), temps)
        return torch.softmax(self._filter(logits / temps.unsqueeze(1), st), dim=-1)

    @staticmethod
    def noise(like: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """``Exp(1)`` draws shaped like ``like``; a seeded row's from its own generator, so
        what it draws does not depend on its batch."""
        noise = torch.empty_like(like)
        if len(st.generators) < like.shape[0]:
            noise.exponential_()
        for i, g in st.generators:
            noise[i].exponential_(generator=g)
        return noise

    @staticmethod
    def logprobs(raw: torch.Tensor, tokens: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The chosen tokens' logprobs and the top ``max_logprobs`` of the raw distribution,
        for the rows that asked (``tokens`` must be valid ids on those rows)."""
        if st.logprob_rows is None:
            return None
        sub = torch.log_softmax(raw.index_select(0, st.logprob_rows), dim=-1)
        chosen = sub.gather(1, tokens.index_select(0, st.logprob_rows).unsqueeze(1)).squeeze(1)
        top_vals, top_ids = sub.topk(st.max_logprobs, dim=-1) if st.max_logprobs > 0 else (sub[:, :0], sub[:, :0].long())
        return chosen, top_vals, top_ids

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor | None, st: SamplingTensors) -> torch.Tensor:
        """Apply the grammar bitmasks to their rows, in place; a row left with no token at
        all (its bias or bans removed every token the grammar allows) takes the grammar's
        mask over its raw logits instead (without a host sync)."""
        rows, bitmask = st.bitmask_rows, st.bitmask
        self._apply_bitmask(logits, bitmask, rows)
        if raw is None:
            return logits
        local = torch.arange(rows.shape[0], device=logits.device)
        fresh = self._apply_bitmask(raw.index_select(0, rows), bitmask, local)
        sub = logits.index_select(0, rows)
        dead = (sub.amax(dim=-1) == float("-inf")).unsqueeze(1)
        logits.index_copy_(0, rows, torch.where(dead, fresh, sub))
        return logits

    def _filter(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Mask tokens outside top-k, outside the top-p nucleus and below min-p to -inf.
        The most likely token always survives every filter."""
        neg_inf = torch.finfo(logits.dtype).min
        if st.any_min_p:
            probs = torch.softmax(logits, dim=-1)
            threshold = st.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, neg_inf)
        if not (st.any_top_k or st.any_top_p):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[1]
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if st.any_top_k:
            k = torch.where(st.top_k > 0, st.top_k, V)
            mask |= torch.arange(V, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
        if st.any_top_p:
            probs_sorted = torch.softmax(sorted_logits.masked_fill(mask, neg_inf), dim=-1)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly above each token
            # Rows with top_p = 1 keep everything (a cumulative sum that rounds to 1 must
            # not cut their tail).
            mask |= (before >= st.top_p.unsqueeze(1)) & (st.top_p < 1).unsqueeze(1)
        mask[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(mask, neg_inf)
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Repetition (HF/vLLM: over prompt and output; positive logits divided, negative
    multiplied), then presence and frequency (OpenAI: over the output), on every row at
    once: a row without penalties passes through unchanged."""
    counts = st.counts
    assert counts is not None
    if st.any_repetition:
        seen = counts > 0
        if st.prompt_seen is not None:
            seen |= st.prompt_seen
        rep = st.repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - st.frequency.unsqueeze(1) * counts - st.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def bias_and_bans(params: list[SamplingParams], vocab_size: int) -> tuple[list[tuple[int, int, float]], list[tuple[int, int]]]:
    """Rows' ``logit_bias`` as ``(row, token, value)`` additions and ``(row, token)`` bans
    (a bias of -100 bans outright, as OpenAI defines it)."""
    adds = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab_size and b > -100]
    bans = [(i, t) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab_size and b <= -100]
    return adds, bans


def logprob_lists(lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """``TokenLogprob``s from logprob tensors already on the host, one per logprob row."""
    chosen, vals, ids = lp
    chosen_l, vals_l, ids_l = chosen.tolist(), vals.tolist(), ids.tolist()
    return [TokenLogprob(t, c, i[:k], v[:k]) for t, c, i, v, k in zip(tokens, chosen_l, ids_l, vals_l, ks)]
