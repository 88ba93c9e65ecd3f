"""Splitting a list of block ids into runs of consecutive ids.

A run of consecutive ids is one contiguous slice of the block-major cache, so it moves
with a single copy (one DMA) and no kernel; the swap functions use this when all ids
form one run, and the staging pool also when they form only a few.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Run:
    """``length`` consecutive blocks: cache blocks ``start..start+length-1`` are staging
    rows ``offset..offset+length-1``."""

    start: int
    offset: int
    length: int


def count_runs(ids: np.ndarray) -> int:
    """Number of maximal runs of consecutive ids in a 1-D int64 array (0 if empty)."""
    if ids.size == 0:
        return 0
    return 1 + int(np.count_nonzero(ids[1:] - ids[:-1] != 1))


def block_runs(ids: np.ndarray) -> list[Run]:
    """The maximal runs of consecutive ids, in order (``[3, 4, 5, 9, 10, 2]`` gives
    ``3..5``, ``9..10``, ``2``)."""
    if ids.size == 0:
        return []
    breaks = (np.flatnonzero(ids[1:] - ids[:-1] != 1) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, ids.size]
    first_ids = ids[starts].tolist()
    return [Run(start=b, offset=s, length=e - s) for b, s, e in zip(first_ids, starts, ends)]


def single_run(ids: np.ndarray) -> Run | None:
    """The one run covering all of ``ids``, or None when they are not consecutive."""
    if count_runs(ids) != 1:
        return None
    return Run(start=int(ids[0]), offset=0, length=ids.size)


def copy_run(cache: torch.Tensor, staging: torch.Tensor, run: Run, *, out: bool) -> None:
    """One copy between a run's slice of the cache and its rows of ``staging``
    (cache → staging when ``out``), enqueued like any non-blocking torch copy."""
    blocks = cache[run.start : run.start + run.length]
    rows = staging[run.offset : run.offset + run.length]
    if out:
        rows.copy_(blocks, non_blocking=True)
    else:
        blocks.copy_(rows, non_blocking=True)


def copy_if_one_run(cache: torch.Tensor, ids: np.ndarray, staging: torch.Tensor, *, out: bool) -> bool:
    """The single-copy path: move ``ids`` with one copy if they are one run (or nothing if
    empty) and return True; return False, moving nothing, when they need a kernel."""
    if ids.size == 0:
        return True
    run = single_run(ids)
    if run is None:
        return False
    copy_run(cache, staging, run, out=out)
    return True
