"""The step's token bitmask: filled on a host thread while the device runs the forward pass.

``BitmaskFiller.submit(matchers)`` starts filling one bitmask row per constrained row of
the step on a helper thread (llguidance releases the GIL while it computes masks, and its
``LLExecutor`` spreads a batch over its own threads); the engine launches the forward
pass meanwhile and calls ``result()`` only when it needs the mask, right before sampling.
Only constrained rows get a bitmask row: a step without constrained requests submits
nothing and pays nothing.

The matchers must not change between ``submit`` and ``result`` (the engine advances them
only after sampling, which needs the result first).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from libs.structured.matcher import GrammarMatcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class BitmaskFiller:
    def __init__(self, vocab_size: int, *, threads: int | None = None):
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._threads = threads or max(1, min(16, (os.cpu_count() or 2) // 2))
        self._executor = None  # llguidance.LLExecutor, made on first batched use
        self._thread: ThreadPoolExecutor | None = None
        self.rows_filled = 0  # counters for metrics
        self.steps = 0

    def fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """``[len(matchers), words]`` int32: row i allows what ``matchers[i]`` allows next."""
        bitmask = torch.empty((len(matchers), self.words), dtype=torch.int32)
        if len(matchers) == 1:
            matchers[0].fill(bitmask, 0)
        elif matchers:
            import llguidance as llg

            if self._executor is None:
                self._executor = llg.LLExecutor(num_threads=self._threads)
            # As llguidance.torch.fill_next_token_bitmask_par, without importing that module
            # (it torch.compiles a kernel at import: a multi-second stall; matcher.py).
            self._executor.unsafe_compute_mask_ptr([(m.raw, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), self.words * 4, len(matchers))
        self.rows_filled += len(matchers)
        self.steps += 1
        return bitmask

    def submit(self, matchers: Sequence[GrammarMatcher]) -> "Future[torch.Tensor]":
        """:meth:`fill` on the helper thread; its errors surface at ``result()``."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._thread.submit(self.fill, list(matchers))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
