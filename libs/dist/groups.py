"""Process groups for parallel inference: expert parallelism now, tensor parallelism next.

A ``Group`` is one torch.distributed process group plus this process's place in it, with
the few collectives the model code calls (so model code never touches torch.distributed
directly and runs unchanged in a single process, where a group of one does no I/O).

``init_parallel(layout, rank=..., init_method=...)`` starts torch.distributed (gloo on the
CPU, NCCL on CUDA, unless told) and builds every group of the layout. Ranks are laid out
so that each EP group is a run of consecutive ranks: with ``world_size=4, ep_size=2`` the
EP groups are ``{0, 1}`` and ``{2, 3}`` (data-parallel replicas of the expert shards).
Tensor parallelism (issue 15) adds ``tp_size`` to ``ParallelLayout`` and a ``tp`` group to
``ParallelGroups``, built the same way; nothing here assumes EP is the only kind.

Every process must call ``init_parallel`` with the same layout (building a group is a
collective), and ``shutdown_parallel`` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """``ranks``: the global ranks in the group, in group order; ``rank``: this process's
    index among them; ``handle``: the torch.distributed group (None for a group of one)."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    handle: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows ``x`` cut into ``send_splits`` (one count per member, in group order) go to
        the members; what they send here comes back as ``recv_splits`` rows, in order."""
        if len(send_splits) != self.size or len(recv_splits) != self.size:
            raise ValueError(f"{self.name}: need {self.size} send and receive splits")
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        if self.size == 1:
            return out.copy_(x)
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.handle)
        return out

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts[i]`` (what this rank sends member ``i``) in, what each member sends here out."""
        if self.size == 1:
            return counts.clone()
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.handle)
        return out

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.handle)
        return x


def single_group(name: str) -> Group:
    return Group(name, (0,), 0, None)


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ep_size < 1 or self.world_size % self.ep_size:
            raise ValueError(f"world_size ({self.world_size}) must be a positive multiple of ep_size ({self.ep_size})")


@dataclass(frozen=True)
class ParallelGroups:
    layout: ParallelLayout
    world: Group
    ep: Group

    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls(ParallelLayout(), single_group("world"), single_group("ep"))


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_parallel(
    layout: ParallelLayout,
    *,
    rank: int,
    init_method: str,
    device: torch.device | str = "cpu",
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> ParallelGroups:
    """Join the job as ``rank`` (``init_method``: e.g. ``tcp://host:port``) and build the groups."""
    if layout.world_size == 1:
        return ParallelGroups.single()
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside [0, {layout.world_size})")
    dist.init_process_group(
        backend or default_backend(device), init_method=init_method, rank=rank,
        world_size=layout.world_size, timeout=timedelta(seconds=timeout_s),
    )
    world = Group("world", tuple(range(layout.world_size)), rank, dist.group.WORLD)
    return ParallelGroups(layout, world, _consecutive_groups("ep", layout.ep_size, layout.world_size, rank))


def _consecutive_groups(name: str, size: int, world_size: int, rank: int) -> Group:
    """This rank's group among ``world_size / size`` groups of consecutive ranks. Every rank
    creates every group (``dist.new_group`` is collective) and keeps its own."""
    if size == 1:
        return Group(name, (rank,), 0, None)
    mine: Group | None = None
    for start in range(0, world_size, size):
        ranks = tuple(range(start, start + size))
        handle = dist.group.WORLD if size == world_size else dist.new_group(list(ranks))
        if rank in ranks:
            mine = Group(name, ranks, ranks.index(rank), handle)
    assert mine is not None
    return mine


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
