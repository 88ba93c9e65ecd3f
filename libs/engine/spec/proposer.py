"""What every proposer takes and returns.

A proposer looks at running sequences and guesses their next tokens. It never changes a
sequence; it returns, per request, up to ``max_drafts`` draft token ids in the *target's*
vocabulary and, for proposers that sample their drafts, the probabilities ``q`` they drew
them from, also over the target's vocabulary (a pruned draft vocabulary is mapped back by
the proposer itself, libs/engine/spec/vocab.py, so everything downstream sees one
vocabulary). Deterministic proposers (n-gram lookup, greedy drafting) return ``q = None``:
one-hot at the draft, which is what the rejection sampler assumes then.

A failure that concerns one sequence is reported in ``errors`` (that request fails, the
rest go on); a failure of the whole batch is an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from libs.engine.sequence import Sequence


@dataclass(frozen=True)
class DraftRequest:
    seq: Sequence
    max_drafts: int  # >= 1; the burst after these must still fit max_tokens and the context


@dataclass
class Drafts:
    token_ids: list[list[int]]  # one list per request, at most its max_drafts long
    probs: torch.Tensor | None = None  # [B, K, V] float32 over the target vocabulary, or None
    errors: dict[int, BaseException] = field(default_factory=dict)  # request index -> error


class Proposer(Protocol):
    name: str

    def propose(self, requests: list[DraftRequest]) -> Drafts: ...

    def forget(self, seq_id: int) -> None:
        """The sequence finished or lost its blocks (preempted): drop per-sequence state."""
        ...
