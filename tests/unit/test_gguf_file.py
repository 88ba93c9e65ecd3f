"""libs/model/gguf_file.py against gguf.GGUFReader: the same metadata values (and Python
types) and the same tensors, on the embedded model and on files written here with every
value type; what the parser leaves to the reader still reads; a bad file is refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from libs.model import default_model_path
from libs.model.gguf_file import _parse, read_gguf_file, read_with_gguf_reader


def assert_same(path) -> None:
    ours, ref = _parse(path), read_with_gguf_reader(path)
    assert list(ours.metadata) == list(ref.metadata)
    for key, value in ref.metadata.items():
        got = ours.metadata[key]
        assert got == value and type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name


def test_the_embedded_model_reads_as_gguf_reads_it():
    assert_same(default_model_path())


def write(path, alignment: int | None = None, nested: bool = False) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo, wörld ✓")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "Ġ t", "日本語"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.none", [])
    if nested:
        w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q4", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q4_0), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_reads_as_gguf_reads_it(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    write(path, alignment)
    assert_same(path)
    meta = read_gguf_file(path).metadata
    assert meta["t.str"] == "héllo, wörld ✓" and meta["t.strs"][3] == "日本語" and meta["t.u64"] == 2**63 + 5
    q8 = next(t for t in read_gguf_file(path).tensors if t.name == "q8")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (4, 64)


def test_an_array_of_arrays_is_left_to_the_reader(tmp_path):
    path = tmp_path / "nested.gguf"
    write(path, nested=True)
    got = read_gguf_file(path)  # the fallback
    ref = read_with_gguf_reader(path)
    assert got.metadata == ref.metadata and "t.nested" in got.metadata
    assert [t.name for t in got.tensors] == [t.name for t in ref.tensors]


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        read_gguf_file(path)
