"""The generation loop in the core: logprobs, cancellation, and the C API's ggraph_generate, each
against an independent computation (numpy over evaluated logits; the Python API)."""

import ctypes
import threading

import numpy as np
import pytest
from capi import STEP, GenParams, load_library, params

import ggraph


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def test_logprobs_are_those_of_the_evaluated_logits(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=128)
    prompt = [1, 5, 9]
    items = list(m.generate(prompt, max_tokens=8, temperature=0, logprobs=3))
    steps = [it for it in items if it.token >= 0]
    assert len(steps) == m.n_generated and m.stop_reason in ("length", "eos")
    tokens = [it.token for it in steps]
    ref = ggraph.Model(tiny_model, device="cpu", n_ctx=128)
    logits = ref.eval(prompt + tokens, all_logits=True)
    for i, it in enumerate(steps):
        row = _log_softmax(logits[len(prompt) - 1 + i])
        assert it.token == int(np.argmax(row))  # greedy
        assert it.logprob == pytest.approx(row[it.token], abs=1e-4)
        assert [t for t, _ in it.top] == [int(j) for j in np.argsort(-row, kind="stable")[:3]]
        assert [lp for _, lp in it.top] == pytest.approx(sorted(row, reverse=True)[:3], abs=1e-4)
    # The same text as the plain form.
    plain = "".join(m.generate(prompt, max_tokens=8, temperature=0))
    assert "".join(it.text for it in items) == plain


def test_bad_generation_options_are_refused_before_anything_changes(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    m.eval([1, 2, 3])
    bad = (dict(logprobs=21), dict(logprobs=-1), dict(max_tokens=-1), dict(stop=[""]))
    bad += (dict(chain=0), dict(chain=-5), dict(chain=257))
    for kw in bad:
        with pytest.raises(ValueError):
            m.generate([1, 2], **kw)
    assert m.n_past == 3 and m._tokens == [1, 2, 3]


def test_cancel_ends_a_generation_at_its_next_token(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=256)
    gen = m.generate([1, 2, 3], max_tokens=200, temperature=0)
    next(gen)
    t = threading.Thread(target=m.cancel)  # from another thread, between two steps
    t.start()
    t.join()
    rest = list(gen)
    assert m.stop_reason == "cancelled", (m.stop_reason, m.n_generated)
    assert m.n_generated < 200 and isinstance("".join(rest), str)
    # The model goes on working, from the context the generation left.
    assert m.n_past == len(m._tokens)
    assert "".join(m.generate([1, 2, 3], max_tokens=4, temperature=0))


def _cancelled_prompt(m, prompt):
    """Generates from prompt while another thread cancels over and over, until the prompt's
    eval is the call that stops (the canceller may start late); returns the Cancelled error.
    Each try has a canceller of its own, stopped before the history is put back."""
    before = m._tokens
    for _ in range(50):
        done = threading.Event()

        def spam(done=done):
            while not done.is_set():
                m.cancel()

        t = threading.Thread(target=spam)
        t.start()
        try:
            list(m.generate(prompt, max_tokens=1, temperature=0))
        except ggraph.Cancelled as e:
            return e
        finally:
            done.set()
            t.join()
        m.reset()  # it went through: put the history back and try again
        m.eval(before)  # (cancels made before this call do not stop it)
    pytest.fail("the cancel never landed while the prompt went in")


def test_a_cancelled_prompt_tells_what_the_context_holds(tiny_model):
    """A prompt that extends the context and is cancelled leaves it as it was; one that differs
    from it has already replaced its tokens past the shared prefix, and the error says so."""
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=256, n_threads=1, n_batch=8)
    history = [(7 * i) % 250 + 3 for i in range(40)]
    m.eval(history)
    e = _cancelled_prompt(m, history + [(5 * i) % 250 + 3 for i in range(150)])
    assert "replaced" not in str(e) and m.stop_reason == "cancelled"
    assert m._tokens == history
    e = _cancelled_prompt(m, history[:10] + [(3 * i) % 250 + 3 for i in range(150)])
    assert "replaced the last 30 tokens" in str(e) and "first 10 tokens" in str(e), str(e)
    assert m.n_past == 10 and m._tokens == history[:10]
    # What it holds is what it says: it goes on as a context of those 10 tokens.
    ref = ggraph.Model(tiny_model, device="cpu", n_ctx=256, n_threads=1, n_batch=8)
    np.testing.assert_array_equal(m.eval([4, 5]), ref.eval(history[:10] + [4, 5]))


@pytest.fixture(scope="module")
def capi(tiny_model):
    lib = load_library()
    err = ctypes.create_string_buffer(256)
    # n_ctx 0: the tiny model's training length (256), as the default 2048 is refused.
    model = lib.ggraph_load(tiny_model.encode(), ctypes.byref(params(lib, n_ctx=0)), err, 256)
    assert model, err.value
    yield lib, model
    lib.ggraph_free(model)


def _generate(lib, model, prompt, params, stop_after=None):
    pieces, tokens = [], []

    def on_step(text, n, token, logprob, top, n_top, user):
        pieces.append(ctypes.string_at(text, n))
        if token >= 0:
            tokens.append((token, logprob, [(top[i].token, top[i].logprob) for i in range(n_top)]))
        return 1 if stop_after is not None and len(tokens) >= stop_after else 0

    ids = (ctypes.c_int32 * len(prompt))(*prompt)
    rc = lib.ggraph_generate(model, ids, len(prompt), ctypes.byref(params), STEP(on_step), None)
    return rc, b"".join(pieces).decode("utf-8"), tokens


def test_c_generate_matches_python(capi, tiny_model):
    lib, model = capi
    p = lib.ggraph_default_generate_params()
    assert p.size == ctypes.sizeof(GenParams)
    p.temperature, p.max_tokens, p.top_logprobs = 0.0, 12, 2
    rc, text, tokens = _generate(lib, model, [1, 5, 9], p)
    py = ggraph.Model(tiny_model, device="auto", n_ctx=0)  # the device the C model took
    items = [it for it in py.generate([1, 5, 9], max_tokens=12, temperature=0, logprobs=2)]
    assert rc == {"length": 3, "eos": 1}[py.stop_reason]
    assert text == "".join(it.text for it in items)
    steps = [it for it in items if it.token >= 0]
    assert [t for t, _, _ in tokens] == [it.token for it in steps]
    for (_, lp, top), it in zip(tokens, steps):
        assert lp == pytest.approx(it.logprob, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in it.top]


def test_c_generate_stops_when_asked_and_refuses_bad_params(capi):
    lib, model = capi
    p = lib.ggraph_default_generate_params()
    p.temperature, p.max_tokens = 0.0, 50
    rc, _, tokens = _generate(lib, model, [1, 2], p, stop_after=3)
    assert rc == 6 and len(tokens) == 3  # GGRAPH_STOP_CALLBACK
    n_past = lib.ggraph_n_past(model)
    for field, value in (("size", 3), ("top_logprobs", 99), ("max_tokens", -1)):
        bad = lib.ggraph_default_generate_params()
        setattr(bad, field, value)
        assert _generate(lib, model, [1, 2], bad)[0] == -2
        assert lib.ggraph_last_error(model)
        assert lib.ggraph_n_past(model) == n_past
    assert _generate(lib, model, [1, 10**6], p)[0] == -2


def test_ignore_eos_generates_past_the_end_of_generation(smollm2):
    m = ggraph.Model(smollm2, device="cpu", n_ctx=256)
    ids = m.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=True)

    def tokens(**kw):
        steps = m.generate(ids, max_tokens=64, temperature=0, logprobs=0, **kw)
        return [it.token for it in steps if it.token >= 0]

    plain = tokens()
    assert m.stop_reason == "eos" and len(plain) < 64
    longer = tokens(ignore_eos=True)
    assert m.stop_reason == "length" and m.n_generated == 64 == len(longer)
    # The same tokens up to the end of generation, which is generated instead of ending it.
    assert longer[: len(plain)] == plain


def test_c_generate_flags(capi):
    lib, model = capi
    p = lib.ggraph_default_generate_params()
    assert p.flags == 0
    p.temperature, p.max_tokens, p.flags = 0.0, 20, 1  # GGRAPH_GENERATE_IGNORE_EOS
    rc, _, tokens = _generate(lib, model, [1, 2], p)
    assert rc == 3 and len(tokens) == 20  # GGRAPH_STOP_LENGTH, whatever the tokens
    n_past = lib.ggraph_n_past(model)
    p.flags = 2  # no such flag
    assert _generate(lib, model, [1, 2], p)[0] == -2
    assert b"flags" in lib.ggraph_last_error(model)
    assert lib.ggraph_n_past(model) == n_past


def test_c_generate_tokens_per_launch(capi):
    lib, model = capi
    p = lib.ggraph_default_generate_params()
    assert p.tokens_per_launch == 0
    p.temperature, p.max_tokens, p.flags = 0.0, 20, 1
    rc, _, want = _generate(lib, model, [1, 2], p)
    # A token at a time, and as many a launch as the backend runs: the same tokens.
    for n in (1, 64):
        p.tokens_per_launch = n
        got_rc, _, got = _generate(lib, model, [1, 2], p)
        assert got_rc == rc and [t for t, _, _ in got] == [t for t, _, _ in want]
    n_past = lib.ggraph_n_past(model)
    for bad in (-1, 257):
        p.tokens_per_launch = bad
        assert _generate(lib, model, [1, 2], p)[0] == -2
        assert b"launch" in lib.ggraph_last_error(model)
        assert lib.ggraph_n_past(model) == n_past


def test_c_detokenize_and_rewind(capi, tiny_model):
    lib, model = capi
    py = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    ids = py.tokenize("hello world", add_bos=False)
    arr = (ctypes.c_int32 * len(ids))(*ids)
    need = lib.ggraph_detokenize(model, arr, len(ids), 0, None, 0)
    buf = ctypes.create_string_buffer(need)
    assert lib.ggraph_detokenize(model, arr, len(ids), 0, buf, need) == need
    assert buf.raw[:need].decode() == py.detokenize(ids)
    p = lib.ggraph_default_generate_params()
    p.temperature, p.max_tokens = 0.0, 4
    _generate(lib, model, [1, 2, 3], p)
    assert lib.ggraph_rewind(model, 2) == 0 and lib.ggraph_n_past(model) == 2
    assert lib.ggraph_rewind(model, 5) == -2


def test_embeddings_are_the_hidden_state_the_logits_come_from(tiny_model):
    gguf = pytest.importorskip("gguf")
    m = ggraph.Model(tiny_model, device="auto", n_ctx=128)
    ids = [1, 5, 9, 13]
    h = m.embed(ids, pooling="none", normalize=False)
    assert h.shape[0] == len(ids) and h.shape[1] == 64  # the tiny shape's n_embd
    # The output projection (dequantized with gguf-py) of each position's hidden state gives
    # that position's logits.
    r = gguf.GGUFReader(tiny_model)
    t = next(t for t in r.tensors if t.name == "output.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(m.n_vocab, -1).astype(np.float64)
    logits = ggraph.Model(tiny_model, device="auto", n_ctx=128).eval(ids, all_logits=True)
    for pos in range(len(ids)):
        want = logits[pos].astype(np.float64)
        got = w @ h[pos].astype(np.float64)
        cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
        assert cos > 0.999, (pos, cos)
    # Pooling and normalization.
    mean = m.embed(ids)
    np.testing.assert_allclose(np.linalg.norm(mean), 1.0, rtol=1e-5)
    ref = h.mean(axis=0)
    np.testing.assert_allclose(mean, ref / np.linalg.norm(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.embed(ids, pooling="last", normalize=False), h[-1], rtol=1e-6)
    with pytest.raises(ValueError, match="pooling"):
        m.embed(ids, pooling="max")


def test_embedding_keeps_the_conversation(tiny_model):
    m = ggraph.Model(tiny_model, device="auto", n_ctx=128)
    m.eval([1, 2, 3, 4])
    m.embed([7, 8, 9])
    assert m.n_past == 4 and m._tokens == [1, 2, 3, 4]
    ref = ggraph.Model(tiny_model, device="auto", n_ctx=128)
    ref.eval([1, 2, 3, 4])
    np.testing.assert_array_equal(m.eval([5]), ref.eval([5]))


def test_c_sample_after_a_generation_its_callback_stopped_asks_for_an_eval(capi):
    """The last eval's logits belong to the context before a generation: after one that its
    callback stopped, ggraph_sample refuses rather than sample them."""
    lib, model = capi
    lib.ggraph_reset(model)
    assert lib.ggraph_eval(model, (ctypes.c_int32 * 3)(1, 20, 30), 3, None) == 0
    greedy = lib.ggraph_default_sampling()
    greedy.temperature = 0.0
    assert lib.ggraph_sample(model, ctypes.byref(greedy)) >= 0
    p = lib.ggraph_default_generate_params()
    p.temperature, p.max_tokens = 0.0, 8
    rc, _, tokens = _generate(lib, model, [40, 50], p, stop_after=1)
    assert rc == 6 and len(tokens) == 1  # GGRAPH_STOP_CALLBACK
    assert lib.ggraph_sample(model, ctypes.byref(greedy)) == -2
    assert b"eval first" in lib.ggraph_last_error(model)
