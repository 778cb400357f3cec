"""ggraph: GGUF language models on one NVIDIA GPU (CUDA graphs) and on the CPU.

>>> m = ggraph.Model("model.gguf")
>>> logits = m.eval(m.tokenize("The capital of France is"))
>>> for piece in m.generate("Once upon a time", max_tokens=32): print(piece, end="")
"""

from ggraph._core import Cancelled, DeviceError, GGUFError, Tokenizer, build_info, devices
from ggraph._core import read_metadata as _read_metadata
from ggraph.model import (
    GeneratedToken,
    Model,
    Session,
    default_model_path,
    make_sampler,
    sample,
)

__version__ = build_info()["version"]

__all__ = [
    "Cancelled",
    "DeviceError",
    "GGUFError",
    "GeneratedToken",
    "Model",
    "Session",
    "make_sampler",
    "Tokenizer",
    "build_info",
    "c_include_dir",
    "c_library_path",
    "cmake_prefix_path",
    "default_model_path",
    "devices",
    "read_metadata",
    "sample",
]


def read_metadata(path):
    """The GGUF metadata and tensor table of a file, without loading its weights."""
    return _read_metadata(str(path))


def c_library_path():
    """Path of the shared library with the C API (include/ggraph.h), for embedding."""
    import glob
    import os

    here = os.path.dirname(__file__)
    found = sorted(glob.glob(os.path.join(here, "lib", "libggraph*")))
    if not found:
        raise FileNotFoundError(f"libggraph is not installed under {os.path.join(here, 'lib')}")
    return found[0]


def cmake_prefix_path():
    """The prefix under which CMake finds ggraph's package config (find_package(ggraph)) and
    pkg-config its ggraph.pc (lib/pkgconfig): the package's own directory."""
    import os

    return os.path.dirname(os.path.abspath(__file__))


def c_include_dir():
    """Directory holding ggraph.h."""
    import os

    return os.path.join(os.path.dirname(__file__), "include")
