"""Saving and loading a context's state: a restored conversation continues exactly as the
original would, and a state that does not belong is refused without changing anything."""

import ctypes
import os

import numpy as np
import pytest
from capi import load_library, params
from conftest import cuda_available

import ggraph


@pytest.fixture
def model(tiny_model):
    return ggraph.Model(tiny_model, device="auto", n_ctx=128)


def test_a_restored_state_continues_exactly(model, tiny_model, tmp_path):
    model.eval([1, 5, 9, 13, 2, 7])
    state = model.save_state()
    expected = model.eval([3, 4])
    other = ggraph.Model(tiny_model, device="auto", n_ctx=128)
    other.eval([2, 2, 2, 2, 2, 2, 2, 2, 2])  # different content, overwritten by the load
    other.load_state(state)
    assert other.n_past == 6 and other._tokens == [1, 5, 9, 13, 2, 7]
    np.testing.assert_array_equal(other.eval([3, 4]), expected)
    # Through a file, and into the same model after it moved on.
    model.save_state(tmp_path / "s.bin")
    model.reset()
    model.load_state(tmp_path / "s.bin")
    assert model._tokens == [1, 5, 9, 13, 2, 7, 3, 4]
    a = "".join(model.generate(model._tokens + [5], max_tokens=6, temperature=0))
    other.reset()
    b = "".join(other.generate([1, 5, 9, 13, 2, 7, 3, 4, 5], max_tokens=6, temperature=0))
    assert a == b


def test_states_that_do_not_belong_are_refused(model, tiny_models):
    model.eval([1, 2, 3])
    good = model.save_state()
    model.eval([4])
    before = (model.n_past, model._tokens)
    bad = [
        (b"", "too few"),
        (b"XXXX" + good[4:], "not a ggraph state"),
        (good[:-1], "bytes"),
        (good + b"\0", "bytes"),
        (good[:4] + (99).to_bytes(4, "little") + good[8:], "version"),
    ]
    small = ggraph.Model(model.path, device="auto", n_ctx=2)
    for data, match in bad:
        with pytest.raises(ValueError, match=match):
            model.load_state(data)
        assert (model.n_past, model._tokens) == before
    with pytest.raises(ValueError, match="another model file"):
        ggraph.Model(tiny_models["Q8_0"], device="auto", n_ctx=128).load_state(good)
    with pytest.raises(ValueError, match="holds 3 tokens"):
        small.load_state(good)


def test_a_state_of_a_file_with_the_same_layout_and_other_weights_is_refused(model, tmp_path):
    """A fine-tune has its base model's tensor table and size: its weights tell them apart."""
    from ggraph.testing import write_random_gguf

    tuned = str(tmp_path / "tuned.gguf")
    write_random_gguf(tuned, shape="tiny", weight_type="Q4_1", seed=2)
    assert os.path.getsize(tuned) == os.path.getsize(model.path)
    model.eval([1, 2, 3])
    other = ggraph.Model(tuned, device="auto", n_ctx=128)
    other.eval([4, 5])
    with pytest.raises(ValueError, match="another model file"):
        other.load_state(model.save_state())
    assert other._tokens == [4, 5]
    # The same file loaded again is the same model.
    again = ggraph.Model(model.path, device="auto", n_ctx=128)
    again.load_state(model.save_state())
    assert again._tokens == [1, 2, 3]


def _table_fingerprint(path):
    """The model's name in states of format versions 1 and 2: FNV-1a over the file's size and,
    per tensor, its name, four dimensions (int64) and type id (uint32)."""
    from gguf import GGUFReader

    h = 1469598103934665603

    def mix(data):
        nonlocal h
        for b in data:
            h = ((h ^ b) * 1099511628211) % (1 << 64)

    mix(os.path.getsize(path).to_bytes(8, "little"))
    for t in GGUFReader(path).tensors:
        ne = [int(d) for d in t.shape] + [1] * (4 - len(t.shape))
        mix(t.name.encode())
        mix(b"".join(d.to_bytes(8, "little") for d in ne))
        mix(int(t.tensor_type).to_bytes(4, "little"))
    return h


def test_states_of_format_version_2_still_load(model):
    model.eval([1, 5, 9])
    state = model.save_state()
    assert int.from_bytes(state[4:8], "little") == 3
    # The same state as version 2 wrote it: the model named by its tensor table alone.
    v2 = (
        state[:4] + (2).to_bytes(4, "little") + _table_fingerprint(model.path).to_bytes(8, "little")
    )
    other = ggraph.Model(model.path, device="auto", n_ctx=128)
    other.load_state(v2 + state[16:])
    assert other._tokens == [1, 5, 9]
    np.testing.assert_array_equal(other.eval([3]), model.eval([3]))
    with pytest.raises(ValueError, match="another model file"):  # a version 2 name it is not
        other.load_state(state[:4] + (2).to_bytes(4, "little") + state[8:])


def test_state_files_that_could_not_be_states_are_refused_unread(model, tmp_path):
    """A path to a device (bytes without end) or to a file larger than any state of this
    context is refused before it is read."""
    model.eval([1, 2, 3])
    with pytest.raises(ValueError, match="not a regular file"):
        model.load_state("/dev/zero")
    big = tmp_path / "big.state"
    with open(big, "wb") as f:
        f.truncate(model._ctx.max_state_bytes + 1)
    with pytest.raises(ValueError, match="at most"):
        model.load_state(big)
    assert model.n_past == 3
    model.save_state(tmp_path / "good.state")
    model.reset()
    model.load_state(tmp_path / "good.state")
    assert model._tokens == [1, 2, 3]


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU beside the CPU")
def test_a_state_moves_between_devices_with_its_kv_type_only(tiny_model):
    cpu = ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type="f32")
    cpu.eval([1, 2])
    gpu = ggraph.Model(tiny_model, device="cuda", n_ctx=64)
    with pytest.raises(ValueError, match="KV cache is F32"):
        gpu.load_state(cpu.save_state())
    # An F16 cache's rows are the same bytes on both: the GPU continues from the CPU's rows.
    half = ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type="f16")
    half.eval([1, 2])
    gpu.load_state(half.save_state())
    assert gpu.n_past == 2
    own = ggraph.Model(tiny_model, device="cuda", n_ctx=64)
    own.eval([1, 2])
    np.testing.assert_allclose(gpu.eval([3]), own.eval([3]), rtol=1e-2, atol=1e-2)


def test_c_api_state_round_trip(tiny_model):
    lib = load_library()
    err = ctypes.create_string_buffer(256)
    # The tiny model was trained (so it says) on 256 positions: the default 2048 is refused.
    m = lib.ggraph_load(tiny_model.encode(), ctypes.byref(params(lib, n_ctx=0)), err, 256)
    assert m, err.value
    try:
        ids = (ctypes.c_int32 * 3)(1, 2, 3)
        assert lib.ggraph_eval(m, ids, 3, None) == 0
        need = lib.ggraph_save_state(m, None, 0)
        buf = ctypes.create_string_buffer(need)
        assert lib.ggraph_save_state(m, buf, need) == need
        assert buf.raw[:4] == b"GGRS"
        lib.ggraph_eval(m, ids, 3, None)
        assert lib.ggraph_load_state(m, buf, need) == 0 and lib.ggraph_n_past(m) == 3
        assert lib.ggraph_load_state(m, buf, need - 1) == -2 and lib.ggraph_n_past(m) == 3
    finally:
        lib.ggraph_free(m)


def test_state_paths_are_paths_not_descriptors(model, tmp_path):
    """An int is not a path: open() would take it for a file descriptor, write the state there
    and close it."""
    with open(tmp_path / "other", "wb") as f:
        for call in (model.save_state, model.load_state):
            with pytest.raises(TypeError):
                call(f.fileno())
        f.write(b"still open")
