"""Rank 0 starts the other ranks of its instance and watches them.

One process per rank: ``python -m libs.engine.tp.worker`` for ranks ``1..N-1``, started by
rank 0 (the process that owns the HTTP service and the scheduler, or ``tidepool
generate``). Each child gets the engine configuration, its rank, the rendezvous address
and the name of the shared staging; its output goes to rank 0's stderr (the service log)
with a ``[tp rank r]`` prefix line per message from the logging setup.

Supervision both ways:

- A child dies with rank 0: it is started with ``PR_SET_PDEATHSIG`` (SIGTERM when its
  parent goes), and its next wait for a message fails at once when rank 0's connection
  closes.
- Rank 0 learns of a child's death from a watcher thread polling the processes, which
  records the reason and calls the ``on_failure`` callbacks (the service takes the whole
  instance down: it deregisters, and the router resumes its streams elsewhere). A
  collective rank 0 is in when that happens fails too (gloo sees the connection close;
  NCCL's watchdog aborts after the collective timeout), so nothing hangs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable

from libs.engine.config import EngineConfig

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    return EngineConfig(**json.loads(text))


class RankProcesses:
    """Ranks ``1..N-1`` of one instance as child processes, and the thread watching them."""

    def __init__(self, config: EngineConfig, init_method: str, staging_name: str, *, poll_s: float = 0.2):
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._stopping = False
        self._lock = threading.Lock()
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, config.tensor_parallel_size):
            argv = [
                sys.executable, "-m", "libs.engine.tp.worker", "--rank", str(rank), "--init-method", init_method,
                "--staging", staging_name, "--config", config_to_json(config),
            ]
            self.procs.append(subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            ))
        self._poll_s = poll_s
        self._watcher = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` once, when a rank dies unasked (at once if one already has)."""
        with self._lock:
            self._callbacks.append(callback)
            failed = self.failure
        if failed is not None:
            callback(failed)

    def _watch(self) -> None:
        stop = threading.Event()
        while not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    self.fail(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with {code}")
                    return
            stop.wait(self._poll_s)

    def fail(self, reason: str) -> None:
        """Record the first failure and tell the callbacks (once)."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            callbacks = list(self._callbacks)
        log.error("%s: the instance cannot run without it", reason)
        for cb in callbacks:
            try:
                cb(reason)
            except Exception:  # noqa: BLE001 - one bad callback must not silence the others
                log.exception("tensor-parallel failure callback failed")

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait up to ``grace_s`` for the ranks to exit (they were told to stop), then kill."""
        self._stopping = True
        for proc in self.procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._watcher.join(timeout=2)

    def kill(self) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
