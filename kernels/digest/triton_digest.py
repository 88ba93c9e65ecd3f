"""Triton digest kernel: ``block_digests`` of ``kernels/digest/reference.py``, on the device.

One program per block. XXH3's eight accumulators are two vectors, the even lanes and the
odd ones, since a stripe adds each word to its own lane's accumulator through a product
and to its partner lane's (``i ^ 1``) as it is. Only the scramble after each 1 KiB block
orders the work, so a program loads ``UNROLL`` blocks at once (their sums need no
accumulator), then folds them in one after another: the loads of a block never wait for
the previous block's arithmetic, and a 368 KB SmolLM2 block takes 45 trips, not 360.

The payload is read where it lies in the cache: word ``q`` of the value (u64 words, the
pool's order: layer, K/V, token) is word ``q % run`` of run ``q // run``, a run being one
layer's K or V rows of the value's ``n`` tokens, ``block_size`` rows apart in the cache.
So a partial last block needs no gather, and the digest is over exactly the bytes that
the swap copies into staging (kernels/swap) and the pool stores.

Everything is stream-ordered: the digests are valid when the current stream reaches them.
No host reads, so it may be captured; the swapper launches it eagerly after a swap-out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.digest import xxh3
from kernels.digest.checks import DigestShapeError, Ints, check_digest, check_layout, token_row_nbytes

_UNROLL = 8
_tables: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _u64(ptr):
    return tl.load(ptr).to(tl.uint64, bitcast=True)


@triton.jit
def _word(base, q, run_words, run_stride, mask):
    """Word ``q`` of the payload (u64), masked loads reading 0."""
    addr = base + (q // run_words) * run_stride + q % run_words
    return tl.load(addr, mask=mask, other=0).to(tl.uint64, bitcast=True)


@triton.jit
def _mix(d, k, low32):
    dk = d ^ k
    return (dk & low32) * (dk >> 32)


@triton.jit
def _fold(a, b, low32):
    """The 128-bit product of ``a`` and ``b`` folded to 64 bits (low ^ high), from 32-bit limbs."""
    al, ah, bl, bh = a & low32, a >> 32, b & low32, b >> 32
    p0, p1, p2, p3 = al * bl, al * bh, ah * bl, ah * bh
    mid = (p0 >> 32) + (p1 & low32) + (p2 & low32)
    lo = (p0 & low32) | (mid << 32)
    hi = p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32)
    return lo ^ hi


@triton.jit
def _digest_kernel(
    cache_ptr, ids_ptr, tokens_ptr, table_ptr, out_ptr,
    block_words, token_words, run_stride,
    RUNS: tl.constexpr, UNROLL: tl.constexpr,
    STRIPE_KEYS: tl.constexpr, SCRAMBLE_KEYS: tl.constexpr, LAST_KEYS: tl.constexpr, MERGE_KEYS: tl.constexpr,
    INIT: tl.constexpr, LEN_PRIME: tl.constexpr, SCRAMBLE_PRIME: tl.constexpr, LOW32: tl.constexpr,
    AVALANCHE_PRIME: tl.constexpr,
):
    j = tl.program_id(0)
    block = tl.load(ids_ptr + j).to(tl.int64)
    run_words = tl.load(tokens_ptr + j).to(tl.int64) * token_words
    total = RUNS * run_words  # payload words
    nbytes = total * 8
    base = cache_ptr + block * block_words
    low32 = _u64(table_ptr + LOW32)
    prime32 = _u64(table_ptr + SCRAMBLE_PRIME)

    s = tl.arange(0, 16)[:, None]  # stripe of a 1 KiB block
    p = tl.arange(0, 4)  # lane pair: lanes 2p (even) and 2p + 1 (odd)
    pp = p[None, :]
    key_e = _u64(table_ptr + STRIPE_KEYS + s + 2 * pp)  # [16, 4]
    key_o = _u64(table_ptr + STRIPE_KEYS + s + 2 * pp + 1)
    scr_e = _u64(table_ptr + SCRAMBLE_KEYS + 2 * p)
    scr_o = _u64(table_ptr + SCRAMBLE_KEYS + 2 * p + 1)
    acc_e = _u64(table_ptr + INIT + 2 * p)
    acc_o = _u64(table_ptr + INIT + 2 * p + 1)

    nb = (nbytes - 1) // 1024  # whole blocks, each followed by a scramble
    u = tl.arange(0, UNROLL)
    blk_off = u[:, None, None] * 128 + s[None, :, :] * 8 + 2 * pp[None, :, :]  # [U, 16, 4]
    for g in range(0, nb, UNROLL):
        valid = (g + u[:, None, None]) < nb
        q = g * 128 + blk_off
        de = _word(base, q, run_words, run_stride, valid)
        do = _word(base, q + 1, run_words, run_stride, valid)
        sum_e = tl.sum(_mix(de, key_e[None, :, :], low32), axis=1) + tl.sum(do, axis=1)  # [U, 4]
        sum_o = tl.sum(_mix(do, key_o[None, :, :], low32), axis=1) + tl.sum(de, axis=1)
        for k in tl.static_range(UNROLL):
            pick = u[:, None] == k
            ae = acc_e + tl.sum(tl.where(pick, sum_e, 0), axis=0)
            ao = acc_o + tl.sum(tl.where(pick, sum_o, 0), axis=0)
            ae = (ae ^ (ae >> 47) ^ scr_e) * prime32
            ao = (ao ^ (ao >> 47) ^ scr_o) * prime32
            live = g + k < nb
            acc_e = tl.where(live, ae, acc_e)
            acc_o = tl.where(live, ao, acc_o)

    # The last block's stripes (fewer than 16), no scramble.
    tail = ((nbytes - 1) - nb * 1024) // 64
    inside = s < tail
    q = nb * 128 + s * 8 + 2 * pp
    de = _word(base, q, run_words, run_stride, inside)
    do = _word(base, q + 1, run_words, run_stride, inside)
    acc_e += tl.sum(tl.where(inside, _mix(de, key_e, low32), 0), axis=0) + tl.sum(do, axis=0)
    acc_o += tl.sum(tl.where(inside, _mix(do, key_o, low32), 0), axis=0) + tl.sum(de, axis=0)

    # The payload's last 64 bytes, with their own keys.
    q = total - 8 + 2 * p
    everywhere = p < 4
    de = _word(base, q, run_words, run_stride, everywhere)
    do = _word(base, q + 1, run_words, run_stride, everywhere)
    acc_e += _mix(de, _u64(table_ptr + LAST_KEYS + 2 * p), low32) + do
    acc_o += _mix(do, _u64(table_ptr + LAST_KEYS + 2 * p + 1), low32) + de

    merged = _fold(acc_e ^ _u64(table_ptr + MERGE_KEYS + 2 * p), acc_o ^ _u64(table_ptr + MERGE_KEYS + 2 * p + 1), low32)
    h = nbytes.to(tl.uint64) * _u64(table_ptr + LEN_PRIME) + tl.sum(merged, axis=0)
    h = h ^ (h >> 37)
    h = h * _u64(table_ptr + AVALANCHE_PRIME)
    h = h ^ (h >> 32)
    tl.store(out_ptr + j, h.to(tl.int64, bitcast=True))


def _table(device: torch.device) -> torch.Tensor:
    table = _tables.get(device)
    if table is None:
        table = _tables[device] = torch.tensor(xxh3.TABLE, dtype=torch.int64, device=device)
    return table


def launch_digests(cache: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> None:
    """Enqueue the digests of ``ids`` (int64, on the cache's device) holding ``tokens``
    tokens into ``out``, without reading any of them on the host: the caller has checked
    the values (ids inside the cache, tokens in ``[1, block_size]``)."""
    n = ids.numel()
    check_layout(cache, out, n)
    for name, t in (("block_ids", ids), ("num_tokens", tokens), ("out", out)):
        if t.device != cache.device:
            raise DigestShapeError(f"{name} is on {t.device}, the cache on {cache.device}")
    if tokens.numel() != n or ids.dtype != torch.int64 or tokens.dtype != torch.int64:
        raise DigestShapeError(f"ids and tokens must be {n} int64 each, got {ids.dtype} {tokens.dtype} {tokens.numel()}")
    if n == 0:
        return
    words = cache.view(-1).view(torch.int64)
    token_words = token_row_nbytes(cache) // 8
    _digest_kernel[(n,)](
        words, ids, tokens, _table(cache.device), out,
        words.numel() // cache.shape[0], token_words, cache.shape[3] * token_words,
        RUNS=cache.shape[1] * 2, UNROLL=_UNROLL,
        STRIPE_KEYS=xxh3.STRIPE_KEYS, SCRAMBLE_KEYS=xxh3.SCRAMBLE_KEYS, LAST_KEYS=xxh3.LAST_KEYS,
        MERGE_KEYS=xxh3.MERGE_KEYS, INIT=xxh3.INIT, LEN_PRIME=xxh3.LEN_PRIME, SCRAMBLE_PRIME=xxh3.SCRAMBLE_PRIME,
        LOW32=xxh3.LOW32, AVALANCHE_PRIME=xxh3.AVALANCHE_PRIME,
    )


def block_digests(cache: torch.Tensor, block_ids: Ints, num_tokens: Ints, out: torch.Tensor) -> None:
    """``out[j]`` = xxh3_64 of block ``block_ids[j]``'s payload of ``num_tokens[j]`` tokens
    (validated here, a host read; ``launch_digests`` is the hot path)."""
    ids, tokens = check_digest(cache, block_ids, num_tokens, out)
    dev = cache.device
    launch_digests(
        cache, torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(tokens, dtype=torch.int64, device=dev), out
    )
