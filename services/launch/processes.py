"""Child processes that announce readiness and die with their parent.

Every Tidepool service prints ``tidepool <name> ready at <url>`` once its socket is bound
(services/common/runner.py); that line is how a launcher learns a service is up and,
with ``--port 0``, where. A child that prints no such line (redis-server) is given a
``probe`` instead, polled until it answers. Children get ``PR_SET_PDEATHSIG`` so that even
a launcher killed with SIGKILL leaves no orphans behind; a normal stop sends SIGTERM
(services shut down gracefully) and SIGKILL after a grace period.

A child is *wanted* from ``start()`` until ``stop()``: the supervisor
(services/launch/supervisor.py) restarts a wanted child that is not running, and leaves a
stopped one alone. ``kill()`` (and any signal from outside) does not change that: it is a
crash, and a crash is restarted. ``lock`` serialises starting and stopping between the
supervisor's thread and everyone else.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Callable, Sequence

from services.common.cpu import torch_child_env

_READY = re.compile(r"ready at (\S+)")
_PR_SET_PDEATHSIG = 1


class ServiceStartError(RuntimeError):
    """A child exited or stayed silent before announcing it was ready."""


# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a
# child started from a short-lived thread (a supervisor's restart) would get SIGTERM as soon
# as that thread returned. Every child is forked from this executor's one thread instead,
# which waits for work for as long as the process lives.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="spawner")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the launcher's own cleanup still stops children


def describe_exit(returncode: int | None) -> str:
    """``"SIGKILL"`` for -9, ``"status 1"`` for 1."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"status {returncode}"


class Child:
    """One child process with its output going to ``log_path`` (and stdout scanned for
    the ready line, unless ``probe`` says when it is ready: it returns the URL or None)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path,
        echo: IO[str] | None = None,
        probe: Callable[[], str | None] | None = None,
    ):
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.echo = echo
        self.probe = probe
        self.url: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.wanted = False
        self.started_at: float | None = None  # monotonic, of the current process
        self.lock = threading.RLock()
        self._ready = threading.Event()

    def start(self) -> None:
        with self.lock:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._ready.clear()
            self.url = None
            log = open(self.log_path, "a", buffering=1)
            self.proc = _SPAWNER.submit(
                subprocess.Popen,
                self.argv,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                text=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            ).result()
            self.wanted = True
            self.started_at = time.monotonic()
            threading.Thread(target=self._pump, args=(self.proc, log), name=f"{self.name}-stdout", daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str], log: IO[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if self.echo is not None:
                self.echo.write(f"[{self.name}] {line}")
            m = _READY.search(line)
            if m and self.probe is None and proc is self.proc and not self._ready.is_set():
                self.url = m.group(1)
                self._ready.set()
        log.close()

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.probe is not None and self.running:
                url = self.probe()
                if url is not None:
                    self.url = url
                    self._ready.set()
                    break
            if self.proc is None or self.proc.poll() is not None:
                raise ServiceStartError(
                    f"{self.name} exited with {describe_exit(self.proc.returncode if self.proc else None)}; see {self.log_path}"
                )
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{self.name} not ready after {timeout:.0f} s; see {self.log_path}")
        assert self.url is not None
        return self.url

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def uptime_s(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns when the process is gone. The
        child is no longer wanted: the supervisor does not restart it."""
        with self.lock:
            self.wanted = False
            if self.proc is None or self.proc.poll() is not None:
                return
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL now (fault injection: a crash, which the supervisor restarts)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now. They are held together while chosen: ports
    asked for one at a time may repeat (each is released before the next is chosen)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def child_env(threads: int | None = None) -> dict[str, str]:
    """The environment of a service process: OMP_WAIT_POLICY=PASSIVE always (DESIGN.md),
    and torch's thread counts for the ones that run a model."""
    env = torch_child_env(threads) if threads is not None else {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    env["PYTHONUNBUFFERED"] = "1"
    return env
