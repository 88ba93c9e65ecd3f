"""Sampling parameters, validated up front so a bad value never reaches the device."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from libs.engine.errors import InvalidSamplingParamsError

MAX_LOGPROBS = 20
MAX_N = 128
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Defaults follow the OpenAI API (temperature 1, top_p 1).

    ``logit_bias``: ``(token id, bias)`` pairs (a dict is accepted) added to the logits
    before sampling, as OpenAI defines it; a bias of -100 bans the token outright.
    ``temperature == 0`` (or below 1e-5) is greedy. ``top_k <= 0`` disables top-k. ``logprobs``: ``None``
    returns none; ``k`` in 0..20 returns the chosen token's logprob and the top ``k``.
    Logprobs are the model's raw distribution (before temperature, penalties and filters),
    as vLLM and OpenAI report them. ``prompt_logprobs``: ``k`` in 0..20 also scores the
    prompt (each token after the first, with the top ``k``; libs/engine/prompt_logprobs.py),
    computing all of it (no prefix-cache hit, no KV import).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids", "must be a list of token ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple((t, float(b) if _finite(b) else b) for t, b in bias)
        except (TypeError, ValueError):
            pairs = None
        _check(pairs is not None, "logit_bias", "must map token ids to biases", self.logit_bias)
        object.__setattr__(self, "logit_bias", pairs)
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]", self.n)
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0", self.temperature)
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0), "top_k", "must be -1 (off), 0 (off) or a positive integer", self.top_k)
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_finite(v) and -2 <= v <= 2, name, "must be in [-2, 2]", v)
        _check(_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty", "must be in (0, 10]", self.repetition_penalty)
        _check(self.seed is None or (_is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX), "seed", "must be an integer (64-bit)", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens", "must be a positive integer", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be a non-negative integer", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens", self.min_tokens)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers", self.stop_token_ids)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean", self.ignore_eos)
        _check(
            all(_is_int(t) and t >= 0 and _finite(b) and -100 <= b <= 100 for t, b in self.logit_bias),
            "logit_bias", "must map non-negative token ids to biases in [-100, 100]", self.logit_bias,
        )
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        _check(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
            "prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]", self.prompt_logprobs,
        )

    @property
    def greedy(self) -> bool:
        # Below _GREEDY_TEMPERATURE sampling is argmax anyway, and logits / T would
        # overflow float32 (T = 1e-40 gives inf - inf = NaN): treat it as greedy (vLLM too).
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_child(self, index: int) -> "SamplingParams":
        """Parameters of the ``index``-th of ``n`` sequences: one sample each, and a derived
        seed so the n sequences differ but each is reproducible."""
        seed = None if self.seed is None else (self.seed + index) % (2**64)
        return replace(self, n=1, seed=seed)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(ok: bool, name: str, what: str, value: object) -> None:
    if not ok:
        raise InvalidSamplingParamsError(f"{name} {what}, got {value!r}", param=name)
