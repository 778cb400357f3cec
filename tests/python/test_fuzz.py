"""The loader against a corpus of malformed files (gguf_fuzz.py): no crash, no hang, and nothing
but GGUFError, ValueError (or FileNotFoundError) from loading, evaluating or tokenizing."""

import os
import subprocess
import sys

from gguf_fuzz import write_corpus

WORKER = r"""
import sys, ggraph
for path in sys.argv[1:]:
    print("BEGIN", path, flush=True)
    try:
        ggraph.read_metadata(path)
        m = ggraph.Model(path, device="cpu", n_ctx=32, n_threads=1)
        m.eval([1])
        m.tokenize("hello world")
        print("LOADED", path, flush=True)
    except UnicodeError as e:  # a ValueError, but a message that could not be decoded
        print("BAD", path, type(e).__name__, str(e)[:200], flush=True)
    except (ggraph.GGUFError, ValueError, FileNotFoundError) as e:
        print("REFUSED", path, type(e).__name__, flush=True)
    except BaseException as e:
        print("BAD", path, type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
"""

BATCH = 100
BATCH_SECONDS = 300  # a hang, not a speed target: a batch of 100 loads takes about a second


def _run(paths):
    """(outcomes by path, the path that crashed or hung or None, how it ended)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", WORKER, *paths],
            capture_output=True,
            text=True,
            timeout=BATCH_SECONDS,
            check=False,
        )
        text, ended = out.stdout, f"exit {out.returncode}"
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        ended = "hang"
    outcomes, current = {}, None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        path = rest.split(" ")[0]
        if kind == "BEGIN":
            current = path
        elif kind in ("LOADED", "REFUSED", "BAD"):
            outcomes[path] = (kind, rest)
            current = None
    return outcomes, current, ended


def test_malformed_files_are_refused_cleanly(tiny_model, tmp_path):
    paths = write_corpus(tiny_model, str(tmp_path / "corpus"))
    assert len(paths) >= 900
    outcomes, failures = {}, []
    todo = list(paths)
    while todo:
        batch, todo = todo[:BATCH], todo[BATCH:]
        got, stuck, ended = _run(batch)
        outcomes.update(got)
        if stuck is not None:  # a crash or a hang: note it and go on after it
            failures.append(f"{os.path.basename(stuck)}: {ended}")
            todo = batch[batch.index(stuck) + 1 :] + todo
    bad = [f"{os.path.basename(p)}: {r}" for p, (k, r) in outcomes.items() if k == "BAD"]
    assert failures == [] and bad == []
    refused = sum(1 for k, _ in outcomes.values() if k == "REFUSED")
    assert refused >= 800, f"{refused} of {len(paths)} refused"
