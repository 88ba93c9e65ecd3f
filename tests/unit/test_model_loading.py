"""Model loading: tiny random Hugging Face checkpoints of every supported family against
transformers, the embedded GGUF's config, fingerprints and namespaces, bf16 on the CPU.

The HF checkpoints are written by transformers itself (tests/checkpoints.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libs.engine import EngineConfig, LLM, SamplingParams
from libs.model import default_model_path, load_config, load_model
from libs.model.attention import torch_backend
from tests.checkpoints import assert_greedy_matches, assert_logits_match, save_tokenizer, write_checkpoint
from tests.models import CHAT_PROMPTS, RAW_PROMPTS, hf_gguf_tokenizer

transformers = pytest.importorskip("transformers")

N_GREEDY = 16
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (config class, model class, config overrides)
CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=50000.0)),
    "llama3-rope-scaling-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "qwen2-qkv-bias-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "mistral-untied": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, rope_theta=20000.0)),
}
CUSTOM_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def make_checkpoint(name: str, folder: Path, tokenizer_dir: Path, *, seed: int = 0):
    """Write a tiny random checkpoint of family ``name`` into ``folder``; return the HF model."""
    cfg_cls, model_cls, overrides = CASES[name]
    return write_checkpoint(cfg_cls, model_cls, {**SMALL, **overrides}, folder, tokenizer_dir, seed=seed)


def engine_for(path, **overrides) -> LLM:
    return LLM(EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=64, **overrides))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory, tokenizer_dir):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = make_checkpoint(name, folder, tokenizer_dir)
    return name, model, folder, engine_for(folder)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = hf_gguf_tokenizer()
    long_text = " ".join(RAW_PROMPTS)  # > 64 tokens: past llama3's original context here
    texts = [RAW_PROMPTS[0], RAW_PROMPTS[6], long_text]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    ids.append(tok.apply_chat_template(CHAT_PROMPTS[2], add_generation_prompt=True, tokenize=True, return_dict=False))
    assert max(len(x) for x in ids) > 64
    return [list(map(int, x)) for x in ids]


def test_config_is_read_like_transformers(checkpoint):
    name, model, folder, engine = checkpoint
    ours, ref = engine.model_config, model.config
    assert ours.architecture == ref.model_type
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.hidden_size, ours.vocab_size) == (
        ref.num_hidden_layers, ref.num_attention_heads, ref.num_key_value_heads, ref.hidden_size, ref.vocab_size,
    )
    assert ours.rope_theta == CASES[name][2]["rope_theta"]
    assert ours.tie_word_embeddings == CASES[name][2]["tie_word_embeddings"]
    assert ours.attention_bias == name.startswith("qwen2")
    assert (ours.rope_scaling is not None) == ("rope_scaling" in CASES[name][2])
    if ours.rope_scaling is not None:
        assert ours.rope_scaling["factor"] == 8.0
    untied = not ours.tie_word_embeddings
    assert (engine.loaded.model.lm_head is not None) == untied


def test_first_step_logits_match_transformers(checkpoint, prompts):
    _, model, _, engine = checkpoint
    assert_logits_match(model, engine, prompts)


def test_greedy_tokens_match_transformers(checkpoint, prompts):
    _, model, _, engine = checkpoint
    assert_greedy_matches(model, engine, prompts, N_GREEDY)


def test_tokenizer_and_template_come_from_the_checkpoint(tmp_path, tokenizer_dir):
    """A folder whose chat template differs from the GGUF's renders with its own."""
    folder = tmp_path / "custom"
    make_checkpoint("llama-untied", folder, tokenizer_dir)
    (folder / "chat_template.jinja").write_text(CUSTOM_TEMPLATE)
    loaded = load_model(folder, dtype=torch.float32, device=torch.device("cpu"), backend=torch_backend())
    tok = loaded.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "[user] hi\n[assistant] "
    ref = hf_gguf_tokenizer()
    for text in RAW_PROMPTS + ["<|im_start|>user\nx<|im_end|>", "  spaces\tand 12345 😀"]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.eos_token_ids[0] == ref.eos_token_id


# -- the embedded GGUF ------------------------------------------------------------------


def test_gguf_config(engine):
    """SmolLM2-135M's published shape, read from the GGUF metadata (and the tensors, for the tie)."""
    for cfg in (engine.model_config, load_config(None)):
        assert cfg.architecture == "llama"
        assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
        assert cfg.rope_theta == 100000.0
        assert cfg.tie_word_embeddings is True
        assert cfg.rope_scaling is None
    assert engine.loaded.model.lm_head is None
    assert engine.loaded.path == default_model_path()


# -- fingerprints -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_gguf():
    return load_model(None, dtype=torch.bfloat16, device=torch.device("cpu"), backend=torch_backend())


def test_fingerprint_stable_across_loads_and_content_addressed(tmp_path, tokenizer_dir):
    a, b, other = tmp_path / "a", tmp_path / "b", tmp_path / "other"
    make_checkpoint("llama-untied", a, tokenizer_dir, seed=1)
    make_checkpoint("llama-untied", b, tokenizer_dir, seed=1)  # same weights, another folder
    make_checkpoint("llama-untied", other, tokenizer_dir, seed=2)  # same shapes, other weights
    load = lambda p: load_model(p, dtype=torch.float32, device=torch.device("cpu"), backend=torch_backend()).fingerprint
    fa = load(a)
    assert load(a) == fa
    assert load(b) == fa
    fo = load(other)
    assert fo.weights_digest != fa.weights_digest
    assert fo.namespace(16) != fa.namespace(16)
    assert fo.namespace(16).digest != fa.namespace(16).digest


def test_fingerprint_changes_with_dtype_and_namespace_with_block_size(engine, bf16_gguf):
    f32, bf16 = engine.loaded.fingerprint, bf16_gguf.fingerprint
    assert (f32.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert f32.weights_digest == bf16.weights_digest  # same file
    assert f32 != bf16
    assert f32.namespace(16).digest != bf16.namespace(16).digest
    assert f32.namespace(16).digest != f32.namespace(32).digest
    assert f32.namespace(16).digest == engine.namespace.digest  # the engine uses its block size (16)


def test_bf16_on_cpu_generates_sensible_text(bf16_gguf):
    engine = LLM(EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64), loaded=bf16_gguf)
    assert engine.layout.dtype == torch.bfloat16
    r = engine.generate(messages=CHAT_PROMPTS[0], params=SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in r.text, r.text
