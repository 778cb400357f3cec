"""Sampled chains (Context::decode_sampled, the Sample op): several decode steps a launch, each
sampling the next step's token on the backend, give the tokens that evaluating and sampling a
token at a time on the host gives."""

import numpy as np
import pytest
from conftest import cuda_available, smollm2_path

import ggraph

DEVICES = ["cpu"] + (["cuda"] if cuda_available() else [])

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3),
    dict(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0, seed=4),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=5),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=6),
    dict(temperature=0.7, repeat_penalty=1.3, frequency_penalty=0.2, penalty_last_n=16, seed=7),
    dict(temperature=0.7, presence_penalty=0.5, penalty_last_n=-1, seed=8),
]


def tokens_of(model, prompt, chain, max_tokens=40, **sampling):
    model.reset()
    out = [
        (t.token, t.logprob)
        for t in model.generate(
            prompt, max_tokens=max_tokens, logprobs=0, ignore_eos=True, chain=chain, **sampling
        )
        if t.token >= 0
    ]
    # What the context holds: its length, and the logits of one more token after it.
    return out, (model.n_past, model.eval([3]).tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("chain", [2, 5, 16, 64])
def test_a_chain_gives_the_tokens_of_one_step_at_a_time(tiny_model, device, settings, chain):
    # (64: on CUDA, a loop of five rounds of eight steps, the last ending after seven; the CPU
    # runs chains of 16.)
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    prompt = [1, 17, 42, 99, 7]
    one, ctx_one = tokens_of(m, prompt, 1, **settings)
    chained, ctx_chained = tokens_of(m, prompt, chain, **settings)
    assert [t for t, _ in chained] == [t for t, _ in one]
    for (_, a), (_, b) in zip(chained, one):
        assert a == pytest.approx(b, abs=2e-4)
    # The context holds what a step at a time leaves: the prompt and every generated token.
    assert ctx_chained[0] == ctx_one[0]
    assert ctx_chained[1] == pytest.approx(ctx_one[1], abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_stops_rewind_what_a_chain_evaluated_past_them(tiny_model, device):
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    prompt = [1, 5, 6]
    full, _ = tokens_of(m, prompt, 1, max_tokens=12, temperature=0.0)
    m.reset()
    m.eval(prompt[:-1])
    # A length limit inside a chain, and a context that fills inside one.
    for chain in (4, 16):
        got, ctx = tokens_of(m, prompt, chain, max_tokens=6, temperature=0.0)
        assert [t for t, _ in got] == [t for t, _ in full[:6]]
        assert ctx[0] == len(prompt) + 6
    # No token asked for: the prompt is all in, as a step at a time leaves it.
    for chain in (1, 8):
        m.reset()
        assert list(m.generate(prompt, max_tokens=0, chain=chain)) == []
        assert m.n_past == len(prompt)
    small = ggraph.Model(tiny_model, device=device, n_ctx=10)
    small.reset()
    out = list(small.generate(prompt, max_tokens=50, temperature=0.0, chain=16, ignore_eos=True))
    assert small.stop_reason == "context_full"
    assert small.n_past <= 10
    assert "".join(out) == "".join(
        ggraph.Model(tiny_model, device=device, n_ctx=10).generate(
            prompt, max_tokens=50, temperature=0.0, chain=1, ignore_eos=True
        )
    )


# Greedy steps whose top two logits lie within this of each other on the CPU: the two backends
# round differently (8-bit activations in other kernels, other orders of summation), and their
# logits of the real SmolLM2 differ by up to ~1 at a step, ~0.3 in the top two's difference, so
# either may take the other token there. llama.cpp's own data sets the bars likewise (the golden
# README: teacher-forced agreement, not a whole greedy text).
NEAR_TIE = 0.5


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.skipif(smollm2_path() is None, reason="needs the real SmolLM2 file")
def test_cuda_chains_on_the_real_model_agree_with_the_cpu_reference_greedy():
    path = smollm2_path()
    prompt = "The capital of France is"
    ref = ggraph.Model(path, device="cpu")
    gpu = ggraph.Model(path, device="cuda")
    want, _ = tokens_of(ref, prompt, 1, max_tokens=24, temperature=0.0)
    one, _ = tokens_of(gpu, prompt, 1, max_tokens=24, temperature=0.0)
    got, _ = tokens_of(gpu, prompt, 8, max_tokens=24, temperature=0.0)
    want, one, got = ([t for t, _ in x] for x in (want, one, got))
    # A chain is the same computation as steps one at a time, on the same backend: exact.
    assert got == one
    # Teacher-forced on the CPU's tokens, a decode step at a time: wherever the CPU's choice is
    # clear, the GPU makes it too.
    ref.reset()
    gpu.reset()
    ids = ref.tokenize(prompt)
    lc, lg = ref.eval(ids), gpu.eval(ids)
    ties = []
    for i, tok in enumerate(want):
        assert int(np.argmax(lc)) == tok  # the CPU's greedy text is its own argmax
        top2 = np.sort(lc)[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            ties.append(i)
        else:
            assert int(np.argmax(lg)) == tok, f"step {i}: CPU margin {top2[1] - top2[0]:.3f}"
        lc, lg = ref.eval([tok]), gpu.eval([tok])
    assert len(ties) <= len(want) // 2, f"near-ties at {ties}: too few clear steps to judge"
    # Free-running, the GPU's text is the CPU's up to the CPU's first near-tie.
    first_tie = ties[0] if ties else len(want)
    assert got[:first_tie] == want[:first_tie], f"near-ties at {ties}"


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.skipif(smollm2_path() is None, reason="needs the real SmolLM2 file")
@pytest.mark.parametrize("settings", SETTINGS[1:])
def test_cuda_sampling_over_a_real_vocabulary_equals_the_host_samplers(settings):
    # 49,152 tokens: the device sampler's tiles and lists, against the host sampler over the same
    # device logits (a chain of one).
    gpu = ggraph.Model(smollm2_path(), device="cuda")
    prompt = gpu.tokenize("Once upon a time")
    one, _ = tokens_of(gpu, prompt, 1, max_tokens=48, **settings)
    chained, _ = tokens_of(gpu, prompt, 8, max_tokens=48, **settings)
    assert [t for t, _ in chained] == [t for t, _ in one]


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "chain, launches, classes, skipped",
    [
        # The prompt's new token (one step; the first token is sampled from its logits), seven
        # chains of eight steps and one of seven for the other 63 tokens, then the last token's
        # own step (as a step at a time ends).
        (8, 10, {"chain8": 7, "chain7": 1}, 0),
        # The same tokens with a loop of eight rounds of eight steps in one launch, the last
        # round's last step skipped on the device.
        (64, 3, {"loop8": 1}, 1),
    ],
)
def test_graph_stats_count_the_tokens_of_each_launch(tiny_model, chain, launches, classes, skipped):
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
    m.eval([1, 2, 3])
    m.reset_graph_stats()
    gen = m.generate([1, 2, 3, 4], max_tokens=64, temperature=0.0, chain=chain, ignore_eos=True)
    assert len("".join(gen)) > 0
    s = m.graph_stats
    assert s["tokens"] == 1 + 63 + 1
    assert s["replays"] == launches
    for name, replays in classes.items():
        assert s[f"{name}.replays"] == replays
    assert s["tokens_per_launch"] == pytest.approx(65 / launches)
    assert s["kernels_per_token"] > 0
    assert s.get("chain_steps_skipped", 0) == skipped


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[1], SETTINGS[5]])
def test_loops_of_every_length_run_in_one_graph(tiny_model, settings):
    # A generation of loops (the default on CUDA) ends each launch at its last token on the
    # device, a last round part-way: 2 to 41 tokens, whole rounds and parts of them, give the
    # tokens and the context of a step at a time, and one loop graph serves every length.
    prompt = [1, 17, 42, 99, 7]
    ref = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
    for n in (2, 3, 9, 10, 17, 24, 25, 31, 41):
        want, want_ctx = tokens_of(ref, prompt, 1, max_tokens=n, **settings)
        got, got_ctx = tokens_of(m, prompt, 256, max_tokens=n, **settings)
        assert [t for t, _ in got] == [t for t, _ in want], n
        assert got_ctx[0] == want_ctx[0], n
        assert got_ctx[1] == pytest.approx(want_ctx[1], abs=1e-4), n
    s = m.graph_stats
    assert s["loop8.captures"] == 1
    assert not any(k.startswith("chain") and k.endswith(".captures") for k in s), s
    # Near the context's end, where a round's steps would pass it, a short launch is a chain.
    m.reset()
    near = [5] * 250
    kw = dict(max_tokens=5, logprobs=0, ignore_eos=True, **settings)
    got = [t.token for t in m.generate(near, chain=256, **kw) if t.token >= 0]
    want = [t.token for t in ref.generate(near, chain=1, **kw) if t.token >= 0]
    assert got == want and m.n_past == ref.n_past
    assert m.graph_stats["loop8.captures"] == 1


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("prompt_len", [3, 4, 9, 20])
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[1]])
def test_loops_run_to_the_contexts_end(tiny_model, prompt_len, settings):
    # A loop's whole rounds must fit the context: near its end, a generation of loops launches
    # the rounds that fit, then a chain of the rest. The tokens, the stop and the context are
    # a step at a time's.
    prompt = [(7 * i) % 250 + 3 for i in range(prompt_len)]
    kw = dict(max_tokens=100, logprobs=0, ignore_eos=True, **settings)
    ref = ggraph.Model(tiny_model, device="cuda", n_ctx=32)
    want = [t.token for t in ref.generate(prompt, chain=1, **kw) if t.token >= 0]
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=32)
    got = [t.token for t in m.generate(prompt, **kw) if t.token >= 0]
    assert got == want
    assert m.stop_reason == ref.stop_reason == "context_full"
    assert m.n_past == ref.n_past
    assert m.graph_stats["loop8.replays"] >= 1


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_a_loop_is_refused_where_it_cannot_run(tiny_model):
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
    with pytest.raises(ValueError, match="chain must be 1 to 256"):
        list(m.generate([1, 2, 3], max_tokens=4, chain=257))
    # Graph modes without conditional nodes run chains of at most 16 steps instead.
    for mode in ("off", "update"):
        u = ggraph.Model(tiny_model, device="cuda", n_ctx=256, cuda_graphs=mode)
        want, _ = tokens_of(m, [1, 2, 3], 1, max_tokens=30, temperature=0.0)
        got, _ = tokens_of(u, [1, 2, 3], 64, max_tokens=30, temperature=0.0)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert not any(k.startswith("loop") for k in u.graph_stats)


def _modes(device):
    return ["off", "update", "recapture", "patch"] if device == "cuda" else [None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chain", [4, 8, 16, 64])
@pytest.mark.parametrize("after", [2, 12])
def test_a_chain_ends_at_an_end_of_generation_token(tiny_model, tmp_path, device, chain, after):
    from ggraph.testing import Typed, write_random_gguf

    prompt = [1, 17, 42, 99, 7]
    n = 40
    free = [
        t.token
        for t in ggraph.Model(tiny_model, device=device, n_ctx=256).generate(
            prompt, max_tokens=n, temperature=0.0, ignore_eos=True, chain=1, logprobs=0
        )
    ]
    # The same weights with a token the greedy text first reaches `after` steps in or later as
    # the end of generation: a chain's later steps are skipped where the graph has conditional
    # steps (with chain 64, in the first round of a loop of four or in a later one).
    at = next((i for i in range(after, len(free)) if free[i] not in free[:i]), None)
    if at is None:
        pytest.skip(f"the greedy text reaches no new token after step {after}")
    path = str(tmp_path / "eos.gguf")
    write_random_gguf(
        path,
        shape="tiny",
        weight_type="Q4_1",
        seed=1,
        metadata={"tokenizer.ggml.eos_token_id": Typed("uint32", free[at])},
    )
    ref = ggraph.Model(path, device=device, n_ctx=256)
    want = [
        t.token for t in ref.generate(prompt, max_tokens=n, temperature=0.0, chain=1, logprobs=0)
    ]
    assert ref.stop_reason == "eos"
    assert want[:at] == free[:at]
    want_ctx = (ref.n_past, ref.eval([3]).tolist())
    for mode in _modes(device):
        kw = {"cuda_graphs": mode} if mode else {}
        m = ggraph.Model(path, device=device, n_ctx=256, **kw)
        got = [
            t.token
            for t in m.generate(prompt, max_tokens=n, temperature=0.0, chain=chain, logprobs=0)
        ]
        assert got == want, mode
        assert m.stop_reason == "eos"
        # The context a step at a time leaves: the prompt and the tokens before the end.
        assert m.n_past == want_ctx[0]
        skipped = m.graph_stats.get("chain_steps_skipped", 0) if device == "cuda" else 0
        assert m.eval([3]).tolist() == pytest.approx(want_ctx[1], abs=1e-4)
        # The first token comes from the prompt's logits, the others from chains of at most
        # `chain` steps (fewer where max_tokens ends one): the steps after the end's are
        # skipped in the modes that have conditional steps.
        # A loop (chain 64 in those modes: five rounds of eight steps for the 39 tokens after
        # the first, the last one's last step skipped for the length) counts the steps of its
        # last round.
        per = 8 if chain > 16 else chain
        start = 1 + (at - 1) // per * per
        steps = 8 if chain > 16 else min(per, n - start)
        expected = steps - 1 - (at - start) if mode in ("patch", "recapture") else 0
        assert skipped == expected, mode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stop_after", [1, 3, 8, 9])
def test_a_loop_left_early_leaves_the_context_of_a_step_at_a_time(tiny_model, device, stop_after):
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    prompt = [1, 17, 42, 99, 7]
    states = []
    for chain in (1, 8):
        m.reset()
        got = []
        for step in m.generate(
            prompt, max_tokens=40, logprobs=0, ignore_eos=True, chain=chain, temperature=0.0
        ):
            got.append(step.token)
            if len(got) == stop_after:
                break
        states.append((got, m.n_past, m.eval([3]).tolist()))
    (one, past_one, next_one), (chained, past_chained, next_chained) = states
    assert chained == one
    assert past_chained == past_one == len(prompt) + stop_after
    assert next_chained == pytest.approx(next_one, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_chain_graphs_of_each_length_serve_again_at_other_positions(tiny_model, device):
    # 13 tokens: chains of 8 and 4 (and the last token's own step); the next generations find
    # those graphs built and shift them to their own positions.
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    ref = ggraph.Model(tiny_model, device=device, n_ctx=256)
    for prompt in ([1, 5, 9], [2, 4, 6, 8, 10, 12, 14], [3]):
        settings = dict(max_tokens=13, temperature=0.9, top_k=20, seed=len(prompt))
        want, ctx_want = tokens_of(ref, prompt, 1, **settings)
        got, ctx_got = tokens_of(m, prompt, 8, **settings)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert ctx_got[0] == ctx_want[0]


def test_sample_after_a_generation_asks_for_an_eval(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=128, n_threads=1)
    m.eval([1, 2, 3])
    m.sample(temperature=0)
    list(m.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="no logits"):
        m.sample(temperature=0)


HELD_PROMPT = [1, 17, 42, 99, 7]
HELD_SETTINGS = dict(max_tokens=24, logprobs=0, ignore_eos=True, temperature=0.8, top_k=40, seed=3)


def held(model, chain, n):
    """A generation of HELD_PROMPT from an empty context, left after n tokens: (it, tokens)."""
    model.reset()
    gen = model.generate(HELD_PROMPT, chain=chain, **HELD_SETTINGS)
    return gen, [next(gen).token for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stop_after", [1, 3, 8, 9, 12])
def test_a_held_generator_between_steps_shows_the_context_of_a_step_at_a_time(
    tiny_model, device, stop_after
):
    # A loop broken out of while its generator is still referenced: the chain's look-ahead is
    # taken back before anything reads or changes the context, and the generator goes on with
    # the tokens it would have given (the same draws).
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    runs = []
    for chain in (1, 8):
        gen, got = held(m, chain, stop_after)
        seen = (m.n_past, m._tokens, len(m.save_state()))
        rest = [t.token for t in gen if t.token >= 0]
        gen, _ = held(m, chain, stop_after)
        after = m.eval([3]).tolist()  # the generator is still referenced
        runs.append((got, seen, rest, after))
        del gen
    (got1, seen1, rest1, after1), (got8, seen8, rest8, after8) = runs
    assert got8 == got1
    assert seen8 == seen1
    assert seen8[:2] == (len(HELD_PROMPT) + stop_after, HELD_PROMPT + got8)
    assert rest8 == rest1 and len(got8 + rest8) == 24
    assert after8 == pytest.approx(after1, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chain", [8, 64])
def test_reads_between_every_step_leave_a_chain_its_tokens(tiny_model, device, chain):
    # With chain 64 on CUDA each read lands a loop in flight: halted, its look-ahead rewound.
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    prompt = [2, 30, 31]
    settings = dict(max_tokens=40, logprobs=0, ignore_eos=True, temperature=1.0, seed=11)
    want = [t.token for t in m.generate(prompt, chain=1, **settings) if t.token >= 0]
    got = []
    for t in m.generate(prompt, chain=chain, **settings):
        if t.token >= 0:
            got.append(t.token)
            assert m.n_past == len(prompt) + len(got)
            assert m.n_past == len(prompt) + len(got)  # a second settle changes nothing
    assert got == want
    assert m._tokens == prompt + want


@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
@pytest.mark.parametrize("settings", [SETTINGS[0], SETTINGS[1]])
def test_a_stop_string_halts_the_loop_in_flight(tiny_model, settings):
    # A loop of up to 256 tokens whose tokens the host takes as the rounds make them: a stop
    # string found early halts the loop a round or two later instead of running all the tokens
    # asked for, and what it ran past is rewound.
    m = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
    prompt = [1, 17, 42, 99, 7]
    n = 240
    pieces = list(m.generate(prompt, max_tokens=n, ignore_eos=True, chain=1, **settings))
    text = "".join(pieces)
    # A stop string that first appears in the text of step 20 or later.
    starts = [len("".join(pieces[:i])) for i in range(len(pieces))]
    at = next((i for i in range(20, 60) if pieces[i] and text.find(pieces[i]) == starts[i]), None)
    if at is None:
        pytest.skip("no piece of the text between steps 20 and 60 appears there first")
    stop = pieces[at]
    ref = ggraph.Model(tiny_model, device="cuda", n_ctx=256)
    want = "".join(
        ref.generate(prompt, max_tokens=n, stop=stop, ignore_eos=True, chain=1, **settings)
    )
    assert ref.stop_reason == "stop"
    m.reset()
    m.reset_graph_stats()
    got = "".join(
        m.generate(prompt, max_tokens=n, stop=stop, ignore_eos=True, chain=256, **settings)
    )
    assert got == want
    assert m.stop_reason == "stop"
    assert m.n_past == ref.n_past
    assert m.eval([3]).tolist() == pytest.approx(ref.eval([3]).tolist(), abs=1e-3)
    s = m.graph_stats
    assert s["loop8.replays"] >= 1
    # The prompt, the tokens through the stop and at most a few rounds past them; without the
    # halt, the loop would have run on to all 240 (as the context allows).
    assert s["tokens"] - len(prompt) <= at + 1 + 4 * 8, s["tokens"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_new_generation_settles_the_one_left_between_steps(tiny_model, device):
    # A generation started (and not stepped) while another is held between steps: the held
    # one's look-ahead is gone before anything reads the context.
    m = ggraph.Model(tiny_model, device=device, n_ctx=256)
    seen = []
    for chain in (1, 8):
        gen, got = held(m, chain, 3)
        m.generate([5, 6], max_tokens=4)  # made, never stepped
        seen.append((got, m.n_past, m._tokens, m.eval([3]).tolist()))
        del gen
    (got1, past1, toks1, next1), (got8, past8, toks8, next8) = seen
    assert got8 == got1
    assert past8 == past1 == len(HELD_PROMPT) + 3
    assert toks8 == toks1 == HELD_PROMPT + got1
    assert next8 == pytest.approx(next1, abs=1e-4)
