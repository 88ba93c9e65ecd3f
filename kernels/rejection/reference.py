"""Torch reference of the rejection sampler: the CPU path and the Triton kernel's oracle.

Shapes (``kernels/rejection/triton_rejection.py`` has the same signature):

- ``draft_token_ids``: ``[B, K]`` int64, target-vocabulary ids; entries at or past a row's
  ``num_draft_tokens`` are ignored (any value);
- ``num_draft_tokens``: ``[B]`` int, ``0..K`` (a row with 0 drafts just samples one token);
- ``draft_probs``: ``[B, K, V]`` float32 ``q`` over the target vocabulary, or ``None``
  (deterministic drafts: ``q`` is one-hot at the draft);
- ``target_probs``: ``[B, K + 1, V]`` float32 ``p``; may be ``None`` if every row is greedy
  (greedy rows never read it);
- ``target_argmax``: ``[B, K + 1]`` int64, the greedy choice at each position (computed by
  the caller from the processed logits, so it is exactly decoding's own argmax);
- ``is_greedy``: ``[B]`` bool;
- ``uniform``: ``[B, K]`` float32 in ``[0, 1)``; ``exp_noise``: ``[B, V]`` float32 ``Exp(1)``.

Returns ``[B, K + 1]`` int64: the emitted tokens of each row (accepted drafts, then the
recovered or bonus token), ``PLACEHOLDER`` after them. A row emits between 1 and
``num_draft_tokens + 1`` tokens.
"""

from __future__ import annotations

import torch

PLACEHOLDER = -1


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform: torch.Tensor,
    exp_noise: torch.Tensor,
) -> torch.Tensor:
    """Emitted tokens ``[B, K + 1]`` (see the module docstring)."""
    B, K = draft_token_ids.shape
    device = draft_token_ids.device
    n = num_draft_tokens.to(device=device, dtype=torch.long)
    pos = torch.arange(K, device=device)
    valid = pos.unsqueeze(0) < n.unsqueeze(1)  # [B, K]
    greedy = is_greedy.to(device=device, dtype=torch.bool)
    drafts = draft_token_ids.long().clamp(min=0)

    ok = drafts == target_argmax[:, :K]
    if target_probs is not None and not bool(greedy.all()):
        p_d = target_probs[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2)
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        # ``p / q >= u`` with ``q > 0``: accept with probability min(1, p / q).
        accept = (q_d > 0) & (p_d / torch.where(q_d > 0, q_d, torch.ones_like(q_d)) >= uniform)
        ok = torch.where(greedy.unsqueeze(1), ok, accept)
    elif not bool(greedy.all()):
        raise ValueError("target_probs is required when any row samples")
    rejected = valid & ~ok
    # First rejected position, or n when every draft was accepted.
    if K:
        first = torch.where(rejected, pos.unsqueeze(0), torch.full_like(pos, K).unsqueeze(0)).min(dim=1).values
    else:
        first = torch.zeros(B, dtype=torch.long, device=device)
    a = torch.minimum(first, n)  # [B] accepted drafts

    rows = torch.arange(B, device=device)
    final = target_argmax[rows, a].clone()
    if target_probs is not None and not bool(greedy.all()):
        p_row = target_probs[rows, a]  # [B, V]
        rejected_row = a < n
        if draft_probs is None:
            d_a = drafts[rows, a.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(a)
            q_row = torch.zeros_like(p_row)
            q_row[rows, d_a] = 1.0
        else:
            q_row = draft_probs[rows, a.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_row)
        q_row = torch.where(rejected_row.unsqueeze(1), q_row, torch.zeros_like(q_row))  # bonus: plain p
        w = torch.clamp(p_row - q_row, min=0.0) / exp_noise
        final = torch.where(greedy, final, w.argmax(dim=1))

    out = torch.full((B, K + 1), PLACEHOLDER, dtype=torch.long, device=device)
    full_pos = torch.arange(K + 1, device=device).unsqueeze(0)
    out[:, :K] = torch.where(pos.unsqueeze(0) < a.unsqueeze(1), drafts, out[:, :K])
    out = torch.where(full_pos == a.unsqueeze(1), final.unsqueeze(1), out)
    return out
