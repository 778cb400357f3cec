"""One Model shared between threads, and calls that are refused: serialized calls, generators that
a newer generation invalidates, and state that a refused call leaves exactly as it was."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import cuda_available

import ggraph


def _devices():
    return ["cpu", "cuda"] if cuda_available() else ["cpu"]


@pytest.fixture(params=_devices())
def model(request, tiny_model):
    return ggraph.Model(tiny_model, device=request.param, n_ctx=256, n_threads=2)


def _state(m):
    return m.n_past, list(m._tokens), None if m._last_logits is None else m._last_logits.copy()


def _same_state(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert (a[2] is None) == (b[2] is None)
    if a[2] is not None:
        np.testing.assert_array_equal(a[2], b[2])


def _run_threads(fn, args):
    errors = []

    def wrap(*a):
        try:
            fn(*a)
        except BaseException as e:  # noqa: B036 - reported to the test below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_two_threads_evaluating_one_model(model):
    model.eval([1])
    logits = {}

    def worker(first):
        for i in range(50):
            logits[(first, i)] = model.eval([first + i])

    assert _run_threads(worker, [(10,), (100,)]) == []
    assert model.n_past == 101
    assert len(model._tokens) == 101 and sorted(model._tokens[1:]) == sorted(
        [10 + i for i in range(50)] + [100 + i for i in range(50)]
    )
    # The interleaving the threads took, replayed alone a token at a time (the same kernels),
    # gives the same logits at every step.
    order = model._tokens
    ref = ggraph.Model(model.path, device=model.device.split(":")[0], n_ctx=256, n_threads=2)
    ref.eval(order[:1])
    for tok in order[1:]:
        first = 10 if 10 <= tok < 60 else 100
        np.testing.assert_allclose(
            logits[(first, tok - first)], ref.eval([tok]), rtol=1e-5, atol=1e-5
        )


def test_two_threads_generating_on_one_model(model):
    """Every generation that finishes equals the same generation run alone; one that a newer
    generation invalidated says so."""
    prompts = {"a": [1, 5, 9, 13], "b": [1, 7, 3]}
    alone = {
        k: "".join(model.generate(p, max_tokens=24, temperature=0)) for k, p in prompts.items()
    }
    results, invalidated = {}, []

    def worker(key):
        for _ in range(5):
            try:
                results.setdefault(key, []).append(
                    "".join(model.generate(prompts[key], max_tokens=24, temperature=0))
                )
            except RuntimeError as e:
                assert "no longer valid" in str(e)
                invalidated.append(key)

    assert _run_threads(worker, [("a",), ("b",)]) == []
    finished = sum(len(v) for v in results.values())
    assert finished + len(invalidated) == 10 and finished >= 1
    for key, texts in results.items():
        assert all(t == alone[key] for t in texts), key


def test_a_new_generation_invalidates_the_previous_generator(model):
    first = model.generate([1, 2, 3], max_tokens=10, temperature=0)
    next(first)
    second = model.generate([1, 4, 5], max_tokens=4, temperature=0)
    with pytest.raises(RuntimeError, match="no longer valid"):
        next(first)
    assert "".join(second) == "".join(model.generate([1, 4, 5], max_tokens=4, temperature=0))
    # So does a change of the context by eval or reset.
    third = model.generate([1, 2], max_tokens=10, temperature=0)
    next(third)
    model.eval([7])
    with pytest.raises(RuntimeError, match="no longer valid"):
        next(third)


def test_refused_calls_leave_the_model_as_it_was(model):
    model.eval([1, 2, 3, 4, 5])
    before = _state(model)
    for bad in ([5, -1], [5, model.n_vocab], [5, 2.5], "text"):
        with pytest.raises(ValueError):
            model.eval(bad)
        _same_state(_state(model), before)
    for bad in ([5, -1], [5, model.n_vocab], []):
        with pytest.raises(ValueError):
            model.generate(bad)
        _same_state(_state(model), before)
    with pytest.raises(ValueError):
        model.generate([1] * (model.n_ctx + 1))
    _same_state(_state(model), before)


def test_eval_of_an_iterator_keeps_tokens_and_cache_in_step(model, tiny_model):
    out = model.eval(iter([5, 6, 7]))
    assert model.n_past == 3 and model._tokens == [5, 6, 7]
    ref = ggraph.Model(tiny_model, device=model.device.split(":")[0], n_ctx=256).eval([5, 6, 7])
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)
    assert model.eval(np.array([8], dtype=np.int64)).shape == (model.n_vocab,)
    assert model._tokens == [5, 6, 7, 8]


def test_thread_counts_out_of_range_are_refused(tiny_model):
    for bad in (-1, 1025, 100000):
        with pytest.raises(ValueError, match="n_threads"):
            ggraph.Model(tiny_model, device="cpu", n_threads=bad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_eval_in_a_forked_child(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=2)
    parent = m.eval([1, 2, 3])
    pid = os.fork()
    if pid == 0:  # the child: its pool must start its own threads, not wait for the parent's
        code = 1
        try:
            child = m.eval([4])
            ref = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=2).eval([1, 2, 3, 4])
            code = 0 if np.allclose(child, ref, rtol=1e-4, atol=1e-4) else 2
        finally:
            os._exit(code)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("eval in the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert m.n_past == 3 and parent.shape == (m.n_vocab,)  # the parent's model is untouched


def _evaluate_while_cancelling(m, ids):
    done = threading.Event()

    def canceller():
        while not done.is_set():
            m.cancel()

    t = threading.Thread(target=canceller)
    t.start()
    try:
        return m.eval(ids)
    finally:
        done.set()
        t.join()


@pytest.mark.filterwarnings("ignore:n_ctx 2048 is longer:RuntimeWarning")
def test_cancel_from_another_thread_stops_a_long_input_and_changes_nothing(tiny_model):
    # Past the tiny model's 256 training positions (random weights: nothing to lose there).
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=2048, n_batch=1, allow_longer_context=True)
    m.eval([1, 2])
    before = _state(m)
    with pytest.raises(ggraph.Cancelled, match="context is unchanged"):
        _evaluate_while_cancelling(m, [3 + i % 50 for i in range(1500)])
    _same_state(_state(m), before)
    ref = ggraph.Model(tiny_model, device="cpu", n_ctx=64).eval([1, 2, 9])
    np.testing.assert_allclose(m.eval([9]), ref, rtol=1e-4, atol=1e-4)


CTRL_C = """
import os, signal, threading, ggraph
signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the parent ignores it
m = ggraph.Model({path!r}, device="cpu", n_ctx=4096, n_batch=1, allow_longer_context=True)
threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    m.eval([3 + i % 50 for i in range(4000)])
    print("finished")
except KeyboardInterrupt:
    print("interrupted", m.n_past, len(m.eval([1, 2])))
"""


def test_ctrl_c_stops_a_long_input_and_leaves_the_model_usable(tiny_model):
    out = subprocess.run(
        [sys.executable, "-c", CTRL_C.format(path=tiny_model)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    # 4000 one-token chunks take seconds; the signal comes after 0.1 s.
    n_vocab = ggraph.Model(tiny_model, n_ctx=64).n_vocab
    assert out.stdout.split() == ["interrupted", "0", str(n_vocab)]


def test_a_refused_call_leaves_a_generator_valid(model):
    gen = model.generate([1, 2, 3], max_tokens=6, temperature=0)
    first = next(gen)
    with pytest.raises(ValueError):
        model.eval([model.n_vocab])
    with pytest.raises(ValueError):
        model.rewind(model.n_past + 5)
    rest = "".join(gen)
    model.reset()
    assert first + rest == "".join(model.generate([1, 2, 3], max_tokens=6, temperature=0))
