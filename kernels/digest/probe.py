"""A one-time check that a digest implementation agrees with python-xxhash on this device.

The swapper asks it before it first puts device digests on pool values: a kernel that did
not compile here, or that computed something else (a compiler's 64-bit integer handling,
say), must cost the CPU hashing it replaces, not the pool's every block (readers would
find each one corrupt and recompute it). So the swapper turns digests off with a warning
instead. It is a question, never an error.
"""

from __future__ import annotations

from typing import Callable

import torch
import xxhash

from kernels.digest.reference import payload_words

DigestFn = Callable[[torch.Tensor, list, list, torch.Tensor], None]
_U64 = (1 << 64) - 1


def xxhash_digests(cache: torch.Tensor, block_ids, num_tokens) -> list[int]:
    """python-xxhash's xxh3_64 over each block's payload (read back to the host): what a
    reader of the pool computes, and what a device implementation must equal."""
    return [xxhash.xxh3_64_intdigest(payload_words(cache, b, n).numpy().tobytes()) for b, n in zip(block_ids, num_tokens)]


def disagreement(cache: torch.Tensor, block_digests: DigestFn) -> str | None:
    """Digest the cache's first block whole and its last one partly with ``block_digests``,
    and the same bytes with python-xxhash; None when they agree, else why not. Reads the
    blocks back through the current stream (one synchronisation)."""
    try:
        bs = cache.shape[3]
        ids, tokens = [0, cache.shape[0] - 1], [bs, max(1, bs // 2 - 1)]
        out = torch.empty(2, dtype=torch.int64, device=cache.device)
        block_digests(cache, ids, tokens, out)
        got = [v & _U64 for v in out.tolist()]
        want = xxhash_digests(cache, ids, tokens)
    except Exception as e:  # noqa: BLE001 - a question, never an error
        return f"{type(e).__name__}: {e}"
    return None if got == want else f"digests {got} differ from python-xxhash's {want}"
