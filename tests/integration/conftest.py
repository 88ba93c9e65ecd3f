"""Fixtures for integration tests: real ``redis-server`` processes (tests/integration/redis_server.py).

- ``redis_server``: one server for the whole session; tests share it and stay apart by key
  prefix (``pool_config`` gives each test its own).
- ``redis_factory``: start servers of one's own (to kill, restart, or fill up), all killed
  at teardown.
"""

from __future__ import annotations

import uuid
from typing import Callable, Iterator

import pytest

from libs.kvpool.config import PoolConfig
from tests.integration.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(maxmemory="512mb") as server:
        yield server


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(**kwargs).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def unique_prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def pool_config(redis_server: RedisServer) -> PoolConfig:
    """A config on the shared server under a key prefix no other test uses."""
    return PoolConfig(url=redis_server.url, key_prefix=unique_prefix(), socket_timeout_s=5.0, retries=1)
