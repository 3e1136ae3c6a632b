"""fedlayer run / plot / predict end to end on small synthetic configurations."""

import json

import numpy as np
import pytest

from fedlayer.cli import main
from fedlayer.models import Model
from fedlayer.run import RunConfig, client_cores, run
from tests.numeric_checks import assert_close

SMALL = ["--clients", "12", "--groups", "3", "--synthetic-alpha", "0.5", "--synthetic-beta", "0.5"]


def test_run_writes_results_models_and_plots(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *SMALL, "--algorithm", "pfedacnnl", "--output", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["algorithm"] == "pfedacnnl"
    assert results["n_clients"] == 12
    stages = [r["stage"] for r in results["rounds"].values()]
    assert stages == ["initialization"] + ["federated"] * 3 + ["personalization"] * 3
    federated = [r for r in results["rounds"].values() if r["stage"] == "federated"]
    assert all(len(r["clients"]) == 12 and all("batch_size" in c for c in r["clients"].values()) for r in federated)
    assert 0.5 < results["accuracy"] <= 1.0
    t = results["time_per_client"]
    assert t["total_s"] == pytest.approx(t["compute_s"] + t["idle_s"] + t["comm_s"])
    groups = sorted(set(results["groups"].values()))
    assert groups == [0, 1, 2]
    assert sorted(p.name for p in out.glob("model_group*.npz")) == [f"model_group{k}.npz" for k in groups]

    assert main(["plot", str(out / "results.json")]) == 0
    for png in ("accuracy.png", "time_breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_scored_by_label_codes_says_so_in_its_summary_and_plot(tmp_path, capsys):
    out = tmp_path / "codes"
    assert main(["run", *SMALL, "--algorithm", "fedacnnl", "--round-accuracy", "codes", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "the hidden layers' rounds score each layer's label codes" in printed
    assert "stays near chance" not in printed
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    assert [r.get("accuracy_of") for r in rounds.values() if r["stage"] == "federated"] == ["codes", "codes", None]
    assert main(["plot", str(out / "results.json")]) == 0
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saved_model_predicts_like_the_run(tmp_path, capsys):
    out = tmp_path / "fed"
    assert main(["run", *SMALL, "--algorithm", "fedacnnl", "--output", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    model, metadata = Model.load(out / "model.npz")
    assert metadata["algorithm"] == "fedacnnl"
    capsys.readouterr()
    assert main(["predict", str(out / "model.npz"), "--dataset", "synthetic", "--clients", "12"]) == 0
    report = json.loads(capsys.readouterr().out)
    # FedACnnL evaluates the one global model on every local test split: the same number.
    assert report["accuracy"] == pytest.approx(results["accuracy"], abs=1e-12)


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"algorithm": "fedacnnl-wa", "clients": 8, "model": "lr", "batch_size": 32}))
    out = tmp_path / "o"
    assert main(["run", "--config", str(cfg), "--seed", "4", "--output", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["algorithm"] == "fedacnnl-wa" and results["config"]["seed"] == 4
    sizes = {c["batch_size"] for c in results["rounds"]["1"]["clients"].values()}
    assert sizes == {32}


def test_fedacnnl_and_wa_reach_the_same_model():
    """Adaptive batch sizes do not change the weights (weight invariance) on real CLI configs."""
    a = run(RunConfig(algorithm="fedacnnl", clients=10, model="dnn"))
    b = run(RunConfig(algorithm="fedacnnl-wa", clients=10, model="dnn"))
    for Wa, Wb in zip(a["group_weights"][0], b["group_weights"][0]):
        assert_close(Wa, Wb, np.float64, rtol=1e-10)
    assert a["accuracy"] == b["accuracy"]


def test_acnnl_is_one_pooled_client():
    results = run(RunConfig(algorithm="acnnl", clients=10, model="lr"))
    assert results["n_clients"] == 1
    assert results["time_per_client"]["comm_s"] == 0.0


def exit_status(argv):
    """main()'s exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dataset", "imagenet"], "argument --dataset: invalid choice: 'imagenet'"),
        (["--groups", "20", "--clients", "5"], "groups (K=20) cannot exceed the number of clients (5)"),
        (["--gamma", "-1"], "argument --gamma: must be a finite number > 0 or one of 'auto', got '-1'"),
        (["--gamma-output", "0"], "argument --gamma-output: must be a finite number > 0 or one of 'auto', got '0'"),
        (["--batch-size", "2048"], "must not exceed max_batch_size"),
        (["--padding", "full"], "argument --padding: invalid choice: 'full'"),
        (["--model", "dnn", "--padding", "same"], "padding='same' applies to the dcnn model only"),
        (["--dataset", "mnist", "--data-dir", "/nonexistent"], "/nonexistent"),
        (["--algorithm", "fedzo", "--hyper", "learning_rate=0.1"],
         "unknown hyperparameters ['learning_rate'] for fedzo"),
        (["--hyper", "lr=0.1"], "'pfedacnnl' trains one round per layer and takes no hyper"),
        (["--algorithm", "fedavg", "--hyper", "lr=nan"], "hyperparameter lr must be a finite number > 0, got nan"),
        (["--algorithm", "acnnl", "--secure"], "'acnnl' pools every client's data in one"),
        (["--algorithm", "acnnl", "--drop-clients", "0.1"], "'acnnl' has one pooled client"),
        (["--server-solve", "both"], "argument --server-solve: invalid choice: 'both'"),
        (["--server-memory", "0"], "argument --server-memory: must be"),
        (["--algorithm", "fedacnnl", "--secure", "--server-solve", "dual"],
         "server_solve='dual' solves from the clients' factored rows, which secure sums cannot carry"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert exit_status(["run", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err


def test_a_protocol_that_cannot_go_on_is_a_one_line_error(capsys):
    # Every client of a group fails every round (drop probability near 1): the run stops, naming them.
    assert main(["run", *SMALL, "--algorithm", "fedacnnl", "--drop-clients", "0.999", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fedlayer run: error: every client of group 0 dropped out of layer 1 (")
    assert "Traceback" not in err


def test_unknown_config_key(tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"learning_rate": 0.1}))
    assert main(["run", "--config", str(cfg)]) == 2
    assert f"config {cfg}: unknown configuration keys ['learning_rate']" in capsys.readouterr().err


def test_client_cores_are_seeded_and_bounded():
    a = client_cores(100, seed=1, available=4)
    assert a == client_cores(100, seed=1, available=4)
    assert set(a) == {1, 2, 3, 4}
    assert client_cores(5, seed=0, cores=[1, 3]) == [1, 3, 1, 3, 1]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedzo", "baffle", "pfedme", "pfedzo"])
def test_baselines_run_through_the_cli(tmp_path, algorithm):
    out = tmp_path / algorithm
    assert main(["run", "--algorithm", algorithm, "--clients", "6", "--model", "lr", "--rounds", "2",
                 "--output", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["rounds"]) == 2
    assert results["n_clients"] == 6
    assert 0.0 <= results["best_accuracy"] <= 1.0
    assert results["time_per_client"]["compute_s"] > 0
    assert np.load(out / "params.npy").ndim == 1


@pytest.mark.parametrize("value,message", [("lr", "expected KEY=VALUE, got 'lr'"),
                                           ("lr=fast", "lr: expected a number, got 'fast'")])
def test_malformed_hyper_is_a_usage_error(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--algorithm", "fedavg", "--hyper", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_hyper_overrides_reach_the_baseline(tmp_path):
    out = tmp_path / "fedzo"
    assert main(["run", "--algorithm", "fedzo", "--clients", "6", "--model", "lr", "--rounds", "1",
                 "--hyper", "lr=2.5e-4,b2=3", "--output", str(out), "--quiet"]) == 0
    hyper = json.loads((out / "results.json").read_text())["hyperparameters"]
    assert hyper["lr"] == 2.5e-4 and hyper["b2"] == 3 and isinstance(hyper["b2"], int)
    assert hyper["mu"] == 1e-3  # untouched default


def test_a_newcomer_sees_progress_totals_and_where_nothing_was_written(capsys):
    assert main(["run", "--algorithm", "fedacnnl", "--clients", "6", "--model", "dnn"]) == 0
    captured = capsys.readouterr()
    assert "3/3" in captured.err  # the bar knows the rounds in advance (one per layer), hence its ETA
    assert "near chance, 1/10, until the last layer is trained" in captured.out
    assert "nothing was written to disk: add --output DIR" in captured.out


def test_plot_marks_layers_only_for_layered_rounds(tmp_path, monkeypatch):
    import matplotlib.axes

    annotated = []
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate", lambda self, text, *a, **k: annotated.append(text))
    for algorithm, extra, marks in (("fedavg", ["--rounds", "2"], []), ("fedacnnl", [], ["F"])):
        out = tmp_path / algorithm
        assert main(["run", "--algorithm", algorithm, "--clients", "6", "--model", "lr", *extra,
                     "--output", str(out), "--quiet"]) == 0
        annotated.clear()
        assert main(["plot", str(out / "results.json")]) == 0
        assert annotated == marks


# Each run option reaches the code it configures (a mutation audit found options parsed and then ignored).

def _small(**options):
    return RunConfig(**{"clients": 10, "groups": 3, "seed": 1, **options})


def test_latency_reaches_the_clock():
    results = run(_small(algorithm="fedacnnl", model="lr", latency_ms=50.0))
    for record in results["rounds"].values():
        assert all(t["comm_s"] >= 0.1 for t in record["clients"].values())  # up and down, 50 ms each


def test_max_batch_size_caps_eq7():
    results = run(_small(algorithm="fedacnnl", batch_size=64, max_batch_size=70, bandwidth_gbps=1e-3))
    sizes = [t["batch_size"] for record in results["rounds"].values() for t in record["clients"].values()]
    assert max(sizes) == 70 and min(sizes) == 64


def test_round_deadline_reaches_the_clients():
    with pytest.raises(Exception, match="past the round deadline of 1e-09 s"):
        run(_small(algorithm="fedacnnl", model="lr", round_deadline=1e-9))


def test_min_group_size_reaches_the_secure_server():
    sizes = {size: np.bincount(list(run(_small(algorithm="pfedacnnl-wp", model="lr", clients=20, groups=4,
                                                secure=True, min_group_size=size))["groups"].values()))
             for size in (3, 5)}
    assert sizes[3].min() < 5 <= sizes[5].min()  # the default left a group that the stricter size merged


def test_h_noise_reaches_the_label_summaries():
    from fedlayer.run import build, load_dataset, make_clients

    summaries = []
    for h_noise in (0.0, 0.5):
        config = _small(algorithm="pfedacnnl", model="lr", h_noise=h_noise)
        dataset = load_dataset(config)
        client = make_clients(config, dataset, build(config, dataset).config(), client_ids=[0])[0]
        summaries.append(client.label_summary()["h"])
    assert not np.allclose(summaries[0], summaries[1])


def test_upload_choice_reaches_the_clients():
    sent = {upload: run(_small(algorithm="fedacnnl", upload=upload))["rounds"]["1"]["bytes_up"]
            for upload in ("coordinates", "targets")}
    assert sent["coordinates"] < sent["targets"]


def test_gamma_scope_group_chooses_a_gamma_per_group():
    scopes = {}
    for scope in ("all", "group"):
        results = run(_small(algorithm="pfedacnnl-wp", model="lr", gamma="auto", gamma_scope=scope))
        scopes[scope] = set(next(r for r in results["rounds"].values() if "selection" in r)["selection"])
    assert scopes["all"] == {"all"} and scopes["group"] == {"0", "1", "2"}
