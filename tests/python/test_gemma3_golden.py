"""Gemma 3 270M Q4_K_M against llama.cpp's recorded outputs (tests/python/data/gemma3_*).

The same bars as SmolLM2 (test_golden.py): cosine >= 0.995 of the last-position logits, top-1
agreement >= 95% over all prompt positions, teacher-forced agreement with llama.cpp's greedy
tokens >= 90% per prompt, and the same first 4 greedy tokens. The last prompt is 985 tokens long,
past the 512-token window of five layers in six, so a wrong window mask or rope base shows.

llama.cpp quantizes activations to 8 bits, and at near-ties its recorded greedy token is not
always the one exact math ranks first (prompt 1: 4 of its 32 tokens). tools/
gemma3_float64_reference.py recorded exact math's choice at those positions (gemma3_float64.npz);
where llama.cpp's token departs from it, the exact argmax is accepted instead."""

import json
import os

import numpy as np
import pytest
from conftest import cuda_available

import ggraph

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(DATA, "gemma3_greedy.json")) as f:
        greedy = json.load(f)
    return greedy, np.load(os.path.join(DATA, "gemma3_logits.npz"))


@pytest.fixture(scope="module")
def exact_choice():
    """Per prompt: float64 math's top token at each position of llama.cpp's greedy run."""
    f = np.load(os.path.join(DATA, "gemma3_float64.npz"))
    return [f[f"p{i}_forced_top2_ids"][:, 0] for i in range(len(f.files) // 2)]


def _agrees(got, recorded, exact):
    """The recorded token, or exact math's where llama.cpp's departs from it."""
    return got == recorded or (recorded != exact and got == exact)


# Every KV cache type meets the bars, the 985-token prompt past the window included, on the CPU
# and (F16 and Q8_0) on CUDA.
@pytest.fixture(
    scope="module",
    params=[("cpu", "f32"), ("cpu", "f16"), ("cpu", "q8_0"), ("cuda", "f16"), ("cuda", "q8_0")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def model(request, gemma3):
    device, kv_type = request.param
    if device == "cuda" and not cuda_available():
        pytest.skip("no CUDA device (or a build without CUDA): the CUDA golden run is skipped")
    return ggraph.Model(gemma3, device=device, n_ctx=1100, kv_type=kv_type)


@pytest.fixture(scope="module")
def prompt_runs(model, golden):
    """Per prompt: the logits of its last position (a plain eval of the prompt) and the 4
    greedy tokens decoded after it, one token a step."""
    greedy, _ = golden
    runs = []
    for g in greedy:
        model.reset()
        last = model.eval(g["prompt_ids"])
        logits, tokens = last, []
        for _ in range(4):
            tokens.append(int(np.argmax(logits)))
            logits = model.eval([tokens[-1]])
        runs.append((last, tokens))
    return runs


@pytest.fixture(scope="module")
def forced_runs(model, golden):
    """Per prompt: the logits of every position of prompt + llama.cpp's greedy tokens."""
    greedy, _ = golden
    runs = []
    for g in greedy:
        model.reset()
        runs.append(model.eval(g["prompt_ids"] + g["greedy_ids"], all_logits=True))
    return runs


@pytest.fixture(scope="module")
def tokenizer(gemma3):
    return ggraph.Tokenizer(gemma3)


def test_tokenization_equals_llamacpps(tokenizer, golden):
    # Plain text as the tokenization data was recorded (no BOS, special tokens as text), and the
    # prompts as their ids were (BOS, special tokens parsed); every text detokenizes back.
    with open(os.path.join(DATA, "gemma3_tokenize.json")) as f:
        cases = json.load(f)
    for c in cases:
        assert tokenizer.tokenize(c["text"], add_bos=False, special=False) == c["ids"], c["text"]
        assert tokenizer.detokenize(c["ids"]) == c["text"]
    greedy, _ = golden
    for g in greedy:
        assert tokenizer.tokenize(g["prompt"], add_bos=True, special=True) == g["prompt_ids"]


def test_prompts_are_the_recorded_ones(golden):
    greedy, logits = golden
    for i, g in enumerate(greedy):
        assert g["prompt_ids"] == logits[f"p{i}_ids"].tolist(), g["prompt"]
    assert max(len(g["prompt_ids"]) for g in greedy) > 512, "no prompt passes the window"


def test_last_position_logits_cosine(prompt_runs, golden):
    greedy, logits = golden
    for i, (got, _) in enumerate(prompt_runs):
        ref = logits[f"p{i}_logits"]
        cos = float(np.dot(got, ref) / (np.linalg.norm(got) * np.linalg.norm(ref)))
        assert cos >= 0.995, f"{greedy[i]['prompt'][:40]!r}: cosine {cos:.5f}"


def test_top1_agreement_over_all_prompt_positions(forced_runs, golden):
    greedy, logits = golden
    agree = total = 0
    for i, got in enumerate(forced_runs):
        ref_top = logits[f"p{i}_top8_all_positions"][:, 0]
        agree += int(np.sum(got[: len(ref_top)].argmax(axis=1) == ref_top))
        total += len(ref_top)
    assert agree / total >= 0.95, f"top-1 agreement {agree}/{total}"


def test_teacher_forced_agreement_with_greedy_ids(forced_runs, golden, exact_choice):
    greedy, _ = golden
    for g, got, exact in zip(greedy, forced_runs, exact_choice):
        n_p = len(g["prompt_ids"])
        pred = got[n_p - 1 : n_p - 1 + len(g["greedy_ids"])].argmax(axis=1)
        ok = [_agrees(p, r, e) for p, r, e in zip(pred, g["greedy_ids"], exact)]
        raw = float(np.mean(pred == np.array(g["greedy_ids"])))
        assert np.mean(ok) >= 0.90, f"{g['prompt'][:40]!r}: {np.mean(ok):.2%} (raw {raw:.2%})"


# Exact math's choice where its top two logits are at least this far apart. The engines quantize
# activations to 8 bits (as llama.cpp does), which moves this model's logits by about 0.2 on
# average against float64 (BENCHMARKS.md, fifteenth session): nearer choices are a coin toss for
# any such engine, at any KV type, and flip with the order of a sum.
CLEAR_MARGIN = 0.25


def test_teacher_forced_agreement_with_exact_math(model, forced_runs, golden):
    """Every position where float64 math's choice is clear (prompt 1 has 12 near-ties of 32,
    the others one to three) takes that choice, with every KV type."""
    greedy, _ = golden
    f = np.load(os.path.join(DATA, "gemma3_float64.npz"))
    clear_positions = 0
    for i, (g, got) in enumerate(zip(greedy, forced_runs)):
        ids, logits = f[f"p{i}_forced_top2_ids"], f[f"p{i}_forced_top2_logits"]
        n_p = len(g["prompt_ids"])
        pred = got[n_p - 1 : n_p - 1 + len(ids)].argmax(axis=1)
        clear = logits[:, 0] - logits[:, 1] >= CLEAR_MARGIN
        clear_positions += int(clear.sum())
        wrong = np.flatnonzero(clear & (pred != ids[:, 0]))
        assert wrong.size == 0, f"{g['prompt'][:40]!r}: positions {wrong.tolist()} differ"
    assert clear_positions >= 140  # the test holds most positions, not a few


def test_first_four_greedy_tokens_equal(prompt_runs, golden, exact_choice):
    greedy, _ = golden
    for g, (_, tokens), exact in zip(greedy, prompt_runs, exact_choice):
        for i, (got, recorded) in enumerate(zip(tokens, g["greedy_ids"][:4])):
            assert _agrees(got, recorded, exact[i]), f"{g['prompt'][:40]!r}: token {i}"
            if got != recorded:
                break  # an accepted departure: the two runs' contexts differ from here on


@pytest.fixture(scope="module")
def cpu_model(gemma3):
    return ggraph.Model(gemma3, device="cpu", n_ctx=256)


def test_chat_uses_gemmas_turns_when_the_file_has_no_template(cpu_model):
    assert not cpu_model.metadata.get("tokenizer.chat_template")
    text = cpu_model.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."},
        ]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    )
    # The turn markers are the vocabulary's control tokens, one id each, and end a reply.
    ids = cpu_model.tokenize(text, special=True)
    start, end = (
        cpu_model.tokenize(t, add_bos=False, special=True)
        for t in ("<start_of_turn>", "<end_of_turn>")
    )
    assert len(start) == 1 and len(end) == 1
    assert ids.count(start[0]) == 4 and ids.count(end[0]) == 3
    assert ids[0] == cpu_model.tokenize("", add_bos=True)[0]  # the template's bos, once


def test_chat_template_raises_on_roles_that_do_not_alternate(cpu_model):
    with pytest.raises(ValueError, match="roles must alternate"):
        cpu_model.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )


def test_chat_answers_through_the_template(cpu_model):
    reply = "".join(cpu_model.chat([{"role": "user", "content": "Say hello."}], max_tokens=8))
    assert cpu_model.stop_reason in ("eos", "length")
    assert "<start_of_turn>" not in reply and "<end_of_turn>" not in reply
    assert cpu_model.n_generated >= 1
