"""The GGUF reader: agreement with gguf-py on the demo file, round trips, big-endian, v2."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType

from llmdoctor.gguf import GGUFError, StringArray, open_gguf

from gguf_builders import ARRAYS, SCALARS, all_quant_types, raw_tensor, set_version, write_file


@pytest.fixture(scope="module")
def demo_pair(demo_path):
    """Our reader and gguf-py's (the oracle; it takes ~20 s to open the demo file)."""
    ours = open_gguf(demo_path)
    yield ours, GGUFReader(demo_path, "r")
    ours.close()


@pytest.mark.slow
def test_demo_tensors_match_gguf_py(demo_pair):
    ours, ref = demo_pair
    assert len(ours.tensors) == len(ref.tensors) == 236
    for t, r in zip(ours.tensors, ref.tensors):
        assert t.name == r.name
        assert t.type == r.tensor_type
        assert t.ne == tuple(int(x) for x in r.shape)  # gguf-py's ReaderTensor.shape is GGUF order
        assert t.shape == tuple(reversed(t.ne))
        assert t.n_elements == r.n_elements
        assert t.nbytes == r.n_bytes
        assert t.offset == r.data_offset
    # bytes: spot-check the first, the last and a quantized middle tensor byte for byte
    for i in (0, len(ours.tensors) // 2, len(ours.tensors) - 1):
        assert np.array_equal(ours.tensors[i].data, ref.tensors[i].data.reshape(-1).view(np.uint8))


def test_demo_metadata_matches_gguf_py(demo_pair):
    ours, ref = demo_pair
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, f in ours.fields.items():
        rf = ref.fields[key]
        assert f.type == rf.types[0]
        expected = rf.contents()
        if isinstance(f.value, StringArray):
            assert len(f.value) == len(expected)
            for i in sorted({0, len(expected) // 2, len(expected) - 1}):
                assert f.value[i] == expected[i]
        elif isinstance(f.value, np.ndarray):
            assert np.array_equal(f.value, np.asarray(expected))
        elif isinstance(f.value, float):
            assert f.value == pytest.approx(expected, rel=0, abs=0)
        else:
            assert f.value == expected


def test_demo_views_are_read_only_and_zero_copy(demo_path):
    with open_gguf(demo_path) as g:
        t = g.tensor("token_embd.weight")
        view = t.data
        assert view.dtype == np.uint8 and view.size == t.nbytes
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = 1
        assert not view.flags.owndata  # a view of the mmap, not a copy
        with pytest.raises(GGUFError, match="no tensor named"):
            g.tensor("nope")


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 4096])
def test_round_trip_every_value_and_ggml_type(tmp_path, alignment):
    rng = np.random.default_rng(0)
    tensors = {}
    for q in all_quant_types():
        ne = (256 if q not in (Q.NVFP4, Q.Q1_0) else 512, 3)
        tensors[f"t.{q.name}"] = (q, ne, raw_tensor(q, ne, rng))
    tensors["t.f32_3d"] = (Q.F32, (5, 3, 2), rng.standard_normal(30).astype(np.float32))
    tensors["t.f16_4d"] = (Q.F16, (4, 3, 2, 2), rng.standard_normal(48).astype(np.float16))
    path = write_file(tmp_path / "rt.gguf", tensors=tensors, alignment=alignment)
    with open_gguf(path) as g:
        assert g.version == 3 and g.byte_order == "<"
        assert g.alignment == (alignment or 32)
        for key, (val, vt) in SCALARS.items():
            f = g.fields[key]
            assert f.type == vt
            assert f.value == (pytest.approx(val) if vt == GGUFValueType.FLOAT32 else val)
        for key, (val, vt) in ARRAYS.items():
            f = g.fields[key]
            assert f.type == GGUFValueType.ARRAY and f.element_type == vt and f.count == len(val)
            got = f.value.tolist()
            assert got == (pytest.approx(val) if vt == GGUFValueType.FLOAT32 else val)
        assert [t.name for t in g.tensors] == list(tensors)
        for t in g.tensors:
            q, ne, data = tensors[t.name]
            assert t.type == q and t.ne == ne and t.offset % g.alignment == 0
            assert np.array_equal(t.data, data.reshape(-1).view(np.uint8))
        assert np.array_equal(g.tensor("t.f32_3d").numpy(), tensors["t.f32_3d"][2].reshape(2, 3, 5))


def test_version_2_is_read(tmp_path):
    path = write_file(tmp_path / "v2.gguf", tensors={"w": (Q.F32, (32,), np.arange(32, dtype=np.float32))})
    set_version(path, 2)
    with open_gguf(path) as g:
        assert g.version == 2
        assert g.tensor("w").numpy().tolist() == list(range(32))


def test_big_endian_metadata_and_float_tensors(tmp_path):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal(64).astype(np.float32)
    f16 = rng.standard_normal(64).astype(np.float16)
    path = write_file(
        tmp_path / "be.gguf",
        big_endian=True,
        tensors={
            "w32": (Q.F32, (64,), f32),
            "w16": (Q.F16, (32, 2), f16),
            "wq": (Q.Q4_K, (256,), raw_tensor(Q.Q4_K, (256,), rng)),
        },
    )
    with open_gguf(path) as g:
        assert g.byte_order == ">"
        assert g.version == 3
        for key, (val, vt) in SCALARS.items():
            assert g.fields[key].value == (pytest.approx(val) if vt == GGUFValueType.FLOAT32 else val)
        assert g.fields["a.i32"].value.tolist() == [7, -8]
        assert g.fields["a.str"].value.tolist() == ARRAYS["a.str"][0]
        assert np.array_equal(g.tensor("w32").numpy(), f32)
        assert np.array_equal(g.tensor("w16").numpy().reshape(-1), f16)
        wq = g.tensor("wq")
        assert not wq.supported
        with pytest.raises(GGUFError, match="Q4_K in a big-endian file is unsupported"):
            wq.data


def test_big_endian_version_2(tmp_path):
    path = write_file(tmp_path / "be2.gguf", big_endian=True, metadata=False,
                      tensors={"w": (Q.F32, (32,), np.ones(32, np.float32))})
    set_version(path, 2, big_endian=True)
    with open_gguf(path) as g:
        assert (g.version, g.byte_order) == (2, ">")


def test_not_a_file_and_empty_file(tmp_path):
    with pytest.raises(GGUFError, match="not a regular file"):
        open_gguf(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty file"):
        open_gguf(tmp_path / "empty.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        open_gguf(tmp_path / "missing.gguf")


def test_file_is_never_written(tmp_path):
    path = write_file(tmp_path / "ro.gguf", tensors={"w": (Q.F32, (32,), np.ones(32, np.float32))})
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    with open_gguf(path) as g:
        _ = [t.data.sum() for t in g.tensors]
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
