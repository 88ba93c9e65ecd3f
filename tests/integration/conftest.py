"""Fixtures for integration tests: real ``redis-server`` processes (tests/integration/redis_server.py).

- ``redis_server``: one server for the whole session; tests share it and stay apart by key
  prefix (``pool_config`` gives each test its own).
- ``redis_factory``: start servers of one's own (to kill, restart, or fill up), all killed
  at teardown.
- ``redis_cluster``: one real 3-node Redis Cluster for the session (``redis-server
  --cluster-enabled yes`` + ``redis-cli --cluster create``), started on first use; tests
  share it by key prefix like ``redis_server``. ``pool_url`` is parametrized over both.
- ``pd_cluster`` / ``pd_client``: the whole system, parametrized over a single Redis
  (``cluster``) and the Redis Cluster (``sharded_cluster``), for the PD tests that must
  hold on both.
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


@pytest.fixture(scope="session")
def redis_cluster():
    from services.launch.redis_cluster import LocalRedisCluster

    with LocalRedisCluster(3, maxmemory=256 << 20) as nodes:
        yield nodes


@pytest.fixture(params=["single", "cluster"])
def pool_url(request: pytest.FixtureRequest) -> str:
    """The shared single Redis, then any node of the shared 3-node cluster."""
    return request.getfixturevalue("redis_server" if request.param == "single" else "redis_cluster").url


# -- the whole system, for the end-to-end tests (tests/integration/test_pd_*.py) -----------


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """Redis, cache_store, router, one prefill and one decode, as real processes, started
    the way ``make run`` starts them (services.launch.LocalCluster), on the real model."""
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.processes import free_port

    cfg = ClusterConfig(
        router_port=free_port(),
        device="cpu",
        threads=1,
        log_dir=tmp_path_factory.mktemp("cluster-logs"),
        worker_args=["--num-blocks", "768", "--heartbeat-s", "0.2"],
        # 64-token chunks: a long prompt's prefill takes many steps, so the streamed
        # handoff (test_pd_stream.py) has blocks to hand over while prefill still computes.
        prefill_args=["--max-num-batched-tokens", "64"],
        router_args=["--heartbeat-timeout-s", "3"],
    )
    with LocalCluster(cfg) as c:
        yield c


@pytest.fixture(scope="session")
def sharded_cluster(tmp_path_factory: pytest.TempPathFactory, redis_cluster):
    """The same system as ``cluster``, its pool sharded over the 3-node Redis Cluster."""
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.processes import free_port

    cfg = ClusterConfig(
        router_port=free_port(),
        device="cpu",
        threads=1,
        redis_url=redis_cluster.url,
        log_dir=tmp_path_factory.mktemp("sharded-cluster-logs"),
        worker_args=["--num-blocks", "768", "--heartbeat-s", "0.2"],
        router_args=["--heartbeat-timeout-s", "3", "--retry-wait-s", "10"],
    )
    with LocalCluster(cfg) as c:
        yield c


@pytest.fixture(params=["single", "redis-cluster"])
def pd_cluster(request: pytest.FixtureRequest):
    return request.getfixturevalue("cluster" if request.param == "single" else "sharded_cluster")


@pytest.fixture
def pd_client(pd_cluster):
    from openai import OpenAI

    return OpenAI(base_url=pd_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def reference_engine():
    """The same model in-process: what PD serving must reproduce token for token."""
    import torch

    from libs.engine import EngineConfig, LLM

    torch.set_num_threads(1)
    return LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=512))


@pytest.fixture(scope="session")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
