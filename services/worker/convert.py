"""Wire types (libs/protocol) to engine types (libs/engine) and back, in one place."""

from __future__ import annotations

import time

from libs.engine import SamplingParams, TokenLogprob
from libs.engine.prompt_logprobs import PromptLogprobs as EnginePromptLogprobs
from libs.structured import GrammarSpec
from libs.protocol.messages import PromptLogprobs, SamplingSpec, StructuredSpec, TokenLogprobs


def sampling_params(spec: SamplingSpec, *, max_tokens: int | None = None, n: int | None = None) -> SamplingParams:
    """Engine parameters for a wire spec; raises InvalidSamplingParamsError on bad values."""
    return SamplingParams(
        n=spec.n if n is None else n,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        seed=spec.seed,
        max_tokens=spec.max_tokens if max_tokens is None else max_tokens,
        min_tokens=min(spec.min_tokens, spec.max_tokens if max_tokens is None else max_tokens),
        stop_token_ids=tuple(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
        logprobs=spec.logprobs,
        logit_bias=tuple(zip(spec.logit_bias_ids, spec.logit_bias_values)),
        prompt_logprobs=spec.prompt_logprobs,
    )


def grammar_spec(spec: StructuredSpec | None) -> GrammarSpec | None:
    """The engine's constraint for a wire one (None: unconstrained)."""
    if spec is None:
        return None
    return GrammarSpec(spec.kind, spec.value, spec.strict)


def wire_logprob(lp: TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top_ids=list(lp.top_ids), top_logprobs=list(lp.top_logprobs))


def wire_prompt_logprobs(scores: EnginePromptLogprobs | None) -> PromptLogprobs | None:
    if scores is None:
        return None
    return PromptLogprobs(token_ids=scores.token_ids, logprobs=scores.logprobs, top_ids=scores.top_ids, top_logprobs=scores.top_logprobs)


def engine_logprob(lp: TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, list(lp.top_ids), list(lp.top_logprobs))


def wall_clock(perf: float, clock=time.perf_counter) -> float:  # noqa: ANN001 - a time function
    """The wall-clock time (``time.time()``) of a ``clock()`` reading (``time.perf_counter``,
    or the engine's ``time.monotonic``): traces state phases in wall time so those of the
    services on one host line up in one timeline (bench/gpu_pd.py prints it)."""
    return time.time() - (clock() - perf)
