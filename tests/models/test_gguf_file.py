"""Our GGUF parser (`conveyor.models.gguf_file`) reads what `gguf.GGUFReader` reads: every metadata value
type, arrays of strings and numbers, tensors of float and block types, in the same numpy layout."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from conveyor.models.gguf_file import GGUFFile
from conveyor.models.loader import ModelLoadError, load_checkpoint


def _write(path: Path) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁wörld")
    writer.add_array("t.strings", ["a", "", "▁b", "<|im_end|>"] * 50)
    writer.add_array("t.ints", list(range(-5, 300)))
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.bools", [True, False, True])
    writer.add_tensor("f32", rng.standard_normal((3, 5, 7)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16):
        data = gguf.quants.quantize(rng.standard_normal((6, 64)).astype(np.float32), kind)
        writer.add_tensor(kind.name.lower(), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_reads_what_ggufreader_reads(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its header, as fields
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert ours.metadata[key] == field.contents(), key
    assert ours.metadata["t.strings"][:4] == ["a", "", "▁b", "<|im_end|>"] and ours.metadata["t.u64"] == 2**63
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == ref.tensor_type and mine.shape.tolist() == ref.shape.tolist(), ref.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, ref.name
        assert np.array_equal(mine.data, ref.data), ref.name


@pytest.mark.parametrize("cut", [0.5, 0.02])
def test_a_truncated_file_is_not_a_valid_gguf(tmp_path: Path, cut: float) -> None:
    """Cut in the tensor data or in the metadata: a clear error naming the file, not an IndexError."""
    data = _write(tmp_path / "all.gguf").read_bytes()
    (path := tmp_path / "cut.gguf").write_bytes(data[:int(len(data) * cut)])
    with pytest.raises(ModelLoadError, match="Not a valid GGUF file") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
