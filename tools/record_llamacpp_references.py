"""Records llama.cpp's logits for small random-weight files of every architecture in K-quant
mixes, for tests/python/test_archs.py::test_matches_llamacpp (CI never rebuilds llama.cpp).

Each file is written by tests/python/test_archs.py's write_arch from a fixed seed, so the test
writes the same bytes again and compares ggraph's logits with these at every position. Needs
llama-cpp-python (built from source) and gguf:

    python tools/record_llamacpp_references.py tests/python/data/llamacpp_arch_logits.npz
"""

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import test_archs  # noqa: E402

# (architecture, weight mix, seed). llama.cpp ignores Phi 3's sliding window, so its file
# declares none.
CASES = [
    ("llama", "Q4_K_M", 11),
    ("llama", "Q6_K", 12),
    ("qwen2", "Q4_K_M", 13),
    ("qwen2", "Q5_K", 14),
    ("qwen3", "Q4_K_M", 15),
    ("qwen3", "Q3_K", 16),
    ("phi3", "Q4_K_M", 17),
    ("phi3", "Q2_K", 18),
    ("gemma3", "Q4_K_M", 19),
    ("gemma3", "Q5_0", 20),
]


def write_case(path, arch, mix, seed):
    meta = {"attention.sliding_window": None} if arch == "phi3" else None
    shape = test_archs.K_SHAPES[arch]
    return test_archs.write_arch(path, arch, mix, seed=seed, shape=shape, meta=meta, vocab=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output .npz")
    args = parser.parse_args()
    import llama_cpp

    out = {"llama_cpp_version": np.array(llama_cpp.__version__)}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, mix, seed in CASES:
            path = os.path.join(tmp, f"{arch}-{mix}.gguf")
            write_case(path, arch, mix, seed)
            llm = llama_cpp.Llama(path, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
            llm.eval(test_archs.PROMPT)
            logits = np.array(llm.scores[: len(test_archs.PROMPT)], dtype=np.float32)
            out[f"{arch}_{mix}"] = logits
            print(f"{arch} {mix}: logits {logits.shape}, mean |x| {np.abs(logits).mean():.4f}")
            del llm
    np.savez_compressed(args.out, **out)


if __name__ == "__main__":
    main()
