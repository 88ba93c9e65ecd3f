"""The pool digests a swapper's swap-outs compute (kernels/digest), kept apart from the copies.

A swap-out asked for digests (``BlockSwapper.swap_out(ids, num_tokens=...)``) also enqueues
the digest kernel over the same cache blocks, just before its copies and on the same
stream, so both see the cache as it is at that point; each digest lands in its staging
buffer's :class:`DigestRows` with the rows. The kernel's operands go to the device through
the buffer's own pinned argument rows and one device array all swaps share (ordered like
the swapper's device staging, by its shared event).

Digests are an optimisation: the first request checks the implementation against
python-xxhash on this device (kernels/digest/probe.py), and a disagreement, or a launch
that fails later, turns them off for good with a warning. The writer then hashes the rows
on the CPU, as without digests; nothing else changes.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np
import torch

from kernels.swap.errors import SwapShapeError
from kernels.swap.heads import HeadSlice

log = logging.getLogger(__name__)


def digests_wanted(asked: bool | None, cache: torch.Tensor, triton: bool, heads: HeadSlice | None) -> bool:
    """Digests by default on CUDA with the Triton backend and whole heads, where the kernel
    supports the cache; ``True`` asks for them anywhere (the reference on the CPU, for tests)."""
    from kernels.digest import supports

    if asked is False or heads is not None or not supports(cache):
        if asked:
            raise SwapShapeError(f"digests asked for, but not possible for this cache ({tuple(cache.shape)} {cache.dtype}, heads {heads})")
        return False
    return bool(asked) or (cache.is_cuda and triton)


def token_counts(num_tokens: Sequence[int], n: int, block_size: int) -> np.ndarray:
    """``num_tokens`` checked against ``n`` blocks of ``block_size`` tokens."""
    tokens = np.asarray(num_tokens, dtype=np.int64)
    if tokens.shape != (n,):
        raise SwapShapeError(f"{tokens.size} token counts for {n} blocks")
    if n and not (tokens.min() >= 1 and tokens.max() <= block_size):
        raise SwapShapeError(f"token counts must be in [1, {block_size}], got {tokens.min()}..{tokens.max()}")
    return tokens


class DigestRows:
    """One staging buffer's digests (int64 bits) from its last swap-out, and how many rows
    they cover (0: none computed), with the kernel's arguments staged for their copy."""

    def __init__(self, max_blocks: int, pinned: bool) -> None:
        self.out = torch.empty(max_blocks, dtype=torch.int64, pin_memory=pinned)
        self.out_np = self.out.numpy()
        self.args = torch.empty((2, max_blocks), dtype=torch.int64, pin_memory=pinned)
        self.count = 0


class SwapDigests:
    """A swapper's digest computation: the implementation for its cache, the device
    operands, and whether digests are (still) on."""

    def __init__(self, cache: torch.Tensor, max_blocks: int) -> None:
        self._cache = cache
        self._max_blocks = max_blocks
        self._dev = torch.empty((3, max_blocks), dtype=torch.int64, device=cache.device) if cache.is_cuda else None
        self.on = True
        self._checked = False

    def rows(self) -> DigestRows:
        return DigestRows(self._max_blocks, pinned=self._cache.is_cuda)

    def _fn(self):
        if self._dev is None:  # a CPU cache: the reference, done when it returns
            from kernels.digest.reference import block_digests
        else:
            from kernels.digest.triton_digest import block_digests
        return block_digests

    def _agree(self) -> bool:
        """Checked once, at the first request (kernels/digest/probe.py)."""
        if not self._checked:
            from kernels.digest.probe import disagreement

            self._checked = True
            why = disagreement(self._cache, self._fn())
            if why is not None:
                log.warning("block digests off, the CPU hashes pool values instead: %s", why)
                self.on = False
        return self.on

    def compute(
        self, rows: DigestRows, ids: np.ndarray, tokens: np.ndarray, stream: torch.cuda.Stream | None,
        shared_event: torch.cuda.Event | None, wait_rows: Callable[[], None],
    ) -> None:
        """Enqueue the digests of blocks ``ids`` holding ``tokens`` tokens into ``rows``.
        ``wait_rows`` waits until the buffer's previous copies (which read its argument rows)
        are done; ``shared_event`` orders the shared device operands across streams. The
        swap has set ``rows.count`` to 0; it says ``n`` only once the digests are enqueued."""
        if not self._agree():
            return
        n = ids.size
        try:
            if self._dev is None:
                self._fn()(self._cache, ids, tokens, rows.out[:n])
            else:
                from kernels.digest.triton_digest import launch_digests

                assert stream is not None and shared_event is not None
                wait_rows()
                args = rows.args.numpy()
                args[0, :n], args[1, :n] = ids, tokens
                stream.wait_event(shared_event)
                dev = self._dev
                dev[:2].copy_(rows.args, non_blocking=True)
                launch_digests(self._cache, dev[0, :n], dev[1, :n], dev[2, :n])
                rows.out[:n].copy_(dev[2, :n], non_blocking=True)
                shared_event.record(stream)
        except Exception as e:  # noqa: BLE001 - an optimisation: the swap goes on without it
            log.warning("block digests off after a failed launch, the CPU hashes pool values instead: %s: %s", type(e).__name__, e)
            self.on = False
            return
        rows.count = n
