"""Gemma 3's forward pass in float64 numpy from the file's dequantized weights: which tokens exact
math ranks first at the positions where llama.cpp's greedy continuations were recorded.

llama.cpp quantizes activations to 8 bits in its dot products, so where two tokens are nearly
tied its recorded greedy token may not be the one exact math ranks first; the golden test
(tests/python/test_gemma3_golden.py) accepts the exact argmax there. Independent of ggraph: it
reads the file with gguf-py and dequantizes with gguf.quants.

    python tools/gemma3_float64_reference.py gemma-3-270m-q4_k_m.gguf \
        tests/python/data/gemma3_greedy.json tests/python/data/gemma3_float64.npz
"""

import argparse
import json

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class Weights:
    def __init__(self, path):
        self.reader = GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.cache = {}

    def field(self, key):
        return self.reader.fields[key].contents()

    def __call__(self, name, dtype=np.float64):
        if name not in self.cache:
            t = self.tensors[name]
            a = dequantize(t.data, t.tensor_type).astype(dtype)
            shape = [int(n) for n in reversed(t.shape)]
            self.cache[name] = a.reshape(shape) if len(shape) > 1 else a.reshape(-1)
        return self.cache[name]


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_neox(x, pos, base):
    """x [T, heads, D]: rotate the halves (x[i], x[i + D/2]) by pos * base^(-2i/D)."""
    d = x.shape[-1]
    half = d // 2
    angle = pos[:, None] * base ** (-np.arange(half) * 2.0 / d)[None, :]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def hidden_states(w, ids):
    """The final-normed hidden state of every position."""
    arch = "gemma3"
    n_embd = w.field(f"{arch}.embedding_length")
    n_head = w.field(f"{arch}.attention.head_count")
    n_head_kv = w.field(f"{arch}.attention.head_count_kv")
    hd = w.field(f"{arch}.attention.key_length")
    eps = w.field(f"{arch}.attention.layer_norm_rms_epsilon")
    window = w.field(f"{arch}.attention.sliding_window")
    base_global = w.field(f"{arch}.rope.freq_base")
    n_layer = w.field(f"{arch}.block_count")
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    emb = w("token_embd.weight", np.float32)
    x = emb[ids].astype(np.float64) * np.sqrt(n_embd)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for il in range(n_layer):
        p = f"blk.{il}."
        windowed = (il + 1) % 6 != 0  # five windowed layers, then a global one
        base = 10000.0 if windowed else base_global
        masked = j > i
        if windowed:
            masked |= j <= i - window
        h = rms_norm(x, w(p + "attn_norm.weight"), eps)
        q = (h @ w(p + "attn_q.weight").T).reshape(n, n_head, hd)
        k = (h @ w(p + "attn_k.weight").T).reshape(n, n_head_kv, hd)
        v = (h @ w(p + "attn_v.weight").T).reshape(n, n_head_kv, hd)
        q = rope_neox(rms_norm(q, w(p + "attn_q_norm.weight"), eps), pos, base)
        k = rope_neox(rms_norm(k, w(p + "attn_k_norm.weight"), eps), pos, base)
        out = np.zeros((n, n_head, hd))
        for head in range(n_head):
            kv = head // (n_head // n_head_kv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            s[masked] = -np.inf
            e = np.exp(s - s.max(1, keepdims=True))
            out[:, head] = (e / e.sum(1, keepdims=True)) @ v[:, kv]
        attn = out.reshape(n, n_head * hd) @ w(p + "attn_output.weight").T
        x = x + rms_norm(attn, w(p + "post_attention_norm.weight"), eps)
        f = rms_norm(x, w(p + "ffn_norm.weight"), eps)
        gate, up = f @ w(p + "ffn_gate.weight").T, f @ w(p + "ffn_up.weight").T
        ffn = (gelu_tanh(gate) * up) @ w(p + "ffn_down.weight").T
        x = x + rms_norm(ffn, w(p + "post_ffw_norm.weight"), eps)
    return rms_norm(x, w("output_norm.weight"), eps)


def logits(w, hidden):
    """hidden [T, n_embd] times the tied output matrix, a slice of the vocabulary at a time."""
    emb = w("token_embd.weight", np.float32)
    out = np.empty((hidden.shape[0], emb.shape[0]))
    for a in range(0, emb.shape[0], 16384):
        out[:, a : a + 16384] = hidden @ emb[a : a + 16384].astype(np.float64).T
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("greedy_json")
    ap.add_argument("out_npz")
    args = ap.parse_args()
    w = Weights(args.model)
    with open(args.greedy_json) as f:
        greedy = json.load(f)
    out = {}
    for i, g in enumerate(greedy):
        ids = np.array(g["prompt_ids"] + g["greedy_ids"])
        n_p = len(g["prompt_ids"])
        # The positions whose next token is a recorded greedy token.
        h = hidden_states(w, ids)[n_p - 1 : n_p - 1 + len(g["greedy_ids"])]
        z = logits(w, h)
        top2 = np.argsort(-z, axis=1)[:, :2]
        out[f"p{i}_forced_top2_ids"] = top2.astype(np.int32)
        out[f"p{i}_forced_top2_logits"] = np.take_along_axis(z, top2, 1).astype(np.float32)
        print(f"prompt {i}: {len(ids)} tokens")
    np.savez_compressed(args.out_npz, **out)


if __name__ == "__main__":
    main()
