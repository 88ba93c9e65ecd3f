"""Setup shared by the one-process-per-rank tests (tests/ep_worker.py, tests/tp_worker.py)."""

from __future__ import annotations

import os

import torch


def start_rank(rank: int, device_type: str) -> torch.device:
    """One torch thread and a passive OpenMP wait (ranks share the box's cores), and the
    rank's device: GPU ``rank`` (made current) or the CPU."""
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def os_threads() -> int:
    """This process's OS threads (Linux)."""
    return len(os.listdir("/proc/self/task"))


def shutdown_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Collectives on a TP group that stays referenced (as an engine's model holds it),
    then ``shutdown_parallel``: the threads torch.distributed started must be gone."""
    from pathlib import Path

    from libs.dist import ParallelLayout, init_parallel, shutdown_parallel

    start_rank(rank, "cpu")
    before = os_threads()
    groups = init_parallel(ParallelLayout(world_size=world, tp_size=world), rank=rank, init_method=f"tcp://127.0.0.1:{port}", timeout_s=60)
    during = os_threads()
    gathered = [groups.tp.all_gather(torch.full((2, 3), float(rank + i))) for i in range(20)]
    groups.tp.broadcast_(torch.zeros(4), control=True)
    shutdown_parallel()
    after = os_threads()
    try:
        groups.tp.all_gather(torch.zeros(2, 3))
        refused = ""
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        refused = str(e)
    torch.save({"before": before, "during": during, "after": after, "refused": refused, "gathered": gathered[-1]}, Path(out_dir) / f"rank{rank}.pt")
