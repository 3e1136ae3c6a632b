"""The one dtype-aware closeness helper of the tests, benchmarks and experiments.

A plain module, not a conftest: conftest names clash across test roots.
``tests`` is a package and pytest puts the checkout's root (the root
``conftest.py``'s folder) on the path, so ``bench/`` and ``experiments/``
import it as ``from tests.numeric_checks import assert_close``.
"""

import numpy as np


def tolerance(dtype, n_terms=1):
    """Relative tolerance for sums of n_terms products in dtype."""
    eps = np.finfo(dtype).eps
    return float(50 * eps * max(1.0, np.sqrt(n_terms)))


def assert_close(actual, reference, dtype, n_terms=1, rtol=None):
    """max |actual - reference| <= tol * max(max |reference|, 1) (entry scale of the result).

    Parameters
    ----------
    actual, reference : array-like of the same shape
    dtype : the dtype the result was computed in
        Sets ``tol = tolerance(dtype, n_terms)``.
    n_terms : int
        Products summed per entry (rounding grows with its square root).
    rtol : float or None
        An explicit tolerance instead, for results whose error also grows
        with a conditioning (solves compared across summation orders).
    """
    actual = np.asarray(actual, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    assert actual.shape == reference.shape, f"shape {actual.shape} != {reference.shape}"
    scale = max(np.abs(reference).max(initial=0.0), 1.0)
    err = np.abs(actual - reference).max(initial=0.0)
    tol = tolerance(dtype, n_terms) if rtol is None else rtol
    assert err <= tol * scale, f"max error {err:.3g} > {tol:.3g} * {scale:.3g}"
