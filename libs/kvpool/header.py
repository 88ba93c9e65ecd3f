"""The byte format of one pool value: a fixed header, then one block's KV payload.

One value holds one block: all layers, K and V (DESIGN.md, "Block values"), so a block is
written, read and evicted atomically. Layout, little-endian::

    offset  size  field
         0     4  magic            b"TPKV"
         4     2  layout version   LAYOUT_VERSION of libs/kvpool/layout.py (never 0)
         6     2  dtype code       DTYPES below (a fixed table, never torch's enum)
         8     2  num_layers
        10     2  num_kv_heads
        12     2  head_dim
        14     2  num_tokens       1..block_size; a partial block of m tokens stores m
        16     8  checksum         xxh3_64 of the payload (27 GB/s here; crc32 is 4 GB/s;
                                   a GPU prefill computes it on the device: kernels/digest)
        24     -  payload          [layers, 2 (K/V), num_tokens, kv_heads, head_dim]

The payload order is the engine's block-major cache order with the token axis cut to
``num_tokens``, so a full block is one contiguous copy out of (and back into) pinned
staging. The header is 24 bytes, so the payload starts 8-byte aligned.

This module needs no torch: cache_store validates values with :func:`inspect_block`
(integrity: magic, known dtype, length, checksum) without knowing any model and without
loading torch. Readers use :class:`~libs.kvpool.codec.BlockCodec`, which also checks
compatibility with their own layout (version, dtype, shape, token count). Every failure is
a :class:`BlockDecodeError` whose ``reason`` is one of :data:`DECODE_REASONS`; readers
count it as a miss labelled ``corrupt:<reason>`` (metrics, traces).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Literal, Sequence, Union, get_args

import xxhash

MAGIC: Final = b"TPKV"
HEADER = struct.Struct("<4sHHHHHHQ")
HEADER_NBYTES: Final = HEADER.size

# Fixed on-the-wire dtype codes -> (torch dtype name, bytes per element).
DTYPES: Final[dict[int, tuple[str, int]]] = {
    1: ("float32", 4),
    2: ("float16", 2),
    3: ("bfloat16", 2),
    4: ("float8_e4m3fn", 1),
    5: ("float8_e5m2", 1),
}
DTYPE_CODES: Final[dict[str, int]] = {name: code for code, (name, _) in DTYPES.items()}

DecodeReason = Literal["truncated", "magic", "version", "dtype", "shape", "tokens", "length", "checksum"]
DECODE_REASONS: Final[tuple[str, ...]] = get_args(DecodeReason)

# Anything the buffer protocol can hand to a socket or to xxhash without a copy.
Buffer = Union[bytes, bytearray, memoryview]
CHECKSUM_OFFSET: Final = 16  # where the checksum sits in the header (the table above)
_CHECKSUM = struct.Struct("<Q")


class PendingValue:
    """A block value whose checksum is not computed yet: ``parts`` are the 24-byte header
    (checksum field still 0) and the payload runs, views of staging memory.

    ``seal()`` hashes the runs and writes the checksum into the header; it is idempotent
    and returns the parts. Whoever sends the value seals it, where it sends it: the bulk
    path on the thread that is about to ``sendmsg`` it (libs/kvpool/resp.py,
    ``Frames.seals``), so hashing costs no hop of its own and overlaps with the other
    sockets' transfers; anything else that reads the parts (``value_parts``) seals first.
    """

    __slots__ = ("parts", "_runs", "_header", "_sealed")

    def __init__(self, header: memoryview, runs: list[memoryview]) -> None:
        if header.nbytes != HEADER_NBYTES:
            raise ValueError(f"header has {header.nbytes} bytes, the header is {HEADER_NBYTES}")
        self._header = header
        self._runs = runs
        self.parts: list[memoryview] = [header, *runs]
        self._sealed = False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def seal(self) -> list[memoryview]:
        if not self._sealed:
            _CHECKSUM.pack_into(self._header, CHECKSUM_OFFSET, checksum(self._runs))
            self._sealed = True
        return self.parts


# What a pool write takes: one buffer, a list/tuple of parts that make the value back
# to back (a header and views of staging memory: scatter-gather, never concatenated), or
# a PendingValue (the same, checksummed by whoever sends it).
Value = Union[Buffer, Sequence[Buffer], PendingValue]


def _flat(buf: Buffer) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def value_parts(value: Value) -> list[memoryview]:
    """A value as flat byte views: a list or tuple is parts sent back to back, a
    PendingValue its parts once sealed, anything else one buffer (bytes, bytearray,
    memoryview, a numpy array...)."""
    if isinstance(value, PendingValue):
        return value.seal()
    if isinstance(value, (list, tuple)):
        return [_flat(part) for part in value]
    return [_flat(value)]  # type: ignore[arg-type]


def value_nbytes(value: Value) -> int:
    if isinstance(value, PendingValue):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(memoryview(part).nbytes for part in value)
    return memoryview(value).nbytes  # type: ignore[arg-type]


class BlockDecodeError(ValueError):
    """A value that is not a usable block; ``reason`` is one of DECODE_REASONS."""

    def __init__(self, reason: DecodeReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: DecodeReason = reason


@dataclass(frozen=True)
class BlockHeader:
    version: int
    dtype_code: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    checksum: int

    @property
    def dtype(self) -> str:
        """The torch dtype's name (``"bfloat16"``); raises BlockDecodeError for an unknown code."""
        return _dtype(self.dtype_code)[0]

    @property
    def payload_nbytes(self) -> int:
        itemsize = _dtype(self.dtype_code)[1]
        return self.num_layers * 2 * self.num_tokens * self.num_kv_heads * self.head_dim * itemsize


def _dtype(code: int) -> tuple[str, int]:
    known = DTYPES.get(code)
    if known is None:
        raise BlockDecodeError("dtype", f"unknown dtype code {code}")
    return known


def unpack_header(value: Buffer) -> BlockHeader:
    """The header's fields; checks only that there is one (length, magic)."""
    if len(value) < HEADER_NBYTES:
        raise BlockDecodeError("truncated", f"value has {len(value)} bytes, the header alone is {HEADER_NBYTES}")
    magic, *fields = HEADER.unpack_from(value, 0)
    if magic != MAGIC:
        raise BlockDecodeError("magic", f"magic is {magic!r}, expected {MAGIC!r}")
    return BlockHeader(*fields)


def checksum(runs: Sequence[Buffer]) -> int:
    """xxh3_64 of ``runs`` back to back (the same digest as over them joined), with the GIL
    released while a large run is hashed.

    Through the streaming object on purpose: python-xxhash's one-shot ``xxh3_64_intdigest``
    holds the GIL in every 3.x release (4.x releases it), and a held GIL serialises the
    checksums of a transfer with everything else the process runs: the other bulk threads,
    the event loop, the engine's thread launching kernels. ``update`` releases it for a large
    buffer in 3.x and 4.x alike; the object costs about a microsecond.
    """
    h = xxhash.xxh3_64()
    for run in runs:
        h.update(run)
    return h.intdigest()


def check_body(value: Buffer, header: BlockHeader) -> None:
    """The value is exactly header + the payload the header describes, and the checksum matches."""
    expected = HEADER_NBYTES + header.payload_nbytes
    if len(value) < expected:
        raise BlockDecodeError("truncated", f"value has {len(value)} bytes, header says {expected}")
    if len(value) > expected:
        raise BlockDecodeError("length", f"value has {len(value)} bytes, header says {expected}")
    actual = checksum([memoryview(value)[HEADER_NBYTES:]])
    if actual != header.checksum:
        raise BlockDecodeError("checksum", f"payload checksum {actual:016x}, header says {header.checksum:016x}")


def inspect_block(value: Buffer) -> BlockHeader:
    """Validate a value's integrity without knowing the model: what cache_store checks on PUT.

    Checks magic, a non-zero version, a known dtype, non-zero dimensions and token count,
    the length the header implies, and the checksum. Compatibility with a model (which
    version, dtype and shape it reads) is the reader's check, in ``BlockCodec.decode``.
    """
    header = unpack_header(value)
    if header.version == 0:
        raise BlockDecodeError("version", "layout version 0")
    _dtype(header.dtype_code)
    if not (header.num_layers and header.num_kv_heads and header.head_dim):
        raise BlockDecodeError(
            "shape",
            f"zero dimension in layers={header.num_layers} kv_heads={header.num_kv_heads} head_dim={header.head_dim}",
        )
    if header.num_tokens == 0:
        raise BlockDecodeError("tokens", "token count is 0")
    check_body(value, header)
    return header
