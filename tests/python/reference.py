"""An independent float64 numpy forward pass of a llama GGUF, read with the `gguf` package.

Used to check ggraph's logits on random-weight models; it shares no code with ggraph."""

import numpy as np


def load(path):
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(path)

    def field(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        w[t.name] = a.reshape([int(d) for d in reversed(t.shape)])
    hp = {
        "n_layer": field("llama.block_count"),
        "n_embd": field("llama.embedding_length"),
        "n_head": field("llama.attention.head_count"),
        "n_head_kv": field("llama.attention.head_count_kv", field("llama.attention.head_count")),
        "rope_base": field("llama.rope.freq_base", 10000.0),
        "eps": field("llama.attention.layer_norm_rms_epsilon", 1e-5),
    }
    hp["head_dim"] = hp["n_embd"] // hp["n_head"]
    hp["n_rot"] = field("llama.rope.dimension_count", hp["head_dim"])
    return w, hp


def _rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, n_rot, base):
    # x: [T, H, D]; llama.cpp's normal mode rotates adjacent pairs.
    out = x.copy()
    i = np.arange(n_rot // 2)
    theta = pos[:, None] * base ** (-2.0 * i / n_rot)  # [T, n_rot/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = a * c - b * s
    out[..., 1:n_rot:2] = a * s + b * c
    return out


def kv_cache_round(kv_type):
    """What a KV cache of kv_type keeps of keys or values [T, n_head_kv, head_dim]: their float32,
    float16 or Q8_0 values (blocks of 32 along each row, quantized by gguf-py as ggml's
    reference quantize_row_q8_0 does). The rows are float32 before they are stored."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    def keep(x):
        x32 = x.astype(np.float32)
        if kv_type == "f32":
            return x32.astype(np.float64)
        if kv_type == "f16":
            return x32.astype(np.float16).astype(np.float64)
        assert kv_type == "q8_0", kv_type
        rows = x32.reshape(x.shape[0], -1)
        q = quantize(rows, GGMLQuantizationType.Q8_0)
        return dequantize(q, GGMLQuantizationType.Q8_0).reshape(x.shape).astype(np.float64)

    return keep


def forward(model, tokens, kv_round=None):
    """Logits [T, n_vocab] for tokens at positions 0..T-1. kv_round, when given, maps the keys
    (after rope) and values to what a KV cache stores of them (kv_cache_round)."""
    w, hp = model
    T = len(tokens)
    H, HK, D = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
    pos = np.arange(T, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(hp["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, hp["eps"]) * w[p + "attn_norm.weight"]
        q = (h @ w[p + "attn_q.weight"].T).reshape(T, H, D)
        k = (h @ w[p + "attn_k.weight"].T).reshape(T, HK, D)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, HK, D)
        q = _rope(q, pos, hp["n_rot"], hp["rope_base"])
        k = _rope(k, pos, hp["n_rot"], hp["rope_base"])
        if kv_round is not None:
            k, v = kv_round(k), kv_round(v)
        k = np.repeat(k, H // HK, axis=1)
        v = np.repeat(v, H // HK, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", s, v).reshape(T, H * D)
        x = x + attn @ w[p + "attn_output.weight"].T
        f = _rms(x, hp["eps"]) * w[p + "ffn_norm.weight"]
        g = f @ w[p + "ffn_gate.weight"].T
        u = f @ w[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
    x = _rms(x, hp["eps"]) * w["output_norm.weight"]
    out = w.get("output.weight", w["token_embd.weight"])
    return x @ out.T
