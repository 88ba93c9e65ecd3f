"""OpenAI response shapes for both endpoints, whole (JSON) and streamed (SSE chunks).

Completions (``text_completion``): ``choices[].text``, ``choices[].logprobs`` =
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``; the sampled
token is always in its ``top_logprobs`` map, as OpenAI documents (so a map may hold
``logprobs + 1`` entries); ``text_offset`` counts characters of the choice's text, echo
included. With ``echo`` and ``logprobs`` the prompt's tokens come first, the first of them
with null ``token_logprobs`` and ``top_logprobs`` entries (it has no context), offsets from
0. Chat (``chat.completion``): ``choices[].message = {role, content}``,
``choices[].logprobs = {content: [{token, logprob, bytes, top_logprobs: [...]}]}``.

Streaming: each chunk carries one choice's delta (chat: a first chunk with the role alone
and empty content, as OpenAI, vLLM and llama.cpp send it, then content; ``delta: {}`` on a
bare finish), ``finish_reason`` on the choice's last chunk; with ``stream_options.include_usage`` every chunk has ``"usage": null`` and a last
chunk with empty ``choices`` carries the usage, as OpenAI sends it. The ``tidepool``
extension (``{"trace": ...}``) rides on the last chunk (the usage chunk when there is one).

Tool calls (a chat request with active tools): each choice's text goes through a
:class:`~services.router.tool_parser.HermesToolParser`; calls become ``message.tool_calls``
(``content`` null when there is no other text) or, streamed, ``delta.tool_calls`` in
OpenAI's form: a call's first delta has its ``index``, ``id``, ``type``, ``function.name``
and empty ``arguments``, the next ones append the arguments as they are generated; a
choice that called tools and stopped finishes ``tool_calls``.

``best_of > n`` (completions): the formatter holds every candidate and the whole response
returns each prompt's ``n`` best (best_of.py).

``usage`` counts prompt tokens once per prompt (not per choice), completion tokens over all
choices (every ``best_of`` candidate included), and ``prompt_tokens_details.cached_tokens``:
prompt tokens served from a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.router import best_of
from services.router.api import GenerateRequest
from services.router.detok import RenderedToken, TokenLogprob
from services.router.handoff import ChoiceUpdate
from services.router.tool_parser import HermesToolParser, ToolCall


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
    parser: HermesToolParser | None = None  # tools are active: parse calls out of the text
    cumulative_logprob: float = 0.0  # of the sampled tokens (best_of ranks by it)

    scored_prompt: bool = False  # echo with logprobs: the prompt's tokens have entries (offsets from 0)

    def __post_init__(self) -> None:
        self.offset = 0 if self.scored_prompt else len(self.prefix)

    def finish_reason_out(self, calls: list[ToolCall]) -> str | None:
        """OpenAI's reason: ``tool_calls`` for a choice that called tools and stopped."""
        return "tool_calls" if calls and self.finish_reason == "stop" else self.finish_reason

    def add(self, u: ChoiceUpdate) -> None:
        self.parts.append(u.text)
        self.logprobs.extend(u.prompt_logprobs)
        self.logprobs.extend(u.logprobs)
        self.cumulative_logprob += u.logprob_sum
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
        names = [t.name for t in req.tools.tools] if req.tools is not None and req.tools.active else None
        self.choices = [  # every candidate: p * candidates + i
            ChoiceState(
                p * req.candidates + i,
                prefix=echo[p] if req.echo else "",
                scored_prompt=req.prompt_logprobs is not None,
                parser=HermesToolParser(names, stream=req.stream) if names is not None else None,
            )
            for p in range(req.num_prompts)
            for i in range(req.candidates)
        ]

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": choices}

    def _logprobs(self, state: ChoiceState, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {
                "content": [
                    {**_chat_token(e.token), "top_logprobs": [_chat_token(t) for t in e.top or ()]} for e in entries
                ],
                "refusal": None,
            }
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token.text)
            token_logprobs.append(e.token.logprob)
            alternatives = None
            if e.top is not None:
                alternatives = {t.text: t.logprob for t in e.top}
                alternatives.setdefault(e.token.text, e.token.logprob)
            top.append(alternatives)
            offsets.append(state.offset)
            state.offset += len(e.token.text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    # -- whole response ---------------------------------------------------------------------

    def _returned(self) -> list[tuple[int, ChoiceState]]:
        """The choices the response shows, with their index: all of them, or with ``best_of
        > n`` each prompt's ``n`` best."""
        req = self.req
        if req.candidates == req.n:
            return [(c.index, c) for c in self.choices]
        return list(enumerate(best_of.select(self.choices, req.num_prompts, req.candidates, req.n)))

    def response(self, usage_: dict[str, Any], extension: dict[str, Any] | None) -> dict[str, Any]:
        choices = []
        for index, c in self._returned():
            logprobs = self._logprobs(c, c.logprobs)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                reason = c.finish_reason
                if c.parser is not None:
                    a, b = c.parser.feed(c.text), c.parser.finish()
                    calls = a.calls + b.calls
                    content = a.content + b.content
                    message = {
                        "role": "assistant",
                        "content": (content.strip() or None) if calls else content,
                        "tool_calls": [call.message() for call in calls],
                    }
                    reason = c.finish_reason_out(calls)
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage_
        if extension is not None:
            body["tidepool"] = extension
        return body

    # -- stream -------------------------------------------------------------------------------

    def chunks(self, u: ChoiceUpdate) -> list[dict[str, Any]]:
        """The SSE chunks of one update (chat: the role alone first; tool calls as deltas)."""
        state = self.choices[u.index]
        text = u.text
        first = not state.started
        state.started = True
        if first:
            text = state.prefix + text
        entries = u.prompt_logprobs + u.logprobs
        logprobs = self._logprobs(state, entries) if entries else None
        if not self.chat:
            return [self._chunk({"index": u.index, "text": text, "logprobs": logprobs, "finish_reason": u.finish_reason})]
        out = []
        if first:
            out.append(self._chunk({"index": u.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}))
        deltas: list[dict[str, Any]] = []
        reason = u.finish_reason
        if state.parser is None:
            if text:
                deltas.append({"content": text})
        else:
            parsed = [state.parser.feed(text)]
            if u.finish_reason is not None:
                state.finish_reason = u.finish_reason
                parsed.append(state.parser.finish())
                reason = state.finish_reason_out(state.parser.calls)
            called = state.parser.called
            for p in parsed:  # whitespace around calls is not content
                deltas += [d for d in p.deltas if not (called and "content" in d and not d["content"].strip())]
        if not deltas and (logprobs or reason is not None):
            deltas.append({})
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            out.append(
                self._chunk(
                    {"index": u.index, "delta": delta, "logprobs": logprobs if k == 0 else None, "finish_reason": reason if last else None}
                )
            )
        return out

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage_
        return body
