"""The CUDA graph executor: every mode gives the same logits as plain stream launches, the
counters behave as designed, and the graph itself (read with cuda-python) holds what runs.

Runs on a machine with an NVIDIA GPU; elsewhere every test skips with the reason."""

import numpy as np
import pytest

import ggraph

MODES = ("off", "recapture", "update", "patch")


def _gpu_reason():
    if not ggraph.build_info()["cuda_compiled"]:
        return "this build of ggraph has no CUDA backend"
    if not ggraph.devices():
        return "no CUDA device is present"
    return None


pytestmark = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


@pytest.fixture(scope="module")
def smol_shape(tmp_path_factory):
    """A random-weight model of SmolLM2-135M's shape (Q4_1, Q8_0 embeddings, tied output)."""
    from ggraph.testing import write_random_gguf

    path = str(tmp_path_factory.mktemp("m") / "smollm2-shape.gguf")
    write_random_gguf(path, shape="smollm2-135m", weight_type="Q4_1", seed=3)
    return path


def _greedy_run(model, prompt, n_steps):
    """Logits of every decode step of a greedy run after `prompt`."""
    out = [model.eval(prompt)]
    for _ in range(n_steps):
        out.append(model.eval([int(np.argmax(out[-1]))]))
    return np.stack(out)


def _session(path, mode, prompts, n_steps):
    m = ggraph.Model(path, device="cuda", n_ctx=2048, cuda_graphs=mode)
    runs = []
    for prompt in prompts:
        m.reset()
        runs.append(_greedy_run(m, prompt, n_steps))
    return runs, m.graph_stats


def test_every_mode_gives_bitwise_the_logits_of_plain_launches(smol_shape):
    rng = np.random.default_rng(0)
    # Prompts of several lengths; 512 decode steps cross the attention split buckets; the
    # later prompts run after reset.
    prompts = [rng.integers(0, 49152, size=n).tolist() for n in (7, 300, 1)]
    ref, _ = _session(smol_shape, "off", prompts, 512)
    for mode in MODES[1:]:
        got, stats = _session(smol_shape, mode, prompts, 512)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert np.array_equal(a, b), f"{mode}: prompt {i} differs from off mode"


def test_counters_follow_each_mode(smol_shape):
    n = 64
    for mode in ("recapture", "update", "patch"):
        m = ggraph.Model(smol_shape, device="cuda", n_ctx=1024, cuda_graphs=mode)
        m.eval([1, 2, 3])
        m.eval([4])  # first decode step: the decode topology is captured
        m.reset_graph_stats()
        for t in range(n):
            m.eval([t + 5])
        s = m.graph_stats
        assert s["replays"] == n
        if mode == "recapture":
            assert s["instantiations"] == n and s["captures"] == n
        if mode == "update":
            assert s["captures"] == n and s["exec_updates"] + s["update_failures"] == n
            assert s["instantiations"] == s["update_failures"]
        if mode == "patch":
            # Within one attention bucket nothing is captured: the KV nodes are patched.
            assert s["captures"] <= 1, s
            assert s["kernel_nodes_patched"] >= n
            assert s["instantiations"] + s["exec_updates"] <= s["captures"]


def test_graph_read_with_cuda_python_holds_the_patched_arguments(smol_shape):
    cudart = pytest.importorskip("cuda.bindings.runtime")

    def kernel_args(handle):
        graph = cudart.cudaGraph_t(init_value=handle)
        err, _, count = cudart.cudaGraphGetNodes(graph, numNodes=0)
        assert err == cudart.cudaError_t.cudaSuccess
        err, nodes, count = cudart.cudaGraphGetNodes(graph, numNodes=count)
        assert err == cudart.cudaError_t.cudaSuccess
        params = {}
        for node in nodes:
            err, kind = cudart.cudaGraphNodeGetType(node)
            if kind != cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel:
                continue
            err, p = cudart.cudaGraphKernelNodeGetParams(node)
            assert err == cudart.cudaError_t.cudaSuccess
            params[int(node)] = (int(p.func), (p.gridDim.x, p.gridDim.y, p.gridDim.z))
        return params, nodes

    m = ggraph.Model(smol_shape, device="cuda", n_ctx=1024, cuda_graphs="patch")
    m.eval([1, 2, 3, 4])
    m.eval([5])
    before, nodes = kernel_args(m.cuda_graph_handle())
    assert len(before) >= 30 * 8, "fewer kernel nodes than the model has ops"
    raw_before = {int(n): _raw_args(cudart, n) for n in nodes}
    m.eval([6])
    after, nodes_after = kernel_args(m.cuda_graph_handle())
    assert after.keys() == before.keys(), "patching must not add or remove nodes"
    raw_after = {int(n): _raw_args(cudart, n) for n in nodes_after}
    changed = [k for k in raw_before if raw_before[k] != raw_after[k]]
    # The KV row written, the attention length and the first position each advance by one.
    assert 0 < len(changed) < len(before) // 2
    for k in changed:
        diffs = _int_diffs(raw_before[k], raw_after[k])
        assert diffs and all(d == 1 for d in diffs), f"node {k}: argument changes {diffs}"


def _raw_args(cudart, node):
    """A kernel node's arguments as read back from the graph: (size, bytes) per argument, the
    sizes from the driver's description of the kernel's parameters."""
    import ctypes

    drv = pytest.importorskip("cuda.bindings.driver")
    err, p = cudart.cudaGraphKernelNodeGetParams(node)
    assert err == cudart.cudaError_t.cudaSuccess
    err, func = cudart.cudaGetFuncBySymbol(p.func)
    assert err == cudart.cudaError_t.cudaSuccess
    if not hasattr(drv, "cuFuncGetParamInfo"):
        pytest.skip("this cuda-python has no cuFuncGetParamInfo")
    arr = ctypes.cast(int(p.kernelParams), ctypes.POINTER(ctypes.c_void_p))
    values = []
    for i in range(64):
        err, _, size = drv.cuFuncGetParamInfo(drv.CUfunction(int(func)), i)
        if err != drv.CUresult.CUDA_SUCCESS:
            break
        values.append(ctypes.string_at(arr[i], size))
    return values


def _int_diffs(before, after):
    """Differences of the 32-bit integer arguments that changed."""
    out = []
    for a, b in zip(before, after):
        if a != b:
            if len(a) != 4:
                return None  # a pointer or wider value changed: not a KV parameter
            out.append(
                int.from_bytes(b, "little", signed=True) - int.from_bytes(a, "little", signed=True)
            )
    return out


def test_debug_mode_passes_and_catches_a_corrupted_patch(smol_shape, monkeypatch):
    monkeypatch.setenv("GGRAPH_CUDA_GRAPH_DEBUG", "1")
    m = ggraph.Model(smol_shape, device="cuda", n_ctx=512, cuda_graphs="patch")
    _greedy_run(m, [1, 2, 3], 40)
    m._ctx.debug_corrupt_next_patch()
    with pytest.raises(ggraph.DeviceError, match="does not hold the parameters"):
        m.eval([7])


def test_dump_cuda_graph_writes_dot(smol_shape, tmp_path):
    m = ggraph.Model(smol_shape, device="cuda", n_ctx=256, cuda_graphs="patch")
    m.eval([1, 2])
    m.eval([3])
    path = tmp_path / "graph.dot"
    m.dump_cuda_graph(str(path))
    text = path.read_text()
    assert text.startswith("digraph") and "kernel" in text.lower()


def test_no_growth_over_ten_thousand_steps_with_resets(smol_shape):
    m = ggraph.Model(smol_shape, device="cuda", n_ctx=1100, cuda_graphs="patch")
    m.eval([1, 2, 3])
    for t in range(200):
        m.eval([t % 1000])
    free_before = ggraph.devices()[0]["free_memory"]
    cached_before = m.graph_stats["cached_graphs"]
    for step in range(10_000):
        if m.n_past >= 1000:
            m.reset()
            m.eval([1, 2, 3])
        m.eval([step % 49152])
    assert m.graph_stats["cached_graphs"] <= max(cached_before, 8)
    free_after = ggraph.devices()[0]["free_memory"]
    assert free_before - free_after < 16 << 20, f"device memory fell by {free_before - free_after}"
