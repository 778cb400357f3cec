"""A batched decode step's wall time beside what the host spends on its logits.

    python tools/batch_host.py MODEL.gguf [-b 32,64] [--past 64] [--steps 32] [--n-ctx 256]
        [--device cuda]

For each batch size B, B sequences take a prompt of --past tokens, then after 4 steps of
warm-up --steps steps of `Model.decode_batch` are timed (ms a step, aggregate tok/s). Beside
it, the host's copy of that many logits (B x n_vocab floats) into a new array and into one
reused: what a step would pay to copy its logits once more on this machine's CPU.
graph_stats' host-time counters a step follow.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ggraph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-b", "--batch", default="32,64", help="batch sizes, comma-separated")
    ap.add_argument("--past", type=int, default=64, help="prompt tokens a sequence")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps")
    ap.add_argument("--n-ctx", type=int, default=256, help="positions a sequence holds")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch.split(",")]
    m = ggraph.Model(
        args.model,
        device=args.device,
        n_ctx=args.n_ctx,
        n_seq_max=max(sizes),
        allow_longer_context=True,
    )
    sessions = [m.session() for _ in range(max(sizes) - 1)]
    for b in sizes:
        seqs = [m] + sessions[: b - 1]
        for s in seqs:
            s.reset()
            s.eval([1 + i % 100 for i in range(args.past)])
        for step in range(4):  # warm-up: graphs and buffers
            m.decode_batch([(s, 5 + step) for s in seqs])
        before = dict(m.graph_stats)
        start = time.perf_counter()
        for step in range(args.steps):
            m.decode_batch([(s, 9 + step) for s in seqs])
        step_s = (time.perf_counter() - start) / args.steps
        after = dict(m.graph_stats)
        src = np.ones((b, m.n_vocab), np.float32)
        start = time.perf_counter()
        for _ in range(args.steps):
            fresh = np.empty_like(src)
            fresh[:] = src
        fresh_s = (time.perf_counter() - start) / args.steps
        start = time.perf_counter()
        for _ in range(args.steps):
            fresh[:] = src
        reused_s = (time.perf_counter() - start) / args.steps
        host = {
            k: round((after[k] - before.get(k, 0)) / args.steps, 2)
            for k in after
            if k.endswith("us_total")
        }
        print(
            f"B={b}: step {step_s * 1e3:.3f} ms ({b / step_s:,.0f} tok/s); a copy of its "
            f"{src.nbytes / 2**20:.1f} MiB of logits: {fresh_s * 1e3:.3f} ms into a new array, "
            f"{reused_s * 1e3:.3f} ms into one reused; graph_stats a step: {host}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
