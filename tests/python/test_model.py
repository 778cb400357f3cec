"""Model API, its errors, and logits against an independent numpy forward pass."""

import os

import numpy as np
import pytest
import reference

import ggraph


def cosine(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


# Relative L2 error allowed against the float64 reference: float weights are exact up to float32
# arithmetic; quantized weights meet 8-bit activations inside the dot products. The KV cache is
# F32 here, as the reference keeps its keys and values (an F16 cache adds about 2e-4).
BOUNDS = {"F32": 1e-4, "F16": 1e-4, "BF16": 1e-4, "Q8_0": 3e-2, "Q4_0": 3e-2, "Q4_1": 3e-2}


@pytest.mark.parametrize("wtype", list(BOUNDS))
def test_logits_match_numpy_reference_for_every_weight_type(tiny_models, wtype):
    path = tiny_models[wtype]
    tokens = [1, 17, 42, 3, 99, 5, 250, 0]
    ref = reference.forward(reference.load(path), np.array(tokens))
    m = ggraph.Model(path, device="cpu", n_ctx=64, kv_type="f32")
    got = m.eval(tokens, all_logits=True)
    assert got.shape == ref.shape
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < BOUNDS[wtype], f"{wtype}: relative error {err:.2e}"


def test_eval_shapes_and_n_past(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=32)
    assert (m.n_past, m.n_ctx) == (0, 32)
    last = m.eval([1, 2, 3])
    assert last.shape == (m.n_vocab,) and last.dtype == np.float32
    assert m.n_past == 3
    every = m.eval([4, 5], all_logits=True)
    assert every.shape == (2, m.n_vocab)
    assert m.n_past == 5
    m.reset()
    assert m.n_past == 0


def test_decoding_one_token_at_a_time_equals_one_prompt(tiny_model):
    tokens = [5, 9, 200, 31, 7, 7, 64]
    whole = ggraph.Model(tiny_model, device="cpu", n_ctx=32).eval(tokens, all_logits=True)
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=32)
    steps = np.stack([m.eval([t]) for t in tokens])
    np.testing.assert_allclose(steps, whole, rtol=1e-4, atol=1e-4)


def test_long_inputs_are_split_into_batches_without_changing_logits(tiny_model):
    tokens = np.random.default_rng(0).integers(0, 250, size=40).tolist()
    one = ggraph.Model(tiny_model, device="cpu", n_ctx=64).eval(tokens, all_logits=True)
    split = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_batch=7)
    np.testing.assert_allclose(split.eval(tokens, all_logits=True), one, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        split.eval([3]),
        ggraph.Model(tiny_model, device="cpu", n_ctx=64).eval(tokens + [3]),
        rtol=1e-4,
        atol=1e-4,
    )


def _state_unchanged_after(m, bad_call, probe=(11,)):
    """Runs a refused call, then checks n_past and the next logits are as if it never happened."""
    before = m.n_past
    with pytest.raises(ValueError) as info:
        bad_call()
    assert m.n_past == before
    after = m.eval(list(probe))
    return info.value, after


def test_bad_token_id_is_refused_and_changes_nothing(tiny_model):
    fresh = ggraph.Model(tiny_model, device="cpu", n_ctx=16)
    fresh.eval([1, 2])
    expected = fresh.eval([11])
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=16)
    m.eval([1, 2])
    for bad in ([1, m.n_vocab], [-1], [3, 2**40], [2**70]):
        err, after = _state_unchanged_after(m, lambda bad=bad: m.eval(bad))
        assert "token id" in str(err) or "range" in str(err)
        np.testing.assert_array_equal(after, expected)
        m.reset()
        m.eval([1, 2])


def test_empty_and_non_integer_inputs_are_refused(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=16)
    with pytest.raises(ValueError, match="empty"):
        m.eval([])
    with pytest.raises(ValueError):
        m.eval("hello")
    with pytest.raises(ValueError):
        m.eval([1.5])
    with pytest.raises(ValueError, match="flat"):
        m.eval(np.array([[1, 2]]))
    with pytest.raises(ValueError, match="found list"):
        m.eval([[1, 2]])
    with pytest.raises(ValueError, match="list of messages"):
        m.chat("hi")
    with pytest.raises(ValueError, match="position"):
        m.rewind(2**40)
    for kw in ("n_ctx", "n_batch", "n_threads", "n_seq_max"):
        with pytest.raises(ValueError, match=kw):
            ggraph.Model(tiny_model, device="cpu", **{kw: 2**31})
    assert m.n_past == 0


def test_context_overflow_is_refused_and_changes_nothing(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=8)
    m.eval([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="context"):
        m.eval([1, 2, 3])
    assert m.n_past == 6
    m.eval([7, 8])  # exactly fills it
    with pytest.raises(ValueError, match="context"):
        m.eval([9])
    assert m.n_past == 8


def test_bad_arguments(tiny_model):
    with pytest.raises(ValueError, match="device"):
        ggraph.Model(tiny_model, device="tpu")
    with pytest.raises(ValueError, match="cuda_graphs"):
        ggraph.Model(tiny_model, cuda_graphs="sometimes")
    with pytest.raises(FileNotFoundError):
        ggraph.Model("/nonexistent/model.gguf")


def test_malformed_files_raise_gguf_error(tmp_path, tiny_model):
    data = open(tiny_model, "rb").read()
    cases = {
        "garbage": b"not a gguf file at all" * 10,
        "truncated_header": data[:40],
        "truncated_data": data[: len(data) // 2],
        "empty": b"",
    }
    for name, blob in cases.items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        with pytest.raises(ggraph.GGUFError) as info:
            ggraph.Model(str(p), device="cpu")
        assert isinstance(info.value, ValueError)
        assert str(info.value), name


def test_missing_tensor_and_wrong_shape_are_named(tmp_path):
    from ggraph.testing import write_random_gguf

    p = str(tmp_path / "m.gguf")
    write_random_gguf(p, shape="tiny", weight_type="F32", seed=0)
    # Rewrite the file with one tensor renamed, through the independent gguf reader/writer.
    import gguf

    r = gguf.GGUFReader(p)
    names = [t.name for t in r.tensors]
    assert "blk.1.ffn_up.weight" in names
    blob = open(p, "rb").read()
    broken = blob.replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_xx.weight")
    q = tmp_path / "missing.gguf"
    q.write_bytes(broken)
    with pytest.raises(ggraph.GGUFError, match="blk.1.ffn_up.weight"):
        ggraph.Model(str(q), device="cpu")


def test_metadata_and_build_info(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=16)
    md = m.metadata
    assert md["general.architecture"] == "llama"
    assert isinstance(md["llama.block_count"], int)
    info = ggraph.build_info()
    assert set(info) >= {"version", "cuda_compiled", "cuda_archs", "cpu_features"}
    assert isinstance(info["cuda_compiled"], bool)


def test_n_threads_do_not_change_logits(tiny_model):
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    a = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=1).eval(tokens, all_logits=True)
    b = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=2).eval(tokens, all_logits=True)
    np.testing.assert_array_equal(a, b)


def test_default_model_path_points_at_the_package_or_says_how_to_install():
    try:
        path = ggraph.default_model_path()
    except FileNotFoundError as e:
        assert "pip install" in str(e)
    else:
        assert os.path.exists(path)


def test_eval_releases_the_gil(smollm2):
    import threading
    import time

    m = ggraph.Model(smollm2, device="cpu", n_ctx=512, n_threads=1)
    tokens = list(range(1000, 1300))
    t0 = time.perf_counter()
    m.eval(tokens)
    alone = time.perf_counter() - t0
    m.reset()
    ticks = 0
    worker = threading.Thread(target=m.eval, args=(tokens,))
    worker.start()
    while worker.is_alive():  # this loop can only run while eval does not hold the GIL
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert m.n_past == len(tokens)
    # Held GIL: the loop would run at most once or twice; released: about once per millisecond.
    assert ticks > 0.25 * alone * 1000, f"{ticks} ticks during an eval of {alone:.2f} s"
