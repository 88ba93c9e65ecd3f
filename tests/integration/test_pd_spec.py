"""Speculative decoding in PD serving: the decode instance speculates (prefill is
unchanged), greedy output through the router equals the in-process engine without
speculation, stop strings cut bursts where they cut single tokens, and the decode
instance's metrics and /stats report exactly the acceptance a known workload has."""

from __future__ import annotations

import json

import pytest

from libs.engine import SamplingParams
from tests.integration.pd_helpers import TRACE, metric, metrics, trace_of
from tests.integration.test_pd_serving import assert_went_through_pd
from tests.spec_expectations import expected_ngram

# Its own stack, ~30 s: make test-slow. make test keeps speculation in the engine (tests/unit/test_spec_*.py)
# and the CLI (tests/unit/test_cli.py), and PD without it (test_pd_serving.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow]

K, LO, HI = 4, 1, 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": LO, "prompt_lookup_max": HI, "min_acceptance_length": 0}
# Long enough (> 32 tokens) that the router sends it through prefill rather than straight to decode.
REPEATING = "Colours: " + "red green blue yellow, " * 8 + "red green"
CHAT = [{"role": "user", "content": "List the days of the week, twice."}]


@pytest.fixture(scope="module")
def spec_cluster(tmp_path_factory):
    """The test cluster, its decode instance speculating."""
    from services.launch.cluster import LocalCluster
    from tests.integration.conftest import cluster_config

    cfg = cluster_config(tmp_path_factory.mktemp("spec-cluster-logs"), num_blocks=512, decode_args=["--speculative-config", json.dumps(SPEC)])
    with LocalCluster(cfg) as c:
        yield c


@pytest.fixture(scope="module")
def spec_client(spec_cluster):
    from openai import OpenAI

    return OpenAI(base_url=spec_cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_pd_with_speculation_equals_the_engine_without(spec_client, reference_engine):
    tok = reference_engine.tokenizer
    model = spec_client.models.list().data[0].id
    ref = reference_engine.generate([tok.encode_chat(CHAT)], SamplingParams(temperature=0, max_tokens=32))[0]
    resp = spec_client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=32, extra_body=TRACE)
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert_went_through_pd(trace_of(resp))


def test_a_stop_string_cuts_a_burst_where_it_cuts_plain_decoding(spec_client, reference_engine):
    tok = reference_engine.tokenizer
    model = spec_client.models.list().data[0].id
    ref = reference_engine.generate([tok.encode(REPEATING)], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    stop = ref.text[len(ref.text) // 2 :][:9]  # from the middle of the output: inside a burst of accepted drafts
    resp = spec_client.completions.create(model=model, prompt=REPEATING, temperature=0, max_tokens=24, stop=[stop])
    assert resp.choices[0].text == ref.text[: ref.text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_decode_metrics_and_stats_report_the_known_acceptance(spec_cluster, spec_client, reference_engine):
    tok = reference_engine.tokenizer
    model = spec_client.models.list().data[0].id
    M = 32
    text = "Again. " + REPEATING  # not in the pool yet: it goes through prefill
    prompt = tok.encode(text)
    ref = reference_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=M, ignore_eos=True))[0].token_ids
    # The decode instance continues after prefill's first token: the same rounds as in-process.
    exp = expected_ngram(prompt, ref, k=K, min_n=LO, max_n=HI, max_tokens=M)
    dec, pre = spec_cluster.decodes[0].url, spec_cluster.prefills[0].url
    before, before_pre = metrics(dec), metrics(pre)
    stats_before = spec_cluster.get_json(dec + "/stats")["engine"]["spec_decode"]
    resp = spec_client.completions.create(model=model, prompt=text, temperature=0, max_tokens=M, extra_body={"ignore_eos": True, **TRACE})
    assert resp.choices[0].text == tok.decode(ref)
    assert_went_through_pd(trace_of(resp))
    after = metrics(dec)
    d = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert d("tidepool_spec_decode_num_drafts_total") == exp["num_drafts"]
    assert d("tidepool_spec_decode_num_draft_tokens_total") == exp["num_draft_tokens"]
    assert d("tidepool_spec_decode_num_accepted_tokens_total") == exp["num_accepted_tokens"]
    for pos, n in enumerate(exp["num_accepted_tokens_per_pos"]):
        assert d("tidepool_spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == n
    assert exp["num_accepted_tokens"] > exp["num_drafts"]  # a workload that pays
    stats = spec_cluster.get_json(dec + "/stats")["engine"]["spec_decode"]
    drafts = stats["num_drafts"] - stats_before["num_drafts"]
    accepted = stats["num_accepted_tokens"] - stats_before["num_accepted_tokens"]
    assert (drafts, accepted) == (exp["num_drafts"], exp["num_accepted_tokens"])
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"])
    # Prefill does not speculate: no counters move there.
    assert metric(metrics(pre), "tidepool_spec_decode_num_drafts_total") == metric(before_pre, "tidepool_spec_decode_num_drafts_total") == 0
