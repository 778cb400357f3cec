"""Generation speed through Model.generate, the way a user's loop runs: 128 tokens after a short
prompt, greedy and with top-k/top-p sampling, at each chain length (decode steps a backend
launch; 1 samples on the host a token at a time).

    python3 tools/gen_bench.py MODEL.gguf [--device cuda] [--chains 1,4,8,16] [--rounds 4]

Prints the best and every round's tok/s. Needs the ggraph package on PYTHONPATH.
"""

import argparse
import time

import ggraph

SETTINGS = (
    ("greedy", dict(temperature=0.0)),
    ("top-k/top-p", dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chains", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    args = ap.parse_args()
    m = ggraph.Model(args.model, device=args.device)
    for name, params in SETTINGS:
        for chain in (int(c) for c in args.chains.split(",")):
            rates = []
            for _ in range(args.rounds):
                m.reset()
                start = time.perf_counter()
                steps = m.generate(
                    [1, 2, 3, 4],
                    max_tokens=args.tokens,
                    ignore_eos=True,
                    logprobs=0,
                    chain=chain,
                    **params,
                )
                n = sum(1 for s in steps if s.token >= 0)
                rates.append(n / (time.perf_counter() - start))
            every = ", ".join(f"{r:.0f}" for r in rates)
            print(f"{name:12s} chain {chain:2d}: {max(rates):8.1f} tok/s (rounds: {every})")


if __name__ == "__main__":
    main()
