"""The reduced chaos matrix (``make chaos`` runs the full one): under steady load on the real
stack, SIGKILL one process of each kind (Redis, cache_store, router, prefill, decode). The
launcher's supervisor brings each back; no request fails, nothing leaks, and the stack is
fully healthy again (tests/chaos/matrix.py has the pass bar)."""

import time

import pytest

from tests.chaos.faults import REDUCED
from tests.chaos.matrix import HEADER, row_cells, run_matrix

pytestmark = pytest.mark.integration


@pytest.mark.slow  # ~100 s: make test-slow (and make chaos's whole matrix) run it
def test_reduced_chaos_matrix(tmp_path):
    results = run_matrix(REDUCED, tmp_path, concurrency=3, warm_s=3, fault_s=5, after_s=3)
    table = "\n".join(" | ".join(cells) for cells in [HEADER, *map(row_cells, results)])
    assert [r.fault.name for r in results] == REDUCED
    assert all(r.passed for r in results), f"service logs in {tmp_path}\n{table}"


def test_latency_proxy_adds_its_delay_per_round_trip_and_passes_outages_through(redis_factory):
    import redis

    from tests.chaos.proxy import LatencyProxy

    server = redis_factory()
    proxy = LatencyProxy(server.port).start()
    try:
        client = redis.Redis.from_url(proxy.url, socket_timeout=5)

        def round_trip() -> float:
            t = time.perf_counter()
            assert client.ping()
            return time.perf_counter() - t

        round_trip()
        assert round_trip() < 0.05
        proxy.set_delay(0.05)
        assert 0.05 <= round_trip() < 0.5
        pipe = client.pipeline(transaction=False)
        for i in range(16):
            pipe.set(f"k{i}", b"x" * 10000)
        t = time.perf_counter()
        assert all(pipe.execute())
        assert time.perf_counter() - t < 0.5  # pipelined: one added delay, not sixteen
        proxy.set_delay(0.0)
        server.stop()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()
        assert client.ping()  # the client reconnects through the proxy
    finally:
        proxy.stop()


def test_a_killed_redis_cluster_node_is_restarted_and_rejoins(tmp_path):
    """Supervision covers ``--redis-cluster N`` too: a node is ready once it answers PING,
    and it rejoins the cluster from its nodes.conf with its slots."""
    from services.launch.redis_cluster import LocalRedisCluster
    from services.launch.supervisor import RestartPolicy, Supervisor

    supervisor = Supervisor(RestartPolicy(initial_backoff_s=0.1, ready_timeout_s=20, poll_s=0.05))
    with LocalRedisCluster(3, maxmemory=64 << 20, log_dir=tmp_path) as cluster:
        for node in cluster.nodes:
            supervisor.watch(node)
        supervisor.start()
        try:
            victim = cluster.nodes[1]
            first = victim.pid
            cluster.kill(1)
            deadline = time.monotonic() + 30
            while supervisor.restarts(victim.name) < 1:
                assert time.monotonic() < deadline, "the node was not restarted"
                time.sleep(0.05)
            assert victim.running and victim.pid != first
            cluster.wait_ok(30)  # every node sees cluster_state:ok again
        finally:
            supervisor.stop()
