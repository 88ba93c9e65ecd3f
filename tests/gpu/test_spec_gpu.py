"""Speculative decoding on CUDA: the verify step in the prefill CUDA graphs, the draft's
decode steps in its own graphs, the Triton rejection sampler and async prepare, all on the
engine's real GPU path; greedy output must equal decoding without speculation on the same
weights."""

import json

import pytest
import torch

from libs.engine import SamplingParams
from tests.gpu.test_engine_gpu import make, models, prompts  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def spec(loaded, cfg: dict, **kw):
    return make(loaded, speculative_config=json.dumps({"min_acceptance_length": 0, **cfg}), **kw)


def verify_paths(eng) -> list[str]:
    """The path (graph or eager) of every verify step the engine lays out from now on."""
    paths, build = [], eng.builder.build

    def spy(*a):
        step = build(*a)
        if step.num_verify_tokens:
            paths.append(step.path)
        return step

    eng.builder.build = spy
    return paths


@pytest.mark.parametrize(
    "cfg",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "self_draft", "num_draft_layers": 2, "num_speculative_tokens": 3},
        {"method": "self_draft", "num_draft_layers": 2, "num_speculative_tokens": 3, "forced_acceptance": 1.0},
    ],
    ids=["ngram", "self_draft", "forced"],
)
def test_greedy_equals_plain_on_cuda_with_graphs(models, cfg):
    _, loaded = models
    ps = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make(loaded)
    want = [r.token_ids for r in plain.generate(ps, params)]
    plain.close()
    eng = spec(loaded, {**cfg, "async_prepare": "on"})
    paths = verify_paths(eng)
    got = [r.token_ids for r in eng.generate(ps, params)]
    assert eng.spec.prepare_runner is not None
    if cfg.get("forced_acceptance") is None:
        assert got == want
    else:  # forced: every draft accepted, all bursts full; still exactly max_tokens each
        assert all(len(g) == 24 for g in got)
        m = eng.spec.metrics
        assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert paths and all(p == "prefill_graph" for p in paths)  # every verify step replayed a graph
    if cfg["method"] == "self_draft":
        assert eng.spec.proposer.graphs.replays["decode"] > 0  # and the draft's decode steps theirs
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.close()


def test_verify_graph_logits_equal_eager(models):
    _, loaded = models
    ps = prompts(4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cfg = {"method": "self_draft", "num_draft_layers": 2, "num_speculative_tokens": 3, "forced_acceptance": 0.5}
    a = spec(loaded, cfg)
    b = spec(loaded, cfg, cuda_graphs=False)
    paths_a, paths_b = verify_paths(a), verify_paths(b)
    assert [r.token_ids for r in a.generate(ps, params)] == [r.token_ids for r in b.generate(ps, params)]
    assert paths_a and set(paths_a) == {"prefill_graph"} and set(paths_b) == {"eager"}
    a.close()
    b.close()
