"""Parallel sampling (``n > 1``): siblings forked from the sequence that computed the prompt.

A request with ``n`` samples runs one sequence through the prompt. At the step where it
samples its first token, ``n - 1`` siblings are spawned and sampled in the same step
(each with its own derived seed and its own batch row, drawn from the parent's logits
row); once the step is launched they share the prompt's KV blocks (refcounted, the
partial last block copied after the step), so the prompt is computed once.
"""

from __future__ import annotations

from collections.abc import Callable

from libs.engine.block_manager import BlockManager
from libs.engine.params import SamplingParams
from libs.engine.scheduler import Scheduler
from libs.engine.sequence import Sequence


class Forks:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, block_size: int):
        self._scheduler = scheduler
        self._blocks = block_manager
        self._block_size = block_size

    @staticmethod
    def spawn(parent: Sequence, family: list[Sequence], params: SamplingParams, new_sequence: Callable[..., Sequence]) -> Sequence:
        """A sibling of ``parent`` (same prompt, its own derived seed), sampled this step."""
        child = new_sequence(parent.request_id, len(family), list(parent.prompt_token_ids), params)
        child.token_ids = list(parent.token_ids)
        child.grammar = parent.grammar.copy() if parent.grammar is not None else None
        family.append(child)
        return child

    def attach(self, parent: Sequence, child: Sequence) -> tuple[bool, tuple[int, int] | None]:
        """Share the parent's prompt blocks with a freshly sampled child. Returns whether
        it was attached, and the (src, dst) block copy to run once the parent's last block
        is written (a partial last block is copied). Without a free block for that copy
        the child is queued to recompute instead."""
        if self._blocks.num_free_blocks < 1 and parent.num_computed_tokens % self._block_size:
            self._scheduler.add(child)  # recompute later; its prompt blocks are prefix-cache hits
            return False, None
        copy = self._blocks.fork(parent, child)
        child.status = parent.status
        return True, copy
