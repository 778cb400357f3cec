"""llama-bench-style throughput: pp (prompt processing) and tg (token generation) in tokens/s,
optionally after a context of d tokens (-d, as llama-bench's: "pp512 @ d4096"). Beside tg, gen
is the speed of the generation loop a user's `generate()` runs (greedy sampling and detokenizing
each token, the end of generation ignored), after a short prompt: what `ggraph generate`
prints. On CUDA the "host us/step" column is the engine's host time an eval step for tg and a
generated token for gen (where a chain's launch is shared by its tokens; the last repetition's
generation loop, its prompt excluded).

python -m ggraph.bench -m MODEL -p 512 -n 128 -r 5 [-d 0,4096] [--device cuda]
    [--cuda-graphs off,patch] [--kv-type auto] [--allow-longer-context]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _time_pp(model, n_prompt, rng, depth=0):
    tokens = rng.integers(0, model.n_vocab, size=n_prompt).tolist()
    model.rewind(depth)
    t0 = time.perf_counter()
    model.eval(tokens)
    return time.perf_counter() - t0


def _time_tg(model, n_gen, rng, depth=0):
    tokens = rng.integers(0, model.n_vocab, size=n_gen).tolist()
    model.rewind(depth)
    t0 = time.perf_counter()
    for t in tokens:
        model.eval([t])
    return time.perf_counter() - t0


def _time_gen(model, n_gen, rng, depth=0, chain=None):
    # The context, then a short prompt evaluated before the clock starts, as `ggraph generate`
    # times it; the generation finds both in the cache.
    prompt = model._tokens[:depth] + rng.integers(0, model.n_vocab, size=8).tolist()
    model.rewind(depth)
    model.eval(prompt[depth:])
    # The engine's counters from here: the row's host time a token is the loop's own (the last
    # repetition's), not the prompt's graph build shared out over its tokens.
    model.reset_graph_stats()
    t0 = time.perf_counter()
    for _ in model.generate(prompt, max_tokens=n_gen, temperature=0, ignore_eos=True, chain=chain):
        pass
    elapsed = time.perf_counter() - t0
    if model.n_generated != n_gen:
        raise RuntimeError(f"gen: {model.n_generated} of {n_gen} tokens ({model.stop_reason})")
    model.rewind(depth)
    return elapsed


def run_bench(
    path,
    n_prompt=512,
    n_gen=128,
    reps=5,
    device="auto",
    modes=("patch",),
    n_threads=None,
    seed=0,
    depths=(0,),
    kv_type="auto",
    allow_longer_context=False,
    chain=None,
):
    """Returns one result dict per (mode, depth, test); chain: the gen rows' decode steps a
    launch (generate's chain; None: its default)."""
    from ggraph.model import Model

    if any(d < 0 for d in depths):
        raise ValueError(f"depths must be >= 0, got {list(depths)}")
    rows = []
    for mode in modes:
        model = Model(
            path,
            device=device,
            n_ctx=max(n_prompt, n_gen) + max(depths) + 16,
            n_threads=n_threads,
            cuda_graphs=mode,
            kv_type=kv_type,
            allow_longer_context=allow_longer_context,
        )
        rng = np.random.default_rng(seed)
        tests = []
        for depth in depths:
            at = f" @ d{depth}" if depth else ""
            if n_prompt > 0:
                tests.append((f"pp{n_prompt}{at}", n_prompt, _time_pp, depth))
            if n_gen > 0:
                tests.append((f"tg{n_gen}{at}", n_gen, _time_tg, depth))
                tests.append((f"gen{n_gen}{at}", n_gen, _time_gen, depth))
        for name, n, fn, depth in tests:
            # The context of `depth` tokens, evaluated once; each run starts from it.
            if depth != getattr(model, "_bench_depth", None):
                model.reset()
                if depth:
                    model.eval(rng.integers(0, model.n_vocab, size=depth).tolist())
                model._bench_depth = depth
            # Warm-up, as llama-bench's: first use and capture of the graphs of the timed shape
            # (a prompt's batch is its own shape; decode steps are one token each; a generation's
            # launches are of the lengths its tokens split into).
            kw = {"chain": chain} if fn is _time_gen else {}
            fn(model, n if fn is not _time_tg else min(n, 16), rng, depth, **kw)
            model.reset_graph_stats()
            times = [fn(model, n, rng, depth, **kw) for _ in range(reps)]
            stats = model.graph_stats
            rates = [n / t for t in times]
            row = {
                "model": os.path.basename(path),
                "size_mib": model._ctx.weight_bytes / 2**20,
                "backend": model._ctx.backend_name,
                "mode": mode if model.device.startswith("cuda") else "-",
                "kv_type": model.kv_type,
                "test": name,
                "tokens_per_s": statistics.mean(rates),
                "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            }
            steps = stats.get("steps", 0)
            # Host time an eval step (tg) or a generated token (gen: chains share a step's over
            # its tokens), and its parts (in the JSON output).
            per = steps if name.startswith("tg") else stats.get("tokens", 0)
            if per and name.startswith(("tg", "gen")):
                row["host_us_per_step"] = stats.get("host_us_total", 0.0) / per
                for part in ("build", "input", "record", "patch", "launch"):
                    row[f"{part}_us_per_step"] = stats.get(f"{part}_us_total", 0.0) / per
                row["patched_nodes_per_step"] = stats.get("kernel_nodes_patched", 0.0) / per
            rows.append(row)
        del model
        if not device.startswith("cuda") and device != "auto":
            break  # graph modes mean nothing on the CPU
    base = {r["test"]: r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    for r in rows:
        if r["test"] in base and r["mode"] not in ("off", "-"):
            r["speedup_vs_off"] = r["tokens_per_s"] / base[r["test"]]
    return rows


def format_markdown(rows):
    head = "| model | size | backend | graphs | test | t/s | host us/step | vs off | kv cache |"
    out = [head, "|" + "---|" * 9]
    for r in rows:
        host = f"{r['host_us_per_step']:.1f}" if "host_us_per_step" in r else ""
        sp = f"{r['speedup_vs_off']:.2f}x" if "speedup_vs_off" in r else ""
        out.append(
            f"| {r['model']} | {r['size_mib']:.1f} MiB | {r['backend']} | {r['mode']} | "
            f"{r['test']} | {r['tokens_per_s']:.2f} ± {r['stddev']:.2f} | {host} | {sp} | "
            f"{r['kv_type']} |"
        )
    return "\n".join(out)


def add_arguments(p):
    p.add_argument("-m", "--model", help="GGUF file (default: SmolLM2-135M-Instruct)")
    from ggraph.cli import INT32_MAX, _int_in

    p.add_argument("-p", "--n-prompt", type=_int_in(0, INT32_MAX), default=512)
    p.add_argument("-n", "--n-gen", type=_int_in(0, INT32_MAX), default=128)
    p.add_argument("-r", "--repetitions", type=_int_in(1, 1_000_000), default=5)
    p.add_argument(
        "-d", "--n-depth", default="0", help="comma-separated context depths to test at (0,4096)"
    )
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--cuda-graphs", default="patch", help="comma-separated modes: off,recapture,update,patch"
    )
    p.add_argument("-o", "--output", choices=("md", "json"), default="md")
    p.add_argument(
        "--chain",
        type=_int_in(1, 256),
        default=None,
        help="the gen rows' decode steps a launch (generate's chain; default: its own)",
    )
    from ggraph.cli import add_context_arguments

    add_context_arguments(p)


def main_args(args):
    from ggraph.model import default_model_path

    path = args.model or default_model_path()
    modes = [m.strip() for m in args.cuda_graphs.split(",") if m.strip()]
    try:
        depths = [int(d) for d in str(args.n_depth).split(",") if d.strip()] or [0]
    except ValueError:
        raise ValueError(f"-d: expected comma-separated integers, got {args.n_depth!r}") from None
    if not modes:
        raise ValueError("--cuda-graphs: expected at least one mode")
    if args.n_prompt == 0 and args.n_gen == 0:
        raise ValueError("nothing to measure: -p and -n are both 0")
    from ggraph.cli import INT32_MAX

    if any(not 0 <= d <= INT32_MAX for d in depths):
        raise ValueError(f"-d: expected depths from 0 to {INT32_MAX}, got {args.n_depth!r}")
    rows = run_bench(
        path,
        args.n_prompt,
        args.n_gen,
        args.repetitions,
        args.device,
        modes,
        args.threads,
        depths=depths,
        kv_type=args.kv_type,
        allow_longer_context=args.allow_longer_context,
        chain=args.chain,
    )
    print(json.dumps(rows, indent=2) if args.output == "json" else format_markdown(rows))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ggraph.bench", description=__doc__)
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
