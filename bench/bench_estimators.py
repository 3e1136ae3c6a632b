"""pytest-benchmark suite for fastls.StreamingRidge against scikit-learn's Ridge(solver='cholesky').

Timed:   python -m pytest bench/bench_estimators.py --benchmark-enable --benchmark-group-by=group
In the test suite (benchmarks disabled) every case runs once at a small size and checks its
coefficients against Ridge's. The issue's ratios (fit against Ridge on 1,000,000 x 785 float32 rows,
partial_fit over 100 batches against one fit, peak extra memory) are measured in one process by
bench/estimators_report.py.
"""

import numpy as np
import pytest
from sklearn.linear_model import Ridge

import fastls
from estimators_report import ALPHA, regression_rows, streamed_fit
from tests.numeric_checks import assert_close

# (rows, features, targets): the MNIST DNN's input layer width (784 pixels + bias) with 10 classes;
# 200,000 rows keep three timed rounds of each side within a minute or two.
ROWS = {"full": [(200_000, 785, 10)], "small": [(3000, 65, 3)]}
BATCHES = 100


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        size = "full" if metafunc.config.getoption("benchmark_enable", False) else "small"
        metafunc.parametrize("case", ROWS[size], ids=lambda case: f"{size}-{case[0]}x{case[1]}x{case[2]}")


@pytest.fixture(scope="module")
def data(request):
    cache = {}

    def rows(case):
        if case not in cache:
            cache[case] = regression_rows(*case)
        return cache[case]

    return rows


@pytest.fixture(scope="module")
def reference(data):
    """Ridge's coefficients of each case, float64 (the check of every implementation)."""
    cache = {}

    def coef(case):
        if case not in cache:
            X, y = data(case)
            cache[case] = Ridge(alpha=ALPHA, solver="cholesky").fit(X.astype(np.float64), y).coef_
        return cache[case]

    return coef


IMPLEMENTATIONS = {
    "fastls-fit": lambda X, y: fastls.StreamingRidge(alpha=ALPHA).fit(X, y),
    f"fastls-partial_fit-x{BATCHES}": lambda X, y: streamed_fit(X, y, BATCHES),
    "sklearn-Ridge-cholesky": lambda X, y: Ridge(alpha=ALPHA, solver="cholesky").fit(X, y),
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_ridge_fit(benchmark, data, reference, case, impl):
    X, y = data(case)
    benchmark.group = f"ridge fit {case[0]}x{case[1]} float32, {case[2]} targets"
    model = benchmark.pedantic(IMPLEMENTATIONS[impl], args=(X, y), rounds=3, iterations=1, warmup_rounds=0)
    # float32 data: the products are float32 over blocks of rows (fastls) or all rows (Ridge).
    assert_close(model.coef_, reference(case), np.float32, n_terms=case[0])
