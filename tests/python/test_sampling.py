"""The sampler chain (penalties, top-k, top-p, min-p, temperature) against a plain numpy
reference that sorts everything and works in float64."""

import math

import numpy as np
import pytest

import ggraph

DEFAULTS = dict(
    temperature=0.8,
    top_k=40,
    top_p=0.95,
    min_p=0.05,
    repeat_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    penalty_last_n=64,
    history=[],
)
# Every filter off: the draw is from softmax(logits / temperature).
UNFILTERED = dict(top_k=0, top_p=1.0, min_p=0.0)


def sample(logits, seed, **params):
    merged = {**DEFAULTS, **params}
    return ggraph.sample(np.asarray(logits, dtype=np.float32), seed=seed, **merged)


def draws(logits, n, **params):
    """n tokens from n seeds: independent draws, since each seed starts its own stream."""
    return np.array([sample(logits, seed, **params) for seed in range(n)])


def softmax(logits, temperature=1.0):
    z = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def descending(logits):
    """Token ids by logit, larger first, lower id first among equal logits."""
    return np.lexsort((np.arange(len(logits)), -np.asarray(logits, dtype=np.float64)))


def reference_kept(logits, top_k=0, top_p=1.0, min_p=0.0):
    """The set the chain draws from, and the smallest relative distance of any cut to its
    threshold (a fixture too close to a threshold would test float rounding, not the chain)."""
    logits = np.asarray(logits, dtype=np.float64)
    order = descending(logits)
    margin = math.inf
    if 0 < top_k < len(order):
        order = order[:top_k]
    probs = softmax(logits[order])  # renormalized over what top-k kept
    keep = len(order)
    if top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, np.float32(top_p), side="left")) + 1
        keep = min(keep, len(order))
        margin = min(margin, np.min(np.abs(cumulative - np.float32(top_p))))
    if min_p > 0.0:
        ratio = probs / probs[0]
        keep = min(keep, int(np.sum(ratio >= np.float32(min_p))))
        margin = min(margin, np.min(np.abs(ratio - np.float32(min_p))) / min_p)
    return set(order[:keep].tolist()), margin


def penalized(
    logits,
    history,
    repeat_penalty=1.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    penalty_last_n=64,
):
    """llama.cpp's penalty rule, token by token."""
    out = np.asarray(logits, dtype=np.float64).copy()
    window = history if penalty_last_n < 0 else history[len(history) - penalty_last_n :]
    if penalty_last_n == 0:
        window = []
    tokens, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    for token, count in zip(tokens, counts):
        value = out[token]
        value = value / repeat_penalty if value > 0 else value * repeat_penalty
        out[token] = value - count * frequency_penalty - presence_penalty
    return out


# --------------------------------------------------------------------------------------------
# Greedy


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.normal(0.0, 3.0, size=int(rng.integers(1, 3000))).astype(np.float32)
        expected = int(np.argmax(logits))
        assert sample(logits, seed=1, temperature=0.0) == expected
        assert sample(logits, seed=1, temperature=1.0, top_k=1) == expected


def test_greedy_takes_the_lowest_id_among_ties():
    logits = [0.5, 2.0, -1.0, 2.0, 2.0]
    assert sample(logits, seed=3, temperature=0.0) == 1
    assert sample(logits, seed=3, temperature=0.7, top_k=1) == 1


# --------------------------------------------------------------------------------------------
# Filters: the support of many draws is exactly the reference set


def check_support(logits, n_draws, temperature, **filters):
    kept, margin = reference_kept(logits, **filters)
    assert margin > 1e-4, "fixture sits on a threshold"
    # Every kept token must show up: the least likely is expected more than 30 times, so
    # missing it has probability below e^-30.
    weights = softmax(np.asarray(logits)[sorted(kept)], temperature)
    assert weights.min() * n_draws > 30, "fixture: a kept token is too rare to observe"
    seen = set(draws(logits, n_draws, temperature=temperature, **{**UNFILTERED, **filters}))
    assert seen == kept


def test_top_k_keeps_the_k_largest():
    logits = np.random.default_rng(1).normal(0.0, 1.0, size=64).astype(np.float32)
    check_support(logits, 3000, temperature=3.0, top_k=5)
    check_support(logits, 3000, temperature=3.0, top_k=12)


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    logits = np.random.default_rng(2).normal(0.0, 0.3, size=10).astype(np.float32)
    check_support(logits, 2000, temperature=1.0, top_k=50)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.random.default_rng(3).normal(0.0, 1.5, size=50).astype(np.float32)
    check_support(logits, 4000, temperature=4.0, top_p=0.6)
    check_support(logits, 4000, temperature=4.0, top_p=0.3)


def test_top_p_over_a_large_vocabulary():
    # Thousands of tokens: the sampler narrows top-p down by histogram rather than sorting.
    rng = np.random.default_rng(4)
    logits = rng.normal(0.0, 1.0, size=30000).astype(np.float32)
    logits[:8] += 9.0  # eight heavy tokens hold most of the mass
    kept, margin = reference_kept(logits, top_p=0.5)
    assert margin > 1e-4 and 2 <= len(kept) <= 8
    seen = set(draws(logits, 1500, temperature=1.0, **{**UNFILTERED, "top_p": 0.5}))
    assert seen == kept


def test_min_p_keeps_tokens_within_a_ratio_of_the_largest():
    logits = np.random.default_rng(5).normal(0.0, 1.0, size=40).astype(np.float32)
    check_support(logits, 3000, temperature=3.0, min_p=0.2)


def test_the_chain_applies_top_k_then_top_p_then_min_p():
    logits = np.random.default_rng(6).normal(0.0, 1.0, size=200).astype(np.float32)
    filters = dict(top_k=20, top_p=0.7, min_p=0.15)
    kept, _ = reference_kept(logits, **filters)
    # Each filter alone keeps more: the result is their combination, not any one of them.
    for one in ("top_k", "top_p", "min_p"):
        alone, _ = reference_kept(logits, **{one: filters[one]})
        assert kept < alone
    check_support(logits, 4000, temperature=3.0, **filters)


def test_top_p_is_measured_before_temperature():
    # At temperature 1 the top token holds 0.7 of the mass, so top_p = 0.6 keeps it alone,
    # however flat a high temperature makes the draw.
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float64)).astype(np.float32)
    tokens = draws(logits, 300, temperature=10.0, **{**UNFILTERED, "top_p": 0.6})
    assert set(tokens) == {0}


# --------------------------------------------------------------------------------------------
# Penalties, observed through greedy sampling


def test_penalties_match_the_reference_rule():
    rng = np.random.default_rng(7)
    checked = 0
    for case in range(300):
        n_vocab = int(rng.integers(2, 40))
        logits = rng.normal(0.0, 2.0, size=n_vocab).astype(np.float32)
        history = rng.integers(0, min(n_vocab, 6), size=int(rng.integers(0, 30))).tolist()
        params = dict(
            repeat_penalty=float(rng.choice([1.0, 1.1, 1.5, 0.8])),
            frequency_penalty=float(rng.choice([0.0, 0.4, -0.3])),
            presence_penalty=float(rng.choice([0.0, 0.6, -0.2])),
            penalty_last_n=int(rng.choice([-1, 0, 3, 64])),
        )
        expected = penalized(logits, history, **params)
        top_two = np.sort(expected)[-2:]
        if len(top_two) == 2 and top_two[1] - top_two[0] < 1e-4:
            continue  # a near tie: float rounding decides, not the rule
        token = sample(logits, seed=case, temperature=0.0, history=history, **params)
        assert token == int(np.argmax(expected)), f"case {case}: {params}, history {history}"
        checked += 1
    assert checked > 250


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    # Token 0 leads by a little; once seen it falls behind token 1 (2.0 / 1.5 < 1.8).
    assert sample([2.0, 1.8], seed=0, temperature=0.0, repeat_penalty=1.5, history=[0]) == 1
    # A negative logit is multiplied, so it falls further: -1.0 * 3 < -2.5.
    assert sample([-1.0, -2.5], seed=0, temperature=0.0, repeat_penalty=3.0, history=[0]) == 1
    # Without the history, no penalty.
    assert sample([2.0, 1.8], seed=0, temperature=0.0, repeat_penalty=1.5, history=[]) == 0


def test_frequency_penalty_counts_occurrences_and_presence_counts_once():
    logits = [1.0, 0.0]
    once, thrice = [0], [0, 0, 0]
    # frequency 0.4: one occurrence leaves 0.6 > 0, three leave -0.2 < 0.
    assert sample(logits, seed=0, temperature=0.0, frequency_penalty=0.4, history=once) == 0
    assert sample(logits, seed=0, temperature=0.0, frequency_penalty=0.4, history=thrice) == 1
    # presence 0.6 is the same for one or three occurrences: 0.4 > 0 either way.
    assert sample(logits, seed=0, temperature=0.0, presence_penalty=0.6, history=thrice) == 0
    assert sample(logits, seed=0, temperature=0.0, presence_penalty=1.2, history=once) == 1


def test_penalty_window_covers_only_the_last_tokens():
    logits = [1.0, 0.9, 0.0]
    history = [0, 2, 2, 2]  # token 0 is four tokens back
    assert (
        sample(
            logits, seed=0, temperature=0.0, presence_penalty=1.0, penalty_last_n=3, history=history
        )
        == 0
    )
    assert (
        sample(
            logits, seed=0, temperature=0.0, presence_penalty=1.0, penalty_last_n=4, history=history
        )
        == 1
    )
    assert (
        sample(
            logits,
            seed=0,
            temperature=0.0,
            presence_penalty=1.0,
            penalty_last_n=-1,
            history=history,
        )
        == 1
    )
    assert (
        sample(
            logits, seed=0, temperature=0.0, presence_penalty=1.0, penalty_last_n=0, history=history
        )
        == 0
    )


# --------------------------------------------------------------------------------------------
# Seeds


def test_a_seed_reproduces_its_token():
    logits = np.random.default_rng(8).normal(0.0, 1.0, size=5000).astype(np.float32)
    first = [sample(logits, seed) for seed in range(100)]
    assert first == [sample(logits, seed) for seed in range(100)]
    assert len(set(first)) > 10  # and different seeds draw different tokens


M32 = (1 << 32) - 1


def philox4x32_10(ctr, key):
    """Philox4x32-10 (Salmon et al., SC 2011) on four 32-bit words under two."""
    c, k = list(ctr), list(key)
    for r in range(10):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return c


def first_uniform(seed):
    """The first number of the documented stream: Philox of the counter 0 under the seed."""
    w = philox4x32_10([0, 0, 0, 0], [seed & M32, seed >> 32])
    return (((w[1] << 32) | w[0]) >> 11) * 2.0**-53


def test_philox_matches_the_published_known_answer():
    assert philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_the_token_follows_the_documented_stream():
    # u = the first uniform of the seed's stream; the token is the first kept id whose running
    # sum of softmax weights exceeds u times their total. Any platform gives the same tokens.
    logits = np.random.default_rng(9).normal(0.0, 1.0, size=300).astype(np.float32)
    for temperature, filters in ((1.0, UNFILTERED), (0.7, dict(top_k=50, top_p=0.9, min_p=0.05))):
        kept, margin = reference_kept(logits, **filters)
        assert margin > 1e-4
        ids = np.array(sorted(kept))
        cdf = np.cumsum(softmax(logits[ids], temperature))
        compared = 0
        for seed in range(300):
            u = first_uniform(seed)
            j = min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)
            if min(abs(cdf[j] - u), abs(u - (cdf[j - 1] if j > 0 else 0.0))) < 1e-5:
                continue  # on a boundary: float rounding decides
            token = sample(logits, seed, temperature=temperature, **filters)
            assert token == ids[j], f"seed {seed}"
            compared += 1
        assert compared > 280


# --------------------------------------------------------------------------------------------
# Distribution


def chi_square_bound(df, false_alarm=1e-6):
    """Laurent and Massart (2000): P(X >= df + 2 sqrt(df x) + 2x) <= e^-x for X chi-square
    with df degrees of freedom, which Pearson's statistic is asymptotically."""
    x = math.log(1.0 / false_alarm)
    return df + 2.0 * math.sqrt(df * x) + 2.0 * x


def pearson(counts, probs):
    expected = counts.sum() * probs
    return float(np.sum((counts - expected) ** 2 / expected))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_the_softmax(temperature):
    logits = np.array([0.3, -0.4, 1.1, 0.0, -1.2, 0.8, 0.5, -0.7], dtype=np.float32)
    n = 20000
    probs = softmax(logits, temperature)
    assert (probs * n).min() > 50  # large expected counts: the chi-square law holds
    tokens = draws(logits, n, temperature=temperature, **UNFILTERED)
    counts = np.bincount(tokens, minlength=len(logits))
    bound = chi_square_bound(len(logits) - 1)
    assert pearson(counts, probs) < bound
    # The same counts fail against a 20% different temperature: the test has the power to
    # tell them apart.
    assert pearson(counts, softmax(logits, temperature * 1.2)) > bound


# --------------------------------------------------------------------------------------------
# Special values and errors


def test_nan_and_minus_infinity_are_never_drawn():
    logits = np.array([np.nan, 0.0, -np.inf, 0.3, np.nan, -0.2], dtype=np.float32)
    tokens = set(draws(logits, 500, temperature=2.0, **UNFILTERED))
    assert tokens == {1, 3, 5}
    assert sample(logits, seed=0, temperature=0.0) == 3


def test_plus_infinity_takes_all_the_probability():
    logits = np.array([0.0, np.inf, 50.0, np.inf], dtype=np.float32)
    tokens = draws(logits, 1000, temperature=1.0, **UNFILTERED)
    assert set(tokens) == {1, 3}


@pytest.mark.parametrize(
    "logits",
    [[np.nan, np.nan], [-np.inf, np.nan, -np.inf], []],
    ids=["all-nan", "nan-and-minus-inf", "empty"],
)
def test_no_usable_logit_is_a_value_error(logits):
    with pytest.raises(ValueError):
        sample(np.array(logits, dtype=np.float32), seed=0)


@pytest.mark.parametrize(
    "name, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("frequency_penalty", math.inf),
        ("presence_penalty", math.nan),
        ("penalty_last_n", -2),
    ],
)
def test_invalid_parameter_is_a_value_error_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        sample([0.0, 1.0], seed=0, **{name: value})


def test_history_token_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match="history"):
        sample([0.0, 1.0, 2.0], seed=0, repeat_penalty=1.1, history=[0, 3])
    with pytest.raises(ValueError, match="history"):
        sample([0.0, 1.0, 2.0], seed=0, repeat_penalty=1.1, history=[-1])


def test_parameter_of_the_wrong_type_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="temperature"):
        ggraph.sample(np.zeros(2, dtype=np.float32), temperature="hot")
    with pytest.raises(TypeError, match="top_k"):
        ggraph.make_sampler(top_k=[3])


def test_model_sample_penalizes_the_context_tokens_in_its_window(tiny_model):
    """Model.sample reads the context's latest tokens for the penalties, as many as
    penalty_last_n asks (all for -1), and none when no penalty applies."""
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    m.eval([5, 6, 7, 8])
    logits = np.zeros(m.n_vocab, dtype=np.float32)
    logits[[5, 8, 9]] = [3.0, 2.0, 1.0]
    greedy = dict(temperature=0.0, repeat_penalty=10.0)
    # Token 5 lies outside a window of 2; token 8 inside it; the whole context holds both.
    assert m.sample(logits, penalty_last_n=2, **greedy) == 5
    assert m.sample(logits, penalty_last_n=-1, **greedy) == 9
    logits[5] = 1.5
    assert m.sample(logits, penalty_last_n=2, **greedy) == 5
    assert m.sample(logits, penalty_last_n=4, **greedy) == 9
    # No penalty: the plain argmax, whatever the window.
    assert m.sample(logits, temperature=0.0, penalty_last_n=2) == 8
    assert m.sample(logits, temperature=0.0, repeat_penalty=10.0, penalty_last_n=0) == 8
