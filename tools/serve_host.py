"""Where `ggraph serve`'s engine loop spends a step, without HTTP: the batched decode, the
sampling of the batch's logits, and the engine thread's own Python.

    python tools/serve_host.py MODEL.gguf [-p 32] [-n 128] [--device cuda] [--threads N]
        [--temperature 0.8]

Runs the server's Engine (ggraph/server.py) on -p generations at once, each of -n tokens
(end-of-generation ignored) after a short prompt, and times every step in which all -p
sequences decode: its wall time from one decode_batch to the next, decode_batch itself (the
device's step and its logits' copy), feed_batch (each row's next token sampled, on several
threads), and the rest, the Python of the engine loop (each job's step: token text, stop
checks, events). A server's event loop (the streams' formatting and sends) comes on top and
is not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ggraph
import ggraph.model as model_module
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
    # Each step's _decode_pending (decode_batch, then feed_batch): its start and end, the part
    # feed_batch took, and its tokens.
    steps = []
    feed_seconds = [0.0]
    decode_pending = model_module.Model._decode_pending
    feed_batch = model_module._core.feed_batch

    def timed_feed(*a):
        t = time.perf_counter()
        out = feed_batch(*a)
        feed_seconds[0] += time.perf_counter() - t
        return out

    def timed_pending(self, entries):
        pending = sum(1 for _, g in entries if g.pending_token >= 0)
        before = feed_seconds[0]
        t = time.perf_counter()
        out = decode_pending(self, entries)
        if pending:
            steps.append([t, time.perf_counter(), feed_seconds[0] - before, pending])
        return out

    model_module._core.feed_batch = timed_feed
    model_module.Model._decode_pending = timed_pending
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
    model_module._core.feed_batch = feed_batch
    model_module.Model._decode_pending = decode_pending

    full = [
        i
        for i in range(1, len(steps))
        if steps[i][3] == args.parallel and steps[i - 1][3] == args.parallel
    ]
    if not full:
        print("no step ran every sequence")
        return 1
    k = len(full)
    wall = sum(steps[i][0] - steps[i - 1][0] for i in full) / k
    pending = sum(steps[i - 1][1] - steps[i - 1][0] for i in full) / k
    feed = sum(steps[i - 1][2] for i in full) / k
    decode = pending - feed
    print("| sequences | steps | step ms | decode_batch ms | feed_batch ms | engine Python ms |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.parallel} | {k} | {wall * 1e3:.2f} | {decode * 1e3:.2f} | {feed * 1e3:.2f} | "
        f"{(wall - decode - feed) * 1e3:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
