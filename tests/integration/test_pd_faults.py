"""Faults cost latency, never a request: evicted or corrupt blocks, a killed prefill, a
client that goes away, Redis restarting. Driven against the real processes."""

import pytest
import redis

from libs.kvpool.redis_pool import data_key
from libs.protocol.messages import PrefillResult
from tests.integration.pd_helpers import TRACE, engine_tokens, prefill_then_decode, trace_of, wait_until

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Tell me about the history of the printing press in three sentences."}]


def redis_client(cluster) -> redis.Redis:
    if _is_cluster(cluster.redis_url):
        return redis.RedisCluster.from_url(cluster.redis_url)  # routes each key to its node
    return redis.Redis.from_url(cluster.redis_url)


def _is_cluster(url: str) -> bool:
    with redis.Redis.from_url(url) as r:
        return bool(r.info("cluster").get("cluster_enabled"))


def block_redis_key(cluster, key: str) -> str:
    ns = cluster.get_json(cluster.decodes[0].url + "/stats")["namespace"]
    return data_key("tidepool", f"{ns}:{key}", cluster=_is_cluster(cluster.redis_url))


def test_evicted_blocks_are_recomputed_with_identical_output(pd_cluster, reference_engine):
    cluster = pd_cluster
    prompt = reference_engine.tokenizer.encode("Evicted blocks: " + "a stone skipped across the pond, " * 12)
    ref = engine_tokens(reference_engine, prompt, 12)

    def evict(result: PrefillResult):
        r = redis_client(cluster)
        assert r.delete(block_redis_key(cluster, result.block_keys[2])) == 1  # the third block is gone

    tokens, trace = prefill_then_decode(cluster, prompt, 12, evict)
    assert tokens == ref
    assert trace["pool_hit_blocks"] == 2
    assert trace["pool_miss_reasons"].get("absent") == 1


def test_a_corrupt_block_is_a_miss_not_garbage(pd_cluster, reference_engine):
    cluster = pd_cluster
    prompt = reference_engine.tokenizer.encode("Corrupt blocks: " + "the river bends around the old mill, " * 12)
    ref = engine_tokens(reference_engine, prompt, 12)

    def corrupt(result: PrefillResult):
        r = redis_client(cluster)
        k = block_redis_key(cluster, result.block_keys[1])
        value = bytearray(r.get(k))
        value[-100] ^= 0x40  # one bit in the payload
        r.set(k, bytes(value))

    tokens, trace = prefill_then_decode(cluster, prompt, 12, corrupt)
    assert tokens == ref
    assert trace["pool_hit_blocks"] == 1
    assert trace["pool_miss_reasons"].get("corrupt:checksum") == 1


def test_killed_prefill_costs_latency_not_requests_and_rejoins(cluster, client, reference_engine):
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    ref = tok.decode(engine_tokens(reference_engine, tok.encode_chat(CHAT), 10))
    prefill = cluster.prefills[0]
    restarts = cluster.supervisor.restarts(prefill.name)
    with cluster.supervisor.paused(prefill):  # held down until the request is answered
        prefill.kill()
        resp = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=10, extra_body=TRACE)
        assert resp.choices[0].message.content == ref
        assert trace_of(resp)["prompts"][0]["prefill"]["decision"] != "prefill"  # decode served it alone
    # The supervisor starts it again; it re-registers under its id.
    wait_until(lambda: cluster.supervisor.restarts(prefill.name) == restarts + 1, 120, "the supervisor to restart prefill")
    wait_until(lambda: any(w.get("role") == "prefill" and w.get("usable", True) for w in cluster.workers()), 30, "prefill to re-register")
    resp = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=10, extra_body=TRACE)
    assert resp.choices[0].message.content == ref
    assert trace_of(resp)["prompts"][0]["prefill"]["decision"] == "prefill"


def test_client_disconnect_frees_the_decode_blocks(cluster, client):
    model = client.models.list().data[0].id
    decode_stats = lambda: cluster.get_json(cluster.decodes[0].url + "/stats")["engine"]  # noqa: E731
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert decode_stats()["running"] == 1
    stream.close()  # the client goes away mid-stream
    wait_until(lambda: decode_stats()["running"] == 0, 20, "decode to drop the request")
    s = decode_stats()
    assert s["free_blocks"] == s["total_blocks"]


def test_redis_restart_costs_latency_not_requests_and_the_pool_is_used_again(cluster, client, reference_engine):
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    msgs = [{"role": "user", "content": "Name a colour of the sunset and explain why in one sentence."}]
    ref = tok.decode(engine_tokens(reference_engine, tok.encode_chat(msgs), 8))
    workers = [c.url for c in cluster.prefills + cluster.decodes]
    pool_state = lambda url: cluster.get_json(url + "/stats")["pool"]  # noqa: E731
    recoveries = {url: pool_state(url)["recoveries"] for url in workers}
    restarts = cluster.supervisor.restarts("redis")
    with cluster.supervisor.paused(cluster.redis):  # an outage of known length
        cluster.redis.kill()
        resp = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=8, extra_body=TRACE)
        assert resp.choices[0].message.content == ref
        totals = trace_of(resp)["totals"]
        assert totals["bytes_written"] == 0 and totals["bytes_read"] == 0  # no pool, all recomputed
        wait_until(lambda: _status(cluster.cache_store.url + "/health") == 503, 15, "cache_store to report unhealthy")
        for url in workers:  # every worker noticed, and skips the pool meanwhile
            wait_until(lambda: pool_state(url)["up"] is False, 15, f"{url} to see the pool down")
    # The supervisor restarts Redis on its port, empty; cache_store and the workers detect it.
    wait_until(lambda: cluster.supervisor.restarts("redis") == restarts + 1, 30, "the supervisor to restart Redis")
    wait_until(lambda: _status(cluster.cache_store.url + "/health") == 200, 30, "cache_store to recover")
    for url in workers:
        wait_until(lambda: pool_state(url)["up"] is True and pool_state(url)["recoveries"] > recoveries[url], 15, f"{url} to see the pool back")
    resp = client.chat.completions.create(model=model, messages=msgs + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"}], temperature=0, max_tokens=8, extra_body=TRACE)
    assert trace_of(resp)["totals"]["bytes_written"] > 0  # the pool is used again


def _status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0
