"""Preparing a request: raw body -> validated request -> token ids -> completion budgets.

Everything between reading the body and calling the first instance, as one function that
runs on the router's bounded executor (executor.py), never on the event loop:

1. parse the JSON within its depth limit (body.py) and validate it (api.py);
2. no decode instance registered: 503 (after validation, so a bad request is still a 400);
3. render the chat template;
4. **precheck** each prompt's length: a text of ``c`` characters has at least
   ``ceil(c / max_token_chars)`` tokens (libs/model/tokenizer.py), so one that cannot fit
   the context is a 400 ``context_length_exceeded`` before the tokenizer sees it (what
   the tokenizer gets is then at most ``max_model_len * max_token_chars`` characters);
5. tokenize, and resolve each prompt's ``max_tokens`` against the context (api.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from libs.model.tokenizer import ChatTemplateError, Tokenizer
from services.router.api import GenerateRequest, Kind, parse_request, prompt_too_long, resolve_max_tokens
from services.router.body import parse_json
from services.router.errors import bad_request, no_decode_instance


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # what ``echo`` shows


@dataclass
class Prepared:
    req: GenerateRequest
    prompts: list[Prompt]
    budgets: list[int]  # max_tokens of each prompt


def prepare(
    raw: bytes,
    kind: Kind,
    *,
    tokenizer: Tokenizer,
    served_model: str,
    max_model_len: int | None,
    max_json_depth: int,
) -> Prepared:
    """Steps 1-5 above; an :class:`ApiError` for the first thing wrong."""
    req = parse_request(parse_json(raw, max_json_depth), kind, served_model=served_model, vocab_size=tokenizer.vocab_size)
    if max_model_len is None:
        raise no_decode_instance()
    prompts = tokenize(tokenizer, req, max_model_len)
    budgets = [resolve_max_tokens(req, len(p.token_ids), max_model_len, i) for i, p in enumerate(prompts)]
    return Prepared(req, prompts, budgets)


def tokenize(tok: Tokenizer, req: GenerateRequest, max_model_len: int) -> list[Prompt]:
    """Chat template and tokenizer, each text prechecked against the context first."""
    if req.kind == "chat":
        try:
            text = tok.render_chat(list(req.messages))
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        precheck(req, text, max_model_len, tok.max_token_chars, 0)
        prompts = [Prompt(tok.encode(text, add_special_tokens=False), text)]
    else:
        prompts = []
        for i, p in enumerate(req.prompts):
            if isinstance(p, str):
                precheck(req, p, max_model_len, tok.max_token_chars, i)
                prompts.append(Prompt(tok.encode(p), p))
            else:
                prompts.append(Prompt(list(p), tok.decode(p) if req.echo else ""))
    for i, p in enumerate(prompts):
        if not p.token_ids:
            if req.kind == "chat":
                raise bad_request("the messages render to an empty prompt", "messages")
            label = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise bad_request(f"{label} is empty after tokenization", "prompt")
    return prompts


def precheck(req: GenerateRequest, text: str, max_model_len: int, max_token_chars: int, index: int) -> None:
    """A 400 when ``text`` leaves no room in the context whatever its tokenization.

    Only the prompt is judged here; whether ``max_tokens`` fits too is decided on the
    exact count (:func:`~services.router.api.resolve_max_tokens`), which the tokenizer
    gives cheaply for any text that passes (at most ``max_model_len * max_token_chars``
    characters).
    """
    at_least = math.ceil(len(text) / max_token_chars)
    if at_least < max_model_len:
        return
    raise prompt_too_long(req, max_model_len, index, f"{len(text)} characters, so at least {at_least} tokens")
