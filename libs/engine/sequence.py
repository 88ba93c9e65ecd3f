"""A sequence: one stream of tokens being generated, and where its KV lives.

A request with ``n > 1`` becomes ``n`` sequences that share the prompt's KV blocks: the
first one computes the prompt, the others are forked from it when it samples its first
token (libs/engine/forks.py). ``token_ids`` is prompt + output as known on the host;
``num_computed_tokens`` of them have their KV in the cache; the scheduler feeds the rest.

While a sequence runs it owns a row of the engine's persistent ``InputBatch``
(libs/engine/input_batch.py), and the row's arrays are the truth for its per-step
counters: ``num_computed_tokens`` reads and writes the row, so a decode step advances
every running sequence with one vectorised add instead of a Python loop. Off the batch
(waiting, finished) the counters live on the sequence itself.

With async scheduling a sampled token may still be on its way from the device:
``num_pending`` counts those (the batch row counts them in its ``num_tokens``); they are
appended to ``token_ids`` when the step's ids are read back, one step late.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from libs.engine.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kernels.swap import StagingBuffer
    from libs.engine.prompt_logprobs import PromptLogprobs
    from libs.structured import GrammarMatcher
    from libs.engine.input_batch import InputBatch

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top-k alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class KVImport:
    """KV of a run of a sequence's blocks, loaded from elsewhere (the pool) into staging.

    The first ``num_blocks`` rows of ``buffers`` (in order; default: every row) are the
    sequence's blocks ``first_block, first_block + 1, ...`` in pool layout; together they
    cover the sequence's tokens up to position ``num_tokens`` (the last block may be
    partial). The engine copies what it needs into its cache and calls ``release()``,
    which hands the staging buffers back; release is idempotent.
    """

    buffers: list["StagingBuffer"]
    first_block: int
    num_tokens: int
    num_blocks: int = -1

    def __post_init__(self) -> None:
        rows = sum(b.n for b in self.buffers)
        if self.num_blocks < 0:
            self.num_blocks = rows
        if self.num_blocks > rows or self.first_block < 0:
            raise ValueError(f"KVImport of {self.num_blocks} blocks from staging with {rows} rows")

    def release(self) -> None:
        buffers, self.buffers = self.buffers, []
        for b in buffers:
            b.release()


@dataclass(eq=False)  # identity: sequences are compared and hashed as objects
class Sequence:
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.batch: "InputBatch | None" = None  # set while the sequence owns a row
        self.row = -1
        self._num_computed = 0
        self.num_pending = 0  # sampled tokens not read back yet (off the batch only)
        self.num_cached_tokens = 0  # prompt tokens found in the local prefix cache
        self.num_imported_tokens = 0  # prompt tokens whose KV was loaded from the pool
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []  # chain keys of this sequence's full blocks, in order
        self.num_committed_blocks = 0  # leading blocks already published to the prefix cache
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.generator: "torch.Generator | None" = None
        self.pending_forks = 0  # siblings to fork off when the prompt's first token is sampled
        self.kv_import: KVImport | None = None
        self.export_kv = False  # prefill role: gather the prompt's KV before freeing
        self.export_buffers: list[StagingBuffer] = []  # the prompt's KV, gathered after it finished
        self.export_pending = False  # finished, blocks held until the export is gathered
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.new_token_ids: list[int] = []  # produced since the last output was reported
        self.new_logprobs: list[TokenLogprob] = []
        self.was_preempted = False
        self.grammar: "GrammarMatcher | None" = None  # structured output: what may come next
        self.capture_logits = False  # keep the first sampled row's logits (tests, debugging)
        self.captured_logits: "torch.Tensor | None" = None
        self.prompt_scores: "PromptLogprobs | None" = None  # prompt_logprobs, chunk by chunk
        self.prompt_scores_reported = False
        # Stop tests, precomputed: a sampled token is checked against these two only.
        self.stop_ids = frozenset(self.params.stop_token_ids) | (frozenset() if self.params.ignore_eos else frozenset(self.eos_token_ids))
        self.max_len = self.num_prompt_tokens + self.params.max_tokens if self.params.max_tokens is not None else 1 << 62

    @property
    def num_computed_tokens(self) -> int:
        b = self.batch
        return self._num_computed if b is None else int(b.num_computed[self.row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        b = self.batch
        if b is None:
            self._num_computed = value
        else:
            b.num_computed[self.row] = value

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host (prompt + output read back so far)."""
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        b = self.batch
        return len(self.token_ids) + self.num_pending if b is None else int(b.num_tokens[self.row])

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        self.new_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.new_logprobs.append(logprob)

    def check_stop(self, max_model_len: int) -> str | None:
        """Why generation should stop after the last appended token, or None: the usual
        reasons, or a grammar (structured outputs) that is complete."""
        p = self.params
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return "stop"
            if last in p.stop_token_ids:
                return "stop"
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length"
        if self.num_tokens >= max_model_len:
            return "length"
        if self.grammar is not None and self.grammar.is_terminated:  # a complete grammar
            return "stop"
        return None

    def min_tokens_banned(self) -> list[int]:
        """Token ids that may not be sampled next: before ``min_tokens`` outputs, the stop
        tokens and (unless ``ignore_eos``) EOS, so generation cannot end early (vLLM)."""
        p = self.params
        if self.num_output_tokens >= p.min_tokens:
            return []
        return [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]

    def take_new(self) -> tuple[list[int], list[TokenLogprob]]:
        ids, lps = self.new_token_ids, self.new_logprobs
        self.new_token_ids, self.new_logprobs = [], []
        return ids, lps
