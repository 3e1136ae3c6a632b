"""Time fastls.StreamingRidge against scikit-learn's Ridge(solver='cholesky') in one process; print a markdown table.

    python bench/estimators_report.py [--rows 1000000] [--features 785] [--targets 10] [--batches 100]
        [--repeat 2] [--out FILE]

The issue's targets (benchmarks, never timed tests): on 1,000,000 x 785 float32 rows and 10 targets,
``StreamingRidge.fit`` at least 1.5x faster than ``Ridge(solver='cholesky')`` on the same data, with
peak extra memory below 2 d^2 x 8 bytes + one batch; ``partial_fit`` over 100 batches within 10 % of
one ``fit``. The three calls run in one process on the same arrays, interleaved over ``--repeat``
rounds (best time kept); the fits' coefficients are compared with Ridge's too.

Peak extra memory is measured two ways while a call runs: the resident set sampled every 2 ms
(everything, including BLAS buffers and the kernels' C scratch) minus the resident set before the call,
and tracemalloc's peak (NumPy's allocations only; a separate, untimed call). The test suite runs this
script at ``--rows 20000`` as a check.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
from sklearn.linear_model import Ridge

import fastls
from fastls._estimators import BLOCK_ROWS

ALPHA = 1.0


def regression_rows(rows, features, targets, seed=0):
    """float32 X (rows x features, standard normal, offset 0.5 so the intercept matters) and y = X W + noise.

    Drawn in blocks: one draw of 1,000,000 x 785 in float64 would hold 6 GB at once.
    """
    rng = np.random.default_rng(seed)
    X = np.empty((rows, features), dtype=np.float32)
    y = np.empty((rows, targets), dtype=np.float32)
    W = (rng.standard_normal((features, targets)) / np.sqrt(features)).astype(np.float32)
    for start in range(0, rows, 65536):
        block = slice(start, min(start + 65536, rows))
        X[block] = rng.standard_normal((block.stop - start, features), dtype=np.float32) + 0.5
        y[block] = fastls.matmul(X[block], W) + rng.standard_normal((block.stop - start, targets),
                                                                    dtype=np.float32)
    return X, y


def streamed_fit(X, y, batches):
    """partial_fit over ``batches`` equal batches, then the coefficients (their one solve)."""
    model = fastls.StreamingRidge(alpha=ALPHA)
    for rows in np.array_split(np.arange(len(X)), batches):
        model.partial_fit(X[rows[0]:rows[-1] + 1], y[rows[0]:rows[-1] + 1])
    model.coef_  # noqa: B018  (reading coef_ runs the one solve, which is what is timed)
    return model


def _rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(call):
    """(result, seconds, peak extra resident bytes) of call(), the resident set sampled every 2 ms."""
    before = _rss_bytes()
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        result = call()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _rss_bytes())
    return result, seconds, peak[0] - before


def traced_peak(call):
    """Peak bytes NumPy and Python allocated during call() (tracemalloc), beyond what was held before."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def relative_difference(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(b).max())


def report(rows, features, targets, batches, repeat):
    X, y = regression_rows(rows, features, targets)
    # Warm-up on a few rows: BLAS thread pools and their buffers start here, not inside a measured call.
    fastls.StreamingRidge(alpha=ALPHA).fit(X[:4096], y[:4096]).predict(X[:10])
    Ridge(alpha=ALPHA, solver="cholesky").fit(X[:4096], y[:4096])
    load_before = os.getloadavg()

    calls = {"fit": lambda: fastls.StreamingRidge(alpha=ALPHA).fit(X, y),
             "ridge": lambda: Ridge(alpha=ALPHA, solver="cholesky").fit(X, y),
             "stream": lambda: streamed_fit(X, y, batches)}
    seconds = {name: float("inf") for name in calls}
    rss = {name: 0 for name in calls}
    models = {}
    # Interleaved rounds, best time and largest peak of each: other processes' load hits all three alike.
    for _ in range(repeat):
        for name, call in calls.items():
            models[name], took, peak = measured(call)
            seconds[name], rss[name] = min(seconds[name], took), max(rss[name], peak)
    ours, theirs, streamed = models["fit"], models["ridge"], models["stream"]
    fit_seconds, ridge_seconds, stream_seconds = seconds["fit"], seconds["ridge"], seconds["stream"]
    fit_rss, ridge_rss, stream_rss = rss["fit"], rss["ridge"], rss["stream"]
    fit_traced = traced_peak(calls["fit"])
    load_after = os.getloadavg()

    d2 = 2 * features * features * 8
    batch = min(BLOCK_ROWS, rows) * features * X.dtype.itemsize
    mb = 2.0 ** 20
    lines = [
        f"# StreamingRidge against Ridge(solver='cholesky'): {rows:,} x {features} float32 rows, {targets} targets",
        "",
        f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, NumPy {np.__version__}; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (other processes share the "
        f"machine). Best of {repeat} interleaved rounds (fit, Ridge, partial_fit), same arrays, alpha = "
        f"{ALPHA:g}.",
        "",
        "| call | seconds | Ridge's time / this time | this time / one fit | peak extra RSS (MB) | "
        "coef vs Ridge (max rel. diff.) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| `Ridge(solver='cholesky').fit` | {ridge_seconds:.2f} | 1.00 | - | {ridge_rss / mb:.1f} | - |",
        f"| `StreamingRidge.fit` | {fit_seconds:.2f} | {ridge_seconds / fit_seconds:.2f} | 1.00 | "
        f"{fit_rss / mb:.1f} | {relative_difference(ours.coef_, theirs.coef_):.1e} |",
        f"| `StreamingRidge.partial_fit` x {batches} + `coef_` | {stream_seconds:.2f} | "
        f"{ridge_seconds / stream_seconds:.2f} | {stream_seconds / fit_seconds:.3f} | {stream_rss / mb:.1f} | "
        f"{relative_difference(streamed.coef_, theirs.coef_):.1e} |",
        "",
        f"Memory budget of the issue: 2 d^2 x 8 bytes + one batch = {d2 / mb:.1f} MB + {batch / mb:.1f} MB "
        f"(a batch: {min(BLOCK_ROWS, rows):,} rows, the estimator's block) = {(d2 + batch) / mb:.1f} MB. "
        f"tracemalloc peak of `StreamingRidge.fit` (NumPy's allocations): {fit_traced / mb:.1f} MB, plus the "
        f"float32 tile gram_update mallocs in C ({min(features, 2560) ** 2 * 4 / mb:.1f} MB, not traced). The "
        f"resident set counts everything but misses memory the allocator reuses from earlier calls. The data "
        f"themselves take {(X.nbytes + y.nbytes) / mb:.0f} MB.",
    ]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--features", type=int, default=785)
    parser.add_argument("--targets", type=int, default=10)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds, best time kept (default 2)")
    parser.add_argument("--out", help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    for name in ("rows", "features", "targets", "batches", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batches > args.rows:
        parser.error(f"--batches ({args.batches}) must not exceed --rows ({args.rows})")
    text = "\n".join(report(args.rows, args.features, args.targets, args.batches, args.repeat)) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
