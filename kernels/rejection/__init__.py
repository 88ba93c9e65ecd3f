"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A draft proposes ``k`` tokens; the target scores all ``k + 1`` positions in one forward;
this kernel decides, per sequence, how many drafts survive and which token follows them:

- greedy rows: accept draft ``i`` while it equals the target's argmax at position ``i``;
  the first mismatch emits the target's argmax there (what decoding without speculation
  would have produced), and if all ``k`` match, the argmax at position ``k`` is the bonus;
- random rows: accept draft ``d`` at position ``i`` with probability ``min(1, p(d)/q(d))``;
  at the first rejection emit a token drawn from ``norm(max(0, p - q))`` (the recovered
  token); if all ``k`` are accepted, a bonus token drawn from ``p`` at position ``k``.
  Emitted tokens are then distributed exactly as samples from ``p``, whatever ``q`` is.

``p`` is the target's distribution after the request's own penalties, temperature,
top-k/top-p and min-p (the engine computes it exactly as it would without speculation);
``q`` is the draft's, already in the target vocabulary (a pruned draft vocabulary is mapped
before this point, libs/engine/spec/vocab.py), or ``None`` for a proposer that picks its
drafts deterministically (n-gram lookup), which is ``q`` one-hot at the draft.

All randomness comes in as tensors (``uniform`` per draft position, one ``Exp(1)`` vector
per row for the recovered or bonus token, drawn by the exponential race
``argmax(w / E)``), so each request's own seeded generator drives its draws and the kernel
is a pure function: the Triton kernel and the torch reference give identical tokens.

- ``reference``: ``rejection_sample`` in torch (the CPU path and the test oracle);
- ``triton_rejection``: the same signature, one program per sequence (imported on demand).

This package imports nothing from ``libs`` or ``services``: tensors in, tensors out.
"""

from kernels.rejection.reference import PLACEHOLDER, rejection_sample

__all__ = ["PLACEHOLDER", "rejection_sample"]
