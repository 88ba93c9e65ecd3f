"""PD export: a finished prefill-only request's prompt KV, gathered into host staging.

A prefill instance runs each prompt with ``export_kv``; when it finishes, its prompt's
blocks are gathered off the cache (one swap launch, libs/engine/model_runner.py) into
staging buffers that the service then writes to the pool. Staging is finite: when no
buffer is free the sequence keeps its blocks and waits in FIFO order, and the request
finishes (its ``RequestOutput`` carries the ``ExportedKV``) only once it is gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterator

import torch

from kernels.swap import StagingBuffer
from libs.engine.block_manager import BlockManager
from libs.engine.sequence import Sequence


@dataclass
class ExportedKV:
    """A prompt's KV, gathered into host staging when a prefill-only request finished.

    ``buffers`` hold the prompt's blocks in order, in pool layout; together they cover
    ``num_tokens`` tokens (the last block may be partial). The consumer reads them and
    must call ``release()`` (idempotent) to hand the staging back to the engine.
    """

    buffers: list[StagingBuffer]
    num_tokens: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return sum(b.n for b in self.buffers)

    def blocks(self) -> Iterator[tuple[torch.Tensor, int]]:
        """``(block, num_tokens_in_block)`` for every block, in order."""
        i = 0
        for buf in self.buffers:
            host = buf.host
            for row in range(buf.n):
                yield host[row], min(self.block_size, self.num_tokens - i * self.block_size)
                i += 1

    def release(self) -> None:
        buffers, self.buffers = self.buffers, []
        for b in buffers:
            b.release()


class ExportQueue:
    """Finished export sequences waiting for staging, gathered in arrival order.

    ``gather(block_ids)`` returns the staging buffers holding those blocks, or None when
    none is free (the runner's ``export_blocks``)."""

    def __init__(self, block_manager: BlockManager, block_size: int, gather: Callable[[list[int]], list[StagingBuffer] | None]):
        self._blocks = block_manager
        self._block_size = block_size
        self._gather = gather
        self._pending: list[Sequence] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, seq: Sequence) -> None:
        """``seq`` finished: keep its blocks until its prompt's KV is gathered (now, if
        staging is free and nothing is queued before it; otherwise at a later ``drain``)."""
        seq.export_pending = True
        self._pending.append(seq)
        if len(self._pending) == 1:
            self._try(seq)

    def drain(self) -> list[Sequence]:
        """Gather queued sequences in order while staging lasts; the ones gathered."""
        done = []
        for seq in list(self._pending):
            if not self._try(seq):
                break
            done.append(seq)
        return done

    def discard(self, seq: Sequence) -> None:
        """An aborted sequence: drop it from the queue, free its blocks and its staging."""
        if seq.export_pending:
            self._pending.remove(seq)
            seq.export_pending = False
            self._blocks.free(seq)
        for b in seq.export_buffers:
            b.release()
        seq.export_buffers = []

    def _try(self, seq: Sequence) -> bool:
        nblocks = -(-seq.num_prompt_tokens // self._block_size)
        bufs = self._gather(seq.block_table[:nblocks])
        if bufs is None:
            return False  # no staging free: retry at the next drain
        seq.export_buffers = bufs
        seq.export_pending = False
        self._pending.remove(seq)
        self._blocks.free(seq)
        return True
