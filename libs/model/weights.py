"""Reading weights: GGUF files (dequantized) and Hugging Face safetensors folders.

Both readers return a state dict in Hugging Face parameter names
(``model.layers.0.self_attn.q_proj.weight`` ...), float32 on the CPU, so the model
code has one naming scheme whatever the source.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from libs.model.config import ModelConfig
from libs.model.gguf_file import read_gguf_file
from libs.model.gguf_meta import gguf_config

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rope(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation for interleaved rope (back to the HF layout).

    llama.cpp's converter reorders each head's rows from [half0, half1] to interleaved
    pairs so its rope can rotate adjacent elements; our rope (like HF's) rotates the two
    halves, so the rows must be put back. Applies to weights and biases alike.
    """
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    if not isinstance(w, torch.Tensor):  # an Int4Weight: permute its rows the same way
        rows = torch.arange(out_dim).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)
        return w.rows(rows)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: Path, *, keep_q4: bool = False) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """Config, float32 state dict (HF names) and raw metadata of a GGUF file.

    With ``keep_q4``, linear weights stored as Q4_0/Q4_1 come back as ``Int4Weight``
    (libs/model/quantized.py) instead of being dequantized."""
    import gguf

    from libs.model.quantized import read_q4

    gguf_file = read_gguf_file(path)
    meta = gguf_file.metadata
    cfg = gguf_config(meta)
    state: dict[str, torch.Tensor] = {}
    for t in gguf_file.tensors:
        name = _gguf_to_hf_name(t.name)
        if name is None:
            continue
        if t.tensor_type.name in ("Q4_0", "Q4_1") and len(t.shape) == 2:
            # GGUF lists dims fastest-first: shape [in, out] is a [out, in] matrix. Unpacked
            # by kernels of our own (bit-exact with gguf.quants, tests/unit/test_quantized.py,
            # and faster), then dequantized unless the caller keeps the 4-bit linears.
            tensor = read_q4(t.data, t.tensor_type.name, (int(t.shape[1]), int(t.shape[0])))
            if not (keep_q4 and name.endswith("_proj.weight")):
                tensor = tensor.dequantize()
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            # GGUF lists dims fastest-first; dequantize already returns [out, in].
            tensor = torch.from_numpy(np.require(arr, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
        if meta["general.architecture"] == "llama":
            if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
                tensor = unpermute_rope(tensor, cfg.num_heads)
            elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
                tensor = unpermute_rope(tensor, cfg.num_kv_heads)
        state[name] = tensor
    tied = "lm_head.weight" not in state
    cfg = _replace(cfg, tie_word_embeddings=tied)
    return cfg, state, meta


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".", 3)
        if kind in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
    if name == "rope_freqs.weight":
        return None  # Llama 3 rope factors: recomputed from the config
    raise ValueError(f"unexpected tensor {name!r} in GGUF file")


def read_hf_folder(folder: Path, shard: Callable[[ModelConfig], Any] | None = None) -> tuple[ModelConfig, dict[str, Any]]:
    """Config and float32 state dict of a Hugging Face checkpoint folder (*.safetensors).

    A block-scaled FP8 checkpoint (libs/model/fp8_checkpoint.py) gives its projections as
    ``Fp8Weight`` (e4m3 values and their scales) instead of float32 tensors.

    ``shard``: a tensor-parallel rank's ``TPShard`` for the config (libs/model/parallel.py);
    each tensor is then read only as far as that rank holds it (safetensors slices), so a
    rank never has the whole model in memory. FP8 checkpoints are cut after their scales
    are attached (``Fp8Weight.narrow``)."""
    from safetensors import safe_open

    from libs.model.fp8_checkpoint import check_quantization_config, collect_fp8_weights

    cfg_json = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(cfg_json)
    fp8 = check_quantization_config(cfg_json)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    plan = shard(cfg) if shard is not None else None
    lazy = plan is not None and not fp8
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                spec = plan.slice(key) if lazy else None
                if spec is None:
                    tensor = sf.get_tensor(key)
                else:
                    dim, start, stop = spec
                    tensor = sf.get_slice(key)[(slice(None),) * dim + (slice(start, stop),)]
                if tensor.dtype == torch.float8_e4m3fn and not fp8:
                    raise ValueError(f"{key} is float8_e4m3fn but config.json has no fp8 quantization_config (its scales would be ignored)")
                state[key] = tensor if fp8 else tensor.to(torch.float32)
    if "lm_head.weight" not in state and not cfg.tie_word_embeddings:
        cfg = _replace(cfg, tie_word_embeddings=True)
    if fp8:
        state = collect_fp8_weights(state)
        if plan is not None:
            state = plan.shard_state(state)
    return cfg, state


def _replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, **changes)
