"""Sessions: independent sequences over one model's weights. Each must behave exactly as a model
of its own would, whatever the others do between its calls, on every device."""

import contextlib
import threading
import time

import numpy as np
import pytest
from conftest import cuda_available
from test_archs import write_arch

import ggraph
from ggraph import _core
from ggraph.testing import write_random_gguf

A = [5, 17, 42, 8, 99, 3, 61, 27, 14, 7]
B = [200, 11, 150, 33, 2, 90, 45]


def _devices():
    return ["cpu", "cuda"] if cuda_available() else ["cpu"]


@pytest.fixture(params=_devices())
def device(request):
    return request.param


def _alone(path, device, tokens, steps, n_ctx=64):
    """Logits of a single-sequence model of the same n_ctx (CUDA's attention splits follow it):
    the prompt's, then each step's."""
    m = ggraph.Model(path, device=device, n_ctx=n_ctx, n_threads=1)
    out = [m.eval(tokens)]
    out += [m.eval([t]) for t in steps]
    return out


def test_sessions_interleaved_equal_models_of_their_own(tiny_model, device):
    m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1, n_seq_max=3)
    s1, s2 = m.session(), m.session()
    want_m = _alone(tiny_model, device, A, [1, 2, 3])
    want_1 = _alone(tiny_model, device, B, [4, 5, 6])
    want_2 = _alone(tiny_model, device, A[:3], [7, 8, 9])
    got_m, got_1, got_2 = [m.eval(A)], [s1.eval(B)], [s2.eval(A[:3])]
    for a, b, c in zip([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        got_2.append(s2.eval([c]))
        got_m.append(m.eval([a]))
        got_1.append(s1.eval([b]))
    for got, want in [(got_m, want_m), (got_1, want_1), (got_2, want_2)]:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert (m.n_past, s1.n_past, s2.n_past) == (len(A) + 3, len(B) + 3, 6)
    assert s1._tokens == B + [4, 5, 6] and m._tokens == A + [1, 2, 3]


def test_a_full_pool_is_a_clear_error_and_closing_frees_a_sequence(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=32, n_seq_max=2)
    s = m.session()
    with pytest.raises(ValueError, match=r"all 2 sequences .* in use \(n_seq_max=2\)"):
        m.session()
    s.eval(A)
    s.close()
    s.close()  # twice: nothing
    assert s.closed
    with pytest.raises(ValueError, match="this session is closed"):
        s.eval(A)
    with m.session() as again:  # the freed sequence, empty
        assert again.n_past == 0
        again.eval(B)
    assert again.closed
    ggraph.Model(tiny_model, device="cpu", n_ctx=32).eval(A)  # n_seq_max 1: no sessions
    with pytest.raises(ValueError, match=r"all 1 sequences"):
        ggraph.Model(tiny_model, device="cpu", n_ctx=32).session()


@pytest.mark.parametrize("bad", [0, -1, 257])
def test_n_seq_max_is_checked(tiny_model, bad):
    with pytest.raises(ValueError, match=f"n_seq_max must be 1 to 256, got {bad}"):
        ggraph.Model(tiny_model, device="cpu", n_ctx=32, n_seq_max=bad)


def test_generators_of_two_sessions_step_in_turns(tiny_model, device):
    def alone(prompt):
        m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1)
        return list(m.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True))

    m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1, n_seq_max=2)
    s = m.session()
    g1, g2 = (
        m.generate(A, max_tokens=12, temperature=0, ignore_eos=True),
        s.generate(B, max_tokens=12, temperature=0, ignore_eos=True),
    )
    outs, gens = ([], []), [g1, g2]
    while any(gens):
        for i, g in enumerate(gens):
            piece = next(g, None) if g else None
            if piece is None:
                gens[i] = None
            else:
                outs[i].append(piece)
    assert outs[0] == alone(A) and outs[1] == alone(B)
    # A change to one session leaves the other's generator valid, and stops its own.
    g2 = s.generate(B, max_tokens=4, temperature=0)
    next(g2)
    m.reset()
    next(g2)
    g1 = m.generate(A, max_tokens=4, temperature=0)
    next(g1)
    s.reset()
    next(g1)
    m.eval([1])
    with pytest.raises(RuntimeError, match="no longer valid"):
        next(g1)


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA (loops run on CUDA graphs)")
@pytest.mark.parametrize("chain", [8, 64])
def test_loops_of_two_sessions_in_turns_give_each_its_own_tokens(tiny_model, chain):
    # Each session's launch lands the other's loop in flight before its caller has taken its
    # tokens: the other session keeps them for its generator's next step.
    settings = dict(max_tokens=100, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)

    def alone(prompt):
        m = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
        return [t.token for t in m.generate(prompt, chain=1, **settings)], m.n_past

    m = ggraph.Model(tiny_model, device="cuda", n_ctx=256, n_seq_max=2)
    s = m.session()
    gens = [m.generate(A, chain=chain, **settings), s.generate(B, chain=chain, **settings)]
    outs = ([], [])
    while any(gens):
        for i, g in enumerate(gens):
            t = next(g, None) if g else None
            if t is None:
                gens[i] = None
            elif t.token >= 0:
                outs[i].append(t.token)
    assert (outs[0], m.n_past) == alone(A)
    assert (outs[1], s.n_past) == alone(B)


def test_a_sessions_step_leaves_its_sequence_selected_and_nested_calls_give_it_back(tiny_model):
    # Selecting another sequence lands a launch in flight: after a session's generator step the
    # session's sequence stays selected, so that its generation loop streams between its steps
    # (on CUDA). A call nested in another (a signal handler, a finalizer) gives the outer call
    # its sequence back.
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_seq_max=2)
    s = m.session()
    m.eval([1, 2])
    gen = s.generate([3, 4], max_tokens=4, temperature=0.0)
    next(gen)
    assert m._ctx.sequence == s._lock.seq
    next(gen)
    assert m._ctx.sequence == s._lock.seq
    assert m.n_past == 2 and m.eval([5]).shape == (m.n_vocab,)
    assert m._ctx.sequence == 0 and m.n_past == 3
    with m._lock:
        with s._lock:
            assert m._ctx.sequence == s._lock.seq
        assert m._ctx.sequence == 0
        with s._lock, m._lock:
            assert m._ctx.sequence == 0
        assert m._ctx.sequence == 0
    assert list(gen)  # the session's generation goes on with its own tokens


def test_rewind_and_states_stay_within_a_session(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_seq_max=2)
    s = m.session()
    m.eval(A)
    s.eval(B)
    state = s.save_state()
    for bad in (1.5, "2"):  # not integers: refused, nothing rewound
        with pytest.raises(TypeError):
            s.rewind(bad)
    s.rewind(np.int64(2))
    assert (m.n_past, s.n_past) == (len(A), 2)
    expected = m.eval([4])
    m.rewind(len(A))
    m.load_state(state)  # the session's sequence, into the model's own
    assert m._tokens == B
    np.testing.assert_array_equal(m.eval([6]), _alone(tiny_model, "cpu", B, [6])[1])
    assert s._tokens == B[:2]
    # And the model's sequence was the model's before the load.
    other = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    other.eval(A)
    np.testing.assert_array_equal(other.eval([4]), expected)


def test_sessions_on_threads(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=1, n_seq_max=4)
    prompts = [A, B, A[:5], B[2:]]
    sessions = [m] + [m.session() for _ in range(3)]
    want = [_alone(tiny_model, "cpu", p, [9, 8, 7, 6]) for p in prompts]
    got = [None] * 4
    errors = []

    def run(i):
        try:
            s = sessions[i]
            got[i] = [s.eval(prompts[i])] + [s.eval([t]) for t in [9, 8, 7, 6]]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)


@contextlib.contextmanager
def _cancelling(who):
    """Calls who.cancel() over and over from another thread while the block runs."""
    done = threading.Event()

    def spam():
        while not done.is_set():
            who.cancel()

    t = threading.Thread(target=spam)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def test_cancel_stops_its_own_session_only(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=256, n_threads=1, n_batch=8, n_seq_max=2)
    s = m.session()
    prompt = [(3 * i + 1) % 300 + 3 for i in range(200)]  # 25 chunks of 8
    with _cancelling(s):
        m.eval(prompt)  # the other session's requests never stop it
    assert m.n_past == 200
    with _cancelling(m), pytest.raises(ggraph.Cancelled):
        for _ in range(50):  # the canceller may start late: it lands within a few evals
            m.reset()
            m.eval(prompt)


def test_a_session_keeps_its_step_graph_while_another_runs_other_shapes(tiny_model, device):
    """Each sequence keeps its last step's graph and the host inputs it reads: a long prompt of
    another session between two decode steps neither disturbs nor invalidates it."""
    m = ggraph.Model(tiny_model, device=device, n_ctx=128, n_threads=1, n_seq_max=2)
    s = m.session()
    long = [(5 * i + 2) % 300 + 3 for i in range(60)]
    want = _alone(tiny_model, device, A, [1, 2, 3], n_ctx=128)
    got = [m.eval(A), m.eval([1])]
    s.eval(long)
    got.append(m.eval([2]))
    s.eval([4])
    s.eval(long[:7], all_logits=True)
    got.append(m.eval([3]))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ref = ggraph.Model(tiny_model, device=device, n_ctx=128, n_threads=1)
    ref.eval(long)
    ref.eval([4])
    ref.eval(long[:7], all_logits=True)
    np.testing.assert_array_equal(s.eval([9]), ref.eval([9]))


def test_decode_batch_equals_each_sessions_own_steps(tiny_model, device):
    """A step of several sequences at once (one read of the weights on the CPU) gives each the
    logits, cache rows and history its own decode step gives."""
    m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1, n_seq_max=4)
    s1, s2, s3 = m.session(), m.session(), m.session()
    seqs = [m, s1, s2, s3]
    prompts = [A, B, A[:4], [77]]
    for who, p in zip(seqs, prompts):
        who.eval(p)
    want = [_alone(tiny_model, device, p, [11, 12, 13]) for p in prompts]
    got = [[] for _ in seqs]
    for step, t in enumerate([11, 12, 13]):
        order = [2, 0, 3, 1] if step % 2 else [0, 1, 2, 3]  # any order, any selected one
        batch = m.decode_batch([(seqs[i], t) for i in order])
        for row, i in enumerate(order):
            got[i].append(batch[row])
    for g, w in zip(got, want):
        for a, b in zip(g, w[1:]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert [x.n_past for x in seqs] == [len(p) + 3 for p in prompts]
    assert s2._tokens == A[:4] + [11, 12, 13]
    # A step after the batch continues each sequence as its own model would.
    for who, p in zip(seqs, prompts):
        ref = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1)
        ref.eval(p)
        for t in [11, 12, 13]:
            ref.eval([t])
        np.testing.assert_allclose(who.eval([5]), ref.eval([5]), rtol=1e-5, atol=1e-5)


def test_decode_batch_logits_stay_the_callers_after_later_steps_and_the_model(tiny_model, device):
    """On CUDA the logits land in page-locked blocks that serve again once their array is gone:
    an array kept keeps its block (later steps write elsewhere), also past the model's end."""
    m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1, n_seq_max=2)
    s = m.session()
    m.eval(A)
    s.eval(B)
    kept = [m.decode_batch([(m, 3 + t), (s, 4 + t)]) for t in range(3)]
    copies = [k.copy() for k in kept]
    for t in range(6):  # more steps than the pool keeps blocks
        m.decode_batch([(m, 20 + t), (s, 30 + t)])
    assert not np.array_equal(copies[0], copies[1])
    del kept[1]
    m.decode_batch([(m, 9), (s, 9)])
    s.close()
    del m, s
    for k, c in zip(kept, [copies[0], copies[2]]):
        np.testing.assert_array_equal(k, c)


def test_decode_batch_refuses_bad_batches_and_changes_nothing(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=16, n_seq_max=3)
    s = m.session()
    m.eval(A)
    s.eval([1] * 16)  # every position used
    before = (m.n_past, s.n_past)
    with pytest.raises(ValueError, match="appears twice"):
        m.decode_batch([(m, 1), (m, 2)])
    with pytest.raises(ValueError, match="sequence 1 is full"):
        m.decode_batch([(m, 1), (s, 2)])
    assert (m.n_past, s.n_past) == before
    with pytest.raises(ValueError, match="token id"):
        m.decode_batch([(m, 10**6)])
    other = ggraph.Model(tiny_model, device="cpu", n_ctx=16)
    with pytest.raises(ValueError, match="this model or its session"):
        m.decode_batch([(other, 1)])
    s.close()
    with pytest.raises(ValueError, match="closed"):
        m.decode_batch([(s, 1)])
    assert m.n_past == before[0]


def test_decode_batch_steps_of_the_same_sessions_reuse_the_graph_exactly(tiny_model, device):
    """A batch of as many tokens runs the last batch's graph again with new slots and positions,
    also after a session moved otherwise in between (a rewind, an eval). Every step's logits
    equal each session's own (on the CPU, bit for bit)."""
    m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1, n_seq_max=3)
    s1, s2 = m.session(), m.session()
    seqs, prompts = [m, s1, s2], [A, B, A[:2]]
    refs = [ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1) for _ in seqs]
    for who, ref, p in zip(seqs, refs, prompts):
        who.eval(p)
        ref.eval(p)

    def step(tokens):
        got = m.decode_batch(list(zip(seqs, tokens)))
        # Three rows, though the step ran in the size class of four.
        assert got.shape == (3, m.n_vocab) and got.flags.c_contiguous
        for row, (ref, t) in enumerate(zip(refs, tokens)):
            if device == "cpu":
                np.testing.assert_array_equal(got[row], ref.eval([t]))
            else:
                np.testing.assert_allclose(got[row], ref.eval([t]), rtol=1e-5, atol=1e-5)

    for t in range(4):
        step([10 + t, 20 + t, 30 + t])
    s1.rewind(s1.n_past - 2)
    refs[1].rewind(refs[1].n_past - 2)
    step([1, 2, 3])
    s2.eval([9])
    refs[2].eval([9])
    for t in range(3):
        step([40 + t, 50 + t, 60 + t])


def test_decode_batch_of_sequences_of_very_different_lengths(tmp_path):
    """One token each of sequences from 1 to 700 positions long (one key chunk of 256 for
    some, three for others), in changing order and membership: each row is bit for bit its
    sequence's own step on the CPU."""
    from test_archs import N_VOCAB, write_arch

    path = tmp_path / "llama.gguf"
    write_arch(path, "llama", "F32", seed=3, meta={"context_length": ("uint32", 1024)})
    lens = [1, 300, 7, 700, 257]
    kw = dict(device="cpu", n_ctx=1024, n_batch=64, kv_type="f32")
    m = ggraph.Model(str(path), n_seq_max=len(lens), **kw)
    seqs = [m] + [m.session() for _ in lens[1:]]
    refs = [ggraph.Model(str(path), **kw) for _ in lens]
    for i, (s, r, n) in enumerate(zip(seqs, refs, lens, strict=True)):
        toks = [(13 * k + 7 * i + 3) % N_VOCAB for k in range(n)]
        s.eval(toks)
        r.eval(toks)
    for step in range(5):
        order = list(range(len(lens)))[:: -1 if step % 2 else 1]
        if step == 3:
            order = order[:-2]
        toks = [(10 + 7 * step + i) % N_VOCAB for i in order]
        got = m.decode_batch([(seqs[i], t) for i, t in zip(order, toks, strict=True)])
        for row, (i, t) in enumerate(zip(order, toks, strict=True)):
            np.testing.assert_array_equal(
                got[row], refs[i].eval([t]), err_msg=f"step {step} seq {i}"
            )


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_cuda_batches_pad_to_their_size_class_and_keep_each_rows_logits(tiny_model):
    """On CUDA a batch of 3, 5 or 6 sequences runs the graph of 4 or 8 tokens, the rest padding
    (stored nowhere): each row still equals its sequence's own step, and batches of one class
    share one executable."""
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=64, n_seq_max=6)
    seqs = [m] + [m.session() for _ in range(5)]
    refs = [ggraph.Model(tiny_model, device="cuda", n_ctx=64) for _ in seqs]
    for i, (s, r) in enumerate(zip(seqs, refs, strict=True)):
        s.eval(A[: 2 + i])
        r.eval(A[: 2 + i])
    m.reset_graph_stats()
    for step, members in enumerate([[0, 1, 2], [0, 1, 2, 3, 4], [5, 3, 1], [0, 1, 2, 3, 4, 5]]):
        toks = [(7 * step + i) % 300 + 1 for i in members]
        got = m.decode_batch([(seqs[i], t) for i, t in zip(members, toks, strict=True)])
        for row, (i, t) in enumerate(zip(members, toks, strict=True)):
            np.testing.assert_allclose(got[row], refs[i].eval([t]), rtol=1e-4, atol=1e-4)
    assert [s.n_past for s in seqs] == [2 + i + n for i, n in enumerate([3, 4, 3, 3, 2, 2])]
    stats = m.graph_stats
    assert (stats["batch4.captures"], stats["batch4.replays"]) == (1, 2)
    assert (stats["batch8.captures"], stats["batch8.replays"]) == (1, 2)


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [12, 20])
def test_cuda_batches_of_nine_and_more_run_the_tensor_core_product(tiny_model, n):
    """Batches of 9 to 64 sequences multiply the quantized weights on the tensor cores: up to 16
    on the warp-pipelined int8 kernel (the activation in 8-bit column tiles), from 17 on the
    kernel that decodes them to half (an activation in half, where a sequence's own step
    quantizes it to 8 bits). Each row stays within those roundings of its sequence's own step,
    and batches of one size class share one executable."""
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=64, n_seq_max=n)
    seqs = [m] + [m.session() for _ in range(n - 1)]
    refs = [ggraph.Model(tiny_model, device="cuda", n_ctx=64) for _ in seqs]
    for i, (s, r) in enumerate(zip(seqs, refs, strict=True)):
        s.eval(A[: 1 + i % len(A)])
        r.eval(A[: 1 + i % len(A)])
    m.reset_graph_stats()
    for step in range(3):
        toks = [(11 * step + 5 * i) % 300 + 1 for i in range(n)]
        got = m.decode_batch(list(zip(seqs, toks, strict=True)))
        for row, (ref, t) in enumerate(zip(refs, toks, strict=True)):
            want = ref.eval([t])
            err = np.linalg.norm(got[row] - want) / np.linalg.norm(want)
            assert err < 3e-2, f"step {step} row {row}: relative error {err:.2e}"
    stats = m.graph_stats
    size_class = 16 if n <= 16 else 32
    # A capture replays.
    assert (stats[f"batch{size_class}.captures"], stats[f"batch{size_class}.replays"]) == (1, 3)


def test_advance_batch_returns_one_generations_error_and_steps_the_others(tiny_model):
    # The server's engine steps every running generation in one call: a generation whose step
    # fails (here: its last token's logits were never fed) gets its exception back as a value,
    # and the others step on.
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_seq_max=2)
    s = m.session()
    ga, _ = m._begin([1, 2, 3], 4, [], None, ignore_eos=True, temperature=0)
    gb, _ = s._begin([4, 5, 6], 4, [], None, ignore_eos=True, temperature=0)
    # The prompts are left for the batch (no token yet); the next step evaluates them together
    # and samples each one's first token.
    steps, failed = _core.step_batch(m._ctx, [ga, gb])
    assert failed is None and [n for _, n, _ in steps] == [0, 0]
    assert ga.pending_token == 3 and gb.pending_token == 6
    first, failed = _core.step_batch(m._ctx, [ga, gb])
    assert failed is None
    assert [type(step) for step, _, _ in first] == [tuple, tuple]
    assert [n for _, n, _ in first] == [1, 1]
    assert ga.pending_token >= 0 and gb.pending_token >= 0
    # b's token evaluated and its row fed, a's left waiting.
    _core.feed_batch([gb], m._ctx.decode_batch([s._lock.seq], [gb.pending_token]))
    (a_step, a_n, _), (b_step, b_n, b_reason) = _core.advance_batch(m._ctx, [ga, gb])
    assert isinstance(a_step, RuntimeError) and "not fed" in str(a_step)
    assert a_n == 1
    assert isinstance(b_step, tuple) and b_n == 2 and b_reason is None
    # b's tokens are those a generation of its own takes.
    alone = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    steps = alone.generate([4, 5, 6], max_tokens=2, temperature=0, logprobs=0, ignore_eos=True)
    assert [first[1][0][1], b_step[1]] == [t.token for t in steps if t.token >= 0]


@pytest.mark.parametrize("prefill_chunk", [0, 2])
def test_step_batch_steps_each_generation_as_it_runs_alone(tiny_model, prefill_chunk):
    # The server's step (_core.step_batch): the tokens the generations left (sampled ones, and
    # the prompts, whole or in chunks, several tokens of one sequence in one batch) are
    # evaluated in one batched decode, then each generation advances. Three generations of
    # different prompts and lengths, stepped together until all end, give the tokens and ends
    # each gives alone; the third prompt is longer than a deferred chunk takes (it goes in
    # through the prompt path unless chunked).
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=128, n_seq_max=3)
    seqs = [m, m.session(), m.session()]
    prompts = ([1, 2, 3], [4, 5, 6, 7, 8], [(7 * i) % 300 + 1 for i in range(70)])
    lengths = (6, 3, 4)
    gens = [
        who._begin(p, n, [], None, ignore_eos=True, prefill_chunk=prefill_chunk, temperature=0)[0]
        for who, p, n in zip(seqs, prompts, lengths, strict=True)
    ]
    tokens, ends, live = [[], [], []], [None, None, None], [0, 1, 2]
    for _ in range(60):
        if not live:
            break
        steps, failed = _core.step_batch(m._ctx, [gens[i] for i in live])
        assert failed is None
        for i, (step, n, reason) in zip(list(live), steps, strict=True):
            if step is None:
                ends[i] = (n, reason)
                live.remove(i)
            else:
                assert not isinstance(step, BaseException), step
                if step[1] >= 0:  # (-1: held-back text, no token)
                    tokens[i].append(step[1])
    assert not live
    for i in range(3):
        alone = ggraph.Model(tiny_model, device="cpu", n_ctx=128)
        steps = alone.generate(
            list(prompts[i]), max_tokens=lengths[i], temperature=0, logprobs=0, ignore_eos=True
        )
        want = [t.token for t in steps if t.token >= 0]
        assert tokens[i] == want
        assert ends[i] == (lengths[i], "length")


def test_step_batch_runs_many_new_prompts_in_one_step(tiny_model):
    # New requests' prompts arrive together: more tokens in one step than a batch of one token
    # a sequence (here 3 x 34, in decode_batch calls of up to 64 tokens, a prompt split between
    # two). No step fails for want of buffers, and each generation gives its tokens alone.
    n, n_ctx = 3, 128
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=n_ctx, n_seq_max=n)
    seqs = [m] + [m.session() for _ in range(n - 1)]
    prompts = [[(13 * i + 7 * j) % 300 + 1 for j in range(34)] for i in range(n)]
    gens = [
        who._begin(p, 3, [], None, ignore_eos=True, temperature=0)[0]
        for who, p in zip(seqs, prompts, strict=True)
    ]
    tokens, live = [[] for _ in range(n)], list(range(n))
    for _ in range(10):
        if not live:
            break
        steps, failed = _core.step_batch(m._ctx, [gens[i] for i in live])
        assert failed is None, failed
        for i, (step, _, _) in zip(list(live), steps, strict=True):
            if step is None:
                live.remove(i)
            elif step[1] >= 0:
                tokens[i].append(step[1])
    assert not live
    with pytest.raises(ValueError, match="two generations on sequence"):
        _core.step_batch(m._ctx, [gens[0], gens[0]])
    alone = ggraph.Model(tiny_model, device="cpu", n_ctx=n_ctx)
    for i in range(n):
        steps = alone.generate(prompts[i], max_tokens=3, temperature=0, logprobs=0, ignore_eos=True)
        assert tokens[i] == [t.token for t in steps if t.token >= 0]


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("prompt_len", [8, 48, 64])
def test_cuda_prompt_in_the_batch_equals_its_eval(tmp_path, prompt_len):
    # A prompt that goes in through the server's batch (one sequence's tokens in one decode
    # batch, their K and V stored by the launch before the attention's, the last token's logits
    # gathered from the batch's rows) samples from its eval's logits and leaves the cache its
    # eval leaves. A GQA model of head_dim 64 takes the tensor-core decode attention, whose rows
    # before a token's sequence's first new one are read before the wait for the store; 48 and
    # 64 tokens cross its 32-key tiles.
    path = tmp_path / "gqa.gguf"
    write_random_gguf(
        path, shape="tiny", weight_type="F16", seed=1, std=0.1, n_embd=256, n_head=4,
        n_head_kv=2, n_ff=512, n_ctx=512,
    )  # fmt: skip
    m = ggraph.Model(path, device="cuda", n_ctx=512, n_seq_max=2)
    ref = ggraph.Model(path, device="cuda", n_ctx=512)
    rng = np.random.default_rng(prompt_len)
    for _ in range(4):
        prompt = [int(x) for x in rng.integers(3, 300, prompt_len)]
        gen = m._begin(prompt, 1, [], 3, ignore_eos=True, temperature=0)[0]
        first = None
        for _ in range(4):
            steps, failed = _core.step_batch(m._ctx, [gen])
            assert failed is None
            step = steps[0][0]
            if step is not None and step[1] >= 0:
                first = step
        assert first is not None and m.n_past == prompt_len + 1
        ref.reset()
        want = np.asarray(ref._ctx.eval(prompt, False), dtype=np.float64)
        lp = want - want.max() - np.log(np.exp(want - want.max()).sum())
        # The step's top logprobs are its eval's (near-ties may order differently).
        third = np.sort(lp)[-3]
        for t, v in first[3]:
            assert abs(v - lp[t]) < 2e-2 and lp[t] > third - 4e-2, (t, v, lp[t])
        assert lp[first[1]] > lp.max() - 4e-2
        got = np.asarray(m._ctx.eval([5], False))
        ref.reset()
        want = np.asarray(ref._ctx.eval(prompt + [first[1], 5], False))
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-2, f"relative error {err:.2e}"


def test_a_copied_prefix_continues_as_the_prompt_evaluated(tiny_model, device):
    m = ggraph.Model(tiny_model, device=device, n_ctx=64, n_threads=1, n_seq_max=4)
    s, t = m.session(), m.session()
    s.eval(A)
    t.eval(B)  # a history of its own, which the copy replaces
    t.copy_prefix(s, 6)
    assert (t.n_past, t._tokens) == (6, A[:6])
    got = [t.eval([4, 4]), t.eval([9])]
    # A session that evaluates the same prompt in the same call (on CUDA a prompt's kernels
    # follow its length), keeps 6 tokens, then makes the same calls: the same bits.
    u = m.session()
    u.eval(A)
    u.rewind(6)
    want = [u.eval([4, 4]), u.eval([9])]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # The source goes on as before.
    assert s._tokens == A
    np.testing.assert_array_equal(s.eval([3]), _alone(tiny_model, device, A, [3])[1])


def test_copy_prefix_refuses_what_it_cannot_copy_and_changes_nothing(tiny_model, tmp_path):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_seq_max=4)
    s, t = m.session(), m.session()
    s.eval(A)
    t.eval(B)
    other = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    other.eval(A)
    closed = m.session()
    closed.close()
    for source, n, says in [
        (t, 2, "another"),
        (s, len(A) + 1, "length"),
        (s, -1, "length"),
        (other, 2, "same model"),
        (closed, 0, "closed"),
    ]:
        with pytest.raises(ValueError, match=says):
            t.copy_prefix(source, n)
        assert t._tokens == B
    np.testing.assert_array_equal(t.eval([6]), _alone(tiny_model, "cpu", B, [6])[1])
    # Sliding-window layers keep rings of other positions than a prefix.
    path = tmp_path / "gemma3.gguf"
    write_arch(path, "gemma3", "F32", seed=3)
    g = ggraph.Model(str(path), device="cpu", n_ctx=64, n_seq_max=2)
    h = g.session()
    g.eval([1, 2, 3])
    with pytest.raises(ValueError, match="sliding-window"):
        h.copy_prefix(g, 2)


def test_cancel_stops_a_sessions_eval_that_waits_for_the_model(smollm2):
    """An eval waiting for another call on the model is in progress: cancel() meanwhile stops
    it (before its second chunk), and the other call goes on to its end."""
    m = ggraph.Model(smollm2, device="cpu", n_ctx=2048, n_threads=1, n_seq_max=2)
    s = m.session()
    out = {}

    def run(name, seq, n):
        try:
            seq.eval([100 + i % 1000 for i in range(n)])
            out[name] = "done"
        except ggraph.Cancelled:
            out[name] = "cancelled"

    first = threading.Thread(target=run, args=("model", m, 1100))  # seconds on one thread
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=run, args=("session", s, 600))  # two chunks
    second.start()
    time.sleep(0.3)  # the session's eval waits for the model's
    assert first.is_alive()
    s.cancel()
    first.join()
    second.join()
    assert out == {"model": "done", "session": "cancelled"}
    assert (m.n_past, s.n_past) == (1100, 0)


def test_closing_a_session_under_its_suspended_generator_leaves_the_generator_quiet(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64, n_threads=1, n_seq_max=2)
    s = m.session()
    g = s.generate([1, 2], max_tokens=10, temperature=0)
    next(g)
    s.close()
    g.close()  # nothing to put back: the session is gone
    with m.session() as s2:
        for _ in s2.generate([1, 2], max_tokens=10, temperature=0):
            break


def test_a_signal_handler_reading_the_model_leaves_a_sessions_eval_its_own(smollm2):
    """Python runs signal handlers between an eval's chunks, under the model's (re-entrant)
    lock: a handler that reads the model selects its sequence, and the session's eval must get
    its own back."""
    import signal

    m = ggraph.Model(smollm2, device="cpu", n_ctx=256, n_batch=4, n_threads=1, n_seq_max=2)
    s = m.session()
    prompt = list(range(1000, 1200))
    ref = s.eval(prompt).copy()
    s.reset()
    reads = []
    old = signal.signal(signal.SIGALRM, lambda *a: reads.append(m.n_past))
    signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
    try:
        out = s.eval(prompt)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert reads  # the handler ran during the eval
    assert (s.n_past, m.n_past) == (200, 0)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8_0"])
def test_decode_batch_over_each_cache_type_gives_each_sequences_own_bits(tmp_path, kv_type):
    """A CPU decode batch of eight on two threads takes every KV head of a sequence in one
    attention task (its cache rows read, or decoded, once), over every cache type; each sequence's
    logits are the bits of its own step, one head a task. Heads 32 wide, two KV heads: a Q8_0
    head is one block."""
    from ggraph.testing import write_random_gguf

    path = str(tmp_path / "heads32.gguf")
    write_random_gguf(
        path, shape="tiny", weight_type="Q4_1", seed=5, n_embd=128, n_head=4, n_head_kv=2
    )
    m = ggraph.Model(path, device="cpu", n_ctx=96, n_threads=2, n_seq_max=8, kv_type=kv_type)
    seqs = [m] + [m.session() for _ in range(7)]
    prompts = [[1 + (i * 7 + j) % 50 for j in range(5 + 9 * i)] for i in range(8)]
    for who, p in zip(seqs, prompts):
        who.eval(p)
    batch = m.decode_batch([(who, 11) for who in seqs])
    for row, p in enumerate(prompts):
        ref = ggraph.Model(path, device="cpu", n_ctx=96, n_threads=1, kv_type=kv_type)
        ref.eval(p)
        np.testing.assert_array_equal(batch[row], ref.eval([11]))
