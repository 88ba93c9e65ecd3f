"""Admission checks: whether a request can be served at all, before anything is queued.

Each failure is a typed ``InvalidRequestError`` (libs/engine/errors.py) naming the
offending parameter, which the services turn into a 4xx; the engine's state is never
touched by a request that fails here.
"""

from __future__ import annotations

from typing import Sequence as Seq

from libs.engine.errors import InvalidRequestError, PromptTooLongError, TokenOutOfRangeError
from libs.engine.params import SamplingParams


def validate_request(
    prompt_token_ids: Seq[int], params: SamplingParams, *, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int, num_output_tokens: int = 0
) -> None:
    """Raise a typed error if the request cannot be served by an engine of this
    vocabulary, context length and cache size."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be SamplingParams", param="params")
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
    # The common case in C (map/min/max): a 16 x 1024-token batch is admitted before its
    # prefill can launch. Only a prompt that fails is searched for its first bad id.
    if set(map(type, prompt_token_ids)) != {int} or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = [t for t in prompt_token_ids if not (type(t) is int and 0 <= t < vocab_size)]
        raise TokenOutOfRangeError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})", param="prompt")
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise TokenOutOfRangeError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})", param="logit_bias")
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise TokenOutOfRangeError(f"stop token id {bad} is outside the vocabulary [0, {vocab_size})", param="stop_token_ids")
    # ``prompt_token_ids`` may end with ``num_output_tokens`` already generated (an
    # output prefix): they count toward max_tokens, not on top of it.
    n_total = len(prompt_token_ids)
    n_prompt = n_total - num_output_tokens
    if n_total >= max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has {n_total}",
            param="prompt",
        )
    if params.max_tokens is not None and n_prompt + params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; you requested "
            f"{n_prompt + params.max_tokens} ({n_prompt} in the prompt, {params.max_tokens} to generate)",
            param="max_tokens",
        )
    needed = -(-max_model_len // block_size) if params.max_tokens is None else -(-(n_prompt + params.max_tokens) // block_size)
    if needed > num_blocks:
        raise PromptTooLongError(
            f"the request needs up to {needed} KV blocks but the cache holds {num_blocks}",
            param="max_tokens",
        )
