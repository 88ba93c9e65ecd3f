"""Chained 128-bit block keys (DESIGN.md, "Block keys").

A prompt is cut into blocks of ``block_size`` tokens. Block ``i``'s key is
``H(key[i-1] || tokens of block i)``; the chain starts from the *namespace*, a hash of
everything that makes KV bytes incompatible (weights digest, dtype, block size, layout
version, quantization; not the tensor-parallel layout: every layout reads and writes
whole blocks of all KV heads, libs/kvpool/slices.py). Because every key depends on all tokens before it, a
key identifies the whole prefix, so "block i exists in the pool" means "the KV of
tokens [0, (i+1)*block_size) exists".

The last, partial block (m < block_size tokens) gets ``H(key[n-1] || its m tokens)``
with the suffix ``:partial:m``. It is written so decode can load a whole prompt, and it
is never the parent of another key: the next block of a longer prompt hashes the full
block instead, so a partial key never aliases a full one.

H is BLAKE2b with a 16-byte digest and a domain-separation ``person`` tag: fixed,
seedless and fast in C. Python's ``hash`` is salted per process and must never be used.
Tokens are hashed as little-endian uint32, so the same ids give the same bytes on every
machine and in every process.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

KEY_BYTES = 16
_BLOCK_PERSON = b"tidepool.block"
_NAMESPACE_PERSON = b"tidepool.ns"
_PARTIAL = ":partial:"
_LEGACY_TP_FIELD = "tp=tp1"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (``array`` is native-endian; swap on BE)."""
    arr = array("I", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        arr = array("L", tokens)
    import sys

    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


# Personalised once: ``copy()`` of it is several times cheaper than a new blake2b with a
# ``person`` (a 1024-token prompt's 64 keys sit on the host before its prefill launches).
_BLOCK_HASH = hashlib.blake2b(digest_size=KEY_BYTES, person=_BLOCK_PERSON)


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """``H(parent || tokens)``: the key of a block whose predecessor's key is ``parent``."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    h = _BLOCK_HASH.copy()
    h.update(parent)
    h.update(_token_bytes(tokens))
    return h.digest()


def chain_keys(parent: bytes, tokens: Sequence[int], block_size: int, first: int, stop: int) -> list[bytes]:
    """The keys of full blocks ``first .. stop - 1`` of ``tokens``, chained from ``parent``
    (block ``first - 1``'s key, or the namespace's digest): ``chain_key`` block by block,
    with the tokens converted to bytes once."""
    if len(parent) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    if stop <= first:
        return []
    data = memoryview(_token_bytes(tokens[first * block_size : stop * block_size]))
    width = 4 * block_size
    keys = []
    for off in range(0, (stop - first) * width, width):
        h = _BLOCK_HASH.copy()
        h.update(parent)
        h.update(data[off : off + width])
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two caches' KV bytes incompatible.

    Two engines may share blocks only if all these fields agree. ``digest`` is the root
    of every key chain, so a different model or block size changes every key.

    There is no tensor-parallel field: instances of any TP size share blocks, since a
    block holds all KV heads whatever layout wrote it (issue 15).
    """

    model_digest: str
    dtype: str
    block_size: int
    layout_version: int = 1
    quantization: str = "none"  # how the weights run ("fp8"): different weights, different KV

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.model_digest:
            raise ValueError("model_digest must not be empty")

    @cached_property  # frozen: computed once (the pool asks for it with every block it moves)
    def digest(self) -> bytes:
        """A field added later enters the hash only when it is not its default, so every
        namespace that existed before it keeps its digest, and the pool its blocks.

        ``tp=tp1`` is what the removed tensor-parallel field hashed to for every instance
        that ever wrote a block (all were TP=1, and a TP=1 block is what every layout
        writes now): kept as a constant so those blocks keep their keys."""
        fields = [
            f"model={self.model_digest}",
            f"dtype={self.dtype}",
            f"block_size={self.block_size}",
            f"layout={self.layout_version}",
            _LEGACY_TP_FIELD,
        ]
        if self.quantization != "none":
            fields.append(f"quant={self.quantization}")
        desc = "|".join(fields).encode()
        return hashlib.blake2b(desc, digest_size=KEY_BYTES, person=_NAMESPACE_PERSON).digest()

    @cached_property
    def hex(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True)
class NamespaceRoot:
    """A namespace known only by its digest and block size: what an instance registers.

    Enough to compute keys (``block_keys`` only needs these two), for processes that never
    see the model (the router)."""

    digest: bytes
    block_size: int

    @classmethod
    def from_hex(cls, text: str, block_size: int) -> "NamespaceRoot":
        digest = bytes.fromhex(text)
        if len(digest) != KEY_BYTES or block_size <= 0:
            raise ValueError("a namespace root is 16 bytes of hex and a positive block size")
        return cls(digest, block_size)

    @property
    def hex(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True)
class BlockKey:
    """One block's key. ``num_tokens < block_size`` exactly when ``partial``."""

    digest: bytes
    num_tokens: int
    partial: bool = False

    def __str__(self) -> str:
        if self.partial:
            return f"{self.digest.hex()}{_PARTIAL}{self.num_tokens}"
        return self.digest.hex()

    @classmethod
    def parse(cls, text: str, block_size: int) -> "BlockKey":
        """Inverse of ``str()``; raises ``ValueError`` naming what is wrong."""
        head, sep, tail = text.partition(_PARTIAL)
        if len(head) != 2 * KEY_BYTES:
            raise ValueError(f"block key must be {2 * KEY_BYTES} hex digits, got {len(head)}")
        try:
            digest = bytes.fromhex(head)
        except ValueError:
            raise ValueError("block key is not hexadecimal") from None
        if not sep:
            return cls(digest, block_size, False)
        if not tail.isdigit() or not 0 < int(tail) < block_size:
            raise ValueError(f"partial token count must be in [1, {block_size}), got {tail!r}")
        return cls(digest, int(tail), True)


def block_keys(
    namespace: Namespace | NamespaceRoot, token_ids: Sequence[int], *, include_partial: bool = True
) -> list[BlockKey]:
    """Keys of every block of ``token_ids``: full blocks, then the partial tail if any."""
    bs = namespace.block_size
    parent = namespace.digest
    n_full = len(token_ids) // bs
    keys = [BlockKey(k, bs) for k in chain_keys(parent, token_ids, bs, 0, n_full)]
    parent = keys[-1].digest if keys else parent
    rest = len(token_ids) - n_full * bs
    if include_partial and rest:
        keys.append(BlockKey(chain_key(parent, token_ids[n_full * bs :]), rest, True))
    return keys


def full_block_keys(namespace: Namespace | NamespaceRoot, token_ids: Sequence[int]) -> list[bytes]:
    """Digests of the full blocks only: what a prefix cache indexes."""
    return [k.digest for k in block_keys(namespace, token_ids, include_partial=False)]
