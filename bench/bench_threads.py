"""pytest-benchmark grid of the size rule: each kernel at d x rows, under 1 or 2 threads or the rule's choice.

Timed, at full size:   python -m pytest bench/bench_threads.py --benchmark-enable --benchmark-group-by=param:kind
In the test suite (benchmarks disabled) the small grid runs once per setting
and checks the kernels' results against NumPy. The ratios of the chosen
setting to the best of 1 and 2 threads, timed in one process, are in the
report: experiments/threads_report.py (docs/results/threads.md).
"""

import numpy as np
import pytest

import fastls
from cases import THREAD_GRID, THREAD_KINDS, thread_case
from tests.numeric_checks import assert_close

# (BLAS threads allowed, size rule on): 1 thread, 2 threads as OpenBLAS picks, 2 allowed with the rule.
SETTINGS = {"one": (1, False), "two": (2, False), "chosen": (2, True)}


def pytest_generate_tests(metafunc):
    size = "full" if metafunc.config.getoption("benchmark_enable", False) else "small"
    grid = THREAD_GRID[size]
    cases = [(kind, d, rows) for kind in THREAD_KINDS for d in grid["d"]
             for rows in (grid["rows"] if kind != "solve" else grid["rows"][:1])]
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", cases, ids=[f"{size}-{k}-d{d}-n{n}" for k, d, n in cases])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_thread_setting(benchmark, case, dtype, setting):
    kind, d, rows = case
    call, _ = thread_case(kind, d, rows, dtype)
    cores, rule = SETTINGS[setting]
    previous = fastls.tuning.set_flops_per_thread(fastls.tuning.FLOPS_PER_THREAD if rule else 0)
    try:
        with fastls.limit_cores(cores):
            result = benchmark.pedantic(call, rounds=3, iterations=1, warmup_rounds=1)
    finally:
        fastls.tuning.set_flops_per_thread(previous)
    _check(kind, d, rows, dtype, result)


def _check(kind, d, rows, dtype, result):
    """The benchmarked call's result against a float64 NumPy reference built from the same inputs."""
    from cases import THREAD_COLUMNS, random_matrix, spd_system

    m = THREAD_COLUMNS
    if kind == "solve":
        G = np.triu(spd_system(d, dtype)[0].astype(np.float64))
        G = G + np.triu(G, 1).T + np.eye(d)
        C = random_matrix((d, m), dtype, 1).astype(np.float64)
        assert_close(result, np.linalg.solve(G, C), dtype, d, rtol=1e-3 if dtype == np.float32 else 1e-10)
        return
    X = random_matrix((rows, d), dtype, 0).astype(np.float64)
    if kind == "gram":
        assert_close(np.triu(result), np.triu(X.T @ X), dtype, rows)
    elif kind == "cross":
        assert_close(result, X.T @ random_matrix((rows, m), dtype, 1).astype(np.float64), dtype, rows)
    else:
        assert_close(result, X @ random_matrix((d, m), dtype, 1).astype(np.float64), dtype, d)
