"""Preparing a request: raw body -> validated request -> token ids -> completion budgets.

Everything between reading the body and calling the first instance, as one function that
runs on the router's bounded executor (executor.py), never on the event loop:

1. parse the JSON within its depth limit (body.py) and validate it (api.py);
2. compile every output constraint the request carries (a schema, regex or grammar; each
   tool's parameter schema; the grammar a forced tool call runs under) with the grammar
   engine, cached (libs/structured): one that does not compile, or is too large to travel
   to the instances, is a 400 ``invalid_grammar`` naming its field;
3. no decode instance registered: 503 (after validation, so a bad request is still a 400);
4. render the chat template (with tools, or a history of tool calls, the template that
   renders them: libs/model/chat_templates.py);
5. **precheck** each prompt's length: a text of ``c`` characters has at least
   ``ceil(c / max_token_chars)`` tokens (libs/model/tokenizer.py), so one that cannot fit
   the context is a 400 ``context_length_exceeded`` before the tokenizer sees it (what
   the tokenizer gets is then at most ``max_model_len * max_token_chars`` characters);
6. tokenize, and resolve each prompt's ``max_tokens`` against the context (api.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from libs.model.chat_templates import tools_template
from libs.model.tokenizer import ChatTemplateError, Tokenizer
from libs.protocol.limits import Limits
from libs.structured import GrammarCompiler, GrammarError, GrammarSpec
from services.router.api import GenerateRequest, Kind, parse_request, prompt_too_long, resolve_max_tokens
from services.router.body import parse_json
from services.router.chat_messages import has_tool_turns
from services.router.constraints import Constraint, compile_error, invalid_grammar
from services.router.errors import bad_request, no_decode_instance
from services.router.tools import ToolRequest

# A constraint travels to prefill and decode as one msgpack string, bounded like every other.
MAX_CONSTRAINT_BYTES = Limits().max_str_len


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
    grammars: GrammarCompiler,
    chat_template: str | None = None,
) -> Prepared:
    """Steps 1-6 above; an :class:`ApiError` for the first thing wrong. ``chat_template``
    is the router's ``--chat-template`` (None: the model's, or the tools template)."""
    req = parse_request(parse_json(raw, max_json_depth), kind, served_model=served_model, vocab_size=tokenizer.vocab_size)
    check_grammars(grammars, req.constraint, req.tools)
    if max_model_len is None:
        raise no_decode_instance()
    prompts = tokenize(tokenizer, req, max_model_len, chat_template)
    budgets = [resolve_max_tokens(req, len(p.token_ids), max_model_len, i) for i, p in enumerate(prompts)]
    return Prepared(req, prompts, budgets)


def check_grammars(grammars: GrammarCompiler, constraint: Constraint | None, tools: ToolRequest | None) -> None:
    """Compile every constraint a request carries (step 2); cached, so a repeated schema is free."""
    specs: list[tuple[str, GrammarSpec]] = [(constraint.param, constraint.spec)] if constraint is not None else []
    if tools is not None:
        specs += tools.schemas()
        forced = tools.constraint()
        if forced is not None:
            specs.append(("tool_choice", forced))
    for param, spec in specs:
        size = len(spec.value.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise invalid_grammar(f"'{param}' is {size} bytes as a grammar; at most {MAX_CONSTRAINT_BYTES}", param)
        try:
            grammars.compile(spec)
        except GrammarError as e:
            raise compile_error(e, param) from None


def render_chat(
    tok: Tokenizer,
    messages: tuple[dict[str, object], ...],
    tools: ToolRequest | None,
    chat_template: str | None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of validated chat messages (chat_messages.py), with the request's
    tools shown to the model when they are active; a 400 when the template fails.

    A request with active tools, or a history with tool turns, needs a template that
    renders them: the model's own when it does, else the Hermes template for ChatML
    models; ``chat_template`` overrides both (and the model's for every request)."""
    template, shown = chat_template, None
    active = tools is not None and tools.active
    if active or has_tool_turns(messages):
        template = tools_template(tok.chat_template, chat_template)
        if template is None:
            raise bad_request("this model's chat template cannot render tools (start the router with --chat-template)", "tools")
        if active:
            assert tools is not None
            shown = [t.as_openai() for t in tools.tools]
    try:
        return tok.render_chat(list(messages), tools=shown, template=template, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None


def tokenize(tok: Tokenizer, req: GenerateRequest, max_model_len: int, chat_template: str | None = None) -> list[Prompt]:
    """Chat template and tokenizer, each text prechecked against the context first."""
    if req.kind == "chat":
        text = render_chat(tok, req.messages, req.tools, chat_template)
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
            # A text made only of bytes the vocabulary cannot spell (SmolLM2's has no token
            # for 21 of the 256, control characters among them) tokenizes to nothing.
            if req.kind == "chat":
                raise bad_request("the messages render to an empty prompt", "messages", "empty_prompt")
            label = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise bad_request(f"{label} is empty after tokenization", "prompt", "empty_prompt")
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
