"""GGUF metadata: the model's hyper-parameters and tokenizer fields, read without torch."""

from __future__ import annotations

from typing import Any

from libs.model.config import ModelConfig


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of a ``gguf.GGUFReader`` as plain Python values."""
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def gguf_config(meta: dict[str, Any]) -> ModelConfig:
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    p = f"{arch}."
    heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    scaling = None
    if meta.get(p + "rope.scaling.type") not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {meta[p + 'rope.scaling.type']!r}")
    return ModelConfig(
        architecture="qwen2" if arch == "qwen2" else "llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[p + "feed_forward_length"]),
        num_layers=int(meta[p + "block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(p + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(p + "context_length", 4096)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=False,  # decided from the tensors present, below
        attention_bias=arch == "qwen2",
        rope_scaling=scaling,
        name=str(meta.get("general.name", "")),
    )
