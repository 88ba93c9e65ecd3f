"""Acceptance counters of speculative decoding, with vLLM's names.

- ``num_drafts``: verification rounds that had at least one draft token (one per sequence
  per step);
- ``num_draft_tokens``: draft tokens verified;
- ``num_accepted_tokens``: draft tokens the rejection sampler accepted;
- ``num_accepted_tokens_per_pos[i]``: rounds whose draft at position ``i`` was accepted
  (position 0 is the first draft), so ``per_pos[i] / num_drafts`` is the acceptance rate
  at depth ``i``;
- ``mean_acceptance_length``: ``1 + num_accepted_tokens / num_drafts``, the tokens a
  speculating sequence emits per step (vLLM's headline figure).

Seed 001 reported an acceptance total that was never assigned, so every figure built on it
read zero. Here there is one entry point, ``observe``, called with the sampler's own
per-sequence result on every verification, and the tests pin each counter to a workload
whose acceptance is known exactly (forced acceptance, a prompt that repeats itself).

Accepted counts are the sampler's decision; a stop token or ``max_tokens`` may cut the
emitted burst shorter afterwards (vLLM counts the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One sequence's verification round: ``num_draft_tokens`` drafts, of which the first
        ``num_accepted_tokens`` were accepted."""
        if num_draft_tokens <= 0:
            return
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} drafts")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def snapshot(self) -> dict:
        """A plain, independent copy (read from other threads: /stats, metrics, --json)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
        }
