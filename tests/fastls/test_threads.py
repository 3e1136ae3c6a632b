"""fastls.matmul against NumPy, and the size rule that picks BLAS threads within the caller's limit."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastls
from tests.numeric_checks import assert_close

DTYPES = [np.float32, np.float64]
ORDERS = ["C", "F"]


def blas_threads():
    return [lib["num_threads"] for lib in fastls.blas_info()]


@pytest.fixture
def rule():
    """Restore the size rule after a test that changes it."""
    previous = fastls.tuning.get_flops_per_thread()
    yield
    fastls.tuning.set_flops_per_thread(previous)


# ---------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_order", ORDERS)
@pytest.mark.parametrize("w_order", ORDERS)
@pytest.mark.parametrize("out_order", [None, "C", "F"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 3, 5), (300, 61, 128), (64, 785, 10)])
def test_matmul_matches_numpy(rng, dtype, x_order, w_order, out_order, shape):
    n, d, m = shape
    X = np.asarray(rng.standard_normal((n, d)), dtype=dtype, order=x_order)
    W = np.asarray(rng.standard_normal((d, m)), dtype=dtype, order=w_order)
    out = None if out_order is None else np.full((n, m), np.nan, dtype=dtype, order=out_order)
    result = fastls.matmul(X, W, out=out)
    assert result.dtype == dtype and result.shape == (n, m)
    if out is not None:
        assert result is out
    assert_close(result, X.astype(np.float64) @ W.astype(np.float64), dtype, d)


def test_matmul_takes_strided_inputs_and_empty_shapes(rng):
    X = rng.standard_normal((9, 10))[:, ::2]
    W = rng.standard_normal((10, 3))[::2]
    assert_close(fastls.matmul(X, W), X @ W, np.float64, 5)
    assert fastls.matmul(np.ones((0, 4)), np.ones((4, 3))).shape == (0, 3)
    np.testing.assert_array_equal(fastls.matmul(np.ones((2, 0)), np.ones((0, 3))), np.zeros((2, 3)))


@pytest.mark.parametrize("X,W,out,error,match", [
    (np.ones((3, 4)), np.ones((5, 2)), None, ValueError, r"W must have shape \(d, m\) with d = 4"),
    (np.ones((3, 4)), np.ones((4, 2), np.float32), None, TypeError, "X and W must share a dtype"),
    (np.ones((3, 4), np.int64), np.ones((4, 2)), None, TypeError, "X must have dtype float32 or float64"),
    (np.ones((3, 4)), np.ones((4, 2)), np.ones((2, 3)), ValueError, r"out must have shape \(3, 2\)"),
    (np.ones((3, 4)), np.ones((4, 2)), np.ones((3, 2), np.float32), ValueError, "dtype float64"),
    (np.ones(4), np.ones((4, 2)), None, ValueError, "X must be 2-dimensional"),
])
def test_matmul_rejects_bad_arguments(X, W, out, error, match):
    with pytest.raises(error, match=match):
        fastls.matmul(X, W, out=out)


@pytest.mark.parametrize("name", ["X", "W"])
def test_matmul_refuses_nan_and_leaves_out_untouched(rng, name):
    X, W = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    {"X": X, "W": W}[name][1, 2] = np.inf
    out = rng.standard_normal((5, 3))
    before = out.copy()
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
        fastls.matmul(X, W, out=out)
    np.testing.assert_array_equal(out, before)


def test_matmul_refuses_a_read_only_out():
    out = np.zeros((3, 2))
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        fastls.matmul(np.ones((3, 4)), np.ones((4, 2)), out=out)


# ---------------------------------------------------------------------------
# The size rule
# ---------------------------------------------------------------------------

def test_small_work_runs_one_thread_and_large_work_the_callers_limit(rule):
    fastls.tuning.set_flops_per_thread(1e6)
    with fastls.limit_cores(2):
        assert fastls.tuning.threads_for(1e3) == 1
        assert fastls.tuning.threads_for(1.9e6) == 1
        assert fastls.tuning.threads_for(2e6) == 2
        assert fastls.tuning.threads_for(1e12) == 2   # never more than the caller allows
    with fastls.limit_cores(1):
        assert fastls.tuning.threads_for(1e12) == 1
    fastls.tuning.set_flops_per_thread(0)             # rule off: the caller's limit whatever the size
    with fastls.limit_cores(2):
        assert fastls.tuning.threads_for(1.0) == 2


@settings(max_examples=60, deadline=None)
@given(flops=st.floats(0, 1e13), more=st.floats(0, 1e13), cores=st.integers(1, 4),
       per_thread=st.floats(1, 1e9))
def test_threads_stay_within_the_limit_and_grow_with_the_work(flops, more, cores, per_thread):
    previous = fastls.tuning.set_flops_per_thread(per_thread)
    try:
        with fastls.limit_cores(cores):
            few, many = fastls.tuning.threads_for(flops), fastls.tuning.threads_for(flops + more)
        assert 1 <= few <= many <= cores
    finally:
        fastls.tuning.set_flops_per_thread(previous)


def test_sized_threads_lowers_and_restores_the_blas_threads(rule):
    fastls.tuning.set_flops_per_thread(1e6)
    with fastls.limit_cores(2):
        with fastls.tuning.sized_threads(1e3):
            assert blas_threads() and all(n == 1 for n in blas_threads())
        assert all(n == 2 for n in blas_threads())
        with fastls.tuning.sized_threads(1e9):
            assert all(n == 2 for n in blas_threads())
        with pytest.raises(RuntimeError, match="inside"):
            with fastls.tuning.sized_threads(1e3):
                raise RuntimeError("inside")
        assert all(n == 2 for n in blas_threads())


@pytest.mark.parametrize("per_thread", [1e4, 1e12])
def test_kernels_give_the_same_numbers_whatever_the_thread_count(rng, rule, per_thread):
    # 1e4 flops per thread: every kernel below runs 2 threads; 1e12: every one runs 1.
    fastls.tuning.set_flops_per_thread(per_thread)
    X, Z = rng.standard_normal((2000, 129)), rng.standard_normal((2000, 10))
    with fastls.limit_cores(2):
        G = fastls.gram_update(np.zeros((129, 129)), X)
        C = fastls.cross_update(np.zeros((129, 10)), X, Z)
        W = fastls.ridge_solve(G, C, 1.0)
        P = fastls.matmul(X, W)
    Gs = fastls.symmetrize(G)
    assert_close(Gs, X.T @ X, np.float64, 2000)
    assert_close(C, X.T @ Z, np.float64, 2000)
    assert_close(P, X @ np.linalg.solve(X.T @ X + np.eye(129), X.T @ Z), np.float64, rtol=1e-9)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "many"])
def test_set_flops_per_thread_rejects_bad_values(rule, bad):
    with pytest.raises(ValueError, match="flops must be a finite number >= 0"):
        fastls.tuning.set_flops_per_thread(bad)


@pytest.mark.parametrize("value,expected", [("123", "123.0"), ("0", "0.0")])
def test_environment_sets_the_rule(value, expected):
    env = {**os.environ, "FASTLS_FLOPS_PER_THREAD": value}
    out = subprocess.run([sys.executable, "-c", "import fastls; print(fastls.tuning.get_flops_per_thread())"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_environment_with_a_bad_value_is_named():
    env = {**os.environ, "FASTLS_FLOPS_PER_THREAD": "fast"}
    out = subprocess.run([sys.executable, "-c", "import fastls"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode != 0
    assert "FASTLS_FLOPS_PER_THREAD must be a finite number >= 0" in out.stderr
    assert "'fast'" in out.stderr


@pytest.fixture
def gram_threads(rule, monkeypatch):
    """The BLAS thread count of every Gram product, in call order, under the 1e4 rule."""
    from fastls import _kernels

    fastls.tuning.set_flops_per_thread(1e4)
    seen = []
    gram_same = _kernels.gram_same

    def recording(*args):
        seen.append(_kernels.blas_threads())
        return gram_same(*args)

    monkeypatch.setattr(_kernels, "gram_same", recording)
    return seen


class _FakeClock:
    """perf_counter for fastls._products: each Gram advances it by a time set per thread count."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def timed_narrow_grams(gram_threads, monkeypatch):
    """(gram_threads' record, seconds per call by thread count, to fill) on a fake clock, thread trials fresh."""
    from fastls import _kernels, _products

    fastls.tuning.reset_thread_trials()
    clock, seconds = _FakeClock(), {}
    monkeypatch.setattr(_products, "time", clock)
    recording = _kernels.gram_same

    def timed(*args):
        clock.now += seconds[_kernels.blas_threads()]
        return recording(*args)

    monkeypatch.setattr(_kernels, "gram_same", timed)
    yield gram_threads, seconds
    fastls.tuning.reset_thread_trials()


@pytest.mark.parametrize("one, two, faster", [(1.0, 1.5, 1), (1.5, 1.0, 2), (1.03, 1.0, 1)],
                         ids=["one-thread-faster", "two-threads-faster", "near-tie-keeps-one"])
def test_narrow_grams_time_both_thread_counts_then_keep_the_faster(rng, timed_narrow_grams, one, two, faster):
    from fastls import _products

    seen, seconds = timed_narrow_grams
    seconds.update({1: one, 2: two})
    d = 64
    rows = 4096
    assert d < _products.GRAM_MIN_THREADED_D and rows * d * d >= _products.GRAM_MIN_THREADED_FLOPS
    X = rng.standard_normal((rows, d))
    G = np.zeros((d, d))
    with fastls.limit_cores(2):
        for _ in range(10):
            fastls.gram_update(G, X, check_finite=False)
    block = fastls._threads.narrow_gram_trials.trials + 1
    assert seen == [1] * block + [2] * block + [faster] * (10 - 2 * block)
    assert fastls.tuning.thread_trials() == {("d", d, rows.bit_length(), 2): faster}
    assert_close(np.triu(G), 10 * np.triu(X.T @ X), np.float64, n_terms=10 * rows)
    # Another kind (rows of another power of two, or another dtype) is timed afresh.
    seen.clear()
    with fastls.limit_cores(2):
        fastls.gram_update(G, X[:rows // 2], check_finite=False)
        fastls.gram_update(np.zeros((d, d), dtype=np.float32), X.astype(np.float32), check_finite=False)
    assert seen == [1, 1]


def test_narrow_grams_are_not_timed_without_a_choice(rng, timed_narrow_grams):
    seen, seconds = timed_narrow_grams
    seconds.update({1: 1.0, 2: 1.0})
    X = rng.standard_normal((4096, 64))
    with fastls.limit_cores(1):  # one thread allowed: nothing to choose
        fastls.gram_update(np.zeros((64, 64)), X, check_finite=False)
    fastls.tuning.set_flops_per_thread(0)  # the rule off: the caller's limit, untimed
    with fastls.limit_cores(2):
        fastls.gram_update(np.zeros((64, 64)), X, check_finite=False)
    assert seen == [1, 2]
    assert fastls.tuning.thread_trials() == {}


def test_grams_below_the_work_floor_run_one_blas_thread(rng, gram_threads):
    from fastls import _products

    seen = gram_threads
    d = 129
    # Rows that put the work just below and just above GRAM_MIN_THREADED_FLOPS.
    below = int(_products.GRAM_MIN_THREADED_FLOPS // (d * d))
    X = rng.standard_normal((below + 2, d))
    with fastls.limit_cores(2):
        fastls.gram_update(np.zeros((d, d)), X[:below], check_finite=False)
        fastls.gram_update(np.zeros((d, d)), X, check_finite=False)
    assert below * d * d < _products.GRAM_MIN_THREADED_FLOPS <= X.shape[0] * d * d
    assert seen == [1, 2]


def test_thread_trials_planned_at_once_from_several_threads_do_not_fail():
    """Eight calls planned before any was recorded all take untimed slots: no decision on empty timings."""
    from fastls._threads import ThreadTrials

    trials = ThreadTrials()
    key = ("f", 8, 10)
    planned = [trials.plan(key, 1e12) for _ in range(8)]
    for _, trial in planned:
        if trial is not None:
            trials.record(trial, 1.0, 1e12)
    for _ in range(4 * 4 + 8):  # then calls one after the other learn the kind as usual
        _, trial = trials.plan(key, 1e12)
        if trial is None:
            break
        trials.record(trial, 1.0 if trial[1] else 2.0, 1e12)
    if fastls.tuning.threads_for(1e12) > 1:  # a machine of one core never times this kind
        assert trials.choices() == {(*key, fastls.tuning.threads_for(1e12)): fastls.tuning.threads_for(1e12)}
