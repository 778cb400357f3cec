"""generate/chat: stop conditions, stop strings, seeds, context limits."""

import json
import os

import pytest

import ggraph

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def smol(smollm2):
    return ggraph.Model(smollm2, device="cpu", n_ctx=512)


def test_greedy_generate_follows_llama_cpp(smol):
    with open(os.path.join(DATA, "smollm2_greedy.json")) as f:
        golden = json.load(f)[0]
    text = "".join(smol.generate(golden["prompt_ids"], max_tokens=4, temperature=0))
    assert text == smol.detokenize(golden["greedy_ids"][:4])
    assert smol.stop_reason == "length"


def test_stop_string_ends_generation_before_it(smol):
    text = "".join(smol.generate("The capital of France is", max_tokens=16, temperature=0))
    assert "Paris" in text
    cut = "".join(
        smol.generate("The capital of France is", max_tokens=16, temperature=0, stop=["Paris"])
    )
    assert "Paris" not in cut
    assert smol.stop_reason == "stop"
    assert text.startswith(cut)


def _held_back(text, stops):
    """The longest end of text that is the beginning of a stop string (not all of one)."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@pytest.mark.parametrize("stop", ["z" * 40, "STOP", "@mid@"])
def test_text_is_held_back_only_while_it_may_begin_a_stop_string(smol, stop):
    prompt = "The capital of France is"
    free = [t.text for t in smol.generate(prompt, max_tokens=16, temperature=0, logprobs=0)]
    text = "".join(free)
    assert text.isascii() and "z" not in text and "STOP" not in text
    if stop == "@mid@":  # a stop string that begins like a stretch of the text, then differs
        stop = text[5:11] + "#"
    got = [
        t.text for t in smol.generate(prompt, max_tokens=16, temperature=0, logprobs=0, stop=[stop])
    ]
    assert "".join(got) == text and smol.stop_reason == "length"
    so_far = ""
    for i, piece in enumerate(free[: len(got) - 1]):
        so_far += piece
        given = "".join(got[: i + 1])
        assert given == so_far[: len(so_far) - _held_back(so_far, [stop])], (i, given, so_far)


def test_seed_makes_sampling_reproducible(smol):
    runs = [
        "".join(smol.generate("Once upon a time", max_tokens=12, temperature=0.9, seed=7))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_chat_applies_template_and_answers(smol):
    reply = "".join(
        smol.chat([{"role": "user", "content": "What is 2+2?"}], max_tokens=40, temperature=0)
    )
    assert "4" in reply
    assert smol.stop_reason == "eos"
    assert "<|im_start|>" not in reply and "<|im_end|>" not in reply


def test_full_context_stops_cleanly(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=12)
    pieces = list(m.generate([1, 2, 3, 4, 5], max_tokens=100, temperature=0))
    assert m.stop_reason in ("context_full", "eos")
    assert m.n_past <= m.n_ctx
    with pytest.raises(ValueError, match="context"):
        list(m.generate(list(range(1, 13)), max_tokens=4))
    assert all(isinstance(p, str) for p in pieces)


def test_generate_argument_errors(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=16)
    with pytest.raises(ValueError, match="temperature"):
        m.generate([1, 2], temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        m.generate([1, 2], top_p=1.5)
    with pytest.raises(TypeError, match="unknown sampling"):
        m.generate([1, 2], temprature=0.5)
    with pytest.raises(ValueError, match="empty"):
        m.generate([])
    with pytest.raises(ValueError, match="sample"):
        ggraph.Model(tiny_model, device="cpu", n_ctx=64).sample()


def test_prefix_is_reused_and_results_unchanged(tiny_model):
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    a = list(m.generate([1, 2, 3, 4], max_tokens=6, temperature=0))
    b = list(m.generate([1, 2, 3, 4], max_tokens=6, temperature=0))
    assert a == b
    fresh = ggraph.Model(tiny_model, device="cpu", n_ctx=64)
    assert list(fresh.generate([1, 2, 3, 4], max_tokens=6, temperature=0)) == a
