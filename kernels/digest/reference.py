"""Torch reference for the digest kernel: the oracle ``kernels.digest.triton_digest`` is
tested against, with the same signature.

``block_digests(cache, block_ids, num_tokens, out)``: ``out[j]`` = xxh3_64 of the pool
value payload of cache block ``block_ids[j]`` holding ``num_tokens[j]`` tokens, as an
int64 bit pattern: the bytes ``cache[b, l, kv, :n]`` for every layer ``l`` and ``kv`` in
(K, V), in that order (libs/kvpool/header.py's payload), which is the whole block when
``n`` is the block size. The same number python-xxhash gives over those bytes.

Shapes: ``cache`` ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``, contiguous,
any dtype whose token row (``kv_heads * head_dim`` elements) is a whole number of 8-byte
words (:func:`check_digest`); ``block_ids`` and ``num_tokens``: ``n`` integers (host or
device tensors, or sequences); ``out``: ``n`` int64 on any device.

Torch has no unsigned 64-bit arithmetic, so the u64 words are int64: addition and
multiplication wrap to the same bits, and a logical right shift is a masked arithmetic one.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from kernels.digest import xxh3
from kernels.digest.checks import check_digest

Ints = Union[torch.Tensor, Sequence[int]]
_MASK64 = (1 << 64) - 1
_LOW32 = 0xFFFFFFFF


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _table(i: int, n: int = 1) -> torch.Tensor:
    return torch.tensor(xxh3.TABLE[i : i + n], dtype=torch.int64)


def _stripe_sums(stripes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """What ``[..., stripes, 8]`` words add to the 8 accumulators, per leading index:
    lane i gets lo32(d ^ k) * hi32(d ^ k) of its own word and the word of lane i ^ 1."""
    dk = stripes ^ keys
    products = ((dk & _LOW32) * _srl(dk, 32)).sum(-2)
    swapped = stripes.sum(-2).view(*stripes.shape[:-2], 4, 2).flip(-1).reshape(*stripes.shape[:-2], 8)
    return products + swapped


def xxh3_words(words: torch.Tensor) -> int:
    """xxh3_64 of the bytes of ``words`` (1-D int64 on the CPU, more than 240 bytes)."""
    nbytes = words.numel() * 8
    if nbytes < xxh3.MIN_LEN:
        raise ValueError(f"{nbytes} bytes: the long-input path needs at least {xxh3.MIN_LEN}")
    s = torch.arange(xxh3.STRIPES_PER_BLOCK)[:, None] + torch.arange(xxh3.LANES)[None, :]
    stripe_keys = _table(xxh3.STRIPE_KEYS, 24)[s]  # [16, 8]: stripe s, lane i reads key s + i
    scramble_key = _table(xxh3.SCRAMBLE_KEYS, 8)
    acc = _table(xxh3.INIT, 8)
    words_per_block = xxh3.BLOCK_BYTES // 8
    nb = (nbytes - 1) // xxh3.BLOCK_BYTES
    whole = words[: nb * words_per_block].view(nb, xxh3.STRIPES_PER_BLOCK, xxh3.LANES)
    sums = _stripe_sums(whole, stripe_keys)  # [nb, 8]: independent of the accumulators
    for b in range(nb):  # the scramble orders the blocks
        acc = acc + sums[b]
        acc = (acc ^ _srl(acc, 47) ^ scramble_key) * xxh3.PRIME32_1
    tail_stripes = ((nbytes - 1) - nb * xxh3.BLOCK_BYTES) // xxh3.STRIPE_BYTES
    tail = words[nb * words_per_block : nb * words_per_block + tail_stripes * xxh3.LANES].view(tail_stripes, xxh3.LANES)
    acc = acc + _stripe_sums(tail, stripe_keys[:tail_stripes])
    acc = acc + _stripe_sums(words[-xxh3.LANES :].view(1, xxh3.LANES), _table(xxh3.LAST_KEYS, 8)[None])
    # The merge, in Python integers: exact 128-bit products.
    a = [(v ^ k) & _MASK64 for v, k in zip(acc.tolist(), xxh3.TABLE[xxh3.MERGE_KEYS : xxh3.MERGE_KEYS + 8])]
    h = nbytes * xxh3.PRIME64_1
    for p in range(4):
        product = a[2 * p] * a[2 * p + 1]
        h += (product & _MASK64) ^ (product >> 64)
    h &= _MASK64
    h ^= h >> 37
    h = (h * xxh3.AVALANCHE) & _MASK64
    h ^= h >> 32
    return h


def payload_words(cache: torch.Tensor, block: int, num_tokens: int) -> torch.Tensor:
    """Block ``block``'s payload of ``num_tokens`` tokens as u64 words (int64, on the CPU)."""
    return cache[block, :, :, :num_tokens].contiguous().cpu().view(-1).view(torch.int64)


def block_digests(cache: torch.Tensor, block_ids: Ints, num_tokens: Ints, out: torch.Tensor) -> None:
    """``out[j]`` = xxh3_64 of block ``block_ids[j]``'s payload of ``num_tokens[j]`` tokens."""
    ids, tokens = check_digest(cache, block_ids, num_tokens, out)
    digests = [xxh3_words(payload_words(cache, b, n)) for b, n in zip(ids, tokens)]
    signed = [d - (1 << 64) if d >= 1 << 63 else d for d in digests]
    out.copy_(torch.tensor(signed, dtype=torch.int64))
