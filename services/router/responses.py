"""OpenAI response shapes for both endpoints, whole (JSON) and streamed (SSE chunks).

Completions (``text_completion``): ``choices[].text``, ``choices[].logprobs`` =
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``; the sampled
token is always in its ``top_logprobs`` map, as OpenAI documents (so a map may hold
``logprobs + 1`` entries); ``text_offset`` counts characters of the choice's text, echo
included. Chat (``chat.completion``): ``choices[].message = {role, content}``,
``choices[].logprobs = {content: [{token, logprob, bytes, top_logprobs: [...]}]}``.

Streaming: each chunk carries one choice's delta (chat: the role comes with the choice's
first content, ``delta: {}`` on a bare finish), ``finish_reason`` on the choice's last
chunk; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and a last
chunk with empty ``choices`` carries the usage, as OpenAI sends it. The ``tidepool``
extension (``{"trace": ...}``) rides on the last chunk (the usage chunk when there is one).

``usage`` counts prompt tokens once per prompt (not per choice), completion tokens over all
choices, and ``prompt_tokens_details.cached_tokens``: prompt tokens served from a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router.api import GenerateRequest
from services.router.detok import RenderedToken, TokenLogprob
from services.router.handoff import ChoiceUpdate


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _chat_token(t: RenderedToken) -> dict[str, Any]:
    return {"token": t.text, "logprob": t.logprob, "bytes": list(t.bytes)}


@dataclass
class ChoiceState:
    """What a choice has produced so far (for the whole response) and where its text is."""

    index: int
    prefix: str = ""  # echoed prompt (completions with echo)
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0  # text_offset of the next token
    started: bool = False  # a chunk of this choice has been sent

    def __post_init__(self) -> None:
        self.offset = len(self.prefix)

    def add(self, u: ChoiceUpdate) -> None:
        self.parts.append(u.text)
        self.logprobs.extend(u.logprobs)
        if u.finish_reason is not None:
            self.finish_reason = u.finish_reason

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)


class Formatter:
    """Builds the response objects of one request."""

    def __init__(self, req: GenerateRequest, response_id: str, created: int, echo: list[str]) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        self.id = response_id
        self.created = created
        self.choices = [
            ChoiceState(p * req.n + i, prefix=echo[p] if req.echo else "")
            for p in range(req.num_prompts)
            for i in range(req.n)
        ]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": choices}

    def _logprobs(self, state: ChoiceState, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {
                "content": [
                    {**_chat_token(e.token), "top_logprobs": [_chat_token(t) for t in e.top]} for e in entries
                ],
                "refusal": None,
            }
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token.text)
            token_logprobs.append(e.token.logprob)
            alternatives = {t.text: t.logprob for t in e.top}
            alternatives.setdefault(e.token.text, e.token.logprob)
            top.append(alternatives)
            offsets.append(state.offset)
            state.offset += len(e.token.text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # -- whole response ---------------------------------------------------------------------

    def response(self, usage_: dict[str, Any], extension: dict[str, Any] | None) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            logprobs = self._logprobs(c, c.logprobs)
            if self.chat:
                choices.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_
        if extension is not None:
            body["tidepool"] = extension
        return body

    # -- stream -------------------------------------------------------------------------------

    def chunk(self, u: ChoiceUpdate) -> dict[str, Any]:
        state = self.choices[u.index]
        text = u.text
        first = not state.started
        state.started = True
        if first:
            text = state.prefix + text
        choice: dict[str, Any] = {"index": u.index}
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(state, u.logprobs) if u.logprobs else None
        choice["finish_reason"] = u.finish_reason
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_
        return body
