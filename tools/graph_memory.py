"""Device memory of the batched decode graphs: the largest batch size's alone, then every size's.

    python tools/graph_memory.py MODEL.gguf [-b 1,2,4,8,16,32,64] [--past 64] [--n-ctx 256]

Loads MODEL on CUDA with as many sequences as the largest batch, gives each a prompt of
--past tokens, and reads the GPU's free memory (cudaMemGetInfo through ggraph._core.devices()):
before any decode step, after steps of the largest batch alone (its graph captured and its
workspaces grown), and after steps of every other size (largest first, as one memory pool
serves them all). Prints each stage's memory above the first, graph_stats' captures a batch
size and its graph pool bytes, and the ratio of all sizes to the largest alone.
"""

from __future__ import annotations

import argparse

import ggraph
from ggraph import _core


def free_bytes(index: int) -> int:
    for d in _core.devices():
        if d["index"] == index:
            return int(d["free_memory"])
    raise SystemExit(f"no CUDA device {index}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-b", "--batch", default="1,2,4,8,16,32,64", help="batch sizes")
    ap.add_argument("--past", type=int, default=64, help="prompt tokens a sequence")
    ap.add_argument("--n-ctx", type=int, default=256, help="positions a sequence holds")
    ap.add_argument("--device-index", type=int, default=0)
    args = ap.parse_args()
    sizes = sorted({int(b) for b in args.batch.split(",")}, reverse=True)

    m = ggraph.Model(
        args.model,
        device="cuda",
        n_ctx=args.n_ctx,
        n_seq_max=sizes[0],
        allow_longer_context=True,
    )
    seqs = [m] + [m.session() for _ in range(sizes[0] - 1)]
    for i, s in enumerate(seqs):
        s.eval([1 + (i + j) % 100 for j in range(args.past)])
    base = free_bytes(args.device_index)

    def steps(b: int) -> None:
        for step in range(3):
            m.decode_batch([(s, 5 + step) for s in seqs[:b]])

    steps(sizes[0])
    largest = base - free_bytes(args.device_index)
    for b in sizes[1:]:
        steps(b)
    every = base - free_bytes(args.device_index)
    stats = m.graph_stats
    mib = 1 << 20
    print("| stage | memory above the prompts, MiB |")
    print("|---|---|")
    print(f"| batch {sizes[0]} alone | {largest / mib:.1f} |")
    print(f"| batches {', '.join(map(str, sizes))} | {every / mib:.1f} |")
    captures = ", ".join(f"{b}: {int(stats.get(f'batch{b}.captures', 0))}" for b in sizes)
    pool = stats["graph_pool_bytes"]
    print(f"\ncaptures by batch size: {captures}; graph pool bytes: {pool:.0f}")
    if largest > 0:
        print(f"all sizes / the largest alone: {every / largest:.2f}")
    else:
        print("the largest batch's steps took no memory the device reports")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
