"""The block codec: exact round trips, and every corruption detected with the right reason."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.kvpool.codec import BlockCodec
from libs.kvpool.header import DECODE_REASONS, HEADER_NBYTES, MAGIC, BlockDecodeError, inspect_block, value_parts
from libs.kvpool.layout import LAYOUT_VERSION, KVLayout

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
CODEC = BlockCodec(LAYOUT)

# Which decode reasons a corrupted header byte may produce, by byte offset.
FIELD_REASONS = {
    **{i: {"magic"} for i in range(0, 4)},
    **{i: {"version"} for i in range(4, 6)},
    **{i: {"dtype"} for i in range(6, 8)},
    **{i: {"shape"} for i in range(8, 14)},
    # A changed token count is out of range, or disagrees with the value's length.
    **{i: {"tokens", "truncated", "length"} for i in range(14, 16)},
    **{i: {"checksum"} for i in range(16, 24)},
}


def random_block(layout: KVLayout, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=gen).to(layout.dtype)


def decode_reason(codec: BlockCodec, value: bytes, **kw: int) -> str:
    out = torch.zeros(codec.layout.block_shape, dtype=codec.layout.dtype)
    with pytest.raises(BlockDecodeError) as info:
        codec.decode(value, out, **kw)
    assert info.value.reason in DECODE_REASONS
    assert not out.view(torch.uint8).any(), "a failed decode must not touch the staging tensor"
    return info.value.reason


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 3, 4])
def test_roundtrip_is_bit_exact(dtype: torch.dtype, num_tokens: int) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    codec = BlockCodec(layout)
    block = random_block(layout, seed=num_tokens)
    value = codec.encode(block, num_tokens)
    assert len(value) == HEADER_NBYTES + layout.num_layers * 2 * num_tokens * 2 * 8 * layout.element_size
    out = torch.full(layout.block_shape, 7.0).to(dtype)
    untouched = out.clone()
    assert codec.decode(bytes(value), out, expected_tokens=num_tokens) == num_tokens
    assert same_bits(out[:, :, :num_tokens], block[:, :, :num_tokens])
    # Tokens past the count are left as they were.
    assert same_bits(out[:, :, num_tokens:], untouched[:, :, num_tokens:])


def test_payload_order_and_checksum_are_the_documented_ones() -> None:
    block = random_block(LAYOUT)
    value = CODEC.encode(block, 3)
    payload = bytes(value[HEADER_NBYTES:])
    assert payload == block[:, :, :3].contiguous().view(torch.uint8).numpy().tobytes()
    magic, version, _, layers, heads, dim, tokens, checksum = struct.unpack_from("<4sHHHHHHQ", value)
    assert (magic, version, layers, heads, dim, tokens) == (MAGIC, LAYOUT_VERSION, 3, 2, 8, 3)
    assert checksum == xxhash.xxh3_64_intdigest(payload)


def test_encode_from_a_strided_view_matches_contiguous() -> None:
    wide = random_block(KVLayout(3, 2, 16, 4, LAYOUT.dtype))
    strided = wide[..., :8]  # every other run of 8 elements: not contiguous
    assert not strided.is_contiguous()
    assert CODEC.encode(strided, 3) == CODEC.encode(strided.contiguous(), 3)


@pytest.mark.parametrize("num_tokens", [2, 4])
@pytest.mark.parametrize("offset", range(HEADER_NBYTES))
@pytest.mark.parametrize("flip", [0x01, 0xFF])
def test_every_header_byte_is_checked(num_tokens: int, offset: int, flip: int) -> None:
    value = CODEC.encode(random_block(LAYOUT, seed=offset), num_tokens)
    value[offset] ^= flip
    assert decode_reason(CODEC, bytes(value)) in FIELD_REASONS[offset]
    if offset not in range(4, 8):
        # inspect_block checks integrity, not compatibility: another version, or a dtype
        # of the same size (bf16 <-> fp16), is only wrong for a reader that knows its own.
        with pytest.raises(BlockDecodeError):
            inspect_block(bytes(value))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_payload_corruption_is_detected(data: st.DataObject) -> None:
    num_tokens = data.draw(st.integers(1, LAYOUT.block_size))
    value = CODEC.encode(random_block(LAYOUT, seed=num_tokens), num_tokens)
    pos = data.draw(st.integers(HEADER_NBYTES, len(value) - 1), label="byte")
    value[pos] ^= data.draw(st.integers(1, 255), label="xor")
    assert decode_reason(CODEC, bytes(value)) == "checksum"
    with pytest.raises(BlockDecodeError, match="checksum"):
        inspect_block(bytes(value))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_truncation_and_trailing_bytes_are_detected(data: st.DataObject) -> None:
    value = bytes(CODEC.encode(random_block(LAYOUT), LAYOUT.block_size))
    cut = data.draw(st.integers(0, len(value) - 1), label="cut")
    assert decode_reason(CODEC, value[:cut]) == "truncated"
    extra = data.draw(st.binary(min_size=1, max_size=16), label="extra")
    assert decode_reason(CODEC, value + extra) == "length"


def test_reader_layout_mismatches_are_named() -> None:
    value = bytes(CODEC.encode(random_block(LAYOUT), 4))
    fp32 = BlockCodec(KVLayout(3, 2, 8, 4, torch.float32))
    assert decode_reason(fp32, value) == "dtype"
    for other in (KVLayout(4, 2, 8, 4, LAYOUT.dtype), KVLayout(3, 1, 8, 4, LAYOUT.dtype), KVLayout(3, 2, 16, 4, LAYOUT.dtype)):
        assert decode_reason(BlockCodec(other), value) == "shape"
    # A reader with smaller blocks cannot hold 4 tokens.
    assert decode_reason(BlockCodec(KVLayout(3, 2, 8, 2, LAYOUT.dtype)), value) == "tokens"
    # The key promises a partial block, the value is full.
    assert decode_reason(CODEC, value, expected_tokens=3) == "tokens"


def test_wrong_version_and_magic() -> None:
    value = CODEC.encode(random_block(LAYOUT), 4)
    newer = bytearray(value)
    struct.pack_into("<H", newer, 4, LAYOUT_VERSION + 1)
    assert decode_reason(CODEC, bytes(newer)) == "version"
    foreign = bytearray(value)
    foreign[:4] = b"GGUF"
    assert decode_reason(CODEC, bytes(foreign)) == "magic"
    assert decode_reason(CODEC, b"") == "truncated"


def test_inspect_block_accepts_valid_values_of_any_model() -> None:
    for layout in (LAYOUT, KVLayout(30, 3, 64, 16, torch.float32)):
        value = BlockCodec(layout).encode(random_block(layout), 3)
        header = inspect_block(bytes(value))
        assert (header.num_layers, header.num_kv_heads, header.head_dim) == (
            layout.num_layers, layout.num_kv_heads, layout.head_dim,
        )
        assert header.num_tokens == 3 and header.dtype == str(layout.dtype).removeprefix("torch.")
        assert header.payload_nbytes == len(value) - HEADER_NBYTES


def test_encode_rejects_caller_bugs() -> None:
    block = random_block(LAYOUT)
    with pytest.raises(ValueError, match="num_tokens"):
        CODEC.encode(block, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        CODEC.encode(block, LAYOUT.block_size + 1)
    with pytest.raises(ValueError, match="shape"):
        CODEC.encode(block[:2], 1)
    with pytest.raises(ValueError, match="dtype"):
        CODEC.encode(block.float(), 1)
    strided_out = torch.zeros(3, 2, 4, 2, 16, dtype=LAYOUT.dtype)[..., :8]
    with pytest.raises(ValueError, match="contiguous CPU"):
        CODEC.decode(bytes(CODEC.encode(block, 1)), strided_out)
    with pytest.raises(ValueError, match="dtype"):
        BlockCodec(KVLayout(1, 1, 1, 1, torch.int32))


@pytest.mark.parametrize("num_tokens", [1, 3, LAYOUT.block_size])
def test_pending_and_byte_row_slots_give_the_same_value_as_encode(num_tokens: int) -> None:
    buffer = torch.stack([random_block(LAYOUT, seed) for seed in range(3)])
    rows = CODEC.byte_rows(buffer)
    assert rows.shape == (3, LAYOUT.block_nbytes) and rows.base is not None  # a view, not a copy
    expected = bytes(CODEC.encode(buffer[1], num_tokens))
    pending = CODEC.encode_pending(rows[1], num_tokens)
    assert bytes(pending.parts[0])[16:24] == bytes(8), "the checksum is left for the sender"
    assert pending.nbytes == len(expected)
    assert b"".join(value_parts(pending)) == expected  # reading its parts seals it
    assert b"".join(bytes(p) for p in CODEC.encode_views(rows[1], num_tokens)) == expected
    assert b"".join(bytes(p) for p in CODEC.encode_views(buffer[1], num_tokens)) == expected


@pytest.mark.parametrize("num_tokens", [2, LAYOUT.block_size])
def test_a_value_lands_and_is_verified_in_a_byte_row_slot(num_tokens: int) -> None:
    value = bytes(CODEC.encode(random_block(LAYOUT, 7), num_tokens))
    staging = torch.zeros(2, *LAYOUT.block_shape, dtype=LAYOUT.dtype)
    header = memoryview(bytearray(HEADER_NBYTES))
    views = CODEC.value_views(header, CODEC.byte_rows(staging)[1], num_tokens)
    pos = 0
    for v in views:  # what the transport does: fill the views in order
        v[:] = value[pos : pos + v.nbytes]
        pos += v.nbytes
    assert pos == len(value)
    assert CODEC.verify_landed(header, CODEC.byte_rows(staging)[1], num_tokens) == num_tokens
    assert bytes(CODEC.encode(staging[1], num_tokens)) == value and not staging[0].view(torch.uint8).any()
    CODEC.byte_rows(staging)[1][0] ^= 1  # layer 0's K, token 0: in the payload of any token count
    with pytest.raises(BlockDecodeError, match="checksum"):
        CODEC.verify_landed(header, CODEC.byte_rows(staging)[1], num_tokens)


def test_slots_of_the_wrong_size_or_kind_are_refused() -> None:
    rows = CODEC.byte_rows(torch.zeros(2, *LAYOUT.block_shape, dtype=LAYOUT.dtype))
    with pytest.raises(ValueError, match="one block's bytes"):
        CODEC.encode_pending(rows[0, :-1], 1)
    with pytest.raises(ValueError, match="one block's bytes"):
        CODEC.value_views(memoryview(bytearray(HEADER_NBYTES)), rows[0].view("u2"), 1)
    with pytest.raises(ValueError, match="layout says"):
        CODEC.byte_rows(torch.zeros(2, *LAYOUT.block_shape, dtype=torch.float32))
