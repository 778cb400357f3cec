"""Malformed GGUF files from a valid one, for the loader's robustness test (test_fuzz.py).

Every variant is derived deterministically from the base file's bytes: truncations, single-byte
corruptions of the header, every 4- and 8-byte field of the header set to extreme values, and
chunks of the header duplicated, dropped or swapped. The header is what the reader interprets;
the tensor data region gets a sample of corruptions too (they must load or fail, never crash).

    python tests/python/gguf_fuzz.py BASE.gguf OUTDIR   # writes the corpus, for other tools
"""

from __future__ import annotations

import os
import random
import struct
import sys

EXTREME_U64 = (0, 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
EXTREME_U32 = (0, 1, 7, 13, 2**16, 2**31 - 1, 2**31, 2**32 - 1)


def header_size(data: bytes) -> int:
    """Where the tensor data starts: the header's end, found through gguf-py's reader when it is
    installed, else a conservative guess (the first 4 KiB or the whole file)."""
    try:
        import numpy as np
        from gguf import GGUFReader

        r = GGUFReader(np.frombuffer(data, dtype=np.uint8))
        return int(r.data_offset)
    except Exception:
        return min(len(data), 4096)


def variants(base: bytes, seed: int = 0):
    """Yields (name, bytes) for each malformed variant of base."""
    rng = random.Random(seed)
    head = header_size(base)
    size = len(base)
    # Truncations: every few bytes through the header, a sample of the data.
    step = max(1, head // 250)
    for cut in list(range(0, head, step)) + rng.sample(range(head, size), min(40, size - head)):
        yield f"truncate-{cut}", base[:cut]
    # Single bytes of the header.
    for at in rng.sample(range(4, head), min(260, head - 4)):
        b = bytearray(base)
        b[at] = rng.choice((0x00, 0xFF, 0x80, 0x7F, b[at] ^ 0x01, rng.randrange(256)))
        yield f"byte-{at}", bytes(b)
    # Every aligned and unaligned 8-byte field position of the first part of the header.
    for at in range(4, min(head - 8, 4 + 8 * 60)):
        b = bytearray(base)
        b[at : at + 8] = struct.pack("<Q", EXTREME_U64[at % len(EXTREME_U64)])
        yield f"u64-{at}", bytes(b)
    # A sample of 4-byte fields across the whole header (value types, n_dims, tensor types).
    for at in rng.sample(range(4, head - 4), min(200, head - 8)):
        b = bytearray(base)
        b[at : at + 4] = struct.pack("<I", rng.choice(EXTREME_U32))
        yield f"u32-{at}", bytes(b)
    # Chunks of the header duplicated, dropped or swapped.
    for i in range(60):
        a = rng.randrange(4, head - 1)
        n = rng.randrange(1, min(64, head - a) + 1)
        chunk = base[a : a + n]
        kind = i % 3
        if kind == 0:
            out = base[: a + n] + chunk + base[a + n :]
        elif kind == 1:
            out = base[:a] + base[a + n :]
        else:
            c = rng.randrange(4, head - n)
            b = bytearray(base)
            b[a : a + n], b[c : c + n] = base[c : c + n], chunk
            out = bytes(b)
        yield f"chunk-{kind}-{a}-{n}", out
    # The data region: flipped bytes (weights may become NaN; loading must still not crash).
    for at in rng.sample(range(head, size), min(30, size - head)):
        b = bytearray(base)
        b[at] ^= 0xFF
        yield f"data-{at}", bytes(b)
    # Whole-file oddities.
    yield "empty", b""
    yield "magic-only", base[:4]
    yield "wrong-magic", b"GGML" + base[4:]
    yield "version-1", base[:4] + struct.pack("<I", 1) + base[8:]
    yield "version-99", base[:4] + struct.pack("<I", 99) + base[8:]
    yield "doubled", base + base


def write_corpus(base_path: str, out_dir: str, seed: int = 0) -> list[str]:
    with open(base_path, "rb") as f:
        base = f.read()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, data in variants(base, seed):
        path = os.path.join(out_dir, name + ".gguf")
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"{len(write_corpus(sys.argv[1], sys.argv[2]))} files in {sys.argv[2]}")
