"""The decode attention's phases per launch, from a measurement build's output.

A build with the CMake option GGRAPH_CUDA_ATTN_TRACE=ON (`GGRAPH_CUDA_ATTN_TRACE=ON
tools/prebuild.sh PYTHON`) prints, in decode steps whose key count is 4 past a multiple of 64,
one line per block of the first KV head: "ATT keys cluster split n_used sm t0 .. t8", the
%globaltimer (ns) at the block's start, after its wait for the kernel before, when its first K
tile landed, after its keys, after its warps' records, at three points of the merge (0 where the
block does not get there) and at its end (src/cuda/attention.cu, AttnTrace). This groups the
lines into launches (wait releases more than 4 us apart) and prints, per key count and kernel,
the median over launches of each phase's time after the launch's first release:

    python -m ggraph bench -m FILE -p 0 -n 128 -r 2 -d 1900 --cuda-graphs patch > out.txt
    python tools/attn_trace.py out.txt
"""

from __future__ import annotations

import argparse
import collections
import statistics


def latest(la: list[list[int]], i: int, rel: int) -> int | None:
    """Stamp i of the latest block that made it, after the release (None: no block did)."""
    made = [r[i] for r in la if r[i]]
    return max(made) - rel if made else None


# The merge's three stamps (5-7), by kernel.
MERGE_PHASES = {
    0: ["partials written (latest block)", "ticket won (last block)", "weights in shared memory"],
    1: ["cluster barrier wait passed", "stores made (latest block)", "cluster barrier passed"],
}

PHASES = [
    ("first block started before the release", lambda la, rel: rel - min(r[0] for r in la)),
    ("last block started before the release", lambda la, rel: rel - max(r[0] for r in la)),
    ("last release", lambda la, rel: max(r[1] for r in la) - rel),
    ("first K tile landed (latest block)", lambda la, rel: max(r[2] for r in la) - rel),
    ("keys done (latest block)", lambda la, rel: max(r[3] for r in la) - rel),
    ("warps' records written (latest block)", lambda la, rel: max(r[4] for r in la) - rel),
    ("end (median block)", lambda la, rel: statistics.median(r[8] for r in la) - rel),
    ("end (last block)", lambda la, rel: max(r[8] for r in la) - rel),
]


def read(paths: list[str]) -> dict[tuple[int, int], list[list[int]]]:
    """Stamps [t0..t8] per (keys, cluster), from the ATT lines of the files (lines of builds
    without the merge's stamps, t0..t5, read as t0..t4, three zeros and t5)."""
    rows: dict[tuple[int, int], list[list[int]]] = collections.defaultdict(list)
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) not in (12, 15) or fields[0] != "ATT":
                    continue
                keys, cluster = int(fields[1]), int(fields[2])
                t = [int(v) for v in fields[6:]]
                rows[(keys, cluster)].append(t if len(t) == 9 else t[:5] + [0, 0, 0, t[5]])
    return rows


def launches(stamps: list[list[int]], gap_ns: int = 4000) -> list[list[list[int]]]:
    """The blocks' stamps grouped into launches by their wait releases."""
    stamps = sorted(stamps, key=lambda r: r[1])
    out: list[list[list[int]]] = []
    for r in stamps:
        if not out or r[1] - out[-1][-1][1] > gap_ns:
            out.append([])
        out[-1].append(r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="outputs of a measurement build")
    args = parser.parse_args()
    rows = read(args.files)
    if not rows:
        raise SystemExit("no ATT lines: is the build made with GGRAPH_CUDA_ATTN_TRACE=ON?")
    for (keys, cluster), stamps in sorted(rows.items()):
        groups = launches(stamps)
        blocks = statistics.median(len(g) for g in groups)
        kernel = "cluster" if cluster else "split/ticket"
        print(f"\n{keys} keys, {kernel} kernel: {len(groups)} launches, {blocks:g} blocks each")
        print("\n| phase (ns after the first release) | median | min | max |\n|---|---|---|---|")
        merge = [
            (name, lambda la, rel, i=i: latest(la, i, rel))
            for i, name in enumerate(MERGE_PHASES[cluster], start=5)
        ]
        for name, fn in PHASES[:6] + merge + PHASES[6:]:
            values = [fn(g, min(r[1] for r in g)) for g in groups if all(r[2] for r in g)]
            values = [v for v in values if v is not None]
            if values:
                print(
                    f"| {name} | {statistics.median(values):,.0f} | {min(values):,.0f} | "
                    f"{max(values):,.0f} |"
                )


if __name__ == "__main__":
    main()
