"""Tokenizer, chat template and incremental detokenizer, built from the same source as the weights.

A GGUF file carries its BPE vocabulary, merges, special tokens and chat template in its
metadata; a Hugging Face folder carries ``tokenizer.json`` and ``tokenizer_config.json``.
Either way the router and the engine get one ``Tokenizer`` with the same behaviour.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's GPT-2 style split, used by most byte-level BPE GGUFs.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3 ("llama-bpe") and Qwen2 split contractions case-insensitively and digits in threes.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: bad roles, bad content, or the template raised."""


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for GGUF ``tokenizer.ggml.pre`` = ``pre``."""
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # Digits are split one by one before the GPT-2 regex (llama.cpp: "\p{N}" first).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass
class Tokenizer:
    """Text ↔ token ids, plus the model's chat template and stop tokens."""

    backend: HFTokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    special_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self._templates: dict[str, jinja2.Template] = {}
        self._template = self._compile_template(self.chat_template) if self.chat_template else None

    def _compile_template(self, source: str) -> jinja2.Template:
        """A chat template, compiled once per source text (sandboxed, as transformers runs them)."""
        template = self._templates.get(source)
        if template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            # transformers' tojson: plain JSON (jinja's escapes <, > and & for HTML).
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
            try:
                template = env.from_string(source)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"the chat template does not compile: {e}") from None
            self._templates[source] = template
        return template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: the length of the longest
        vocabulary entry. An entry of a byte-level vocabulary spells one byte per character
        (and a byte is at most one character of text); a SentencePiece entry spells its text
        with ``▁`` for the space; a control token is its literal text.

        So a text of ``c`` characters has at least ``ceil(c / max_token_chars)`` tokens,
        which lets the router refuse a prompt that cannot fit the context before paying to
        tokenize it.
        """
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(t) for t in vocab), default=1)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; control tokens written in the text are recognised.

        Calls ``encode_batch``: unlike ``encode``, it releases the GIL while it works, so a
        long text tokenized on a worker thread does not stall the caller's event loop
        (measured: ``encode`` of 2.4 M characters held the loop for the whole 0.9 s).
        """
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``).

        ``tools`` (OpenAI's ``tools`` entries) are passed to the template as ``tools``;
        ``template`` replaces the model's own (libs/model/chat_templates.py chooses)."""
        compiled = self._compile_template(template) if template is not None else self._template
        if compiled is None:
            raise ChatTemplateError("this model has no chat template; use a plain prompt")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        clean = [_normalize_message(i, m) for i, m in enumerate(messages)]
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        extra = {"tools": tools} if tools else {}
        try:
            return compiled.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos or "",
                eos_token=eos or "",
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        # The template writes the BOS itself where the model wants one.
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, meta: dict[str, Any]) -> "Tokenizer":
        """From GGUF ``tokenizer.ggml.*`` metadata (byte-level BPE only)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "load the Hugging Face folder instead"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        # Control (3) and user-defined (4) tokens are matched whole in the text.
        specials = [i for i, t in enumerate(types) if t in (3, 4)]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
        eos = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
        for extra in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if extra in meta and meta[extra] not in eos:
                eos.append(meta[extra])
        return cls(
            backend=backend,
            eos_token_ids=tuple(int(e) for e in eos),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            special_ids=frozenset(i for i, t in enumerate(types) if t == 3),
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "Tokenizer":
        """From ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``)."""
        folder = Path(folder)
        backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        tcfg = _read_json(folder / "tokenizer_config.json")
        gcfg = _read_json(folder / "generation_config.json")
        mcfg = _read_json(folder / "config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()

        def token_id(entry: Any) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return backend.token_to_id(entry) if isinstance(entry, str) else None

        eos: list[int] = []
        for source in (gcfg.get("eos_token_id"), mcfg.get("eos_token_id"), token_id(tcfg.get("eos_token"))):
            for e in source if isinstance(source, list) else [source]:
                if isinstance(e, int) and e not in eos:
                    eos.append(e)
        bos = token_id(tcfg.get("bos_token"))
        if bos is None and isinstance(mcfg.get("bos_token_id"), int):
            bos = mcfg["bos_token_id"]
        # tokenizer.json's post-processor adds BOS itself for most Llama checkpoints; we
        # always encode without special tokens and add BOS explicitly, so read the intent.
        add_bos = bool(tcfg.get("add_bos_token", False)) or _post_processor_adds(backend, bos)
        added = backend.get_added_tokens_decoder()
        return cls(
            backend=backend,
            eos_token_ids=tuple(eos),
            bos_token_id=bos,
            add_bos=add_bos,
            chat_template=template,
            special_ids=frozenset(i for i, t in added.items() if t.special),
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Decoding token by token breaks multi-byte characters and byte-level spaces, so each
    step decodes a small window (``prefix_offset:``) and emits only the text beyond what
    the window decoded to before, holding back while the tail is an incomplete character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self._prefix = 0
        self._read = len(self.ids)
        self.text = ""

    def add(self, new_ids: Iterable[int]) -> str:
        """Append tokens and return the newly completed text (possibly empty)."""
        delta = []
        for tid in new_ids:
            self.ids.append(tid)
            prefix_text = self._tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=self._skip)
            full_text = self._tok.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                delta.append(full_text[len(prefix_text) :])
                self._prefix = self._read
                self._read = len(self.ids)
        out = "".join(delta)
        self.text += out
        return out

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        rest = self._tok.decode(self.ids[self._prefix :], skip_special_tokens=self._skip)
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], skip_special_tokens=self._skip)
        out = rest[len(prefix_text) :]
        self._prefix = self._read = len(self.ids)
        self.text += out
        return out


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"messages[{index}] must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"messages[{index}].role must be a non-empty string")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"messages[{index}].content[{j}] must be a text part")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
    return {**message, "role": role, "content": content}


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _post_processor_adds(backend: HFTokenizer, bos: int | None) -> bool:
    if bos is None:
        return False
    return bos in backend.encode("a", add_special_tokens=True).ids[:1]
