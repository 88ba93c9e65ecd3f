"""The shape of one KV block, shared by the engine's paged cache, the swap kernels and the codec.

The engine allocates its whole paged cache as ONE block-major tensor::

    cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
                         K=0/V=1

so each block (all layers, K and V) is one contiguous run of ``block_nbytes`` bytes.
That is exactly the pool's value payload order (layer, K/V, token, kv head, head dim),
which is why moving a block off the device is one contiguous copy and a run of
consecutive block ids is a single copy. Per layer, ``cache[:, layer, 0]`` and
``cache[:, layer, 1]`` are the K and V views of shape
[num_blocks, block_size, num_kv_heads, head_dim] that attention addresses through block
tables (a strided view: its block stride is ``num_layers * 2 * block_size * heads * dim``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bumped whenever the byte layout of a block changes; part of the block-key namespace.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: [layers, 2, block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def element_size(self) -> int:
        # The dtype's attribute, not ``torch.empty((), dtype).element_size()``: every block
        # a bulk thread verifies asks for this, and a torch call gives the GIL up and must
        # win it back from the other bulk threads and the event loop (py-spy of decode on
        # the H100: as many thread-samples there as in the checksum itself).
        return self.dtype.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.block_numel * self.element_size

    def token_nbytes(self) -> int:
        """Bytes of KV per token across all layers."""
        return self.block_nbytes // self.block_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.cache_shape(num_blocks), dtype=self.dtype, device=device)
