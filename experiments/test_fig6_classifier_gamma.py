"""The classifier re-solved from a finished run: the run's gamma gives back the run's accuracy."""

import numpy as np

from fig6_classifier_gamma import classifier_gamma_table
from fedlayer.models import Model
from fedlayer.run import RunConfig, load_dataset, run


def test_the_runs_gamma_gives_the_runs_accuracy_and_gcv_its_minimum(tmp_path):
    config = RunConfig(algorithm="fedacnnl", dataset="synthetic", model="dnn", clients=30, seed=3,
                       output=str(tmp_path))
    dataset = load_dataset(config)
    results = run(config, dataset=dataset)
    model, _ = Model.load(tmp_path / "model.npz")
    rows, gcv_gamma, timings = classifier_gamma_table(model, dataset, [1.0, config.gamma, 1e4])
    gammas = [gamma for gamma, _, _ in rows]
    assert gammas == sorted({1.0, config.gamma, 1e4, gcv_gamma})
    accuracy = {gamma: acc for gamma, acc, _ in rows}
    n_test = timings["rows"][1]
    # Weight invariance: the run's classifier is the ridge solution on the union of the clients' rows.
    np.testing.assert_allclose(accuracy[config.gamma], 100.0 * results["accuracy"], atol=100.0 / n_test)
    scores = {gamma: score for gamma, _, score in rows}
    assert scores[gcv_gamma] == min(scores.values())
    assert timings["rows"][2] == 65  # the classifier's 64 inputs and the bias
