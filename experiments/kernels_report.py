"""Measure the fastls kernels against their references in one run; print a markdown report.

    python experiments/kernels_report.py [--quick] [--out FILE]

Every ratio compares implementations timed in the same process on the same
data (best of ``--repeat`` runs). GFLOP/s counts N d^2 flops for a Gram.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

import fastls

# The report times the same cases as the pytest-benchmark files, which live in bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cases import (  # noqa: E402
    CONV_CASES,
    GRAM_SHAPES,
    SOLVE_SIZES,
    THREADS,
    conv_im2col,
    conv_inputs,
    conv_streaming,
    gram_fastls,
    gram_flops,
    gram_numpy,
    gram_scipy,
    random_matrix,
    spd_system,
)


def best_time(fn, *args, repeat=3):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def peak_bytes(fn, *args):
    """Peak of NumPy/Python allocations during fn (tracemalloc sees NumPy buffers)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def gram_table(shapes, repeat):
    rows = ["| N x d | threads | fastls f64 GFLOP/s | vs dsyrk | vs NumPy X.T@X | fastls f32 GFLOP/s | vs ssyrk "
            "| f32->f64 GFLOP/s | f32->f64 / f64 |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n, d in shapes:
        X64 = random_matrix((n, d), np.float64)
        X32 = X64.astype(np.float32)
        G64 = np.zeros((d, d), order="F")
        G32 = np.zeros((d, d), np.float32, order="F")
        flops = gram_flops(n, d)
        for threads in THREADS:
            with fastls.limit_cores(threads):
                t = {
                    "f64": best_time(gram_fastls, X64, G64, repeat=repeat),
                    "dsyrk": best_time(gram_scipy, X64, G64, repeat=repeat),
                    "numpy": best_time(gram_numpy, X64, G64, repeat=repeat),
                    "f32": best_time(gram_fastls, X32, G32, repeat=repeat),
                    "ssyrk": best_time(gram_scipy, X32, G32, repeat=repeat),
                    "mixed": best_time(gram_fastls, X32, G64, repeat=repeat),
                }
            rate = {k: flops / v / 1e9 for k, v in t.items()}
            rows.append(
                f"| {n} x {d} | {threads} | {rate['f64']:.1f} | {t['dsyrk'] / t['f64']:.2f}x | "
                f"{t['numpy'] / t['f64']:.2f}x | {rate['f32']:.1f} | {t['ssyrk'] / t['f32']:.2f}x | "
                f"{rate['mixed']:.1f} | {t['f64'] / t['mixed']:.2f}x |"
            )
            print(rows[-1], flush=True)
        del X64, X32, G64, G32
    return rows


def conv_table(cases, repeat):
    rows = ["| case | dtype | streaming s | im2col+syrk s | speed-up | streaming peak MiB | im2col peak MiB |",
            "|---|---|---|---|---|---|---|"]
    for channels, side, batch in cases:
        for dtype in ("float32", "float64"):
            images, targets = conv_inputs(channels, side, batch, dtype)
            d = 9 * channels
            G = np.zeros((d, d), dtype=dtype, order="F")
            C = np.zeros((d, targets.shape[1]), dtype=dtype, order="F")
            t_stream = best_time(conv_streaming, images, targets, G, C, repeat=repeat)
            t_ref = best_time(conv_im2col, images, targets, G, C, repeat=repeat)
            m_stream = peak_bytes(conv_streaming, images, targets, G, C) / 2**20
            m_ref = peak_bytes(conv_im2col, images, targets, G, C) / 2**20
            rows.append(
                f"| 3x3, {channels} ch, {side}x{side}, B={batch} | {dtype} | {t_stream:.3f} | {t_ref:.3f} | "
                f"{t_ref / t_stream:.2f}x | {m_stream:.1f} | {m_ref:.1f} |"
            )
            print(rows[-1], flush=True)
    return rows


def solve_table(sizes, repeat):
    rows = ["| d | dtype | ridge_solve s | proximal_solve s | scipy.linalg.solve(assume_a='pos') s | ratio |",
            "|---|---|---|---|---|---|"]
    import scipy.linalg

    for d in sizes:
        for dtype in ("float32", "float64"):
            G, C, M = spd_system(d, dtype)
            t_ridge = best_time(fastls.ridge_solve, G, C, 100.0, repeat=repeat)
            t_prox = best_time(fastls.proximal_solve, G, C, 2500.0, M, repeat=repeat)
            t_ref = best_time(lambda: scipy.linalg.solve(G + 100.0 * np.eye(d, dtype=dtype), C, assume_a="pos"),
                              repeat=repeat)
            rows.append(f"| {d} | {dtype} | {t_ridge:.3f} | {t_prox:.3f} | {t_ref:.3f} | {t_ref / t_ridge:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smallest case of each table, one repeat")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    pick = (lambda cases: cases[:1]) if args.quick else (lambda cases: cases)
    libs = ", ".join(f"{b['internal_api']} {b['version']} ({b['num_threads']} threads, {b.get('architecture')})"
                     for b in fastls.blas_info())
    lines = [
        f"Machine: {platform.machine()}, {fastls.available_cores()} cores, Python {platform.python_version()}, "
        f"NumPy {np.__version__}; BLAS: {libs}",
        "",
        "### Gram update (G += X^T X)",
        *gram_table(pick(GRAM_SHAPES), repeat),
        "",
        "### Streaming convolution Gram vs im2col + syrk (scratch 64 MiB)",
        *conv_table(pick(CONV_CASES), repeat),
        "",
        "### Solves (m = 10 right-hand sides)",
        *solve_table(pick(SOLVE_SIZES), repeat),
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
