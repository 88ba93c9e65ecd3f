"""Finding, reading and fingerprinting a model: the one entry point the engine and services use."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from libs.blocks import Namespace
from libs.kvpool.layout import LAYOUT_VERSION
from libs.model.attention import PagedAttention
from libs.model.config import ModelConfig
from libs.model.fp8 import Fp8Weight, quantize_projections
from libs.model.llama import LlamaModel
from libs.model.moe import MoEOptions
from libs.dist.groups import Group
from libs.model.parallel import TensorParallel, TPLayoutError, TPShard
from libs.model.tokenizer import Tokenizer
from libs.model.source import model_name, resolve_model_path, weights_digest
from libs.model.weight_cache import WeightCache
from libs.model.weights import read_gguf, read_hf_folder

QUANTIZATIONS = ("auto", "none", "fp8")

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelFingerprint:
    """What makes this model's KV bytes what they are; the root of every block key."""

    weights_digest: str
    dtype: str
    layout_version: int = LAYOUT_VERSION
    quantization: str = "none"  # "fp8": the projections run block-scaled FP8 (other KV bytes)

    def namespace(self, block_size: int) -> Namespace:
        """No tensor-parallel layout in it: a pool block holds every KV head whatever layout
        wrote it (libs/kvpool/slices.py), so all layouts share blocks."""
        return Namespace(self.weights_digest, self.dtype, block_size, self.layout_version, self.quantization)


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: ModelFingerprint
    dtype: torch.dtype
    device: torch.device


def load_model(
    path: str | Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    backend: PagedAttention,
    quantized_weights: bool = False,
    moe: MoEOptions = MoEOptions(),
    quantization: str = "auto",
    cache_dir: Path | None = None,
    tp: Group | None = None,
    packed_linears: bool = True,
) -> LoadedModel:
    """Read weights and tokenizer from the same source, build the model on ``device``.

    ``quantized_weights``: keep a GGUF's Q4_0/Q4_1 linear weights 4-bit and run them with
    torch's int4 CPU kernel (libs/model/quantized.py): CPU only, GGUF only.
    ``moe``: how MoE layers run (strategy, FakeBalanceExpert, EP group); dense models ignore it.

    ``quantization`` (libs/model/fp8.py): ``fp8`` runs the decoder's projections as
    block-scaled FP8, loading a checkpoint already in that format as it is and quantizing
    any other at load; ``none`` runs them dense (an FP8 checkpoint is dequantized);
    ``auto`` follows the checkpoint.
    ``cache_dir``: keep a GGUF's converted tensors there and map them on the next load
    instead of converting again (libs/model/weight_cache.py); None: always convert.

    ``tp``: this process is one rank of this tensor-parallel group (libs/model/parallel.py);
    it reads and keeps only its shard of the weights (GGUF files, which cannot be read in
    slices, are read whole and cut).

    ``packed_linears``: on the CPU in float32, run the linear layers and the LM head
    through oneDNN over weights packed once here (libs/model/cpu_linear.py); off, and with
    FP8 quantization (whose layers have their own path): torch's BLAS (``F.linear``)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantized_weights and quantization == "fp8":
        raise ValueError("quantized_weights (GGUF 4-bit) and fp8 quantization cannot be combined")
    if quantized_weights and device.type != "cpu":
        raise ValueError("quantized_weights needs a GGUF model on the CPU (the int4 kernels are CPU kernels)")
    tp = tp if tp is not None and tp.size > 1 else None
    if tp is not None and quantized_weights:
        raise TPLayoutError("quantized_weights (GGUF 4-bit, CPU) runs with tensor_parallel_size 1 only")
    p = resolve_model_path(path)
    if quantized_weights and not p.is_file():
        raise ValueError("quantized_weights needs a GGUF model on the CPU (a Hugging Face folder has no 4-bit weights)")
    digest = weights_digest(p)
    plan = (lambda c: TPShard.plan(c, tp.size, tp.rank)) if tp is not None else None
    if p.is_file():
        cfg, state, meta = _read_gguf_cached(p, digest, quantized_weights, cache_dir)
        tokenizer = Tokenizer.from_gguf_fields(meta)
        if plan is not None:
            state = plan(cfg).shard_state(state)
    else:
        cfg, state = read_hf_folder(p, shard=plan)
        tokenizer = Tokenizer.from_hf_folder(p)
    parallel = TensorParallel(tp, plan(cfg)) if plan is not None else None
    checkpoint_fp8 = any(isinstance(v, Fp8Weight) for v in state.values())
    fp8 = quantization == "fp8" or (quantization == "auto" and checkpoint_fp8)
    if checkpoint_fp8 and not fp8:
        state = {k: v.dequantize() if isinstance(v, Fp8Weight) else v for k, v in state.items()}
    if fp8 and parallel is not None:
        _check_fp8_split(cfg, parallel.shard)
    with _skip_random_init(), torch.device("cpu"):
        model = LlamaModel(cfg, backend, moe, parallel).float()
    model.load_hf_state(state)
    del state
    if fp8 and not checkpoint_fp8:  # an FP8 checkpoint's dense layers stay dense (ignored_layers)
        quantize_projections(model, device)
    model = model.to(device=device, dtype=dtype)
    # The rope tables stay fp32 whatever the weights' dtype (cast per step, as HF does).
    model.rotary.to(device=device, dtype=torch.float32)
    model.eval().requires_grad_(False)
    if quantized_weights:
        model.quantize_head()
    if packed_linears and device.type == "cpu" and dtype == torch.float32 and not fp8:
        model.pack_linears()  # oneDNN over packed weights: decode and verify rows at the weights' bandwidth
    # 4-bit weights give different KV than dequantized ones, and FakeBalanceExpert's routing
    # different KV than the router's: never share blocks across modes.
    modes = ("+q4" if quantized_weights else "") + ("+fakebalance" if moe.fake_balance and cfg.moe else "")
    fp = ModelFingerprint(digest, str(dtype).removeprefix("torch.") + modes, quantization="fp8" if fp8 else "none")
    return LoadedModel(model_name(p), p, cfg, model, tokenizer, fp, dtype, device)


@contextmanager
def _skip_random_init() -> Iterator[None]:
    """Build modules with uninitialised weights: the checkpoint overwrites every one.

    Not the meta device: on meta tensors torch runs Python reference kernels whose first
    call imports torch._dynamo (1.2 s of every start, the largest cost of a warm start)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn  # type: ignore[method-assign]


def _read_gguf_cached(path: Path, digest: str, keep_q4: bool, cache_dir: Path | None) -> tuple[ModelConfig, dict, dict]:
    """``read_gguf``'s result, from the converted-model cache when it has it."""
    if cache_dir is None:
        return read_gguf(path, keep_q4=keep_q4)
    cache, variant = WeightCache(cache_dir), "q4" if keep_q4 else "dense"
    hit = cache.load(digest, variant)
    if hit is not None:
        log.info("weights of %s mapped from the cache (%s)", path.name, cache_dir)
        return hit
    cfg, state, meta = read_gguf(path, keep_q4=keep_q4)
    if cache.store(digest, variant, cfg, state, meta) is not None:
        log.info("converted weights of %s cached in %s", path.name, cache_dir)
    return cfg, state, meta


def _check_fp8_split(cfg: ModelConfig, shard: TPShard) -> None:
    """FP8 under TP: each shard's blocks must be blocks of the TP=1 weight (same scales,
    same KV bytes), so every cut falls on a multiple of 128."""
    from libs.model.fp8 import BLOCK

    if cfg.head_dim % BLOCK or any(c % BLOCK for c in shard.intermediate):
        raise TPLayoutError(
            f"fp8 with tensor_parallel_size {shard.size} needs head_dim and the MLP split at multiples of {BLOCK} "
            f"(head_dim {cfg.head_dim}, intermediate slice {shard.intermediate}); run it with TP=1 or without fp8"
        )
