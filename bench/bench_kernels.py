"""pytest-benchmark suite for the fastls kernels.

Run:  python -m pytest bench/bench_kernels.py --benchmark-only --benchmark-group-by=group
In CI they run once each (--benchmark-disable) as correctness checks of the
benchmarked code paths; every case compares its result with the reference.
"""

import numpy as np
import pytest

import fastls
from cases import (
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

GRAM_IMPLS = {"fastls": gram_fastls, "scipy-syrk": gram_scipy, "numpy-XtX": gram_numpy}


@pytest.fixture(scope="module")
def gram_data():
    cache = {}

    def get(shape, dtype):
        key = (shape, np.dtype(dtype).name)
        if key not in cache:
            cache.clear()  # keep at most one large X alive
            cache[key] = random_matrix(shape, dtype)
        return cache[key]

    return get


def _rel_err(a, b):
    return np.abs(np.triu(a) - np.triu(b)).max() / np.abs(np.triu(b)).max()


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("path", ["float64", "float32", "float32->float64", "scipy-syrk-float64",
                                  "scipy-syrk-float32", "numpy-XtX-float64"])
@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gram_update(benchmark, gram_data, shape, path, threads):
    impl_name, _, x_dtype = path.rpartition("-") if path.startswith(("scipy", "numpy")) else ("fastls", "", path)
    x_dtype, g_dtype = (x_dtype.split("->") * 2)[:2] if "->" in x_dtype else (x_dtype, x_dtype)
    X = gram_data(shape, x_dtype)
    G = np.zeros((shape[1], shape[1]), dtype=g_dtype, order="F")
    impl = GRAM_IMPLS[impl_name]
    benchmark.group = f"gram {shape[0]}x{shape[1]} {threads} thread(s)"
    with fastls.limit_cores(threads):
        result = benchmark.pedantic(impl, args=(X, G), rounds=3, iterations=1, warmup_rounds=0)
    if benchmark.stats is not None:
        benchmark.extra_info["GFLOP/s"] = gram_flops(*shape) / benchmark.stats.stats.min / 1e9
    # Check against float64 on a slice of columns (a full float64 reference costs as much again).
    cols = slice(0, 64)
    ref = X[:, cols].astype(np.float64).T @ X[:, cols].astype(np.float64)
    assert _rel_err(np.asarray(result)[cols, cols], ref) < (1e-4 if "32" in x_dtype else 1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("impl", ["streaming", "im2col+syrk"])
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[0]}ch-{c[1]}px-B{c[2]}")
def test_conv_gram(benchmark, case, impl, dtype):
    channels, side, batch = case
    images, targets = conv_inputs(channels, side, batch, dtype)
    d = 9 * channels
    G = np.zeros((d, d), dtype=dtype, order="F")
    C = np.zeros((d, targets.shape[1]), dtype=dtype, order="F")
    fn = conv_streaming if impl == "streaming" else conv_im2col
    benchmark.group = f"conv3x3 {channels}ch {side}x{side} B={batch} {dtype}"
    G, C = benchmark.pedantic(fn, args=(images, targets, G, C), rounds=3, iterations=1)
    # Check on the first images against an explicit im2col.
    P = fastls.im2col(images[:2], 3, padding=1).astype(np.float64)
    G2 = np.zeros((d, d), dtype=dtype, order="F")
    C2 = np.zeros_like(C)
    fn(images[:2], targets[:2], G2, C2)
    assert _rel_err(G2, P.T @ P) < (1e-5 if dtype == "float32" else 1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("solver", ["ridge_solve", "proximal_solve"])
@pytest.mark.parametrize("d", SOLVE_SIZES)
def test_solve(benchmark, d, solver, dtype):
    G, C, M = spd_system(d, dtype)
    benchmark.group = f"solve d={d}"
    if solver == "ridge_solve":
        W = benchmark.pedantic(fastls.ridge_solve, args=(G, C, 100.0), rounds=3, iterations=1)
        residual = fastls.symmetrize(G.astype(np.float64)) @ W + 100.0 * W - C
    else:
        W = benchmark.pedantic(fastls.proximal_solve, args=(G, C, 2500.0, M), rounds=3, iterations=1)
        residual = fastls.symmetrize(G.astype(np.float64)) @ W + 2500.0 * (W - M) - C
    assert np.abs(residual).max() < (1e-2 if dtype == "float32" else 1e-8) * np.abs(C).max() * d
