"""Sliding-window layers over a ring of window + n_batch - 1 KV rows: the same logits as a full
cache and as the float64 forward pass, across wraps, rewinds, saved states and sessions."""

import numpy as np
import pytest
from test_archs import N_VOCAB, _devices, _rel, reference_logits, write_arch

import ggraph

# A conversation several times longer than the windows (5 for gemma3, 6 for phi3), so that the
# rings (window + n_batch - 1 rows) wrap many times.
TOKENS = [(17 * i + 5) % N_VOCAB for i in range(90)]
N_CTX = 128


def _model(path, device, n_batch, swa_full=False, **kw):
    kw.setdefault("kv_type", "f32" if device == "cpu" else "f16")
    return ggraph.Model(
        str(path), device=device, n_ctx=N_CTX, n_batch=n_batch, swa_full=swa_full, **kw
    )


def _feed(m, tokens, sizes):
    """all-position logits of tokens fed in calls of the given sizes, then one at a time."""
    out, i = [], 0
    for n in sizes:
        out.append(m.eval(tokens[i : i + n], all_logits=True))
        i += n
    out += [m.eval([t])[None, :] for t in tokens[i:]]
    return np.concatenate(out)


@pytest.fixture(scope="module", params=["gemma3", "phi3"])
def arch_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ring") / f"{request.param}.gguf"
    return request.param, path, write_arch(path, request.param, "F32", seed=11)


def test_a_ring_holds_fewer_rows(arch_file):
    arch, path, _ = arch_file
    ring = _model(path, "cpu", n_batch=4)
    full = _model(path, "cpu", n_batch=4, swa_full=True)
    # gemma3: five of its six layers are windowed; phi3: both of its two.
    windowed = 5 if arch == "gemma3" else 2
    layers = 6 if arch == "gemma3" else 2
    window = 5 if arch == "gemma3" else 6
    row = full.kv_bytes // (layers * N_CTX)
    assert full.kv_bytes == layers * N_CTX * row
    assert ring.kv_bytes == (layers - windowed) * N_CTX * row + windowed * (window + 3) * row


@pytest.mark.parametrize("device", _devices())
def test_ring_equals_full_cache_and_the_reference(arch_file, device):
    # n_batch 16: prompt chunks take the prompt kernels (over 8 tokens on CUDA) and wrap the
    # ring mid-chunk; then single steps wrap it one row at a time.
    arch, path, w = arch_file
    sizes = [16, 16, 16, 7, 3]
    ring = _feed(_model(path, device, 16), TOKENS, sizes)
    full = _feed(_model(path, device, 16, swa_full=True), TOKENS, sizes)
    # The same rows at other addresses: the same sums, bit for bit.
    np.testing.assert_array_equal(ring, full)
    if device == "cpu":  # an F32 cache, as the reference keeps K and V
        ref = reference_logits(arch, w, np.array(TOKENS))
        for pos in range(len(TOKENS)):
            assert _rel(ring[pos], ref[pos]) < 1e-4, f"{arch} position {pos}"


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_ring_equals_full_cache_in_every_cpu_cache_type(arch_file, kv_type):
    # F16 and Q8_0 rows are decoded position by position, wrapped or not.
    arch, path, _ = arch_file
    if kv_type == "q8_0" and arch == "phi3":
        pytest.skip("phi3's tiny heads (16 wide) are not whole Q8_0 blocks")
    sizes = [16, 16, 16, 7, 3]
    ring = _feed(_model(path, "cpu", 16, kv_type=kv_type), TOKENS, sizes)
    full = _feed(_model(path, "cpu", 16, swa_full=True, kv_type=kv_type), TOKENS, sizes)
    np.testing.assert_array_equal(ring, full)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.9, seed=5)])
def test_chains_over_rings_give_the_tokens_of_a_step_at_a_time(
    arch_file, device, settings, tmp_path
):
    # 60 tokens after a 10-token prompt wrap the rings many times inside chains of 8 and, on
    # CUDA, inside a loop's rounds (chain 64: rounds of 8 on the device).
    arch = arch_file[0]
    path = tmp_path / f"{arch}-vocab.gguf"
    write_arch(path, arch, "F32", seed=11, vocab=True)
    runs = []
    for chain in (1, 8, 64):
        m = _model(path, device, 16)
        steps = m.generate(
            TOKENS[:10], max_tokens=60, ignore_eos=True, logprobs=0, chain=chain, **settings
        )
        got = [t.token for t in steps if t.token >= 0]
        runs.append((got, m.n_past, m.eval([3])))
    (want, past, logits), *others = runs
    assert len(want) == 60
    for got, got_past, got_logits in others:
        assert got == want
        assert got_past == past
        np.testing.assert_allclose(got_logits, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", _devices())
def test_rewind_past_the_ring_reevaluates_what_it_keeps(arch_file, device):
    arch, path, _ = arch_file
    m = _model(path, device, 4)
    m.eval(TOKENS[:60])
    m.rewind(20)  # rows of positions 20 - window .. 19 were overwritten long ago
    assert m.n_past == 20
    got = m.eval(TOKENS[40:50], all_logits=True)
    fresh = _model(path, device, 4)
    fresh.eval(TOKENS[:20])
    np.testing.assert_array_equal(got, fresh.eval(TOKENS[40:50], all_logits=True))
    # A rewind the ring still covers needs nothing re-evaluated, and gives the same logits.
    m.rewind(28)
    fresh.rewind(28)
    np.testing.assert_array_equal(m.eval([TOKENS[3]]), fresh.eval([TOKENS[3]]))


@pytest.mark.parametrize("device", _devices())
def test_states_move_between_rings_and_full_caches(arch_file, device):
    arch, path, _ = arch_file
    a = _model(path, device, 4)
    a.eval(TOKENS[:70])
    state = a.save_state()
    expected = [a.eval([t]) for t in TOKENS[70:80]]
    full = _model(path, device, 4, swa_full=True)
    full.eval(TOKENS[:70])
    full_state = full.save_state()
    assert len(state) < len(full_state)  # a ring saves the rows it keeps
    # Into another ring, into a longer ring (n_batch 8) and into a full cache: the rows the state
    # lacks are rebuilt where needed, and decoding continues with the same logits.
    for target in (
        _model(path, device, 4),
        _model(path, device, 8),
        _model(path, device, 4, swa_full=True),
    ):
        target.load_state(state)
        assert target.n_past == 70
        got = [target.eval([t]) for t in TOKENS[70:80]]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * np.abs(e).max())
    # A full cache's state loads into a ring, which keeps the last rows.
    b = _model(path, device, 4)
    b.load_state(full_state)
    got = [b.eval([t]) for t in TOKENS[70:80]]
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-5 * np.abs(e).max())


@pytest.mark.parametrize("device", _devices())
def test_sessions_decode_together_over_rings(arch_file, device):
    arch, path, _ = arch_file
    m = _model(path, device, 4, n_seq_max=3)
    s1, s2 = m.session(), m.session()
    m.eval(TOKENS[:9])
    s1.eval(TOKENS[20:23])
    s2.eval(TOKENS[40:53])
    alone = [_model(path, device, 4) for _ in range(3)]
    alone[0].eval(TOKENS[:9])
    alone[1].eval(TOKENS[20:23])
    alone[2].eval(TOKENS[40:53])
    # CUDA's batch runs its products over three columns, a step alone over one: other kernels,
    # other orders of the sums.
    bound = 1e-5 if device == "cpu" else 1e-4
    for step in range(30):
        toks = [TOKENS[(step * 3 + k) % len(TOKENS)] for k in range(3)]
        batch = m.decode_batch([(m, toks[0]), (s1, toks[1]), (s2, toks[2])])
        for k in range(3):
            one = alone[k].eval([toks[k]])
            assert _rel(batch[k], one) < bound, f"{arch} sequence {k} step {step}"


def test_a_batch_repairs_a_rewound_session_despite_a_stale_cancel(arch_file):
    # A session rewound past its ring, with a cancel request left over from an earlier
    # operation: the batch re-evaluates its tokens and decodes.
    arch, path, _ = arch_file
    m = _model(path, "cpu", 4, n_seq_max=2)
    s = m.session()
    m.eval(TOKENS[:10])
    s.eval(TOKENS[:60])
    s.rewind(20)
    s.cancel()
    got = m.decode_batch([(m, TOKENS[10]), (s, TOKENS[20])])
    assert m.n_past == 11 and s.n_past == 21
    alone = _model(path, "cpu", 4)
    alone.eval(TOKENS[:20])
    np.testing.assert_array_equal(got[1], alone.eval([TOKENS[20]]))


def test_a_ring_state_with_bad_first_positions_is_refused(arch_file):
    # The layers' first kept positions follow the tokens: a first past the state's tokens, or a
    # global layer's (gemma3's sixth) past 0, is a clear error that changes nothing.
    arch, path, _ = arch_file
    m = _model(path, "cpu", 4)
    m.eval(TOKENS[:30])
    state = m.save_state()
    header, n_layer = 40, 6 if arch == "gemma3" else 2
    firsts = header + 30 * 4
    target = _model(path, "cpu", 4)
    target.eval(TOKENS[:3])

    def with_first(layer, value):
        at = firsts + 4 * layer
        return state[:at] + value.to_bytes(4, "little") + state[at + 4 :]

    bad = [(with_first(0, 31), "rows start at position 31; expected at most 30")]
    if arch == "gemma3":
        bad.append((with_first(5, 1), "layer 5's rows start at position 1; expected 0"))
    bad.append((state[: firsts + 4 * n_layer], "bytes"))
    for data, match in bad:
        with pytest.raises(ValueError, match=match):
            target.load_state(data)
        assert target.n_past == 3
    target.load_state(state)
    np.testing.assert_array_equal(target.eval([TOKENS[30]]), m.eval([TOKENS[30]]))
