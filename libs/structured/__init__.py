"""Structured outputs: constraining what a sequence may generate to a grammar.

How it works (vLLM v1's design, with llguidance as the grammar engine; see compiler.py
for why llguidance):

- A request carries a :class:`GrammarSpec` (JSON schema, any JSON object, regex, choice,
  EBNF/Lark grammar). The service compiles it off its event loop into a
  :class:`CompiledGrammar` (cached by spec) before handing the request to the engine; a
  malformed spec is a :class:`GrammarError` naming the problem, answered 400.
- Each sequence gets its own :class:`GrammarMatcher` (``n > 1`` siblings copy it).
- Every step, the bitmasks of the constrained rows are filled on a host thread
  (``libs.structured.bitmask.BitmaskFiller``; it needs torch, so it is not imported
  here: the router validates constraints with this package without torch), batched across requests, while the device runs the forward
  pass; the sampler applies them to the logits on the device
  (``kernels.bitmask.apply_token_bitmask_``) before any other processing that could pick a
  token. Unconstrained rows are never touched, and a step without constraints does no work.
- The sampled token advances the matcher. A sequence whose grammar is complete (EOS
  accepted, or nothing may follow) finishes with ``stop``.
- In PD, prefill compiles the same spec and constrains the first token; decode owns the
  grammar state for the rest: it replays the first token (and, for a stream the router
  resumed after a failure, everything generated before) into a fresh matcher.
- Speculative decoding: constrained sequences do not speculate (their drafts would need
  a mask per draft position and a rollback on rejection; :meth:`GrammarMatcher.rollback`
  exists for the day they do).
"""

from libs.structured.compiler import CompiledGrammar, GrammarCompiler
from libs.structured.matcher import GrammarMatcher, GrammarMismatchError
from libs.structured.spec import GrammarError, GrammarSpec

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarMismatchError",
    "GrammarSpec",
]
