"""Faults on the zero-copy path, against real redis-servers and a real Redis Cluster: a
corrupt or mis-sized value, a value cut mid-transfer (a proxy that drops the connection),
a hung server, a cluster node killed mid-transfer, a slot that moved, a lease that expired
before decode read, AUTH, database selection and TLS on the bulk sockets. Each fault is a
miss with a reason (or an error for writes) within bounded time, never garbage, a hang or
a leaked socket."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import redis
import torch

from libs.blocks.keys import Namespace, block_keys
from libs.kvpool.codec import BlockCodec
from libs.kvpool.config import PoolConfig
from libs.kvpool.header import HEADER_NBYTES, BlockDecodeError
from libs.kvpool.layout import KVLayout
from libs.kvpool.pool import PoolUnavailable, block_id
from libs.kvpool.redis_pool import RedisPool, data_key
from libs.kvpool.topology import key_slot
from services.launch.redis_cluster import LocalRedisCluster
from tests.integration.conftest import unique_prefix
from tests.integration.redis_server import RedisServer, free_port

pytestmark = pytest.mark.integration

NS = Namespace(model_digest="bulk-faults", dtype="bf16", block_size=16)
SMOL = KVLayout(30, 3, 64, 16, torch.bfloat16)  # SmolLM2-135M: 368,640 B a block
SMALL = KVLayout(2, 2, 32, 16, torch.bfloat16)


class Blocks:
    """A prompt's worth of random blocks in one layout, and staging to receive them into."""

    def __init__(self, layout: KVLayout, n: int, *, partial_tail: bool = True) -> None:
        self.codec = BlockCodec(layout)
        tokens = n * 16 - (5 if partial_tail else 0)
        self.keys = block_keys(NS, list(range(tokens)))
        gen = torch.Generator().manual_seed(n)
        self.data = torch.randn(len(self.keys), *layout.block_shape, generator=gen).to(layout.dtype)
        self.staging = torch.zeros_like(self.data)
        self.headers = np.zeros((len(self.keys), HEADER_NBYTES), dtype=np.uint8)

    def values(self) -> list:
        return [self.codec.encode_views(self.data[i], k.num_tokens) for i, k in enumerate(self.keys)]

    def dests(self) -> list:
        self.staging.zero_()
        return [self.codec.value_views(memoryview(self.headers[i]), self.staging[i], k.num_tokens) for i, k in enumerate(self.keys)]

    def verify(self, i: int) -> None:
        k = self.keys[i]
        self.codec.verify_landed(memoryview(self.headers[i]), self.staging[i], k.num_tokens)
        assert torch.equal(self.staging[i, :, :, : k.num_tokens], self.data[i, :, :, : k.num_tokens])

    async def put(self, pool: RedisPool, **kw) -> None:
        assert await pool.put_blocks(NS, list(zip(self.keys, self.values())), **kw) == [None] * len(self.keys)

    async def get(self, pool: RedisPool) -> list[str | None]:
        return await pool.get_blocks_into(NS, self.keys, self.dests())


def raw_client(url: str) -> redis.Redis:
    with redis.Redis.from_url(url) as r:
        cluster = bool(r.info("cluster").get("cluster_enabled"))
    return redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)


def redis_key(pool: RedisPool, key) -> str:
    assert pool.control.slots is not None
    return data_key(pool.config.key_prefix, block_id(NS, key), cluster=pool.control.slots.cluster)


# -- corrupt and mis-sized values ---------------------------------------------------------------


async def test_a_corrupt_value_is_caught_in_place_and_a_missized_one_never_lands(pool_url: str) -> None:
    blocks = Blocks(SMALL, 4)
    async with RedisPool(PoolConfig(url=pool_url, key_prefix=unique_prefix())) as pool:
        await blocks.put(pool)
        r = raw_client(pool_url)
        try:
            k1 = redis_key(pool, blocks.keys[1])
            flipped = bytes([r.getrange(k1, 500, 500)[0] ^ 0x01])
            r.setrange(k1, 500, flipped)  # one bit of the payload
            r.append(redis_key(pool, blocks.keys[2]), b"x")  # one byte too many
        finally:
            r.close()
        outcomes = await blocks.get(pool)
        assert outcomes == [None, None, "length", None]
        blocks.verify(0)
        blocks.verify(3)  # the partial tail, scattered into its staging row and back
        with pytest.raises(BlockDecodeError) as info:
            blocks.verify(1)
        assert info.value.reason == "checksum"
        assert not blocks.staging[2].view(torch.uint8).any()  # the mis-sized value wrote nothing


# -- a value cut mid-transfer ---------------------------------------------------------------------


class CuttingProxy:
    """Forwards TCP to ``port``; the first ``cuts`` connections whose replies pass ``after``
    bytes are dropped right there, mid-value (control-plane replies are far smaller). With
    ``before_request``, it is requests that are cut instead: right before the command whose
    frame holds that marker, so the commands ahead of it arrive whole and it never does."""

    def __init__(self, port: int, *, after: int = 0, cuts: int, before_request: bytes | None = None) -> None:
        self.port_to = port
        self.after = after
        self.before_request = before_request
        self.cuts_left = cuts
        self.cut = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port_to))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                at = -1 if replies or self.before_request is None else data.find(self.before_request)
                if at >= 0 and self.cuts_left > 0:
                    self.cuts_left -= 1
                    self.cut += 1
                    dst.sendall(data[: data.rfind(b"*", 0, at)])  # up to the command's own header
                    break
                if replies and self.before_request is None and sent + len(data) > self.after and self.cuts_left > 0:
                    self.cuts_left -= 1
                    self.cut += 1
                    dst.sendall(data[: self.after - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("model", ["threads", "asyncio"])
async def test_a_value_cut_mid_transfer_is_retried_then_a_miss(redis_server: RedisServer, model: str) -> None:
    blocks = Blocks(SMOL, 8)
    prefix = unique_prefix()
    async with RedisPool(PoolConfig(url=redis_server.url, key_prefix=prefix)) as pool:
        await blocks.put(pool)
    # One cut: the retry on a fresh connection delivers everything (latency, not a miss).
    proxy = CuttingProxy(redis_server.port, after=1_000_000, cuts=1)
    cfg = PoolConfig(url=f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix, retries=1, bulk_model=model, max_parallel=1)
    async with RedisPool(cfg) as pool:
        assert await blocks.get(pool) == [None] * 8
        assert proxy.cut == 1
        for i in range(8):
            blocks.verify(i)
    proxy.close()
    # Cut every time: what landed before each cut is good, the rest are misses that say why.
    proxy = CuttingProxy(redis_server.port, after=1_000_000, cuts=100)
    async with RedisPool(dataclasses.replace(cfg, url=f"redis://127.0.0.1:{proxy.port}/0")) as pool:
        start = time.monotonic()
        outcomes = await blocks.get(pool)
        assert time.monotonic() - start < 5
        landed = [i for i, o in enumerate(outcomes) if o is None]
        assert landed and set(outcomes) == {None, "closed"}
        for i in landed:
            blocks.verify(i)
        assert pool.bulk.open_sockets == 0  # every cut socket was closed, none reused
    proxy.close()


async def test_values_whose_accounting_never_ran_expire_instead_of_leaking(redis_server: RedisServer) -> None:
    """A write's values go out with a TTL that only their accounting script removes: when
    the connection dies after the SETs and before the script, the values are unaccounted
    (cache_store cannot see or evict them) and expire on their own; written again, they
    are accounted and persistent."""
    from libs.kvpool.redis_pool import ORPHAN_TTL_MS

    blocks = Blocks(SMALL, 4)
    prefix = unique_prefix()
    proxy = CuttingProxy(redis_server.port, cuts=1, before_request=b"$4\r\nEVAL\r\n")
    cfg = PoolConfig(url=f"redis://127.0.0.1:{proxy.port}/0", key_prefix=prefix, retries=0, max_parallel=1)
    r = redis.Redis(port=redis_server.port)
    try:
        async with RedisPool(cfg) as pool:
            with pytest.raises(PoolUnavailable, match="4 of 4 block writes unconfirmed"):
                await blocks.put(pool)
            assert proxy.cut == 1
            keys = [redis_key(pool, k) for k in blocks.keys]
            assert r.exists(*keys) == 4
            assert all(0 < r.pttl(k) <= ORPHAN_TTL_MS for k in keys)
            assert (await pool.stats()).blocks == 0
            await blocks.put(pool)  # the connection is not cut twice
            assert [r.pttl(k) for k in keys] == [-1] * 4
            stats = await pool.stats()
            assert stats.blocks == 4 and stats.bytes == sum(r.strlen(k) for k in keys)
    finally:
        r.close()
        proxy.close()


async def test_a_hung_redis_is_a_timeout_miss_not_a_hang(redis_factory) -> None:
    server = redis_factory()
    blocks = Blocks(SMALL, 4)
    cfg = PoolConfig(url=server.url, key_prefix=unique_prefix(), socket_timeout_s=0.3, retries=1, retry_backoff_s=0.01)
    async with RedisPool(cfg) as pool:
        await blocks.put(pool)
        os.kill(server._proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            start = time.monotonic()
            assert await asyncio.wait_for(blocks.get(pool), 10) == ["timeout"] * 4
            assert time.monotonic() - start < 3
        finally:
            os.kill(server._proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        assert await blocks.get(pool) == [None] * 4


# -- leases ---------------------------------------------------------------------------------------


async def test_a_lease_that_expires_before_decode_reads_leaves_a_miss(pool_url: str) -> None:
    blocks = Blocks(SMALL, 3)
    async with RedisPool(PoolConfig(url=pool_url, key_prefix=unique_prefix())) as pool:
        lease = await pool.create_lease(NS, blocks.keys, ttl_s=0.2)
        await blocks.put(pool, lease_id=lease)
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 0  # pinned
        await asyncio.sleep(0.3)
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 0  # expired, not reaped yet
        assert await pool.reap_leases() == 1
        assert (await pool.evict(budget_bytes=0, max_blocks=100)).evicted == 3
        assert await blocks.get(pool) == ["absent"] * 3  # decode comes too late: it recomputes
        assert not await pool.release_lease(lease)
        stats = await pool.stats()
        assert stats.misses == {"absent": 3} and stats.pinned_blocks == 0 and stats.leases == 0


# -- AUTH, database, TLS ----------------------------------------------------------------------------


async def test_auth_and_database_on_the_bulk_sockets(redis_factory) -> None:
    server = redis_factory()
    with redis.Redis(port=server.port) as r:
        r.config_set("requirepass", "s3cret")
    blocks = Blocks(SMALL, 2)
    prefix = unique_prefix()
    for url, password in (
        (f"redis://:s3cret@127.0.0.1:{server.port}/3", None),
        (f"redis://default:s3cret@127.0.0.1:{server.port}/3", None),
        (f"redis://127.0.0.1:{server.port}/3", "s3cret"),
    ):
        async with RedisPool(PoolConfig(url=url, password=password, key_prefix=prefix)) as pool:
            await blocks.put(pool)
            assert await blocks.get(pool) == [None, None]
            blocks.verify(1)
    with redis.Redis(port=server.port, password="s3cret", db=3) as r:
        assert r.exists(f"{prefix}:kv:{block_id(NS, blocks.keys[0])}")
    with redis.Redis(port=server.port, password="s3cret", db=0) as r:
        assert not r.keys(f"{prefix}:*")
    async with RedisPool(PoolConfig(url=f"redis://:wr0ng@127.0.0.1:{server.port}/3", key_prefix=prefix, retries=0)) as pool:
        outcomes = await blocks.get(pool)
        assert None not in outcomes
        with pytest.raises(PoolUnavailable) as info:
            await blocks.put(pool)
        assert "wr0ng" not in str(info.value)


def _tls_files(tmp: Path) -> tuple[Path, Path] | None:
    if shutil.which("openssl") is None:
        return None
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )
    return key, cert


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("tls")
    files = _tls_files(tmp)
    if files is None:
        pytest.fail("openssl is needed to make a test certificate")
    key, cert = files
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
         "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("redis-server with TLS did not start (built without TLS?)")
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("model", ["threads", "asyncio"])
async def test_tls_on_the_bulk_sockets(tls_redis: int, model: str) -> None:
    blocks = Blocks(SMOL, 3)
    url = f"rediss://127.0.0.1:{tls_redis}/0?ssl_cert_reqs=none"
    async with RedisPool(PoolConfig(url=url, key_prefix=unique_prefix(), bulk_model=model)) as pool:
        await blocks.put(pool)
        assert await blocks.get(pool) == [None] * 3
        for i in range(3):
            blocks.verify(i)


# -- Redis Cluster: redirects and lost nodes ---------------------------------------------------------


@pytest.fixture
def own_cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(3, maxmemory=256 << 20) as nodes:
        yield nodes


def _node_of(nodes: LocalRedisCluster, slot: int) -> int:
    for i, port in enumerate(nodes.ports):
        for line in nodes.cli(port, "cluster", "nodes").splitlines():
            if "myself" in line:
                for part in line.split()[8:]:
                    lo, _, hi = part.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return i
    raise AssertionError(f"no node owns slot {slot}")


class SlotMigration:
    """Moving one slot between nodes by hand, the way ``redis-cli --cluster reshard`` does."""

    def __init__(self, nodes: LocalRedisCluster, slot: int, src: int, dst: int) -> None:
        self.nodes, self.slot = nodes, slot
        self.ids = [nodes.cli(p, "cluster", "myid") for p in nodes.ports]
        self.src, self.dst = nodes.ports[src], nodes.ports[dst]
        self.dst_id = self.ids[dst]
        assert nodes.cli(self.dst, "cluster", "setslot", str(slot), "importing", self.ids[src]) == "OK"
        assert nodes.cli(self.src, "cluster", "setslot", str(slot), "migrating", self.dst_id) == "OK"

    def keys(self) -> list[str]:
        return self.nodes.cli(self.src, "cluster", "getkeysinslot", str(self.slot), "10000").split()

    def move(self, keys: list[str]) -> None:
        assert keys
        assert self.nodes.cli(self.src, "migrate", "127.0.0.1", str(self.dst), "", "0", "5000", "keys", *keys) == "OK"

    def finish(self) -> None:
        self.move(self.keys())
        for p in self.nodes.ports:
            self.nodes.cli(p, "cluster", "setslot", str(self.slot), "node", self.dst_id)


async def test_a_migrating_slot_is_followed_with_ask_then_moved(own_cluster: LocalRedisCluster) -> None:
    blocks = Blocks(SMALL, 48)
    async with RedisPool(PoolConfig(url=own_cluster.url, key_prefix=unique_prefix())) as pool:
        await blocks.put(pool)
        slot = key_slot(redis_key(pool, blocks.keys[0]))
        src = _node_of(own_cluster, slot)
        migration = SlotMigration(own_cluster, slot, src, (src + 1) % 3)
        moved = [k for k in migration.keys() if ":kv:" in k][::2]
        migration.move(moved)  # half the partition's values are on the new node already: ASK
        assert await blocks.get(pool) == [None] * 48
        for i in range(48):
            blocks.verify(i)
        assert await pool.exists_blocks(NS, blocks.keys) == [True] * 48  # the control plane follows ASK too
        migration.finish()
        refreshes = pool.control.refreshes
        assert await blocks.get(pool) == [None] * 48  # the stale map gets MOVED, refreshes, resends
        assert pool.control.refreshes > refreshes
        for i in range(48):
            blocks.verify(i)
        await blocks.put(pool)
        assert (await pool.stats()).blocks == 48


async def test_a_cluster_node_killed_mid_transfer_costs_its_blocks_only(own_cluster: LocalRedisCluster) -> None:
    blocks = Blocks(SMOL, 24)
    cfg = PoolConfig(url=own_cluster.url, key_prefix=unique_prefix(), socket_timeout_s=2.0, retries=1, retry_backoff_s=0.01)
    async with RedisPool(cfg) as pool:
        await blocks.put(pool)
        victim = 1
        on_victim = {i for i, k in enumerate(blocks.keys) if _node_of(own_cluster, key_slot(redis_key(pool, k))) == victim}
        assert 0 < len(on_victim) < len(blocks.keys)
        # Freeze the victim so its pipelines are in flight, let the others land, then kill it.
        own_cluster.nodes[victim].proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        read = asyncio.ensure_future(blocks.get(pool))
        others = [i for i in range(len(blocks.keys)) if i not in on_victim]
        deadline = time.monotonic() + 10
        while not all(blocks.staging[i].view(torch.uint8).any() for i in others):
            assert time.monotonic() < deadline, "the other nodes' blocks never landed"
            await asyncio.sleep(0.01)
        own_cluster.kill(victim)
        start = time.monotonic()
        outcomes = await asyncio.wait_for(read, 15)
        assert time.monotonic() - start < 10
        assert {i for i, o in enumerate(outcomes) if o is not None} == on_victim
        assert {outcomes[i] for i in on_victim} <= {"closed", "connect", "timeout"}
        for i in others:
            blocks.verify(i)
        # Later calls: reads of the survivors still work; writes to the lost node fail loudly.
        assert [o for i, o in enumerate(await blocks.get(pool)) if i not in on_victim] == [None] * len(others)
        with pytest.raises(PoolUnavailable):
            await blocks.put(pool)
        assert pool.bulk.open_sockets <= 3 * cfg.max_parallel
        # The policy keeps working on the survivors: one budget over what they hold.
        await pool.ping()
        assert await pool.exists_blocks(NS, blocks.keys) == [i not in on_victim for i in range(len(blocks.keys))]
        stats = await pool.stats()
        assert stats.blocks == len(others)
        lease = await pool.create_lease(NS, blocks.keys[:4], ttl_s=60)
        pinned = [i for i in range(4) if i not in on_victim]
        result = await pool.evict(budget_bytes=0, max_blocks=1000)
        assert result.evicted == len(others) - len(pinned) and result.bytes_after == len(pinned) * blocks.codec.value_nbytes(16)
        assert await pool.release_lease(lease)
        assert (await pool.stats()).pinned_blocks == 0


async def test_after_every_connection_was_killed_the_next_read_still_lands(redis_server: RedisServer) -> None:
    """A restarted or killed server takes every pooled socket: the retry must not spend
    itself on the other dead ones."""
    many, few = Blocks(SMALL, 64), Blocks(SMALL, 2)
    cfg = PoolConfig(url=redis_server.url, key_prefix=unique_prefix(), retries=1, pipeline_blocks=16, max_parallel=4)
    async with RedisPool(cfg) as pool:
        await many.put(pool)
        await few.put(pool)
        assert await many.get(pool) == [None] * 64  # four pipelines at once: four pooled sockets
        assert pool.bulk.open_sockets == 4
        with redis.Redis(port=redis_server.port) as r:
            assert r.client_kill_filter(_type="normal", skipme=True) >= 4
        assert await few.get(pool) == [None, None]
        few.verify(1)


@pytest.mark.parametrize("model", ["threads", "asyncio"])
async def test_a_unix_socket_url(tmp_path: Path, model: str) -> None:
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        blocks = Blocks(SMALL, 3)
        async with RedisPool(PoolConfig(url=f"unix://{sock}?db=2", key_prefix=unique_prefix(), bulk_model=model)) as pool:
            await blocks.put(pool)
            assert await blocks.get(pool) == [None] * 3
            blocks.verify(2)
            assert (await pool.stats()).blocks == 3
    finally:
        proc.kill()
        proc.wait()
