"""Time the fastls kernels against their references in one process; print a markdown report.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/kernels_report.py [--repeat 3] [--out FILE]
        [--only-targets | --only-gcv [--gcv-wide]]

Every ratio compares two implementations timed in the same process, on the
same data, interleaved, best of ``--repeat``; 2 BLAS threads unless stated.
GFLOP/s count N d^2 for a Gram (N patch rows for a convolution), whichever
method computed it.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import scipy.linalg

import fastls

# The report times the cases of the pytest-benchmark files, which live in bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from cases import (  # noqa: E402
    CONV_LAYERS,
    FORWARD_CONVS,
    GCV_SIZES,
    GRAM_SHAPES,
    PROXIMAL_CASES,
    SOLVE_SIZES,
    conv_flops,
    conv_im2col_gram,
    conv_inputs,
    conv_stats,
    conv_zeros,
    forward_flops,
    forward_inputs,
    gcv_choice,
    gcv_problem,
    gram_fastls,
    gram_flops,
    gram_scipy,
    proximal_dual,
    proximal_primal,
    proximal_problem,
    random_matrix,
    spd_system,
    zero_stats,
)
from dev_layout import emit_report  # noqa: E402
from fig6_cifar import gemm_rate  # noqa: E402


def best_times(functions, repeat, setup=None):
    """Best time of each function, the functions interleaved round by round (drifts hit all alike).

    ``setup`` runs untimed before every call.
    """
    best = {name: float("inf") for name in functions}
    for _ in range(repeat):
        for name, fn in functions.items():
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def gram_table(repeat):
    rows = ["| N x d | f64 GFLOP/s | vs dsyrk | f32 GFLOP/s | vs ssyrk | f32->f64 GFLOP/s | f32->f64 / f64 | "
            "C-ordered G: f32->f64 / f64 |",
            "|---|---|---|---|---|---|---|---|"]
    for n, d in GRAM_SHAPES["full"]:
        X64 = random_matrix((n, d), np.float64)
        X32 = X64.astype(np.float32)
        G64, G32, Gm = (np.zeros((d, d), dtype, order="F") for dtype in (np.float64, np.float32, np.float64))
        # fedlayer's accumulators are C-ordered; SciPy's syrk writes a Fortran one.
        G64c, Gmc = np.zeros((d, d)), np.zeros((d, d))
        t = best_times({
            "f64": lambda: gram_fastls(X64, G64), "dsyrk": lambda: gram_scipy(X64, G64),
            "f32": lambda: gram_fastls(X32, G32), "ssyrk": lambda: gram_scipy(X32, G32),
            "mixed": lambda: gram_fastls(X32, Gm),
            "f64 C": lambda: gram_fastls(X64, G64c), "mixed C": lambda: gram_fastls(X32, Gmc),
        }, repeat)
        rate = {k: gram_flops(n, d) / v / 1e9 for k, v in t.items()}
        rows.append(f"| {n} x {d} | {rate['f64']:.1f} | {t['dsyrk'] / t['f64']:.2f}x | {rate['f32']:.1f} | "
                    f"{t['ssyrk'] / t['f32']:.2f}x | {rate['mixed']:.1f} | {t['f64'] / t['mixed']:.2f}x | "
                    f"{t['f64 C'] / t['mixed C']:.2f}x |")
    return rows


def conv_table(repeat):
    rows = ["| map (side x side x channels), images | d | auto picks | overlap s | im2col streamed s | "
            "im2col + gram_update s | overlap speed-up | auto speed-up | overlap GFLOP/s (N d^2) | "
            "zeroing G s | overlap speed-up with the zeroing on both sides |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    rates = {}
    for side, channels, batch in CONV_LAYERS["full"]:
        images, targets = conv_inputs(side, channels, batch)
        G, C = conv_zeros(channels)
        functions = {"auto": lambda: conv_stats(images, targets, G, C, "auto"),
                     "overlap": lambda: conv_stats(images, targets, G, C, "overlap"),
                     "im2col": lambda: conv_stats(images, targets, G, C, "im2col"),
                     "im2col+gram": lambda: conv_im2col_gram(images, targets, G, C)}
        t = best_times(functions, repeat, setup=lambda: zero_stats(G, C))
        zeroing = best_times({"zero": lambda: zero_stats(G, C)}, repeat)["zero"]
        rate = conv_flops(side, channels, batch) / t["overlap"] / 1e9
        # The same time against the multiply-adds the overlap performs (2 flops each).
        performed = 2 * fastls.tuning.conv_stats_cost((side, side, channels), 3)[1] * batch / t["overlap"] / 1e9
        rates[(side, channels, batch)] = rate, performed
        rows.append(
            f"| {side}x{side}x{channels}, {batch} | {9 * channels + 1} | "
            f"{fastls.tuning.conv_stats_method((side, side, channels), 3, images=batch)} | {t['overlap']:.2f} | "
            f"{t['im2col']:.2f} | {t['im2col+gram']:.2f} | {t['im2col+gram'] / t['overlap']:.2f}x | "
            f"{t['im2col+gram'] / t['auto']:.2f}x | {rate:.0f} | {zeroing:.2f} | "
            f"{(t['im2col+gram'] + zeroing) / (t['overlap'] + zeroing):.2f}x |")
    return rows, rates


def forward_table(repeat):
    rows = ["| map, filters, images | im2col + gemm s | Winograd s | Winograd speed-up | "
            "im2col GFLOP/s | Winograd GFLOP/s (im2col's count) |", "|---|---|---|---|---|---|"]
    for side, channels, filters, images in FORWARD_CONVS["full"]:
        x, W = forward_inputs(side, channels, filters, images)
        U = fastls.winograd_filters(W, channels)  # kept across calls, as fedlayer keeps it per weights
        t = best_times({"im2col": lambda: fastls.conv2d(x, W, 3, bias=True, method="im2col"),
                        "winograd": lambda: fastls.conv2d(x, W, 3, bias=True, method="winograd", filters=U)},
                       repeat)
        flops = forward_flops(side, channels, filters, images)
        rows.append(f"| {side}x{side}x{channels}, {filters}, {images} | {t['im2col']:.3f} | {t['winograd']:.3f} | "
                    f"{t['im2col'] / t['winograd']:.2f}x | {flops / t['im2col'] / 1e9:.0f} | "
                    f"{flops / t['winograd'] / 1e9:.0f} |")
    return rows


def proximal_table(repeat):
    rows = ["| n x d, m | primal s | dual s | dual speed-up | cost model picks |", "|---|---|---|---|---|"]
    for n, d, m in PROXIMAL_CASES["full"]:
        X, Z, M = proximal_problem(n, d, m)
        t = best_times({"primal": lambda: proximal_primal(X, Z, M), "dual": lambda: proximal_dual(X, Z, M)}, repeat)
        costs = fastls.proximal_cost(n, d, m)
        rows.append(f"| {n} x {d}, {m} | {t['primal']:.2f} | {t['dual']:.3f} | {t['primal'] / t['dual']:.0f}x | "
                    f"{min(costs, key=costs.get)} |")
    return rows


def solve_table(repeat):
    rows = ["| d | dtype | ridge_solve s | scipy.linalg.solve(assume_a='pos') s | ratio |", "|---|---|---|---|---|"]
    for d in SOLVE_SIZES["full"]:
        for dtype in (np.float32, np.float64):
            G, C, _ = spd_system(d, dtype)
            full = fastls.symmetrize(G) + 100.0 * np.eye(d, dtype=dtype)
            t = best_times({"fastls": lambda: fastls.ridge_solve(G, C, 100.0),
                            "scipy": lambda: scipy.linalg.solve(full, C, assume_a="pos")}, repeat)
            rows.append(f"| {d} | {np.dtype(dtype).name} | {t['fastls']:.3f} | {t['scipy']:.3f} | "
                        f"{t['scipy'] / t['fastls']:.2f}x |")
    return rows


def gcv_table(sizes):
    """Server's GCV choice of gamma plus its solve, band route against eigh; one run each (eigh takes minutes)."""
    rows = ["| d | eigh s | band s | band speed-up | gamma, eigh | gamma, band | band reduction GFLOP/s (4/3 d^3) |",
            "|---|---|---|---|---|---|---|"]
    for d in sizes:
        G, C, zz, n = gcv_problem(d)
        t, chosen = {}, {}
        for method in ("band", "eigh"):
            start = time.perf_counter()
            chosen[method] = gcv_choice(G, C, zz, n, method)[0]
            t[method] = time.perf_counter() - start
        start = time.perf_counter()
        fastls.RidgePath.from_statistics(G.copy(), C, zz, n, method="band", overwrite_g=True)
        reduction = time.perf_counter() - start
        rows.append(f"| {d} | {t['eigh']:.2f} | {t['band']:.2f} | {t['eigh'] / t['band']:.1f}x | "
                    f"{chosen['eigh']:.6g} | {chosen['band']:.6g} | {4 / 3 * d ** 3 / reduction / 1e9:.0f} |")
    return rows


def gcv_section(wide):
    sizes = GCV_SIZES["full"] + ([18433] if wide else [])
    return ["", "### GCV choice of gamma from summed statistics (`RidgePath.from_statistics`, then select "
            "and solve): G reduced to a band of 64 against one eigendecomposition; one run each", ""] + gcv_table(sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--gcv-wide", action="store_true",
                        help="add d = 18433 to the GCV table (its eigendecomposition alone takes about 11 min)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--only-gcv", action="store_true", help="only the GCV table")
    only.add_argument("--only-targets", action="store_true",
                      help="only the tables issue 9's targets read: the Gram update and the convolution statistics")
    args = parser.parse_args()
    blas = ", ".join(f"{i['internal_api']} {i['version']} ({i['num_threads']} threads, {i['architecture']})"
                     for i in fastls.blas_info())
    lines = [f"Machine: {platform.machine()}, {fastls.available_cores()} cores, Python {platform.python_version()}, "
             f"NumPy {np.__version__}; BLAS: {blas}; float32 gemm (4096^3) at the start: "
             f"{gemm_rate() / 1e9:.0f} GFLOP/s", ""]
    if args.only_gcv:
        emit_report(lines + gcv_section(args.gcv_wide), args.out)
        return 0
    lines += ["### Gram update (G += X^T X), fastls with its finiteness check against SciPy's syrk", ""]
    lines += gram_table(args.repeat)
    conv_rows, rates = conv_table(args.repeat)
    lines += ["", "### Convolution statistics, float32 maps into float64 G and C (3x3 valid, bias column, "
              "10 targets)", "",
              "Each call adds into G and C zeroed beforehand, untimed (the caller's memset, which a run "
              "pays once per layer and client whichever method it uses); the last column adds that "
              "zeroing back to both sides.", ""] + conv_rows
    wide = max(rates, key=lambda case: (case[1], case[2]))
    wide_nd2, wide_done = rates[wide]
    for base in sorted(case for case in rates if case[:2] == (14, 512)):
        base_nd2, base_done = rates[base]
        lines += ["", f"Rate at d = 18433 ({wide[2]} images) against d = 4609 ({base[2]} images): "
                  f"{wide_nd2 / base_nd2:.2f}x with N d^2 counted for both (im2col's work; the overlap saves "
                  f"less of it on the 4x4 map), {wide_done / base_done:.2f}x in the multiply-adds the overlap "
                  f"performs ({wide_done:.0f} against {base_done:.0f} GFLOP/s)."]
    if args.only_targets:
        emit_report(lines, args.out)
        return 0
    lines += ["", "### Forward 3x3 convolutions, float32 (bias row; the images of one 16 MiB forward step)", ""]
    lines += forward_table(args.repeat)
    lines += ["", "### Proximal solve: primal (G, then Cholesky of d x d) against dual (Cholesky of n x n)", ""]
    lines += proximal_table(args.repeat)
    lines += ["", "### Ridge solve", ""] + solve_table(args.repeat)
    lines += gcv_section(args.gcv_wide)
    emit_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
