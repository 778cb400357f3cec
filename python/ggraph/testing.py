"""Test helpers: random-weight llama models and GGUF files, written with gguf-py.

ggraph.testing needs the `gguf` package (gguf-py 0.17 or newer: pip install gguf, or the test
extra), imported when first needed: its GGUFWriter writes the files and its quantizers encode
the weights. This module adds typed metadata, lazy tensors (written one at a time, so large
models never sit in memory), random quantized blocks of every weight format (K-quants
included) and llama-shaped models with a byte-level BPE vocabulary::

    from ggraph.testing import write_random_gguf
    write_random_gguf("tiny.gguf", shape="tiny", weight_type="Q4_1")

or from the shell::

    python -m ggraph.testing model.gguf --shape smollm2-135m --type Q4_K_M
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Union

import numpy as np

DEFAULT_ALIGNMENT = 32

# Metadata value types: name -> GGUF type id.
VALUE_TYPES = {
    "uint8": 0,
    "int8": 1,
    "uint16": 2,
    "int16": 3,
    "uint32": 4,
    "int32": 5,
    "float32": 6,
    "bool": 7,
    "string": 8,
    "array": 9,
    "uint64": 10,
    "int64": 11,
    "float64": 12,
}
_SCALAR_DTYPES = {
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "uint16": np.dtype("<u2"),
    "int16": np.dtype("<i2"),
    "uint32": np.dtype("<u4"),
    "int32": np.dtype("<i4"),
    "float32": np.dtype("<f4"),
    "bool": np.dtype("<u1"),
    "uint64": np.dtype("<u8"),
    "int64": np.dtype("<i8"),
    "float64": np.dtype("<f8"),
}


@dataclasses.dataclass(frozen=True)
class GGMLType:
    name: str
    id: int
    block_size: int  # elements per block
    type_size: int  # bytes per block


# ggml's tensor types with their block layouts (ggml-common.h).
GGML_TYPES = {
    t.name: t
    for t in [
        GGMLType("F32", 0, 1, 4),
        GGMLType("F16", 1, 1, 2),
        GGMLType("Q4_0", 2, 32, 18),
        GGMLType("Q4_1", 3, 32, 20),
        GGMLType("Q5_0", 6, 32, 22),
        GGMLType("Q5_1", 7, 32, 24),
        GGMLType("Q8_0", 8, 32, 34),
        GGMLType("Q8_1", 9, 32, 36),
        GGMLType("Q2_K", 10, 256, 84),
        GGMLType("Q3_K", 11, 256, 110),
        GGMLType("Q4_K", 12, 256, 144),
        GGMLType("Q5_K", 13, 256, 176),
        GGMLType("Q6_K", 14, 256, 210),
        GGMLType("Q8_K", 15, 256, 292),
        GGMLType("IQ2_XXS", 16, 256, 66),
        GGMLType("IQ2_XS", 17, 256, 74),
        GGMLType("IQ3_XXS", 18, 256, 98),
        GGMLType("IQ1_S", 19, 256, 50),
        GGMLType("IQ4_NL", 20, 32, 18),
        GGMLType("IQ3_S", 21, 256, 110),
        GGMLType("IQ2_S", 22, 256, 82),
        GGMLType("IQ4_XS", 23, 256, 136),
        GGMLType("I8", 24, 1, 1),
        GGMLType("I16", 25, 1, 2),
        GGMLType("I32", 26, 1, 4),
        GGMLType("I64", 27, 1, 8),
        GGMLType("F64", 28, 1, 8),
        GGMLType("IQ1_M", 29, 256, 56),
        GGMLType("BF16", 30, 1, 2),
        GGMLType("TQ1_0", 34, 256, 54),
        GGMLType("TQ2_0", 35, 256, 66),
        GGMLType("MXFP4", 39, 32, 17),
    ]
}
# Types the writer can encode from float data (and decode back).
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_INT_TYPES = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "F64": "<f8"}
# general.file_type values (llama_ftype) for a model whose weights are mostly of one type.
FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "BF16": 32,
}


def ggml_type(name: str) -> GGMLType:
    try:
        return GGML_TYPES[name.upper()]
    except KeyError:
        raise ValueError(
            f"unknown ggml type {name!r}; expected one of {', '.join(GGML_TYPES)}"
        ) from None


def tensor_nbytes(type_name: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of GGUF shape (ne[0] first) stored as type_name."""
    t = ggml_type(type_name)
    if not shape or any(int(n) < 1 for n in shape):
        raise ValueError(f"shape {list(shape)}: expected 1 to 4 positive dimensions")
    if shape[0] % t.block_size:
        raise ValueError(
            f"shape {list(shape)}: ne[0] must be a multiple of the {t.name} block size "
            f"{t.block_size}"
        )
    return int(np.prod(shape[1:], dtype=np.int64)) * (shape[0] // t.block_size) * t.type_size


# ---------------------------------------------------------------------------------------------
# Quantizers: gguf-py's, which round as ggml does.


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Encodes float values as type_name (one of QUANTIZABLE) with gguf-py; returns the bytes
    as a flat uint8 array."""
    gguf = _gguf()
    name = ggml_type(type_name).name
    if name not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {name}; supported: {', '.join(QUANTIZABLE)}")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    block = ggml_type(name).block_size
    if x.size % block:
        raise ValueError(f"{x.size} elements are not a multiple of the block size {block}")
    rows = x.reshape(-1, block) if block > 1 else x.reshape(1, -1)
    out = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[name])
    return np.ascontiguousarray(out).reshape(-1).view(np.uint8)


def dequantize(data: bytes | np.ndarray, type_name: str) -> np.ndarray:
    """Decodes bytes of type_name into a flat float32 array with gguf-py."""
    gguf = _gguf()
    t = ggml_type(type_name)
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size % t.type_size:
        raise ValueError(f"{raw.size} bytes are not whole {t.name} blocks of {t.type_size}")
    rows = raw.reshape(-1, t.type_size)
    try:
        out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[t.name])
    except NotImplementedError:
        raise ValueError(f"cannot dequantize {t.name}") from None
    return np.asarray(out, dtype=np.float32).reshape(-1)


# Types random_blocks generates beside the quantizable ones, and llama.cpp-style mixes: the main
# type, and the type of attn_v, ffn_down and the output projection (the tensors llama.cpp's
# "_M" mixes keep at more bits).
RANDOM_BLOCK_TYPES = QUANTIZABLE + ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
WEIGHT_TYPES = RANDOM_BLOCK_TYPES + tuple(MIXES)
# llama.cpp's fallbacks for K-quant tensors whose rows are not whole 256-element super-blocks
# (the tiny and SmolLM2 shapes): a type of 32-element blocks with about as many bits.
K_FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# K-quant sub-block fields that centre the values on zero, with the spread of one unit of d:
# (offset, packed bytes, std). Q4_K: scale 8 and minimum 60 (8 * 7.5) for every sub-block, in the
# 12-byte 6-bit packing; Q5_K: 4 and 62 (4 * 15.5); Q6_K: int8 scales 2 (values 2 (q - 32)).
_K_SUBBLOCKS = {
    "Q4_K": (4, [8] * 4 + [60 | 3 << 6] * 4 + [8 | 12 << 4] * 4, 8 * 4.61),
    "Q5_K": (4, [4] * 4 + [62 | 3 << 6] * 4 + [4 | 14 << 4] * 4, 4 * 9.23),
    "Q6_K": (192, [2] * 16, 2 * 18.47),
}


def random_blocks(
    type_name: str, n_elements: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    """Random weights of about the given standard deviation, generated directly as blocks.

    Quantized types get uniform random quants and scales chosen so that the dequantized values
    have standard deviation near `std` and mean near zero; no float tensor is materialized.
    """
    name = ggml_type(type_name).name
    if name in ("F32", "F16", "BF16"):
        return quantize(rng.standard_normal(n_elements, dtype=np.float32) * np.float32(std), name)
    t = ggml_type(name)
    if name not in RANDOM_BLOCK_TYPES or n_elements % t.block_size:
        raise ValueError(f"cannot generate random {name} blocks for {n_elements} elements")
    n = n_elements // t.block_size
    out = np.frombuffer(rng.bytes(n * t.type_size), np.uint8).reshape(n, t.type_size).copy()
    jitter = rng.uniform(0.9, 1.1, n).astype(np.float32)

    def put_f16(at: int, v: np.ndarray) -> None:
        out[:, at : at + 2] = v.astype("<f2")[:, None].view(np.uint8)

    if name in _K_SUBBLOCKS:
        at, packed, unit = _K_SUBBLOCKS[name]
        out[:, at : at + len(packed)] = packed
        d = np.float32(std / unit) * jitter
        put_f16(208 if name == "Q6_K" else 0, d)
        if name != "Q6_K":
            put_f16(2, d)  # dmin, times the minimums above
        return out.reshape(-1)
    if name == "Q8_0":
        # Uniform integers in [-127, 127] have standard deviation 73.3.
        d = np.float32(std / 73.3) * jitter
        out[:, 2:] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    else:
        # Uniform nibbles have standard deviation 4.61, five-bit values 9.23.
        five = name in ("Q5_0", "Q5_1")
        d = np.float32(std / (9.23 if five else 4.61)) * jitter
        if name in ("Q4_0", "Q5_0"):
            d = d * rng.choice(np.array([-1, 1], np.float32), n)
        else:
            m = np.float32(-15.5 if five else -7.5) * d * rng.uniform(0.95, 1.05, n)
            put_f16(2, m.astype(np.float32))
    put_f16(0, d)
    return out.reshape(-1)


# ---------------------------------------------------------------------------------------------
# Writer


@dataclasses.dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type, e.g. Typed("uint64", 5) or
    Typed("array", [1, 2], elem_type="uint8"). Arrays of arrays use elem_type="array"."""

    type: str
    value: Any
    elem_type: str | None = None


TensorData = Union[np.ndarray, bytes, bytearray, memoryview, Callable[[], Any]]


@dataclasses.dataclass
class Tensor:
    """One tensor to write. shape is GGUF order (ne[0], the contiguous dimension, first).

    data is float values (quantized to `type` on write), encoded bytes (bytes or a uint8 array
    of exactly the tensor's size), integer values for I8..I64, or a callable returning any of
    these, called only when the tensor is written (so large models never sit in memory).
    """

    name: str
    data: TensorData
    type: str = "F32"
    shape: Sequence[int] | None = None

    def resolved_shape(self) -> list[int]:
        if self.shape is not None:
            return [int(n) for n in self.shape]
        if isinstance(self.data, np.ndarray) and self.data.dtype != np.uint8:
            return [int(n) for n in reversed(self.data.shape)]
        raise ValueError(f"tensor {self.name!r}: a shape is needed for bytes or lazy data")


def _infer_type(value: Any) -> str:
    if isinstance(value, Typed):
        return value.type
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, np.integer):
        return value.dtype.name
    if isinstance(value, np.floating):
        return {4: "float32", 8: "float64"}.get(value.dtype.itemsize, "float32")
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return "uint32"
        if -(2**31) <= value < 0:
            return "int32"
        return "uint64" if value >= 0 else "int64"
    if isinstance(value, float):
        return "float32"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "array"
    raise TypeError(f"cannot store a {type(value).__name__} in GGUF metadata")


def _infer_elem_type(values: Any) -> str:
    if isinstance(values, np.ndarray):
        if values.dtype == np.bool_:
            return "bool"
        if values.dtype.kind in "iu":
            return values.dtype.name
        if values.dtype.kind == "f":
            return "float64" if values.dtype.itemsize == 8 else "float32"
        if values.dtype.kind in "US":
            return "string"
        raise TypeError(f"cannot store a numpy {values.dtype} array in GGUF metadata")
    if len(values) == 0:
        raise ValueError("cannot infer the element type of an empty array; use Typed")
    kinds = {_infer_type(v) for v in values}
    ints = {"uint32", "int32", "uint64", "int64"}
    if kinds <= ints:
        lo, hi = min(values), max(values)
        if -(2**31) <= lo and hi < 2**31:
            return "int32"
        return "int64" if lo < 0 else "uint64"
    if len(kinds) == 1:
        return kinds.pop()
    if kinds <= ints | {"float32"}:
        return "float32"
    raise TypeError(f"array mixes element types {sorted(kinds)}")


def _gguf():
    """gguf-py, which writes the files and quantizes: imported when first needed, so that the
    shapes, layouts and random blocks above work without it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("ggraph.testing needs the gguf package: pip install gguf") from None
    return gguf


class _Array(list):
    """The items of an array nested in an array, with their own GGUF element type (gguf-py
    takes an inner array's element type from its first item alone)."""

    def __init__(self, items: Iterable[Any], sub_type: Any):
        super().__init__(items)
        self.sub_type = sub_type


@functools.cache
def _Writer():  # noqa: N802 - returns a class
    """GGUFWriter that also writes empty arrays (legal GGUF, which gguf-py refuses to write)
    and arrays nested in arrays with their own element types."""
    gguf = _gguf()

    class Writer(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY:
                if isinstance(val, _Array):
                    sub_type = val.sub_type
                if len(val) == 0 and sub_type is not None:
                    head = self._pack("I", vtype) if add_vtype else b""
                    return bytes(head + self._pack("I", sub_type) + self._pack("Q", 0))
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _value_for_writer(type_name: str, value: Any, elem_type: str | None = None):
    """(GGUFValueType, value, element type) for GGUFWriter.add_key_value, with the range checks
    and element-type inference of this module (gguf-py infers an array's type from its first
    element alone)."""
    vt = _gguf().GGUFValueType
    if isinstance(value, Typed):
        return _value_for_writer(value.type, value.value, value.elem_type)
    if type_name == "array":
        elem = elem_type or _infer_elem_type(value)
        if elem not in VALUE_TYPES:
            raise ValueError(f"unknown array element type {elem!r}")
        if elem == "array":
            items = [_Array(*_value_for_writer("array", v)[1:]) for v in value]
        elif elem == "string":
            items = [v if isinstance(v, (str, bytes)) else str(v) for v in value]
        elif elem == "bool":
            items = [bool(v) for v in value]
        else:
            arr = np.asarray(value)
            out = arr.astype(_SCALAR_DTYPES[elem])
            if out.dtype.kind in "iu" and not np.array_equal(out, arr):
                raise ValueError(f"array values do not fit {elem}")
            items = out.tolist()
        return vt.ARRAY, items, vt[elem.upper()]
    if type_name not in _SCALAR_DTYPES and type_name != "string":
        raise ValueError(f"unknown metadata type {type_name!r}")
    if type_name in ("string", "bool"):
        return vt[type_name.upper()], value if type_name == "string" else bool(value), None
    dtype = _SCALAR_DTYPES[type_name]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            raise ValueError(f"{value} does not fit {type_name}")
        return vt[type_name.upper()], int(value), None
    # Rounded by numpy as before: a value beyond the float32 range is stored as infinity.
    return vt[type_name.upper()], float(dtype.type(value)), None


def _encode_tensor(t: Tensor, shape: list[int], nbytes: int) -> np.ndarray:
    data = t.data() if callable(t.data) else t.data
    name = ggml_type(t.type).name
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = np.frombuffer(data, dtype=np.uint8)
    else:
        arr = np.asarray(data)
        if arr.dtype == np.uint8:
            raw = arr.reshape(-1)
        elif name in _INT_TYPES:
            raw = np.ascontiguousarray(arr, dtype=_INT_TYPES[name]).reshape(-1).view(np.uint8)
        elif arr.dtype.kind == "f":
            n = int(np.prod(shape, dtype=np.int64))
            if arr.size != n:
                raise ValueError(
                    f"tensor {t.name!r}: {arr.size} values for shape {shape} ({n} elements)"
                )
            raw = quantize(arr, name)
        else:
            raise TypeError(f"tensor {t.name!r}: cannot write {arr.dtype} data as {name}")
    if raw.size != nbytes:
        raise ValueError(
            f"tensor {t.name!r}: {raw.size} bytes of data, {name} {shape} needs {nbytes}"
        )
    return raw


def write_gguf(
    path: str | os.PathLike,
    metadata: dict[str, Any],
    tensors: Iterable[Tensor | tuple],
    alignment: int | None = None,
) -> None:
    """Writes a little-endian GGUF v3 file with gguf-py's GGUFWriter.

    metadata maps keys to values; types are inferred (int -> uint32/int32/uint64/int64 by range,
    float -> float32, str, bool, lists -> arrays) unless given with Typed. tensors are Tensor
    objects or (name, data, type[, shape]) tuples, written in order, one at a time (lazy data is
    produced only when its tensor is written).

    This is the module's only writer: tests that need malformed files (bad offsets, keys or
    names) patch the bytes of a file written here, so no raw encoder is kept beside GGUFWriter.
    """
    gguf = _gguf()
    metadata = dict(metadata)
    if alignment is None:
        a = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        alignment = int(a.value if isinstance(a, Typed) else a)
    elif alignment != DEFAULT_ALIGNMENT:
        metadata["general.alignment"] = Typed("uint32", alignment)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")

    specs = [t if isinstance(t, Tensor) else Tensor(*t) for t in tensors]
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    layout = []
    for t in specs:
        shape = t.resolved_shape()
        if not 1 <= len(shape) <= 4:
            raise ValueError(f"tensor {t.name!r}: {len(shape)} dimensions, expected 1 to 4")
        layout.append((t, shape, tensor_nbytes(t.type, shape)))
    entries = [(key, _value_for_writer(_infer_type(v), v)) for key, v in metadata.items()]

    w = _Writer()(os.fspath(path), arch="")
    # The writer names an architecture itself; the metadata given is what the file holds.
    w.kv_data[0].clear()
    w.data_alignment = alignment
    for key, (vtype, value, sub_type) in entries:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    for t, shape, nbytes in layout:
        w.add_tensor_info(
            t.name,
            list(reversed(shape)),
            np.dtype(np.float32),
            nbytes,
            raw_dtype=gguf.GGMLQuantizationType(ggml_type(t.type).id),
        )
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t, shape, nbytes in layout:
            w.write_tensor_data(_encode_tensor(t, shape, nbytes))
    finally:
        w.close()


# ---------------------------------------------------------------------------------------------
# Random llama models


@dataclasses.dataclass(frozen=True)
class ModelShape:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ctx: int
    rope_base: float = 10000.0
    rope_dims: int | None = None  # head dimension when None
    rms_eps: float = 1e-5
    tied: bool = False  # output projection shares token_embd.weight
    weight_type: str = "Q4_0"
    embd_type: str | None = None  # weight_type when None
    output_type: str | None = None  # weight_type when None
    pre: str = "default"  # tokenizer.ggml.pre
    add_bos: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv


SHAPES = {
    "tiny": ModelShape(
        n_embd=64,
        n_ff=128,
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        n_vocab=320,
        n_ctx=256,
        weight_type="Q4_1",
    ),
    "smollm2-135m": ModelShape(
        n_embd=576,
        n_ff=1536,
        n_layer=30,
        n_head=9,
        n_head_kv=3,
        n_vocab=49152,
        n_ctx=8192,
        rope_base=100000.0,
        rope_dims=64,
        tied=True,
        weight_type="Q4_1",
        embd_type="Q8_0",
        pre="smollm",
    ),
    # Llama 3.2 1B's dimensions (its 128,256-token vocabulary, tied output), in F16.
    "llama3-1b": ModelShape(
        n_embd=2048,
        n_ff=8192,
        n_layer=16,
        n_head=32,
        n_head_kv=8,
        n_vocab=128256,
        n_ctx=8192,
        rope_base=500000.0,
        tied=True,
        weight_type="F16",
        add_bos=True,
    ),
    # Llama 3 8B's dimensions (grouped-query attention, 128,256-token vocabulary).
    "llama3-8b": ModelShape(
        n_embd=4096,
        n_ff=14336,
        n_layer=32,
        n_head=32,
        n_head_kv=8,
        n_vocab=128256,
        n_ctx=8192,
        rope_base=500000.0,
        weight_type="Q4_0",
        output_type="Q8_0",
        add_bos=True,
    ),
    "llama2-7b": ModelShape(
        n_embd=4096,
        n_ff=11008,
        n_layer=32,
        n_head=32,
        n_head_kv=32,
        n_vocab=32000,
        n_ctx=4096,
        weight_type="Q4_0",
        output_type="Q8_0",
        add_bos=True,
    ),
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past U+0100 so that every byte is a visible character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(0x100 + shifted)
            shifted += 1
    return mapping


def byte_level_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A gpt2-style vocabulary of exactly n_vocab tokens: three control tokens, the 256 byte
    tokens, then tokens built by merges of letters (after a space, then longer and longer), so
    that tokenization is real BPE with a consistent merge list."""
    alphabet = byte_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [alphabet[b] for b in range(256)]
    types = [TOKEN_CONTROL] * len(SPECIAL_TOKENS) + [TOKEN_NORMAL] * 256
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab}: a byte-level vocabulary needs at least {len(tokens)}")
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    merges: list[str] = []
    frontier = [alphabet[0x20]] + list(letters)
    while len(tokens) < n_vocab:
        grown = []
        for left in frontier:
            for right in letters:
                if len(tokens) == n_vocab:
                    break
                merges.append(f"{left} {right}")
                tokens.append(left + right)
                types.append(TOKEN_NORMAL)
                grown.append(left + right)
        frontier = grown
    return tokens, types, merges


def llama_metadata(shape: ModelShape, name: str, weight_type: str) -> dict[str, Any]:
    tokens, token_types, merges = byte_level_vocab(shape.n_vocab)
    return {
        "general.architecture": "llama",
        "general.type": "model",
        "general.name": name,
        "general.file_type": Typed("uint32", FILE_TYPES.get(weight_type, 0)),
        "general.quantization_version": Typed("uint32", 2),
        "llama.block_count": Typed("uint32", shape.n_layer),
        "llama.context_length": Typed("uint32", shape.n_ctx),
        "llama.embedding_length": Typed("uint32", shape.n_embd),
        "llama.feed_forward_length": Typed("uint32", shape.n_ff),
        "llama.attention.head_count": Typed("uint32", shape.n_head),
        "llama.attention.head_count_kv": Typed("uint32", shape.n_head_kv),
        "llama.rope.freq_base": Typed("float32", shape.rope_base),
        "llama.attention.layer_norm_rms_epsilon": Typed("float32", shape.rms_eps),
        "llama.vocab_size": Typed("uint32", shape.n_vocab),
        "llama.rope.dimension_count": Typed("uint32", shape.rope_dims or shape.head_dim),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": shape.pre,
        "tokenizer.ggml.tokens": Typed("array", tokens, "string"),
        "tokenizer.ggml.token_type": Typed("array", token_types, "int32"),
        "tokenizer.ggml.merges": Typed("array", merges, "string"),
        "tokenizer.ggml.bos_token_id": Typed("uint32", 1),
        "tokenizer.ggml.eos_token_id": Typed("uint32", 2),
        "tokenizer.ggml.unknown_token_id": Typed("uint32", 0),
        "tokenizer.ggml.padding_token_id": Typed("uint32", 2),
        "tokenizer.ggml.add_bos_token": shape.add_bos,
        "tokenizer.ggml.add_space_prefix": False,
    }


def llama_tensor_layout(shape: ModelShape) -> list[tuple[str, str, list[int]]]:
    """(name, ggml type, GGUF shape) of every tensor of a llama model, in llama.cpp's order.

    K-quant tensors with rows that are not a multiple of 256 get the type of K_FALLBACKS, as
    llama.cpp's quantizer gives them (Q4_K_M on the tiny shape: Q5_0 and Q8_0).
    """
    e, f, kv, v = shape.n_embd, shape.n_ff, shape.n_embd_kv, shape.n_vocab
    w, w_more = MIXES.get(shape.weight_type, (shape.weight_type, shape.weight_type))
    layout = [("token_embd.weight", shape.embd_type or w, [e, v])]
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        layout += [
            (p + "attn_norm.weight", "F32", [e]),
            (p + "attn_q.weight", w, [e, e]),
            (p + "attn_k.weight", w, [e, kv]),
            (p + "attn_v.weight", w_more, [e, kv]),
            (p + "attn_output.weight", w, [e, e]),
            (p + "ffn_norm.weight", "F32", [e]),
            (p + "ffn_gate.weight", w, [e, f]),
            (p + "ffn_up.weight", w, [e, f]),
            (p + "ffn_down.weight", w_more, [f, e]),
        ]
    layout.append(("output_norm.weight", "F32", [e]))
    if not shape.tied:
        layout.append(("output.weight", shape.output_type or w_more, [e, v]))
    return [
        (name, K_FALLBACKS.get(ggml_type(t).name, t) if s[0] % 256 else t, s)
        for name, t, s in layout
    ]


def resolve_shape(
    shape: str | ModelShape = "tiny",
    weight_type: str | None = None,
    embd_type: str | None = None,
    output_type: str | None = None,
    tied: bool | None = None,
    **overrides: Any,
) -> ModelShape:
    """A named (or given) shape with the options applied."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    changes = dict(overrides)
    if weight_type is not None:
        changes["weight_type"] = weight_type
    if embd_type is not None:
        changes["embd_type"] = embd_type
    if output_type is not None:
        changes["output_type"] = output_type
    if tied is not None:
        changes["tied"] = tied
    shape = dataclasses.replace(shape, **changes)
    for t in (shape.weight_type, shape.embd_type, shape.output_type):
        if t is not None and t not in MIXES and ggml_type(t).name not in RANDOM_BLOCK_TYPES:
            raise ValueError(f"weight type {t!r}: expected one of {', '.join(WEIGHT_TYPES)}")
    if shape.n_embd % shape.n_head or shape.n_head % shape.n_head_kv:
        raise ValueError("n_embd must divide into n_head heads, n_head into n_head_kv groups")
    return shape


def write_random_gguf(
    path: str | os.PathLike,
    shape: str | ModelShape = "tiny",
    weight_type: str | None = None,
    seed: int = 0,
    embd_type: str | None = None,
    output_type: str | None = None,
    tied: bool | None = None,
    direct_blocks: bool | None = None,
    std: float = 0.02,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
    **overrides: Any,
) -> ModelShape:
    """Writes a complete llama GGUF with random weights and a byte-level BPE vocabulary.

    Weights are normal(0, std) (norms near 1) quantized with ggml's rounding, or, with
    direct_blocks, random quantized blocks of the same spread generated without floats
    (the default for models over 500M parameters, where quantizing would take minutes).
    metadata adds or replaces keys (e.g. {"tokenizer.ggml.eos_token_id": Typed("uint32", 7)});
    the weights stay those of the seed. overrides replace ModelShape fields (n_layer=4,
    n_ctx=512, ...). Returns the shape used.
    """
    m = resolve_shape(shape, weight_type, embd_type, output_type, tied, **overrides)
    layout = llama_tensor_layout(m)
    if direct_blocks is None:
        direct_blocks = sum(int(np.prod(s)) for _, _, s in layout) > 500_000_000
    # Formats the writer cannot quantize floats to are generated as blocks.
    direct_blocks = direct_blocks or any(ggml_type(t).name not in QUANTIZABLE for _, t, _ in layout)
    label = shape if isinstance(shape, str) else "custom"
    extra = metadata or {}
    metadata = llama_metadata(m, name or f"random {label}", m.weight_type)
    metadata.update(extra)

    def generator(index: int, type_name: str, n: int, is_norm: bool) -> Callable[[], np.ndarray]:
        # Each tensor has its own stream, so one tensor's values do not depend on the others.
        def make() -> np.ndarray:
            rng = np.random.default_rng([seed, index])
            if is_norm:
                return 1.0 + np.float32(std) * rng.standard_normal(n, dtype=np.float32)
            if direct_blocks:
                return random_blocks(type_name, n, std, rng)
            return rng.standard_normal(n, dtype=np.float32) * np.float32(std)

        return make

    tensors = [
        Tensor(tname, generator(i, ttype, int(np.prod(s)), tname.endswith("norm.weight")), ttype, s)
        for i, (tname, ttype, s) in enumerate(layout)
    ]
    write_gguf(path, metadata, tensors)
    return m


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ggraph.testing",
        description="Write a llama GGUF with random weights (for tests and speed measurements).",
    )
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument(
        "--type", dest="weight_type", choices=WEIGHT_TYPES, help="weight type or mix (Q4_K_M)"
    )
    parser.add_argument("--embd-type", choices=RANDOM_BLOCK_TYPES, help="token embedding type")
    parser.add_argument("--output-type", choices=RANDOM_BLOCK_TYPES, help="output projection type")
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None)
    tie.add_argument("--untied", dest="tied", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-layer", type=int, help="override the number of layers")
    parser.add_argument("--n-ctx", type=int, help="override the context length")
    blocks = parser.add_mutually_exclusive_group()
    blocks.add_argument(
        "--direct-blocks",
        dest="direct_blocks",
        action="store_true",
        default=None,
        help="generate random quantized blocks instead of quantizing random floats",
    )
    blocks.add_argument("--quantize-floats", dest="direct_blocks", action="store_false")
    args = parser.parse_args(argv)

    overrides = {}
    if args.n_layer is not None:
        overrides["n_layer"] = args.n_layer
    if args.n_ctx is not None:
        overrides["n_ctx"] = args.n_ctx
    start = time.perf_counter()
    try:
        m = write_random_gguf(
            args.out,
            args.shape,
            args.weight_type,
            seed=args.seed,
            embd_type=args.embd_type,
            output_type=args.output_type,
            tied=args.tied,
            direct_blocks=args.direct_blocks,
            **overrides,
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(args.out)
    print(
        f"wrote {args.out}: {args.shape} ({m.n_layer} layers, {m.weight_type} weights), "
        f"{size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
