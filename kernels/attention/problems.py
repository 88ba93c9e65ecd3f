"""Random paged-attention problems, shared by the kernel tests and the attention benchmark.

A problem lives in the engine's real cache layout: one block-major tensor
``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` whose per-layer K and V views
are strided, blocks handed out in a random order (so block tables are not contiguous runs),
table rows padded with valid random block ids, and queries taken as a strided view of a
fused QKV projection, as the model produces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedProblem:
    cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    k_cache: torch.Tensor  # cache[:, layer, 0]
    v_cache: torch.Tensor  # cache[:, layer, 1]
    q: torch.Tensor  # [T, num_heads, head_dim], a strided view of a fused QKV buffer
    block_tables: torch.Tensor  # [B, width] int32
    seq_lens: torch.Tensor  # [B] int32, context including this step's queries
    query_start_loc: torch.Tensor  # [B + 1] int32
    scale: float

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def decode_args(self) -> tuple:
        """Positional arguments of ``paged_decode_attention``."""
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale

    def prefill_args(self) -> tuple:
        """Positional arguments of ``paged_prefill_attention``."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale)

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K and V, ``[T, kv_heads, head_dim]`` views of the fused QKV buffer
        beside ``q`` (as the model produces them), first written into the cache slots of the
        step's queries, as the engine's KV store does before attention: what
        ``paged_prefill_attention``'s ``new_kv`` takes."""
        from kernels.attention.reference import store_kv

        total, num_heads, head_dim = self.q.shape
        num_kv_heads = self.k_cache.shape[2]
        qkv = self.q.as_strided((total, (num_heads + 2 * num_kv_heads) * head_dim), (self.q.stride(0), 1))
        k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(total, num_kv_heads, head_dim)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(total, num_kv_heads, head_dim)
        starts, lens, tables = self.query_start_loc.tolist(), self.seq_lens.tolist(), self.block_tables.tolist()
        bs = self.block_size
        slots = [tables[i][pos // bs] * bs + pos % bs
                 for i, n in enumerate(lens) for pos in range(n - (starts[i + 1] - starts[i]), n)]
        store_kv(k[: len(slots)], v[: len(slots)], self.k_cache, self.v_cache,  # padding rows store nowhere
                 torch.tensor(slots, dtype=torch.int64, device=self.q.device))
        return k, v


def make_problem(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_layers: int = 3,
    layer: int = 1,
    spare_blocks: int = 7,
    extra_table_width: int = 2,
    padding_rows: int = 0,
    seed: int = 0,
) -> PagedProblem:
    """Sequence ``i`` has ``context_lens[i]`` tokens of context, the last ``query_lens[i]``
    of which are this step's queries. The whole cache is random, so a kernel that reads a
    wrong slot, block or layer gets wrong numbers rather than zeros. Tensors are drawn on
    ``device`` (a large cache never passes through host memory), tables on the host.
    ``padding_rows``: rows of the QKV buffer past the last sequence's queries, as a CUDA
    graph's token bucket has (they belong to no sequence)."""
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens differ in length")
    if any(q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError("a sequence has more queries than context")
    gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=0) + extra_table_width

    cache = torch.empty(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    ).normal_(generator=device_gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n

    total = sum(query_lens) + padding_rows
    qkv_width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.empty((total, qkv_width), dtype=dtype, device=device).normal_(generator=device_gen)
    q = qkv[:, : num_heads * head_dim].view(total, num_heads, head_dim)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens, dtype=torch.int64).cumsum(0)
    return PagedProblem(
        cache=cache,
        k_cache=cache[:, layer, 0],
        v_cache=cache[:, layer, 1],
        q=q,
        block_tables=tables.to(dtype=torch.int32, device=device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        scale=head_dim**-0.5,
    )


def make_decode_problem(context_lens: list[int], **kwargs) -> PagedProblem:
    """One query per sequence, at its last position."""
    return make_problem([1] * len(context_lens), context_lens, **kwargs)
