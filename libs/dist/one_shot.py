"""One-shot all-reduce over symmetric memory: a TP group's small all-reduces on GPUs.

A decode step of a tensor-parallel model does two all-reduces per layer (the row-parallel
attention output and MLP down projections), each of ``batch x hidden`` values: 7 KiB at
batch 1 for Qwen2.5-7B, 56 of them a step. At that size NCCL's ring is latency, not
bandwidth. In a *one-shot* all-reduce every rank copies its values into a buffer that all
ranks map (symmetric memory), the ranks meet at a barrier of flags in that memory, and
each reads every peer's copy over NVLink and sums them: one kernel, one barrier (plus one
so a buffer is never overwritten while a peer still reads it). vLLM's custom all-reduce
and SGLang's do the same for small messages; larger ones (prefill) stay with NCCL, whose
ring moves fewer bytes per rank. bench/all_reduce_bench.py measures both by size, in
eager launches and in CUDA graphs, and ``ONE_SHOT_MAX_BYTES`` is taken from it.

The kernel is PyTorch's (``torch.ops.symm_mem.one_shot_all_reduce_copy_out`` over
``torch.distributed._symmetric_memory``): no CUDA code of ours. It is captured in CUDA
graphs like any kernel (its flags return to zero after every use).

- **No multicast.** NVLink multicast (NVLS) is not used, and its set-up at rendezvous is
  turned off here (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless the caller set it): the
  one-shot reads peers' memory directly.
- **Every rank decides alike.** Whether a rank can use it is agreed over the group before
  the (collective) rendezvous, so one rank without it cannot leave the other waiting.
- **Once per process, in practice.** PyTorch numbers a process's symmetric-memory
  rendezvous and pairs the ranks' by that number (its store keys hold it), and the number
  outlives a process group. A TP instance's other ranks are fresh processes, so a second
  instance built in the same rank-0 process (the offline API, tests) would pair its
  rendezvous with the wrong number and wait forever. The ranks compare their counts
  first (``rendezvous_count``); if they differ, that instance uses NCCL and logs why. A
  service runs one instance per process, so it always gets the one-shot.
- **A dead peer.** The barrier waits on the peer's flags without a timeout, as NCCL's
  kernels do inside a CUDA graph: a rank that dies mid-step leaves its peers' GPUs waiting.
  Rank 0's watcher deregisters the instance (libs/engine/tp/launch.py; the router resumes
  its streams elsewhere), as it does with NCCL. That path is tested with gloo ranks on the
  CPU; a rank killed on GPUs, with a peer stuck in this wait, has not been tried.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)
# Before any symmetric-memory allocation of this process (see "No multicast" above).
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

# Measured on two H200s (bench/all_reduce_bench.py, bench/RESULTS.md "Tensor parallelism"):
# the one-shot took about half NCCL's time up to 1.75 MiB in CUDA graphs and was even at
# 7 MiB; a decode step's sums (batch x hidden) are far below this bound.
ONE_SHOT_MAX_BYTES = 1 << 20
DTYPES = (torch.bfloat16, torch.float32)
_ALIGN = 16  # bytes: the kernel's vector loads


def unavailable_reason(device: torch.device) -> str | None:
    """Why this process cannot run the one-shot on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"needs CUDA (the device is {device.type})"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch has no symmetric memory ({e})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    return None


def fits(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether ``x`` goes through the one-shot: a contiguous bf16/fp32 tensor of at most
    ``max_bytes``, a whole number of the kernel's 16-byte vectors."""
    n = x.numel() * x.element_size()
    return x.dtype in DTYPES and 0 < n <= max_bytes and n % _ALIGN == 0 and x.is_contiguous() and x.data_ptr() % _ALIGN == 0


_rendezvous = 0  # symmetric-memory rendezvous this process has done (see the docstring)


def rendezvous_count() -> int:
    return _rendezvous


class OneShotAllReduce:
    """The symmetric buffer of one process group and the one-shot over it.

    Built by every rank of the group at the same point (``rendezvous`` is collective)."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        self.max_bytes = max_bytes
        global _rendezvous
        self.buffer: torch.Tensor | None = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        _rendezvous += 1
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return self.buffer is not None and fits(x, self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, in a new tensor (``x`` is left as it was)."""
        assert self.buffer is not None, "the one-shot all-reduce was closed"
        out = torch.empty_like(x)
        staging = self.buffer.view(x.dtype)[: x.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x.view(-1), "sum", self.group_name, out.view(-1))
        return out

    def close(self) -> None:
        """Let go of the buffer (before the process group is destroyed)."""
        self.buffer = None


def attach(group: Any, device: torch.device, *, required: bool, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
    """Give ``group`` (a libs.dist.groups.Group of more than one rank) a one-shot, if every
    rank can run it. ``required``: a rank that cannot is an error, not a fall-back to the
    backend's all-reduce. Collective: every rank of the group calls it."""
    import torch.distributed as dist

    reason = unavailable_reason(device)
    # [can run it, this process's rendezvous so far, its negation]: the MIN gives whether
    # all can, and the fewest and most rendezvous of any rank.
    agreed = torch.tensor([0 if reason else 1, _rendezvous, -_rendezvous], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group.control_handle)
    can, fewest, most = agreed[0].item(), agreed[1].item(), -agreed[2].item()
    if not can or fewest != most:
        why = (reason or "another rank cannot run it") if not can else (
            f"the ranks' processes have done {fewest} to {most} symmetric-memory rendezvous before "
            "(another tensor-parallel instance ran in this process): their next ones would not pair up")
        if required:
            raise RuntimeError(f"the one-shot all-reduce is not available: {why}")
        log.info("%s group: all-reduce over the backend (one-shot: %s)", group.name, why)
        return
    group.one_shot = OneShotAllReduce(group.handle, device, max_bytes)
    log.info("%s group: one-shot all-reduce for sums up to %d bytes", group.name, max_bytes)
