"""GrammarSpec -> compiled grammar, with llguidance, cached.

Why llguidance (bench/grammar_bench.py, bench/RESULTS.md): on the real SmolLM2 tokenizer
it compiles realistic JSON schemas in about a millisecond where xgrammar takes 0.4-2.4 s
(a request with a new schema, or a new set of tools, waits that long before its first
token), its batched mask stays well under a decode step at batch 64, it never allows a
special token inside a value without extra care, and it has draft-token masks for
speculative decoding. xgrammar's per-step masks are faster at batch 1 (a few µs against
10-50 µs), which a device step of milliseconds hides either way.

Compiling builds an ``LLMatcher`` from the grammar text: that is the expensive part
(lexer and parser tables; up to ~1 s for pathological grammars, with the GIL released).
The compiled template is kept in an LRU cache keyed by the spec and never advanced;
every request gets a cheap ``deep_copy`` of it (:meth:`CompiledGrammar.matcher`).

Callers on an event loop compile with :meth:`GrammarCompiler.compile_async` (a thread),
so a slow compile never stalls I/O. The engine's step thread only copies templates.

JSON output is compact and canonical: ``", "`` between items, ``": "`` after keys, no
other whitespace. Flexible whitespace lets a small model wander into endless newlines at
temperature 1 until ``max_tokens`` cuts the JSON short; a fixed layout cannot.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Sequence

from libs.structured.matcher import GrammarMatcher
from libs.structured.spec import GrammarError, GrammarSpec

if TYPE_CHECKING:
    import llguidance

    from libs.model.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text of ``spec`` (no tokenizer needed; not yet validated)."""
    import llguidance as llg

    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = json.loads(spec.value) if spec.kind == "json_schema" else ANY_JSON_OBJECT
            options = dict(JSON_OPTIONS, lenient=not spec.strict)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return llg.grammar_from("choice", spec.value)
        if spec.kind == "grammar":
            return llg.grammar_from("grammar", spec.value)
        return llg.LLMatcher.grammar_from_lark(spec.value)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid {spec.kind}: {e}", kind=spec.kind) from None
    except Exception as e:  # llguidance's GBNF converter raises bare Exceptions
        raise GrammarError(f"invalid {spec.kind}: {e}", kind=spec.kind) from None


class CompiledGrammar:
    """A compiled constraint: hands out fresh matchers (copies of a never-advanced template)."""

    def __init__(self, spec: GrammarSpec, template: "llguidance.LLMatcher", eos_token_ids: tuple[int, ...]):
        self.spec = spec
        self._template = template
        self._eos = eos_token_ids
        self._lock = threading.Lock()  # deep_copy from several threads at once is not documented safe

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._template.deep_copy(), self._eos)


class GrammarCompiler:
    """Compiles specs against one tokenizer; thread-safe; an LRU cache of ``cache_size``."""

    def __init__(self, tokenizer: "Tokenizer", *, cache_size: int = 256, vocab_size: int | None = None):
        self._tokenizer = tokenizer
        # The model's vocabulary may be padded past the tokenizer's: masks cover the model's.
        self._vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: "llguidance.LLTokenizer | None" = None
        self.hits = 0
        self.misses = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def ll_tokenizer(self) -> "llguidance.LLTokenizer":
        """llguidance's view of the vocabulary (built once, ~1 s: it indexes every token)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance as llg

                tok = self._tokenizer
                self._ll_tokenizer = llg.LLTokenizer(
                    tok.backend.to_str(), n_vocab=self._vocab_size, eos_token=list(tok.eos_token_ids)
                )
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache or compiled now (may take a while:
        call it off the event loop). Raises :class:`GrammarError` naming the problem."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return hit
        import llguidance as llg

        grammar = llguidance_grammar(spec)
        template = llg.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {spec.kind}: {template.get_error().strip()}", kind=spec.kind)
        compiled = CompiledGrammar(spec, template, tuple(self._tokenizer.eos_token_ids))
        with self._lock:
            self.misses += 1
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def start(self, grammar: GrammarSpec | CompiledGrammar, replay: "Sequence[int]" = ()) -> GrammarMatcher:
        """A fresh grammar state for a request, advanced by ``replay`` (tokens generated
        before: prefill's first token, a resumed stream's output). Raises ``GrammarError``
        (a malformed spec) or ``GrammarMismatchError`` (replayed tokens that do not follow)."""
        compiled = grammar if isinstance(grammar, CompiledGrammar) else self.compile(grammar)
        matcher = compiled.matcher()
        matcher.replay(replay)
        return matcher

    async def compile_async(self, spec: GrammarSpec, executor: Executor | None = None) -> CompiledGrammar:
        """:meth:`compile` on a thread, for callers on an event loop."""
        return await asyncio.get_running_loop().run_in_executor(executor, self.compile, spec)

    def __len__(self) -> int:
        return len(self._cache)
