"""Architecture hyper-parameters of a Llama-family decoder, whatever file they came from.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) are Llama blocks whose MLP is
replaced, in some or all layers, by a sparse MoE block: ``ModelConfig.moe`` describes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Families that share the Llama block: RMSNorm, rotary attention with GQA, SwiGLU MLP (or
# SwiGLU experts).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MoE block: a router over ``num_experts`` SwiGLU experts, ``top_k`` per token.

    - ``scoring`` / ``renormalize``: how router logits become weights (libs/model/moe/routing.py).
    - ``shared_expert_intermediate_size``: Qwen2-MoE's dense expert that every token also
      takes, scaled by a sigmoid gate; 0 for none.
    - ``sparse_step`` / ``dense_layers``: layer ``i`` is sparse when ``(i + 1) % sparse_step
      == 0`` and ``i`` is not in ``dense_layers`` (Qwen's ``decoder_sparse_step`` and
      ``mlp_only_layers``); the others keep a dense MLP of ``ModelConfig.intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    renormalize: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before rotary
    moe: MoEConfig | None = None
    # Llama 3.x "llama3" rope scaling; None for plain rope.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    name: str = ""

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """From a Hugging Face ``config.json``."""
        model_type = cfg.get("model_type", "llama")
        arch = model_type if model_type in SUPPORTED_ARCHITECTURES else None
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # every MLP and expert here is SwiGLU
            raise ValueError(f"unsupported hidden_act {act!r} in config.json (SwiGLU models only)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers >= 5 writes rope_theta and the scaling into one ``rope_parameters``
        # dict; older files have top-level ``rope_theta`` and ``rope_scaling``.
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}")
            scaling = None if kind == "default" else dict(scaling)
        max_pos = cfg.get("max_position_embeddings", 4096)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if arch in ("mistral", "mixtral") and window:
            # Sliding-window attention is not implemented; within the window it is plain
            # causal attention, so the context is capped there instead of being wrong.
            max_pos = min(max_pos, window)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2-MoE's files say ``qkv_bias`` (transformers >= 5) or nothing (bias on).
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))),
            qk_norm=arch == "qwen3_moe",
            moe=_moe_from_hf(arch, cfg),
            rope_scaling=scaling,
            name=cfg.get("_name_or_path", ""),
        )


def _moe_from_hf(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if arch == "mixtral":
        return MoEConfig(
            num_experts=cfg.get("num_local_experts", cfg.get("num_experts")), top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["intermediate_size"], renormalize=True,
        )
    if arch in ("qwen2_moe", "qwen3_moe"):
        return MoEConfig(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")), top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"], renormalize=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0,
            sparse_step=int(cfg.get("decoder_sparse_step", 1)), dense_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    return None
