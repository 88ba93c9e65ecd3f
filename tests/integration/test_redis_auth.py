"""Redis AUTH and TLS end to end: credentials and ``rediss://`` travel in the pool's URL to
every client of Redis (cache_store, prefill, decode), against a real ``redis-server``
started with ``--requirepass`` (and serving TLS only, when the packaged server supports it)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from openai import OpenAI

from libs.kvpool.config import PoolConfig
from libs.kvpool.pool import PoolUnavailable
from libs.kvpool.redis_pool import RedisPool
from tests.integration.conftest import unique_prefix
from tests.integration.pd_helpers import TRACE, trace_of
from tests.integration.redis_server import RedisServer
from tests.unit.test_kvpool_pool import KEYS, NS, put_ok, values

pytestmark = pytest.mark.integration

PASSWORD = "correct-horse-battery-staple"


def redis_supports_tls() -> bool:
    """Whether the installed redis-server was built with TLS, without starting one: it reads
    ``--tls-port`` and then stops at a directive that exists nowhere; a build without TLS
    stops at ``tls-port`` already."""
    probe = subprocess.run(
        ["redis-server", "--port", "0", "--tls-port", "0", "--no-such-directive", "x"], capture_output=True, text=True, timeout=10
    )
    out = probe.stdout + probe.stderr
    assert "no-such-directive" in out or "tls-port" in out, out
    return "tls-port" not in out


TLS = redis_supports_tls()


@pytest.fixture(scope="module", params=["auth", "auth+tls"])
def secured_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    tls = request.param == "auth+tls"
    if tls and not TLS:
        pytest.skip("the packaged redis-server has no TLS support")
    with RedisServer(password=PASSWORD, tls=tls) as server:
        yield server


async def test_the_pool_client_takes_credentials_and_tls_from_the_url(secured_redis: RedisServer) -> None:
    prefix = unique_prefix()
    blocks = values(2)
    async with RedisPool(PoolConfig(url=secured_redis.url, key_prefix=prefix)) as pool:
        await put_ok(pool, KEYS[:2], blocks)
        assert await pool.get_blocks(NS, KEYS[:2]) == blocks
    wrong = secured_redis.url.replace(PASSWORD, "wrong-password")
    async with RedisPool(PoolConfig(url=wrong, key_prefix=prefix, retries=0)) as pool:
        with pytest.raises(PoolUnavailable) as info:
            await pool.ping()
        assert PASSWORD not in str(info.value) and "wrong-password" not in str(info.value)
    no_auth = secured_redis.url.replace(f":{PASSWORD}@", "")
    async with RedisPool(PoolConfig(url=no_auth, key_prefix=prefix, retries=0)) as pool:
        with pytest.raises(PoolUnavailable):
            await pool.ping()
    if secured_redis.tls:  # a plain-text client gets nowhere with a TLS-only server
        plain = f"redis://:{PASSWORD}@127.0.0.1:{secured_redis.port}/0"
        async with RedisPool(PoolConfig(url=plain, key_prefix=prefix, retries=0, connect_timeout_s=1, socket_timeout_s=1)) as pool:
            with pytest.raises(PoolUnavailable):
                await pool.ping()


@pytest.mark.slow  # a whole stack, ~15 s: make test-slow; the pool client's credentials test stays in make test
def test_the_stack_hands_off_through_a_secured_redis(tmp_path: Path) -> None:
    """cache_store, prefill and decode all reach Redis with the URL's password and over TLS
    (AUTH alone where the server has no TLS): prefill writes the prompt's blocks, decode
    loads them, cache_store accounts for them. One stack (processes on the real model
    take a while to start), on the strictest Redis available."""
    with RedisServer(password=PASSWORD, tls=TLS) as server:
        run_stack(server, tmp_path)


def run_stack(secured_redis: RedisServer, tmp_path: Path) -> None:
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.processes import free_port

    cfg = ClusterConfig(
        router_port=free_port(),
        device="cpu",
        threads=1,
        redis_url=secured_redis.url,
        log_dir=tmp_path,
        worker_args=["--num-blocks", "256", "--heartbeat-s", "0.2", "--key-prefix", "auth"],
        cache_store_args=["--key-prefix", "auth"],
    )
    with LocalCluster(cfg) as cluster:
        client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Name three colours of the sea at dawn, and say why each one appears."}]
        resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, temperature=0, max_tokens=4, extra_body=TRACE)  # type: ignore[arg-type]
        totals = trace_of(resp)["totals"]
        assert totals["blocks_written"] > 0, trace_of(resp)  # prefill wrote through AUTH (+TLS)
        assert totals["blocks_hit"] >= totals["blocks_written"] and not totals["blocks_missed"]  # decode read them
        assert cluster.cache_store is not None and cluster.cache_store.url is not None
        stats = cluster.get_json(cluster.cache_store.url + "/v1/stats")
        assert stats["redis_up"] and stats["blocks"] >= totals["blocks_written"], stats
        for child in (cluster.cache_store, *cluster.prefills, *cluster.decodes):
            assert PASSWORD not in " ".join(child.argv)  # secrets travel by environment
