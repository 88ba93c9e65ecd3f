"""Starting a local Redis Cluster (services/launch/redis_cluster.py) when a port chosen free
is taken before its node binds it: the node exits, and the cluster starts again on new
ports instead of failing the caller (a test suite, ``make run --redis-cluster N``)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from services.launch import redis_cluster
from services.launch.processes import free_ports
from services.launch.redis_cluster import LocalRedisCluster

pytestmark = pytest.mark.integration


def test_ports_chosen_together_are_distinct() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64


def taking_the_first_port(taken: int, calls: list[list[int]]):
    """A ``free_ports`` whose first answer names ``taken`` for node 0's client port."""

    def free(n: int, host: str = "127.0.0.1") -> list[int]:
        ports = free_ports(n, host)
        if not calls:
            ports[0] = taken
        calls.append(ports)
        return ports

    return free


def test_a_node_whose_port_was_taken_starts_again_on_new_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    squatter = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    taken = squatter.getsockname()[1]
    calls: list[list[int]] = []

    monkeypatch.setattr(redis_cluster, "free_ports", taking_the_first_port(taken, calls))
    try:
        with LocalRedisCluster(2, maxmemory=64 << 20) as nodes:
            assert len(calls) == 2
            assert taken not in nodes.ports and nodes.ports == calls[1][:2]
            assert nodes.cli(nodes.ports[0], "cluster", "info").splitlines()[0].strip() == "cluster_state:ok"
    finally:
        squatter.close()


def test_another_redis_answering_on_a_taken_port_is_not_taken_for_a_node(monkeypatch: pytest.MonkeyPatch, redis_factory) -> None:
    other = redis_factory()  # answers PING on the port node 0 was given, but is not node 0
    calls: list[list[int]] = []
    monkeypatch.setattr(redis_cluster, "free_ports", taking_the_first_port(other.port, calls))
    with LocalRedisCluster(2, maxmemory=64 << 20) as nodes:
        assert len(calls) == 2 and other.port not in nodes.ports
    assert "cluster_enabled:0" in subprocess.run(
        ["redis-cli", "-p", str(other.port), "info", "cluster"], capture_output=True, text=True
    ).stdout  # left alone
