"""Expert parallelism with torch.distributed: two gloo processes on the CPU, EP=2 against EP=1.

Each rank routes its own tokens, keeps half the experts, and dispatches and combines by
all-to-all (libs/model/moe/dispatch.py). Checked:

- layer level, per strategy (loop, and the contiguous and masked executors on the
  reference kernels): a rank with no tokens, a rank that receives nothing (all its pairs
  go to the other rank's experts), random routing; outputs equal EP=1's on the same tokens;
- model level: a tiny Mixtral loaded from its folder with EP=2 on both ranks (each storing
  half the experts) serves through the engine in lockstep; first-step logits equal EP=1's
  within 1e-5 and 32 greedy tokens are identical;
- the same with FP8 experts (``--quantization fp8``): each rank holds its experts' e4m3
  weights and block scales (half of them); layer outputs equal EP=1's (the activations are
  quantized per token row, so a row's FP8 values do not depend on which rank computes it),
  and the model's logits and greedy tokens equal EP=1 fp8's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from libs.engine import SamplingParams
from services.launch.processes import free_port
from tests import ep_worker
from tests.checkpoints import save_tokenizer, write_checkpoint
from tests.models import RAW_PROMPTS, hf_gguf_tokenizer
from tests.unit.test_moe_models import CASES, engine_for

pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

N_GREEDY = 32


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral")
    write_checkpoint(*CASES["mixtral"], folder, save_tokenizer(tmp_path_factory.mktemp("tok")))
    tok = hf_gguf_tokenizer()
    prompts = [[int(t) for t in tok.encode(p, add_special_tokens=False)] for p in (RAW_PROMPTS[1], RAW_PROMPTS[7])]
    out = tmp_path_factory.mktemp("ep")
    mp.spawn(ep_worker.run, args=(free_port(), str(folder), prompts, N_GREEDY, str(out)), nprocs=ep_worker.WORLD, join=True)
    return folder, prompts, [torch.load(out / f"rank{r}.pt") for r in range(ep_worker.WORLD)]


@pytest.mark.parametrize("strategy", ["loop", "contiguous", "masked"])
def test_layer_ep2_equals_ep1(ep_run, strategy):
    _, _, ranks = ep_run
    for rank, results in enumerate(ranks):
        assert (results["ep_rank"], results["ep_size"]) == (rank, 2)
        assert results[f"local_experts_{strategy}"] == (4 * rank, 4)
        full = ep_worker.full_block(strategy)
        for case, *_ in ep_worker.LAYER_CASES:
            x, routing = ep_worker.layer_tokens(case, rank)
            with torch.no_grad():
                ref = full.dispatch(x, routing, full.run_experts)
            got = results[f"layer/{strategy}/{case}"]
            assert got.shape == ref.shape == x.shape
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6, msg=f"{case} on rank {rank}")


def test_model_ep2_equals_ep1(ep_run):
    folder, prompts, ranks = ep_run
    engine = engine_for(Path(folder))
    ref_logits = [engine.first_step_logits(ids) for ids in prompts]
    ref_tokens = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=N_GREEDY, ignore_eos=True))]
    num_experts = CASES["mixtral"][2]["num_local_experts"] * CASES["mixtral"][2]["num_hidden_layers"]
    for results in ranks:
        assert results["experts_stored"] == num_experts // 2
        for got, ref in zip(results["logits"], ref_logits):
            assert (got - ref).abs().max().item() < 1e-5
        assert results["tokens"] == ref_tokens


@pytest.mark.parametrize("strategy", ["contiguous", "masked"])
def test_layer_ep2_equals_ep1_with_fp8_experts(ep_run, strategy):
    _, _, ranks = ep_run
    name = f"fp8-{strategy}"
    full = ep_worker.full_block(strategy, fp8=True)
    assert full.fp8
    for rank, results in enumerate(ranks):
        assert results[f"local_experts_{name}"] == (4 * rank, 4) and results[f"dtype_{name}"] == torch.float8_e4m3fn
        for case, *_ in ep_worker.LAYER_CASES:
            x, routing = ep_worker.layer_tokens(case, rank)
            with torch.no_grad():
                ref = full.dispatch(x, routing, full.run_experts)
            torch.testing.assert_close(results[f"layer/{name}/{case}"], ref, atol=1e-6, rtol=1e-6, msg=f"{case} on rank {rank}")
        dense = results[f"layer/{strategy}/uniform"]
        assert not torch.allclose(results[f"layer/{name}/uniform"], dense, atol=1e-4)  # FP8 really ran


def test_model_ep2_equals_ep1_with_fp8_experts(ep_run):
    folder, prompts, ranks = ep_run
    engine = engine_for(Path(folder), quantization="fp8")
    ref_logits = [engine.first_step_logits(ids) for ids in prompts]
    ref_tokens = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=N_GREEDY, ignore_eos=True))]
    num_local = CASES["mixtral"][2]["num_local_experts"] // 2
    for results in ranks:
        assert results["fp8_experts"] == [(torch.float8_e4m3fn, num_local, num_local)] * CASES["mixtral"][2]["num_hidden_layers"]
        for got, ref in zip(results["fp8_logits"], ref_logits):
            assert (got - ref).abs().max().item() < 1e-5
        assert results["fp8_tokens"] == ref_tokens
