"""Every service's metrics move by the expected amounts under a known workload, so none
sits silently at zero (DESIGN.md: "counters that feed metrics are always set")."""

import pytest

from tests.integration.pd_helpers import TRACE, metric, metrics, trace_of

pytestmark = pytest.mark.integration


def test_metrics_follow_a_known_workload(cluster, client):
    model = client.models.list().data[0].id
    pre_url, dec_url, router_url = cluster.prefills[0].url, cluster.decodes[0].url, cluster.url
    before = {u: metrics(u) for u in (pre_url, dec_url, router_url)}
    msgs = [{"role": "user", "content": "Metrics check: describe a quiet harbour at dawn, in detail. " * 3}]
    resp = client.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=12, extra_body=TRACE)
    trace = trace_of(resp)
    totals = trace["totals"]
    after = {u: metrics(u) for u in (pre_url, dec_url, router_url)}
    d = lambda url, name, **l: metric(after[url], name, **l) - metric(before[url], name, **l)  # noqa: E731

    assert totals["blocks_written"] > 0 and totals["blocks_hit"] > 0
    # prefill: what it wrote, its request and its timings
    assert d(pre_url, "tidepool_pool_written_blocks_total") == totals["blocks_written"]
    assert d(pre_url, "tidepool_pool_written_bytes_total") == totals["bytes_written"]
    assert d(pre_url, "tidepool_worker_requests_total", outcome="ok") == 1
    assert d(pre_url, "tidepool_handoff_seconds_count", phase="store") == 1
    assert d(pre_url, "tidepool_engine_step_seconds_count") >= 1
    assert d(pre_url, "tidepool_worker_ttft_seconds_count") == 1
    # decode: what it loaded, its tokens and their timing
    assert d(dec_url, "tidepool_pool_hit_blocks_total") == totals["blocks_hit"]
    assert d(dec_url, "tidepool_pool_read_bytes_total") == totals["bytes_read"]
    assert d(dec_url, "tidepool_handoff_seconds_count", phase="load") == 1
    assert d(dec_url, "tidepool_worker_requests_total", outcome="ok") == 1
    assert d(dec_url, "tidepool_worker_ttft_seconds_count") == 1
    assert d(dec_url, "tidepool_worker_tpot_seconds_count") >= 1
    assert d(dec_url, "tidepool_generated_tokens") == resp.usage.completion_tokens - 1  # the first came from prefill
    assert metric(after[dec_url], "tidepool_kv_blocks_total") == 768
    assert metric(after[dec_url], "tidepool_kv_blocks_used") == 0  # finished: all free again
    # router: latency histograms, token counts, pool traffic, handoff
    assert d(router_url, "tidepool_router_ttft_seconds_count") == 1
    assert d(router_url, "tidepool_router_e2e_latency_seconds_count") == 1
    assert d(router_url, "tidepool_router_time_per_output_token_seconds_count") == 1
    assert d(router_url, "tidepool_router_completion_tokens_total") == resp.usage.completion_tokens
    assert d(router_url, "tidepool_router_prompt_tokens_total") == resp.usage.prompt_tokens
    assert d(router_url, "tidepool_router_pool_hit_blocks_total") == totals["blocks_hit"]
    assert d(router_url, "tidepool_router_pool_bytes_total", direction="written") == totals["bytes_written"]
    assert d(router_url, "tidepool_router_handoff_seconds_count") == 1
    assert d(router_url, "tidepool_router_prefill_decisions_total", decision="prefill") == 1
    assert metric(after[router_url], "tidepool_router_requests_running") == 0
