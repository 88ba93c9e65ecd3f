"""CPU threading for processes that run torch (DESIGN.md, "Configuration and operations").

Two torch processes sharing two cores were measured to collapse from about 40 to about
250 ms per decode step when OpenMP workers spin-wait (the default ``OMP_WAIT_POLICY``):
each process burns the cores the other needs. Each process must therefore set its torch
thread count explicitly and run with ``OMP_WAIT_POLICY=PASSIVE``.

The OpenMP runtime reads ``OMP_WAIT_POLICY`` once, when it is loaded (at ``import torch``),
so setting it later from inside the process does nothing for that process. Launchers must
put it in the child's environment: use :func:`torch_child_env`. :func:`configure_torch_threads`
sets the thread counts and checks the variable, warning when it came too late.

Nothing here imports torch at module import time: cache_store and the router use
services.common and do not need torch.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

log = logging.getLogger(__name__)

OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def torch_child_env(threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process that will run torch on ``threads`` CPU threads.

    ``base`` defaults to ``os.environ``. Sets ``OMP_WAIT_POLICY=PASSIVE`` and
    ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` so the limits hold from the first instruction.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    env = dict(os.environ if base is None else base)
    env[OMP_WAIT_POLICY] = PASSIVE
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def configure_torch_threads(threads: int, *, interop_threads: int = 1) -> bool:
    """Set torch's intra-op (``threads``) and inter-op thread counts; check the wait policy.

    Returns whether ``OMP_WAIT_POLICY=PASSIVE`` is known to be in effect for this process.
    When the variable is missing it is set (so children inherit it) and, if torch was already
    imported, a warning says the setting came too late for this process. A different value
    set by the operator is respected, with a warning. Inter-op threads can only be set once
    per process, before any parallel work; a later call leaves them and says so.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch_loaded_before = "torch" in sys.modules
    policy = os.environ.get(OMP_WAIT_POLICY)
    effective = True
    if policy is None:
        os.environ[OMP_WAIT_POLICY] = PASSIVE
        if torch_loaded_before:
            effective = False
            log.warning(
                "OMP_WAIT_POLICY was not set when torch was imported; OpenMP threads in this "
                "process will spin-wait. Launch it with OMP_WAIT_POLICY=PASSIVE (torch_child_env)."
            )
    elif policy.upper() != PASSIVE:
        effective = False
        log.warning("OMP_WAIT_POLICY=%s; services sharing cores need PASSIVE", policy)

    import torch  # deferred: only torch-running services pay for it

    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != interop_threads:
        try:
            torch.set_num_interop_threads(interop_threads)
        except RuntimeError as exc:
            log.warning("could not set torch inter-op threads to %d: %s", interop_threads, exc)
    log.info(
        "torch threads: intra-op %d, inter-op %d, %s=%s",
        torch.get_num_threads(),
        torch.get_num_interop_threads(),
        OMP_WAIT_POLICY,
        os.environ.get(OMP_WAIT_POLICY),
    )
    return effective
