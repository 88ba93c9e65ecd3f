"""Prompt logprobs (vLLM's ``prompt_logprobs``): how likely the model found each prompt token
given the tokens before it, with the top-k alternatives at each position. It is what
``echo`` with ``logprobs`` shows on completions, and what scoring and perplexity
pipelines read.

Computed during prefill from the hidden states the forward already produces for every
prompt position: the LM head runs over the rows of the sequences that ask (only theirs;
other prompts still compute logits for their last row alone), then a log-softmax,
gathered at the next prompt token. Position ``p``'s logits predict token ``p + 1``, so a
chunk of positions ``[start, start + n)`` scores tokens ``start + 1 .. start + n``,
except that the last prompt position predicts the first *generated* token, whose logprob
the sampler reports. Chunked prefill scores chunk after chunk; entries are appended by
position, so a chunk computed twice (a preempted sequence computes its prompt again)
adds nothing twice, and the whole is ``len(prompt) - 1`` entries in order.

The work rides on the step (``Step.prompt_rows``, laid out by the engine with the chunk's
rows after the step's decode rows) and runs in the runner's forward, right after the model,
from the same hidden states; the results come back with the step's ids (``StepResult``),
one host read per scored chunk (a step with scored rows syncs there). Under tensor
parallelism the LM head gathers the vocabulary across ranks, so every rank runs the same
LM-head passes (the spans travel in the ``ForwardPlan``) and rank 0 alone scores.

What is scored must be computed: a sequence that asks takes nothing from the prefix cache
or from a KV import (as vLLM v1 skips its prefix cache for such requests), which the
block manager and the engine check with :func:`needs_scoring`.

The log-probabilities are the model's raw distribution (before penalties, bias and
temperature), as the sampled tokens' logprobs are (libs/engine/sampler.py). The LM head
is applied to at most :data:`ROWS_PER_PASS` rows at a time, so a long prompt never holds
a ``[len(prompt), vocab]`` float32 matrix at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch

if TYPE_CHECKING:
    from libs.engine.sequence import Sequence

ROWS_PER_PASS = 256  # 256 x 49,152 float32 logits: 48 MiB per pass for SmolLM2's vocabulary


@dataclass
class PromptLogprobs:
    """A prompt's scores so far: entry ``i`` is prompt token ``i + 1``'s."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend_from(self, position: int, other: "PromptLogprobs") -> None:
        """Append ``other``, which scores tokens from ``position + 1`` on, skipping what this
        already holds (a chunk computed again)."""
        if position > len(self):
            raise ValueError(f"prompt scores for position {position} after only {len(self)}: a chunk was skipped")
        skip = len(self) - position
        self.token_ids += other.token_ids[skip:]
        self.logprobs += other.logprobs[skip:]
        self.top_ids += other.top_ids[skip:]
        self.top_logprobs += other.top_logprobs[skip:]


@dataclass(frozen=True)
class PromptRows:
    """One sequence's prompt rows in a step's hidden states and the tokens they predict.

    ``row``: its first row among the step's flattened tokens; ``position``: that row's
    position in the prompt; ``targets``: the next prompt token of each row that predicts
    one (rows past the prompt's second-to-last position predict generated tokens)."""

    seq: "Sequence"
    row: int
    position: int
    targets: tuple[int, ...]
    k: int


def needs_scoring(seq: "Sequence") -> bool:
    """Whether ``seq`` still has prompt tokens to score (and so must compute its prompt)."""
    k = seq.params.prompt_logprobs
    return k is not None and seq.index == 0 and (seq.prompt_scores is None or len(seq.prompt_scores) < seq.num_prompt_tokens - 1)


def rows_to_score(seq: "Sequence", row: int, start: int, num_tokens: int) -> PromptRows | None:
    """The rows of a step chunk (``num_tokens`` tokens of ``seq`` from ``start``, at ``row``
    in the step) that score prompt tokens, or None."""
    if not needs_scoring(seq):
        return None
    prompt = seq.prompt_token_ids
    end = min(start + num_tokens, len(prompt) - 1)  # the last prompt position predicts an output
    if end <= start:
        return None
    return PromptRows(seq, row, start, tuple(prompt[start + 1 : end + 1]), seq.params.prompt_logprobs)


def plan(chunks: Iterable[tuple["Sequence", int, int]], first_row: int = 0) -> list[PromptRows]:
    """The step's scoring work from its chunks ``(seq, start, num_tokens)``, in step order,
    the first chunk's rows starting at ``first_row`` (after the step's decode rows)."""
    out, row = [], first_row
    for seq, start, n in chunks:
        rows = rows_to_score(seq, row, start, n)
        if rows is not None:
            out.append(rows)
        row += n
    return out


def spans(work: Iterable[PromptRows]) -> tuple[tuple[int, int], ...]:
    """``(first row, rows)`` of each entry: what every tensor-parallel rank runs the LM head on."""
    return tuple((w.row, len(w.targets)) for w in work)


@torch.inference_mode()
def score(
    hidden: torch.Tensor,
    rows: tuple[tuple[int, int], ...],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    work: list[PromptRows] | None,
) -> list[PromptLogprobs]:
    """Each entry's scores from the step's final hidden states ``[T, hidden]``.

    ``rows`` are the entries' :func:`spans`; ``compute_logits`` is the model's LM head
    (fp32 logits). A tensor-parallel rank other than 0 passes no ``work``: it runs the same
    LM-head passes (their all-gathers) and gets nothing back."""
    results = []
    for i, (row, n) in enumerate(rows):
        w = work[i] if work is not None else None
        targets = torch.tensor(w.targets, dtype=torch.long, device=hidden.device) if w is not None else None
        chosen, top_vals, top_ids = [], [], []
        for lo in range(0, n, ROWS_PER_PASS):
            hi = min(n, lo + ROWS_PER_PASS)
            logits = compute_logits(hidden[row + lo : row + hi])
            if w is None:
                continue
            logprobs = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
            chosen.append(logprobs.gather(1, targets[lo:hi].unsqueeze(1)).squeeze(1))
            if w.k > 0:
                vals, ids = logprobs.topk(w.k, dim=-1)
                top_vals.append(vals)
                top_ids.append(ids)
        if w is None:
            continue
        result = PromptLogprobs(token_ids=list(w.targets), logprobs=torch.cat(chosen).tolist())
        if w.k > 0:
            result.top_ids = torch.cat(top_ids).tolist()
            result.top_logprobs = torch.cat(top_vals).tolist()
        else:
            result.top_ids = [[] for _ in range(n)]
            result.top_logprobs = [[] for _ in range(n)]
        results.append(result)
    return results


def record(work: list[PromptRows] | None, results: list[PromptLogprobs] | None) -> None:
    """Append each chunk's scores to its sequence's (``Sequence.prompt_scores``)."""
    for w, r in zip(work or (), results or ()):
        if w.seq.prompt_scores is None:
            w.seq.prompt_scores = PromptLogprobs()
        w.seq.prompt_scores.extend_from(w.position, r)


def take_complete(seq: "Sequence") -> PromptLogprobs | None:
    """``seq``'s scores once the whole prompt is scored, the first time it is asked."""
    if seq.params.prompt_logprobs is None or seq.index != 0 or seq.prompt_scores_reported:
        return None
    scores = seq.prompt_scores or PromptLogprobs()  # a one-token prompt has nothing to score
    if len(scores) < seq.num_prompt_tokens - 1:
        return None
    seq.prompt_scores_reported = True
    return scores
