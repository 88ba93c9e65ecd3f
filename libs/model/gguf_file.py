"""GGUF files read in bulk: metadata as plain Python values, tensors as numpy views.

Why not ``gguf.GGUFReader`` alone: it builds a numpy view for every value of every field,
and SmolLM2's vocabulary (49,152 tokens, 48,900 merges) makes that 2.15 s of a 4.3-4.5 s
cold ``load_model`` on this project's CPU box (measured 2026-11-28; bench/RESULTS.md), paid
by every process that converts the GGUF or reads its tokenizer without the cache. ``read_gguf_file`` parses the same format
(GGUF v2/v3, little-endian) with one pass of ``struct`` over a memory map, in about 0.1 s.
It keeps what the library defines: the value and tensor types (``gguf.constants``), the
scalar dtypes (``GGUFReader.gguf_scalar_to_np``), the quantized blocks' byte shapes
(``gguf.quants``), and gives the values ``ReaderField.contents()`` gives and the tensors
``GGUFReader.tensors`` gives (name, GGML type, dims fastest-first, the same view of the
data), so ``gguf.quants.dequantize`` reads them as before. tests/unit/test_gguf_file.py
compares the two on the embedded model and on a file written with every value type. A
file this parser does not handle (big-endian, an array of arrays, another version) is
read by ``GGUFReader``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = 0x46554747  # "GGUF", little-endian
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFTensor(NamedTuple):
    """One tensor, as ``gguf.GGUFReader`` lists it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, fastest first
    data: np.ndarray  # a view of the mapped file: elements, or a quantized type's bytes


class GGUFFile(NamedTuple):
    metadata: dict[str, Any]  # every key/value field, as ``ReaderField.contents()``
    tensors: list[GGUFTensor]


class _Unsupported(Exception):
    """A valid file this parser leaves to ``GGUFReader``."""


def read_gguf_file(path: str | Path) -> GGUFFile:
    """``path``'s metadata and tensors (the tensors' data stays memory-mapped)."""
    try:
        return _parse(Path(path))
    except _Unsupported:
        return read_with_gguf_reader(path)


def read_with_gguf_reader(path: str | Path) -> GGUFFile:
    """The same through ``gguf.GGUFReader`` (the reference; the fallback)."""
    import gguf

    from libs.model.gguf_meta import gguf_metadata

    reader = gguf.GGUFReader(str(path))
    return GGUFFile(gguf_metadata(reader), [GGUFTensor(t.name, t.tensor_type, t.shape, t.data) for t in reader.tensors])


def _string(buf: memoryview, offs: int) -> tuple[str, int]:
    (n,) = _U64.unpack_from(buf, offs)
    offs += 8
    return str(buf[offs:offs + n], "utf-8"), offs + n


def _value(buf: memoryview, offs: int, vtype: int) -> tuple[Any, int]:
    from gguf.constants import GGUFValueType

    if vtype == GGUFValueType.STRING:
        return _string(buf, offs)
    if vtype == GGUFValueType.ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        if etype == GGUFValueType.STRING:
            items = []
            for _ in range(count):
                s, offs = _string(buf, offs)
                items.append(s)
            return items, offs
        if etype == GGUFValueType.ARRAY:
            raise _Unsupported("an array of arrays")
        dtype = _scalar_dtype(etype)
        return np.frombuffer(buf, dtype, count, offs).tolist(), offs + dtype.itemsize * count
    dtype = _scalar_dtype(vtype)
    return np.frombuffer(buf, dtype, 1, offs).tolist()[0], offs + dtype.itemsize


def _scalar_dtype(vtype: int) -> np.dtype:
    """The library's numpy type for a scalar value type, little-endian."""
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType

    nptype = GGUFReader.gguf_scalar_to_np.get(GGUFValueType(vtype))
    if nptype is None:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return np.dtype(nptype).newbyteorder("<")


def _parse(path: Path) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    buf = memoryview(data)
    magic, version = struct.unpack_from("<II", buf, 0)
    if magic != _MAGIC:
        raise ValueError(f"{path}: GGUF magic invalid")
    if version not in _VERSIONS:
        raise _Unsupported(f"version {version} (or a big-endian file)")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    offs = 24
    metadata: dict[str, Any] = {}
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, offs = _string(buf, offs)
        if key in metadata:
            raise KeyError(f"Duplicate {key} already in list")
        (vtype,) = _U32.unpack_from(buf, offs)
        value, offs = _value(buf, offs + 4, vtype)
        metadata[key] = value
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise ValueError("Bad type for general.alignment field")
            if value == 0 or value & (value - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
            alignment = value
    infos = []
    for _ in range(n_tensors):
        name, offs = _string(buf, offs)
        (n_dims,) = _U32.unpack_from(buf, offs)
        dims = np.frombuffer(buf, "<u8", n_dims, offs + 4).copy()
        offs += 4 + 8 * n_dims
        raw_type, tensor_offs = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        infos.append((name, dims, raw_type, tensor_offs))
    start = offs + (-offs % alignment)
    tensors, names = [], set()
    for name, dims, raw_type, tensor_offs in infos:
        if name in names:
            raise ValueError(f"Found duplicated tensor with name {name}")
        names.add(name)
        ggml_type = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims))
        np_dims = tuple(reversed(dims.tolist()))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        item_type = _PLAIN_TYPES.get(ggml_type.name)
        if item_type is None:  # quantized: its bytes, shaped as the reader shapes them
            item_type, count, np_dims = np.uint8, n_elems * type_size // block_size, quant_shape_to_byte_shape(np_dims, ggml_type)
        else:
            count = n_elems
        begin = start + tensor_offs
        view = data[begin:begin + np.dtype(item_type).itemsize * count].view(item_type)[:count]
        tensors.append(GGUFTensor(name, ggml_type, dims, view.reshape(np_dims)))
    return GGUFFile(metadata, tensors)


_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}
