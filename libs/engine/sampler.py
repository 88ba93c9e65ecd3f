"""Turning logits into tokens: penalties, logit bias, grammar masks, temperature, top-k /
top-p / min-p, seeds, logprobs.

Order of the logits processing: penalties, ``logit_bias`` (OpenAI: added to the logits;
-100 bans), ``min_tokens`` bans, then the grammar bitmask of constrained rows
(libs/engine/structured). The grammar has the last word: if a row's bias and bans leave no
token the grammar allows, the row falls back to the grammar's mask over the raw logits,
so a constrained row always samples a token that follows its grammar.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws
exactly from ``p`` and lets each row use its own generator: a seeded request draws its
noise from a generator seeded with its seed, so its tokens do not depend on what else is
in the batch. Only the sampled ids and the top-k logprobs (k <= 20) leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.select import bitmask_op
from libs.engine.params import SamplingParams
from libs.engine.sequence import TokenLogprob


@dataclass
class SamplingBatch:
    """One row per sample to draw (a forked request contributes several rows)."""

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

    tokens: torch.Tensor  # [rows] int64
    logprobs: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, chosen, top vals, top ids
    want: list[int | None]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._apply_bitmask = bitmask_op(device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.collect(self.sample(logits, batch))

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> DeviceSamples:
        """Launch sampling; nothing is read back. ``logits``: fp32 ``[rows, vocab]``."""
        logits = logits[:, : self.vocab_size]
        params = batch.params
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        raw = logits

        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), batch)
        if any(p.logit_bias for p in params):
            logits = self._bias(logits if logits is not raw else logits.clone(), params)
        if batch.banned_ids is not None and any(batch.banned_ids):
            logits = self._ban(logits, batch.banned_ids)
        if batch.bitmask is not None and batch.bitmask_rows:
            processed = logits is not raw  # bias and bans may have removed every allowed token
            logits = self._constrain(logits if processed else logits.clone(), raw if processed else None, batch)

        greedy = [i for i, p in enumerate(params) if p.greedy]
        random = [i for i, p in enumerate(params) if not p.greedy]
        if not random:
            tokens = logits.argmax(dim=-1)
        elif not greedy:
            tokens = self._sample(logits, params, batch.generators)
        else:
            tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
            g_idx = torch.tensor(greedy, device=logits.device)
            r_idx = torch.tensor(random, device=logits.device)
            tokens[g_idx] = logits[g_idx].argmax(dim=-1)
            tokens[r_idx] = self._sample(logits[r_idx], [params[i] for i in random], [batch.generators[i] for i in random])
        return DeviceSamples(tokens, self._logprob_tensors(raw_logprobs, tokens, want_logprobs), want_logprobs)

    def collect(self, ds: DeviceSamples) -> SamplerOutput:
        """Read the samples back: the one host sync of a step."""
        token_list = ds.tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(ds, token_list))

    def _ban(self, logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
        """Mask each row's banned ids to -inf; the rest of the row stays finite, so every
        row still has tokens to sample."""
        pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < logits.shape[1]]
        if not pairs:
            return logits
        rows, cols = zip(*pairs)
        logits = logits.clone()
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits

    def _bias(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """OpenAI's ``logit_bias``, in place: added to the logits, -100 bans outright."""
        V = logits.shape[1]
        add = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < V and b > -100]
        ban = [(i, t) for i, p in enumerate(params) for t, b in p.logit_bias if t < V and b <= -100]
        dev = logits.device
        if add:
            rows, cols, vals = zip(*add)
            idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
            logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
        if ban:
            rows, cols = zip(*ban)
            logits[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = float("-inf")
        return logits

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor | None, batch: SamplingBatch) -> torch.Tensor:
        """Apply the grammar bitmasks to their rows, in place; a row left with no token at
        all (its bias or bans removed every token the grammar allows) takes the grammar's
        mask over its raw logits instead."""
        assert batch.bitmask is not None and batch.bitmask_rows is not None
        dev = logits.device
        bitmask = batch.bitmask.to(dev, non_blocking=True)
        rows = torch.tensor(batch.bitmask_rows, dtype=torch.long, device=dev)
        self._apply_bitmask(logits, bitmask, rows)
        if raw is None:
            return logits
        # Without a host sync: every constrained row also gets the grammar-only version.
        local = torch.arange(len(batch.bitmask_rows), device=dev)
        fresh = self._apply_bitmask(raw.index_select(0, rows), bitmask, local)
        sub = logits.index_select(0, rows)
        dead = (sub.amax(dim=-1) == float("-inf")).unsqueeze(1)
        logits.index_copy_(0, rows, torch.where(dead, fresh, sub))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Repetition (HF/vLLM: over prompt and output), presence and frequency (OpenAI:
        over the output) penalties, only on rows that ask for them."""
        V = logits.shape[1]
        for i, p in enumerate(batch.params):
            if not p.has_penalties:
                continue
            out_ids = torch.tensor(batch.output_ids[i], dtype=torch.long, device=logits.device)
            counts = torch.bincount(out_ids[out_ids < V], minlength=V).to(logits.dtype)
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(batch.prompt_ids[i], dtype=torch.long, device=logits.device)
                seen[prompt[prompt < V]] = True
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(seen, penalized, row)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
            logits[i] = row
        return logits

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temps.unsqueeze(1)
        logits = self._filter(logits, params)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    def _filter(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask tokens outside top-k, outside the top-p nucleus and below min-p to -inf.
        The most likely token always survives every filter."""
        neg_inf = torch.finfo(logits.dtype).min
        if any(p.min_p > 0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, neg_inf)
        need_k = any(p.top_k > 0 for p in params)
        need_p = any(p.top_p < 1 for p in params)
        if not (need_k or need_p):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[1]
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=logits.device)
            ranks = torch.arange(V, device=logits.device).unsqueeze(0)
            mask |= ranks >= k.unsqueeze(1)
        if need_p:
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
            probs_sorted = torch.softmax(sorted_logits.masked_fill(mask, neg_inf), dim=-1)
            before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass strictly above each token
            mask |= before >= top_p.unsqueeze(1)
        mask[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(mask, neg_inf)
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _logprob_tensors(self, raw: torch.Tensor | None, tokens: torch.Tensor, want: list[int | None]):
        """Only what leaves the device: the chosen token's logprob and the top k (k <= 20)."""
        if raw is None:
            return None
        rows = [i for i, k in enumerate(want) if k is not None]
        sub = raw[torch.tensor(rows, device=raw.device)]
        chosen = sub.gather(1, tokens[torch.tensor(rows, device=raw.device)].unsqueeze(1)).squeeze(1)
        k = max(want[i] for i in rows)
        top_vals, top_ids = sub.topk(k, dim=-1) if k > 0 else (sub[:, :0], sub[:, :0].long())
        return rows, chosen, top_vals, top_ids

    def _logprobs(self, ds: DeviceSamples, token_list: list[int]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(ds.want)
        if ds.logprobs is None:
            return out
        rows, chosen, top_vals, top_ids = ds.logprobs
        chosen_l, vals_l, ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            ki = ds.want[i]
            out[i] = TokenLogprob(token_list[i], chosen_l[j], ids_l[j][:ki], vals_l[j][:ki])
        return out
