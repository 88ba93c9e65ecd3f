"""A request's grammar state on a prefill or decode instance (structured outputs).

Compiling runs on a thread (``GrammarCompiler.compile_async``, cached by spec) so the event
loop never waits on it; the fresh state replays what was generated before this instance
got the request (decode: prefill's first token, and a resumed stream's earlier output).
A spec that does not compile, or tokens that do not follow it, are the request's fault:
an ``InvalidRequestError`` answered 400 like every other bad request.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from libs.engine import InvalidRequestError
from libs.protocol.messages import StructuredSpec
from libs.structured import GrammarError, GrammarMatcher
from services.worker.convert import grammar_spec
from services.worker.runtime import WorkerRuntime


async def start_grammar(rt: WorkerRuntime, spec: StructuredSpec | None, replay: Sequence[int] = ()) -> GrammarMatcher | None:
    """The request's fresh grammar state advanced by ``replay``; None when unconstrained."""
    engine_spec = grammar_spec(spec)
    if engine_spec is None:
        return None
    try:
        compiled = await rt.llm.grammars.compile_async(engine_spec)
        return await asyncio.get_running_loop().run_in_executor(None, rt.llm.start_grammar, compiled, list(replay))
    except GrammarError as e:
        raise InvalidRequestError(str(e), param="sampling.structured") from None
