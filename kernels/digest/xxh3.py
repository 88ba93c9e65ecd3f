"""XXH3-64's constants for long inputs (more than 240 bytes), as tables the kernels read.

The pool's values carry xxh3_64 of their payload (libs/kvpool/header.py), the digest
python-xxhash computes on the CPU. ``kernels/digest`` computes the very same digest on the
device, from the cache. These are the parts of XXH3 (xxhash 0.8, ``XXH3_hashLong_64b``
with the default secret and seed 0) that its long-input path uses:

- ``stripes`` of 64 bytes, 8 little-endian u64 lanes each; a stripe adds, per lane ``i``,
  ``lo32(d ^ k) * hi32(d ^ k)`` to accumulator ``i`` and the data word itself to
  accumulator ``i ^ 1``, where ``k`` is the secret's u64 at byte ``8 * (stripe + i)``;
- ``blocks`` of 16 stripes (1 KiB): after each whole block the accumulators are
  scrambled (``a ^= a >> 47; a ^= key; a *= PRIME32_1``), the one step that orders them;
- the last, partial block's stripes, then the input's last 64 bytes as a stripe with the
  secret at byte 121; then the eight accumulators are merged in pairs (a 128-bit product
  folded to 64 bits) into ``len * PRIME64_1`` and avalanched.

Every key is a u64 read at some byte offset of the 192-byte secret; :data:`TABLE` holds
them, as int64 bit patterns, at the offsets named below, with the initial accumulators
and the multipliers and mask (as data, so no literal's integer type is left to a
compiler's promotion rules).
"""

from __future__ import annotations

import struct
from typing import Final

SECRET: Final = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
PRIME32_1: Final = 0x9E3779B1
PRIME32_2: Final = 0x85EBCA77
PRIME32_3: Final = 0xC2B2AE3D
PRIME64_1: Final = 0x9E3779B185EBCA87
PRIME64_2: Final = 0xC2B2AE3D27D4EB4F
PRIME64_3: Final = 0x165667B19E3779F9
PRIME64_4: Final = 0x85EBCA77C2B2AE63
PRIME64_5: Final = 0x27D4EB2F165667C5
AVALANCHE: Final = 0x165667919E3779F9

MIN_LEN: Final = 241  # shorter inputs take XXH3's other paths (never a KV payload)
STRIPE_BYTES: Final = 64
LANES: Final = 8
STRIPES_PER_BLOCK: Final = 16
BLOCK_BYTES: Final = STRIPE_BYTES * STRIPES_PER_BLOCK
INIT_ACC: Final = (PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1)


def _u64(offset: int) -> int:
    return struct.unpack_from("<Q", SECRET, offset)[0]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


# Offsets into TABLE.
STRIPE_KEYS: Final = 0  # 24 entries: the secret's u64 at byte 8k; stripe s, lane i reads 8(s + i)
SCRAMBLE_KEYS: Final = 16  # the secret's u64 at bytes 128 + 8i: the same table from entry 16
LAST_KEYS: Final = 24  # 8 entries: bytes 121 + 8i, the last stripe's keys
MERGE_KEYS: Final = 32  # 8 entries: bytes 11 + 8i; pair p merges lanes 2p, 2p + 1
INIT: Final = 40  # 8 entries: the initial accumulators
LEN_PRIME: Final = 48  # PRIME64_1: the merge starts from len * PRIME64_1
SCRAMBLE_PRIME: Final = 49  # PRIME32_1
LOW32: Final = 50  # 0xFFFFFFFF
AVALANCHE_PRIME: Final = 51
TABLE_SIZE: Final = 52

TABLE: Final[tuple[int, ...]] = tuple(
    _signed(v)
    for v in (
        *(_u64(8 * k) for k in range(24)),
        *(_u64(121 + 8 * i) for i in range(LANES)),
        *(_u64(11 + 8 * i) for i in range(LANES)),
        *INIT_ACC,
        PRIME64_1,
        PRIME32_1,
        0xFFFFFFFF,
        AVALANCHE,
    )
)
assert len(TABLE) == TABLE_SIZE
