"""What the engine hands back: per-step request outputs and finished offline results,
and their assembly from a request's sequences (its *family*: one, or ``n`` forks).

A request's output carries only what is new since its last report (``Sequence.take_new``);
its final output also carries the request's timing metrics, the exported KV of a
prefill-only request and its prompt logprobs once complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from libs.engine import prompt_logprobs
from libs.engine.sequence import Sequence, TokenLogprob

if TYPE_CHECKING:
    from libs.engine.kv_export import ExportedKV, ExportQueue
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


def family_done(family: list[Sequence]) -> bool:
    """Every sequence of the request finished, its KV exported, no fork still to spawn."""
    return all(s.is_finished and not s.export_pending for s in family) and family[0].pending_forks == 0


def request_output(request_id: str, family: list[Sequence], exports: "ExportQueue") -> RequestOutput:
    """What the request's sequences produced since the last report."""
    if len(family) == 1:
        seq = family[0]
        ids, lps = seq.take_new()
        outs = [CompletionOutput(0, ids, lps, seq.finish_reason, seq.num_output_tokens)] if ids or seq.is_finished else []
        finished = seq.is_finished and not seq.export_pending and seq.pending_forks == 0
    else:
        outs = []
        for seq in family:
            ids, lps = seq.take_new()
            if ids or seq.is_finished:
                outs.append(CompletionOutput(seq.index, ids, lps, seq.finish_reason, seq.num_output_tokens))
        finished = family_done(family)
    head = family[0]
    metrics = {}
    if finished:  # (reported once, with the final output)
        if head.first_scheduled_time is not None:
            metrics["queue_s"] = head.first_scheduled_time - head.arrival_time
        if head.first_token_time is not None:
            metrics["ttft_s"] = head.first_token_time - head.arrival_time
            # when the first token's id was on the host (time.monotonic): services put it in
            # their traces' timelines, apart from when their event loop had it
            metrics["first_token_monotonic"] = head.first_token_time
    return RequestOutput(
        request_id,
        outs,
        finished,
        head.num_prompt_tokens,
        head.num_cached_tokens,
        head.num_imported_tokens,
        exports.result(head) if finished else None,
        metrics,
        prompt_logprobs=prompt_logprobs.take_complete(head),
    )


def aborted_output(request_id: str, family: list[Sequence]) -> RequestOutput:
    """The final output of an aborted request: what each sequence had not reported yet."""
    head = family[0] if family else None
    outs = [CompletionOutput(s.index, *s.take_new(), "abort", s.num_output_tokens) for s in family]
    return RequestOutput(request_id, outs, True, head.num_prompt_tokens if head else 0, head.num_cached_tokens if head else 0)
