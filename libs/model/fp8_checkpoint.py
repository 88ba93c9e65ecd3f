"""Reading checkpoints already in block-scaled FP8 (DeepSeek-V3's format, as vLLM and
transformers' FineGrainedFP8 read it).

config.json says so::

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "fmt": "e4m3", "weight_block_size": [128, 128]}

and each quantized ``X.weight`` is a ``float8_e4m3fn`` ``[N, K]`` tensor with a sibling
``X.weight_scale_inv`` of shape ``[ceil(N/128), ceil(K/128)]``: despite its name, the
factor that dequantizes (``w = q * scale_inv`` per block). The last block along either
axis may be partial. Layers left dense (``ignored_layers`` / ``modules_to_not_convert``)
simply have no scale and a float weight.

Only what the kernels run is accepted, and anything else fails at load with a message
that says what is not supported: per-tensor FP8 (no ``weight_block_size``), other block
sizes, static activation scales, e5m2.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kernels.fp8 import BLOCK, FP8_DTYPE
from libs.model.fp8 import Fp8Weight

SCALE_SUFFIX = ".weight_scale_inv"
# What the model runs as FP8 (libs/model/fp8.py): each layer's attention projections, its
# dense MLP's (fused there into q/k/v and gate/up), a MoE block's shared expert (a dense
# MLP) and its experts (``mlp.experts.{e}.*_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``).
# Routers (``mlp.gate``, ``shared_expert_gate``) do not match: they run in the model's dtype.
_FP8_PROJECTION = re.compile(
    r"model\.layers\.\d+\.("
    r"self_attn\.[qkvo]_proj"
    r"|mlp\.(shared_expert\.)?(gate|up|down)_proj"
    r"|(mlp|block_sparse_moe)\.experts\.\d+\.((gate|up|down)_proj|w[123])"
    r")\.weight"
)


def check_quantization_config(config_json: dict[str, Any]) -> bool:
    """Whether config.json declares a block-scaled FP8 checkpoint; ``ValueError`` for a
    quantization this loader cannot run."""
    qc = config_json.get("quantization_config")
    if qc is None:
        return False
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported quantization_config quant_method {method!r}; supported: 'fp8' with weight_block_size [{BLOCK}, {BLOCK}]")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(f"per-tensor FP8 checkpoints are not supported (quantization_config has no weight_block_size); only [{BLOCK}, {BLOCK}] block scales are")
    if list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"weight_block_size {list(block)} is not supported; only [{BLOCK}, {BLOCK}]")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"activation_scheme {scheme!r} is not supported; activations are quantized dynamically per token group")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"FP8 format {fmt!r} is not supported; only e4m3")
    return True


def collect_fp8_weights(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict with each decoder projection's e4m3 weight and its scale paired into
    one ``Fp8Weight`` (libs/model/fp8.py), MoE experts included. Any other e4m3 tensor (a
    router, an embedding or LM head stored in FP8) is dequantized to fp32: those run in
    the model's dtype."""
    out: dict[str, Any] = {}
    for key, tensor in state.items():
        if key.endswith(SCALE_SUFFIX):
            weight_key = key.removesuffix(SCALE_SUFFIX) + ".weight"
            if weight_key not in state or state[weight_key].dtype != FP8_DTYPE:
                raise ValueError(f"{key} scales {weight_key}, which is not a float8_e4m3fn weight in the checkpoint")
            continue
        if tensor.dtype != FP8_DTYPE:
            out[key] = tensor.to(torch.float32)
            continue
        scale_key = key.removesuffix(".weight") + SCALE_SUFFIX
        if not key.endswith(".weight") or scale_key not in state:
            raise ValueError(f"{key} is float8_e4m3fn but the checkpoint has no {scale_key} for it")
        weight = Fp8Weight.from_checkpoint(tensor, state[scale_key], key)
        out[key] = weight if _FP8_PROJECTION.fullmatch(key) else weight.dequantize()
    return out
