"""Where `ggraph serve`'s engine loop spends a step, without HTTP: the engine's one call a step
(the batched decode, the sampling of the batch's logits and every generation's step) against
the engine thread's own Python.

    python tools/serve_host.py MODEL.gguf [-p 32] [-n 128] [--device cuda] [--threads N]
        [--temperature 0.8]

Runs the server's Engine (ggraph/server.py) on -p generations at once, each of -n tokens
(end-of-generation ignored) after a short prompt, and times every step in which all -p
sequences decode a sampled token (no prompt's tokens in the batch): its wall time from one
step_batch call to the next, the call itself (the device's step, its logits' copy, each row's
next token sampled on several threads, each generation's token text and stop checks, with the
GIL released), and the rest, the Python of the engine loop (cancellations, events). A server's
event loop (the streams' formatting and sends) comes on top and is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ggraph
from ggraph import server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--parallel", type=int, default=32, help="generations at once")
    ap.add_argument("-n", "--tokens", type=int, default=128, help="tokens a generation")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (the CPU backend)")
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args()

    m = ggraph.Model(
        args.model,
        device=args.device,
        n_ctx=args.tokens + 64,
        n_seq_max=args.parallel,
        n_threads=args.threads,
    )
    # Each step_batch call's start, end and the tokens it evaluates (a step that carries a
    # prompt's tokens is not a steady one).
    steps = []
    step_batch = server._core.step_batch

    def timed_step(ctx, gens):
        pending = sum(len(g.pending_tokens) for g in gens)
        t = time.perf_counter()
        out = step_batch(ctx, gens)
        steps.append([t, time.perf_counter(), pending])
        return out

    server._core.step_batch = timed_step
    loop = asyncio.new_event_loop()
    engine = server.Engine(m, parallel=args.parallel)
    ids = m.tokenize("Tell me a short story.")
    jobs = []
    for i in range(args.parallel):
        sampling = {"temperature": args.temperature, "seed": i, "ignore_eos": True}
        job = server._Job(loop, ids, args.tokens, [], None, sampling)
        jobs.append(job)
        engine.submit(job)

    async def drain() -> None:
        for job in jobs:
            while (await job.events.get())[0] not in ("done", "error"):
                pass

    loop.run_until_complete(drain())
    engine.close()
    server._core.step_batch = step_batch

    full = [
        i
        for i in range(1, len(steps))
        if steps[i][2] == args.parallel and steps[i - 1][2] == args.parallel
    ]
    if not full:
        print("no step ran every sequence")
        return 1
    k = len(full)
    wall = sum(steps[i][0] - steps[i - 1][0] for i in full) / k
    call = sum(steps[i - 1][1] - steps[i - 1][0] for i in full) / k
    print("| sequences | steps | step ms | step_batch ms | engine Python ms |")
    print("|---|---|---|---|---|")
    ms = [f"{v * 1e3:.2f}" for v in (wall, call, wall - call)]
    print(f"| {args.parallel} | {k} | {' | '.join(ms)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
