"""Per-sequence switch-off of speculation when it does not pay.

A verification round costs the target ``k + 1`` query tokens instead of one (and, for the
model-based proposers, ``k`` draft forwards). A sequence whose drafts keep being rejected
makes every step of its batch slower for nothing, so each sequence keeps the acceptance
lengths of its last ``acceptance_window`` rounds; once the window is full and their mean
falls below ``min_acceptance_length``, it stops speculating. Text changes character (a
quote begins, code follows prose), so after ``reprobe_interval`` plain decode steps it
tries again, judged on a quarter window; each failed probe doubles the wait (up to 64x),
and a probe that pays resets it. Only the sequence's own history decides, never its batch's,
so one bad sequence cannot switch speculation off (or on) for the others.

Rounds without drafts (an n-gram lookup that found nothing) cost nothing and count for
nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

_MAX_BACKOFF = 64


@dataclass
class SeqAcceptance:
    window: deque[int] = field(default_factory=deque)
    paused_steps: int = 0  # plain decode steps left before the next probe
    backoff: int = 1

    @property
    def enabled(self) -> bool:
        return self.paused_steps == 0


class AdaptiveSpeculation:
    def __init__(self, *, window: int, min_acceptance_length: float, reprobe_interval: int):
        self.window = window
        self.min_acceptance_length = min_acceptance_length
        self.reprobe_interval = reprobe_interval
        self._seqs: dict[int, SeqAcceptance] = {}
        self.num_disabled = 0  # times a sequence was switched off (a metric)

    def should_speculate(self, seq_id: int) -> bool:
        """Whether this sequence speculates this step; a paused one counts down a step."""
        state = self._seqs.get(seq_id)
        if state is None or state.enabled:
            return True
        state.paused_steps -= 1
        return False

    def observe(self, seq_id: int, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0 or self.min_acceptance_length <= 0:
            return
        state = self._seqs.setdefault(seq_id, SeqAcceptance())
        state.window.append(1 + num_accepted)
        if len(state.window) > self.window:
            state.window.popleft()
        # A probe after a pause is judged on a quarter window (at least 2 rounds), so a
        # sequence that still does not pay costs little each time it is tried again.
        need = self.window if state.backoff == 1 else max(2, self.window // 4)
        if len(state.window) < need:
            return
        if sum(state.window) / len(state.window) < self.min_acceptance_length:
            state.paused_steps = self.reprobe_interval * state.backoff
            state.backoff = min(state.backoff * 2, _MAX_BACKOFF)
            state.window.clear()
            self.num_disabled += 1
        else:
            state.backoff = 1

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
