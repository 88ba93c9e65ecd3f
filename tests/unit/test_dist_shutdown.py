"""``shutdown_parallel`` joins torch.distributed's threads while the interpreter is alive,
even while the engine (here: the test's own reference) still holds its ``Group``: a gloo
thread left to interpreter exit aborted the process after its work was done, about one
CPU TP test run in six (SIGABRT, "terminate called without an active exception")."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from services.launch.processes import free_port
from tests import ranks

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")


def test_shutdown_joins_collective_threads(tmp_path):
    mp.spawn(ranks.shutdown_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["during"] > r["before"]  # gloo (and rank 0's store) started threads
        assert r["after"] == r["before"], r  # and they are gone
        assert torch.equal(r["gathered"], torch.cat([torch.full((2, 3), 19.0), torch.full((2, 3), 20.0)], dim=-1))
        assert r["refused"]  # a released group does no more collectives
