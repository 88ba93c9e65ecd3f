"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them.

- ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false, "tools": [...]}`` (rendered with
  the same chat template a chat completion would use), plus ``model`` and
  ``return_token_strs``; it answers ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``.

Tokenizing runs on the router's thread pool; every bad field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.router.api import _Fields, _json_type, _messages, _token_ids
from services.router.errors import ApiError, bad_request
from services.router.generate import _read_json, _tokenize
from services.router.state import STATE, RouterState
from services.router.tools import parse_tools

_TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs", "tools",
     "continue_final_message"}
)


def _body(raw: Any, state: RouterState, known: frozenset[str]) -> _Fields:
    if type(raw) is not dict:
        raise bad_request(f"the request body must be a JSON object, got {_json_type(raw)}", None, "invalid_type")
    for key in raw:
        if key not in known:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    f = _Fields(raw)
    model = f.string("model", state.model_name)
    if model != state.model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
    return f


def _tokenize_ids(state: RouterState, f: _Fields) -> list[int]:
    from services.router.api import parse_request

    if f.given("prompt") == f.given("messages"):
        raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
    if f.boolean("continue_final_message", False):
        raise bad_request("'continue_final_message' is not supported", "continue_final_message", "unsupported_parameter")
    if f.given("prompt"):
        prompt = f.string("prompt", "")
        ids = state.tokenizer.encode(prompt or "", add_special_tokens=f.boolean("add_special_tokens", True))
        return ids
    _messages(f)
    if not f.boolean("add_generation_prompt", True):
        raise bad_request("'add_generation_prompt': false is not supported", "add_generation_prompt", "unsupported_parameter")
    body = {"messages": f.raw("messages"), **({"tools": f.raw("tools")} if f.given("tools") else {})}
    req = parse_request(body, "chat", served_model=state.model_name, vocab_size=state.tokenizer.vocab_size)
    ids = _tokenize(state, req)[0].token_ids
    if f.boolean("add_special_tokens", False) and state.tokenizer.add_bos and state.tokenizer.bos_token_id is not None:
        ids = [state.tokenizer.bos_token_id, *ids]
    return ids


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        f = _body(await _read_json(request), state, _TOKENIZE_FIELDS)
        parse_tools({"tools": f.raw("tools")}) if f.given("tools") else None
        ids = await state.in_thread(lambda: _tokenize_ids(state, f))
        strs = [state.tokenizer.id_to_token(i) for i in ids] if f.boolean("return_token_strs", False) else None
    except ApiError as exc:
        return exc.response()
    return web.json_response(
        {"count": len(ids), "max_model_len": state.registry.max_model_len("decode"), "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        f = _body(await _read_json(request), state, frozenset({"model", "tokens"}))
        ids = _token_ids(f.raw("tokens"), "tokens", state.tokenizer.vocab_size, allow_empty=True)
        text = await state.in_thread(lambda: state.tokenizer.decode(list(ids)))
    except ApiError as exc:
        return exc.response()
    return web.json_response({"prompt": text})
