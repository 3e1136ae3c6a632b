"""The dual route to the 'same' DCNN's classifier, on small shapes (no data needed)."""

import numpy as np
import pytest

import fastls
from fig6_dual_classifier import exact_model, solve_dual, write_features
from fig6_padding import pool_before_classifier
from test_fig6_padding import _Config, _Dataset, _build


def _trained_convolutions(model, rng):
    for index in model.trainable[:-1]:
        shape = model.layers[index].ls_shape(model.input_shape_of(index))
        model.layers[index].set_weights(rng.standard_normal(shape) / np.sqrt(shape[0]))
    return model


def test_features_keep_the_order_the_classifier_reads(tmp_path):
    rng = np.random.default_rng(0)
    model = _trained_convolutions(_build(_Config, _Dataset), rng)
    x = rng.random((5, 32, 32, 3), dtype=np.float32)
    classifier = model.trainable[-1]
    features = write_features(model, classifier - 1, x, tmp_path / "f.npy")
    assert features.shape == (8 * 8, 32, 5)
    rows = model.layers[classifier].ls_rows(model.forward(x, stop=classifier))
    np.testing.assert_array_equal(features.transpose(2, 0, 1).reshape(5, -1), rows[:, :-1])


def test_exact_model_takes_the_pooled_runs_convolutions_and_reads_every_position():
    rng = np.random.default_rng(1)
    pooled = _trained_convolutions(pool_before_classifier(_build, 2)(_Config, _Dataset), rng)
    model, conv_stop = exact_model(pooled, _Config.width, 10)
    for i, j in zip(model.trainable[:-1], pooled.trainable[:-1]):
        np.testing.assert_array_equal(model.layers[i].weights, pooled.layers[j].weights)
    assert model.input_shape_of(conv_stop) == (8, 8, 32)
    classifier = model.trainable[-1]
    assert model.layers[classifier].ls_shape(model.input_shape_of(classifier)) == (8 * 8 * 32 + 1, 10)


# float32 features accumulate K through float32 tiles (as the run's G): the
# float32 rounding of X X^T, amplified by the conditioning of K + gamma I.
TOLERANCE = {np.float64: 1e-8, np.float32: 2e-3}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("positions, channels, n", [(4, 6, 9), (2, 5, 40)])
def test_dual_solve_equals_the_primal_ridge_solve(positions, channels, n, dtype):
    rng = np.random.default_rng(positions * 100 + n)
    features = rng.standard_normal((positions, channels, n)).astype(dtype)
    y = rng.integers(0, 3, n)
    gamma = 0.7
    W, train_predictions, _ = solve_dual(features, y, 3, gamma)
    X = np.hstack([features.transpose(2, 0, 1).reshape(n, -1).astype(np.float64), np.ones((n, 1))])
    Y = np.eye(3)[y]
    W_primal = np.linalg.solve(X.T @ X + gamma * np.eye(X.shape[1]), X.T @ Y)
    np.testing.assert_allclose(W, W_primal, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype] * 1e-2 * np.abs(W_primal).max())
    np.testing.assert_array_equal(train_predictions, (X @ W_primal).argmax(axis=1))
    # fastls's in-memory dual (the proximal solve around M = 0) is the same solve
    W_fastls = fastls.proximal_solve_dual(X, Y, gamma, np.zeros_like(W_primal))
    np.testing.assert_allclose(W, W_fastls, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype] * 1e-2 * np.abs(W_primal).max())


def test_report_has_a_row_per_width_and_the_reference_check():
    from fig6_dual_classifier import report

    seconds = {"forward_train": 33.0, "gram": 95.0, "solve": 245.0, "weights": 1.0, "test_evaluation": 10.0,
               "wall": 391.0}
    rows = [{"width": 1.0, "classifier_inputs": 131073, "train_rows": 44963, "test_accuracy": 0.71234,
             "train_accuracy": 0.99, "seconds": seconds, "peak_rss_gib": 18.5},
            {"width": 0.0625, "classifier_inputs": 8193, "train_rows": 44963, "test_accuracy": 0.59952,
             "train_accuracy": 0.727, "seconds": seconds, "peak_rss_gib": 17.97,
             "reference": {"identical_convolutions": True, "relative_difference": 5.5e-5}}]
    table = [line for line in report(rows) if line.startswith("| 1")]
    assert [line.split(" | ")[0] for line in table] == ["| 1/16", "| 1"]
    assert "59.95" in table[0] and "identical" in table[0] and "5.5e-05" in table[0]
    assert "131,073" in table[1] and "71.23" in table[1] and table[1].endswith("| - |")
