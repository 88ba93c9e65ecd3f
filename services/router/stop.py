"""Stop strings over a growing text: find the first match, hold back what might start one.

Tokens arrive one at a time and a stop string may be split across several of them
(``"END"`` as ``"E"`` + ``"ND"``), so text is released only up to the point where no stop
string can still begin: the longest tail of the text that is a proper prefix of some stop
string is held back until the next token says whether it completes the match. On a match
the text is cut before the stop string, which is never part of the output (OpenAI's
behaviour); held text is released when generation ends without a match.

A match can never start inside released text, because everything that could start one
was held back, so only the tail needs scanning: the last ``longest stop - 1`` characters
plus what was just added.
"""

from __future__ import annotations

from typing import Sequence


class StopScanner:
    """Feed text deltas; get back the text that is safe to send."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything accepted so far (cut at the match once stopped)
        self.released = 0  # how much of ``text`` has been handed out
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the newly releasable text. After a match nothing more is taken."""
        if self.stopped or not delta:
            return ""
        scan_from = max(self.released, len(self.text) - self._longest + 1)
        self.text += delta
        if not self.stops:
            return self._release(len(self.text))
        hits = [p for p in (self.text.find(s, scan_from) for s in self.stops) if p >= 0]
        if hits:
            cut = min(hits)
            self.text = self.text[:cut]
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """Generation ended without a match: release whatever was held back."""
        return self._release(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.released), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out = self.text[self.released : upto]
        self.released = upto
        return out
