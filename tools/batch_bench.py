"""Aggregate decode speed of B sequences stepped together, as llama.cpp's llama-batched-bench
measures it: each of B sequences takes a prompt of PP tokens, then TG steps of
`Model.decode_batch` give every sequence one token a step.

    python tools/batch_bench.py [-m smollm2] [-b 1,8,32,64] [--pp 128] [--tg 128] [--device cuda]

Reports, per B, the prompts' speed (B * PP tokens over their time, one sequence's prompt at a
time) and the generation's (B * TG tokens over the decode steps' time). On CUDA also the device
memory taken since the sessions were opened (each batch size's graph, captured on first use;
list the sizes largest first to see what the smaller ones add to the largest's).
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


def device_free(model: ggraph.Model) -> int | None:
    """Free memory of the model's GPU in bytes, or None on the CPU."""
    if not model.device.startswith("cuda"):
        return None
    index = int(model.device.split(":")[1]) if ":" in model.device else 0
    return next(d["free_memory"] for d in ggraph.devices() if d["index"] == index)


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
    free0 = device_free(model)
    print(f"{args.model} on {model.device}: prompts of {args.pp}, {args.tg} decode steps")
    mem = " MiB since the sessions opened |" if free0 is not None else ""
    print(f"| B | prompt tok/s | generation tok/s (aggregate) | per sequence |{mem}")
    print("|---|---|---|---|" + ("---|" if free0 is not None else ""))
    for b in sizes:
        seqs = [model] + sessions[: b - 1]
        measure(model, seqs, args.pp, min(args.tg, 8))  # warm-up: graphs and buffers
        prompt, gen = measure(model, seqs, args.pp, args.tg)
        row = f"| {b} | {prompt:,.0f} | {gen:,.1f} | {gen / b:,.1f} |"
        if free0 is not None:
            row += f" {(free0 - device_free(model)) / 2**20:,.0f} |"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
