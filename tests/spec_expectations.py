"""What speculative decoding must report, computed without the engine's speculation: the
known-acceptance workloads of the spec tests.

- ``expected_ngram``: greedy n-gram speculation accepts a draft token exactly when it equals
  the token plain greedy decoding produces there, so replaying the n-gram lookup over the
  plain engine's output gives every round's drafts and acceptances.
- ``expected_forced``: forced acceptance accepts ``round(r * k_i)`` of every round's
  ``k_i`` drafts whatever they are, and ``k_i`` only depends on how many tokens are left.

Both follow the engine's rule for ``k_i`` (libs/engine/spec/verify.py ``max_drafts``): a
burst (drafts + 1) never passes ``max_tokens``. Outputs must run to ``max_tokens``
(``ignore_eos``) so no round is cut by a stop the replay cannot see past.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from libs.engine.spec.ngram import ngram_lookup


def _counts(k: int) -> dict:
    return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [0] * k, "rounds": 0, "plain_steps": 0}


def _observe(c: dict, n: int, a: int) -> None:
    c["num_drafts"] += 1
    c["num_draft_tokens"] += n
    c["num_accepted_tokens"] += a
    for i in range(a):
        c["num_accepted_tokens_per_pos"][i] += 1


def expected_ngram(prompt: list[int], output: list[int], *, k: int, min_n: int, max_n: int, max_tokens: int) -> dict:
    assert len(output) == max_tokens, "the reference must run to max_tokens"
    c = _counts(k)
    n_out = 1  # the first token comes from the prompt's step, which never speculates
    while n_out < len(output):
        k_i = min(k, max_tokens - n_out - 1)
        d = ngram_lookup(np.asarray(prompt + output[:n_out], dtype=np.int64), min_n, max_n, k_i) if k_i >= 1 else []
        a = 0
        while a < len(d) and d[a] == output[n_out + a]:
            a += 1
        if d:
            _observe(c, len(d), a)
            c["rounds"] += 1
        n_out += a + 1
    return c


def expected_rounds(max_tokens: int, *, k: int, accepts: Callable[[int], int]) -> dict:
    """A proposer that always drafts (model-based), with ``accepts(k_i)`` accepted a round."""
    c = _counts(k)
    n_out = 1
    while n_out < max_tokens:
        k_i = min(k, max_tokens - n_out - 1)
        if k_i < 1:  # no room for a draft: a plain step
            c["plain_steps"] += 1
            n_out += 1
            continue
        a = accepts(k_i)
        _observe(c, k_i, a)
        c["rounds"] += 1
        n_out += a + 1
    return c


def expected_forced(max_tokens: int, *, k: int, rate: float) -> dict:
    return expected_rounds(max_tokens, k=k, accepts=lambda n: min(n, int(math.floor(rate * n + 0.5))))


def metrics_match(snapshot: dict, expected: dict) -> bool:
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    return all(snapshot[key] == expected[key] for key in keys)
