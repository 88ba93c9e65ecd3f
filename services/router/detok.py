"""From token ids to what a client sees: text (detokenized, stop strings applied) and logprobs.

One :class:`TextAssembler` per choice turns the tokens decode streams into text deltas with
the model's :class:`IncrementalDetokenizer` (never splitting a UTF-8 character) and the
:class:`StopScanner`, and renders each token's logprobs with its text and bytes.
:class:`TokenRenderer` is shared by all requests: the text and bytes of a token id never
change, so they are computed once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from libs.model.tokenizer import IncrementalDetokenizer, Tokenizer
from libs.protocol.messages import PromptLogprobs, TokenLogprobs
from services.router.stop import StopScanner

# JSON has no -inf; vLLM reports impossible tokens with this floor too.
LOGPROB_FLOOR = -9999.0


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character each raw byte is written as."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(visible)
    n = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars)}


@dataclass(frozen=True)
class RenderedToken:
    """A token as logprobs show it: its text, its raw bytes and its log-probability (None
    when the instance sent none, which the response shows as null rather than invent one)."""

    text: str
    bytes: tuple[int, ...]
    logprob: float | None


class TokenRenderer:
    """Token id -> text and bytes, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def text_and_bytes(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            hit = (text, self._bytes(token_id, text))
            self._cache[token_id] = hit
        return hit

    def _bytes(self, token_id: int, text: str) -> tuple[int, ...]:
        """The token's exact bytes: byte-level BPE pieces map back byte by byte (so half a
        UTF-8 character is reported as the bytes it is); other vocabularies use the text."""
        piece = self.tokenizer.id_to_token(token_id)
        table = _byte_decoder()
        if piece is not None and token_id not in self.tokenizer.special_ids and all(c in table for c in piece):
            return tuple(table[c] for c in piece)
        return tuple(text.encode("utf-8"))

    def render(self, token_id: int, logprob: float | None) -> RenderedToken:
        text, raw = self.text_and_bytes(token_id)
        if logprob is not None and not math.isfinite(logprob):
            logprob = LOGPROB_FLOOR
        return RenderedToken(text, raw, logprob)


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its top alternatives, ready for either API's format; ``top`` is None
    for a prompt's first token, which has no logprob (OpenAI shows null for both)."""

    token: RenderedToken
    top: tuple[RenderedToken, ...] | None


def render_prompt_logprobs(renderer: TokenRenderer, prompt_ids: Sequence[int], wire: PromptLogprobs) -> list[TokenLogprob]:
    """A scored prompt as logprob entries: its first token without a logprob, then each
    later token with its logprob and alternatives; a ``ValueError`` if ``wire`` does not
    score exactly this prompt."""
    if list(wire.token_ids) != list(prompt_ids[1:]):
        raise ValueError(f"prompt logprobs for {len(wire.token_ids)} tokens that are not this prompt's {len(prompt_ids) - 1}")
    out = [TokenLogprob(renderer.render(prompt_ids[0], None), None)]
    for token_id, lp, ids, lps in zip(wire.token_ids, wire.logprobs, wire.top_ids, wire.top_logprobs):
        out.append(TokenLogprob(renderer.render(token_id, lp), tuple(renderer.render(t, v) for t, v in zip(ids, lps))))
    return out


@dataclass
class Piece:
    """What one batch of tokens added to a choice."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    logprob_sum: float = 0.0  # the tokens' sampled logprobs, whether or not they are rendered


class TextAssembler:
    """One choice's tokens -> text deltas (stop strings applied) and rendered logprobs."""

    def __init__(
        self, renderer: TokenRenderer, prompt_ids: Sequence[int], stops: Sequence[str], *, logprobs: bool
    ) -> None:
        self.renderer = renderer
        self.detok = IncrementalDetokenizer(renderer.tokenizer, prompt_ids)
        self.scanner = StopScanner(stops)
        self.want_logprobs = logprobs

    @property
    def stopped(self) -> bool:
        """A stop string matched: the choice is over, and later tokens are ignored."""
        return self.scanner.stopped

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None) -> Piece:
        """Take tokens until they run out or a stop string matches."""
        piece = Piece()
        for i, token_id in enumerate(token_ids):
            piece.num_tokens += 1
            piece.text += self.scanner.feed(self.detok.add([token_id]))
            lp = logprobs[i] if logprobs else None
            if lp is not None and lp.token_id == token_id:
                piece.logprob_sum += lp.logprob if math.isfinite(lp.logprob) else LOGPROB_FLOOR
            if self.want_logprobs:
                piece.logprobs.append(self._logprob(token_id, lp))
            if self.stopped:
                break
        return piece

    def finish(self) -> str:
        """Generation ended: the rest of the text (an incomplete character, held-back text)."""
        if self.stopped:
            return ""
        return self.scanner.feed(self.detok.flush()) + self.scanner.flush()

    def _logprob(self, token_id: int, lp: TokenLogprobs | None) -> TokenLogprob:
        if lp is None or lp.token_id != token_id:
            return TokenLogprob(self.renderer.render(token_id, None), ())
        top = tuple(self.renderer.render(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs))
        return TokenLogprob(self.renderer.render(token_id, lp.logprob), top)
