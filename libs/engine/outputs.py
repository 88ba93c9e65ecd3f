"""What the engine hands back: per-step request outputs and finished offline results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libs.engine.sequence import TokenLogprob

if TYPE_CHECKING:
    from libs.engine.kv_export import ExportedKV
    from libs.engine.prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """What one sequence of a request produced since the last report."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None
    num_output_tokens: int


@dataclass(slots=True)
class RequestOutput:
    """One step's news about one request: new tokens of each sequence, and whether it ended.

    ``exported_kv`` is set on the final output of a prefill-only (``export_kv``) request,
    and, with ``stream_export``, on unfinished outputs carrying the blocks a chunk completed
    (libs/engine/kv_export.py); ``metrics`` (``queue_s``, ``ttft_s``) on the final output
    of every request. ``prompt_logprobs`` (asked by ``SamplingParams``) comes once, on the
    output of the step that finished the prompt, the first token's step."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    num_imported_tokens: int = 0
    exported_kv: "ExportedKV | None" = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: "PromptLogprobs | None" = None
    error: str | None = None  # the request failed in the engine (finish reason "error")


@dataclass
class GenerationResult:
    """A finished sequence from the offline API (``LLM.generate``)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob]
    num_cached_tokens: int
    index: int = 0
    prompt_logprobs: "PromptLogprobs | None" = None  # when SamplingParams.prompt_logprobs asked
