"""PD export: a prefill-only request's prompt KV, gathered into host staging.

A prefill instance runs each prompt with ``export_kv``; its prompt's blocks are gathered
off the cache (one swap launch, libs/engine/model_runner.py) into staging buffers that
the service then writes to the pool. Two ways:

- **At the end** (``export_kv`` alone): when the request finishes, every block of the
  prompt is gathered at once and rides on its final ``RequestOutput``.
- **Streamed** (``export_kv`` and ``stream_export``; DESIGN.md "the handoff is streamed",
  docs/HANDOFF.md): a long prompt is prefilled in chunks (the scheduler's step budget,
  ``max_num_batched_tokens``, cuts it). After every step, the *full* blocks a chunk
  completed are gathered and handed out at once on an unfinished ``RequestOutput``
  (``outputs`` empty, ``exported_kv`` set), so the service can write them to the pool
  while the engine computes the next chunk. When the prompt finishes, the blocks not yet
  handed out (the last chunk's, the partial tail included) ride on the final output.
  Each ``ExportedKV`` says where it starts (``first_block``).

Staging is finite. A streamed gather that finds no free buffer is simply retried after
the next step (the running sequence still holds its blocks). At the end, a finished
sequence keeps its blocks and waits in FIFO order, and the request finishes only once
its rest is gathered. Streamed pieces are never held back for the end, so a consumer that
releases each piece once written can never deadlock the queue.

A preempted sequence (its blocks freed, recomputed later) keeps its count of blocks
handed out: those are already in staging or in the pool, and only the blocks after them
are gathered once recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from kernels.swap import StagingBuffer
from libs.engine.block_manager import BlockManager
from libs.engine.outputs import RequestOutput
from libs.engine.sequence import Sequence


@dataclass
class ExportedKV:
    """A run of a prompt's blocks, gathered into host staging.

    ``buffers`` hold the prompt's blocks ``first_block, first_block + 1, ...`` in order, in
    pool layout. ``num_tokens`` is the prompt's length, so the prompt's last block may be
    partial. The consumer reads them and must call ``release()`` (idempotent) to hand the
    staging back to the engine.
    """

    buffers: list[StagingBuffer]
    num_tokens: int
    block_size: int
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(b.n for b in self.buffers)

    @property
    def end_block(self) -> int:
        """One past the last block held."""
        return self.first_block + self.num_blocks

    def digests(self) -> list[int | None]:
        """Each block's pool digest (xxh3_64 of its payload, unsigned), computed on the device
        by the swap that gathered it, or None where that swap computed none (the CPU, digests
        off): the writer then hashes the block itself. Waits for the copies like ``host``."""
        out: list[int | None] = []
        for buf in self.buffers:
            d = buf.digests
            out.extend([None] * buf.n if d is None else d.view(np.uint64).tolist())
        return out

    def blocks(self) -> Iterator[tuple[torch.Tensor, int]]:
        """``(block, num_tokens_in_block)`` for every block held, in order."""
        i = self.first_block
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
    """Gathers export sequences' blocks: streamed pieces after each step, and what is left
    when a sequence finishes (queued in arrival order while staging is short).

    ``gather(block_ids, num_tokens)`` returns the staging buffers holding those blocks (and
    their pool digests for those token counts, where the swapper computes them), or None
    when not enough are free (the runner's ``export_blocks``)."""

    def __init__(
        self, block_manager: BlockManager, block_size: int, gather: Callable[[list[int], list[int]], list[StagingBuffer] | None]
    ):
        self._blocks = block_manager
        self._block_size = block_size
        self._gather = gather
        self._pending: list[Sequence] = []
        self._handed_out: dict[int, int] = {}  # seq_id -> leading blocks already handed out
        self._final_first: dict[int, int] = {}  # seq_id -> first block of its final export
        self.num_streamed_blocks = 0  # blocks handed out before their prompt finished (a metric)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def streaming(self) -> bool:
        """Whether any sequence is having its blocks streamed (the engine skips the
        per-step check otherwise)."""
        return bool(self._handed_out)

    # -- streamed export ---------------------------------------------------------------------

    def stream(self, seq: Sequence) -> None:
        """Hand out ``seq``'s full prompt blocks as chunks complete them (see the module doc)."""
        self._handed_out[seq.seq_id] = 0

    def export_completed_blocks(self, chunks: Iterable[tuple[Sequence, int]]) -> list[RequestOutput]:
        """After a step's device work is done: gather the full blocks it completed for
        streamed sequences still prefilling; one unfinished ``RequestOutput`` per sequence
        that got some. ``chunks`` pairs each prefilled sequence with how many of its tokens
        have their KV in the cache after that step (with async scheduling the engine has
        already launched the next step, so the sequence's own count may be ahead)."""
        outputs = []
        for seq, computed in chunks:
            done = self._handed_out.get(seq.seq_id)
            if done is None or seq.is_finished or computed >= seq.num_prompt_tokens:
                continue  # not streamed, or its prompt is complete: the rest goes at the end
            full = computed // self._block_size
            if full <= done:
                continue
            bufs = self._gather(seq.block_table[done:full], [self._block_size] * (full - done))
            if bufs is None:
                continue  # no staging free: these blocks go with a later step's
            self._handed_out[seq.seq_id] = full
            self.num_streamed_blocks += full - done
            piece = ExportedKV(bufs, seq.num_prompt_tokens, self._block_size, first_block=done)
            outputs.append(
                RequestOutput(
                    seq.request_id, [], False, seq.num_prompt_tokens, seq.num_cached_tokens,
                    seq.num_imported_tokens, exported_kv=piece,
                )
            )
        return outputs

    # -- at the end ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """``seq`` finished: keep its blocks until the rest of its prompt's KV is gathered
        (now, if staging is free and nothing is queued before it; else at a later ``drain``)."""
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

    def result(self, seq: Sequence) -> ExportedKV | None:
        """The final output's export: the blocks gathered when ``seq`` finished."""
        first = self._final_first.pop(seq.seq_id, 0)
        if not seq.export_buffers:
            return None
        return ExportedKV(seq.export_buffers, seq.num_prompt_tokens, self._block_size, first_block=first)

    def discard(self, seq: Sequence) -> None:
        """An aborted sequence: drop it from the queue, free its blocks and its staging."""
        self._handed_out.pop(seq.seq_id, None)
        self._final_first.pop(seq.seq_id, None)
        if seq.export_pending:
            self._pending.remove(seq)
            seq.export_pending = False
            self._blocks.free(seq)
        for b in seq.export_buffers:
            b.release()
        seq.export_buffers = []

    def _try(self, seq: Sequence) -> bool:
        nblocks = -(-seq.num_prompt_tokens // self._block_size)
        first = self._handed_out.get(seq.seq_id, 0)
        tokens = [min(self._block_size, seq.num_prompt_tokens - j * self._block_size) for j in range(first, nblocks)]
        bufs = self._gather(seq.block_table[first:nblocks], tokens)
        if bufs is None:
            return False  # no staging free: retry at the next drain
        self._handed_out.pop(seq.seq_id, None)
        self._final_first[seq.seq_id] = first
        seq.export_buffers = bufs
        seq.export_pending = False
        self._pending.remove(seq)
        self._blocks.free(seq)
        return True
