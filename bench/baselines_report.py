"""Time one round of each baseline on both engines, against the flop floor at the gemm rate of the same run.

    python bench/baselines_report.py [--algorithms pfedme pfedzo] [--subset 10] [--rounds 3]

MNIST-DNN, the paper's setting (bench/baseline_cases.py): 100 clients of the
MNIST partition's sizes, the default hyperparameters, 2 cores. The batched
engine runs whole rounds (median of ``--rounds``). The per-client engine
runs ``--subset`` clients spread over the size order (every 10th) and is
scaled to 100 by the ratio of the round's flops: its rounds take minutes
(pFedZO's about 8), and its per-client work is proportional to those flops.
The floor is the round's flops (model products only) at the rate of one
2,000 x 2,000 dgemm on SciPy's BLAS, measured first, on all cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from scipy.linalg import blas

import fastls

sys.path.insert(0, str(Path(__file__).parent))
from baseline_cases import (  # noqa: E402
    ALGORITHMS, client_sizes, draws, hyper_of, make_clients, round_flops, round_runner)


def gemm_rate(n=2000, repeats=3):
    a, b = np.random.default_rng(0).random((2, n, n))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        blas.dgemm(1.0, a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def timed(run, rounds):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    parser.add_argument("--subset", type=int, default=10, help="clients the per-client engine runs (scaled to all)")
    parser.add_argument("--rounds", type=int, default=3, help="batched rounds per algorithm (median)")
    parser.add_argument("--cores", type=int, default=fastls.available_cores())
    parser.add_argument("--out", default=None, help="also write the table, with the command, to this markdown file")
    args = parser.parse_args(argv)

    rate = gemm_rate()
    sizes = client_sizes()
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    subset = [sizes[i] for i in order[::max(1, len(sizes) // args.subset)]][:args.subset]
    print(f"dgemm 2000^3 on {args.cores} cores: {rate / 1e9:.1f} GFLOP/s; {len(sizes)} clients, {sum(sizes)} rows; "
          f"per-client engine on {len(subset)} of them ({sum(subset)} rows)", flush=True)
    lines = ["| algorithm | per-client s / round | batched s / round | speed-up | GFLOP / round | floor s | "
             "batched / floor | draws / round |", "|---|---|---|---|---|---|---|---|"]
    for algorithm in args.algorithms:
        hyper = hyper_of(algorithm)
        flops = round_flops(algorithm, sizes, hyper=hyper)
        scale = flops / round_flops(algorithm, subset, hyper=hyper)
        per_client = timed(round_runner(make_clients(subset, cores=args.cores), algorithm, "per-client", hyper,
                                        args.cores), 1) * scale
        batched = timed(round_runner(make_clients(sizes, cores=args.cores), algorithm, "batched", hyper, args.cores),
                        args.rounds)
        floor = flops / rate
        lines.append(f"| {algorithm} | {per_client:.2f} | {batched:.2f} | {per_client / batched:.1f}x | "
                     f"{flops / 1e9:.0f} | {floor:.2f} | {batched / floor:.1f}x | {draws(algorithm, sizes):.2e} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out:
        command = "python bench/baselines_report.py " + " ".join(sys.argv[1:] if argv is None else argv)
        header = (f"# Baseline rounds on MNIST-DNN: per-client and batched engines\n\nCommand: `{command.strip()}`. "
                  f"dgemm 2000^3 on {args.cores} cores: {rate / 1e9:.1f} GFLOP/s (the floor's rate); {len(sizes)} "
                  f"clients, {sum(sizes)} rows; the per-client engine ran {len(subset)} of them, scaled by flops.\n\n")
        Path(args.out).write_text(header + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
