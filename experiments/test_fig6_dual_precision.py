"""The exact ridge reference of fig6_dual_precision.py."""

import numpy as np

from fig6_dual_classifier import relative_difference as relative
from fig6_dual_precision import exact_ridge


def _reference(features, y, n_classes, gamma):
    positions, channels, n = features.shape
    X = np.hstack([features.reshape(positions * channels, n).T.astype(np.float64), np.ones((n, 1))])
    Y = np.eye(n_classes)[y]
    return np.linalg.solve(X.T @ X + gamma * np.eye(X.shape[1]), X.T @ Y)


def test_exact_ridge_is_the_float64_ridge_solution_with_the_bias_last(monkeypatch):
    rng = np.random.default_rng(3)
    monkeypatch.setattr("fig6_dual_precision.EXACT_BLOCK_ROWS", 7)  # several row blocks, one partial
    features = rng.uniform(0.0, 2.0, (3, 4, 30)).astype(np.float32)  # (positions, channels, N), as written
    y = rng.integers(0, 5, 30)
    W = exact_ridge(features, y, 5, gamma=0.7)
    assert W.shape == (13, 5)
    assert relative(W, _reference(features, y, 5, 0.7)) <= 1e-12


def test_a_perturbation_of_one_float32_rounding_moves_the_solution_by_about_that_much():
    rng = np.random.default_rng(4)
    features = rng.uniform(0.0, 2.0, (2, 3, 40)).astype(np.float32)
    y = rng.integers(0, 4, 40)
    W = exact_ridge(features, y, 4, gamma=1.0)
    moved = relative(exact_ridge(features, y, 4, gamma=1.0, perturbation=2.0 ** -24), W)
    assert 1e-10 < moved < 1e-5
