"""A Hugging Face checkpoint folder of a named shape with random weights, written to disk.

A tensor-parallel engine loads its model itself, each rank only its shard and in its own
process (libs/engine/tp), so a benchmark of it cannot hand over weights built in memory
(``bench.common.random_loaded``): it needs a folder on disk. This writes one of the
dense shapes of ``bench.common.SHAPES`` (or any given Hugging Face config fields):
``config.json``, the weights as safetensors (one file per layer, N(0, 0.02) linears and
embeddings, unit norms; speed does not depend on the values) and an empty BPE
tokenizer (the benchmarks feed token ids). A folder already complete for the same config
is reused, so a 15 GB Qwen2.5-7B is written once per machine.

    python -m bench.random_checkpoint qwen2.5-7b /tmp/tidepool-bench/qwen2.5-7b [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench.common import SHAPES
from libs.model.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_DONE = ".complete"


def tensor_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Hugging Face tensor names and shapes of a dense Llama/Qwen2 model, grouped by file."""
    H, I, V, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    files: dict[str, dict[str, tuple[int, ...]]] = {"embed": {"model.embed_tokens.weight": (V, H)}}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        layer = {
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H), p + "self_attn.v_proj.weight": (kv, H),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        }
        if cfg.attention_bias:
            layer.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
        files[f"layer{i:03d}"] = layer
    files["head"] = {"model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        files["head"]["lm_head.weight"] = (V, H)
    return files


def write_random_checkpoint(
    fields: dict[str, Any] | str, folder: Path, *, dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0
) -> Path:
    """Write (or reuse) a random checkpoint of ``fields`` (a ``SHAPES`` name or Hugging Face
    config fields) in ``folder``; draws on ``device`` (a GPU draws 7B values in seconds)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    fields = dict(SHAPES[fields]) if isinstance(fields, str) else dict(fields)
    fields.setdefault("model_type", "llama")
    cfg = ModelConfig.from_hf(fields)
    if cfg.moe is not None or cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"random checkpoints are written for dense {', '.join(ARCHITECTURES)} shapes, not {cfg.architecture}")
    config = {**fields, "architectures": [ARCHITECTURES[cfg.architecture]], "torch_dtype": str(dtype).removeprefix("torch.")}
    folder = Path(folder)
    if (folder / _DONE).exists() and json.loads((folder / "config.json").read_text()) == config:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / _DONE).unlink(missing_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, tensors in tensor_shapes(cfg).items():
        state = {}
        for key, shape in tensors.items():
            if key.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, 0.02, generator=gen).to(dtype).cpu()
            state[key] = t
        save_file(state, str(folder / f"{name}.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    Tokenizer(models.BPE()).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / _DONE).write_text("")
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--device", default="cpu", help="where the values are drawn (cuda is much faster for large shapes)")
    args = ap.parse_args(argv)
    print(write_random_checkpoint(args.shape, args.folder, device=args.device))


if __name__ == "__main__":
    main()
