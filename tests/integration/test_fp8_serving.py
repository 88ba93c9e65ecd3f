"""FP8 end to end: prefill and decode processes started with ``--quantization fp8`` serve
through the router and hand the KV off through Redis, reproducing the in-process FP8
engine token for token; their blocks live under an FP8 namespace; and a dense decode
that tries to join them is refused at registration, with the reason in its log."""

from __future__ import annotations

import pytest

from tests.integration.pd_helpers import TRACE, engine_tokens, trace_of, wait_until

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Write two short sentences about the sea and the wind at night."}]


@pytest.fixture(scope="module")
def fp8_cluster(tmp_path_factory):
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.processes import free_port

    cfg = ClusterConfig(
        router_port=free_port(),
        device="cpu",
        threads=1,
        log_dir=tmp_path_factory.mktemp("fp8-cluster-logs"),
        worker_args=["--num-blocks", "256", "--heartbeat-s", "0.2", "--quantization", "fp8"],
        router_args=["--heartbeat-timeout-s", "3"],
    )
    with LocalCluster(cfg) as c:
        yield c


@pytest.fixture(scope="module")
def fp8_engine():
    import torch

    from libs.engine import LLM, EngineConfig

    torch.set_num_threads(1)
    return LLM(EngineConfig(device="cpu", dtype="float32", num_blocks=256, quantization="fp8"))


@pytest.mark.slow  # its stack ~25 s: make test-slow; tests/unit/test_fp8_model.py checks the FP8 engine and CLI, test_pd_serving the PD path
def test_fp8_prefill_and_decode_serve_like_the_fp8_engine(fp8_cluster, fp8_engine):
    from openai import OpenAI

    workers = fp8_cluster.workers()
    assert sorted((w["role"], w["quantization"]) for w in workers) == [("decode", "fp8"), ("prefill", "fp8")]
    assert workers[0]["namespace"] == workers[1]["namespace"] == fp8_engine.namespace.hex
    client = OpenAI(base_url=fp8_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    tok = fp8_engine.tokenizer
    ref = engine_tokens(fp8_engine, tok.encode_chat(CHAT), 16)
    resp = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=16, extra_body=TRACE)
    assert resp.choices[0].message.content == tok.decode(ref)
    totals = trace_of(resp)["totals"]
    assert totals["blocks_written"] > 0 and totals["blocks_hit"] >= totals["blocks_written"]  # through the pool


@pytest.mark.slow  # a second stack, ~12 s: make test-slow; tests/unit/test_fp8_serving.py checks the refusal in the registry and the router
def test_a_dense_decode_is_refused_by_an_fp8_deployment(fp8_cluster, tmp_path):
    from services.launch.processes import Child, child_env, python_argv

    log = tmp_path / "dense-decode.log"
    dense = Child(
        "dense-decode",
        python_argv(
            "services.decode", "--port", "0", "--device", "cpu", "--threads", "1", "--num-blocks", "64",
            "--redis-url", fp8_cluster.redis_url, "--router-url", fp8_cluster.url, "--instance-id", "dense-decode",
            "--heartbeat-s", "0.2",
        ),
        env={**child_env(1), "TIDEPOOL_INTERNAL_TOKEN": fp8_cluster.config.internal_token},
        log_path=log,
    )
    dense.start()
    try:
        dense.wait_ready(180)
        wait_until(lambda: "refused registration" in log.read_text(), timeout=30, what="the refusal in the decode's log")
        line = next(line for line in log.read_text().splitlines() if "refused registration" in line)
        assert "quantization_mismatch" in line and "runs none weights but prefill instance" in line
        assert "dense-decode" not in [w["id"] for w in fp8_cluster.workers()]
        assert dense.running  # refused, not crashed: it keeps serving standalone and retrying
    finally:
        dense.stop()
