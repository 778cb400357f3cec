"""Files an application may be handed: each is refused at load with a GGUFError that names the
problem, quickly, and as text."""

import os
import subprocess
import sys

import pytest

import ggraph
from ggraph import _core


def _patched(src, dst, old: bytes, new: bytes):
    data = open(src, "rb").read()
    assert data.count(old) == 1 and len(old) == len(new)
    open(dst, "wb").write(data.replace(old, new))
    return str(dst)


def _write_llama(path, **meta):
    """A tiny llama file through gguf-py, with metadata entries replaced or added."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    src = gguf.GGUFReader(os.fspath(meta.pop("_base")))
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    for field in src.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture" or name in meta:
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), vt)
    for name, value in meta.items():
        if value is not None:
            w.add_string(name, value)
    for t in src.tensors:
        plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(t.name, np.array(t.data), raw_dtype=None if plain else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    code = (
        "import ggraph, sys\n"
        "try:\n"
        f"    ggraph.Model({str(fifo)!r}, device='cpu')\n"
        "except ggraph.GGUFError as e:\n"
        "    print(e)\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "not a regular file" in out.stdout


def test_a_key_that_is_not_utf8_is_a_gguf_error_shown_escaped(tmp_path, tiny_model):
    bad = _patched(tiny_model, tmp_path / "key.gguf", b"general.name", b"general.n\xffme")
    for load in (ggraph.read_metadata, lambda p: ggraph.Model(p, device="cpu")):
        with pytest.raises(ggraph.GGUFError, match=r"general\.n\\xffme.*not valid UTF-8"):
            load(bad)


def test_a_tensor_name_that_is_not_utf8_is_a_gguf_error(tmp_path, tiny_model):
    bad = _patched(
        tiny_model, tmp_path / "name.gguf", b"output_norm.weight", b"output_norm.w\xe9ight"
    )
    with pytest.raises(ggraph.GGUFError, match=r"output_norm\.w\\xe9ight"):
        ggraph.Model(bad, device="cpu")


def test_overlapping_tensor_data_is_refused(tmp_path, tiny_model):
    import struct

    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(tiny_model)
    second = r.tensors[1]
    # The second tensor's data offset field, pointed back at the first tensor's data.
    field = second.field.parts[-1]
    at = int(field.ctypes.data - r.data.ctypes.data)
    data = bytearray(open(tiny_model, "rb").read())
    data[at : at + 8] = struct.pack("<Q", 0)
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ggraph.GGUFError, match=r"data offset 0, expected \d+"):
        ggraph.Model(str(bad), device="cpu")


def test_a_broken_tokenizer_fails_the_load(tmp_path, tiny_model):
    bad = _write_llama(tmp_path / "tok.gguf", _base=tiny_model, **{"tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ggraph.GGUFError, match="mystery"):
        ggraph.Model(bad, device="cpu")


def test_a_file_without_a_tokenizer_loads_and_says_so_when_asked(tmp_path, tiny_model):
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(tiny_model)
    tok_keys = {k: None for k in r.fields if k.startswith("tokenizer.")}
    plain = _write_llama(tmp_path / "plain.gguf", _base=tiny_model, **tok_keys)
    m = ggraph.Model(plain, device="cpu", n_ctx=32)
    assert m.eval([1, 2]).shape == (m.n_vocab,)
    with pytest.raises(ggraph.GGUFError, match="no tokenizer"):
        m.tokenize("hello")


def test_use_mmap_false_reads_the_file_and_survives_its_truncation(tmp_path, tiny_model):
    import shutil

    import numpy as np

    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_model, copy)
    read = ggraph.Model(str(copy), device="cpu", n_ctx=32, use_mmap=False)
    mapped = ggraph.Model(tiny_model, device="cpu", n_ctx=32)
    np.testing.assert_array_equal(read.eval([1, 2, 3]), mapped.eval([1, 2, 3]))
    os.truncate(copy, 100)  # the file on disk changes; the read model does not notice
    read.reset()
    mapped.reset()
    np.testing.assert_array_equal(read.eval([1, 2, 3]), mapped.eval([1, 2, 3]))
    assert read.tokenize("hello") == mapped.tokenize("hello")


def _tiny_llama(path, meta_edit=None, tensor_edit=None):
    """A tiny F32 llama through ggraph.testing's own layout, its metadata and tensors edited."""
    import numpy as np

    from ggraph import testing as T

    shape = T.resolve_shape("tiny", weight_type="F32")
    meta = T.llama_metadata(shape, "tiny", "F32")
    rng = np.random.default_rng(0)
    tensors = {
        n: T.Tensor(n, (0.1 * rng.standard_normal(int(np.prod(s)))).astype(np.float32), t, s)
        for n, t, s in T.llama_tensor_layout(shape)
    }
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors)
    T.write_gguf(str(path), meta, list(tensors.values()))
    return str(path)


def test_tensors_the_architecture_does_not_read_are_refused(tmp_path):
    """Layers past block_count, or a tensor of a form the architecture does not read, would be
    silently left out of the model."""
    import numpy as np

    from ggraph.testing import Tensor, Typed

    fewer = _tiny_llama(
        tmp_path / "fewer.gguf",
        meta_edit=lambda m: m.update({"llama.block_count": Typed("uint32", 1)}),
    )

    def extra(t):
        t["blk.0.attn_qkv.weight"] = Tensor(
            "blk.0.attn_qkv.weight", np.zeros(64 * 128, np.float32), "F32", [64, 128]
        )

    for path, name in (
        (fewer, "blk.1."),
        (_tiny_llama(tmp_path / "x.gguf", tensor_edit=extra), "blk.0.attn_qkv"),
    ):
        with pytest.raises(ggraph.GGUFError, match=f"tensor '{name}.*not used"):
            ggraph.Model(path, device="cpu", n_ctx=64, n_threads=1)
        assert "not used" in _core.check_model_file(path)


def test_a_vocabulary_of_another_size_than_the_embedding_is_refused(tmp_path):
    from ggraph.testing import Typed

    def fewer(m):
        del m["llama.vocab_size"]
        for key, kind in (
            ("tokenizer.ggml.tokens", "string"),
            ("tokenizer.ggml.token_type", "int32"),
        ):
            m[key] = Typed("array", m[key].value[:300], kind)

    path = _tiny_llama(tmp_path / "v.gguf", meta_edit=fewer)
    with pytest.raises(ggraph.GGUFError, match="300 tokens but token_embd.weight has 320 rows"):
        ggraph.Model(path, device="cpu", n_ctx=64, n_threads=1)


def test_rope_scaling_reads_as_llama_cpp_reads_it(tmp_path):
    """A factor without a type is linear, and the older rope.scale_linear key is its factor."""
    import numpy as np

    from ggraph.testing import Typed

    def logits(name, keys):
        path = _tiny_llama(tmp_path / f"{name}.gguf", meta_edit=lambda m: m.update(keys))
        m = ggraph.Model(path, device="cpu", n_ctx=64, n_threads=1)
        return m.eval(list(range(1, 30)), all_logits=True)

    four = Typed("float32", 4.0)
    plain = logits("plain", {})
    linear = logits(
        "linear", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": four}
    )
    assert not np.array_equal(plain, linear)
    np.testing.assert_array_equal(logits("untyped", {"llama.rope.scaling.factor": four}), linear)
    np.testing.assert_array_equal(logits("old", {"llama.rope.scale_linear": four}), linear)


def test_rope_freqs_must_be_finite_and_positive(tmp_path):
    import numpy as np

    from ggraph.testing import Tensor

    for values in (np.zeros(8, np.float32), np.full(8, -1.0, np.float32)):

        def freqs(t, values=values):
            t["rope_freqs.weight"] = Tensor("rope_freqs.weight", values, "F32", [8])

        path = _tiny_llama(tmp_path / "f.gguf", tensor_edit=freqs)
        with pytest.raises(ggraph.GGUFError, match="rope_freqs.weight.*finite positive"):
            ggraph.Model(path, device="cpu", n_ctx=64, n_threads=1)


def test_a_chat_template_that_is_not_text_is_a_clear_error(tmp_path):
    from ggraph.testing import Typed

    path = _tiny_llama(
        tmp_path / "t.gguf",
        meta_edit=lambda m: m.update({"tokenizer.chat_template": Typed("uint32", 7)}),
    )
    m = ggraph.Model(path, device="cpu", n_ctx=64, n_threads=1)
    with pytest.raises(ValueError, match="chat_template: expected a string"):
        list(m.chat([{"role": "user", "content": "hi"}], max_tokens=2))


def test_a_mixture_of_experts_file_says_so_and_info_shows_malformed_fields(tmp_path):
    from ggraph.testing import Typed

    path = _tiny_llama(
        tmp_path / "moe.gguf",
        meta_edit=lambda m: m.update({"llama.expert_count": Typed("uint32", 4)}),
    )
    with pytest.raises(ggraph.GGUFError, match="mixture-of-experts"):
        ggraph.Model(path, device="cpu", n_ctx=64, n_threads=1)
    odd = _tiny_llama(
        tmp_path / "odd.gguf",
        meta_edit=lambda m: m.update(
            {
                "general.architecture": Typed("array", ["llama", "x"], "string"),
                "tokenizer.chat_template": Typed("uint32", 7),
            }
        ),
    )
    r = subprocess.run(
        [sys.executable, "-m", "ggraph", "info", odd], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "chat template:  no (int" in r.stdout and "runs in ggraph: no" in r.stdout
