"""Tokenizers against independent references.

- SmolLM2 (byte-level BPE): llama.cpp's ids from the golden file, and from
  data/tokenizer_corpus.json for a multi-script corpus under five pre-tokenizers (the SmolLM2
  vocabulary with only tokenizer.ggml.pre changed).
- A SentencePiece BPE vocabulary (data/spm_vocab.gguf, trained with byte fallback): the ids of
  SentencePiece itself and of llama.cpp.
- Streaming: Python's incremental UTF-8 decoder.

tools/make_tokenizer_corpus.py recorded the reference ids and says which engine made which."""

import codecs
import json
import os
import random
import time

import pytest

import ggraph
from ggraph.testing import Typed, write_gguf

DATA = os.path.join(os.path.dirname(__file__), "data")
SPM_VOCAB = os.path.join(DATA, "spm_vocab.gguf")
SPM_MODEL = os.path.join(DATA, "spm_vocab.model")
SPM_USER_DEFINED = "<|user|>"
# The SmolLM2 vocabulary has no token for the byte 0x1D, so it is dropped (as llama.cpp does).
SMOLLM2_MISSING_BYTE = "\x1d"


@pytest.fixture(scope="module")
def corpus():
    with open(os.path.join(DATA, "tokenizer_corpus.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smol(smollm2):
    return ggraph.Tokenizer(smollm2)


@pytest.fixture(scope="module")
def spm_tok():
    return ggraph.Tokenizer(SPM_VOCAB)


def tokenizer_metadata(path):
    """The tokenizer.* metadata of a GGUF file, typed for ggraph.testing.write_gguf."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.ggml."):
            continue
        kind = field.types[0].name.lower()
        elem = field.types[-1].name.lower() if kind == "array" else None
        out[name] = Typed(kind, field.contents(), elem_type=elem)
    return out


@pytest.fixture(scope="module")
def smollm2_with_pre(smollm2, corpus, tmp_path_factory):
    """Writes the SmolLM2 vocabulary with another pre-tokenizer, and with the multi-digit tokens
    of the corpus appended when digits=True; returns its Tokenizer."""
    base = tokenizer_metadata(smollm2)
    root = tmp_path_factory.mktemp("vocab")
    cache = {}

    def make(pre, digits=False):
        if (pre, digits) not in cache:
            meta = dict(base)
            if pre is None:
                del meta["tokenizer.ggml.pre"]
            else:
                meta["tokenizer.ggml.pre"] = pre
            if digits:
                extra = corpus["smollm2_digits"]
                for key, more in (
                    ("tokenizer.ggml.tokens", extra["extra_tokens"]),
                    ("tokenizer.ggml.token_type", [1] * len(extra["extra_tokens"])),
                    ("tokenizer.ggml.merges", extra["extra_merges"]),
                ):
                    old = meta[key]
                    meta[key] = Typed(old.type, list(old.value) + more, elem_type=old.elem_type)
            path = str(root / f"smollm2-{pre}-{digits}.gguf")
            write_gguf(path, meta, [])
            cache[(pre, digits)] = ggraph.Tokenizer(path)
        return cache[(pre, digits)]

    return make


def mismatches(tok, texts, expected, special=False):
    bad = []
    for text, want in zip(texts, expected):
        got = tok.tokenize(text, add_bos=False, special=special)
        if got != want:
            bad.append(f"{text[:60]!r}: llama.cpp {want[:12]}..., ggraph {got[:12]}...")
    return bad


def test_golden_smollm2_ids(smol):
    with open(os.path.join(DATA, "smollm2_tokenize.json"), encoding="utf-8") as f:
        golden = json.load(f)
    for case in golden:
        assert smol.tokenize(case["text"], add_bos=False) == case["ids"], case["text"]


PRES = ["smollm", "gpt-2", "default", "llama-bpe", "qwen2"]


@pytest.mark.parametrize("pre", PRES)
def test_corpus_matches_llama_cpp(pre, corpus, smollm2_with_pre):
    tok = smollm2_with_pre(pre)
    assert not mismatches(tok, corpus["texts"], corpus["smollm2"][pre])


@pytest.mark.parametrize("pre", PRES)
def test_numbers_with_multi_digit_tokens_match_llama_cpp(pre, corpus, smollm2_with_pre):
    tok = smollm2_with_pre(pre, digits=True)
    digits = corpus["smollm2_digits"]
    assert not mismatches(tok, digits["texts"], digits[pre])


def test_pre_tokenizers_differ_on_the_corpus(corpus):
    # Guards the corpus itself: each pre-tokenizer must be told apart from every other.
    def ids(pre):
        return corpus["smollm2"][pre] + corpus["smollm2_digits"][pre]

    for i, a in enumerate(PRES):
        for b in PRES[i + 1 :]:
            assert ids(a) != ids(b), f"{a} and {b} give the same ids on the whole corpus"


def test_gpt2_alias_and_missing_pre(corpus, smollm2_with_pre):
    # "gpt2" is accepted for GPT-2's split (llama.cpp names it "gpt-2"); a file without the key
    # gets llama.cpp's default split.
    assert not mismatches(smollm2_with_pre("gpt2"), corpus["texts"], corpus["smollm2"]["gpt-2"])
    missing = smollm2_with_pre(None)
    assert not mismatches(missing, corpus["texts"], corpus["smollm2"]["default"])


def test_special_tokens_match_llama_cpp(smol, corpus):
    texts = corpus["special_texts"]
    assert not mismatches(smol, texts, corpus["smollm2"]["special"], special=True)


def test_special_flag(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = smol.tokenize(text, special=True)
    plain = smol.tokenize(text, special=False)
    assert parsed[0] == 1 and parsed[-1] == 2
    assert 1 not in plain and 2 not in plain
    assert len(plain) > len(parsed)
    assert smol.detokenize(plain) == text
    assert smol.detokenize(parsed) == "user\nhi"  # control tokens render as nothing
    assert smol.detokenize(parsed, render_special=True) == text
    assert smol.token_to_piece(1) == b""
    assert smol.token_to_piece(1, render_special=True) == b"<|im_start|>"


def test_round_trip_smollm2(smol, corpus):
    for text in corpus["texts"]:
        back = smol.detokenize(smol.tokenize(text))
        assert back == text.replace(SMOLLM2_MISSING_BYTE, ""), text


def test_end_of_generation_and_bos_match_llama_cpp(smol, spm_tok, corpus):
    for tok, facts in ((smol, corpus["smollm2"]["vocab"]), (spm_tok, corpus["spm"]["vocab"])):
        eog = [i for i in range(tok.n_vocab) if tok.is_end_of_generation(i)]
        assert eog == facts["end_of_generation"]
        assert tok.tokenize(facts["default_bos_text"]) == facts["default_bos_ids"]


def test_spm_matches_sentencepiece(spm_tok, corpus):
    texts = corpus["texts"]
    assert not mismatches(spm_tok, texts, corpus["spm"]["sentencepiece"])
    # Byte fallback is exercised: some ids are <0xXX> tokens.
    assert any(3 <= i < 259 for ids in corpus["spm"]["sentencepiece"] for i in ids)


def test_spm_matches_llama_cpp(spm_tok, corpus):
    # After a user-defined token llama.cpp prefixes the following text with a space, as after a
    # control token; SentencePiece (and ggraph) treat a user-defined token as part of the text.
    def comparable(texts, ids):
        return zip(*[(t, i) for t, i in zip(texts, ids) if SPM_USER_DEFINED not in t])

    texts, ids = comparable(corpus["texts"], corpus["spm"]["llama.cpp"])
    assert not mismatches(spm_tok, texts, ids)
    texts, ids = comparable(corpus["special_texts"], corpus["spm"]["special"])
    assert not mismatches(spm_tok, texts, ids, special=True)


def test_spm_round_trip(spm_tok, corpus):
    for text, decoded in zip(corpus["texts"], corpus["spm"]["sentencepiece_decoded"]):
        back = spm_tok.detokenize(spm_tok.tokenize(text))
        assert back == text
        assert back == decoded  # SentencePiece's own decoding of its ids


def test_spm_random_text_matches_sentencepiece(spm_tok):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=SPM_MODEL)
    rng = random.Random(7)
    alphabet = list("abcdefghij tT.,'\n\t0123456789") + [
        "  ",
        "the",
        " of",
        "é",
        "日本",
        "ж",
        "😀",
        "\u0301",
        "\u00a0",
        "<|user|>",
        "<s>",
        "\u2581",
    ]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert spm_tok.tokenize(text, add_bos=False) == sp.encode(text), repr(text)


def stream(tok, ids):
    d = tok.decode_stream()
    return [d.push(i) for i in ids], d.flush()


def reference_stream(tok, ids):
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [dec.decode(tok.token_to_piece(i)) for i in ids], dec.decode(b"", final=True)


def test_stream_decoder_matches_incremental_utf8_decoding(smol, spm_tok, corpus):
    for tok in (smol, spm_tok):
        for text in corpus["texts"]:
            ids = tok.tokenize(text, add_bos=False)
            pieces, tail = stream(tok, ids)
            assert (pieces, tail) == reference_stream(tok, ids)
            assert "\ufffd" not in "".join(pieces) + tail  # nothing broken on the way
    # Arbitrary byte sequences, malformed ones included, from single-byte tokens.
    byte_ids = [i for i in range(smol.n_vocab) if len(smol.token_to_piece(i)) == 1]
    bytes_covered = {smol.token_to_piece(i)[0] for i in byte_ids}
    assert set(range(0x80, 0xC0)) | set(range(0xC2, 0xF1)) <= bytes_covered
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice(byte_ids) for _ in range(rng.randint(1, 12))]
        assert stream(smol, ids) == reference_stream(smol, ids)


def test_multibyte_characters_split_across_tokens_are_held_back(smol):
    ids = smol.tokenize("日本語")

    def whole_characters(piece):
        try:
            piece.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(whole_characters(smol.token_to_piece(i)) for i in ids)
    pieces, tail = stream(smol, ids)
    assert "".join(pieces) == "日本語" and tail == ""
    assert pieces.count("") >= 1


def write_vocab(path, **meta):
    base = {
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    base.update(meta)
    write_gguf(path, {k: v for k, v in base.items() if v is not None}, [])
    return str(path)


def test_unsupported_tokenizers_raise_naming_them(tmp_path):
    with pytest.raises(ggraph.GGUFError, match="tokenizer.ggml.model"):
        ggraph.Tokenizer(write_vocab(tmp_path / "none.gguf"))
    with pytest.raises(ggraph.GGUFError, match=r"'bert'.*gpt2.*llama"):
        ggraph.Tokenizer(write_vocab(tmp_path / "bert.gguf", **{"tokenizer.ggml.model": "bert"}))
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"}
    with pytest.raises(ggraph.GGUFError, match=r"'mystery'.*smollm.*llama-bpe.*qwen2"):
        ggraph.Tokenizer(write_vocab(tmp_path / "pre.gguf", **meta))


def test_token_ids_out_of_range(smol):
    with pytest.raises(ValueError):
        smol.detokenize([smol.n_vocab])
    with pytest.raises(ValueError):
        smol.token_to_piece(-1)


def test_speed_100kb(smol, spm_tok, corpus):
    text = "\n".join(corpus["texts"])
    text = (text * (100_000 // len(text.encode()) + 1))[:100_000]
    for tok in (smol, spm_tok):
        start = time.perf_counter()
        ids = tok.tokenize(text)
        elapsed = time.perf_counter() - start
        assert len(ids) > 10_000
        assert elapsed < 1.0, f"{elapsed:.3f} s for 100 KB"
