"""pytest-benchmark suite for the fastls kernels.

Timed, at full size:   python -m pytest bench/bench_kernels.py --benchmark-enable --benchmark-group-by=group
In the test suite (benchmarks disabled) every case runs once at a small size
and checks its result against a float64 reference. The ratios the issues ask
for (fastls against SciPy's syrk, the overlap statistics against im2col +
gram_update, dual against primal) are in the report that times both sides
in one process: experiments/kernels_report.py.
"""

import numpy as np
import pytest

import fastls
from cases import (
    ACTIVATION_MAPS,
    CONV_LAYERS,
    FORWARD_CONVS,
    GCV_SIZES,
    GRAM_SHAPES,
    PROXIMAL_CASES,
    SOLVE_SIZES,
    conv_im2col_gram,
    conv_inputs,
    conv_stats,
    conv_zeros,
    forward_inputs,
    gcv_choice,
    gcv_problem,
    gram_fastls,
    gram_scipy,
    proximal_dual,
    proximal_primal,
    proximal_problem,
    random_matrix,
    spd_system,
    zero_stats,
)
from tests.numeric_checks import assert_close


# Arguments whose cases come from a table of cases.py: full size with
# --benchmark-enable, small size when the test suite runs the cases once.
CASE_TABLES = {"shape": GRAM_SHAPES, "layer": CONV_LAYERS, "problem": PROXIMAL_CASES, "d": SOLVE_SIZES,
               "maps": ACTIVATION_MAPS, "conv": FORWARD_CONVS, "gcv_d": GCV_SIZES}


def pytest_generate_tests(metafunc):
    size = "full" if metafunc.config.getoption("benchmark_enable", False) else "small"
    for name, table in CASE_TABLES.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, table[size], ids=lambda case: f"{size}-{case}")


def _run(benchmark, fn, *args, setup=None):
    """Time fn(*args) over 3 rounds; ``setup`` runs untimed before each round."""
    if setup is None:
        return benchmark.pedantic(fn, args=args, rounds=3, iterations=1, warmup_rounds=0)

    def untimed():
        setup()
        return args, {}

    return benchmark.pedantic(fn, setup=untimed, rounds=3, iterations=1, warmup_rounds=0)


@pytest.mark.parametrize("dtype,impl", [("float32", "fastls"), ("float32", "scipy-syrk"),
                                        ("float32", "fastls-float32-into-float64"),
                                        ("float64", "fastls"), ("float64", "scipy-syrk")])
def test_gram_update(benchmark, shape, dtype, impl):
    X = random_matrix(shape, dtype)
    G = np.zeros((shape[1], shape[1]), dtype=np.float64 if impl.endswith("float64") else dtype, order="F")
    benchmark.group = f"gram {shape[0]}x{shape[1]} {dtype}"
    result = _run(benchmark, gram_scipy if impl == "scipy-syrk" else gram_fastls, X, G)
    cols = slice(0, 64)
    X64 = X[:, cols].astype(np.float64)
    assert_close(np.triu(np.asarray(result)[cols, cols]), np.triu(X64.T @ X64), dtype, shape[0])


@pytest.mark.parametrize("impl", ["overlap", "im2col-streamed", "im2col+gram_update"])
def test_conv_statistics(benchmark, layer, impl):
    side, channels, batch = layer
    images, targets = conv_inputs(side, channels, batch)
    G, C = conv_zeros(channels)
    benchmark.group = f"conv3x3 {side}x{side}x{channels} B={batch}"
    # The kernel alone: G and C are zeroed before each round, untimed (the caller's memset).
    if impl == "im2col+gram_update":
        G, C = _run(benchmark, conv_im2col_gram, images, targets, G, C, setup=lambda: zero_stats(G, C))
    else:
        method = "overlap" if impl == "overlap" else "im2col"
        G, C = _run(benchmark, conv_stats, images, targets, G, C, method, setup=lambda: zero_stats(G, C))
    # Check the first two images against an explicit im2col in float64.
    P = fastls.im2col(images[:2].astype(np.float64), 3, append_ones=True)
    G2, C2 = conv_zeros(channels)
    conv_stats(images[:2], targets[:2], G2, C2, "overlap" if impl == "overlap" else "im2col")
    assert_close(np.triu(G2), np.triu(P.T @ P), np.float32, P.shape[0])


@pytest.mark.parametrize("method", ["winograd", "im2col"])
def test_conv_forward(benchmark, conv, method):
    """A 3x3 forward convolution of float32 maps: Winograd F(2x2, 3x3) against im2col + gemm."""
    side, channels, filters, images = conv
    x, W = forward_inputs(*conv)
    U = fastls.winograd_filters(W, channels) if method == "winograd" else None
    benchmark.group = f"conv forward {images}x{side}x{side}x{channels} -> {filters}"
    out = _run(benchmark, lambda: fastls.conv2d(x, W, 3, bias=True, method=method, filters=U))
    P = fastls.im2col(x.astype(np.float64), 3, append_ones=True)
    reference = (P @ W.astype(np.float64)).reshape(out.shape)
    assert_close(out, reference, np.float32, 16 * W.shape[0])


def _numpy_leaky_pool(x):
    """The forward epilogue as NumPy alone does it: masked multiply, then 2x2 strided slices."""
    np.multiply(x, np.float32(0.01), out=x, where=x < 0)
    out = x[:, 0::2, 0::2].copy()
    out += x[:, 0::2, 1::2]
    out += x[:, 1::2, 0::2]
    out += x[:, 1::2, 1::2]
    out /= 4
    return out


def _fastls_leaky_pool(x):
    return fastls.avg_pool2d(fastls.scale_negatives(x, 0.01), 2)


@pytest.mark.parametrize("impl", ["fastls", "numpy"])
def test_leaky_relu_and_pool(benchmark, maps, impl):
    """LeakyReLU + 2x2 average pool of a conv output, the elementwise part of a DCNN forward pass."""
    images, side, channels = maps
    original = random_matrix((images * side * side, channels), "float32").reshape(images, side, side, channels)
    benchmark.group = f"leaky relu + avgpool {images}x{side}x{side}x{channels}"
    fn = _fastls_leaky_pool if impl == "fastls" else _numpy_leaky_pool
    # Each round activates a fresh copy (the activation is in place), outside the timing.
    out = benchmark.pedantic(fn, setup=lambda: ((original.copy(),), {}), rounds=5, iterations=1)
    x64 = original.astype(np.float64)
    x64 = np.where(x64 < 0, 0.01 * x64, x64)
    expected = (x64[:, 0::2, 0::2] + x64[:, 0::2, 1::2] + x64[:, 1::2, 0::2] + x64[:, 1::2, 1::2]) / 4
    assert_close(out, expected, np.float32, 4)


@pytest.mark.parametrize("form", ["primal", "dual"])
def test_proximal_solve_forms(benchmark, problem, form):
    X, Z, M = proximal_problem(*problem)
    benchmark.group = f"proximal n={problem[0]} d={problem[1]}"
    W = _run(benchmark, proximal_dual if form == "dual" else proximal_primal, X, Z, M)
    other = proximal_primal(X, Z, M) if form == "dual" else proximal_dual(X, Z, M)
    assert_close(W, other, np.float32, problem[0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("solver", ["ridge_solve", "proximal_solve"])
def test_solve(benchmark, d, solver, dtype):
    G, C, M = spd_system(d, dtype)
    benchmark.group = f"solve d={d}"
    if solver == "ridge_solve":
        W = _run(benchmark, fastls.ridge_solve, G, C, 100.0)
        residual = fastls.symmetrize(G.astype(np.float64)) @ W + 100.0 * W - C
    else:
        W = _run(benchmark, fastls.proximal_solve, G, C, 2500.0, M)
        residual = fastls.symmetrize(G.astype(np.float64)) @ W + 2500.0 * (W - M) - C
    assert np.abs(residual).max() < (1e-2 if dtype == "float32" else 1e-8) * np.abs(C).max() * d


@pytest.mark.parametrize("method", ["band", "eigh"])
def test_gcv_choice(benchmark, gcv_d, method):
    """gamma by GCV plus its solve: G reduced to a band (gemm) against one eigendecomposition."""
    G, C, zz, n = gcv_problem(gcv_d)
    benchmark.group = f"gcv d={gcv_d}"
    gamma, W = _run(benchmark, gcv_choice, G, C, zz, n, method)
    assert_close(W, fastls.ridge_solve(G, C, gamma), np.float64, rtol=1e-9)
    if gcv_d <= 2048:  # the other route's choice, where it costs seconds at most
        assert gamma == pytest.approx(gcv_choice(G, C, zz, n, "eigh" if method == "band" else "band")[0], rel=1e-4)
