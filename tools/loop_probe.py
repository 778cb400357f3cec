"""When a generation's tokens reach the caller: the time each token of `generate()` is yielded,
for chain loops (tokens a launch above 16, on CUDA graphs in patch or recapture mode) and for
chains of 8, and what the host saw of a loop's words while it ran (graph_stats' loop_looks,
loop_tokens_streamed and loop_looks_given_up). Streamed loop tokens arrive a round (8 tokens)
at a time; tokens read at the loop's end arrive all at once after the whole loop.

    python3 tools/loop_probe.py MODEL.gguf [--chains 256,8] [--trials 2] [--tokens 30]
        [--device cuda] [--session]

--session generates from a session of the model (a sequence of its own) after a call on the
model's own sequence, as programs that hold several conversations do.

Needs the ggraph package on PYTHONPATH; loops run on CUDA only.
"""

import argparse
import time

import ggraph

LOOP_STATS = ("loop_looks", "loop_tokens_streamed", "loop_looks_given_up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--chains", default="256,8")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=30, help="tokens taken before breaking off")
    ap.add_argument("--max-tokens", type=int, default=200, help="what generate() is asked for")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--session", action="store_true", help="generate from a session")
    ap.add_argument("--n-ctx", type=int, default=1024)
    args = ap.parse_args()
    m = ggraph.Model(args.model, device=args.device, n_ctx=args.n_ctx, n_seq_max=2)
    gen_from = m.session() if args.session else m
    for chain in (int(c) for c in args.chains.split(",")):
        for trial in range(args.trials):
            if args.session:
                m.eval([1, 2])  # the model's own sequence selected last
                m.reset()
            m.reset_graph_stats()
            t0 = time.perf_counter()
            times = []
            for _ in gen_from.generate(
                [1, 2, 3], max_tokens=args.max_tokens, chain=chain, logprobs=0, ignore_eos=True
            ):
                times.append((time.perf_counter() - t0) * 1e3)
                if len(times) >= args.tokens:
                    break
            s = m.graph_stats
            seen = " ".join(f"{k}={s.get(k, 0):g}" for k in LOOP_STATS)
            shown = " ".join(f"{t:.2f}" for t in times[:12])
            last = f"{times[-1]:.2f}"
            print(f"chain {chain} trial {trial}: ms {shown} ... {last}; {seen}", flush=True)


if __name__ == "__main__":
    main()
