"""raylm's one-pass GGUF reader gives what the gguf package's reader gives: every metadata
value type, string and numeric arrays, plain and quantized tensors (data and layout)."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.runner.loading.gguf_file import GGUFFile, open_gguf


def _write(path: str) -> str:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁world")
    w.add_array("t.strs", ["a", "", "ŋ▁x", "<s>"] * 50)
    w.add_array("t.ints", list(range(-3, 300)))
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("half", np.arange(64, dtype=np.float16).reshape(2, 32))
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("q8", rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_fields_and_tensors_equal_the_gguf_packages_reader(tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = _write(str(tmp_path / "all.gguf"))
    ours, ref = GGUFFile(path), GGUFReader(path)
    header = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the reader's own
    assert list(ours.fields) == [k for k in ref.fields if k not in header]
    for key in ours.fields:
        field = ref.fields[key]
        want = field.contents()
        assert ours.fields[key] == pytest.approx(want) if isinstance(want, float) \
            else ours.fields[key] == want, key
    assert ours.fields["t.strs"][2] == "ŋ▁x" and ours.fields["t.u64"] == 1 << 40
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert t.tensor_type == r.tensor_type and t.shape == tuple(int(d) for d in r.shape)
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data, r.data), t.name
        assert np.array_equal(dequantize(t.data, t.tensor_type),
                              dequantize(r.data, r.tensor_type), equal_nan=True), t.name
    assert open_gguf(path) is open_gguf(path)  # parsed once while unchanged


def test_not_a_gguf_file_and_a_truncated_one_are_named(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
    path = _write(str(tmp_path / "t.gguf"))
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="'q8' runs past the end"):
        GGUFFile(str(cut))
