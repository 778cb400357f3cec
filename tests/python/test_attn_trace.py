"""tools/attn_trace.py's reading of a measurement build's stamps: blocks grouped into launches by
their wait releases, each phase's time after the launch's first release (the merge's stamps from
the blocks that made them), and lines of builds without the merge's stamps read as before."""

import importlib.util
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "attn_trace.py")
spec = importlib.util.spec_from_file_location("attn_trace", TOOL)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

# Three blocks of a ticket launch (t0..t8, ns): two leave after their ticket, the third wins it.
BLOCKS = [
    [100, 1000, 1500, 2300, 2500, 3300, 0, 0, 3700],
    [120, 1010, 1520, 2350, 2550, 3350, 0, 0, 3800],
    [110, 1005, 1510, 2400, 2600, 3400, 4100, 4800, 8000],
]


def att_lines(blocks, shift=0, keys=4100, cluster=0):
    return [
        f"ATT {keys} {cluster} {i} {len(blocks)} 7 " + " ".join(str(t + shift) for t in b)
        for i, b in enumerate(blocks)
    ]


def test_launches_are_grouped_by_their_releases():
    stamps = list(BLOCKS) + [[t + 20000 for t in b] for b in BLOCKS]
    groups = tool.launches(stamps)
    assert [len(g) for g in groups] == [3, 3]


def test_merge_stamps_come_from_the_blocks_that_made_them(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text(
        "\n".join(["bench output", *att_lines(BLOCKS), *att_lines(BLOCKS, shift=20000)]) + "\n"
    )
    rows = tool.read([str(path)])
    assert list(rows) == [(4100, 0)] and len(rows[(4100, 0)]) == 6
    launch = tool.launches(rows[(4100, 0)])[0]
    assert tool.latest(launch, 6, 1000) == 3100  # only the last block won the ticket
    assert tool.latest(launch, 5, 1000) == 2400
    out = subprocess.run(
        [sys.executable, TOOL, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "4100 keys, split/ticket kernel: 2 launches, 3 blocks each" in out
    assert "| ticket won (last block) | 3,100 | 3,100 | 3,100 |" in out
    assert "| weights in shared memory | 3,800 |" in out
    assert "| end (median block) | 2,800 |" in out
    assert "| end (last block) | 7,000 |" in out


def test_lines_without_the_merge_stamps(tmp_path):
    old = [b[:5] + [b[8]] for b in BLOCKS]
    path = tmp_path / "old.txt"
    path.write_text("\n".join(att_lines(old, keys=1924, cluster=1)) + "\n")
    stamps = tool.read([str(path)])[(1924, 1)]
    assert stamps[2] == BLOCKS[2][:5] + [0, 0, 0, 8000]
    out = subprocess.run(
        [sys.executable, TOOL, str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert "| end (last block) | 7,000 |" in out
    assert "cluster barrier" not in out  # no block made the merge's stamps


def test_no_stamps_is_an_error(tmp_path):
    path = tmp_path / "none.txt"
    path.write_text("tg128 1,000\n")
    result = subprocess.run([sys.executable, TOOL, str(path)], capture_output=True, text=True)
    assert result.returncode != 0 and "GGRAPH_CUDA_ATTN_TRACE" in result.stderr
