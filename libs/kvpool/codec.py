"""Encode and decode one block's KV between a staging tensor and a pool value.

The value format (header fields, payload order, checksum) is in libs/kvpool/header.py.
Decoding checks the header against the reader's own :class:`KVLayout`, in an order that
makes every single corrupted byte detectable: the fields the reader knows (magic,
version, dtype, shape) are compared with its layout, the token count is range-checked and
must agree with the value's length, and the payload is checksummed. Any mismatch raises
:class:`~libs.kvpool.header.BlockDecodeError` before the staging tensor is touched.

Two ways to use it:

- ``encode`` / ``decode``: one copy each way between a staging tensor and a value buffer.
- In place, for the zero-copy bulk path: ``encode_views`` returns a value as parts, the
  header (24 fresh bytes) and views of the staging block itself, checksummed where they
  lie; ``value_views`` says where a value of ``n`` tokens lands in a staging slot (the
  header in a separate 24-byte buffer, the payload straight into the slot), and
  ``verify_landed`` checks it there after it arrived. A full block's payload is one
  contiguous run of the slot; a partial block of ``m`` tokens is ``2 * layers`` runs (the
  first ``m`` token rows of each layer's K and V), so even the tail block is received
  and sent scatter-gather, with no copy. The checksum is xxh3 over the runs in order
  (streamed for a partial block), the same digest as over the payload in one piece.
  ``encode_pending`` is ``encode_views`` without the checksum yet: a
  :class:`~libs.kvpool.header.PendingValue` that the bulk path seals on the thread that
  sends it, so a write needs no hop of its own for hashing. ``encode_digested`` takes the
  checksum as already computed on the GPU (kernels/digest), so nothing hashes the block
  on the CPU at all.

A *slot* is where one block lies in staging: a contiguous CPU tensor of the layout's
block shape, or the same bytes as a numpy row of ``byte_rows(buffer)``, which the hot
paths (prefill's writes, decode's reads) use so that no torch call is made per block.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from libs.kvpool.header import (
    DTYPE_CODES,
    DTYPES,
    HEADER,
    HEADER_NBYTES,
    MAGIC,
    BlockDecodeError,
    BlockHeader,
    Buffer,
    PendingValue,
    check_body,
    checksum,
    unpack_header,
)
from libs.kvpool.layout import LAYOUT_VERSION, KVLayout


# Where a block's bytes lie: a contiguous CPU tensor of the layout's block shape (a staging
# row), or that row's bytes as numpy (BlockCodec.byte_rows: no torch call per block).
Slot = Union[torch.Tensor, np.ndarray]


def dtype_code(dtype: torch.dtype) -> int:
    """The header's code for ``dtype``; ``ValueError`` if the pool has no encoding for it."""
    code = DTYPE_CODES.get(str(dtype).removeprefix("torch."))
    if code is None:
        raise ValueError(f"dtype {dtype} has no pool encoding; known: {sorted(DTYPE_CODES)}")
    return code


class BlockCodec:
    """Encode and decode the blocks of one :class:`KVLayout`.

    Both directions make exactly one copy of the payload: encode from the (pinned) staging
    tensor into the value's buffer, decode from the value into the caller's staging tensor.
    """

    def __init__(self, layout: KVLayout) -> None:
        self._code = dtype_code(layout.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(layout, name) > 0xFFFF:
                raise ValueError(f"KVLayout.{name}={getattr(layout, name)} does not fit the 16-bit header field")
        self.layout = layout
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

    def byte_rows(self, buffer: torch.Tensor) -> np.ndarray:
        """A staging buffer ``[n, *layout.block_shape]`` (a contiguous CPU tensor) as its
        bytes, ``[n, block_nbytes]`` uint8, without a copy. Row ``i`` is a *slot* that the
        methods below take in place of the tensor ``buffer[i]``: the torch view is made once
        per buffer, not once per block (a few torch calls per block are most of the
        codec's cost besides the hash, and they hold the GIL)."""
        lay = self.layout
        if tuple(buffer.shape[1:]) != lay.block_shape or buffer.dtype != lay.dtype:
            raise ValueError(f"buffer is {tuple(buffer.shape)} {buffer.dtype}, layout says [n, {lay.block_shape}] {lay.dtype}")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("a staging buffer is a contiguous CPU tensor")
        return buffer.detach().view(torch.uint8).numpy().reshape(buffer.shape[0], lay.block_nbytes)

    def _slot_rows(self, slot: Slot, what: str) -> np.ndarray:
        """``slot`` as ``[2 * layers, block_size * token bytes]`` uint8, without a copy:
        a contiguous CPU tensor of the layout's block shape, or a row of :meth:`byte_rows`."""
        lay = self.layout
        shape = (lay.num_layers * 2, lay.block_size * self._token_nbytes)
        if isinstance(slot, np.ndarray):
            if slot.dtype != np.uint8 or slot.shape != (lay.block_nbytes,) or not slot.flags.c_contiguous:
                raise ValueError(f"{what} must be one block's bytes ({lay.block_nbytes} contiguous uint8), got {slot.dtype} {slot.shape}")
            return slot.reshape(shape)
        self._check_tensor(slot, what)
        if slot.device.type != "cpu" or not slot.is_contiguous():
            raise ValueError(f"{what} must be a contiguous CPU tensor (a staging slot)")
        return slot.detach().view(torch.uint8).numpy().reshape(shape)

    def _runs(self, rows: np.ndarray, num_tokens: int) -> list[memoryview]:
        """The payload of ``num_tokens`` tokens as views of a slot's rows."""
        if num_tokens == self.layout.block_size:
            return [memoryview(rows.reshape(-1))]
        cut = num_tokens * self._token_nbytes
        return [memoryview(rows[i, :cut]) for i in range(rows.shape[0])]

    def _header(self, num_tokens: int, checksum: int) -> memoryview:
        lay = self.layout
        head = memoryview(bytearray(HEADER_NBYTES))
        HEADER.pack_into(
            head, 0, MAGIC, LAYOUT_VERSION, self._code, lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, checksum
        )
        return head

    def encode_pending(self, block: Slot, num_tokens: int) -> PendingValue:
        """The value of ``block`` (a slot) as a :class:`PendingValue`: the header and views
        of the payload, checksummed later by whoever sends it (``seal``), on its own thread.

        The runs are views of ``block``, so it must not change until the value is written.
        """
        self._check_tokens(num_tokens)
        runs = self._runs(self._slot_rows(block, "block"), num_tokens)
        return PendingValue(self._header(num_tokens, 0), runs)

    def encode_views(self, block: Slot, num_tokens: int) -> list[memoryview]:
        """The value of ``block`` as parts ``[header, payload runs...]`` without copying the payload.

        The runs are views of ``block`` (a slot: a contiguous CPU tensor such as a pinned
        staging row, or a row of :meth:`byte_rows`), so it must not change until the value
        is written. Any other tensor is encoded with :meth:`encode` (one copy) and returned
        as one part.
        """
        if isinstance(block, torch.Tensor):
            self._check_tensor(block, "block")
            if block.device.type != "cpu" or not block.is_contiguous():
                self._check_tokens(num_tokens)
                return [self.encode(block, num_tokens)]
        return self.encode_pending(block, num_tokens).seal()

    def encode_digested(self, block: Slot, num_tokens: int, checksum: int) -> list[memoryview]:
        """The value of ``block`` (a slot) as parts, its payload's checksum already known
        (xxh3_64, computed on the device from the cache the slot was copied from:
        kernels/digest): the header, then views of the payload. Nothing is left to hash."""
        self._check_tokens(num_tokens)
        runs = self._runs(self._slot_rows(block, "block"), num_tokens)
        return [self._header(num_tokens, checksum), *runs]

    def value_views(self, header: memoryview, out: Slot, num_tokens: int) -> list[memoryview]:
        """Where a value of ``num_tokens`` lands: ``header`` (24 bytes), then payload runs of ``out``.

        ``out`` is a slot (a contiguous CPU tensor of ``layout.block_shape``, or a row of
        :meth:`byte_rows`). The views add up to ``value_nbytes(num_tokens)``.
        """
        self._check_tokens(num_tokens)
        rows = self._slot_rows(out, "out")
        if header.nbytes != HEADER_NBYTES:
            raise ValueError(f"header buffer has {header.nbytes} bytes, the header is {HEADER_NBYTES}")
        return [header, *self._runs(rows, num_tokens)]

    def verify_landed(self, header: Buffer, out: Slot, num_tokens: int) -> int:
        """Check a value that landed through ``value_views(header, out, num_tokens)``; its token count.

        The transport guaranteed the value's length (header + payload of ``num_tokens``);
        this checks the header against this layout and that token count, and the checksum
        of the payload where it lies in ``out``. Raises :class:`BlockDecodeError`.
        """
        h = unpack_header(header)
        self._check_header(h, num_tokens)
        actual = checksum(self._runs(self._slot_rows(out, "out"), num_tokens))
        if actual != h.checksum:
            raise BlockDecodeError("checksum", f"payload checksum {actual:016x}, header says {h.checksum:016x}")
        return num_tokens

    def _check_header(self, h: BlockHeader, expected_tokens: int | None) -> None:
        lay = self.layout
        if h.version != LAYOUT_VERSION:
            raise BlockDecodeError("version", f"layout version {h.version}, this reader knows {LAYOUT_VERSION}")
        if h.dtype_code != self._code:
            got = DTYPES.get(h.dtype_code, (f"unknown code {h.dtype_code}",))[0]
            raise BlockDecodeError("dtype", f"value holds {got}, reader expects {lay.dtype}")
        if (h.num_layers, h.num_kv_heads, h.head_dim) != (lay.num_layers, lay.num_kv_heads, lay.head_dim):
            raise BlockDecodeError(
                "shape",
                f"value is layers={h.num_layers} kv_heads={h.num_kv_heads} head_dim={h.head_dim}, reader "
                f"expects layers={lay.num_layers} kv_heads={lay.num_kv_heads} head_dim={lay.head_dim}",
            )
        tokens = h.num_tokens
        if not 1 <= tokens <= lay.block_size:
            raise BlockDecodeError("tokens", f"token count {tokens} outside [1, {lay.block_size}]")
        if expected_tokens is not None and tokens != expected_tokens:
            raise BlockDecodeError("tokens", f"value holds {tokens} tokens, key says {expected_tokens}")

    def encode(self, block: torch.Tensor, num_tokens: int) -> memoryview:
        """The value of ``block`` (shape ``layout.block_shape``) holding its first ``num_tokens`` tokens.

        ``block`` may live on any device (typically a view into pinned staging). The
        result is a fresh buffer, so the caller may reuse its staging memory at once. It is
        a byte ``memoryview`` over uninitialised numpy memory: a ``bytearray`` would zero
        its memory first, a whole extra pass (3x the cost of allocate + copy, measured);
        sockets, xxhash and redis-py take it as it is, ``bytes(value)`` copies it.
        """
        self._check_tensor(block, "block")
        self._check_tokens(num_tokens)
        lay = self.layout
        buf = np.empty(self.value_nbytes(num_tokens), dtype=np.uint8)
        row = self._token_nbytes
        dst = buf[HEADER_NBYTES:].reshape(lay.num_layers, 2, num_tokens, row)
        if block.device.type == "cpu" and block.is_contiguous():
            # numpy's copy: no torch intra-op threads, which contend on shared cores.
            src = block.detach().view(torch.uint8).numpy().reshape(lay.num_layers, 2, lay.block_size, row)
            dst[...] = src[:, :, :num_tokens]
        else:
            torch.from_numpy(dst).view(lay.dtype).view(
                lay.num_layers, 2, num_tokens, lay.num_kv_heads, lay.head_dim
            ).copy_(block[:, :, :num_tokens])
        out = memoryview(buf)
        HEADER.pack_into(
            out, 0, MAGIC, LAYOUT_VERSION, self._code,
            lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, checksum([out[HEADER_NBYTES:]]),
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
        h = unpack_header(value)
        self._check_header(h, expected_tokens)
        tokens = h.num_tokens
        check_body(value, h)
        # numpy views: the value is usually read-only ``bytes``, which torch.frombuffer
        # accepts only with a warning; numpy reads it without a copy and without one.
        row = self._token_nbytes
        src = np.frombuffer(value, dtype=np.uint8, count=self.payload_nbytes(tokens), offset=HEADER_NBYTES)
        dst = out.view(torch.uint8).numpy().reshape(lay.num_layers, 2, lay.block_size, row)
        dst[:, :, :tokens] = src.reshape(lay.num_layers, 2, tokens, row)
        return tokens
