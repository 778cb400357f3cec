"""llama.cpp's CPU prompt and decode speed after a context, measured as `ggraph bench -d` measures
ggraph's, for comparisons on the same machine and file.

    python3 tools/llamacpp_depth_bench.py -m MODEL [-p 512] [-n 128] [-d 2048] [-t 2] [-r 3]

Needs llama-cpp-python (built from source: see the README's reference section). MODEL is a GGUF
path or a name `ggraph` resolves (smollm2, gemma3). The context of d random tokens is evaluated
once; each repetition rewinds to it and times a prompt of p random tokens in one call (pp), or
n single-token calls (tg). Prints rows in `ggraph bench`'s table layout, tok/s mean +- stddev.
"""

import argparse
import pathlib
import statistics
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-d", "--depth", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    args = ap.parse_args()

    import llama_cpp  # optional: only this tool needs it

    from ggraph.model import resolve_model

    path = pathlib.Path(resolve_model(args.model))
    n_ctx = args.depth + max(args.n_prompt, args.n_gen) + 16
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=max(args.n_prompt, 512), n_threads=args.threads,
        n_threads_batch=args.threads, verbose=False,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()

    def tokens(n):
        return rng.integers(0, vocab, size=n).tolist()

    if args.depth:
        llm.eval(tokens(args.depth))

    def pp(n):
        llm.n_tokens = args.depth
        t0 = time.perf_counter()
        llm.eval(tokens(n))
        return time.perf_counter() - t0

    def tg(n):
        llm.n_tokens = args.depth
        t0 = time.perf_counter()
        for tok in tokens(n):
            llm.eval([tok])
        return time.perf_counter() - t0

    at = f" @ d{args.depth}" if args.depth else ""
    print("| model | engine | threads | test | t/s |\n|---|---|---|---|---|")
    for name, n, fn in (
        (f"pp{args.n_prompt}{at}", args.n_prompt, pp),
        (f"tg{args.n_gen}{at}", args.n_gen, tg),
    ):
        if n <= 0:
            continue
        fn(min(n, 16))  # warm-up
        rates = [n / fn(n) for _ in range(args.reps)]
        sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
        print(f"| {path.name} | llama.cpp (cpu) | {args.threads} | {name} | "
              f"{statistics.mean(rates):.2f} ± {sd:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
