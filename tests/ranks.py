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
