"""Checks the CUDA objects of a build for read-only loads that ptxas moved above a kernel's wait
for the kernel before it (programmatic dependent launch, DESIGN.md's invariants).

    python tools/check_pdl_order.py OBJECT...

The read-only path (`__ldg`, `ld.global.nc`) promises that nothing writes the data while the
kernel runs, so ptxas may schedule such a load before `griddepcontrol.wait` (SASS `ACQBULK`),
where it reads what the kernel before may still be writing. A kernel whose PTX loads nothing
that way before the wait must not do so in its SASS either; and every kernel must wait (all of
them may be launched early). Kernels that load weights that way
before the wait by design (the mat-vecs) are not checked: every other load of theirs after the
wait reads weights too, or activations through L1 (`load_after_wait`).

Reads sm_90's PTX and SASS from each object (the build's architecture 90 puts sm_90a's PTX and
SASS there, and compute_90's PTX; where a kernel has both PTX forms, sm_90a's, the SASS's own
source, counts: the warpgroup kernel is a stub in compute_90's); objects without them (host
code) are passed over. Exit status: 0 when no kernel reads
early, 1 when some do (listed), 77 when cuobjdump or nvdisasm is missing or no object holds
sm_90 code, so that ctest counts the check as skipped.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

SKIP = 77


def find_tool(name: str) -> str | None:
    """A CUDA tool on the PATH, beside nvcc, or from its wheel (nvidia-cuda-NAME)."""
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    beside = os.path.join(os.path.dirname(nvcc), name)
    if os.path.exists(beside):
        return beside
    for site in sys.path:
        for path in glob.glob(os.path.join(site, "nvidia", "cu*", "bin", name)):
            return path
    return None


def dump(tools: tuple[str, str], obj: str, what: str) -> str:
    """sm_90's PTX or SASS of an object; empty where it holds none. (cuobjdump prints SASS
    through nvdisasm, which it looks for on the PATH.)"""
    cuobjdump, nvdisasm = tools
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(
        [cuobjdump, "-arch", "sm_90", what, obj],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    return r.stdout if r.returncode == 0 else ""


def ptx_loads_before_wait(ptx: str) -> dict[str, int | None]:
    """Each kernel's read-only loads before the wait, in the PTX; None where it never waits.
    Where the dump holds several PTX targets, an arch-specific one's (sm_90a) kernels win."""
    out: dict[str, int | None] = {}
    targets = list(re.finditer(r"^\.target\s+(\S+)", ptx, re.M)) or [None]
    for ti, t in enumerate(targets):
        start = t.start() if t else 0
        end = targets[ti + 1].start() if ti + 1 < len(targets) else len(ptx)
        section = ptx[start:end]
        specific = bool(t) and t.group(1).rstrip(",").endswith("a")
        entries = list(re.finditer(r"\.entry\s+(\S+?)\s*\(", section))
        for i, m in enumerate(entries):
            # To the next kernel (cuobjdump's PTX has no indentation to find a body's end by).
            end_i = entries[i + 1].start() if i + 1 < len(entries) else len(section)
            body = section[m.end() : end_i]
            wait = body.find("griddepcontrol.wait")
            loads = len(re.findall(r"\bld\.global\.nc\b", body[:wait])) if wait >= 0 else None
            if specific or m.group(1) not in out:
                out[m.group(1)] = loads
    return out


def sass_loads_before_wait(sass: str) -> dict[str, int]:
    """Each kernel that waits: its read-only loads before ACQBULK, in the SASS."""
    out = {}
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        name = fn.split("\n", 1)[0].strip()
        wait = fn.find("ACQBULK")
        if wait >= 0:
            out[name] = len(re.findall(r"\bLDG\.[A-Z0-9.]*CONSTANT\b", fn[:wait]))
    return out


def check(objects: list[str], tools: tuple[str, str]) -> tuple[int, list[str]]:
    """(kernels checked, the offenders' descriptions)."""
    checked, bad = 0, []
    for obj in objects:
        ptx = ptx_loads_before_wait(dump(tools, obj, "-ptx"))
        sass = sass_loads_before_wait(dump(tools, obj, "-sass"))
        for name, in_ptx in ptx.items():
            if in_ptx is None:
                # Launched early, a kernel that never waits runs beside the kernel before it.
                checked += 1
                bad.append(f"{os.path.basename(obj)}: {name}: no griddepcontrol.wait in the PTX")
                continue
            if name not in sass or in_ptx > 0:
                continue
            checked += 1
            if sass[name] > 0:
                bad.append(
                    f"{os.path.basename(obj)}: {name}: {sass[name]} read-only load(s) before "
                    "ACQBULK in the SASS, none before griddepcontrol.wait in the PTX"
                )
    return checked, bad


def main(argv: list[str]) -> int:
    # (CMake's $<TARGET_OBJECTS:...> arrives as one argument, its paths joined by ';'.)
    paths = [p for a in argv for p in a.split(";") if p]
    objects = [p for p in paths if p.endswith(".o") or p.endswith(".obj")]
    if not objects:
        print("usage: check_pdl_order.py OBJECT...", file=sys.stderr)
        return 2
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        print(
            "cuobjdump or nvdisasm not found (pip install nvidia-cuda-cuobjdump "
            "nvidia-cuda-nvdisasm): check skipped"
        )
        return SKIP
    checked, bad = check(objects, (cuobjdump, nvdisasm))
    if checked == 0:
        print("no sm_90 kernel that waits for the kernel before it: check skipped")
        return SKIP
    for line in bad:
        print(line)
    print(f"{checked} kernels checked, {len(bad)} that read early" + (" (above)" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
