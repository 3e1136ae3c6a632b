"""gamma="auto" (server GCV) and eps="auto" (client leave-one-out / GCV) in the protocol."""

import json

import numpy as np
import pytest

import fastls
from fedlayer.cli import main
from fedlayer.client import Client
from fedlayer.server import Variant, run_protocol
from fedlayer.models import build_model
from fedlayer.transport import InProcessTransport
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from tests.numeric_checks import assert_close
from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, make_data


def run_clients(datas, variant, config, **options):
    clients = [Client(i, data, config, seed=3, n_classes=N_CLASSES) for i, data in enumerate(datas)]
    n_layers = sum(1 for layer in config["layers"] if "units" in layer or "filters" in layer)
    outcome = run_protocol(InProcessTransport(clients), n_layers, variant,
                           ServerOptions(batch=BatchPolicy(first=16, max=64), **options))
    return outcome, clients


def chosen_gammas(outcome):
    return [[choice["gamma"] for choice in r["selection"].values()] for r in outcome["rounds"] if "selection" in r]


@pytest.mark.parametrize("n_clients", [2, 5, 11])
def test_gamma_auto_does_not_depend_on_the_partition(rng, n_clients):
    """Every partition sums to the same statistics, so GCV picks the same gamma and weights."""
    x, y = make_data(rng)
    config = dnn_config(x.shape[1])
    central, _ = run_clients([client_data(x, y, np.arange(len(x)))], Variant(adaptive=False), config, gamma="auto")
    parts = np.array_split(rng.permutation(len(x)), n_clients)
    federated, _ = run_clients([client_data(x, y, p) for p in parts], Variant(), config, gamma="auto")
    np.testing.assert_allclose(np.ravel(chosen_gammas(federated)), np.ravel(chosen_gammas(central)), rtol=1e-6)
    for W_fed, W_central in zip(federated["group_weights"][0], central["group_weights"][0]):
        assert_close(W_fed, W_central, np.float64, rtol=1e-6)


def test_gamma_auto_solves_each_layer_with_its_gcv_minimum(rng):
    """Layer by layer: the weights are the ridge solution at the recorded gamma, which minimizes GCV."""
    x, y = make_data(rng, n=150, d=7)
    config = dnn_config(7)
    outcome, (client,) = run_clients([client_data(x, y, np.arange(150))], Variant(adaptive=False), config,
                                     gamma="auto")
    encoders = client.encoders
    Y = np.eye(N_CLASSES)[y]
    h = x
    for position, (W, record) in enumerate(zip(outcome["group_weights"][0], outcome["rounds"])):
        choice = record["selection"]["all"]
        A = np.hstack([h, np.ones((len(h), 1))])
        Z = Y @ encoders[position] if position < len(encoders) else Y
        gamma = choice["gamma"]
        assert_close(W, np.linalg.solve(A.T @ A + gamma * np.eye(A.shape[1]), A.T @ Z), np.float64, rtol=1e-8)
        path = fastls.RidgePath.from_rows(A, Z)
        assert path.gcv([gamma])[0] <= min(choice["scores"]) * (1 + 1e-9)
        np.testing.assert_allclose(choice["scores"], path.gcv(choice["grid"]), rtol=1e-8)
        h = np.maximum(A @ W, 0) if position < 2 else A @ W


def test_gamma_output_auto_chooses_only_the_classifiers_gamma(rng):
    """gamma_output="auto": the hidden layers keep gamma's weights; the output layer is solved at its GCV minimum."""
    x, y = make_data(rng, n=150, d=7)
    config = dnn_config(7)
    data = [client_data(x, y, np.arange(150))]
    fixed, _ = run_clients(data, Variant(adaptive=False), config, gamma=30.0)
    mixed, (client,) = run_clients(data, Variant(adaptive=False), config, gamma=30.0, gamma_output="auto")
    *hidden, output = mixed["group_weights"][0]
    for W, W_fixed in zip(hidden, fixed["group_weights"][0]):
        np.testing.assert_array_equal(W, W_fixed)
    assert [position for position, r in enumerate(mixed["rounds"]) if r.get("selection")] == [len(hidden)]
    choice = mixed["rounds"][len(hidden)]["selection"]["all"]
    h = x
    for W in hidden:
        h = np.maximum(np.hstack([h, np.ones((len(h), 1))]) @ W, 0)
    A, Y = np.hstack([h, np.ones((len(h), 1))]), np.eye(N_CLASSES)[y]
    assert_close(output, np.linalg.solve(A.T @ A + choice["gamma"] * np.eye(A.shape[1]), A.T @ Y), np.float64,
                 rtol=1e-8)
    assert fastls.RidgePath.from_rows(A, Y).gcv([choice["gamma"]])[0] <= min(choice["scores"]) * (1 + 1e-9)
    assert not np.allclose(output, fixed["group_weights"][0][-1])


@pytest.mark.parametrize("conv_targets", ["position", "image"])
def test_target_moments_count_every_patch(rng, conv_targets):
    """tr(Z^T Z) and the row count a conv client uploads equal those of its explicit patch rows."""
    model = build_model("dcnn", (32, 32, 2), N_CLASSES, width=1 / 256)
    x = rng.random((12, 32, 32, 2))
    y = rng.integers(0, N_CLASSES, 12)
    client = Client(0, client_data(x, y, np.arange(12)), model.config(), seed=1, n_classes=N_CLASSES,
                    options=ClientOptions(conv_targets=conv_targets))
    layer = client.model.layers[client.model.trainable[0]]
    rows = layer.ls_rows(x).shape[0]
    targets = client._targets(0, y)
    Z = targets.reshape(rows, -1) if conv_targets == "position" else np.repeat(targets, rows // 12, axis=0)
    assert Z.shape == client._row_targets(0, y).shape
    zz, counted = client._target_moments(0)
    assert counted == rows
    assert zz == pytest.approx(float((Z ** 2).sum()), rel=1e-12)


@pytest.mark.parametrize("n, d, scratch_bytes, criterion",
                         [(60, 20, 1 << 26, "loo"), (60, 20, 64, "gcv"), (200, 5, 1 << 26, "gcv")])
def test_eps_auto_is_the_clients_own_choice(rng, n, d, scratch_bytes, criterion):
    """Leave-one-out for few rows per feature that fit in the scratch budget, else GCV; the weights solve eq. (13)."""
    x, y = make_data(rng, n=n, d=d)
    config = build_model("lr", (d,), N_CLASSES).config()
    client = Client(0, client_data(x, y, np.arange(n)), config, seed=0, n_classes=N_CLASSES,
                    options=ClientOptions(scratch_bytes=scratch_bytes))
    M = rng.standard_normal((d + 1, N_CLASSES))
    client.set_weights(0, M)
    result = client.personalize(0, eps="auto", batch_size=13)
    assert result["method"] == criterion
    A = np.hstack([x, np.ones((n, 1))])
    Y = np.eye(N_CLASSES)[y]
    expected, _, _ = fastls.RidgePath.from_rows(A, Y, center=M).select(criterion)
    assert result["eps"] == pytest.approx(expected, rel=1e-6)
    W = client.model.layers[client.model.trainable[0]].weights
    assert_close(W, fastls.proximal_solve(A.T @ A, A.T @ Y, result["eps"], M), np.float64, rtol=1e-8)


def test_auto_choices_are_recorded_printed_and_plotted(tmp_path, capsys):
    out = tmp_path / "auto"
    argv = ["run", "--algorithm", "pfedacnnl", "--dataset", "synthetic", "--model", "dnn", "--clients", "12",
            "--groups", "3", "--gamma", "auto", "--eps", "auto", "--quiet", "--output", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    federated = [r for r in results["rounds"].values() if r["stage"] == "federated"]
    personalized = [r for r in results["rounds"].values() if r["stage"] == "personalization"]
    assert len(federated) == len(personalized) == 3
    for record in federated:
        assert record["selection"], "every federated round records the gamma of each group"
        for choice in record["selection"].values():
            assert choice["gamma"] > 0 and len(choice["grid"]) == len(choice["scores"])
    for record in personalized:
        assert all(c["eps"] > 0 and c["criterion"] in ("loo", "gcv") for c in record["clients"].values())
    assert main(["run", *argv[1:-3], "--output", str(tmp_path / "again")]) == 0
    printed = capsys.readouterr().out
    assert "gamma chosen by GCV" in printed and "eps chosen by" in printed and "over 12 clients" in printed
    assert main(["plot", str(out / "results.json")]) == 0
    assert (out / "gcv.png").stat().st_size > 0


def test_gamma_output_flag_selects_on_the_last_layer_only(tmp_path, capsys):
    out = tmp_path / "output_only"
    assert main(["run", "--algorithm", "fedacnnl", "--dataset", "synthetic", "--model", "dnn", "--clients", "12",
                 "--gamma-output", "auto", "--quiet", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    selected = [bool(r.get("selection")) for r in results["rounds"].values() if r["stage"] == "federated"]
    assert selected == [False, False, True]
    assert results["config"]["gamma_output"] == "auto" and results["config"]["gamma"] == 100.0
    with np.load(out / "model.npz") as saved:
        assert json.loads(str(saved["metadata"]))["gamma_output"] == "auto"


@pytest.mark.parametrize("eps_output", ["inf", 40.0, "auto"])
def test_eps_output_personalizes_only_the_output_layer_differently(rng, eps_output):
    """eps_output: the hidden layers are personalized as with eps alone; "inf" keeps the group's output layer."""
    x, y = make_data(rng, n=150, d=7)
    config = dnn_config(7)
    data = [client_data(x, y, part) for part in np.array_split(rng.permutation(150), 3)]
    variant = Variant(adaptive=False, personalize=True)
    plain, plain_clients = run_clients(data, variant, config, eps=2500.0)
    mixed, mixed_clients = run_clients(data, variant, config, eps=2500.0, eps_output=eps_output)
    group_output = mixed["group_weights"][0][-1]
    for plain_client, client in zip(plain_clients, mixed_clients):
        *hidden, output = client.final_weights()["weights"]
        *plain_hidden, plain_output = plain_client.final_weights()["weights"]
        for W, W_plain in zip(hidden, plain_hidden):
            np.testing.assert_array_equal(W, W_plain)
        if eps_output == "inf":
            np.testing.assert_array_equal(output, group_output)
        else:
            assert not np.allclose(output, plain_output)
    last = [r for r in mixed["rounds"] if r["stage"] == "personalization"][-1]
    if eps_output == "inf":
        assert all(client["form"] == "kept" for client in last["clients"].values())


def test_eps_output_flag_is_recorded_and_checked(tmp_path):
    out = tmp_path / "kept"
    assert main(["run", "--algorithm", "pfedacnnl-wc", "--dataset", "synthetic", "--model", "dnn", "--clients", "12",
                 "--eps-output", "inf", "--quiet", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["eps_output"] == "inf" and results["config"]["eps"] == 2500.0
    personalized = [r for r in results["rounds"].values() if r["stage"] == "personalization"]
    assert personalized[-1]["accuracy"] == personalized[-2]["accuracy"]  # every client kept the group's layer
    with np.load(out / "personalized" / "client0.npz") as saved:
        assert json.loads(str(saved["metadata"]))["eps_output"] == "inf"
    with pytest.raises(SystemExit):
        main(["run", "--algorithm", "pfedacnnl-wc", "--eps-output", "-3", "--quiet", "--output", str(tmp_path / "x")])


def test_eps_by_the_class_decision(rng):
    """eps_criterion="loo_class": the eps with the fewest held-out misclassified rows, from the same factorization."""
    x, y = make_data(rng, n=60, d=20)
    config = build_model("lr", (20,), N_CLASSES).config()
    client = Client(0, client_data(x, y, np.arange(60)), config, seed=0, n_classes=N_CLASSES,
                    options=ClientOptions(eps_criterion="loo_class"))
    M = rng.standard_normal((21, N_CLASSES))
    client.set_weights(0, M)
    result = client.personalize(0, eps="auto", batch_size=13)
    assert result["method"] == "loo_class"
    A = np.hstack([x, np.ones((60, 1))])
    expected, _, _ = fastls.RidgePath.from_rows(A, np.eye(N_CLASSES)[y], center=M).select("loo_class", labels=y)
    assert result["eps"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="eps_criterion must be one of"):
        Client(0, client_data(x, y, np.arange(60)), config, seed=0, n_classes=N_CLASSES,
               options=ClientOptions(eps_criterion="aic"))


@pytest.mark.parametrize("gamma_scope", ["all", "group"])
def test_gamma_auto_with_groups(rng, gamma_scope):
    """'all': one gamma from every group's sums (FedACnnL's), each group solved with it; 'group': its own GCV."""
    x, y = make_data(rng, n=200, d=6)
    config = build_model("lr", (6,), N_CLASSES).config()
    # Clients holding one class each, so that K-means has clear groups.
    parts = [np.flatnonzero(y == c) for c in range(N_CLASSES)]
    grouped, _ = run_clients([client_data(x, y, p) for p in parts], Variant(cluster=True), config, gamma="auto",
                             groups=2, gamma_scope=gamma_scope)
    single, _ = run_clients([client_data(x, y, p) for p in parts], Variant(), config, gamma="auto")
    selection = grouped["rounds"][-1]["selection"]
    group_of = {int(cid): k for cid, k in grouped["groups"].items()}
    if gamma_scope == "all":
        assert list(selection) == ["all"]
        assert selection["all"]["gamma"] == pytest.approx(single["rounds"][-1]["selection"]["all"]["gamma"], rel=1e-6)
    else:
        assert sorted(selection) == ["0", "1"]
    for k, weights in grouped["group_weights"].items():
        rows = np.concatenate([parts[cid] for cid, g in group_of.items() if g == k])
        A = np.hstack([x[rows], np.ones((len(rows), 1))])
        gamma = selection["all" if gamma_scope == "all" else str(k)]["gamma"]
        expected = np.linalg.solve(A.T @ A + gamma * np.eye(7), A.T @ np.eye(N_CLASSES)[y[rows]])
        assert_close(weights[0], expected, np.float64, rtol=1e-8)
