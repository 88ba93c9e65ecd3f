"""The pool's redis-server as a launched child: the pool's production settings, a fixed port.

No persistence (``--save "" --appendonly no``: the pool is a cache, and a restart starts
empty), ``maxmemory`` with ``noeviction`` (cache_store owns eviction, DESIGN.md), bound to
localhost. The port is chosen once and kept, so a restarted Redis is found at the same URL
by every client, which reconnects by itself.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import IO, Sequence

from services.launch.processes import Child, ServiceStartError


def answers_ping(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_child(
    name: str, port: int, *, maxmemory_bytes: int, log_dir: Path, echo: IO[str] | None = None, extra_args: Sequence[str] = ()
) -> Child:
    """A redis-server child on ``127.0.0.1:port``, ready once it answers PING; ``extra_args``
    are more server flags (``--io-threads 4 --io-threads-do-reads yes`` on a host with cores to spare)."""
    if shutil.which("redis-server") is None:
        raise ServiceStartError("redis-server is not installed (make install installs it)")
    url = f"redis://127.0.0.1:{port}/0"
    return Child(
        name,
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "noeviction", *extra_args],
        log_path=log_dir / f"{name}.log",
        echo=echo,
        probe=lambda: url if answers_ping(port) else None,
    )
