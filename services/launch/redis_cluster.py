"""A local Redis Cluster of N master nodes (``python -m services.launch --redis-cluster N``).

Each node is a ``redis-server --cluster-enabled yes`` on a free localhost port, with the
pool's settings (no persistence, ``maxmemory`` + ``noeviction``: cache_store owns
eviction) and ``cluster-require-full-coverage no``: the pool is a cache, so a lost node
must cost its share of the blocks (misses), not stop the other nodes from serving theirs.
With three or more nodes the cluster is formed by ``redis-cli --cluster create
--cluster-replicas 0 --cluster-yes``; ``redis-cli`` refuses fewer than three masters, so
one or two nodes get their slot ranges with ``CLUSTER ADDSLOTSRANGE`` and meet with
``CLUSTER MEET`` (the same even split). ``start`` returns once every node reports
``cluster_state:ok``. Any node's URL reaches the whole cluster: the pool discovers the rest.

Used by services.launch (``LocalCluster``), the integration tests, and
bench/pool_throughput.py.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

from services.launch.processes import Child, ServiceStartError, free_ports
from services.launch.redis import answers_ping

SLOTS = 16384


class LocalRedisCluster:
    def __init__(
        self,
        nodes: int,
        *,
        maxmemory: int = 512 << 20,
        log_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        node_timeout_ms: int = 2000,
        redis_server: str = "redis-server",
        redis_cli: str = "redis-cli",
    ) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {nodes}")
        self.size = nodes
        self.maxmemory = maxmemory  # per node
        self.extra_args = list(extra_args)
        self.node_timeout_ms = node_timeout_ms
        self.redis_server = shutil.which(redis_server) or redis_server
        self.redis_cli = shutil.which(redis_cli) or redis_cli
        self._dir = Path(tempfile.mkdtemp(prefix="tidepool-redis-cluster-"))
        self.log_dir = log_dir or self._dir
        self.ports: list[int] = []
        self.bus_ports: list[int] = []
        self.nodes: list[Child] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node_url(self, i: int) -> str:
        return f"redis://127.0.0.1:{self.ports[i]}/0"

    def cli(self, port: int, *args: str, timeout: float = 10.0) -> str:
        out = subprocess.run([self.redis_cli, "-p", str(port), *args], capture_output=True, text=True, timeout=timeout)
        return out.stdout.strip()

    def _node(self, port: int, bus_port: int) -> Child:
        workdir = self._dir / str(port)
        workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.redis_server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
            "--save", "", "--appendonly", "no", "--maxmemory", str(self.maxmemory), "--maxmemory-policy", "noeviction",
            "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", "--cluster-port", str(bus_port),
            "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no",
            *self.extra_args,
        ]
        # Ready once it answers PING (redis-server prints no "ready at" line); a supervisor
        # restarting a node relies on it, and the node rejoins from its nodes.conf.
        url = f"redis://127.0.0.1:{port}/0"
        return Child(f"redis-{port}", argv, log_path=self.log_dir / f"redis-{port}.log", probe=lambda: url if answers_ping(port) else None)

    def start(self, timeout_s: float = 30.0, attempts: int = 3) -> "LocalRedisCluster":
        """Start the nodes and form the cluster. A port chosen free can be taken by another
        process before its node binds it; a node that exits before answering is therefore
        started again on new ports, ``attempts`` times in all."""
        if shutil.which(self.redis_server) is None:
            raise ServiceStartError("redis-server is not installed (make install installs it)")
        deadline = time.monotonic() + timeout_s
        for attempt in range(attempts):
            try:
                if self._start_nodes(deadline):
                    break
            except BaseException:
                self.stop()
                raise
            self.stop()
            if attempt == attempts - 1:
                raise ServiceStartError(f"a redis-server exited at start {attempts} times; see {self.log_dir}")
        try:
            self._form()
            self.wait_ok(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nodes(self, deadline: float) -> bool:
        """Start every node on fresh ports; False if one exited before answering PING."""
        # The cluster bus port is another free one (by default it would be port + 10000,
        # which a kernel-chosen port may push past 65535). All 2N are chosen together, so
        # none repeats.
        ports = free_ports(2 * self.size)
        self.ports, self.bus_ports = ports[: self.size], ports[self.size :]
        self.nodes = [self._node(p, b) for p, b in zip(self.ports, self.bus_ports)]
        for node in self.nodes:
            node.start()
        for port, node in zip(self.ports, self.nodes):
            while not answers_ping(port):
                if not node.running:
                    return False
                if time.monotonic() > deadline:
                    raise ServiceStartError(f"redis-server on port {port} did not start; see {node.log_path}")
                time.sleep(0.05)
            # Another process's Redis on a taken port answers PING too.
            if f"process_id:{node.pid}" not in self.cli(port, "info", "server").splitlines():
                return False
        return True

    def _form(self) -> None:
        if self.size >= 3:
            out = subprocess.run(
                [self.redis_cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )
            if out.returncode != 0:
                raise ServiceStartError(f"redis-cli --cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
            return
        for i, port in enumerate(self.ports):
            lo, hi = i * SLOTS // self.size, (i + 1) * SLOTS // self.size - 1
            if self.cli(port, "cluster", "addslotsrange", str(lo), str(hi)) != "OK":
                raise ServiceStartError(f"CLUSTER ADDSLOTSRANGE {lo} {hi} failed on port {port}")
        for port, bus in zip(self.ports[1:], self.bus_ports[1:]):
            self.cli(self.ports[0], "cluster", "meet", "127.0.0.1", str(port), str(bus))

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node says ``cluster_state:ok`` and knows every node."""
        deadline = time.monotonic() + timeout_s
        for port, node in zip(self.ports, self.nodes):
            if not node.running:
                continue
            while True:
                info = self.cli(port, "cluster", "info")
                if "cluster_state:ok" in info and f"cluster_known_nodes:{self.size}" in info:
                    break
                if time.monotonic() > deadline:
                    raise ServiceStartError(f"cluster node {port} not ready: {info[:200]}")
                time.sleep(0.02)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a crash); its slots stay assigned to it, now unreachable."""
        self.nodes[i].kill()

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
