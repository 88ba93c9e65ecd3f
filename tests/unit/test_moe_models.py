"""Mixture-of-experts models against transformers: Mixtral, Qwen2-MoE (shared expert, a
dense layer among sparse ones) and Qwen3-MoE (q/k norm, ``norm_topk_prob``, a head_dim
that is not hidden / heads), each a tiny random checkpoint written by transformers itself
(tests/checkpoints.py), loaded from its folder and served by the engine on the CPU in fp32.

- first-step logits within 1e-4 of transformers', for prompts of several lengths;
- 32 greedy tokens equal to transformers' own generation, batched;
- every expert strategy (the grouped executors run the torch references of the Triton
  kernels on the CPU) gives transformers' greedy tokens; ``grouped_mm`` falls back in fp32;
- ``tidepool generate`` on one of them prints what the engine computes;
- FakeBalanceExpert changes the output and the KV namespace, and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from libs.engine import EngineConfig, LLM, SamplingParams
from libs.model.moe.block import SparseMoeBlock
from tests.checkpoints import assert_greedy_matches, assert_logits_match, save_tokenizer, write_checkpoint
from tests.models import CHAT_PROMPTS, RAW_PROMPTS, hf_gguf_tokenizer, hf_greedy

transformers = pytest.importorskip("transformers")

N_GREEDY = 32
ROOT = Path(__file__).resolve().parents[2]
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
# name -> (config class, model class, config)
CASES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        BASE, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False,
    )),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        BASE, intermediate_size=112, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        BASE, head_dim=24, intermediate_size=112, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, tie_word_embeddings=True,
    )),
}


def engine_for(path: Path, **overrides) -> LLM:
    return LLM(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=96, **overrides))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_dir) -> dict[str, tuple[Path, object]]:
    out = {}
    for name, (cfg_cls, model_cls, cfg) in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = folder, write_checkpoint(cfg_cls, model_cls, cfg, folder, tokenizer_dir)
    return out


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, folders):
    folder, model = folders[request.param]
    return request.param, model, folder, engine_for(folder)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = hf_gguf_tokenizer()
    texts = [RAW_PROMPTS[3], RAW_PROMPTS[6], " ".join(RAW_PROMPTS[:5])]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    ids.append(tok.apply_chat_template(CHAT_PROMPTS[2], add_generation_prompt=True, tokenize=True, return_dict=False))
    return [list(map(int, x)) for x in ids]


def test_config_is_read_like_transformers(checkpoint):
    name, model, _, engine = checkpoint
    ours, ref = engine.model_config, model.config
    assert ours.architecture == ref.model_type == name
    moe = ours.moe
    assert moe is not None and moe.top_k == ref.num_experts_per_tok
    assert moe.num_experts == CASES[name][2].get("num_experts", CASES[name][2].get("num_local_experts"))
    assert moe.renormalize == (name == "mixtral" or bool(getattr(ref, "norm_topk_prob", False)))
    assert moe.shared_expert_intermediate_size == CASES[name][2].get("shared_expert_intermediate_size", 0)
    assert ours.qk_norm == (name == "qwen3_moe")
    assert ours.head_dim == CASES[name][2].get("head_dim", 16)
    assert ours.attention_bias == (name == "qwen2_moe")
    layers = engine.loaded.model.layers
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in layers]
    assert sparse == [i not in CASES[name][2].get("mlp_only_layers", []) for i in range(len(layers))]


def test_configs_the_model_cannot_run_are_refused(folders):
    import json

    from libs.model.config import ModelConfig

    cfg = json.loads((folders["qwen3_moe"][0] / "config.json").read_text())
    ModelConfig.from_hf(cfg)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**cfg, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**cfg, "num_experts_per_tok": cfg.get("num_experts", cfg.get("num_local_experts")) + 1})


def test_first_step_logits_match_transformers(checkpoint, prompts):
    _, model, _, engine = checkpoint
    assert_logits_match(model, engine, prompts)


def test_greedy_tokens_match_transformers(checkpoint, prompts):
    _, model, _, engine = checkpoint
    assert_greedy_matches(model, engine, prompts, N_GREEDY)


@pytest.mark.parametrize("strategy", ["loop", "contiguous", "masked", "hybrid", "grouped_mm"])
def test_every_strategy_generates_transformers_tokens(folders, prompts, strategy):
    folder, model = folders["qwen3_moe"]
    engine = engine_for(folder, moe_strategy=strategy)
    ours = engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for ids, r in zip(prompts, ours):
        assert r.token_ids == hf_greedy(model, ids, 12)[0]
    block = engine.loaded.model.layers[0].mlp
    assert block.selection.requested == strategy
    expected = "loop" if strategy == "grouped_mm" else strategy  # grouped_mm needs bf16: auto's choice instead
    assert block.selection.executor.name == expected, block.selection.reason


def test_fake_balance_changes_routing_and_namespace(folders, prompts):
    folder, _ = folders["mixtral"]
    real, fake = engine_for(folder), engine_for(folder, moe_fake_balance=True)
    assert real.namespace != fake.namespace, "KV of fake routing must never be shared with real routing's"
    ids = prompts[2]
    assert not torch.allclose(real.first_step_logits(ids), fake.first_step_logits(ids))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert fake.generate([ids], params)[0].token_ids == fake.generate([ids], params)[0].token_ids


def test_tidepool_generate_serves_a_moe_folder(folders):
    folder, _ = folders["qwen2_moe"]
    prompt = RAW_PROMPTS[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run(
        [sys.executable, "-m", "libs.cli", "generate", "--device", "cpu", "--dtype", "float32", "--model", str(folder),
         "--prompt", prompt, "--max-tokens", "16", "--temperature", "0", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    engine = engine_for(folder)
    assert out["prompt_token_ids"] == engine.tokenizer.encode(prompt)
    assert out["token_ids"] == engine.generate([out["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=16))[0].token_ids
