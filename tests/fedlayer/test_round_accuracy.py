"""The accuracy after a hidden layer's round: the network's, or the layer's label-code readout (round_accuracy)."""

import numpy as np
import pytest

from fedlayer.client import Client, label_encoders, encoder_widths
from fedlayer.models import build_model
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from fedlayer.server import ModelLayers, Variant, run_protocol
from fedlayer.transport import InProcessTransport
from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, run_clients

SHAPE = (32, 32, 2)


def _model(kind):
    if kind == "dnn":
        return build_model("dnn", (12,), N_CLASSES, width=0.25)
    return build_model("dcnn", SHAPE, N_CLASSES, width=1 / 256, padding="same")


def _trained_client(rng, kind, conv_targets, n=40, n_test=23):
    shape = (12,) if kind == "dnn" else SHAPE
    x, y = rng.random((n, *shape)), rng.integers(0, N_CLASSES, n)
    client = Client(0, client_data(x, y, np.arange(n), n_test=n_test), _model(kind).config(), seed=4,
                    n_classes=N_CLASSES, options=ClientOptions(conv_targets=conv_targets))
    for position, index in enumerate(client.model.trainable):
        # Least squares on the client's own rows: a layer that has learned something of its code.
        A = client.model.layers[index].ls_rows(client.model.forward(x, stop=index))
        Z = client._row_targets(position, y)
        client.set_weights(position, np.linalg.solve(A.T @ A + 1e-3 * np.eye(A.shape[1]), A.T @ Z))
    return client


@pytest.mark.parametrize("kind,conv_targets", [("dnn", "position"), ("dcnn", "position"), ("dcnn", "image")])
def test_the_readout_gives_each_sample_the_class_whose_code_is_nearest_the_layers_output(rng, kind, conv_targets):
    client = _trained_client(rng, kind, conv_targets)
    model, x_test, y_test = client.model, client.data.x_test, client.data.y_test
    encoders = label_encoders(4, N_CLASSES, encoder_widths(model, conv_targets))
    for position, index in enumerate(model.trainable[:-1]):
        layer = model.layers[index]
        # The layer's outputs as least-squares rows (sample-major), and each class's target for those rows.
        rows = layer.ls_rows(model.forward(x_test, stop=index)) @ layer.weights
        out = rows.reshape(len(x_test), -1, rows.shape[1])  # (samples, positions, m)
        codes = encoders[position].reshape(N_CLASSES, -1, out.shape[2])  # (classes, positions or 1, m)
        distances = ((out[:, None] - codes[None]) ** 2).sum(axis=(2, 3))
        expected = int(np.count_nonzero(distances.argmin(axis=1) == y_test))
        assert client.evaluate(batch_size=5, code_layer=position) == {"correct": expected, "total": len(x_test)}
        # The readout says something here, unlike a network whose later layers are untrained.
        assert expected > 0
    # Readouts leave the cached test activations where the network's evaluation expects them.
    correct, total = model.accuracy(x_test, y_test)
    assert client.evaluate() == {"correct": correct, "total": total}


def test_a_layer_without_a_label_code_has_no_readout(rng):
    client = _trained_client(rng, "dnn", "position")
    last = len(client.model.trainable) - 1
    with pytest.raises(ValueError, match=f"code_layer must be the position of a hidden layer with a label code, "
                                         f"0 to {last - 1}; got {last}"):
        client.evaluate(code_layer=last)


def test_codes_change_the_hidden_rounds_accuracy_and_nothing_else(rng):
    x, y = rng.random((90, 12)), rng.integers(0, N_CLASSES, 90)
    datas = [client_data(x, y, part, n_test=20) for part in np.array_split(rng.permutation(90), 3)]
    network, _ = run_clients(datas, Variant(adaptive=False), config=dnn_config(12))
    codes, transport = run_clients(datas, Variant(adaptive=False), config=dnn_config(12), round_accuracy="codes")
    rounds, reference = codes["rounds"], network["rounds"]
    n_layers = len(rounds)
    for k, (mine, theirs) in enumerate(zip(rounds, reference, strict=True)):
        hidden = k < n_layers - 1
        assert mine.get("accuracy_of") == ("codes" if hidden else None)
        assert "accuracy_of" not in theirs
        if not hidden:
            assert mine["accuracy"] == theirs["accuracy"]
    # The readout of the first layer is the clients' own evaluate(code_layer=0) with the final weights of that layer.
    correct = total = 0
    for _, reply in transport.call("evaluate", {cid: {"code_layer": 0} for cid in transport.client_ids}):
        correct, total = correct + reply["correct"], total + reply["total"]
    assert rounds[0]["accuracy"] == correct / total
    for W, V in zip(codes["group_weights"][0], network["group_weights"][0], strict=True):
        assert np.array_equal(W, V)


def test_an_unknown_round_accuracy_is_refused():
    with pytest.raises(ValueError, match="round_accuracy"):
        ServerOptions(round_accuracy="layer")


@pytest.mark.parametrize("cache_ram_bytes", [0, 1 << 24])  # activations memory-mapped, or in RAM
def test_readouts_do_not_depend_on_which_rounds_were_scored_before(rng, cache_ram_bytes):
    """pFedACnnL (groups, then personalization) with every round scored, and with every second round: the
    readouts both score are equal, whatever the test cache held when each began."""
    x, y = rng.random((120, 12)), rng.integers(0, N_CLASSES, 120)
    datas = [client_data(x, y, part, n_test=15) for part in np.array_split(rng.permutation(120), 4)]

    def run(eval_every):
        clients = [Client(i, data, dnn_config(12), seed=3, n_classes=N_CLASSES,
                          options=ClientOptions(cache_ram_bytes=cache_ram_bytes)) for i, data in enumerate(datas)]
        n_layers = len(clients[0].model.trainable)
        return run_protocol(InProcessTransport(clients), n_layers, Variant(cluster=True, personalize=True),
                            ServerOptions(batch=BatchPolicy(8), groups=2, eval_every=eval_every,
                                          round_accuracy="codes"), layers=ModelLayers())["rounds"]

    every, second = run(1), run(2)
    n_hidden = sum(r.get("accuracy_of") == "codes" for r in every)
    assert n_hidden == len(every) // 2 - 1 >= 1
    scored_twice = [k for k, r in enumerate(second) if r["accuracy"] is not None]
    assert scored_twice
    for k in scored_twice:
        assert second[k]["accuracy"] == every[k]["accuracy"]
        assert second[k].get("accuracy_of") == every[k].get("accuracy_of")
