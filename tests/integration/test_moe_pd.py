"""A mixture-of-experts model served through PD like a dense one: a tiny random Qwen2-MoE
(shared expert, a dense layer among sparse ones) written by transformers to a folder, run by
the real stack (services.launch.LocalCluster: Redis, cache_store, router, prefill, decode as
processes), queried with the official openai client, and compared token for token with the
in-process engine, which tests/unit/test_moe_models.py compares with transformers. The KV
handed from prefill to decode through Redis has the dense layout: it depends on attention only.

With ``--quantization fp8`` on prefill and decode, the experts run FP8 (libs/model/fp8.py
``Fp8Experts``) in both processes, the blocks live under the FP8 namespace, and PD
reproduces the in-process FP8 engine token for token.
"""

from __future__ import annotations

import pytest

from tests.checkpoints import save_tokenizer, write_checkpoint
from tests.integration.pd_helpers import CHAT, PROMPT, TRACE, assert_went_through_pd, engine_tokens, trace_of
from tests.unit.test_moe_models import CASES, engine_for

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_moe")
    write_checkpoint(*CASES["qwen2_moe"], folder, save_tokenizer(tmp_path_factory.mktemp("tok")))
    return folder


def _cluster(folder, tmp_path_factory, *extra: str):
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.processes import free_port

    cfg = ClusterConfig(
        router_port=free_port(), model=str(folder), device="cpu", dtype="float32", threads=1,
        log_dir=tmp_path_factory.mktemp("moe-cluster-logs"),
        worker_args=["--num-blocks", "256", "--heartbeat-s", "0.2", *extra],
    )
    return LocalCluster(cfg)


@pytest.fixture(scope="module")
def moe_cluster(moe_folder, tmp_path_factory):
    with _cluster(moe_folder, tmp_path_factory) as c:
        yield c


@pytest.fixture(scope="module")
def moe_client(moe_cluster):
    from openai import OpenAI

    return OpenAI(base_url=moe_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def moe_engine(moe_folder):
    return engine_for(moe_folder)


def test_the_moe_folder_is_served_under_its_name(moe_client, moe_folder):
    assert [m.id for m in moe_client.models.list().data] == [moe_folder.name]


def test_chat_greedy_through_pd_equals_the_engine(moe_client, moe_folder, moe_engine):
    tok = moe_engine.tokenizer
    ref = engine_tokens(moe_engine, tok.encode_chat(CHAT), 24)
    resp = moe_client.chat.completions.create(model=moe_folder.name, messages=CHAT, temperature=0, max_tokens=24, extra_body=TRACE)
    assert resp.choices[0].message.content == tok.decode(ref)
    assert resp.usage.completion_tokens == len(ref)
    assert_went_through_pd(trace_of(resp))


def test_streamed_completion_through_pd_equals_the_engine(moe_client, moe_folder, moe_engine):
    tok = moe_engine.tokenizer
    ref = engine_tokens(moe_engine, tok.encode(PROMPT), 32)
    chunks = moe_client.completions.create(model=moe_folder.name, prompt=PROMPT, temperature=0, max_tokens=32, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(ref)


@pytest.mark.slow  # a second MoE stack, ~11 s: make test-slow
def test_fp8_experts_through_pd_equal_the_fp8_engine(moe_folder, moe_engine, tmp_path_factory):
    from openai import OpenAI

    engine = engine_for(moe_folder, quantization="fp8")
    assert engine.loaded.model.layers[0].mlp.fp8
    tok = engine.tokenizer
    ref = engine_tokens(engine, tok.encode_chat(CHAT), 16)
    assert ref != engine_tokens(moe_engine, tok.encode_chat(CHAT), 16)  # FP8 changes this random model's tokens: PD must match FP8's
    with _cluster(moe_folder, tmp_path_factory, "--quantization", "fp8") as cluster:
        workers = cluster.workers()
        assert sorted((w["role"], w["quantization"]) for w in workers) == [("decode", "fp8"), ("prefill", "fp8")]
        assert workers[0]["namespace"] == workers[1]["namespace"] == engine.namespace.hex
        client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model=moe_folder.name, messages=CHAT, temperature=0, max_tokens=16, extra_body=TRACE)
    assert resp.choices[0].message.content == tok.decode(ref)
    assert_went_through_pd(trace_of(resp))
