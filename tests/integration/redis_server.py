"""Start a throwaway ``redis-server`` for a test, the way every integration test does it.

No persistence (``--save "" --appendonly no``), a ``maxmemory`` with ``noeviction`` (the
pool's production setting: Redis never drops blocks itself), bound to localhost on a free
port, its files in a temporary directory. ``restart`` comes back on the same port, which
is what a client that must reconnect by itself sees when Redis is restarted.

``password`` starts it with ``--requirepass``; ``tls=True`` serves TLS only (``--port 0
--tls-port``), with a fresh self-signed certificate for 127.0.0.1 made by the ``openssl``
command. ``url`` carries what a client needs: the password, ``rediss://`` and the CA file.

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
    def __init__(
        self, *, maxmemory: str = "512mb", port: int | None = None, password: str | None = None, tls: bool = False
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found on PATH; `make redis` installs it")
        self.binary = binary
        self.maxmemory = maxmemory
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self._dir = Path(tempfile.mkdtemp(prefix="tidepool-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None
        if tls:
            self._make_certificate()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path:
        return self._dir / "cert.pem"

    def _make_certificate(self) -> None:
        if shutil.which("openssl") is None:
            raise RuntimeError("the openssl command is needed to make a test certificate")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
             "-keyout", str(self._dir / "key.pem"), "-out", str(self.ca_file)],
            check=True, capture_output=True,
        )  # fmt: skip

    def _listen_args(self) -> list[str]:
        args = ["--requirepass", self.password] if self.password else []
        if not self.tls:
            return [*args, "--port", str(self.port)]
        return [
            *args, "--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
            "--tls-cert-file", str(self.ca_file), "--tls-key-file", str(self._dir / "key.pem"),
            "--tls-ca-cert-file", str(self.ca_file),
        ]  # fmt: skip

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
                *self._listen_args(),
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
        if self.password or self.tls:  # a raw PING would get NOAUTH, or no TLS handshake
            import redis

            try:
                with redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
                    return bool(client.ping())
            except redis.RedisError:
                return False
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
