"""The CUDA graph executor: every mode gives the same logits as plain stream launches, the
counters behave as designed, and the graph itself (read with cuda-python) holds what runs.

Runs on a machine with an NVIDIA GPU; elsewhere every test skips with the reason."""

import numpy as np
import pytest
from conftest import gpu_skip_reason

import ggraph

MODES = ("off", "recapture", "update", "patch")


pytestmark = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))


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
    # Prompts of several lengths; 512 decode steps use from one to several attention splits; the
    # later prompts run after reset.
    prompts = [rng.integers(0, 49152, size=n).tolist() for n in (7, 300, 1)]
    ref, _ = _session(smol_shape, "off", prompts, 512)
    for mode in MODES[1:]:
        got, stats = _session(smol_shape, mode, prompts, 512)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert np.array_equal(a, b), f"{mode}: prompt {i} differs from off mode"


def test_every_mode_stays_bitwise_equal_over_a_4096_token_conversation(smol_shape):
    # One model per mode, stepped together with off mode's greedy tokens: over 4096 decode steps
    # the attention uses from one split to most of the cache's (the split count follows n_ctx;
    # the splits in use follow the depth), and every step must give off mode's bits.
    models = {m: ggraph.Model(smol_shape, device="cuda", n_ctx=4608, cuda_graphs=m) for m in MODES}
    prompt = np.random.default_rng(1).integers(0, 49152, size=5).tolist()
    tokens = prompt
    for step in range(4097):
        ref = models["off"].eval(tokens)
        for mode in MODES[1:]:
            got = models[mode].eval(tokens)
            assert np.array_equal(ref, got), f"{mode} differs from off mode at step {step}"
        tokens = [int(np.argmax(ref))]
    assert models["off"].n_past == len(prompt) + 4096
    assert models["patch"].graph_stats["captures"] <= 2


def test_every_mode_gives_bitwise_the_logits_of_plain_launches_for_decode_batches(smol_shape):
    # Batches of 2, 3, 8 and 20 sessions (the size classes of 2, 4, 8 and 32: the mat-vecs, the
    # warp-pipelined products with their rope epilogue into the pools, the half kernel), now and
    # then without the first session: every mode gives the plain launches' bits.
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 49152, size=int(n)).tolist() for n in rng.integers(1, 40, size=20)]
    plan = [2, 2, 3, 3, 3, 8, 8, 8, 20, 20, 20]

    def run(mode):
        m = ggraph.Model(smol_shape, device="cuda", n_ctx=256, n_seq_max=20, cuda_graphs=mode)
        seqs = [m] + [m.session() for _ in prompts[1:]]
        for s, p in zip(seqs, prompts, strict=True):
            s.eval(p)
        out = []
        for step, size in enumerate(plan):
            members = list(range(size))
            if step % 3 == 1 and size > 2:
                members = members[1:]
            toks = [(7 * step + 13 * i) % 49152 for i in members]
            out.append(np.array(m.decode_batch([(seqs[i], t) for i, t in zip(members, toks)])))
        return out, m.graph_stats

    ref, _ = run("off")
    for mode in MODES[1:]:
        got, stats = run(mode)
        assert stats["captures"] > 0 and stats["replays"] > 0, (mode, stats)
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            assert np.array_equal(a, b), f"{mode}: batch step {step} differs from off mode"


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
            # Within one attention bucket nothing is captured: each step patches one node, the
            # kernel that writes the step's KV position into the record the others read.
            assert s["captures"] == 0 and s["instantiations"] == 0 and s["exec_updates"] == 0, s
            assert s["kernel_nodes_patched"] == n, s


def test_patch_mode_never_captures_again_as_the_context_grows(smol_shape):
    # The decode attention's grid depends on the cache size only: one executable serves every
    # depth, from the first decode step to the end of the cache.
    m = ggraph.Model(smol_shape, device="cuda", n_ctx=1024, cuda_graphs="patch")
    m.eval(list(range(1, 3)))
    m.eval([1])  # the decode topology is captured at n_past 2
    m.reset_graph_stats()
    m.eval(list(range(1, 500)))  # a prompt batch between decode steps
    m.eval([1])
    m.reset_graph_stats()
    n = 1024 - m.n_past
    for t in range(n):
        m.eval([t % 1000 + 2])
    s = m.graph_stats
    assert s["replays"] == n
    assert s["captures"] == 0 and s["exec_updates"] == 0 and s["instantiations"] == 0, s
    assert s["kernel_nodes_patched"] == n, s


def test_a_grown_cublas_buffer_is_never_read_at_its_old_address(smol_shape):
    """Prompt products run on cuBLAS, whose nodes the executor neither records nor patches: when
    a buffer they use moves (an all_logits prompt sends the output head through cuBLAS, and the
    buffer its decoded rows go to grows), no cached executable may replay them at the freed
    address."""
    rng = np.random.default_rng(5)
    p, q = (rng.integers(0, 49152, size=40).tolist() for _ in range(2))
    for mode in MODES:
        m = ggraph.Model(smol_shape, device="cuda", n_ctx=256, cuda_graphs=mode)
        first = m.eval(p)
        m.reset()
        m.eval(q, all_logits=True)
        m.reset()
        assert np.array_equal(m.eval(p), first), mode


def _kernel_nodes(drv, handle):
    """{node: (function, grid, argument bytes)} for every kernel node of a graph, read through
    the CUDA driver API (shared by every runtime in the process)."""
    import ctypes

    graph = drv.CUgraph(handle)
    err, _, count = drv.cuGraphGetNodes(graph, numNodes=0)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    err, nodes, count = drv.cuGraphGetNodes(graph, numNodes=count)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    out = {}
    for node in nodes:
        err, kind = drv.cuGraphNodeGetType(node)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        if kind != drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        err, p = drv.cuGraphKernelNodeGetParams(node)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        arr = ctypes.cast(int(p.kernelParams), ctypes.POINTER(ctypes.c_void_p))
        args = []
        for i in range(64):
            err, _, size = drv.cuFuncGetParamInfo(p.func, i)
            if err != drv.CUresult.CUDA_SUCCESS:
                break
            args.append(ctypes.string_at(arr[i], size))
        out[int(node)] = (int(p.func), (p.gridDimX, p.gridDimY, p.gridDimZ), args)
    return out


def test_graph_read_with_cuda_python_holds_the_steps_kv_position(smol_shape):
    drv = pytest.importorskip("cuda.bindings.driver")
    if not hasattr(drv, "cuFuncGetParamInfo"):
        pytest.skip("this cuda-python has no cuFuncGetParamInfo")
    m = ggraph.Model(smol_shape, device="cuda", n_ctx=1024, cuda_graphs="patch")
    m.eval([1, 2, 3, 4])
    steps = []  # (position the step wrote, the graph's kernel nodes after it)
    for t in range(4):
        n_past = m.n_past
        m.eval([5 + t])
        steps.append((n_past, _kernel_nodes(drv, m.cuda_graph_handle())))
    first = steps[0][1]
    # Six launches a layer at least (q/k/v with its norm, attention, o, gate/up, glu, down).
    assert len(first) >= 30 * 6, "fewer kernel nodes than the model has ops"
    record_node = None
    for (_, before), (n_past, after) in zip(steps, steps[1:]):
        assert after.keys() == before.keys(), "patching must not add or remove nodes"
        changed = [k for k in before if before[k] != after[k]]
        # One node moves: the kernel that writes the KV record. Its function, grid and record
        # pointer stay; its values are the cache row and first query position (n_past) and the
        # attention length (n_past + 1), in order of first use, the unused slots zero.
        assert len(changed) == 1, f"{len(changed)} nodes changed"
        k = changed[0]
        assert record_node in (None, k), "another node took the KV position"
        record_node = k
        assert before[k][:2] == after[k][:2], "function or grid changed"
        values, pointer = after[k][2]
        assert pointer == before[k][2][1], "the record moved"
        slots = np.frombuffer(values, dtype="<i4")
        assert len(slots) == 32
        assert slots[:2].tolist() == [n_past, n_past + 1], slots[:4]
        assert not slots[2:].any(), slots
        moved = slots[:2] - np.frombuffer(before[k][2][0], dtype="<i4")[:2]
        assert moved.tolist() == [1, 1], "the position did not move by one"


def test_debug_mode_passes_and_catches_a_corrupted_patch(smol_shape, monkeypatch):
    monkeypatch.setenv("GGRAPH_CUDA_GRAPH_DEBUG", "1")
    m = ggraph.Model(smol_shape, device="cuda", n_ctx=512, cuda_graphs="patch")
    _greedy_run(m, [1, 2, 3], 40)
    # The next patch is the KV record's (the only node a decode step patches): one of its values
    # is written wrong, which the check against the step's values must catch before launch.
    m._ctx.debug_corrupt_next_patch()
    with pytest.raises(ggraph.DeviceError, match=r"KV record\) does not hold the parameters"):
        m.eval([7])
    # The failed step launched nothing; the next one patches the node right again.
    n_past = m.n_past
    m.eval([7])
    assert m.n_past == n_past + 1


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
