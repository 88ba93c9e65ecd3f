"""Run a Tidepool service as a real subprocess (``python -m services.<name> --port 0 ...``).

The service prints ``tidepool <name> ready at http://host:port`` once bound
(services/common/runner.py); :class:`ServiceProcess` waits for that line and exposes the
URL. ``stop`` sends SIGTERM (the graceful path) and kills after a grace period; its exit
status and output (a log file) are kept for assertions until ``close``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

_READY = re.compile(r"tidepool (\S+) ready at (http://\S+)")
REPO = Path(__file__).resolve().parents[2]


class ServiceProcess:
    def __init__(self, name: str, args: Sequence[str], *, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = [sys.executable, "-m", f"services.{name}", "--port", "0", *args]
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
        self.url = ""
        # Output goes to a file, not a pipe: a pipe nobody drains fills up and blocks the service.
        self._log = Path(tempfile.mkstemp(prefix=f"tidepool-{name}-", suffix=".log")[1])
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def output(self) -> str:
        return self._log.read_text(errors="replace")

    def start(self, timeout_s: float = 30.0) -> "ServiceProcess":
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._proc.poll() is None:
            match = _READY.search(self.output)
            if match:
                self.url = match.group(2)
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.name} did not come up:\n{self.output}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns the exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        return self._proc.returncode

    def close(self) -> None:
        self.stop()
        self._log.unlink(missing_ok=True)

    def __enter__(self) -> "ServiceProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
