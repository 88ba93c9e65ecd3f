"""Grammar engines compared: xgrammar against llguidance on the real SmolLM2 tokenizer.

Structured outputs need a grammar engine: one that compiles a JSON schema / regex / choice
/ EBNF grammar against the model's vocabulary, and at every decoding step fills a token
bitmask (one bit per token: may it come next?). Both maintained engines that vLLM and
SGLang use are measured here in the same run, on the same grammars and token sequences:

- **compile**: a cold compile (no cache), in ms. What a request with a new schema waits
  before its first token.
- **first mask**: the first bitmask after compiling (llguidance builds its lexer lazily,
  so some work moves here); compile + first mask is the real time-to-first-mask.
- **mask, batch 1**: one matcher walking a valid output token by token; per-step bitmask
  fill time (mean, p50, p99) in microseconds, accept excluded.
- **mask, batch 64**: 64 matchers over all the grammars at staggered positions, filled
  with each engine's batched, multi-threaded call (xgrammar ``BatchGrammarMatcher``,
  llguidance ``LLExecutor``); per-step time for the whole batch.

Both engines must accept every token of every sequence and end in an accepting state, or
the run fails: a fast engine that rejects valid output is no engine. Special tokens
(``<|im_start|>`` and friends) must never be allowed inside a value: the run checks that
too (xgrammar needs them blanked in the vocabulary it is given, see ``xgrammar_info``).

    python -m bench.grammar_bench [--reps 3] [--threads N] [--json out.json] [--markdown out.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from bench.common import table

# -- workloads ---------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
    "required": ["name", "age", "email"],
}

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "city"],
                },
            },
            "required": ["name", "address"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "quantity", "price"],
            },
            "minItems": 1,
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "status", "customer", "items", "note"],
}

WIDE = {
    "type": "object",
    "properties": {
        f"field_{i:02d}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"type": "number"}][i % 4]
        for i in range(40)
    },
    "required": [f"field_{i:02d}" for i in range(40)],
}

TOOL_CALL = {  # what tool_choice="required" / a named function compiles to
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
    "required": ["name", "arguments"],
}

ARITH_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # json | regex | choice | ebnf
    spec: Any
    output: str  # a valid output, tokenized canonically for the step loop


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(", ", ": "))


WORKLOADS = [
    Workload("json_object", "json", {"type": "object"}, _dump({"answer": "Paris", "confidence": 0.93, "sources": ["atlas", "wiki"]})),
    Workload("schema_person", "json", PERSON, _dump({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"})),
    Workload(
        "schema_order",
        "json",
        ORDER,
        _dump(
            {
                "order_id": "ABC-1234",
                "status": "shipped",
                "customer": {"name": "Grace", "address": {"street": "1 Main St", "city": "Arlington", "zip": "22201"}},
                "items": [
                    {"sku": "X-1", "quantity": 2, "price": 9.99, "tags": ["blue", "sale"]},
                    {"sku": "Y-22", "quantity": 1, "price": 120.5},
                ],
                "note": None,
            }
        ),
    ),
    Workload(
        "schema_wide_40",
        "json",
        WIDE,
        _dump({f"field_{i:02d}": ["value", i * 7, i % 3 == 0, i / 8][i % 4] for i in range(40)}),
    ),
    Workload("tool_call", "json", TOOL_CALL, _dump({"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}})),
    Workload("regex_email", "regex", r"[a-z]+(\.[a-z]+)*@[a-z]+\.(com|org|net)", "grace.hopper@navy.org"),
    Workload("choice", "choice", ["strongly positive", "somewhat positive", "neutral", "somewhat negative"], "somewhat negative"),
    Workload("ebnf_arith", "ebnf", ARITH_GBNF, "(12+7)*3-48/(2+2)"),
]

# -- engines -----------------------------------------------------------------------------


class Engine:
    """One grammar engine behind the four calls the benchmark times."""

    name: str

    def compile(self, w: Workload) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, m: Any, token: int) -> bool: ...
    def accepting(self, m: Any) -> bool: ...
    def reset(self, m: Any) -> None: ...


def xgrammar_info(tokenizer):
    """xgrammar's view of the vocabulary. Special tokens are blanked: given their text,
    xgrammar treats ``<|im_start|>`` as the literal characters and allows it inside JSON
    strings; an empty entry makes it a special token that no grammar allows."""
    import xgrammar as xgr

    stop = set(tokenizer.eos_token_ids)
    vocab = [
        "" if (i in tokenizer.special_ids and i not in stop) else tokenizer.id_to_token(i)
        for i in range(tokenizer.vocab_size)
    ]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(stop))


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tokenizer, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgrammar_info(tokenizer)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.threads = threads
        self.compiler().compile_regex("warm")  # one-time initialisation out of the figures

    def compiler(self):
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def compile(self, w: Workload) -> Any:
        c = self.compiler()
        if w.kind == "json":
            return c.compile_json_schema(json.dumps(w.spec), any_whitespace=True, strict_mode=False)
        if w.kind == "regex":
            return c.compile_regex(w.spec)
        if w.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in w.spec))
        return c.compile_grammar(w.spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m, token) -> bool:
        return m.accept_token(token)

    def accepting(self, m) -> bool:
        return m.is_terminated() or any(m.accept_token(t) and (m.rollback(1) or True) for t in self.info.stop_token_ids)

    def reset(self, m) -> None:
        m.reset()


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tokenizer, threads: int) -> None:
        import llguidance as llg
        import llguidance.torch as llt

        self.llg, self.llt = llg, llt
        self.tok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=list(tokenizer.eos_token_ids))
        self.executor = llg.LLExecutor(num_threads=threads)

    def compile(self, w: Workload) -> Any:
        llg = self.llg
        if w.kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(w.spec))
        elif w.kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(w.spec)
        elif w.kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(w.spec))
        else:
            grammar = llg.grammar_from("ebnf", w.spec)
        m = llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar, m

    def matcher(self, compiled: Any) -> Any:
        return compiled[1].deep_copy()

    def fill(self, m, bitmask, row) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms, bitmask) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def accept(self, m, token) -> bool:
        return m.consume_token(token)

    def accepting(self, m) -> bool:
        return m.is_accepting()

    def reset(self, m) -> None:
        m.reset()


# -- measurements ------------------------------------------------------------------------


def _bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


@dataclass
class Result:
    engine: str
    workload: str
    compile_ms: list[float] = field(default_factory=list)
    first_mask_ms: list[float] = field(default_factory=list)
    step_us: list[float] = field(default_factory=list)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def run_single(engine: Engine, w: Workload, tokens: list[int], specials: list[int], vocab: int, reps: int) -> Result:
    r = Result(engine.name, w.name)
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for _ in range(reps):
        compiled, dt = _timed(lambda: engine.compile(w))
        r.compile_ms.append(dt * 1e3)
        m = engine.matcher(compiled)
        _, dt = _timed(lambda: engine.fill(m, bitmask, 0))
        r.first_mask_ms.append(dt * 1e3)
        for i, t in enumerate(tokens):
            if i:
                _, dt = _timed(lambda: engine.fill(m, bitmask, 0))
                r.step_us.append(dt * 1e6)
            if not _bit(bitmask, 0, t):
                raise AssertionError(f"{engine.name} masks out token {t} at step {i} of {w.name}")
            if i == 0 or i == len(tokens) // 2:
                allowed = [s for s in specials if _bit(bitmask, 0, s)]
                if allowed:
                    raise AssertionError(f"{engine.name} allows special tokens {allowed} inside {w.name}")
            if not engine.accept(m, t):
                raise AssertionError(f"{engine.name} rejects token {t} at step {i} of {w.name}")
        if not engine.accepting(m):
            raise AssertionError(f"{engine.name} does not accept the complete {w.name} output")
    return r


def run_batch(engine: Engine, compiled: dict[str, Any], seqs: dict[str, list[int]], vocab: int, batch: int, steps: int) -> list[float]:
    """``batch`` matchers round-robin over the workloads, staggered; per-step batch fill."""
    names = list(seqs)
    rows = []
    for i in range(batch):
        name = names[i % len(names)]
        m = engine.matcher(compiled[name])
        pos = (i * 7) % len(seqs[name])
        for t in seqs[name][:pos]:
            engine.accept(m, t)
        rows.append([m, name, pos])
    bitmask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)
    ms = [row[0] for row in rows]
    engine.fill_batch(ms, bitmask)  # warm
    times = []
    for _ in range(steps):
        _, dt = _timed(lambda: engine.fill_batch(ms, bitmask))
        times.append(dt * 1e6)
        for row in rows:
            m, name, pos = row
            seq = seqs[name]
            if not engine.accept(m, seq[pos]):
                raise AssertionError(f"{engine.name} batch: rejects {name} token {pos}")
            row[2] = pos + 1
            if row[2] == len(seq):
                engine.reset(m)
                row[2] = 0
    return times


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "mean": statistics.fmean(s),
        "p50": s[len(s) // 2],
        "p99": s[min(len(s) - 1, int(len(s) * 0.99))],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="cold compiles and walks per workload")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for compiling and batched masks")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="batched steps timed")
    ap.add_argument("--json", help="write raw figures here")
    ap.add_argument("--markdown", help="write the tables here")
    args = ap.parse_args(argv)

    from libs.model.source import load_tokenizer

    tok = load_tokenizer(None)
    vocab = tok.vocab_size
    specials = sorted(s for s in tok.special_ids if s not in tok.eos_token_ids)
    seqs = {w.name: tok.encode(w.output, add_special_tokens=False) for w in WORKLOADS}
    engines: list[Engine] = [XGrammar(tok, args.threads), LLGuidance(tok, args.threads)]

    results: dict[str, dict[str, Any]] = {}
    for e in engines:
        per = {}
        for w in WORKLOADS:
            r = run_single(e, w, seqs[w.name], specials, vocab, args.reps)
            per[w.name] = {
                "compile_ms": statistics.median(r.compile_ms),
                "first_mask_ms": statistics.median(r.first_mask_ms),
                "step_us": _stats(r.step_us),
                "tokens": len(seqs[w.name]),
            }
        compiled = {w.name: e.compile(w) for w in WORKLOADS}
        per["batch1_all"] = {"step_us": _stats(run_batch(e, compiled, seqs, vocab, 1, args.steps))}
        per[f"batch{args.batch}"] = {"step_us": _stats(run_batch(e, compiled, seqs, vocab, args.batch, args.steps))}
        results[e.name] = per

    x, l = results["xgrammar"], results["llguidance"]
    rows = []
    for w in WORKLOADS:
        a, b = x[w.name], l[w.name]
        rows.append(
            [
                w.name,
                a["tokens"],
                f"{a['compile_ms']:.2f} / {b['compile_ms']:.2f}",
                f"{a['first_mask_ms']:.3f} / {b['first_mask_ms']:.3f}",
                f"{a['compile_ms'] + a['first_mask_ms']:.2f} / {b['compile_ms'] + b['first_mask_ms']:.2f}",
                f"{a['step_us']['mean']:.1f} / {b['step_us']['mean']:.1f}",
                f"{a['step_us']['p99']:.1f} / {b['step_us']['p99']:.1f}",
            ]
        )
    single = table(
        ["workload", "tokens", "compile ms (xgr / llg)", "first mask ms", "compile + first mask ms", "mask µs/step mean, batch 1", "p99"],
        rows,
    )
    brow = []
    for key in ("batch1_all", f"batch{args.batch}"):
        a, b = x[key]["step_us"], l[key]["step_us"]
        brow.append([key, f"{a['mean']:.1f} / {b['mean']:.1f}", f"{a['p50']:.1f} / {b['p50']:.1f}", f"{a['p99']:.1f} / {b['p99']:.1f}", f"{b['mean'] / a['mean']:.2f}"])
    batched = table(["batch (mixed workloads)", "µs/step mean (xgr / llg)", "p50", "p99", "llg / xgr mean"], brow)
    from importlib.metadata import version

    header = (
        f"xgrammar {version('xgrammar')}, llguidance {version('llguidance')}, "
        f"threads {args.threads}, reps {args.reps}, batched steps {args.steps}, vocab {vocab}"
    )
    text = f"{header}\n\n{single}\n\n{batched}\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
