"""Dtype-aware comparisons shared by the tests (a plain module: conftest names clash across test roots)."""

import numpy as np


def tolerance(dtype, n_terms=1):
    """Relative tolerance for sums of n_terms products in dtype."""
    eps = np.finfo(dtype).eps
    return float(50 * eps * max(1.0, np.sqrt(n_terms)))


def assert_close(actual, reference, dtype, n_terms=1):
    """max |actual - reference| <= tol * max |reference| (entry scale of the result)."""
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    assert actual.shape == reference.shape
    scale = max(np.abs(reference).max(initial=0.0), 1.0)
    err = np.abs(actual - reference).max(initial=0.0)
    tol = tolerance(dtype, n_terms)
    assert err <= tol * scale, f"max error {err:.3g} > {tol:.3g} * {scale:.3g}"


