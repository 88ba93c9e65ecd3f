"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

- ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false, "tools": [...]}`` (rendered with
  the same chat template a chat completion would use), plus ``model`` and
  ``return_token_strs``; it answers ``{"count", "max_model_len", "tokens", "token_strs"}``.
  Which form a body is follows from ``messages``: with it, ``prompt`` is an unknown field.
- ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``.

They go the way of the generation endpoints (generate.py): an admission slot, the body
within its size and time limits (body.py), then parsing, validation (fields.py,
chat_messages.py, tools.py: every bad field a 400 naming it; a tool whose parameter schema
does not compile is a 400 as on a chat completion) and the tokenizer as one job on the
router's bounded executor, never on the event loop. openapi.py describes both.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from aiohttp import web

from libs.model.tokenizer import Tokenizer
from libs.structured import GrammarCompiler
from services.router.api import token_ids
from services.router.body import parse_json, read_body
from services.router.chat_messages import parse_messages
from services.router.errors import ApiError, bad_request
from services.router.fields import Fields, json_type, missing
from services.router.prepare import check_grammars, render_chat
from services.router.state import STATE
from services.router.tools import parse_tools

TOKENIZE_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
TOKENIZE_CHAT_FIELDS = frozenset(
    {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs", "tools",
     "continue_final_message"}
)  # fmt: skip
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _fields(raw: bytes, max_json_depth: int, served_model: str, known: Callable[[dict[str, Any]], frozenset[str]]) -> Fields:
    """The body's fields, all of them ``known(body)``, for ``served_model``."""
    body = parse_json(raw, max_json_depth)
    if type(body) is not dict:
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}", None, "invalid_type")
    f = Fields(body)
    f.only(known(body))
    model = f.string("model", served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
    return f


def _tokenize_form(body: dict[str, Any]) -> frozenset[str]:
    return TOKENIZE_CHAT_FIELDS if "messages" in body else TOKENIZE_PROMPT_FIELDS


def tokenize_body(
    raw: bytes,
    *,
    tokenizer: Tokenizer,
    served_model: str,
    max_model_len: int | None,
    max_json_depth: int,
    grammars: GrammarCompiler,
    chat_template: str | None,
) -> dict[str, Any]:
    """The ``/tokenize`` answer to ``raw`` (runs on the executor); an :class:`ApiError` if invalid."""
    f = _fields(raw, max_json_depth, served_model, _tokenize_form)
    if "messages" in f.body:
        messages = parse_messages(f.raw("messages"))
        tools = parse_tools({"tools": f.raw("tools")})
        if f.boolean("continue_final_message", False):
            raise bad_request("'continue_final_message' is not supported", "continue_final_message", "unsupported_parameter")
        check_grammars(grammars, None, tools)
        add_generation_prompt = f.boolean("add_generation_prompt", True)
        text = render_chat(tokenizer, messages, tools, chat_template, add_generation_prompt=add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=f.boolean("add_special_tokens", False))
    else:
        if not f.given("prompt"):
            raise missing("prompt")
        prompt = f.string("prompt", "")
        assert prompt is not None
        ids = tokenizer.encode(prompt, add_special_tokens=f.boolean("add_special_tokens", True))
    strs = [tokenizer.id_to_token(i) for i in ids] if f.boolean("return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(raw: bytes, *, tokenizer: Tokenizer, served_model: str, max_json_depth: int) -> dict[str, Any]:
    """The ``/detokenize`` answer to ``raw`` (runs on the executor); an :class:`ApiError` if invalid."""
    f = _fields(raw, max_json_depth, served_model, lambda _: DETOKENIZE_FIELDS)
    if not f.given("tokens"):
        raise missing("tokens")
    ids = token_ids(f.raw("tokens"), "tokens", tokenizer.vocab_size, allow_empty=True)
    return {"prompt": tokenizer.decode(list(ids))}


async def _serve(request: web.Request, job: Callable[[bytes], dict[str, Any]]) -> web.Response:
    state = request.app[STATE]
    s = state.settings
    try:
        async with state.admission.slot():
            raw = await read_body(request, s.max_body_bytes, s.body_timeout_s)
            answer = await state.executor.run(functools.partial(job, raw))
    except ApiError as exc:
        if exc.status == 429:
            state.metrics.overloaded.labels(exc.code or "").inc()
        return exc.response()
    return web.json_response(answer)


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    job = functools.partial(
        tokenize_body,
        tokenizer=state.tokenizer,
        served_model=state.model_name,
        max_model_len=state.registry.max_model_len("decode"),  # read here: the registry belongs to the loop
        max_json_depth=state.settings.max_json_depth,
        grammars=state.grammars,
        chat_template=state.chat_template,
    )
    return await _serve(request, job)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    job = functools.partial(
        detokenize_body, tokenizer=state.tokenizer, served_model=state.model_name, max_json_depth=state.settings.max_json_depth
    )
    return await _serve(request, job)
