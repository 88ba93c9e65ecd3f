"""Start a throwaway ``redis-server`` for a test, the way every integration test does it.

No persistence (``--save "" --appendonly no``), a ``maxmemory`` with ``noeviction`` (the
pool's production setting: Redis never drops blocks itself), bound to localhost on a free
port, its files in a temporary directory. ``restart`` comes back on the same port, which
is what a client that must reconnect by itself sees when Redis is restarted.

Use the fixtures in tests/integration/conftest.py, or this class directly when a test
needs its own server (for instance to kill it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from services.launch.redis import answers_ping


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, *, maxmemory: str = "512mb", port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found on PATH; `make redis` installs it")
        self.binary = binary
        self.maxmemory = maxmemory
        self.port = port or free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="tidepool-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        if self.running:
            return self
        log = open(self._dir / "redis.log", "ab")
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "noeviction",
                "--dir", str(self._dir),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {self.log_tail()}")
            if self._answers_ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {timeout_s}s: {self.log_tail()}")

    def _answers_ping(self) -> bool:
        return answers_ping(self.port)

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: a crash, not a clean shutdown)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        path = self._dir / "redis.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
