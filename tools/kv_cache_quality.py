"""What each KV cache type costs in quality: a real model on the CPU against llama.cpp's
recorded logits (tests/python/data/<golden>_*), for kv_type f32, f16 and q8_0.

Reports, per type: the cosine of the last position's logits with llama.cpp's (mean and lowest
over the prompts), top-1 agreement over every prompt position, teacher-forced agreement with
llama.cpp's greedy continuations and, where float64 math's choices were recorded (gemma3), the
lowest per-prompt agreement with them. Prints a Markdown table for BENCHMARKS.md.

python tools/kv_cache_quality.py [--golden smollm2|gemma3] [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import ggraph
from ggraph.model import resolve_model

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "python", "data")


def measure(path, kv_type, n_threads, logits, greedy, exact):
    m = ggraph.Model(path, device="cpu", n_ctx=1100, n_threads=n_threads, kv_type=kv_type)
    prompts = sorted({k.split("_")[0] for k in logits.files})
    cosines, agree, total = [], 0, 0
    for p in prompts:
        m.reset()
        got = m.eval(logits[f"{p}_ids"].tolist(), all_logits=True)
        ref = logits[f"{p}_logits"]
        last = got[-1]
        cosines.append(float(np.dot(last, ref) / (np.linalg.norm(last) * np.linalg.norm(ref))))
        ref_top = logits[f"{p}_top8_all_positions"][:, 0]
        agree += int(np.sum(got.argmax(axis=1) == ref_top))
        total += len(ref_top)
    forced_agree = forced_total = 0
    exact_rates = []
    for i, g in enumerate(greedy):
        m.reset()
        ids = g["prompt_ids"] + g["greedy_ids"]
        got = m.eval(ids, all_logits=True)
        n_p = len(g["prompt_ids"])
        pred = got[n_p - 1 : len(ids) - 1].argmax(axis=1)
        forced_agree += int(np.sum(pred == np.array(g["greedy_ids"])))
        forced_total += len(g["greedy_ids"])
        if exact is not None:
            choice = exact[f"p{i}_forced_top2_ids"][:, 0]
            exact_rates.append(float(np.mean(pred[: len(choice)] == choice)))
    return {
        "kv_type": kv_type,
        "cosine_mean": float(np.mean(cosines)),
        "cosine_min": float(np.min(cosines)),
        "top1": (agree, total),
        "forced": (forced_agree, forced_total),
        "exact_min": min(exact_rates) if exact_rates else None,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--golden", choices=("smollm2", "gemma3"), default="smollm2")
    p.add_argument("--model", help="the golden's model file (default: as `-m NAME` finds it)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    path = args.model or resolve_model(args.golden)
    logits = np.load(os.path.join(DATA, f"{args.golden}_logits.npz"))
    with open(os.path.join(DATA, f"{args.golden}_greedy.json")) as f:
        greedy = json.load(f)
    exact_path = os.path.join(DATA, f"{args.golden}_float64.npz")
    exact = np.load(exact_path) if os.path.exists(exact_path) else None
    print("| kv_type | cosine, last position (mean / lowest) | top-1, all positions | "
          "teacher-forced greedy | float64's choices, lowest prompt |")  # fmt: skip
    print("|---|---|---|---|---|")
    for kv_type in ("f32", "f16", "q8_0"):
        r = measure(path, kv_type, args.threads, logits, greedy, exact)
        a, n = r["top1"]
        fa, fn = r["forced"]
        low = "-" if r["exact_min"] is None else f"{r['exact_min']:.1%}"
        print(
            f"| {kv_type} | {r['cosine_mean']:.5f} / {r['cosine_min']:.5f} | "
            f"{a}/{n} ({a / n:.1%}) | {fa}/{fn} ({fa / fn:.1%}) | {low} |"
        )


if __name__ == "__main__":
    main()
