"""The C API, used as an embedding application would: through the shared library."""

import ctypes
import threading
import time

import numpy as np
import pytest
from capi import Sampling, load_library, params
from capi import ids as _ids
from conftest import cuda_available

import ggraph

DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])


@pytest.fixture(scope="module")
def lib():
    return load_library()


def test_c_api_eval_matches_python_and_refuses_bad_input(lib, tiny_model):
    p = params(lib, device=b"cpu", n_ctx=32, n_threads=1)
    err = ctypes.create_string_buffer(256)
    m = lib.ggraph_load(tiny_model.encode(), ctypes.byref(p), err, 256)
    assert m, err.value
    try:
        n_vocab = lib.ggraph_n_vocab(m)
        logits = (ctypes.c_float * n_vocab)()
        assert lib.ggraph_eval(m, _ids([1, 2, 3]), 3, logits) == 0
        expected = ggraph.Model(tiny_model, device="cpu", n_ctx=32).eval([1, 2, 3])
        np.testing.assert_allclose(np.frombuffer(logits, dtype=np.float32), expected, rtol=1e-6)
        assert lib.ggraph_n_past(m) == 3

        assert lib.ggraph_eval(m, _ids([n_vocab]), 1, logits) == -2  # GGRAPH_ERR_ARGUMENT
        assert b"outside" in lib.ggraph_last_error(m)
        assert lib.ggraph_n_past(m) == 3

        greedy = Sampling(0.0, 0, 1.0, 0.0, 1.0, 1)
        tok = lib.ggraph_sample(m, ctypes.byref(greedy))
        assert tok == int(np.argmax(expected))

        lib.ggraph_reset(m)
        assert lib.ggraph_n_past(m) == 0
        assert lib.ggraph_eval(m, _ids([0] * 40), 40, logits) == -2  # context of 32
        assert b"context" in lib.ggraph_last_error(m)
    finally:
        lib.ggraph_free(m)


def test_c_api_load_error_message(lib, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    err = ctypes.create_string_buffer(256)
    assert not lib.ggraph_load(str(bad).encode(), None, err, 256)
    assert err.value


def _load(lib, path, n_ctx=256, graphs=b"patch"):
    err = ctypes.create_string_buffer(256)
    p = params(lib, device=b"cpu", n_ctx=n_ctx, n_threads=1, cuda_graphs=graphs)
    m = lib.ggraph_load(path.encode(), ctypes.byref(p), err, 256)
    return m, err.value


def test_c_api_calls_from_two_threads_are_serialized(lib, tiny_model):
    m, err = _load(lib, tiny_model)
    assert m, err
    try:
        n_vocab = lib.ggraph_n_vocab(m)
        failures = []

        def worker(first):
            logits = (ctypes.c_float * n_vocab)()
            for i in range(60):
                if lib.ggraph_eval(m, _ids([(first + i) % n_vocab]), 1, logits) != 0:
                    failures.append(lib.ggraph_last_error(m))

        threads = [threading.Thread(target=worker, args=(s,)) for s in (3, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert lib.ggraph_n_past(m) == 120
    finally:
        lib.ggraph_free(m)


def test_c_api_last_error_is_the_calling_threads(lib, tiny_model):
    m, err = _load(lib, tiny_model)
    assert m, err
    try:
        n_vocab = lib.ggraph_n_vocab(m)
        logits = (ctypes.c_float * n_vocab)()
        assert lib.ggraph_eval(m, _ids([n_vocab + 5]), 1, logits) == -2
        seen = []

        def other():
            seen.append(lib.ggraph_last_error(m))
            assert lib.ggraph_eval(m, _ids([1]), 1, logits) == 0
            seen.append(lib.ggraph_last_error(m))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == [b"", b""]
        assert b"outside" in lib.ggraph_last_error(m)  # this thread's failure, still
    finally:
        lib.ggraph_free(m)


def test_c_api_checks_sizes_before_reading_buffers(lib, tiny_model):
    m, err = _load(lib, tiny_model, n_ctx=32)
    assert m, err
    try:
        one = _ids([1])
        # A count far past the one-element buffer: refused for the context's size, not read.
        assert lib.ggraph_eval(m, one, 1 << 40, None) == -2
        assert b"do not fit" in lib.ggraph_last_error(m)
        assert lib.ggraph_n_past(m) == 0
        out = (ctypes.c_int32 * 4)()
        assert lib.ggraph_tokenize(m, b"hi", ctypes.c_size_t(-1).value, 0, 0, out, 4) == -2
        assert b"bytes of text" in lib.ggraph_last_error(m)
    finally:
        lib.ggraph_free(m)


def test_c_api_refuses_unknown_options(lib, tiny_model):
    m, err = _load(lib, tiny_model, graphs=b"bogus")
    assert not m
    assert b"cuda_graphs" in err and b"bogus" in err
    err = ctypes.create_string_buffer(256)
    bad_threads = params(lib, device=b"cpu", n_ctx=32, n_threads=100000)
    assert not lib.ggraph_load(tiny_model.encode(), ctypes.byref(bad_threads), err, 256)
    assert b"n_threads" in err.value and b"1024" in err.value


def test_c_api_cancel_stops_a_long_input_from_another_thread(lib, smollm2):
    m, err = _load(lib, smollm2, n_ctx=2048)
    assert m, err
    try:
        assert lib.ggraph_eval(m, _ids([1, 2]), 2, None) == 0
        done = threading.Event()

        def canceller():
            while not done.is_set():
                lib.ggraph_cancel(m)
                done.wait(0.01)

        t = threading.Thread(target=canceller)
        t.start()
        try:
            # 1500 tokens run as chunks of 512: the cancel lands before the second.
            rc = lib.ggraph_eval(m, _ids([100 + i % 1000 for i in range(1500)]), 1500, None)
        finally:
            done.set()
            t.join()
        assert rc == -5  # GGRAPH_ERR_CANCELLED
        assert b"cancelled" in lib.ggraph_last_error(m)
        assert lib.ggraph_n_past(m) == 2
        assert lib.ggraph_eval(m, _ids([3]), 1, None) == 0
        assert lib.ggraph_n_past(m) == 3
    finally:
        lib.ggraph_free(m)


@pytest.mark.parametrize("device", DEVICES)
def test_c_api_sessions_are_models_of_their_own_over_one_load(lib, tiny_model, device):
    # Against single-sequence models of the same device and n_ctx (CUDA's attention splits
    # follow it).
    p = params(lib, device=device.encode(), n_ctx=64, n_threads=1, n_seq_max=3)
    err = ctypes.create_string_buffer(256)
    m = lib.ggraph_load(tiny_model.encode(), ctypes.byref(p), err, 256)
    assert m, err.value
    n_vocab = lib.ggraph_n_vocab(m)

    def ev(h, ids):
        out = (ctypes.c_float * n_vocab)()
        assert lib.ggraph_eval(h, (ctypes.c_int32 * len(ids))(*ids), len(ids), out) == 0
        return np.array(out)

    s1 = lib.ggraph_session_open(m)
    s2 = lib.ggraph_session_open(m)
    assert s1 and s2
    assert not lib.ggraph_session_open(m)
    assert b"all 3 sequences" in lib.ggraph_last_error(m)
    alone = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1)
    want = [alone.eval([5, 6, 7]), alone.eval([8])]
    got_m = ev(m, [9, 10])
    got = [ev(s1, [5, 6, 7])]
    ev(s2, [1])
    got.append(ev(s1, [8]))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert (lib.ggraph_n_past(m), lib.ggraph_n_past(s1), lib.ggraph_n_past(s2)) == (2, 4, 1)
    lib.ggraph_free(m)  # the sessions keep the weights
    np.testing.assert_array_equal(ev(s1, [3]), alone.eval([3]))
    lib.ggraph_free(s2)
    s3 = lib.ggraph_session_open(s1)  # s2's sequence, free again
    assert s3 and lib.ggraph_n_past(s3) == 0
    lib.ggraph_free(s3)
    lib.ggraph_free(s1)
    other = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1)
    np.testing.assert_array_equal(got_m, other.eval([9, 10]))


def test_c_api_copy_prefix_starts_a_session_from_anothers_tokens(lib, tiny_model):
    p = params(lib, device=b"cpu", n_ctx=64, n_threads=1, n_seq_max=3)
    err = ctypes.create_string_buffer(256)
    m = lib.ggraph_load(tiny_model.encode(), ctypes.byref(p), err, 256)
    assert m, err.value
    other = lib.ggraph_load(tiny_model.encode(), ctypes.byref(p), err, 256)
    s = lib.ggraph_session_open(m)
    try:
        n_vocab = lib.ggraph_n_vocab(m)
        prompt = [5, 17, 42, 8, 99, 3]
        assert lib.ggraph_eval(m, _ids(prompt), len(prompt), None) == 0
        assert lib.ggraph_eval(s, _ids([1, 2]), 2, None) == 0
        # Refused: itself, another model's sequence, past the source's tokens; nothing changes.
        assert lib.ggraph_copy_prefix(s, s, 1) == -2
        assert lib.ggraph_copy_prefix(s, other, 1) == -2
        assert b"same model" in lib.ggraph_last_error(s)
        assert lib.ggraph_copy_prefix(s, m, 7) == -2
        assert lib.ggraph_n_past(s) == 2
        assert lib.ggraph_copy_prefix(s, m, 4) == 0
        assert lib.ggraph_n_past(s) == 4
        out = (ctypes.c_float * n_vocab)()
        assert lib.ggraph_eval(s, _ids([9]), 1, out) == 0
        alone = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=1)
        alone.eval(prompt[:4])
        np.testing.assert_array_equal(np.array(out), alone.eval([9]))
    finally:
        for h in (s, m, other):
            lib.ggraph_free(h)


def test_c_api_decode_batch_equals_each_sequences_own_step(lib, tiny_model):
    """One step of a model and two sessions through ggraph_decode_batch: each row is that
    sequence's own next step, each samples from its own row, and a refused batch changes
    nothing."""
    p = params(lib, device=b"cpu", n_ctx=64, n_threads=1, n_seq_max=3)
    err = ctypes.create_string_buffer(256)
    m = lib.ggraph_load(tiny_model.encode(), ctypes.byref(p), err, 256)
    assert m, err.value
    other = lib.ggraph_load(tiny_model.encode(), ctypes.byref(p), err, 256)
    s1, s2 = lib.ggraph_session_open(m), lib.ggraph_session_open(m)
    try:
        n_vocab = lib.ggraph_n_vocab(m)
        prompts, tokens = [[1, 2, 3], [4, 5], [6]], [7, 8, 9]
        for h, pr in zip((m, s1, s2), prompts):
            assert lib.ggraph_eval(h, _ids(pr), len(pr), None) == 0

        def batch(handles, toks, logits=None):
            seqs = (ctypes.c_void_p * len(handles))(*handles)
            return lib.ggraph_decode_batch(seqs, _ids(toks), len(toks), logits)

        # Refused batches: the same sequence twice, another model's sequence, a bad token id,
        # an empty batch.
        assert batch([m, m], [1, 2]) == -2
        assert b"appears twice" in lib.ggraph_last_error(m)
        assert batch([m, other], [1, 2]) == -2
        assert b"not of the first one's model" in lib.ggraph_last_error(m)
        assert batch([m, s1, s2], [1, n_vocab, 2]) == -2
        assert b"outside the vocabulary" in lib.ggraph_last_error(m)
        assert batch([m], []) == -2
        passed = [lib.ggraph_n_past(h) for h in (m, s1, s2)]
        assert passed == [3, 2, 1]

        out = (ctypes.c_float * (3 * n_vocab))()
        assert batch([s1, m, s2], [tokens[1], tokens[0], tokens[2]], out) == 0
        got = np.frombuffer(out, dtype=np.float32).reshape(3, n_vocab)
        for row, i in enumerate([1, 0, 2]):
            alone = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=1)
            alone.eval(prompts[i])
            np.testing.assert_allclose(got[row], alone.eval([tokens[i]]), rtol=1e-5, atol=1e-5)
        assert [lib.ggraph_n_past(h) for h in (m, s1, s2)] == [4, 3, 2]
        greedy = Sampling(0.0, 0, 1.0, 0.0, 1.0, 1)
        assert lib.ggraph_sample(s1, ctypes.byref(greedy)) == int(np.argmax(got[0]))
        assert lib.ggraph_sample(m, ctypes.byref(greedy)) == int(np.argmax(got[1]))
        # A refused batch keeps each sequence's last logits.
        assert batch([s1, s1], [1, 2]) == -2
        assert lib.ggraph_sample(s1, ctypes.byref(greedy)) == int(np.argmax(got[0]))
        # Two sequences (a size class with no padding rows): the caller's buffer takes them.
        out2 = (ctypes.c_float * (2 * n_vocab))()
        assert batch([s2, m], [5, 6], out2) == 0
        got2 = np.frombuffer(out2, dtype=np.float32).reshape(2, n_vocab)
        for row, (i, t) in enumerate([(2, 5), (0, 6)]):
            alone = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=1)
            alone.eval(prompts[i] + [tokens[i]])
            np.testing.assert_allclose(got2[row], alone.eval([t]), rtol=1e-5, atol=1e-5)
    finally:
        for h in (s1, s2, m, other):
            lib.ggraph_free(h)


def test_c_api_swa_full_keeps_the_same_logits(lib, tmp_path):
    # A windowed model (window 5) through the C API, with its windowed layers as rings of
    # 5 + 512 - 1 rows (the default) and with every row (swa_full = 1): the same logits after a
    # prompt that wraps the rings, and after steps past it.
    from test_archs import write_arch

    path = tmp_path / "gemma3.gguf"
    write_arch(path, "gemma3", "F32", seed=3)
    tokens = [(11 * i + 2) % 96 for i in range(580)]
    out = []
    for swa_full in (0, 1):
        p = params(lib, device=b"cpu", n_ctx=600, n_threads=1, kv_type=b"f32")
        p.allow_longer_context, p.swa_full = 1, swa_full
        err = ctypes.create_string_buffer(256)
        m = lib.ggraph_load(str(path).encode(), ctypes.byref(p), err, 256)
        assert m, err.value
        try:
            logits = (ctypes.c_float * lib.ggraph_n_vocab(m))()
            assert lib.ggraph_eval(m, _ids(tokens[:570]), 570, logits) == 0
            for t in tokens[570:]:
                assert lib.ggraph_eval(m, _ids([t]), 1, logits) == 0
            out.append(np.frombuffer(logits, dtype=np.float32).copy())
        finally:
            lib.ggraph_free(m)
    np.testing.assert_array_equal(out[0], out[1])
    kw = dict(device="cpu", n_ctx=600, kv_type="f32", allow_longer_context=True)
    with pytest.warns(RuntimeWarning):
        ring, full = ggraph.Model(str(path), **kw), ggraph.Model(str(path), swa_full=True, **kw)
    assert ring.kv_bytes < full.kv_bytes


def test_c_api_cancel_reaches_an_eval_still_waiting_for_the_model(lib, smollm2):
    """A session's eval that waits for another call on the model is in progress: a cancel made
    meanwhile stops it (before its second chunk), and the other call is untouched."""
    p = params(lib, device=b"cpu", n_ctx=2048, n_threads=1, n_seq_max=2)
    err = ctypes.create_string_buffer(256)
    m = lib.ggraph_load(smollm2.encode(), ctypes.byref(p), err, 256)
    assert m, err.value
    s = lib.ggraph_session_open(m)
    assert s
    try:
        rcs = {}

        def ev(name, h, n):
            rcs[name] = lib.ggraph_eval(h, _ids([100 + i % 1000 for i in range(n)]), n, None)

        first = threading.Thread(target=ev, args=("model", m, 1100))
        first.start()
        time.sleep(0.3)  # the model's eval holds it for seconds
        second = threading.Thread(target=ev, args=("session", s, 600))
        second.start()
        time.sleep(0.3)  # the session's eval waits for the model
        lib.ggraph_cancel(s)
        first.join()
        second.join()
        assert rcs == {"model": 0, "session": -5}  # GGRAPH_ERR_CANCELLED
        assert (lib.ggraph_n_past(m), lib.ggraph_n_past(s)) == (1100, 0)
        # A cancel made while no eval runs stops nothing later.
        lib.ggraph_cancel(s)
        assert lib.ggraph_eval(s, _ids([1, 2, 3]), 3, None) == 0
    finally:
        lib.ggraph_free(s)
        lib.ggraph_free(m)


def test_c_api_every_call_leaves_the_last_error_its_own(lib, tiny_model):
    m, err = _load(lib, tiny_model)
    assert m, err
    try:
        assert lib.ggraph_rewind(m, -1) == -2
        assert lib.ggraph_last_error(m)
        assert lib.ggraph_n_past(m) == 0
        assert lib.ggraph_last_error(m) == b""  # the read succeeded
        assert lib.ggraph_n_past(None) == 0
        assert lib.ggraph_last_error(None) == b"model is NULL"
        buf = ctypes.create_string_buffer(16)
        assert lib.ggraph_token_to_piece(m, 5, buf, -1) == -2
        assert b"size" in lib.ggraph_last_error(m)
    finally:
        lib.ggraph_free(m)


def test_c_api_load_state_file_refuses_endless_and_oversized_files(lib, tiny_model, tmp_path):
    m, err = _load(lib, tiny_model, n_ctx=32)
    assert m, err
    try:
        assert lib.ggraph_eval(m, _ids([1, 2, 3]), 3, None) == 0
        assert lib.ggraph_load_state_file(m, b"/dev/zero") == -2
        assert b"not a regular file" in lib.ggraph_last_error(m)
        big = tmp_path / "big.state"
        big.write_bytes(b"\0" * (8 << 20))  # more than any state of a 32-token context
        assert lib.ggraph_load_state_file(m, str(big).encode()) == -2
        assert b"at most" in lib.ggraph_last_error(m)
        assert lib.ggraph_n_past(m) == 3  # unchanged
        good = tmp_path / "good.state"
        assert lib.ggraph_save_state_file(m, str(good).encode()) == 0
        assert lib.ggraph_load_state_file(m, str(good).encode()) == 0
    finally:
        lib.ggraph_free(m)
