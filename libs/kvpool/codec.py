"""The byte format of one pool value: a fixed header, then one block's KV payload.

One value holds one block: all layers, K and V (DESIGN.md, "Block values"), so a block is
written, read and evicted atomically. Layout, little-endian::

    offset  size  field
         0     4  magic            b"TPKV"
         4     2  layout version   LAYOUT_VERSION of libs/kvpool/layout.py
         6     2  dtype code       DTYPE_CODES below (a fixed table, never torch's enum)
         8     2  num_layers
        10     2  num_kv_heads
        12     2  head_dim
        14     2  num_tokens       1..block_size; a partial block of m tokens stores m
        16     8  checksum         xxh3_64 of the payload (27 GB/s here; crc32 is 4 GB/s)
        24     -  payload          [layers, 2 (K/V), num_tokens, kv_heads, head_dim]

The payload order is the engine's block-major cache order with the token axis cut to
``num_tokens``, so a full block is one contiguous copy out of (and back into) pinned
staging. The header is 24 bytes, so the payload starts 8-byte aligned.

Decoding checks the header against the reader's own :class:`KVLayout` and verifies the
checksum; any mismatch raises :class:`BlockDecodeError` whose ``reason`` comes from the
fixed set :data:`DECODE_REASONS`. Readers turn it into a cache miss labelled
``corrupt:<reason>`` (metrics, traces), never into garbage in the cache. The order of the
checks makes every single corrupted byte detectable: header fields the reader knows
(magic, version, dtype, shape) are compared with its layout, the token count is
range-checked and must agree with the value's length, and the payload is checksummed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, Literal, Union, get_args

import numpy as np
import torch
import xxhash

from libs.kvpool.layout import LAYOUT_VERSION, KVLayout

MAGIC: Final = b"TPKV"
_HEADER = struct.Struct("<4sHHHHHHQ")
HEADER_NBYTES: Final = _HEADER.size

# Fixed on-the-wire dtype codes: torch's own enum values are not a stable format.
DTYPE_CODES: Final[dict[torch.dtype, int]] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
_DTYPES_BY_CODE: Final = {code: dtype for dtype, code in DTYPE_CODES.items()}

DecodeReason = Literal["truncated", "magic", "version", "dtype", "shape", "tokens", "length", "checksum"]
DECODE_REASONS: Final[tuple[str, ...]] = get_args(DecodeReason)

# Anything the buffer protocol can hand to a socket or to xxhash without a copy.
Buffer = Union[bytes, bytearray, memoryview]


class BlockDecodeError(ValueError):
    """A value that is not a usable block for this reader; ``reason`` is one of DECODE_REASONS."""

    def __init__(self, reason: DecodeReason, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason: DecodeReason = reason


@dataclass(frozen=True)
class BlockHeader:
    """The decoded header of a value (its checksum already verified where it came from)."""

    version: int
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    checksum: int

    @property
    def payload_nbytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_tokens * self.num_kv_heads * self.head_dim * elem


def _unpack(value: Buffer) -> tuple[bytes, int, int, int, int, int, int, int]:
    if len(value) < HEADER_NBYTES:
        raise BlockDecodeError("truncated", f"value has {len(value)} bytes, the header alone is {HEADER_NBYTES}")
    fields = _HEADER.unpack_from(value, 0)
    if fields[0] != MAGIC:
        raise BlockDecodeError("magic", f"magic is {fields[0]!r}, expected {MAGIC!r}")
    if fields[1] != LAYOUT_VERSION:
        raise BlockDecodeError("version", f"layout version {fields[1]}, this reader knows {LAYOUT_VERSION}")
    return fields


def _check_body(value: Buffer, payload_nbytes: int, checksum: int) -> None:
    """Length exactly header + payload, then the payload checksum."""
    expected = HEADER_NBYTES + payload_nbytes
    if len(value) < expected:
        raise BlockDecodeError("truncated", f"value has {len(value)} bytes, header says {expected}")
    if len(value) > expected:
        raise BlockDecodeError("length", f"value has {len(value)} bytes, header says {expected}")
    actual = xxhash.xxh3_64_intdigest(memoryview(value)[HEADER_NBYTES:])
    if actual != checksum:
        raise BlockDecodeError("checksum", f"payload checksum {actual:016x}, header says {checksum:016x}")


def inspect_block(value: Buffer) -> BlockHeader:
    """Validate a value without knowing the model: what cache_store checks on PUT.

    Checks magic, version, a known dtype, non-zero dimensions, the length the header
    implies, and the checksum. It cannot check the shape against a model; readers do
    that in :meth:`BlockCodec.decode`.
    """
    _, version, code, layers, heads, dim, tokens, checksum = _unpack(value)
    dtype = _DTYPES_BY_CODE.get(code)
    if dtype is None:
        raise BlockDecodeError("dtype", f"unknown dtype code {code}")
    if not (layers and heads and dim):
        raise BlockDecodeError("shape", f"zero dimension in layers={layers} kv_heads={heads} head_dim={dim}")
    if tokens == 0:
        raise BlockDecodeError("tokens", "token count is 0")
    header = BlockHeader(version, dtype, layers, heads, dim, tokens, checksum)
    _check_body(value, header.payload_nbytes, checksum)
    return header


class BlockCodec:
    """Encode and decode the blocks of one :class:`KVLayout`.

    Both directions make exactly one copy of the payload: encode from the (pinned) staging
    tensor into the value's buffer, decode from the value into the caller's staging tensor.
    """

    def __init__(self, layout: KVLayout) -> None:
        if layout.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {layout.dtype} has no pool encoding; known: {list(DTYPE_CODES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(layout, name) > 0xFFFF:
                raise ValueError(f"KVLayout.{name}={getattr(layout, name)} does not fit the 16-bit header field")
        self.layout = layout
        self._code = DTYPE_CODES[layout.dtype]
        self._token_nbytes = layout.num_kv_heads * layout.head_dim * layout.element_size

    def payload_nbytes(self, num_tokens: int) -> int:
        return self.layout.num_layers * 2 * num_tokens * self._token_nbytes

    def value_nbytes(self, num_tokens: int) -> int:
        return HEADER_NBYTES + self.payload_nbytes(num_tokens)

    def _check_tensor(self, block: torch.Tensor, what: str) -> None:
        if tuple(block.shape) != self.layout.block_shape:
            raise ValueError(f"{what} has shape {tuple(block.shape)}, layout says {self.layout.block_shape}")
        if block.dtype != self.layout.dtype:
            raise ValueError(f"{what} has dtype {block.dtype}, layout says {self.layout.dtype}")

    def _check_tokens(self, num_tokens: int) -> None:
        if not 1 <= num_tokens <= self.layout.block_size:
            raise ValueError(f"num_tokens must be in [1, {self.layout.block_size}], got {num_tokens}")

    def encode(self, block: torch.Tensor, num_tokens: int) -> bytearray:
        """The value of ``block`` (shape ``layout.block_shape``) holding its first ``num_tokens`` tokens.

        ``block`` may live on any device (typically a view into pinned staging). The
        result is a fresh buffer, so the caller may reuse its staging memory at once.
        """
        self._check_tensor(block, "block")
        self._check_tokens(num_tokens)
        lay = self.layout
        out = bytearray(self.value_nbytes(num_tokens))
        if block.device.type == "cpu" and block.is_contiguous():
            # numpy's copy: no torch intra-op threads, which contend on shared cores.
            row = self._token_nbytes
            src = block.detach().view(torch.uint8).numpy().reshape(lay.num_layers, 2, lay.block_size, row)
            dst = np.frombuffer(out, dtype=np.uint8, offset=HEADER_NBYTES)
            dst.reshape(lay.num_layers, 2, num_tokens, row)[...] = src[:, :, :num_tokens]
        else:
            payload = torch.frombuffer(out, dtype=lay.dtype, offset=HEADER_NBYTES)
            payload.view(lay.num_layers, 2, num_tokens, lay.num_kv_heads, lay.head_dim).copy_(
                block[:, :, :num_tokens]
            )
        checksum = xxhash.xxh3_64_intdigest(memoryview(out)[HEADER_NBYTES:])
        _HEADER.pack_into(
            out, 0, MAGIC, LAYOUT_VERSION, self._code,
            lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, checksum,
        )
        return out

    def decode(self, value: Buffer, out: torch.Tensor, *, expected_tokens: int | None = None) -> int:
        """Check ``value`` against this layout and copy its tokens into ``out``; return the token count.

        ``out`` is a contiguous CPU tensor of ``layout.block_shape`` (a pinned staging slot);
        tokens past the returned count are left as they were. ``expected_tokens`` (the
        count the block key promises) turns a mismatch into reason ``"tokens"``. Raises
        :class:`BlockDecodeError` on any mismatch, before touching ``out``.
        """
        self._check_tensor(out, "out")
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("out must be a contiguous CPU tensor (a staging slot)")
        lay = self.layout
        _, _, code, layers, heads, dim, tokens, checksum = _unpack(value)
        if code != self._code:
            got = _DTYPES_BY_CODE.get(code, f"unknown code {code}")
            raise BlockDecodeError("dtype", f"value holds {got}, reader expects {lay.dtype}")
        if (layers, heads, dim) != (lay.num_layers, lay.num_kv_heads, lay.head_dim):
            raise BlockDecodeError(
                "shape",
                f"value is layers={layers} kv_heads={heads} head_dim={dim}, reader expects "
                f"layers={lay.num_layers} kv_heads={lay.num_kv_heads} head_dim={lay.head_dim}",
            )
        if not 1 <= tokens <= lay.block_size:
            raise BlockDecodeError("tokens", f"token count {tokens} outside [1, {lay.block_size}]")
        if expected_tokens is not None and tokens != expected_tokens:
            raise BlockDecodeError("tokens", f"value holds {tokens} tokens, key says {expected_tokens}")
        _check_body(value, self.payload_nbytes(tokens), checksum)
        # numpy views: the value is usually read-only ``bytes``, which torch.frombuffer
        # accepts only with a warning; numpy reads it without a copy and without one.
        row = self._token_nbytes
        src = np.frombuffer(value, dtype=np.uint8, count=self.payload_nbytes(tokens), offset=HEADER_NBYTES)
        dst = out.view(torch.uint8).numpy().reshape(lay.num_layers, 2, lay.block_size, row)
        dst[:, :, :tokens] = src.reshape(lay.num_layers, 2, tokens, row)
        return tokens
