"""One sequence's grammar state: which tokens may come next, advanced by each sampled token.

A thin wrapper over llguidance's ``LLMatcher`` with the engine's vocabulary of operations:
``fill`` a bitmask row, ``accept`` a sampled token, ``replay`` tokens generated elsewhere
(prefill's first token, or a broken decode stream's output when the router resumes it on
another instance), ``copy`` for ``n > 1`` forks and ``rollback`` for speculative drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from libs.structured.spec import GrammarError

if TYPE_CHECKING:
    import llguidance
    import torch


class GrammarMismatchError(GrammarError):
    """Tokens given to :meth:`GrammarMatcher.replay` do not follow the grammar."""


class GrammarMatcher:
    def __init__(self, matcher: "llguidance.LLMatcher", eos_token_ids: tuple[int, ...]):
        self._m = matcher
        self._eos = eos_token_ids
        self.num_accepted = 0

    @property
    def raw(self) -> "llguidance.LLMatcher":
        """The llguidance matcher (for the batched bitmask fill)."""
        return self._m

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and an error state) if the grammar forbids it."""
        ok = self._m.consume_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    def replay(self, token_ids: Sequence[int]) -> None:
        """Advance by tokens generated before this state existed; raise if one is not allowed."""
        for i, t in enumerate(token_ids):
            if self.is_terminated:
                raise GrammarMismatchError(f"token {i} of {len(token_ids)} to replay comes after the output is complete")
            if not self.accept(t):
                raise GrammarMismatchError(f"token {i} of {len(token_ids)} to replay (id {t}) does not follow the grammar")

    def fill(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor).

        llguidance's own pointer API, as ``llguidance.torch.fill_next_token_bitmask`` calls
        it: importing that module ``torch.compile``s its bitmask kernel, which loads
        dynamo and inductor (4-5 s of a loaded CPU), a stall of the first constrained step."""
        v = bitmask[row]
        if str(bitmask.dtype) != "torch.int32" or not bitmask.is_cpu or not v.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    @property
    def is_terminated(self) -> bool:
        """The output is complete: nothing may follow (EOS was accepted, or the grammar has
        no continuation)."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS would be allowed next)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def copy(self) -> "GrammarMatcher":
        """An independent matcher in the same state (an ``n > 1`` sibling)."""
        m = GrammarMatcher(self._m.deep_copy(), self._eos)
        m.num_accepted = self.num_accepted
        return m
