"""One SHA-256 over the logits of a seeded prompt and the greedy decode steps after it, so that
two builds (or two settings) can be shown to compute the same step bit for bit: run it under each
and compare the lines.

    python tools/logits_digest.py MODEL [--device cuda] [--kv-type q8_0] [--prompt 300] [--steps 16]
"""

import argparse
import hashlib

import numpy as np

import ggraph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens (seeded, random)")
    ap.add_argument("--steps", type=int, default=16, help="greedy decode steps after it")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    m = ggraph.Model(a.model, device=a.device, n_ctx=a.prompt + a.steps + 1, kv_type=a.kv_type)
    ids = np.random.default_rng(a.seed).integers(0, m.n_vocab, a.prompt).tolist()
    h = hashlib.sha256()
    logits = m.eval(ids)
    h.update(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
    tokens = []
    for _ in range(a.steps):
        tokens.append(int(np.argmax(logits)))
        logits = m.eval([tokens[-1]])
        h.update(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
    print(f"{h.hexdigest()} {a.kv_type} prompt {a.prompt} steps {a.steps} tokens {tokens[:8]}")


if __name__ == "__main__":
    main()
