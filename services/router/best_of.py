"""``best_of`` on completions: of ``best_of`` completions generated per prompt, the ``n``
with the highest cumulative logprob are returned.

The semantics are OpenAI's (and vLLM's v0 engine, which implemented them):

- A candidate's cumulative logprob is the sum of its sampled tokens' log-probabilities,
  over the tokens the choice returns (a stop string's cut ends the sum where it ends the
  text). Those are the log-probabilities ``logprobs`` reports: the model's distribution
  before penalties, bias and temperature (libs/engine/sampler.py), so the ranking says
  how likely the model found each text, not how the sampler was tuned. The router asks
  the instances for the sampled token's logprob (``logprobs: 0`` on the wire,
  ``GenerateRequest.wire_logprobs``) whenever ``best_of > n``, so ranking never depends
  on whether the client asked for logprobs; they are shown only if it did.
- The ``n`` best, highest first, become choices ``p * n + rank`` of prompt ``p``; equal
  sums keep generation order, so the result is deterministic.
- It is not streamable when ``best_of > n``: the best are known only once every candidate
  has finished (a 400, as OpenAI answers; api.py). ``best_of == n`` is plain ``n``.
- ``usage.completion_tokens`` counts every token of every candidate, the discarded ones
  included: they were generated, and OpenAI bills them ("generates best_of completions
  server-side ... can quickly consume your token quota"). vLLM's server differs here: it
  sums only the outputs it returns.
"""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class Candidate(Protocol):
    @property
    def cumulative_logprob(self) -> float: ...


C = TypeVar("C", bound=Candidate)


def best(candidates: Sequence[C], n: int) -> list[C]:
    """The ``n`` candidates with the highest cumulative logprob, highest first (stable)."""
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i].cumulative_logprob, i))
    return [candidates[i] for i in order[:n]]


def select(candidates: Sequence[C], num_prompts: int, best_of: int, n: int) -> list[C]:
    """Every prompt's ``n`` best of its ``best_of`` candidates (``p * best_of + i``), in
    output order: prompt by prompt, best first."""
    if len(candidates) != num_prompts * best_of or not 1 <= n <= best_of:
        raise ValueError(f"{len(candidates)} candidates for {num_prompts} prompts x best_of={best_of}, n={n}")
    return [c for p in range(num_prompts) for c in best(candidates[p * best_of : (p + 1) * best_of], n)]
