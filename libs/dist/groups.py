"""Process groups for parallel inference: tensor parallelism (TP) and expert parallelism (EP).

A ``Group`` is one torch.distributed process group plus this process's place in it, with
the few collectives the model code calls (so model code never touches torch.distributed
directly and runs unchanged in a single process, where a group of one does no I/O).

``init_parallel(layout, rank=..., init_method=...)`` starts torch.distributed (gloo on the
CPU, NCCL on CUDA, unless told) and builds every group of the layout. Ranks are laid out
so that each TP group and each EP group is a run of consecutive ranks: with
``world_size=4, ep_size=2`` the EP groups are ``{0, 1}`` and ``{2, 3}`` (data-parallel
replicas of the expert shards); with ``world_size=4, tp_size=2`` the TP groups are the
same pairs. TP and EP in one layout are refused for now (a MoE model under TP would need
its experts split over the TP group, which nothing does yet).

A TP group on GPUs may also have a *one-shot* all-reduce (libs/dist/one_shot.py): its
small all-reduces (a decode step's) go through symmetric memory instead of NCCL
(``init_parallel(..., all_reduce=)``).

A TP group also has a *control* handle: a second, gloo group over the same ranks for
small host messages (a TP instance's step plans, libs/dist/channel.py). Host messages
cannot go through NCCL (device memory only), and they need their own timeout: a worker
rank waits for its next plan as long as its instance is idle, while a collective of the
forward pass must finish within seconds.

Collectives have a timeout (``timeout_s``): a peer that died or hangs makes them raise
(gloo) or aborts the process (NCCL's watchdog, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``),
never a silent hang. The control handle's timeout (``control_timeout_s``) is each
process's own (gloo keeps it per process): a TP instance gives its receiving ranks a long
one (a dead peer still ends their wait at once, as gloo sees its connection close) and
its sending rank the collective timeout (a send a stopped peer never takes fails).

Every process must call ``init_parallel`` with the same layout (building a group is a
collective), and ``shutdown_parallel`` at the end: it lets go of every group's torch handle
(the engine's model still holds its ``Group`` objects) so the collective threads are joined
while the interpreter is alive (see ``shutdown_parallel``).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(eq=False)
class Group:
    """``ranks``: the global ranks in the group, in group order; ``rank``: this process's
    index among them; ``handle``: the torch.distributed group (None for a group of one;
    dropped by ``shutdown_parallel``, after which a collective on the group raises)."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    handle: Any = None
    control: Any = None  # gloo handle over the same ranks for host messages (TP); None: ``handle``
    one_shot: Any = None  # a libs.dist.one_shot.OneShotAllReduce for small all-reduces (TP on GPUs)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def control_handle(self) -> Any:
        return self.handle if self.control is None else self.control

    def release(self) -> None:
        """Let go of the torch handles (``shutdown_parallel`` does it for every group)."""
        if self.one_shot is not None:
            self.one_shot.close()
        self.handle = self.control = self.one_shot = None

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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group: through the one-shot where it has one and ``x``
        fits it (a new tensor), else over the backend in place (identity for a group of one)."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.handle)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's ``x`` (all of one shape) concatenated along ``dim``, in group order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # members stacked along dim 0
        _all_gather_single(out, x, group=self.handle)
        if dim == 0:
            return out
        return torch.cat(out.view(self.size, *x.shape).unbind(0), dim=dim)

    def broadcast_(self, x: torch.Tensor, *, control: bool = False) -> torch.Tensor:
        """Member 0's ``x`` into every member's ``x`` (in place). ``control``: over the gloo
        control handle (host tensors), else the data handle (the device's backend)."""
        if self.size > 1:
            dist.broadcast(x, src=self.ranks[0], group=self.control_handle if control else self.handle)
        return x

    def barrier(self) -> None:
        """Wait for every member (over the control handle)."""
        if self.size > 1:
            dist.barrier(group=self.control_handle)


# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def single_group(name: str) -> Group:
    return Group(name, (0,), 0, None)


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int = 1
    ep_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("ep_size", "tp_size"):
            size = getattr(self, name)
            if self.world_size < 1 or size < 1 or self.world_size % size:
                raise ValueError(f"world_size ({self.world_size}) must be a positive multiple of {name} ({size})")
        if self.ep_size > 1 and self.tp_size > 1:
            raise ValueError("tensor and expert parallelism in one layout are not supported (tp_size > 1 needs ep_size 1)")


@dataclass(frozen=True)
class ParallelGroups:
    layout: ParallelLayout
    world: Group
    ep: Group
    tp: Group = single_group("tp")

    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls(ParallelLayout(), single_group("world"), single_group("ep"), single_group("tp"))


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
    control_timeout_s: float = 7 * 24 * 3600.0,
    all_reduce: str = "nccl",
) -> ParallelGroups:
    """Join the job as ``rank`` (``init_method``: e.g. ``tcp://host:port``) and build the groups.

    ``timeout_s`` bounds every collective (and the rendezvous); ``control_timeout_s`` a
    wait on a TP group's control handle. ``all_reduce``: how the TP group sums (``nccl``:
    the backend's all-reduce, gloo's on the CPU; ``one_shot``: small sums through the
    one-shot, libs/dist/one_shot.py, else an error; ``auto``: the one-shot where every rank
    can run it)."""
    if layout.world_size == 1:
        return ParallelGroups.single()
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside [0, {layout.world_size})")
    backend = backend or default_backend(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=layout.world_size, timeout=timeout)
    world = Group("world", tuple(range(layout.world_size)), rank, dist.group.WORLD)
    groups = ParallelGroups(
        layout, world,
        _consecutive_groups("ep", layout.ep_size, layout.world_size, rank, timeout=timeout),
        _consecutive_groups("tp", layout.tp_size, layout.world_size, rank, timeout=timeout, control_timeout=timedelta(seconds=control_timeout_s)),
    )
    _LIVE.update((groups.world, groups.ep, groups.tp))
    if all_reduce != "nccl" and groups.tp.size > 1:
        from libs.dist.one_shot import attach

        attach(groups.tp, torch.device(device), required=all_reduce == "one_shot")
    return groups


def _consecutive_groups(
    name: str, size: int, world_size: int, rank: int, *, timeout: timedelta | None = None, control_timeout: timedelta | None = None
) -> Group:
    """This rank's group among ``world_size / size`` groups of consecutive ranks (with a
    gloo control twin when ``control_timeout`` is given). Every rank creates every group
    (``dist.new_group`` is collective) and keeps its own."""
    if size == 1:
        return Group(name, (rank,), 0, None)
    mine: Group | None = None
    for start in range(0, world_size, size):
        ranks = tuple(range(start, start + size))
        handle = dist.group.WORLD if size == world_size else dist.new_group(list(ranks), timeout=timeout)
        gloo = dist.new_group(list(ranks), backend="gloo", timeout=control_timeout) if control_timeout is not None else None
        if rank in ranks:
            mine = Group(name, ranks, ranks.index(rank), handle, gloo)
    assert mine is not None
    return mine


# The groups init_parallel handed out, whose torch handles shutdown_parallel lets go of.
_LIVE: "weakref.WeakSet[Group]" = weakref.WeakSet()


def shutdown_parallel() -> None:
    """Leave torch.distributed and free its process groups now, joining their threads.

    A gloo (or NCCL) worker thread lets go of a finished collective's tensors after the
    caller has returned, and releasing a tensor Python also saw takes the GIL. If the
    process group outlives this call (the engine's model holds its ``Group``), its threads
    are joined only at interpreter exit, where a thread that still needs the GIL is killed
    and the process aborts ("terminate called without an active exception", SIGABRT,
    after all its work is done: the CPU TP tests hit it about one run in six). So every
    ``Group`` lets go of its handles and the collector frees the groups here; torch frees
    a process group with the GIL released, so its threads finish and are joined. Safe to
    call twice."""
    for group in list(_LIVE):
        group.release()
    _LIVE.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
