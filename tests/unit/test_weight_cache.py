"""The converted-model cache (libs/model/weight_cache.py): a warm load maps the cached tensors
instead of converting the GGUF, gives a bit-identical model, and never loads a bad entry."""

import pytest
import torch

import libs.model.loader as loader
import libs.model.weight_cache as weight_cache
from libs.model import default_model_path, load_model, load_tokenizer
from libs.model.attention import make_backend
from libs.model.config import ModelConfig
from libs.model.quantized import Int4Weight
from libs.model.source import weights_digest
from libs.model.weight_cache import WeightCache, resolve_cache_dir

CPU = torch.device("cpu")


def _load(cache_dir):
    return load_model(None, dtype=torch.float32, device=CPU, backend=make_backend("torch", CPU), cache_dir=cache_dir)


def _no_conversion(*args, **kwargs):
    raise AssertionError("the GGUF was converted although the cache holds it")


def test_warm_load_maps_the_cache_and_equals_the_converted_model(engine, tmp_path, monkeypatch):
    cold = _load(tmp_path)  # converts and fills the cache
    assert list((tmp_path / "gguf").iterdir()), "nothing was cached"
    del cold
    monkeypatch.setattr(loader, "read_gguf", _no_conversion)
    warm = _load(tmp_path)
    reference = engine.loaded.model.state_dict()
    got = warm.model.state_dict()
    assert got.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got[name], value), name
    assert warm.config == engine.loaded.config
    assert warm.fingerprint == engine.loaded.fingerprint  # same KV namespace: blocks are shared
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert warm.tokenizer.encode_chat(chat) == engine.tokenizer.encode_chat(chat)
    assert warm.tokenizer.eos_token_ids == engine.tokenizer.eos_token_ids

    # The router's tokenizer comes from the cached metadata, without parsing the GGUF.
    import gguf

    import libs.model.source as source

    monkeypatch.setattr(source, "read_gguf_file", _no_conversion)
    monkeypatch.setattr(gguf, "GGUFReader", _no_conversion)
    assert load_tokenizer(None, tmp_path).encode_chat(chat) == engine.tokenizer.encode_chat(chat)


def _tiny_state():
    g = torch.Generator().manual_seed(0)
    q4 = Int4Weight(torch.randint(0, 16, (4, 64), dtype=torch.uint8, generator=g), torch.rand(4, 2, generator=g), torch.rand(4, 2, generator=g))
    return {"model.norm.weight": torch.rand(8, generator=g), "model.layers.0.mlp.up_proj.weight": q4}


def _tiny_config():
    return ModelConfig(architecture="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64)


def test_config_round_trips_with_a_moe_block(tmp_path):
    from dataclasses import replace

    from libs.model.config import MoEConfig

    cfg = replace(_tiny_config(), architecture="qwen2_moe", moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=8, dense_layers=(0,)))
    cache = WeightCache(tmp_path)
    cache.store("ab" * 16, "dense", cfg, _tiny_state(), {})
    assert cache.load("ab" * 16, "dense")[0] == cfg


def test_entry_round_trips_dense_and_4bit_tensors_and_metadata(tmp_path):
    cache = WeightCache(tmp_path)
    state, meta = _tiny_state(), {"tokenizer.ggml.model": "gpt2", "general.name": "tiny"}
    assert cache.load("ab" * 16, "q4") is None  # a miss
    assert cache.store("ab" * 16, "q4", _tiny_config(), state, meta) is not None
    cfg, got, got_meta = cache.load("ab" * 16, "q4")
    assert cfg == _tiny_config() and got_meta == meta
    assert torch.equal(got["model.norm.weight"], state["model.norm.weight"])
    q, ref = got["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(q, Int4Weight)
    assert all(torch.equal(getattr(q, f), getattr(ref, f)) for f in ("q", "scale", "minimum"))
    assert cache.load("ab" * 16, "dense") is None  # another variant, another entry
    assert cache.load("cd" * 16, "q4") is None  # another source digest, another entry
    # A second writer of the same entry (two workers starting cold) leaves one good entry.
    assert cache.store("ab" * 16, "q4", _tiny_config(), state, meta) is not None
    assert cache.load("ab" * 16, "q4") is not None
    assert not [p for p in (tmp_path / "gguf").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_entry_is_dropped_never_loaded(tmp_path, damage):
    cache = WeightCache(tmp_path)
    entry = cache.store("ab" * 16, "dense", _tiny_config(), _tiny_state(), {})
    tensors = entry / "model.safetensors"
    data = bytearray(tensors.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10  # one bit of a weight: still a valid safetensors file
    else:
        data = data[: len(data) // 2]
    tensors.write_bytes(bytes(data))
    assert cache.load("ab" * 16, "dense") is None
    assert not entry.exists()  # removed, so the next start rebuilds it


def test_the_key_follows_the_conversion_code(tmp_path, monkeypatch):
    cache = WeightCache(tmp_path)
    cache.store("ab" * 16, "dense", _tiny_config(), _tiny_state(), {})
    monkeypatch.setattr(weight_cache, "LAYOUT_VERSION", weight_cache.LAYOUT_VERSION + 1)
    assert cache.load("ab" * 16, "dense") is None


def test_cache_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve_cache_dir("auto") == tmp_path / "tidepool"
    assert resolve_cache_dir(None) is None  # what --cache-dir none parses to
    assert resolve_cache_dir("none") is None and resolve_cache_dir("") is None and resolve_cache_dir("off") is None
    assert str(resolve_cache_dir("/x/y")) == "/x/y"
    from services.common import parse_settings
    from services.worker.settings import WorkerSettings

    assert parse_settings(WorkerSettings, argv=[], env={}).cache_dir == "auto"
    assert resolve_cache_dir(parse_settings(WorkerSettings, argv=["--cache-dir", "none"], env={}).cache_dir) is None


def test_an_unwritable_cache_costs_speed_not_the_load(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = WeightCache(blocker)
    assert cache.store(weights_digest(default_model_path()), "dense", _tiny_config(), _tiny_state(), {}) is None
    cache.store_metadata("ab" * 16, {})  # logs, does not raise
    assert cache.load_metadata("ab" * 16) is None
