"""ggraph: GGUF language models on one NVIDIA GPU (CUDA graphs) and on the CPU.

>>> m = ggraph.Model("model.gguf")
>>> logits = m.eval(m.tokenize("The capital of France is"))
>>> for piece in m.generate("Once upon a time", max_tokens=32): print(piece, end="")
"""

from ggraph._core import DeviceError, GGUFError, Sampler, Tokenizer, build_info, devices
from ggraph._core import read_metadata as _read_metadata
from ggraph.model import Model, default_model_path, sample

__version__ = build_info()["version"]

__all__ = [
    "DeviceError",
    "GGUFError",
    "Model",
    "Sampler",
    "Tokenizer",
    "build_info",
    "default_model_path",
    "devices",
    "read_metadata",
    "sample",
]


def read_metadata(path):
    """The GGUF metadata and tensor table of a file, without loading its weights."""
    return _read_metadata(str(path))
