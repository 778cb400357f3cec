"""A decode step's critical path kernel by kernel, from a measurement build's output.

A build with the CMake option GGRAPH_CUDA_STEP_TRACE=ON (`GGRAPH_CUDA_STEP_TRACE=ON
tools/prebuild.sh PYTHON`) prints a line "LNC index name blocks threads" for each launch of a
step as it is captured into a CUDA graph, and, at the process's exit, a line "STP gridid blocks
threads sm arrived released" for each grid: %globaltimer (ns) when its block 0 started and when
that block's wait for the grid before it ended, stamped into page-locked host memory
(src/cuda/device_util.cuh, pdl_wait). Grids run in the order of their ids, and a grid's wait
ends when the grid before it has ended, so the time from one grid's release to the next one's
is that grid's share of the step's critical path.

This finds the captured steps among the grids (their blocks and threads in the captured order),
and prints, per kernel, its launches a step, the median of its share (us) over the steps, summed
over its launches, and how long before the release its block 0 had started (the overlap that
programmatic dependent launch gave it):

    python -m ggraph bench -m FILE -p 0 -n 32 -r 1 --cuda-graphs patch > out.txt
    python tools/step_trace.py out.txt
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import statistics
import subprocess


def demangle(names: list[str]) -> dict[str, str]:
    """Short readable names: c++filt's where it is installed, namespaces and arguments dropped."""
    out = dict(zip(names, names))
    if shutil.which("c++filt"):
        res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        out = dict(zip(names, res.stdout.splitlines()))
    short = {}
    for k, v in out.items():
        v = re.sub(r"\b(ggraph|cuda)::|\(anonymous namespace\)::", "", v)
        v = re.sub(r"\(.*\)$", "", v)  # the parameter list
        v = re.sub(r"^void ", "", v)
        short[k] = v
    return short


def read(paths: list[str]) -> tuple[list[list[tuple[str, int, int]]], list[tuple[int, ...]]]:
    """The captured launch lists [(name, blocks, threads)] and the grids' stamps."""
    captures: list[list[tuple[str, int, int]]] = []
    grids = []
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 5 and fields[0] == "LNC":
                    if fields[1] == "0" or not captures:
                        captures.append([])
                    captures[-1].append((fields[2], int(fields[3]), int(fields[4])))
                elif len(fields) == 7 and fields[0] == "STP":
                    grids.append(tuple(int(v) for v in fields[1:]))
    return captures, grids


def steps(captures, grids):
    """(capture, [grid stamps]) for each run of grids that matches a capture's launches."""
    shapes = [[(b, t) for _, b, t in c] for c in captures]
    out = []
    i = 0
    while i < len(grids):
        for ci, shape in enumerate(shapes):
            n = len(shape)
            if n > 1 and [(g[1], g[2]) for g in grids[i : i + n]] == shape:
                out.append((ci, grids[i : i + n]))
                i += n
                break
        else:
            i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--skip", type=int, default=2, help="steps to drop at the start (warm-up)")
    ap.add_argument("--order", type=int, default=0, help="also list the first N launches in order")
    args = ap.parse_args()
    captures, grids = read(args.paths)
    if not captures or not grids:
        raise SystemExit("no LNC/STP lines: is the build made with GGRAPH_CUDA_STEP_TRACE=ON?")
    # Launch order is the grid ids' order; where that finds fewer steps, the releases' order.
    found = max(
        (steps(captures, sorted(grids)), steps(captures, sorted(grids, key=lambda g: g[5]))),
        key=len,
    )
    if not found:
        raise SystemExit(f"no step's grids match a captured step ({len(captures)} captures)")
    by_capture = collections.defaultdict(list)
    for ci, g in found:
        by_capture[ci].append(g)
    names = demangle(sorted({n for c in captures for n, _, _ in c}))
    for ci, runs in sorted(by_capture.items(), key=lambda kv: -len(kv[1])):
        runs = runs[args.skip :] if len(runs) > args.skip + 2 else runs
        cap = captures[ci]
        n = len(cap)
        # Share of launch k: release of k+1 minus release of k; the last launch has none.
        share = [statistics.median(r[k + 1][5] - r[k][5] for r in runs) for k in range(n - 1)]
        early = [statistics.median(r[k][5] - r[k][4] for r in runs) for k in range(n)]
        span = statistics.median(r[-1][5] - r[0][5] for r in runs)
        print(
            f"## capture {ci}: {n} launches, {len(runs)} steps, first to last release "
            f"{span / 1000:.1f} us (median)"
        )
        # Per kernel and grid: its launches' shares and block 0's waits.
        rows = collections.defaultdict(lambda: ([], []))
        for k in range(n - 1):
            each, wait = rows[(names[cap[k][0]], cap[k][1], cap[k][2])]
            each.append(share[k])
            wait.append(early[k])
        print(
            "| kernel | blocks x threads | launches | us a step | us each (median) "
            "| block 0 waited, us (median) |"
        )
        print("|---|---|---|---|---|---|")
        for (name, b, t), (each, wait) in sorted(rows.items(), key=lambda kv: -sum(kv[1][0])):
            print(
                f"| {name} | {b} x {t} | {len(each)} | {sum(each) / 1000:.1f} | "
                f"{statistics.median(each) / 1000:.2f} | {statistics.median(wait) / 1000:.2f} |"
            )
        if args.order:
            print()
            print("| # | kernel | blocks | us (median) | block 0 waited, us |")
            print("|---|---|---|---|---|")
            for k in range(min(args.order, n - 1)):
                print(
                    f"| {k} | {names[cap[k][0]]} | {cap[k][1]} | {share[k] / 1000:.2f} | "
                    f"{early[k] / 1000:.2f} |"
                )
        print()


if __name__ == "__main__":
    main()
