"""The CUDA backend on whole random-weight llama models, against the CPU backend: prompt logits
at every position and teacher-forced decode steps agree for every weight format; devices()
lists the GPU and device="auto" picks it; running out of device memory is a clear Python error
that leaves the process usable.

Runs on a machine with an NVIDIA GPU; elsewhere every test skips with the reason."""

import numpy as np
import pytest
from conftest import gpu_skip_reason

import ggraph

pytestmark = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))

# Quantized weights meet 8-bit activations on both backends (with different rounding); float
# weights differ only by the GPU's half-precision prompt products.
COSINE_BAR = {
    "Q4_0": 0.995,
    "Q4_1": 0.995,
    "Q8_0": 0.995,
    "F16": 0.9995,
    "BF16": 0.9995,
    "F32": 0.9995,
}


def _cosine(a, b):
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Random models: the tiny shape in every weight format, and SmolLM2-135M's widths (GQA
    9/3, head_dim 64, 49152-token vocabulary, tied Q8_0 embeddings) cut to 3 layers."""
    from ggraph.testing import write_random_gguf

    d = tmp_path_factory.mktemp("cuda_models")
    out = {}
    for wt in COSINE_BAR:
        path = str(d / f"tiny-{wt}.gguf")
        write_random_gguf(path, shape="tiny", weight_type=wt, seed=5)
        out[("tiny", wt)] = path
    path = str(d / "smol3.gguf")
    write_random_gguf(path, shape="smollm2-135m", weight_type="Q4_1", seed=6, n_layer=3)
    out[("smol3", "Q4_1")] = path
    return out


@pytest.mark.parametrize(
    "key", [("tiny", wt) for wt in COSINE_BAR] + [("smol3", "Q4_1")], ids=lambda k: "-".join(k)
)
def test_prompt_and_decode_logits_match_the_cpu(models, key):
    path = models[key]
    bar = COSINE_BAR[key[1]]
    cpu = ggraph.Model(path, device="cpu", n_ctx=256)
    gpu = ggraph.Model(path, device="cuda", n_ctx=256, cuda_graphs="off")
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cpu.n_vocab, size=37).tolist()
    lc = cpu.eval(prompt, all_logits=True)
    lg = gpu.eval(prompt, all_logits=True)
    assert lg.shape == lc.shape
    assert np.all(np.isfinite(lg))
    for pos in range(len(prompt)):
        assert _cosine(lg[pos], lc[pos]) >= bar, f"prompt position {pos}"
    # Decode steps, fed the CPU's greedy choices so both follow the same tokens.
    tok = int(np.argmax(lc[-1]))
    for step in range(12):
        c = cpu.eval([tok])
        g = gpu.eval([tok])
        assert _cosine(g, c) >= bar, f"decode step {step}"
        tok = int(np.argmax(c))
    assert gpu.n_past == cpu.n_past


def test_prompt_in_chunks_equals_prompt_at_once_on_the_gpu(models):
    # Chunked prompts cross the mat-vec/tiled switch (8 tokens) and continue a filled cache.
    path = models[("smol3", "Q4_1")]
    m = ggraph.Model(path, device="cuda", n_ctx=256, cuda_graphs="off")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, m.n_vocab, size=40).tolist()
    whole = m.eval(prompt)
    m.reset()
    for start, end in ((0, 5), (5, 13), (13, 30), (30, 40)):
        part = m.eval(prompt[start:end])
    assert _cosine(part, whole) >= 0.999


def test_devices_lists_the_gpu_and_auto_picks_it(models):
    devs = ggraph.devices()
    assert devs
    for d in devs:
        assert d["name"]
        assert d["total_memory"] > 0
        assert tuple(d["compute_capability"]) >= (8, 0)
    m = ggraph.Model(models[("tiny", "Q4_1")], device="auto", n_ctx=64)
    assert m.device.startswith("cuda")


def test_out_of_device_memory_is_a_clear_error_and_the_process_goes_on(models):
    path = models[("tiny", "Q4_1")]
    with pytest.raises(ggraph.DeviceError, match=r"out of device memory: needed .* MiB free of"):
        ggraph.Model(path, device="cuda", n_ctx=2_000_000_000, allow_longer_context=True)
    m = ggraph.Model(path, device="cuda", n_ctx=64)
    assert np.all(np.isfinite(m.eval([1, 2, 3])))
