"""The KV cache's element types (kv_type) and the context-length guard: each type against a
float64 forward pass, states that keep their type, and every refusal, in Python, C and the CLI."""

import ctypes
import subprocess
import sys
import warnings

import numpy as np
import pytest
import reference
from capi import load_library, params
from conftest import cuda_available

import ggraph
from ggraph.testing import write_random_gguf

KV_TYPES = ["f32", "f16", "q8_0"]
TOKENS = [1, 17, 42, 3, 99, 5, 250, 0, 7, 7, 64, 120, 33, 2, 19, 200]
STATE_HEADER = 40  # bytes: magic, version, fingerprint, kv type, layers, width, n_past, reserved


@pytest.fixture(scope="module")
def heads32(tmp_path_factory):
    """A tiny random model with F32 weights and attention heads 32 wide (one Q8_0 block), so that
    the cache's rounding is the only error against float64."""
    path = str(tmp_path_factory.mktemp("kv") / "heads32.gguf")
    write_random_gguf(
        path, shape="tiny", weight_type="F32", seed=3, n_embd=128, n_head=4, n_head_kv=2
    )
    return path


# Relative L2 error of the logits against float64 on the unrounded keys and values (measured:
# f16 1.9e-4, q8_0 6.0e-3): F16 rounds by at most 2^-11, Q8_0 by half a step of amax/127 per 32
# values; a few times the measured error leaves room for other seeds without hiding a wrong
# decoder (one of those is off by whole steps: errors of 1e-1 and more).
BOUND_UNROUNDED = {"f32": 1e-4, "f16": 2e-3, "q8_0": 3e-2}


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_each_cache_type_rounds_as_its_format_and_no_more(heads32, kv_type):
    w = reference.load(heads32)
    m = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type)
    assert m.kv_type == kv_type
    got = m.eval(TOKENS, all_logits=True)
    tokens = np.array(TOKENS)
    stored = reference.forward(w, tokens, kv_round=reference.kv_cache_round(kv_type))
    plain = reference.forward(w, tokens)

    def rel(ref):
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    # On the values the cache stores, only float32 arithmetic remains (and, rarely, a value that
    # float32 and float64 round to neighbouring steps).
    assert rel(stored) < 1e-4, f"{kv_type}: {rel(stored):.2e} against the stored values"
    assert rel(plain) < BOUND_UNROUNDED[kv_type], f"{kv_type}: {rel(plain):.2e}"
    if kv_type == "q8_0":
        assert rel(plain) > 1e-3, "a Q8_0 cache that loses nothing holds no 8-bit values"


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_decoding_step_by_step_equals_one_prompt_for_every_type(heads32, kv_type):
    whole = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type).eval(
        TOKENS, all_logits=True
    )
    m = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type)
    steps = np.stack([m.eval([t]) for t in TOKENS])
    np.testing.assert_allclose(steps, whole, rtol=1e-4, atol=1e-4)


def test_the_default_kv_type_is_f16_on_the_cpu(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    assert m.kv_type == "f16"
    assert "kv_type='f16'" in repr(m)
    assert ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type="auto").kv_type == "f16"
    assert (
        m._ctx.max_state_bytes
        < ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type="f32")._ctx.max_state_bytes
    )


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_the_default_kv_type_is_f16_on_cuda(heads32):
    assert ggraph.Model(heads32, device="cuda", n_ctx=64).kv_type == "f16"


@pytest.mark.parametrize("bad", ["bf16", "F16", "q4_0", ""])
def test_unknown_kv_types_are_refused(tiny_model, bad):
    with pytest.raises(
        ValueError, match=f"kv_type: expected 'auto', 'f32', 'f16' or 'q8_0', got '{bad}'"
    ):
        ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type=bad)


def test_q8_0_needs_heads_of_whole_blocks(tiny_model):
    # The tiny shape's heads are 16 wide: half a Q8_0 block.
    with pytest.raises(ValueError, match=r"kv_type 'q8_0'.*heads are 16 wide.*use 'f16' or 'f32'"):
        ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type="q8_0")
    assert ggraph.Model(tiny_model, device="cpu", n_ctx=64, kv_type="f32").kv_type == "f32"


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_cuda_takes_f16_and_q8_0_caches(heads32):
    with pytest.raises(ValueError, match="kv_type 'f32' is not supported on CUDA; use 'f16' or"):
        ggraph.Model(heads32, device="cuda", n_ctx=64, kv_type="f32")
    # Heads of 32 are one Q8_0 block: CUDA stages heads of whole pairs of blocks.
    with pytest.raises(ValueError, match="q8_0' on CUDA needs attention heads a multiple of 64"):
        ggraph.Model(heads32, device="cuda", n_ctx=64, kv_type="q8_0")
    assert ggraph.Model(heads32, device="cuda", n_ctx=64, kv_type="f16").kv_type == "f16"


@pytest.fixture(scope="module")
def heads64(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kv") / "heads64.gguf")
    write_random_gguf(
        path, shape="tiny", weight_type="Q8_0", seed=4, n_embd=256, n_head=4, n_head_kv=2
    )
    return path


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")
def test_cuda_q8_0_cache_agrees_with_the_cpus_and_keeps_its_state(heads64):
    """CUDA's logits with an 8-bit cache follow the CPU's with one, over a prompt (flash kernel)
    and single steps (split decode), as closely as the two backends' products allow (the CPU
    rounds activations to 8 bits, CUDA's prompt products to half); a saved state reloads into
    a fresh CUDA context bit for bit, and into a CPU context."""

    def cos(a, b):
        return float(np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)))

    cpu = ggraph.Model(heads64, device="cpu", n_ctx=128, kv_type="q8_0")
    gpu = ggraph.Model(heads64, device="cuda", n_ctx=128, kv_type="q8_0")
    f16 = ggraph.Model(heads64, device="cuda", n_ctx=128, kv_type="f16")
    assert gpu.kv_type == "q8_0"
    prompt = [(7 * i + 3) % 300 + 5 for i in range(70)]
    a, b = cpu.eval(prompt, all_logits=True), gpu.eval(prompt, all_logits=True)
    c = f16.eval(prompt, all_logits=True)
    assert cos(a, b) > 0.999
    # An 8-bit cache moves CUDA's logits about as far as the CPU's (test above: 3e-2).
    assert np.linalg.norm(b - c) / np.linalg.norm(c) < 3e-2
    for t in [11, 42, 99, 7]:
        assert cos(cpu.eval([t]), gpu.eval([t])) > 0.999
    state = gpu.save_state()
    again = ggraph.Model(heads64, device="cuda", n_ctx=128, kv_type="q8_0")
    again.load_state(state)
    next_gpu = again.eval([13])
    np.testing.assert_array_equal(next_gpu, gpu.eval([13]))
    other = ggraph.Model(heads64, device="cpu", n_ctx=128, kv_type="q8_0")
    other.load_state(state)
    assert other.n_past == len(prompt) + 4
    assert cos(other.eval([13]), next_gpu) > 0.999


# ---------------------------------------------------------------------------------------------
# States


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_a_state_round_trips_in_its_own_type(heads32, kv_type):
    m = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type)
    m.eval(TOKENS[:9])
    state = m.save_state()
    row = {"f32": 64 * 4, "f16": 64 * 2, "q8_0": 2 * 34}[kv_type]  # rows of 64 (2 heads of 32)
    # The tokens, each layer's first position (2 layers), then each layer's K and V rows.
    assert len(state) == STATE_HEADER + 9 * 4 + 2 * 4 + 2 * 2 * 9 * row
    expected = m.eval(TOKENS[9:])
    other = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type)
    other.eval([5, 5, 5])
    other.load_state(state)
    assert other.n_past == 9
    np.testing.assert_array_equal(other.eval(TOKENS[9:]), expected)


def test_a_state_is_refused_by_a_context_of_another_type(heads32):
    states = {}
    for kv_type in KV_TYPES:
        m = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type)
        m.eval(TOKENS[:5])
        states[kv_type] = m.save_state()
    for kv_type in KV_TYPES:
        m = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type)
        m.eval([3, 4])
        expected = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type=kv_type).eval([3, 4, 5])
        for saved, state in states.items():
            if saved == kv_type:
                continue
            with pytest.raises(
                ValueError,
                match=rf"KV cache is {saved.upper()} .*this context's {kv_type.upper()} .*"
                "same kv_type",
            ):
                m.load_state(state)
            assert m.n_past == 2 and m._tokens == [3, 4]
        np.testing.assert_allclose(m.eval([5]), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The context-length guard (the tiny model says it was trained on 256 positions)


def test_a_context_past_the_training_length_is_refused_and_says_how_to_allow_it(tiny_model):
    with pytest.raises(ValueError) as info:
        ggraph.Model(tiny_model, device="cpu", n_ctx=257)
    msg = str(info.value)
    assert "n_ctx 257" in msg and "training context of 256 tokens" in msg
    assert "llama.context_length" in msg and "allow_longer_context" in msg


def test_the_training_length_itself_and_zero_load_without_a_warning(tiny_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = ggraph.Model(tiny_model, device="cpu", n_ctx=256)
        zero = ggraph.Model(tiny_model, device="cpu", n_ctx=0)
    assert (m.n_ctx, m.n_ctx_train) == (256, 256)
    assert (zero.n_ctx, zero.n_ctx_train) == (256, 256)


def test_the_default_context_is_2048_or_the_training_length_where_shorter(tiny_model, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short = ggraph.Model(tiny_model, device="cpu")
    assert short.n_ctx == short.n_ctx_train == 256
    path = str(tmp_path / "long.gguf")
    write_random_gguf(path, shape="tiny", weight_type="F32", seed=1, n_ctx=4096)
    long_trained = ggraph.Model(path, device="cpu")
    assert (long_trained.n_ctx, long_trained.n_ctx_train) == (2048, 4096)
    with pytest.raises(ValueError, match="n_ctx must be >= 0"):
        ggraph.Model(tiny_model, device="cpu", n_ctx=-2)


def test_allow_longer_context_runs_past_the_training_length_with_a_warning(tiny_model):
    with pytest.warns(RuntimeWarning, match="n_ctx 300 is longer than .* 256 tokens"):
        m = ggraph.Model(tiny_model, device="cpu", n_ctx=300, allow_longer_context=True)
    assert m.n_ctx == 300
    logits = m.eval(list(range(1, 291)))
    assert m.n_past == 290 and np.all(np.isfinite(logits))


def test_c_api_kv_type_and_context_guard(tiny_model, heads32):
    lib = load_library()
    err = ctypes.create_string_buffer(512)

    def load(path, **fields):
        return lib.ggraph_load(path.encode(), ctypes.byref(params(lib, **fields)), err, 512)

    assert lib.ggraph_default_params().kv_type == b"auto"
    assert not load(tiny_model, device=b"cpu", n_ctx=512)
    assert b"training context of 256 tokens" in err.value
    assert b"allow_longer_context" in err.value
    assert not load(tiny_model, device=b"cpu", n_ctx=64, kv_type=b"f8")
    assert b"expected 'auto', 'f32', 'f16' or 'q8_0', got 'f8'" in err.value
    assert not load(tiny_model, device=b"cpu", n_ctx=64, size=8)
    assert b"params->size 8" in err.value
    m = load(tiny_model, device=b"cpu", n_ctx=512, allow_longer_context=1)
    assert m, err.value
    try:
        assert lib.ggraph_n_ctx(m) == 512
    finally:
        lib.ggraph_free(m)
    # The type reaches the cache: the C model's logits are Python's for the same type.
    m = load(heads32, device=b"cpu", n_ctx=64, kv_type=b"q8_0")
    assert m, err.value
    try:
        n_vocab = lib.ggraph_n_vocab(m)
        logits = (ctypes.c_float * n_vocab)()
        ids = (ctypes.c_int32 * len(TOKENS))(*TOKENS)
        assert lib.ggraph_eval(m, ids, len(TOKENS), logits) == 0
        py = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type="q8_0").eval(TOKENS)
        f16 = ggraph.Model(heads32, device="cpu", n_ctx=64, kv_type="f16").eval(TOKENS)
        got = np.frombuffer(logits, dtype=np.float32)
        np.testing.assert_allclose(got, py, rtol=1e-6, atol=1e-6)
        assert not np.allclose(got, f16, rtol=1e-6, atol=1e-6)
    finally:
        lib.ggraph_free(m)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "ggraph", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_kv_type_and_allow_longer_context(tiny_model, heads32):
    r = _cli("generate", "-m", tiny_model, "--device", "cpu", "-n", "2", "-c", "512", "hi")
    assert r.returncode == 1 and "training context of 256 tokens" in r.stderr
    r = _cli(
        "generate", "-m", tiny_model, "--device", "cpu", "-n", "2", "-c", "512",
        "--allow-longer-context", "hi",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" in r.stderr and "longer than the model's training context" in r.stderr
    r = _cli("generate", "-m", tiny_model, "--device", "cpu", "-c", "64", "--kv-type", "x", "hi")
    assert r.returncode == 1 and "kv_type: expected" in r.stderr
    r = _cli(
        "bench", "-m", heads32, "-p", "8", "-n", "4", "-r", "1", "--device", "cpu",
        "--kv-type", "q8_0",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [line.split("|") for line in r.stdout.splitlines()[2:]]
    assert [row[9].strip() for row in rows] == ["q8_0", "q8_0", "q8_0"]  # pp, tg and gen
