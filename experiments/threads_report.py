"""Time every kernel of the thread grid under 1 thread, 2 threads and the size rule's choice; print a markdown report.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/threads_report.py \
        [--repeat 5] [--out docs/results/threads.md] [--json docs/results/threads.json]

The grid is bench/cases.py's THREAD_GRID (d = 16..4609, rows 64..65536, both
dtypes; gram, cross and forward products of 128 columns, and d x d ridge
solves). Each case is timed as a run of back-to-back calls that lasts at least
``--budget`` seconds (one call when a call is longer), the three settings
interleaved, and each setting's time is the fastest of its ``--repeat`` runs
(``--stat median`` for the median): on a shared VM a run is only ever slowed
by what else the machine does, so the fastest is the least disturbed.
"chosen" is 2 threads allowed with the size rule on; its ratio to the better
of 1 and 2 threads is the issue's measure. Cases above the target ratio are
measured again ``--confirm`` more times (their runs pooled with the first
ones), so a ratio the report flags is one that survived a second look. The
report also fits the rule's flops per thread to these measurements: the value
a re-measured machine should put in fastls.tuning.FLOPS_PER_THREAD (or
FASTLS_FLOPS_PER_THREAD).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import fastls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cases import THREAD_COLUMNS, THREAD_GRID, THREAD_KINDS, thread_case  # noqa: E402

SETTINGS = {"one": (1, False), "two": (2, False), "chosen": (2, True)}
TARGET_RATIO = 1.10
LARGE = {"d": 785, "rows": 4096}  # "where the work is large": 2 threads should be >= 1.6x faster


def per_call(call, budget):
    """Seconds per call over a run of back-to-back calls lasting at least ``budget`` (one call if longer)."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    calls = int(budget / first) if first < budget else 0
    if calls == 0:
        return first
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def measure(call, flops_per_thread, repeat, budget, times=None):
    """Per setting, the list of per-call times of ``repeat`` interleaved runs (appended to ``times`` if given)."""
    times = times if times is not None else {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for r in range(repeat):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order: drifts hit all settings alike
            cores, rule = SETTINGS[name]
            previous = fastls.tuning.set_flops_per_thread(flops_per_thread if rule else 0)
            try:
                with fastls.limit_cores(cores):
                    times[name].append(per_call(call, budget))
            finally:
                fastls.tuning.set_flops_per_thread(previous)
    return times


STATS = {"min": min, "median": statistics.median}


def summarize(record, stat):
    """Set the record's one/two/chosen seconds from its runs by ``stat``."""
    for name in SETTINGS:
        record[name] = STATS[stat](record["runs"][name])
    return record


def ratio(record):
    return record["chosen"] / min(record["one"], record["two"])


def pooled_ratio(record, stat=min):
    """The ratio with the chosen runs pooled with those of the fixed setting that runs the same calls.

    Where the rule chose 1 (or 2) threads, "chosen" and "1 thread" (or "2 threads") are one code path,
    timed in separate runs: a cell must not be flagged because one run of the fixed setting was luckier
    than all of the chosen ones. What remains above 1 is the rule choosing the slower thread count.
    """
    runs = record["runs"]
    same, other = ("two", "one") if record["threads"] == 2 else ("one", "two")
    chosen = stat(runs["chosen"] + runs[same])
    return chosen / min(chosen, stat(runs[other]))


def fit_flops_per_thread(records):
    """The flops per thread whose rule, applied to the measured 1- and 2-thread times, loses least to the best."""
    best = None
    for exponent in np.arange(4.0, 10.01, 0.125):
        candidate = 10.0 ** exponent
        ratios = [(r["two"] if r["flops"] >= 2 * candidate else r["one"]) / min(r["one"], r["two"]) for r in records]
        score = (max(ratios), sum(ratios))
        if best is None or score < best[0]:
            best = (score, candidate)
    return best[1], best[0][0]


def grid_table(records, kind, dtype, grid):
    rows_list = grid["rows"] if kind != "solve" else grid["rows"][:1]
    if kind == "solve":
        lines = ["| d | 1 thread (ms) | 2 threads (ms) | chosen (ms) | chosen / best | 1 / 2 |",
                 "|---|---|---|---|---|---|"]
        for r in records:
            if r["kind"] == kind and r["dtype"] == dtype:
                lines.append(f"| {r['d']} | {r['one'] * 1e3:.3f} | {r['two'] * 1e3:.3f} | {r['chosen'] * 1e3:.3f} | "
                             f"{r['chosen'] / min(r['one'], r['two']):.2f} | {r['one'] / r['two']:.2f} |")
        return lines
    lines = ["| d \\ rows | " + " | ".join(str(n) for n in rows_list) + " |", "|---" * (len(rows_list) + 1) + "|"]
    for d in grid["d"]:
        cells = []
        for n in rows_list:
            r = next((r for r in records if (r["kind"], r["dtype"], r["d"], r["rows"]) == (kind, dtype, d, n)), None)
            if r is None:
                cells.append("-")
                continue
            ratio = r["chosen"] / min(r["one"], r["two"])
            mark = "**" if ratio > TARGET_RATIO else ""
            cells.append(f"{mark}{ratio:.2f}{mark} ({r['threads']}t, x{r['one'] / r['two']:.2f})")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.02, help="seconds of back-to-back calls per timing")
    parser.add_argument("--size", choices=sorted(THREAD_GRID), default="full")
    parser.add_argument("--flops-per-thread", type=float, default=fastls.tuning.get_flops_per_thread())
    parser.add_argument("--kinds", nargs="+", default=THREAD_KINDS, choices=THREAD_KINDS)
    parser.add_argument("--stat", choices=sorted(STATS), default="min", help="a setting's time from its runs")
    parser.add_argument("--confirm", type=int, default=5,
                        help="more runs for every case above the target ratio (0: none)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--from-json", default=None,
                        help="render the report of a grid saved by --json, measuring nothing")
    args = parser.parse_args()
    grid = THREAD_GRID[args.size]
    records = []
    started = time.perf_counter()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        records, args.flops_per_thread = saved["records"], saved["flops_per_thread"]
        args.kinds = [k for k in args.kinds if any(r["kind"] == k for r in records)]
    for kind in (args.kinds if not args.from_json else ()):
        for dtype in ("float32", "float64"):
            for d in grid["d"]:
                for rows in (grid["rows"] if kind != "solve" else grid["rows"][:1]):
                    call, flops = thread_case(kind, d, rows, np.dtype(dtype))
                    repeat = args.repeat if flops < 5e10 else 2
                    runs = measure(call, args.flops_per_thread, repeat, args.budget)
                    previous = fastls.tuning.set_flops_per_thread(args.flops_per_thread)
                    with fastls.limit_cores(2):
                        work = fastls._products._gram_thread_work(rows, d) if kind == "gram" else flops
                        threads = fastls.tuning.threads_for(work)
                    fastls.tuning.set_flops_per_thread(previous)
                    if kind == "gram":  # narrow Grams run what their timed first calls chose
                        kind_key = (np.dtype(dtype).char, d, rows.bit_length(), threads)
                        threads = fastls.tuning.thread_trials().get(kind_key, threads)
                    record = summarize({"kind": kind, "dtype": dtype, "d": d, "rows": rows, "flops": flops,
                                        "threads": threads, "runs": runs}, args.stat)
                    if ratio(record) > TARGET_RATIO and args.confirm:
                        record["first_ratio"] = ratio(record)
                        measure(call, args.flops_per_thread, args.confirm, args.budget, runs)
                        summarize(record, args.stat)
                    records.append(record)
                    print(f"{kind:6s} {dtype} d={d:5d} rows={rows:6d} 1t {record['one'] * 1e3:9.3f} ms  "
                          f"2t {record['two'] * 1e3:9.3f} ms  chosen({threads}t) {record['chosen'] * 1e3:9.3f} ms"
                          + (f"  (confirmed: {record['first_ratio']:.2f} -> {ratio(record):.2f})"
                             if "first_ratio" in record else ""),
                          file=sys.stderr, flush=True)
                    del call
    elapsed = time.perf_counter() - started
    ratios = [ratio(r) for r in records]
    confirmed = [r for r in records if "first_ratio" in r]
    worst = max(range(len(records)), key=lambda i: ratios[i])
    over = [r for r, q in zip(records, ratios) if q > TARGET_RATIO]
    large = [r["one"] / r["two"] for r in records
             if r["kind"] != "solve" and r["d"] >= LARGE["d"] and r["rows"] >= LARGE["rows"]]
    pooled = [(r, pooled_ratio(r, STATS[args.stat])) for r in records]
    pooled_over = [(r, q) for r, q in pooled if q > TARGET_RATIO]
    fitted, fitted_worst = fit_flops_per_thread(records)
    w = records[worst]
    lines = [
        "# BLAS threads chosen by problem size",
        "",
        f"Command: `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/threads_report.py "
        f"{' '.join(sys.argv[1:])}` on {platform.machine()}, {fastls.available_cores()} cores "
        f"({elapsed / 60:.0f} min). Rule: {args.flops_per_thread:.3g} flops per thread "
        f"(2 threads from {2 * args.flops_per_thread:.3g} flops of work). Cross and forward products have "
        f"{THREAD_COLUMNS} columns; solves are d x d Cholesky ridge solves of {THREAD_COLUMNS} right-hand sides.",
        "",
        f"- **chosen / best of (1, 2 threads)**: worst {ratios[worst]:.2f} ({w['kind']} {w['dtype']} d={w['d']} "
        f"rows={w['rows']}), median {statistics.median(ratios):.2f}; {len(over)} of {len(records)} cases above "
        f"{TARGET_RATIO:.2f} (target: none); each setting's time the {args.stat} of its runs.",
        f"- **Second look**: {len(confirmed)} cases were above {TARGET_RATIO:.2f} after {args.repeat} runs and "
        f"measured {args.confirm} more times; {sum(ratio(r) <= TARGET_RATIO for r in confirmed)} of them came "
        f"back within it"
        + (" (" + ", ".join(f"{r['kind']} {r['dtype']} d={r['d']} rows={r['rows']} {r['first_ratio']:.2f} -> "
                            f"{ratio(r):.2f}" for r in confirmed) + ")." if confirmed else "."),
        f"- **Same calls pooled** (where the rule chose a fixed setting's thread count, its runs and the chosen "
        f"ones are one code path): {len(pooled_over)} of {len(records)} cases above {TARGET_RATIO:.2f}"
        + (" (" + ", ".join(f"{r['kind']} {r['dtype']} d={r['d']} rows={r['rows']} {r['threads']}t {q:.2f}"
                            for r, q in pooled_over) + ")." if pooled_over else "."),
        f"- **2 threads against 1 where the work is large** (d >= {LARGE['d']}, rows >= {LARGE['rows']}, "
        f"gram/cross/forward): speed-up min {min(large):.2f}x, median {statistics.median(large):.2f}x "
        f"(target >= 1.6x)." if large else "- no large cases in this grid.",
        f"- **Fitted rule**: {fitted:.3g} flops per thread would give a worst ratio of {fitted_worst:.2f} "
        f"on these measurements.",
        "",
        "Cells: chosen / best (threads the rule chose, speed-up of 2 threads over 1); bold above "
        f"{TARGET_RATIO:.2f}.",
    ]
    for kind in args.kinds:
        for dtype in ("float32", "float64"):
            lines += ["", f"## {kind}, {dtype}", ""] + grid_table(records, kind, dtype, grid)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"flops_per_thread": args.flops_per_thread, "records": records},
                                              indent=1))
    print(text)


if __name__ == "__main__":
    main()
