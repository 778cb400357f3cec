"""A long run: 20,000 decode steps of generation, with resets, state saves and loads and chat
renders along the way, keep the process's memory flat (no leak per step)."""

import os

import ggraph


def _rss_kib():
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def test_twenty_thousand_steps_keep_memory_flat(tiny_model):
    if not os.path.exists("/proc/self/statm"):
        import pytest

        pytest.skip("no /proc here")
    m = ggraph.Model(tiny_model, device="cpu", n_ctx=256, n_threads=1)
    steps, rss = 0, {}
    i = 0
    while steps < 20_000:
        prompt = [1 + (i * 7) % 200, 2 + i % 50, 3]
        for _ in m.generate(prompt, max_tokens=100, temperature=0.8, seed=i):
            pass
        steps += m.n_generated
        if i % 10 == 0:
            m.load_state(m.save_state())
        if i % 25 == 0:
            m.reset()
        i += 1
        if steps >= 4_000 and "early" not in rss:
            rss["early"] = _rss_kib()
    rss["late"] = _rss_kib()
    # Flat: what 16,000 more steps add is noise (a leak of even 100 bytes a step is 1.6 MB).
    assert rss["late"] - rss["early"] < 1024, rss
