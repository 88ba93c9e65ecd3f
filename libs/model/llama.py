"""A Llama-family decoder over a paged KV cache, readable top to bottom (after gpt-fast).

Covers Llama 1-3, SmolLM, Mistral (within its sliding window) and Qwen2 (qkv bias), and the
mixture-of-experts families Mixtral, Qwen2-MoE and Qwen3-MoE (per-head q/k norm), whose
sparse layers swap the MLP for a ``SparseMoeBlock`` (libs/model/moe).
Tokens of all sequences in a step are flattened into one ``[T]`` batch; everything
per-sequence (which cache blocks, which positions attend to which) is in the
``AttentionMetadata`` and handled by the attention backend.

Projections are fused where the math allows (q/k/v into one matmul, gate/up into one):
fewer, larger matmuls are faster on every device, and the result is identical.

Under tensor parallelism (``tp``, libs/model/parallel.py) each rank builds the same model
with its shard's sizes (its heads, its MLP slice, its vocabulary rows); ``qkv_proj`` and
``gate_up_proj`` are column-parallel, ``o_proj`` and ``down_proj`` row-parallel (their
outputs are all-reduced here), the embedding and LM head vocab-parallel.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels.rope import reference as rope_reference
from kernels.select import ops_for
from libs.model.attention import AttentionMetadata, PagedAttention
from libs.model.config import ModelConfig
from libs.model.cpu_linear import available as cpu_linear_available, pack, pack_linears, packed_linear
from libs.model.fp8 import Fp8Linear, Fp8Weight
from libs.model.linear import down_linear, gate_up_linear, linear, linear_weight, norm_gate_up_linear, norm_linear
from libs.model.moe import MoEOptions
from libs.model.moe.block import SparseMoeBlock
from libs.model.parallel import TensorParallel, VocabParallelEmbedding
from libs.model.quantized import Int4Linear, Int4Weight, Int8Linear

# Weights kept in a compact format, and the linear layer that runs each.
_PACKED = {Int4Weight: Int4Linear, Fp8Weight: Fp8Linear}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 whatever the model dtype, as the reference implementation does.
        return ops_for(x.device).rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + residual), x + residual)``: a residual add and this norm, one kernel on CUDA."""
        return ops_for(x.device).fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, smooth between.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, rotating the two halves of each head (HF layout)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._rows = _RowsCache()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated ``(q, k)``. On CUDA ``q`` and ``k`` are rotated in place (inside the qkv
        projection's output) and returned; use only the return values."""
        return ops_for(q.device).apply_rotary(q, k, positions, self.cos, self.sin)

    def rotate_heads(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """CPU: q's and k's heads rotated together (``[T, Hq + Hkv, D]``). Every layer of a
        forward rotates by the same positions, so the table rows are gathered once per
        forward (``new_forward`` drops them: a caller may refill the same positions tensor
        for its next step) rather than once per layer."""
        c = self._rows
        if c.key is not positions or c.rows[0].dtype != heads.dtype:
            c.key, c.rows = positions, rope_reference.rotary_rows(positions, self.cos, self.sin, heads.dtype)
        return rope_reference.rotate_heads(heads, *c.rows)

    def new_forward(self) -> None:
        self._rows.key = None


class _RowsCache:
    """The rotary rows of the current forward (a plain object: no nn.Module attribute cost)."""

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.rows: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: PagedAttention, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads = (tp.shard.num_heads, tp.shard.num_kv_heads) if tp else (cfg.num_heads, cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend
        # Qwen3: each head's q and k are RMS-normalised before rotary.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim] views
        self.v_cache: torch.Tensor | None = None

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata) -> torch.Tensor:
        """``qkv``: ``qkv_proj`` of the normed stream (``DecoderLayer`` computes it together
        with the norm: one kernel on the decode path)."""
        T = qkv.shape[0]
        if qkv.device.type == "cpu":  # q and k are adjacent: rotate their heads in one go
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(T, -1, self.head_dim)
            if self.q_norm is not None:
                qk = torch.cat(self.norm_heads(*qk.split([self.num_heads, self.num_kv_heads], dim=1)), dim=1)
            q, k = rotary.rotate_heads(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
            rope = None
        else:  # rotated with the KV store: one kernel (kernels/attention rotary_store_kv)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.norm_heads(q, k)
            rope = (positions, rotary.cos, rotary.sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = self.backend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, rope)
        out = linear(self.o_proj, o.reshape(T, self.q_size))
        return self.tp.reduce(out) if self.tp is not None else out

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's q/k norm: RMSNorm over each head (``[T, heads, head_dim]``)."""
        d = self.head_dim
        return self.q_norm(q.reshape(-1, d)).view(q.shape), self.k_norm(k.reshape(-1, d)).view(k.shape)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        intermediate_size = tp.shard.intermediate_size if tp else (intermediate_size or cfg.intermediate_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(*gate_up_linear(self.gate_up_proj, x))

    def down(self, y: torch.Tensor, activated: bool) -> torch.Tensor:
        """The rest of the MLP after ``gate_up_proj``'s ``y``: SwiGLU unless ``activated``
        (the gate/up GEMM applied it in its epilogue, libs/model/linear.py), then
        ``down_proj``."""
        out = down_linear(self.down_proj, y, activated)
        return self.tp.reduce(out) if self.tp is not None else out


def feed_forward(cfg: ModelConfig, layer: int, moe: MoEOptions, tp: TensorParallel | None = None) -> nn.Module:
    """Layer ``layer``'s MLP: a sparse MoE block where the config makes the layer sparse
    (with Qwen2-MoE's shared expert, a dense MLP of its own size), else the dense MLP."""
    if cfg.moe is None or not cfg.moe.is_sparse(layer):
        return MLP(cfg, tp=tp)
    shared = cfg.moe.shared_expert_intermediate_size
    return SparseMoeBlock(cfg, moe, shared_expert=MLP(cfg, shared) if shared else None)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: PagedAttention, layer: int = 0, moe: MoEOptions = MoEOptions(), tp: TensorParallel | None = None
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer, moe, tp)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the previous layer's MLP output (the embeddings, with ``residual`` None, for
        the first layer). Returns this layer's MLP output and the residual stream before it:
        each residual add is fused into the norm that follows it, and on the decode path the
        norm into the projection after it (``norm_linear``, libs/model/linear.py)."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, h, residual)
        attn_out = self.self_attn(qkv, positions, rotary, meta)
        if isinstance(self.mlp, MLP):
            y, residual, activated = norm_gate_up_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, attn_out, residual)
            return self.mlp.down(y, activated), residual
        x, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: PagedAttention, moe: MoEOptions = MoEOptions(), tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        tp = self.tp
        # The KV heads this rank's cache holds, in the model's numbering.
        self.kv_heads: tuple[int, int] = tp.shard.kv_heads if tp else (0, cfg.num_kv_heads)
        # Of those, the ones this rank writes into pool blocks (a replicated head: one rank).
        self.kv_written: tuple[int, int] = tp.shard.kv_written if tp else self.kv_heads
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i, moe, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab_rows = tp.shard.vocab_size if tp else cfg.vocab_size
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.quantized_head: Int8Linear | None = None  # quantized-weights mode (CPU)
        self.packed_head: torch.Tensor | None = None  # the head's weight packed for oneDNN (CPU float32)
        self._quantized: list[nn.Module] | None = None

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """Point every layer at its K/V views of the block-major cache
        ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` (libs/kvpool/layout.py)."""
        if cache.shape[1] != len(self.layers):
            raise ValueError(f"cache has {cache.shape[1]} layers, model has {len(self.layers)}")
        if cache.shape[4] != self.kv_heads[1] - self.kv_heads[0]:
            raise ValueError(f"cache has {cache.shape[4]} KV heads, this model (shard) has {self.kv_heads[1] - self.kv_heads[0]}")
        for i, layer in enumerate(self.layers):
            layer.self_attn.k_cache = cache[:, i, 0]
            layer.self_attn.v_cache = cache[:, i, 1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for the flattened tokens of a step.
        ``num_layers``: stop after that many layers, then the final norm (an early exit:
        speculative decoding's ``self_draft``)."""
        for m in self._quantized_modules:  # generated tokens take the 4-bit path (libs/model/quantized.py)
            m.decode_rows = meta.num_decodes + meta.num_verify_tokens
        self.rotary.new_forward()
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers if num_layers is None else self.layers[:num_layers]:
            h, residual = layer(h, residual, positions, self.rotary, meta)
        return self.norm.add_and_norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[S, vocab]`` for the rows that are sampled."""
        if self.quantized_head is not None:
            return self.quantized_head(hidden).float()
        if self.packed_head is not None:
            logits = packed_linear(hidden, self.packed_head)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = linear_weight(hidden, weight)
        return (self.tp.gather_vocab(logits) if self.tp is not None else logits).float()

    @torch.no_grad()
    def pack_linears(self) -> int:
        """float32 on the CPU: every linear layer and the LM head through oneDNN with
        packed weights (libs/model/cpu_linear.py); in quantized mode, the float32 rows of
        the 4-bit and int8 layers. Returns how many plain linears were packed."""
        if not cpu_linear_available():
            return 0
        n = pack_linears(self)
        for m in self._quantized_modules:  # quantized mode: their prompt rows, as the float32 model's
            m.pack_dense()
        if self.quantized_head is None and self.packed_head is None:
            self.packed_head = pack(self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        return n

    @torch.no_grad()
    def quantize_head(self) -> None:
        """Run the LM head (the tied embeddings, or lm_head) as per-row int8 (CPU only)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.quantized_head = Int8Linear(weight.detach())

    @property
    def _quantized_modules(self) -> list[nn.Module]:
        if self._quantized is None:
            self._quantized = [m for m in self.modules() if isinstance(m, (Int4Linear, Int8Linear))]
        return self._quantized

    @torch.no_grad()
    def load_hf_state(self, state: dict[str, Any]) -> None:
        """Copy a Hugging Face-named state dict in, fusing q/k/v and gate/up.

        A linear weight given as an ``Int4Weight`` (GGUF 4-bit, kept packed) or an
        ``Fp8Weight`` (an FP8 checkpoint's) replaces that projection with an ``Int4Linear``
        or ``Fp8Linear``; fused parts are concatenated when all share the format and
        dequantized otherwise."""
        own = dict(self.named_parameters())
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"weight {name!r} missing from checkpoint")
            used.add(name)
            return state[name]

        def put(name: str, value: Any) -> None:
            if type(value) in _PACKED:
                module_path = name.removesuffix(".weight")
                parent, _, attr = module_path.rpartition(".")
                linear = self.get_submodule(module_path)
                if (linear.out_features, linear.in_features) != value.shape:
                    raise ValueError(f"{name}: checkpoint shape {value.shape} != model {(linear.out_features, linear.in_features)}")
                bias = linear.bias.detach().clone() if linear.bias is not None else None
                setattr(self.get_submodule(parent), attr, _PACKED[type(value)](value, bias))
                return
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(own[name].shape)}")
            own[name].copy_(value)

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(len(self.layers)):
            p, m = f"layers.{i}.", f"model.layers.{i}."
            put(p + "input_layernorm.weight", take(m + "input_layernorm.weight"))
            put(p + "post_attention_layernorm.weight", take(m + "post_attention_layernorm.weight"))
            a = m + "self_attn."
            if self.config.attention_bias:  # before the weight: a packed linear takes the bias along
                put(p + "self_attn.qkv_proj.bias", torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"]))
            put(p + "self_attn.qkv_proj.weight", _cat([take(a + f"{x}_proj.weight") for x in "qkv"]))
            put(p + "self_attn.o_proj.weight", take(a + "o_proj.weight"))
            if self.config.qk_norm:
                put(p + "self_attn.q_norm.weight", take(a + "q_norm.weight"))
                put(p + "self_attn.k_norm.weight", take(a + "k_norm.weight"))
            mlp = self.layers[i].mlp
            if isinstance(mlp, SparseMoeBlock):
                mlp.load_hf_state(take, m)
                if mlp.shared_expert is None:
                    continue
                put(p + "mlp.shared_expert_gate.weight", take(m + "mlp.shared_expert_gate.weight"))
                p, m = p + "mlp.shared_expert.", m + "mlp.shared_expert."  # a dense MLP, loaded as one
            else:
                p, m = p + "mlp.", m + "mlp."
            put(p + "gate_up_proj.weight", _cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]))
            put(p + "down_proj.weight", take(m + "down_proj.weight"))
        unused = set(state) - used - {"lm_head.weight"}
        if unused:
            raise ValueError(f"checkpoint has weights the model does not use: {sorted(unused)[:5]}")


def _cat(parts: list[Any]) -> Any:
    """Fuse projections: a packed format stays packed when every part has it; otherwise dense."""
    for kind in _PACKED:
        if all(isinstance(p, kind) for p in parts):
            return kind.cat(parts)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
