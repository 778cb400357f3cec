"""Aggregate decode speed of B sequences stepped together, as llama.cpp's llama-batched-bench
measures it: each of B sequences takes a prompt of PP tokens, then TG steps of
`Model.decode_batch` give every sequence one token a step.

    python tools/batch_bench.py [-m smollm2] [-b 1,8,32,64] [--pp 128] [--tg 128] [--device cuda]

Reports, per B, the prompts' speed (B * PP tokens over their time, one sequence's prompt at a
time) and the generation's (B * TG tokens over the decode steps' time).
"""

from __future__ import annotations

import argparse
import time

import ggraph
from ggraph.model import resolve_model


def measure(model: ggraph.Model, seqs: list, pp: int, tg: int) -> tuple[float, float]:
    for s in seqs:
        s.reset()
    start = time.perf_counter()
    for i, s in enumerate(seqs):
        s.eval([1 + (7 * k + i) % 1000 for k in range(pp)])
    prompt = len(seqs) * pp / (time.perf_counter() - start)
    start = time.perf_counter()
    for step in range(tg):
        model.decode_batch([(s, 2 + (step + i) % 1000) for i, s in enumerate(seqs)])
    return prompt, len(seqs) * tg / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-b", "--batch", default="1,8,32,64", help="batch sizes, comma-separated")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens a sequence")
    ap.add_argument("--tg", type=int, default=128, help="decode steps")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (0: all)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch.split(",")]
    model = ggraph.Model(
        resolve_model(args.model),
        device=args.device,
        n_ctx=args.pp + args.tg + 16,
        n_seq_max=max(sizes),
        n_threads=args.threads or None,
        allow_longer_context=True,
    )
    sessions = [model.session() for _ in range(max(sizes) - 1)]
    print(f"{args.model} on {model.device}: prompts of {args.pp}, {args.tg} decode steps")
    print("| B | prompt tok/s | generation tok/s (aggregate) | per sequence |")
    print("|---|---|---|---|")
    for b in sizes:
        seqs = [model] + sessions[: b - 1]
        measure(model, seqs, args.pp, min(args.tg, 8))  # warm-up: graphs and buffers
        prompt, gen = measure(model, seqs, args.pp, args.tg)
        print(f"| {b} | {prompt:,.0f} | {gen:,.1f} | {gen / b:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
