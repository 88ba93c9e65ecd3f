"""Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method): drafts copied from the text.

When a model is copying (editing code, extracting from a document, quoting the prompt),
its next tokens already appear earlier in the sequence. The proposer takes the last ``n``
tokens of prompt + output, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, finds their most recent earlier occurrence, and proposes the tokens
that followed it. No model runs, so a miss costs nothing but the lookup (a vectorised
comparison over the sequence with numpy, microseconds for thousands of tokens).

Drafts are deterministic, so ``q`` is one-hot (``probs`` is None) and the rejection
sampler accepts a draft ``d`` with probability ``p(d)`` on sampled rows.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from libs.engine.spec.proposer import DraftRequest, Drafts


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` of length in ``[min_n, max_n]``; empty when none recurs."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        # Windows starting at 0 .. L - n - 1: every earlier occurrence, not the suffix itself.
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> Drafts:
        drafts: list[list[int]] = []
        errors: dict[int, BaseException] = {}
        for i, req in enumerate(requests):
            try:
                drafts.append(self.lookup(req.seq.token_ids, req.max_drafts))
            except Exception as e:  # noqa: BLE001 - that request fails, the batch goes on
                errors[i] = e
                drafts.append([])
        return Drafts(drafts, None, errors)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        return ngram_lookup(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, k)

    def forget(self, seq_id: int) -> None:
        pass
