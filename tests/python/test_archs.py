"""Every architecture on small random-weight files written with gguf-py: its logits against a
float64 numpy forward pass of the same (dequantized) weights, prompt-then-decode against one-shot
evaluation at every position, every CUDA graph mode against plain launches, and the new keys and
tensors validated with errors that name them.

The float64 reference is written from the papers' math (RMS norm, rope, causal softmax
attention with a window, gated feed-forward), not from ggraph's code."""

import math
import os
import sys

import numpy as np
import pytest
from conftest import cuda_available

import ggraph

gguf = pytest.importorskip("gguf")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

N_VOCAB = 96

# Small shapes that still exercise what each family adds: GQA, head sizes that are not
# n_embd / n_head, windows shorter than the prompts, six Gemma layers (one of them global).
ARCHS = {
    "llama": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96),
    "qwen2": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=1, n_ff=96),
    "qwen3": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, head_dim=32),
    "phi3": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=4, n_ff=96, window=6),
    "gemma3": dict(n_layer=6, n_embd=64, n_head=4, n_head_kv=1, n_ff=96, head_dim=32, window=5),
}
ROPE_BASE = {"llama": 10000.0, "qwen2": 1e6, "qwen3": 1e6, "phi3": 10000.0, "gemma3": 1e6}
EPS = 1e-6


def _layout(arch, c):
    """Tensor names and GGUF shapes (ne0 first) of an architecture."""
    e, f = c["n_embd"], c["n_ff"]
    hd = c.get("head_dim", e // c["n_head"])
    q, kv = c["n_head"] * hd, c["n_head_kv"] * hd
    out = [("token_embd.weight", (e, N_VOCAB)), ("output_norm.weight", (e,))]
    if arch != "gemma3":
        out.append(("output.weight", (e, N_VOCAB)))
    for il in range(c["n_layer"]):
        p = f"blk.{il}."
        out += [(p + "attn_norm.weight", (e,)), (p + "ffn_norm.weight", (e,))]
        if arch == "phi3":
            out += [(p + "attn_qkv.weight", (e, q + 2 * kv)), (p + "ffn_up.weight", (e, 2 * f))]
        else:
            out += [(p + "attn_q.weight", (e, q)), (p + "attn_k.weight", (e, kv))]
            out += [(p + "attn_v.weight", (e, kv)), (p + "ffn_gate.weight", (e, f))]
            out += [(p + "ffn_up.weight", (e, f))]
        out += [(p + "attn_output.weight", (q, e)), (p + "ffn_down.weight", (f, e))]
        if arch == "qwen2":
            out += [
                (p + "attn_q.bias", (q,)),
                (p + "attn_k.bias", (kv,)),
                (p + "attn_v.bias", (kv,)),
            ]
        if arch in ("qwen3", "gemma3"):
            out += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]
        if arch == "gemma3":
            out += [(p + "post_attention_norm.weight", (e,)), (p + "post_ffw_norm.weight", (e,))]
    return out


# Shapes whose rows suit K-quants' 256-element blocks (for the llama.cpp references).
K_SHAPES = {
    "llama": dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2),
    "qwen2": dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=1),
    "qwen3": dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=128),
    "phi3": dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=4),
    "gemma3": dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=1, head_dim=128),
}
# Where each block format keeps its f16 scale (and minimum) fields, in bytes.
_SCALE_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}
# (offset, packed bytes) of sub-block scales and minimums with d = dmin that centre the values:
# Q4_K scale 8 and minimum 60 (8 * 7.5), Q5_K 4 and 62 (4 * 15.5), both in the 12-byte 6-bit
# packing; Q2_K scale 2 and minimum 3 (2 * 1.5) in each of its 16 nibble pairs.
_CENTRED_SCALES = {
    "Q4_K": (4, [8] * 4 + [60 | 3 << 6] * 4 + [8 | 12 << 4] * 4),
    "Q5_K": (4, [4] * 4 + [62 | 3 << 6] * 4 + [4 | 14 << 4] * 4),
    "Q2_K": (0, [2 | 3 << 4] * 16),
}


def weight_type(mix, name):
    """The type of a matrix in a mix: "Q4_K_M" is llama.cpp's (Q6_K for attn_v, ffn_down and
    the output, Q4_K elsewhere); "Q5_K_S" and the like use one type; plain names one type."""
    if mix == "Q4_K_M":
        fused_v = name.endswith("attn_qkv.weight")
        six = name.endswith(("attn_v.weight", "ffn_down.weight")) or name == "output.weight"
        return "Q6_K" if six or fused_v else "Q4_K"
    return mix


def _random_k_blocks(qt_name, shape, rng, std):
    """Random blocks of a K-quant whose scale fields make the values' spread about std."""
    qt = getattr(gguf.GGMLQuantizationType, qt_name)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rows, ne0 = shape[1], shape[0]
    raw = rng.integers(0, 256, size=(rows * ne0 // block, size), dtype=np.uint8)
    # Sub-block scales and minimums chosen so that each row's values centre on zero, as trained
    # weights do (random minimums give rows random means, which no trained model has).
    if qt_name in _CENTRED_SCALES:
        start, values = _CENTRED_SCALES[qt_name]
        raw[:, start : start + len(values)] = values
    fields = _SCALE_FIELDS[qt_name]
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    for f in fields:
        raw[:, f : f + 2] = one
    spread = gguf.quants.dequantize(raw.reshape(rows, -1), qt).std()
    scale = np.frombuffer(np.float16(std / spread).tobytes(), np.uint8)
    for f in fields:
        raw[:, f : f + 2] = scale
    return raw.reshape(rows, -1)


def write_arch(
    path, arch, wtype="F32", seed=0, meta=None, tensors=None, softcap=None, shape=None, vocab=False
):
    """Writes a random-weight file; returns {name: float64 weights as the file stores them}.
    meta overrides metadata (None drops a key); tensors replaces (None drops) tensors; shape
    overrides ARCHS' sizes; wtype is a type or a mix (see weight_type); vocab adds a plain
    SentencePiece-style vocabulary (which llama.cpp needs to load a file)."""
    c = dict(ARCHS[arch], **(shape or {}))
    rng = np.random.default_rng(seed)
    hd = c.get("head_dim")
    keys = {
        "block_count": ("uint32", c["n_layer"]),
        "context_length": ("uint32", 256),
        "embedding_length": ("uint32", c["n_embd"]),
        "feed_forward_length": ("uint32", c["n_ff"]),
        "attention.head_count": ("uint32", c["n_head"]),
        "attention.head_count_kv": ("uint32", c["n_head_kv"]),
        "attention.layer_norm_rms_epsilon": ("float32", EPS),
        "rope.freq_base": ("float32", ROPE_BASE[arch]),
    }
    if hd:
        keys["attention.key_length"] = ("uint32", hd)
        keys["attention.value_length"] = ("uint32", hd)
    if c.get("window"):
        keys["attention.sliding_window"] = ("uint32", c["window"])
    if softcap is not None:
        keys["final_logit_softcapping"] = ("float32", softcap)
    for k, v in (meta or {}).items():
        if v is None:
            keys.pop(k, None)
        else:
            keys[k] = v
    w = gguf.GGUFWriter(str(path), arch)
    for k, (kind, v) in keys.items():
        getattr(w, f"add_{kind}")(f"{arch}.{k}", v)
    if vocab:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, N_VOCAB)])
        w.add_token_scores([0.0] * N_VOCAB)
        w.add_token_types([3, 3, 3] + [1] * (N_VOCAB - 3))
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    stored = {}
    layout = dict(_layout(arch, c))
    for name, value in (tensors or {}).items():
        if value is None:
            layout.pop(name)
        else:
            layout[name] = value
    for name, shape in layout.items():
        if isinstance(shape, np.ndarray):  # a replacement given as values
            w.add_tensor(name, shape.astype(np.float32))
            continue
        n = int(np.prod(shape))
        if len(shape) == 1:
            vals = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
            if name.endswith(".bias"):
                vals -= 1.0
        else:
            vals = (rng.standard_normal(n) / math.sqrt(shape[0])).astype(np.float32)
            if name == "token_embd.weight" and arch != "gemma3":
                vals *= 8.0  # embeddings of unit-like rms, as trained models have
        arr = vals.reshape(tuple(reversed(shape)))
        wt = weight_type(wtype, name)
        if len(shape) > 1 and wt in _SCALE_FIELDS:
            qt = getattr(gguf.GGMLQuantizationType, wt)
            raw = _random_k_blocks(wt, shape, rng, float(vals.std()))
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
            stored[name] = gguf.quants.dequantize(raw, qt).astype(np.float64).reshape(arr.shape)
        elif len(shape) > 1 and wt != "F32":
            qt = getattr(gguf.GGMLQuantizationType, wt)
            raw = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
            stored[name] = gguf.quants.dequantize(raw, qt).astype(np.float64).reshape(arr.shape)
        else:
            w.add_tensor(name, arr)
            stored[name] = arr.astype(np.float64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(x, base, neox, freqs=None, scale=1.0):
    """x [T, heads, D] rotated by position t * scale * base^(-2i/D) / freqs[i]."""
    t, d = x.shape[0], x.shape[-1]
    ang = scale * np.arange(t)[:, None] * base ** (-np.arange(d // 2) * 2.0 / d)[None, :]
    if freqs is not None:
        ang = ang / np.asarray(freqs, dtype=np.float64)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * c - b * s, a * s + b * c
    if neox:
        return np.concatenate([ra, rb], -1)
    return np.stack([ra, rb], -1).reshape(x.shape)


def reference_logits(arch, w, ids, softcap=None, window=None, rope_freqs=None, rope_scale=1.0):
    """float64 logits [T, vocab] of every position; window overrides the shape's."""
    c = dict(ARCHS[arch])
    if window is not None:
        c["window"] = window
    e, nh, nkv = c["n_embd"], c["n_head"], c["n_head_kv"]
    hd = c.get("head_dim", e // nh)
    t = len(ids)
    x = w["token_embd.weight"][ids] * (math.sqrt(e) if arch == "gemma3" else 1.0)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    for il in range(c["n_layer"]):
        p = f"blk.{il}."
        window, base = c.get("window", 0), ROPE_BASE[arch]
        if arch == "gemma3" and window:  # five windowed layers with their own base, one global
            windowed = (il + 1) % 6 != 0
            window, base = (window, 10000.0) if windowed else (0, base)
        h = _rms(x, w[p + "attn_norm.weight"])
        if arch == "phi3":
            q, k, v = np.split(h @ w[p + "attn_qkv.weight"].T, [nh * hd, (nh + nkv) * hd], axis=1)
        else:
            q, k, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
        if arch == "qwen2":
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
        if arch in ("qwen3", "gemma3"):
            q, k = _rms(q, w[p + "attn_q_norm.weight"]), _rms(k, w[p + "attn_k_norm.weight"])
        neox = arch != "llama"
        q = _rope(q, base, neox, rope_freqs, rope_scale)
        k = _rope(k, base, neox, rope_freqs, rope_scale)
        masked = j > i
        if window:
            masked |= j <= i - window
        out = np.zeros((t, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            s[masked] = -np.inf
            pr = np.exp(s - s.max(1, keepdims=True))
            out[:, head] = pr / pr.sum(1, keepdims=True) @ v[:, kv]
        a = out.reshape(t, nh * hd) @ w[p + "attn_output.weight"].T
        x = x + (_rms(a, w[p + "post_attention_norm.weight"]) if arch == "gemma3" else a)
        f = _rms(x, w[p + "ffn_norm.weight"])
        if arch == "phi3":
            gate, up = np.split(f @ w[p + "ffn_up.weight"].T, 2, axis=1)
        else:
            gate, up = f @ w[p + "ffn_gate.weight"].T, f @ w[p + "ffn_up.weight"].T
        if arch == "gemma3":
            act = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
        else:
            act = gate / (1 + np.exp(-gate))
        d = (act * up) @ w[p + "ffn_down.weight"].T
        x = x + (_rms(d, w[p + "post_ffw_norm.weight"]) if arch == "gemma3" else d)
    out_w = w.get("output.weight", w["token_embd.weight"])
    z = _rms(x, w["output_norm.weight"]) @ out_w.T
    return softcap * np.tanh(z / softcap) if softcap else z


PROMPT = [5, 17, 3, 88, 41, 41, 2, 60, 9, 33, 71, 12, 50, 7]  # past every window above


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
def test_logits_match_float64_reference(tmp_path, arch, wtype):
    path = tmp_path / f"{arch}.gguf"
    w = write_arch(path, arch, wtype, seed=1)
    m = ggraph.Model(str(path), device="cpu", n_ctx=64, kv_type="f32")
    got = m.eval(PROMPT, all_logits=True)
    ref = reference_logits(arch, w, np.array(PROMPT))
    # F32 weights (and an F32 KV cache, as the reference keeps K and V): float32 rounding only.
    # Q8_0: activations meet the weights in 8 bits, about 1% a layer (six Gemma layers reach
    # 2.5%).
    bound = 1e-4 if wtype == "F32" else 5e-2
    for pos in range(len(PROMPT)):
        assert _rel(got[pos], ref[pos]) < bound, f"{arch} {wtype} position {pos}"


def test_gemma3_soft_caps_the_logits(tmp_path):
    path = tmp_path / "capped.gguf"
    w = write_arch(path, "gemma3", seed=2, softcap=3.0)
    got = ggraph.Model(str(path), device="cpu", n_ctx=64, kv_type="f32").eval(
        PROMPT, all_logits=True
    )
    ref = reference_logits("gemma3", w, np.array(PROMPT), softcap=3.0)
    assert np.abs(got).max() <= 3.0
    assert np.abs(reference_logits("gemma3", w, np.array(PROMPT))).max() > 3.0, "cap unused"
    assert _rel(got, ref) < 1e-4


def test_gemma3_without_a_window_is_global_everywhere(tmp_path):
    path = tmp_path / "global.gguf"
    w = write_arch(path, "gemma3", seed=7, meta={"attention.sliding_window": None})
    got = ggraph.Model(str(path), device="cpu", n_ctx=64, kv_type="f32").eval(
        PROMPT, all_logits=True
    )
    assert _rel(got, reference_logits("gemma3", w, np.array(PROMPT), window=0)) < 1e-4


def test_window_changes_what_later_positions_see(tmp_path):
    # The same weights with and without the declared window: equal up to the window, then not.
    a, b = tmp_path / "win.gguf", tmp_path / "nowin.gguf"
    write_arch(a, "phi3", seed=3)
    write_arch(b, "phi3", seed=3, meta={"attention.sliding_window": None})
    la = ggraph.Model(str(a), device="cpu", n_ctx=64).eval(PROMPT, all_logits=True)
    lb = ggraph.Model(str(b), device="cpu", n_ctx=64).eval(PROMPT, all_logits=True)
    w = ARCHS["phi3"]["window"]
    np.testing.assert_array_equal(la[:w], lb[:w])
    assert all(_rel(la[p], lb[p]) > 1e-3 for p in range(w, len(PROMPT)))


def _devices():
    return ["cpu", "cuda"] if cuda_available() else ["cpu"]


def _cosine(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prompt_then_decode_equals_one_shot(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_arch(path, arch, "Q8_0", seed=4)
    for device in _devices():
        m = ggraph.Model(str(path), device=device, n_ctx=64)
        one_shot = m.eval(PROMPT, all_logits=True)
        m.reset()
        steps = [m.eval(PROMPT[:4], all_logits=True)]
        steps.append(m.eval(PROMPT[4:7], all_logits=True))  # a second chunk after a past
        steps += [m.eval([t])[None, :] for t in PROMPT[7:]]  # then one token a step
        stepped = np.concatenate(steps)
        for pos in range(len(PROMPT)):
            if device == "cpu":  # the same sums in the same order, whatever the batch
                assert np.array_equal(stepped[pos], one_shot[pos]), f"{arch} cpu position {pos}"
            else:  # the GPU's mat-vec and tiled kernels add in different orders
                cos = _cosine(stepped[pos], one_shot[pos])
                assert cos >= 0.999, f"{arch} {device} position {pos}: cosine {cos:.5f}"


@pytest.mark.skipif(not cuda_available(), reason="the CUDA comparison needs a CUDA device")
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cuda_matches_the_cpu(tmp_path, arch):
    # F32 weights: the two differ by the GPU's F16 KV cache alone.
    path = tmp_path / f"{arch}.gguf"
    write_arch(path, arch, "F32", seed=6)
    cpu = ggraph.Model(str(path), device="cpu", n_ctx=64).eval(PROMPT, all_logits=True)
    gpu = ggraph.Model(str(path), device="cuda", n_ctx=64).eval(PROMPT, all_logits=True)
    for pos in range(len(PROMPT)):
        assert _cosine(gpu[pos], cpu[pos]) >= 0.9999, f"{arch} position {pos}"


@pytest.mark.skipif(not cuda_available(), reason="the CUDA comparison needs a CUDA device")
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cuda_quantized_matches_float64_reference(tmp_path, arch):
    # Q8_0: each backend rounds activations to 8 bits its own way, so each is held to the
    # float64 forward pass with the CPU's bound rather than to the other.
    path = tmp_path / f"{arch}.gguf"
    w = write_arch(path, arch, "Q8_0", seed=6)
    gpu = ggraph.Model(str(path), device="cuda", n_ctx=64).eval(PROMPT, all_logits=True)
    ref = reference_logits(arch, w, np.array(PROMPT))
    for pos in range(len(PROMPT)):
        assert _rel(gpu[pos], ref[pos]) < 5e-2, f"{arch} position {pos}"


@pytest.mark.skipif(not cuda_available(), reason="CUDA graph modes need a CUDA device")
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_cuda_graph_mode_equals_plain_launches(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_arch(path, arch, "Q8_0", seed=5)

    def run(mode):
        m = ggraph.Model(str(path), device="cuda", n_ctx=128, cuda_graphs=mode)
        out = [m.eval(PROMPT)]
        for _ in range(40):  # decode steps past every window
            out.append(m.eval([int(np.argmax(out[-1]))]))
        return np.stack(out)

    ref = run("off")
    for mode in ("recapture", "update", "patch"):
        assert np.array_equal(run(mode), ref), mode


def _refused(tmp_path, arch, match, **kw):
    path = tmp_path / "bad.gguf"
    write_arch(path, arch, **kw)
    with pytest.raises(ggraph.GGUFError, match=match):
        ggraph.Model(str(path), device="cpu", n_ctx=32)


@pytest.mark.parametrize("cap", [0.0, -30.0, float("inf"), float("nan")])
def test_bad_soft_cap_is_refused(tmp_path, cap):
    _refused(tmp_path, "gemma3", "final_logit_softcapping: expected a finite positive", softcap=cap)


def test_bad_head_sizes_are_refused(tmp_path):
    _refused(
        tmp_path,
        "qwen3",
        r"value_length: expected 32 .* found 16",
        meta={"attention.value_length": ("uint32", 16)},
    )
    _refused(
        tmp_path,
        "gemma3",
        r"rope.dimension_count: expected an even size at most the head size 32, found 33",
        meta={"rope.dimension_count": ("uint32", 33)},
    )
    # Without key_length the head size must come from n_embd / n_head.
    _refused(
        tmp_path,
        "llama",
        "not a multiple of head_count 5",
        meta={"attention.head_count": ("uint32", 5), "attention.head_count_kv": ("uint32", 5)},
    )


def test_bad_window_is_refused(tmp_path):
    _refused(
        tmp_path,
        "gemma3",
        "sliding_window: expected a window of 0 .* found -4",
        meta={"attention.sliding_window": ("int32", -4)},
    )


def test_bad_bias_and_fused_shapes_are_named(tmp_path):
    _refused(
        tmp_path,
        "qwen2",
        r"blk.0.attn_k.bias': expected 16, file has 64",
        tensors={"blk.0.attn_k.bias": np.zeros(64)},
    )
    _refused(
        tmp_path, "qwen2", "blk.1.attn_v.bias' is missing", tensors={"blk.1.attn_v.bias": None}
    )
    _refused(
        tmp_path,
        "phi3",
        r"blk.0.attn_qkv.weight': expected 64x192, file has 64x128",
        tensors={"blk.0.attn_qkv.weight": np.zeros((128, 64))},
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rope_frequency_factors_and_linear_scaling(tmp_path, device):
    # Llama 3.1's rope_freqs divide each pair's frequency; linear scaling multiplies positions.
    if device == "cuda" and not cuda_available():
        pytest.skip("the CUDA run needs a CUDA device")
    c = ARCHS["llama"]
    factors = np.linspace(1.0, 8.0, c.get("head_dim", c["n_embd"] // c["n_head"]) // 2)
    path = tmp_path / "llama31.gguf"
    meta = {"rope.scaling.type": ("string", "linear"), "rope.scaling.factor": ("float32", 2.0)}
    w = write_arch(path, "llama", seed=3, meta=meta, tensors={"rope_freqs.weight": factors})
    kv_type = "f32" if device == "cpu" else "f16"  # CUDA has F16 caches only
    got = ggraph.Model(str(path), device=device, n_ctx=64, kv_type=kv_type).eval(
        PROMPT, all_logits=True
    )
    ref = reference_logits("llama", w, np.array(PROMPT), rope_freqs=factors, rope_scale=0.5)
    plain = reference_logits("llama", w, np.array(PROMPT))
    bound = 1e-4 if kv_type == "f32" else 1e-2
    for pos in range(1, len(PROMPT)):
        assert _rel(got[pos], ref[pos]) < bound, f"position {pos}"
    assert max(_rel(plain[p], ref[p]) for p in range(1, len(PROMPT))) > 10 * bound


def test_rope_scaling_and_frequency_factors_are_refused(tmp_path):
    _refused(
        tmp_path,
        "qwen2",
        "rope.scaling.type 'yarn'",
        meta={"rope.scaling.type": ("string", "yarn"), "rope.scaling.factor": ("float32", 4.0)},
    )
    _refused(
        tmp_path,
        "phi3",
        "rope_factors_long.weight': rope frequency factors are not supported",
        tensors={"rope_factors_long.weight": np.ones(8)},
    )


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((N_VOCAB, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ggraph.GGUFError, match=r"'mamba' \(supported: gemma3, llama, phi3, qwen2, qwen3\)"
    ):
        ggraph.Model(str(path), device="cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_matches_llamacpp(tmp_path, device):
    # llama.cpp's logits (tools/record_llamacpp_references.py) for every architecture in K-quant
    # mixes, at every position: cosine >= 0.995 each, top-1 agreement >= 95% over all of them.
    if device == "cuda" and not cuda_available():
        pytest.skip("the CUDA run needs a CUDA device")
    import record_llamacpp_references as rec

    ref = np.load(os.path.join(os.path.dirname(__file__), "data", "llamacpp_arch_logits.npz"))
    agree = total = 0
    for arch, mix, seed in rec.CASES:
        path = tmp_path / f"{arch}-{mix}.gguf"
        rec.write_case(path, arch, mix, seed)
        got = ggraph.Model(str(path), device=device, n_ctx=64).eval(PROMPT, all_logits=True)
        want = ref[f"{arch}_{mix}"]
        for pos in range(len(PROMPT)):
            cos = _cosine(got[pos], want[pos])
            assert cos >= 0.995, f"{arch} {mix} position {pos}: cosine {cos:.5f}"
        agree += int(np.sum(got.argmax(1) == want.argmax(1)))
        total += len(PROMPT)
    assert agree / total >= 0.95, f"top-1 agreement {agree}/{total}"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
@pytest.mark.parametrize("key", ["rope.freq_base", "attention.layer_norm_rms_epsilon"])
def test_non_finite_or_non_positive_hyperparameters_are_refused(tmp_path, key, value):
    # ggml refuses such files too; loaded, they would give NaN logits.
    _refused(
        tmp_path, "llama", f"{key}: expected a finite positive", meta={key: ("float32", value)}
    )
