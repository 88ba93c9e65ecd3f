"""Tensor parallelism inside one instance (Megatron-LM): which rank holds which part of a
Llama-family decoder, the vocab-parallel embedding and LM head, and the two reductions.

Each of the ``N`` ranks of a TP group holds a slice of every layer and runs the same
forward on the same tokens:

- **Column-parallel** ``qkv_proj`` and ``gate_up_proj``: each rank holds the output rows
  of its attention heads (q, k and v of the same heads) and of its slice of the MLP's
  intermediate dimension. Their outputs stay split; nothing is communicated.
- **Row-parallel** ``o_proj`` and ``down_proj``: each rank holds the input columns that
  match its heads / intermediate slice, so each computes a partial sum of the full
  output; one all-reduce per projection (``TensorParallel.reduce``) completes it.
- **Vocab-parallel** embedding and LM head: each rank holds a contiguous range of the
  vocabulary's rows. The embedding looks up the ids in its range (zeros elsewhere) and
  all-reduces; the LM head computes its range's logits and all-gathers them.

The projections stay plain ``nn.Linear`` modules of the shard's size (so FP8 and every
kernel treat them as they treat any linear); what makes them column- or row-parallel is
which slice of the checkpoint they are loaded with (``TPShard.slice``) and where the
model reduces.

**Attention heads.** GQA ties each KV head to its group of ``g`` query heads, and the
attention kernels need every rank's local heads to be whole groups of the same size. So:

- ``N <= num_kv_heads``: rank ``r`` holds the KV heads ``[G*r//N, G*(r+1)//N)`` and their
  query heads. With ``N`` dividing ``G`` this is Megatron's even split; otherwise (SmolLM2:
  3 KV heads, ``N = 2``) the split is as even as whole groups allow (1 group and 2: rank 0,
  which also runs the scheduler, gets the smaller part), and only attention is uneven
  (the MLP and vocabulary still split evenly).
- ``N > num_kv_heads``: the KV heads are **replicated**: KV head ``j`` is held by the run
  of ranks ``[N*j//G, N*(j+1)//G)``, which split its ``g`` query heads between them. Every
  replica computes the same K and V (same weights, same input); the first one of each run
  is the head's *writer* when blocks go to the pool (``kv_written``), the others only
  read. A rank must get at least one query head (``N <= num_heads``).

vLLM asks for ``N`` to divide the head counts or the KV heads to divide ``N``; the rule
above reduces to that where it applies and also serves the rest.

The LM head's all-gather needs equal sizes, so each rank's logits are padded to
``vocab_per_rank`` columns and the padding is dropped after the gather.

Under TP the greedy output equals TP=1's up to floating-point summation order (a
row-parallel projection adds ``N`` partial sums where TP=1 adds one): in fp32 that is far
below any logit gap that decides a token on the test prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from libs.dist.groups import Group
from libs.model.config import ModelConfig

# MLP slices are cut at multiples of this where the size allows: FP8 weights are scaled in
# 128 x 128 blocks, and a shard boundary inside a block would change the scales.
_MLP_UNIT = 128


def split_range(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """Part ``index`` of ``parts`` near-equal contiguous parts of ``range(n)``, cut at
    multiples of ``unit`` when ``n`` allows it."""
    if unit > 1 and n % unit == 0 and n // unit >= parts:
        a, b = split_range(n // unit, parts, index)
        return a * unit, b * unit
    return n * index // parts, n * (index + 1) // parts


class TPLayoutError(ValueError):
    """The model cannot be split this way (a clear refusal, never a wrong model)."""


@dataclass(frozen=True)
class TPShard:
    """Which part of the model rank ``rank`` of ``size`` holds. Ranges are ``[start, stop)``
    in the full model's numbering."""

    size: int
    rank: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    kv_written: tuple[int, int]  # KV heads this rank writes into pool blocks (replicas: empty)
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_total: int

    @property
    def vocab_sizes(self) -> list[int]:
        """Every rank's vocabulary slice size, in rank order."""
        return [b - a for a, b in (split_range(self.vocab_total, self.size, r) for r in range(self.size))]

    @property
    def vocab_per_rank(self) -> int:
        """The largest slice: the width each rank's logits are padded to for the gather."""
        return max(self.vocab_sizes)

    @classmethod
    def plan(cls, cfg: ModelConfig, size: int, rank: int) -> "TPShard":
        if size < 1 or not 0 <= rank < size:
            raise TPLayoutError(f"rank {rank} outside a TP group of {size}")
        if size > cfg.num_heads:
            raise TPLayoutError(f"tensor_parallel_size {size} exceeds the model's {cfg.num_heads} attention heads")
        if cfg.moe is not None and size > 1:
            raise TPLayoutError("tensor parallelism for mixture-of-experts models is not supported; use expert parallelism")
        G, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        if size <= G:
            k0, k1 = split_range(G, size, rank)
            q, kv, written = (k0 * g, k1 * g), (k0, k1), (k0, k1)
        else:
            j = max(i for i in range(G) if size * i // G <= rank)  # the KV head this rank replicates
            first, last = size * j // G, size * (j + 1) // G  # at most ceil(N/G) <= g ranks
            a, b = split_range(g, last - first, rank - first)
            q, kv, written = (j * g + a, j * g + b), (j, j + 1), ((j, j + 1) if rank == first else (j, j))
        vocab = split_range(cfg.vocab_size, size, rank)
        return cls(
            size=size, rank=rank, head_dim=cfg.head_dim, q_heads=q, kv_heads=kv, kv_written=written,
            intermediate=split_range(cfg.intermediate_size, size, rank, _MLP_UNIT),
            vocab=vocab, vocab_total=cfg.vocab_size,
        )

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def slice(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)``: the part of checkpoint tensor ``name`` (Hugging Face
        naming) this rank loads; None for tensors every rank holds whole (the norms)."""
        D = self.head_dim
        q = (0, self.q_heads[0] * D, self.q_heads[1] * D)
        kv = (0, self.kv_heads[0] * D, self.kv_heads[1] * D)
        for suffix, spec in (
            ("self_attn.q_proj.weight", q), ("self_attn.q_proj.bias", q),
            ("self_attn.k_proj.weight", kv), ("self_attn.k_proj.bias", kv),
            ("self_attn.v_proj.weight", kv), ("self_attn.v_proj.bias", kv),
            ("self_attn.o_proj.weight", (1, q[1], q[2])),
            ("mlp.gate_proj.weight", (0, *self.intermediate)), ("mlp.up_proj.weight", (0, *self.intermediate)),
            ("mlp.down_proj.weight", (1, *self.intermediate)),
            ("embed_tokens.weight", (0, *self.vocab)), ("lm_head.weight", (0, *self.vocab)),
        ):
            if name.endswith(suffix):
                return spec
        return None

    def shard_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A full checkpoint state dict cut down to this rank's part (tensors and FP8 weights)."""
        if self.size == 1:
            return state
        return {name: slice_weight(value, self.slice(name), name) for name, value in state.items()}


def slice_weight(value: Any, spec: tuple[int, int, int] | None, name: str = "weight") -> Any:
    """``value`` cut to ``spec`` (``(dim, start, stop)``; None: whole)."""
    if spec is None:
        return value
    dim, start, stop = spec
    if isinstance(value, torch.Tensor):
        return value.narrow(dim, start, stop - start).contiguous()
    if hasattr(value, "narrow"):  # an Fp8Weight: along whole 128-blocks
        return value.narrow(dim, start, stop, name)
    raise TPLayoutError(f"{name}: a {type(value).__name__} cannot be split for tensor parallelism (GGUF 4-bit weights run with TP=1 only)")


class TensorParallel:
    """A TP group and this rank's shard: the model's only handle on communication."""

    def __init__(self, group: Group, shard: TPShard):
        if group.size != shard.size or group.rank != shard.rank:
            raise ValueError(f"shard for rank {shard.rank}/{shard.size} on group member {group.rank}/{group.size}")
        self.group = group
        self.shard = shard

    @property
    def size(self) -> int:
        return self.group.size

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, completed (in place, or in a new
        tensor where the group's one-shot takes them)."""
        return self.group.all_reduce(x)

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """``[S, vocab slice]`` logits of every rank → ``[S, vocab]``."""
        if self.size == 1:
            return local
        per = self.shard.vocab_per_rank
        if local.shape[-1] < per:
            local = F.pad(local, (0, per - local.shape[-1]))
        full = self.group.all_gather(local, dim=-1)
        sizes = self.shard.vocab_sizes
        if all(n == per for n in sizes):
            return full
        return torch.cat([full[..., r * per : r * per + n] for r, n in enumerate(sizes)], dim=-1)


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding, its rows split over the TP group (whole when ``tp`` is None).
    An ``nn.Embedding`` of this rank's rows, so code that treats embeddings as such (FP8
    leaves them dense) still does."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel | None = None):
        tp = tp if tp is not None and tp.size > 1 else None
        start, stop = tp.shard.vocab if tp is not None else (0, num_embeddings)
        super().__init__(stop - start, embedding_dim)
        self.tp, self.start, self.vocab_size = tp, start, num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.tp.reduce(out)
