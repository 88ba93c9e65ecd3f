"""Triton paged attention: the GPU path behind the attention backend, one module per kernel:

- ``triton_store``: ``store_kv`` and ``rotary_store_kv`` (rotary on q and k, then the KV
  store, in one launch);
- ``triton_decode``: ``paged_decode_attention`` (flash-decoding over splits of the context,
  GQA heads as the rows of one tile) and ``rotary_decode_attention`` (the rotation and the
  KV store folded into it, for decode-only steps);
- ``triton_prefill``: ``paged_prefill_attention`` (causal varlen flash-attention over the
  paged context: prefill and chunked prefill; fresh prompts, given the step's K/V rows,
  read them there instead of the cache);
- ``triton_tiles``: the flash-attention steps the two attention kernels share.

This module gathers their public functions, the same signatures and semantics as
``kernels/attention/reference.py`` (read its docstring for the shapes). Everything is
written for the engine's block-major cache, whose per-layer K and V caches are strided
views, and for GQA models with few KV heads. Outputs are stored in the query dtype.

The wrappers never read device memory on the host: they launch kernels whose grids derive
from tensor shapes and host ints and allocate with ``torch.empty``, so the decode step can
be captured in a CUDA graph (compile the kernels with one eager call before capturing).

Constraints: ``head_dim`` is any size from 1 up (tiles are padded to a power of two of at
least 16, so sizes that are not powers of two waste some lanes; it is a compile-time
constant, which lets the masks fold away so tile loads vectorize and pipeline);
``block_size`` is any positive size (powers of two make the slot arithmetic cheapest). A
sequence with no context (``seq_len`` 0, e.g. CUDA-graph padding) gets a zero output, as in
the reference.
"""

from __future__ import annotations

from kernels.attention.triton_decode import (
    decode_num_splits,
    decode_prefetch_kv,
    paged_decode_attention,
    paged_decode_attention_splits,
    rotary_decode_attention,
)
from kernels.attention.triton_prefill import paged_prefill_attention
from kernels.attention.triton_store import rotary_store_kv, store_kv
from kernels.attention.triton_tiles import head_block

__all__ = [
    "decode_num_splits",
    "decode_prefetch_kv",
    "head_block",
    "paged_decode_attention",
    "paged_decode_attention_splits",
    "paged_prefill_attention",
    "rotary_decode_attention",
    "rotary_store_kv",
    "store_kv",
]
