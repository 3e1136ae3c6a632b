"""The personalized classifier re-solved per eps: the run's eps gives back the run's classifiers and accuracy."""

import json

import numpy as np
import pytest

from fig6_personal_eps import personal_eps_table
from fedlayer.run import RunConfig, run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pfedacnnl-wc")
    config = RunConfig(algorithm="pfedacnnl-wc", dataset="synthetic", model="dnn", clients=20, seed=3, output=str(out))
    return out, run(config)


def test_the_runs_eps_gives_the_runs_classifiers_and_accuracy(finished_run):
    out, results = finished_run
    epses = [1.0, 2500.0, 1e6]
    table = personal_eps_table(out, epses, progress=lambda line: None)
    records = table["clients"].values()
    assert len(records) == results["n_clients"]
    assert max(r["saved_difference"] for r in records) < 1e-8
    accuracy = table["accuracy"]
    np.testing.assert_allclose(accuracy[1], 100.0 * results["accuracy"], atol=1e-9)
    # eps -> inf keeps the global classifier: the accuracy before the last layer was personalized.
    rounds = sorted(results["rounds"].values(), key=lambda r: (r["stage"] != "federated", r["layer"]))
    np.testing.assert_allclose(accuracy[len(epses)], 100.0 * rounds[-2]["accuracy"], atol=1e-9)
    assert all(r["loo_eps"] > 0 and r["loo_class_eps"] > 0 for r in records)


def test_an_interrupted_table_resumes_from_its_json(finished_run, tmp_path):
    out, _ = finished_run
    path = tmp_path / "eps.json"
    first = personal_eps_table(out, [2500.0], clients=[0, 1], json_path=path, progress=lambda line: None)
    assert sorted(json.loads(path.read_text())["clients"]) == ["0", "1"]
    lines = []
    second = personal_eps_table(out, [2500.0], clients=[0, 1, 2], json_path=path, progress=lines.append)
    assert len(lines) == 1 and lines[0].startswith("client 2:")
    assert second["clients"][0] == first["clients"][0]


def test_a_run_with_groups_is_refused(finished_run, tmp_path):
    out, _ = finished_run
    settings = json.loads((out / "results.json").read_text())
    settings["config"]["algorithm"] = "pfedacnnl"
    (tmp_path / "results.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="pfedacnnl run; the table needs pfedacnnl-wc's"):
        personal_eps_table(tmp_path, [2500.0])
