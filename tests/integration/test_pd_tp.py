"""PD across tensor-parallel layouts, on the real processes (CPU, gloo ranks) and the real
model: a TP=2 prefill, a TP=1 prefill, a TP=1 decode and a TP=2 decode, Redis, cache_store
and the router, started as ``make run`` starts them (one TP=2 instance is two processes).

- The pool is layout-independent: the four instances share one namespace, and a prompt
  prefilled at TP=2 and decoded at TP=1 (and the reverse), every block through Redis,
  continues exactly like the in-process TP=1 engine.
- A rank killed under a TP=2 decode takes that instance down cleanly: it deregisters (the
  router logs it: no waiting for missed heartbeats), its streams break and the router
  resumes them on the other decode, so every client still gets the complete, identical
  completion; the supervisor then brings the instance (and its rank) back.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from libs.engine import SamplingParams
from tests.integration.pd_helpers import TRACE, engine_tokens, metric, metrics, prefill_then_decode, trace_of, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # two-rank TP on the CPU: make test-slow runs it, make test not

N = 12


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory: pytest.TempPathFactory):
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.processes import free_port

    cfg = ClusterConfig(
        router_port=free_port(),
        device="cpu",
        threads=1,
        num_prefill=2,
        num_decode=2,
        log_dir=tmp_path_factory.mktemp("tp-cluster-logs"),
        worker_args=["--num-blocks", "256", "--heartbeat-s", "0.2", "--tp-timeout-s", "30"],
        instance_args={"prefill-0": ["--tensor-parallel-size", "2"], "decode-1": ["--tensor-parallel-size", "2"]},
        router_args=["--heartbeat-timeout-s", "3"],
    )
    with LocalCluster(cfg) as c:
        yield c


def stats(cluster, child) -> dict:
    return cluster.get_json(child.url + "/stats")


def test_tp2_prefill_to_tp1_decode_and_back_equal_the_engine(tp_cluster, reference_engine):
    c = tp_cluster
    tp = {child.name: stats(c, child)["tensor_parallel"]["size"] for child in c.prefills + c.decodes}
    sums = {child.name: stats(c, child)["tensor_parallel"].get("all_reduce") for child in c.prefills + c.decodes}
    assert tp == {"prefill-0": 2, "prefill-1": 1, "decode-0": 1, "decode-1": 2}
    assert sums == {"prefill-0": "gloo", "prefill-1": None, "decode-0": None, "decode-1": "gloo"}  # the one-shot needs GPUs
    assert len({stats(c, child)["namespace"] for child in c.prefills + c.decodes}) == 1  # TP is not in it
    tok = reference_engine.tokenizer
    pairs = [
        (c.prefills[0], c.decodes[0], "A TP=2 prefill hands a long prompt to a TP=1 decode: " + "waves fold over the reef, " * 9),
        (c.prefills[1], c.decodes[1], "A TP=1 prefill hands a long prompt to a TP=2 decode: " + "gulls circle the harbour, " * 9),
    ]
    for prefill, decode, text in pairs:
        prompt = tok.encode(text)
        tokens, trace = prefill_then_decode(c, prompt, N, prefill_url=prefill.url, decode_url=decode.url)
        assert tokens == engine_tokens(reference_engine, prompt, N), (prefill.name, decode.name)
        # Every prompt token came from the pool (whole blocks and the partial last one).
        assert trace["pool_hit_blocks"] == -(-len(prompt) // 16) and not trace["pool_miss_reasons"], trace


def test_a_killed_rank_takes_its_decode_down_and_the_router_resumes_its_streams(tp_cluster, reference_engine):
    from openai import OpenAI

    c = tp_cluster
    client = OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    tok = reference_engine.tokenizer
    chats = [[{"role": "user", "content": f"In two sentences, describe the {thing} at dawn."}] for thing in ("harbour", "forest", "desert", "river")]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # long enough to be cut
    refs = [tok.decode(o.token_ids) for o in reference_engine.generate([tok.encode_chat(m) for m in chats], greedy)]
    decode = c.decodes[1]
    rank_pid = stats(c, decode)["tensor_parallel"]["rank_pids"][1]
    resumed_before = metric(metrics(c.url), "tidepool_router_decode_resumptions_total")
    restarts = c.supervisor.restarts(decode.name)

    texts: list[str | None] = [None] * len(chats)
    traces: list[dict | None] = [None] * len(chats)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model=model, messages=chats[i], temperature=0, max_tokens=40, stream=True, extra_body={**TRACE, "ignore_eos": True}
            )
            parts = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                if (chunk.model_extra or {}).get("tidepool"):
                    traces[i] = trace_of(chunk)
            texts[i] = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    # Kill rank 1 of the TP=2 decode once it is decoding some of them.
    wait_until(lambda: stats(c, decode)["engine"]["running"] > 0, 120, "the TP=2 decode to run a request")
    os.kill(rank_pid, signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert texts == refs
    assert metric(metrics(c.url), "tidepool_router_decode_resumptions_total") > resumed_before
    attempts = [a for tr in traces if tr for p in tr["prompts"] for ch in p["choices"] for a in ch["attempts"]]
    assert any(a["instance"] == decode.name and a["outcome"] not in ("length", "stop") for a in attempts), attempts
    # It deregistered (the router did not wait for missed heartbeats), and it is back.
    router_log = (c.config.log_dir / "router.log").read_text()
    # (the reason: the watcher's "rank 1 exited", or the mirrored operation that failed first)
    assert re.search(rf"decode {decode.name} at \S+ deregistered: (tensor-parallel rank 1|\w+ failed on rank 0)", router_log), router_log
    wait_until(lambda: c.supervisor.restarts(decode.name) > restarts, 60, "the supervisor to restart the decode")
    wait_until(lambda: decode.url is not None and _registered(c, decode.name), 180, "the decode to register again")
    assert stats(c, decode)["tensor_parallel"]["rank_pids"][1] != rank_pid
    again = prefill_then_decode(c, tok.encode(chats[0][0]["content"] * 4), 6, prefill_url=c.prefills[1].url, decode_url=decode.url)[0]
    assert again == engine_tokens(reference_engine, tok.encode(chats[0][0]["content"] * 4), 6)


def _registered(c, name: str) -> bool:
    try:
        return any(w.get("id", w.get("instance_id")) == name for w in c.workers())
    except OSError:
        return False
