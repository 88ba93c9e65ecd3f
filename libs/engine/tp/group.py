"""This process's place in its instance's tensor-parallel group.

``TensorParallelGroup.start`` (rank 0) launches ranks ``1..N-1`` (libs/engine/tp/launch.py)
and joins the group with them; ``join`` (the other ranks) joins it. Both then build the
same engine (libs/engine/engine.py: each loads only its shard, allocates a cache of its
KV heads, maps the shared staging) so every collective of start-up pairs up.

What the group provides the engine:

- ``wait_loaded``: every rank has its shard (the one wait not bounded by the collective
  timeout: loading may take minutes);
- ``agree_min``: one value every rank accepts (the KV cache's block count: each rank
  sizes its cache from its own free memory, the smallest wins, so block ids mean the
  same blocks everywhere);
- ``shared_staging``: the staging rows all ranks map (kernels/swap/shared.py);
- ``channel``: rank 0's messages to the others (libs/dist/channel.py);
- ``barrier``: a wait for every rank with the collective timeout (``tp_timeout_s``), used
  after a block import or export so rank 0 never reuses a staging row another rank is
  still copying;
- ``failure`` / ``on_failure``: a rank that died (rank 0 only).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kernels.swap.shared import SharedStaging
from libs.dist import ParallelLayout, init_parallel, shutdown_parallel
from libs.dist.channel import Channel
from libs.dist.groups import Group
from libs.engine.config import EngineConfig
from libs.engine.tp.launch import RankProcesses, free_port

log = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A rank of this instance died or timed out: the instance cannot go on."""


@dataclass(frozen=True)
class JoinInfo:
    """How a rank other than 0 finds its group (given by rank 0 on its command line)."""

    rank: int
    init_method: str
    staging_name: str


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``r`` of an instance on ``cuda:k`` uses ``cuda:k+r``; on the CPU every rank is the CPU."""
    base = config.resolve_device()
    if base.type != "cuda":
        return base
    device = torch.device("cuda", (base.index or 0) + rank)
    torch.cuda.set_device(device)
    return device


class TensorParallelGroup:
    def __init__(self, config: EngineConfig, group: Group, device: torch.device, staging_name: str, ranks: RankProcesses | None):
        self.config = config
        self.group = group
        self.device = device
        self.staging_name = staging_name
        self.ranks = ranks
        self.channel = Channel(group, device)
        self._staging: SharedStaging | None = None
        self._closed = False
        self._failure: str | None = None

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def all_reduce(self) -> str:
        """How this group sums: "one_shot" (libs/dist/one_shot.py) or the backend's name."""
        if self.group.one_shot is not None:
            return "one_shot"
        return str(dist.get_backend(self.group.handle)) if self.group.handle is not None else "closed"

    # -- joining ----------------------------------------------------------------------------

    @classmethod
    def start(cls, config: EngineConfig) -> "TensorParallelGroup":
        """Rank 0: launch the other ranks and join the group with them."""
        device = rank_device(config, 0)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        staging = f"tidepool-tp-{secrets.token_hex(6)}"
        ranks = RankProcesses(config, init_method, staging)
        try:
            group = _init(config, 0, init_method, device)
        except BaseException:
            ranks.kill()
            raise
        log.info("tensor parallelism: %d ranks (pids %s) on %s", config.tensor_parallel_size, ranks.pids, device)
        return cls(config, group, device, staging, ranks)

    @classmethod
    def join(cls, config: EngineConfig, info: JoinInfo) -> "TensorParallelGroup":
        """Ranks 1..N-1: join rank 0's group."""
        device = rank_device(config, info.rank)
        return cls(config, _init(config, info.rank, info.init_method, device), device, info.staging_name, None)

    # -- start-up agreements ----------------------------------------------------------------

    def wait_loaded(self) -> None:
        """Every rank has loaded its shard. Loading takes as long as it takes (a large
        model, a slow disk, a rank started seconds later), so this one wait is bounded by
        ``tp_idle_timeout_s``, not the collective timeout; a rank that dies meanwhile ends
        it at once (gloo sees its connection close)."""
        try:
            dist.monitored_barrier(group=self.group.control_handle, timeout=timedelta(seconds=self.config.tp_idle_timeout_s))
        except RuntimeError as e:
            raise TensorParallelError(f"a tensor-parallel rank did not finish loading: {e}") from e

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group.control_handle)
        return int(t.item())

    def shared_staging(self, shape: tuple[int, ...], dtype: torch.dtype, num_buffers: int) -> list[torch.Tensor]:
        """The staging rows every rank maps: rank 0 creates them, the others attach, then
        the name is removed (the memory goes with the last process, however it ends)."""
        pin = self.device.type == "cuda"
        if self.rank == 0:
            self._staging = SharedStaging(self.staging_name, shape, dtype, num_buffers, create=True, pin=pin)
        self.barrier()
        if self.rank != 0:
            self._staging = SharedStaging(self.staging_name, shape, dtype, num_buffers, create=False, pin=pin)
        self.barrier()
        self._staging.unlink()
        return self._staging.buffers

    # -- while running ------------------------------------------------------------------------

    def barrier(self) -> None:
        """Every rank got here, within the collective timeout (else ``TensorParallelError``)."""
        try:
            dist.monitored_barrier(group=self.group.control_handle, timeout=timedelta(seconds=self.config.tp_timeout_s))
        except RuntimeError as e:
            raise TensorParallelError(f"a tensor-parallel rank did not reach the barrier: {e}") from e

    @property
    def failure(self) -> str | None:
        """Why the group cannot go on (a rank died, or a mirrored operation failed)."""
        return self._failure or (self.ranks.failure if self.ranks is not None else None)

    def fail(self, reason: str) -> None:
        """The ranks are out of step (an operation failed part-way): nothing can run any
        more. Rank 0 reports it like a dead rank (``on_failure``)."""
        if self._failure is None:
            self._failure = reason
        if self.ranks is not None:
            self.ranks.fail(reason)

    def on_failure(self, callback) -> None:
        """``callback(reason)`` (from another thread) when the group fails; rank 0 only."""
        if self.ranks is not None:
            self.ranks.on_failure(callback)

    def close(self) -> None:
        """Rank 0: tell the ranks to stop and wait for them. Every rank: leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.ranks is not None:
            if self.failure is None:
                try:
                    self.channel.send("stop")
                except Exception:  # noqa: BLE001 - a rank already gone: it is killed below
                    log.warning("could not tell the tensor-parallel ranks to stop; killing them")
            self.ranks.stop()
        if self._staging is not None:
            self._staging.close()
        shutdown_parallel()


def _init(config: EngineConfig, rank: int, init_method: str, device: torch.device) -> Group:
    n = config.tensor_parallel_size
    # The control handle's timeout is each process's own: rank 0 only sends on it, and a
    # send that a stopped rank never takes must fail like any collective (tp_timeout_s);
    # the others wait there for their next step as long as the instance is idle.
    control_timeout_s = config.tp_timeout_s if rank == 0 else config.tp_idle_timeout_s
    groups = init_parallel(
        ParallelLayout(world_size=n, tp_size=n), rank=rank, init_method=init_method, device=device,
        timeout_s=config.tp_timeout_s, control_timeout_s=control_timeout_s, all_reduce=config.tp_all_reduce,
    )
    return groups.tp
