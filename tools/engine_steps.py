"""What `ggraph serve`'s engine costs beside the batched step it drives: B greedy jobs through
the server's Engine (no HTTP), against Model.decode_batch of B sequences, one token each, for
the same number of steps.

    python tools/engine_steps.py [-m smollm2] [-b 1,8] [-n 128] [--device cpu] [--temperature T]

The engine's figure includes each job's prompt and sampling (greedy, or at temperature T with the
server's defaults for the rest, as `tools/serve_load.py`'s requests at 0.8); decode_batch's is
steps alone.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ggraph
from ggraph.model import resolve_model
from ggraph.server import _DEFAULTS, Engine, _Job


async def measure(
    path: str, device: str, batch: int, n: int, temperature: float
) -> tuple[float, float]:
    model = ggraph.Model(path, device=device, n_ctx=512, n_seq_max=batch)
    engine = Engine(model, parallel=batch)
    loop = asyncio.get_running_loop()
    sampling = {"ignore_eos": True, "temperature": 0.0}
    if temperature > 0:
        sampling.update(_DEFAULTS, temperature=temperature)
    jobs = [
        _Job(loop, model.tokenize(f"Story number {i}:"), n, [], None, dict(sampling, seed=i))
        for i in range(batch)
    ]
    start = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    tokens = 0
    for job in jobs:
        while True:
            kind, _ = await job.events.get()
            tokens += kind == "token"
            if kind in ("done", "error"):
                break
    served = tokens / (time.perf_counter() - start)
    engine.close()
    seqs = engine._free  # the model and its sessions, all free again
    for seq in seqs:
        seq.reset()
        seq.eval([1, 2, 3])
    start = time.perf_counter()
    for _ in range(n):
        if batch == 1:
            model.eval([5])
        else:
            model.decode_batch([(seq, 5) for seq in seqs])
    raw = batch * n / (time.perf_counter() - start)
    return served, raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-b", "--batch", default="1,8")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    args = ap.parse_args()
    path = resolve_model(args.model)
    print("| B | engine tok/s | decode_batch tok/s | engine / decode_batch |")
    print("|---|---|---|---|")
    for b in (int(x) for x in args.batch.split(",")):
        served, raw = asyncio.run(measure(path, args.device, b, args.tokens, args.temperature))
        print(f"| {b} | {served:.1f} | {raw:.1f} | {served / raw:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
