"""ggraph's decoders of every weight format against gguf-py's (gguf.quants.dequantize), bit for bit.

Blocks are random bytes with finite f16 scales; extra blocks put the extreme f16 values in every
scale field and, for the K-quants and IQ4_XS, every byte value into every byte of the packed
sub-block scales, so that each 6-bit scale and minimum pattern is decoded at each position.
"""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from ggraph import _core

# The byte offsets of each format's f16 fields, and of its packed sub-block scales (ggml's block
# structs, as in src/quant.h).
FORMATS = {
    "Q4_0": {"halves": [0], "scales": None},
    "Q4_1": {"halves": [0, 2], "scales": None},
    "Q5_0": {"halves": [0], "scales": None},
    "Q5_1": {"halves": [0, 2], "scales": None},
    "Q8_0": {"halves": [0], "scales": None},
    "Q2_K": {"halves": [80, 82], "scales": (0, 16)},
    "Q3_K": {"halves": [108], "scales": (96, 12)},
    "Q4_K": {"halves": [0, 2], "scales": (4, 12)},
    "Q5_K": {"halves": [0, 2], "scales": (4, 12)},
    "Q6_K": {"halves": [208], "scales": (192, 16)},
    "IQ4_NL": {"halves": [0], "scales": None},
    "IQ4_XS": {"halves": [0], "scales": (2, 6)},
}

# Largest finite, smallest normal, smallest subnormal, zero, one, their negatives.
EXTREME_HALVES = [0x7BFF, 0x0400, 0x0001, 0x0000, 0x3C00, 0xFBFF, 0x8400, 0x8001, 0x8000, 0xBC00]


def random_finite_halves(rng, shape):
    h = rng.integers(0, 0x10000, size=shape, dtype=np.uint32).astype(np.uint16)
    # An all-ones exponent is Inf or NaN: move those to the largest finite exponent.
    bad = (h & 0x7C00) == 0x7C00
    h[bad] &= np.uint16(0xFBFF)
    return h


def make_blocks(name, rng):
    fmt = FORMATS[name]
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    n_random = 300
    n_extreme = len(EXTREME_HALVES) ** len(fmt["halves"])
    n_scales = 256 if fmt["scales"] else 0
    nb = n_random + n_extreme + n_scales
    blocks = rng.integers(0, 256, size=(nb, type_size), dtype=np.uint16).astype(np.uint8)
    halves = random_finite_halves(rng, (nb, len(fmt["halves"])))
    # Every combination of extreme values over the f16 fields.
    for i in range(n_extreme):
        for f in range(len(fmt["halves"])):
            idx = (i // len(EXTREME_HALVES) ** f) % len(EXTREME_HALVES)
            halves[n_random + i, f] = EXTREME_HALVES[idx]
    for f, off in enumerate(fmt["halves"]):
        blocks[:, off : off + 2] = halves[:, f : f + 1].view(np.uint8)
    if fmt["scales"]:
        off, size = fmt["scales"]
        # Block i holds byte (i + 37 j) % 256 at scale byte j: every value at every position.
        i = np.arange(256).reshape(-1, 1)
        j = np.arange(size).reshape(1, -1)
        blocks[nb - 256 :, off : off + size] = ((i + 37 * j) % 256).astype(np.uint8)
    return blocks, nb * block_size


def same_bits(got, want):
    got_bits = got.view(np.uint32)
    want_bits = want.view(np.uint32)
    both_nan = np.isnan(got) & np.isnan(want)
    return np.flatnonzero((got_bits != want_bits) & ~both_nan)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_matches_gguf_py_bit_for_bit(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    blocks, n = make_blocks(name, rng)
    want = dequantize(blocks.reshape(-1), GGMLQuantizationType[name]).reshape(-1)
    got = _core._dequantize(name, blocks.tobytes(), n)
    assert got.dtype == np.float32 and got.shape == (n,)
    bad = same_bits(got, want)
    block_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    assert bad.size == 0, (
        f"{name}: {bad.size} of {n} elements differ, first at element {bad[0]} "
        f"(block {bad[0] // block_size}): ggraph {got[bad[0]]!r}, gguf-py {want[bad[0]]!r}"
    )
    # The random blocks must exercise real values, not only zeros and infinities.
    assert np.count_nonzero(np.isfinite(want) & (want != 0)) > n // 2


def test_dequantize_refuses_wrong_sizes_and_unknown_types():
    with pytest.raises(ValueError, match="expected 144 bytes, got 143"):
        _core._dequantize("Q4_K", bytes(143), 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        _core._dequantize("Q6_K", bytes(210), 128)
    with pytest.raises(ValueError, match="unknown ggml type name 'Q9_K'"):
        _core._dequantize("Q9_K", bytes(1), 1)
    with pytest.raises(ValueError, match="cannot decode IQ2_XXS"):
        _core._dequantize("IQ2_XXS", bytes(66), 256)


def test_every_tensor_of_the_real_gemma3_file_decodes_like_gguf_py(gemma3):
    path = gemma3
    from gguf import GGUFReader

    reader = GGUFReader(path)
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name
        if name not in FORMATS:
            continue
        seen.add(name)
        # The first 64 rows of each tensor keep the test quick (the embedding has 262,144).
        rows = np.asarray(t.data)[:64]
        data = rows.reshape(-1).view(np.uint8)
        n = rows.shape[0] * int(t.shape[0])
        want = dequantize(data, t.tensor_type).reshape(-1)
        got = _core._dequantize(name, data.tobytes(), n)
        bad = same_bits(got, want)
        assert bad.size == 0, f"{t.name} ({name}): {bad.size} of {n} elements differ"
    # The file mixes these formats (with F32 norms).
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= seen
