"""GPU time of each kernel of one decode step, as Nsight Compute measures it.

    python3 tools/kernel_times.py MODEL.gguf [--past N] [--kv-type f16|q8_0] [--batch B]
        [--sass REGEX [--skip N] [--keep FILE]] [--csv FILE]

Evaluates a prompt of N tokens (default 64) and two decode steps with stream launches
(cuda_graphs="off") under `ncu`, which profiles the two steps only (a long prompt's kernels would
take minutes); prints the last step's kernels grouped by function,
largest total first. --batch B has B sequences (the model and its sessions) take that prompt,
then batched decode steps (`Model.decode_batch`), of which only the last two are profiled.
ncu runs kernels one at a time, so launches do not overlap: the total
bounds a graph replay's GPU time from above. Needs ncu and the ggraph package on PYTHONPATH
(tools/gpu_run.sh build). --stalls adds, per kernel, the instructions a launch issues and
the cycles a warp waited on average for each issued instruction, by reason: an instruction
fetch, global memory, shared memory (and other short-latency units), a full MIO queue, a busy
math pipe (the tensor cores among them), a fixed-latency dependency, a barrier, and another
warp issuing instead; and the shared-memory configuration its blocks ran under, with the dynamic
shared memory a block asked for.
--warm keeps the caches between kernels (ncu flushes them by default), as a replayed step does:
the small kernels then take about what they take in a real step, less the launch gaps.

--sass REGEX instead profiles one launch of a kernel whose name matches REGEX (the first of
the profiled range, or the one --skip N launches later) with Nsight's per-instruction source
counters, and prints where its instructions and stall samples go: by opcode, by block of code
(consecutive instructions that ran equally often, e.g. a loop body), and the most sampled
instructions; --keep FILE also saves the profile's CSV there. With --sections NAMES
(comma-separated Nsight Compute sections, e.g. MemoryWorkloadAnalysis,ComputeWorkloadAnalysis)
it prints those sections' details for that launch instead: how busy shared memory, the caches
and each pipe were. --csv FILE summarizes such a
profile saved before (`ncu --csv --page source --print-source sass --section SourceCounters ...`,
or --keep) without running anything.
"""

import argparse
import collections
import csv
import io
import subprocess
import sys

STEP = """
import ctypes
import ggraph
m = ggraph.Model({model!r}, device="cuda", cuda_graphs="off", n_ctx={n_ctx},
                 kv_type={kv_type!r}, allow_longer_context=True)
m.eval([1 + i % 100 for i in range({past})])
ctypes.CDLL("libcuda.so.1").cuProfilerStart()
m.eval([7])
m.eval([8])
"""

BATCH_STEP = """
import ctypes
import ggraph
m = ggraph.Model({model!r}, device="cuda", cuda_graphs="off", n_ctx={n_ctx},
                 kv_type={kv_type!r}, n_seq_max={batch}, allow_longer_context=True)
seqs = [m] + [m.session() for _ in range({batch} - 1)]
for i, s in enumerate(seqs):
    s.eval([1 + (i + j) % 100 for j in range({past})])
m.decode_batch([(s, 7) for s in seqs])
ctypes.CDLL("libcuda.so.1").cuProfilerStart()
m.decode_batch([(s, 8) for s in seqs])
m.decode_batch([(s, 9) for s in seqs])
"""


TIME = "gpu__time_duration.sum"
STALLS = {
    "smsp__inst_executed.sum": "instructions",
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio": "fetch wait",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "memory wait",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio": "shared wait",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio": "MIO queue",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "pipe busy",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "fixed latency",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "barrier",
    "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio": "not selected",
    # An SM runs blocks of kernels of one shared-memory configuration at a time: a kernel whose
    # configuration differs from the one before waits for the SM to empty.
    "launch__shared_mem_config_size": "smem config KiB",
    "launch__shared_mem_per_block_dynamic": "dynamic smem KiB",
}
KIB = {"": 1 / 1024, "B": 1 / 1024, "byte": 1 / 1024, "bytes": 1 / 1024, "Kbyte": 1000 / 1024}


def short_name(name: str) -> str:
    # "void ns::(anonymous namespace)::kernel<3, 1, 2>(args)" -> "kernel<3, 1, 2>"
    name = name.replace("(anonymous namespace)::", "").split("(")[0]
    return name.split("::")[-1].removeprefix("void ").strip()


def sass_summary(text: str, top: int = 12) -> None:
    """Prints where a kernel's instructions and stall samples go, from the CSV that `ncu --csv
    --page source --print-source sass` writes for one launch."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit("no per-instruction table in the profile (was --page source given?)")
    head = rows[start]
    n_col = head.index("Instructions Executed")
    s_col = head.index("Warp Stall Sampling (All Samples)")
    code = []  # (address, instruction, executions, samples)
    for r in rows[start + 1 :]:
        if len(r) > max(n_col, s_col) and r[n_col].replace(",", "").isdigit():
            n = int(r[n_col].replace(",", ""))
            code.append((r[0], r[1].strip(), n, int(r[s_col].replace(",", "") or 0)))
    insts = sum(c[2] for c in code) or 1
    samples = sum(c[3] for c in code) or 1

    def opcode(instruction: str) -> str:
        words = instruction.split()
        word = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
        return word.split(".")[0]

    by_op = collections.Counter()
    op_samples = collections.Counter()
    for _, ins, n, smp in code:
        by_op[opcode(ins)] += n
        op_samples[opcode(ins)] += smp
    print(f"{insts:,} warp instructions, {samples:,} stall samples\n")
    print("| opcode | instructions | share | stall samples |")
    print("|---|---|---|---|")
    for op, n in by_op.most_common(top * 2):
        print(f"| {op} | {n:,} | {100 * n / insts:.1f}% | {100 * op_samples[op] / samples:.1f}% |")
    # Blocks of code: runs of instructions executed equally often.
    blocks = []
    for addr, ins, n, smp in code:
        if blocks and blocks[-1][1] == n:
            blocks[-1][2].append(opcode(ins))
            blocks[-1][3] += smp
        else:
            blocks.append([addr, n, [opcode(ins)], smp])
    print("\n| first address | runs | instructions | share | stall samples | opcodes |")
    print("|---|---|---|---|---|---|")
    for addr, n, ops, smp in blocks:
        if n * len(ops) >= insts / 100:
            shown = " ".join(ops[:12]) + (" ..." if len(ops) > 12 else "")
            print(
                f"| {addr[-6:]} | {n:,} | {len(ops)} | {100 * n * len(ops) / insts:.1f}% "
                f"| {100 * smp / samples:.1f}% | {shown} |"
            )
    print("\n| address | instruction | runs | stall samples |")
    print("|---|---|---|---|")
    for addr, ins, n, smp in sorted(code, key=lambda c: -c[3])[:top]:
        print(f"| {addr[-6:]} | `{ins}` | {n:,} | {100 * smp / samples:.1f}% |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--past", type=int, default=64)
    ap.add_argument("--stalls", action="store_true")
    ap.add_argument("--warm", action="store_true", help="keep the caches between kernels")
    ap.add_argument("--kv-type", default="f16", help="the KV cache's type (f16 or q8_0)")
    ap.add_argument("--batch", type=int, default=0, help="sequences a batched decode step")
    ap.add_argument("--sass", metavar="REGEX", help="per-instruction profile of one launch")
    ap.add_argument("--skip", type=int, default=0, help="matching launches to skip (--sass)")
    ap.add_argument("--keep", metavar="FILE", help="save the --sass profile's CSV")
    ap.add_argument(
        "--sections", metavar="NAMES", help="--sass: these Nsight sections' details instead"
    )
    ap.add_argument("--csv", metavar="FILE", help="summarize a saved --page source profile")
    args = ap.parse_args()
    if args.csv:
        with open(args.csv) as f:
            sass_summary(f.read())
        return 0
    metrics = [TIME] + (list(STALLS) if args.stalls else [])
    step = (BATCH_STEP if args.batch else STEP).format(
        model=args.model,
        past=args.past,
        n_ctx=args.past + 128,
        kv_type=args.kv_type,
        batch=args.batch,
    )
    # The step under ncu, profiled from cuProfilerStart on.
    run = [
        "--profile-from-start", "off",
        *(["--cache-control", "none"] if args.warm else []),
        sys.executable, "-c", step,
    ]  # fmt: skip
    if args.sass:
        launch = [
            "-k", f"regex:{args.sass}", "--launch-skip", str(args.skip), "--launch-count", "1",
        ]  # fmt: skip
        if args.sections:
            sections = [x for name in args.sections.split(",") for x in ("--section", name.strip())]
            cmd = ["ncu", "--clock-control", "none", *sections, *launch, *run]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            print("\n".join(line for line in out.splitlines() if not line.startswith("==PROF==")))
            return 0
        cmd = [
            "ncu", "--csv", "--clock-control", "none", "--page", "source",
            "--print-source", "sass", "--section", "SourceCounters", *launch, *run,
        ]  # fmt: skip
        profile = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        if args.keep:
            with open(args.keep, "w") as f:
                f.write(profile)
        sass_summary(profile)
        return 0
    cmd = ["ncu", "--csv", "--clock-control", "none", "--metrics", ",".join(metrics), *run]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [r for r in csv.DictReader(io.StringIO(out[out.index('"ID"') :]))]
    extra = collections.defaultdict(lambda: collections.defaultdict(float))
    for r in rows:
        if r["Metric Name"] != TIME:
            value = float(r["Metric Value"].replace(",", "") or 0)
            if r["Metric Name"].startswith("launch__shared_mem"):
                value *= KIB.get(r["Metric Unit"], 1 / 1024)
            extra[r["ID"]][r["Metric Name"]] = value
    rows = [r for r in rows if r["Metric Name"] == TIME]
    names = [r["Kernel Name"] for r in rows]
    starts = [i for i, n in enumerate(names) if "kv_params_kernel" in n]
    if not starts:
        print("no decode step found in the profile", file=sys.stderr)
        return 1
    step = rows[starts[-1] :]
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    total = collections.Counter()
    count = collections.Counter()
    sums = collections.defaultdict(collections.Counter)
    for r in step:
        us = float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]
        total[short_name(r["Kernel Name"])] += us
        count[short_name(r["Kernel Name"])] += 1
        for metric, value in extra[r["ID"]].items():
            sums[short_name(r["Kernel Name"])][metric] += value
    after = args.past + (2 if args.batch else 1)
    print(f"one decode step after {after} tokens: {len(step)} kernels, "
          f"{sum(total.values()):.1f} us of GPU time\n")  # fmt: skip
    heads = [STALLS[m] for m in metrics[1:]]
    print("| kernel | launches | us total | us each |" + "".join(f" {h} |" for h in heads))
    print("|---|---|---|---|" + "---|" * len(heads))
    for name, us in total.most_common():
        cells = "".join(f" {sums[name][m] / count[name]:.1f} |" for m in metrics[1:])
        print(f"| {name} | {count[name]} | {us:.1f} | {us / count[name]:.2f} |{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
