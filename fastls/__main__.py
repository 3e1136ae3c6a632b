"""Demonstrate the kernels: a ridge regression through streamed Gram blocks.

    python -m fastls [--n 60000] [--d 785] [--threads 2]
"""

import argparse
import time

import numpy as np

import fastls


def _speed_phrase(reference_s, fastls_s):
    """How the reference compares with fastls, in words that stay true either way."""
    if reference_s >= fastls_s:
        return f"{reference_s / fastls_s:.1f}x the time of fastls"
    return f"{fastls_s / reference_s:.1f}x faster than fastls here"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m fastls", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60000, help="samples (rows of X)")
    parser.add_argument("--d", type=int, default=785, help="features (columns of X)")
    parser.add_argument("--m", type=int, default=10, help="targets (columns of Z)")
    parser.add_argument("--gamma", type=float, default=100.0)
    parser.add_argument("--threads", type=int, default=fastls.available_cores())
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    X = rng.standard_normal((args.n, args.d)).astype(np.float32)
    W_true = rng.standard_normal((args.d, args.m))
    Z = (X @ W_true + 0.1 * rng.standard_normal((args.n, args.m))).astype(np.float32)
    G = np.zeros((args.d, args.d))
    C = np.zeros((args.d, args.m))
    with fastls.limit_cores(args.threads):
        # One small call of each kernel first: the first call of a process pays for loading LAPACK's and the
        # thread pool's code (about 1 s for the first Cholesky here), which is not the kernels' speed.
        fastls.ridge_solve(np.eye(args.d), np.ones((args.d, args.m)), args.gamma)
        np.linalg.solve(np.eye(args.d) + args.gamma * np.eye(args.d), np.ones((args.d, args.m)))
        start = time.perf_counter()
        for block in range(0, args.n, 10000):  # as clients would, one batch at a time
            fastls.gram_update(G, X[block:block + 10000])
            fastls.cross_update(C, X[block:block + 10000], Z[block:block + 10000])
        t_acc = time.perf_counter() - start
        start = time.perf_counter()
        W = fastls.ridge_solve(G, C, args.gamma)
        t_solve = time.perf_counter() - start
        start = time.perf_counter()
        X64 = X.astype(np.float64)
        W_ref = np.linalg.solve(X64.T @ X64 + args.gamma * np.eye(args.d), X64.T @ Z.astype(np.float64))
        t_ref = time.perf_counter() - start
    rel = np.abs(W - W_ref).max() / np.abs(W_ref).max()
    print(f"ridge regression: X {args.n} x {args.d} float32 accumulated into float64, {args.m} targets, "
          f"gamma={args.gamma:g}, {args.threads} thread(s)")
    print(f"  gram_update + cross_update: {t_acc:.3f} s ({args.n * args.d ** 2 / t_acc / 1e9:.1f} GFLOP/s)")
    print(f"  ridge_solve (Cholesky):     {t_solve:.3f} s")
    print(f"  NumPy float64 reference:    {t_ref:.3f} s  ({_speed_phrase(t_ref, t_acc + t_solve)})")
    print(f"  max relative difference to the reference: {rel:.2e}")
    print(f"  weights recovered: max |W - W_true| = {np.abs(W - W_true).max():.3f}")


if __name__ == "__main__":
    main()
