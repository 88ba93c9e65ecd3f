"""``--speculative-config``: which proposer, how many drafts, and the knobs around them.

The JSON has vLLM's shape, so a command line written for vLLM's n-gram or draft-model
speculation works here unchanged::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}
    {"model": "/models/draft", "num_speculative_tokens": 4}          # method inferred
    {"method": "self_draft", "num_draft_layers": 6, "num_speculative_tokens": 3,
     "draft_vocab": "vocab.safetensors"}

Keys vLLM has and Tidepool reads: ``method``, ``num_speculative_tokens``, ``model``,
``prompt_lookup_min``/``prompt_lookup_max`` (vLLM's defaults: both 5, one given sets the
other). Tidepool's own keys:

- ``num_draft_layers`` (``self_draft``): how many of the target's first layers draft;
- ``draft_vocab``: a pruned draft vocabulary (``python -m libs.engine.spec.vocab``) for the
  model-based proposers;
- ``acceptance_window``, ``min_acceptance_length``, ``reprobe_interval``: the per-sequence
  adaptive switch-off (libs/engine/spec/adaptive.py); ``min_acceptance_length`` 0 disables it;
- ``async_prepare``: ``auto`` (on CUDA), ``on`` or ``off``: build each verify step's
  inputs on a worker thread while the target's forward runs (libs/engine/spec/verify.py);
- ``forced_acceptance``: a test and benchmark mode (seed 001's "force accept"): instead of
  rejection sampling, the first ``round(r * k)`` drafts of every round are accepted and the
  target samples the token after them. Output is then not the model's; never serve with it.

Anything else, a wrong type or a value out of range is a ``ValueError`` naming the key,
raised at start-up (the services turn it into exit status 2, ``tidepool generate`` too).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "self_draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    num_draft_layers: int | None = None
    draft_vocab: str | None = None
    acceptance_window: int = 8
    min_acceptance_length: float = 1.3
    reprobe_interval: int = 16
    forced_acceptance: float | None = None
    async_prepare: str = "auto"

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def uses_draft_model(self) -> bool:
        return self.method in ("draft_model", "self_draft")

    def forced_accepts(self, num_drafts: int) -> int:
        """Forced mode: drafts accepted out of ``num_drafts`` (``round(r * n)``, half up)."""
        assert self.forced_acceptance is not None
        return min(num_drafts, int(math.floor(self.forced_acceptance * num_drafts + 0.5)))

    def resolve_async_prepare(self, device_type: str) -> bool:
        return self.async_prepare == "on" or (self.async_prepare == "auto" and device_type == "cuda")

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})


_INT_KEYS = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_draft_layers", "acceptance_window", "reprobe_interval")
_FLOAT_KEYS = ("min_acceptance_length", "forced_acceptance")
_STR_KEYS = ("method", "model", "draft_vocab", "async_prepare")
_KNOWN = set(_INT_KEYS) | set(_FLOAT_KEYS) | set(_STR_KEYS)


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """``None``/empty → speculation off; JSON text or a dict → a validated config."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("speculative config must be a JSON object")
    unknown = sorted(set(value) - _KNOWN)
    if unknown:
        raise ValueError(f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(_KNOWN))}")
    d = dict(value)
    for key in _INT_KEYS:
        if d.get(key) is not None and (not isinstance(d[key], int) or isinstance(d[key], bool)):
            raise ValueError(f"speculative config: {key} must be an integer, got {d[key]!r}")
    for key in _FLOAT_KEYS:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"speculative config: {key} must be a number, got {v!r}")
    for key in _STR_KEYS:
        if d.get(key) is not None and not isinstance(d[key], str):
            raise ValueError(f"speculative config: {key} must be a string, got {d[key]!r}")

    method = d.get("method")
    if method is None:
        if d.get("model"):
            method = "draft_model"  # vLLM infers a draft model from "model"
        else:
            raise ValueError("speculative config: method is required (ngram, draft_model or self_draft)")
    if method == "[ngram]":  # vLLM's legacy spelling
        method = "ngram"
    if method not in METHODS:
        raise ValueError(f"speculative config: method {method!r} is not supported; use one of {', '.join(METHODS)}")
    d["method"] = method

    k = d.get("num_speculative_tokens")
    if k is None:
        raise ValueError("speculative config: num_speculative_tokens is required")
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative config: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")

    if method == "ngram":
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo < 1:
            raise ValueError(f"speculative config: prompt_lookup_min must be >= 1, got {lo}")
        if lo > hi:
            raise ValueError(f"speculative config: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        d["prompt_lookup_min"], d["prompt_lookup_max"] = lo, hi
        for key in ("model", "num_draft_layers", "draft_vocab"):
            if d.get(key) is not None:
                raise ValueError(f"speculative config: {key} does not apply to method ngram")
    else:
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if d.get(key) is not None:
                raise ValueError(f"speculative config: {key} applies to method ngram only")
    if method == "draft_model":
        if not d.get("model"):
            raise ValueError("speculative config: method draft_model needs model (a checkpoint folder or .gguf file)")
        if d.get("num_draft_layers") is not None:
            raise ValueError("speculative config: num_draft_layers applies to method self_draft only")
    if method == "self_draft":
        if d.get("model") is not None:
            raise ValueError("speculative config: self_draft drafts with the target's own layers; model does not apply")
        n = d.get("num_draft_layers")
        if n is None or n < 1:
            raise ValueError(f"speculative config: self_draft needs num_draft_layers >= 1, got {n!r}")

    if d.get("acceptance_window", 8) < 1:
        raise ValueError("speculative config: acceptance_window must be >= 1")
    if d.get("reprobe_interval", 16) < 1:
        raise ValueError("speculative config: reprobe_interval must be >= 1")
    mal = d.get("min_acceptance_length", 1.3)
    if not 0 <= mal <= k + 1:
        raise ValueError(f"speculative config: min_acceptance_length must be in [0, {k + 1}], got {mal}")
    if d.get("async_prepare", "auto") not in ("auto", "on", "off"):
        raise ValueError(f"speculative config: async_prepare must be auto, on or off, got {d['async_prepare']!r}")
    fa = d.get("forced_acceptance")
    if fa is not None and not 0 <= fa <= 1:
        raise ValueError(f"speculative config: forced_acceptance must be in [0, 1], got {fa}")
    return SpeculativeConfig(**d)
