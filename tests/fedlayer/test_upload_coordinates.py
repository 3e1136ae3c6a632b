"""Hidden layers' cross statistics uploaded as X^T Y's coordinates in the label code (upload="coordinates")."""

import numpy as np
import pytest

from fedlayer.client import Client, target_bases
from fedlayer.server import ModelLayers, Variant, run_protocol, targets_cross
from fedlayer.models import build_model
from fedlayer.transport import InProcessTransport
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from tests.numeric_checks import assert_close
from tests.fedlayer.cases import N_CLASSES, client_data


def _dnn(rng, n):
    x = rng.standard_normal((n, 12))
    return build_model("dnn", (12,), N_CLASSES, width=0.25), x


def _dcnn(rng, n):
    # Width 1/16: the last convolution has more filters (128) than positions x classes (2 x 2 x 4).
    x = rng.random((n, 32, 32, 3))
    return build_model("dcnn", (32, 32, 3), N_CLASSES, width=1 / 16), x


CASES = [(_dnn, "position"), (_dcnn, "position"), (_dcnn, "image")]
IDS = ["dnn", "dcnn-position", "dcnn-image"]


@pytest.mark.parametrize("make, conv_targets", CASES, ids=IDS)
def test_coordinates_times_the_code_are_thetargets_cross(rng, make, conv_targets):
    """Per layer with a narrower code: the same G, and C_coordinates @ Q_l == X^T Z."""
    model, x = make(rng, 11)
    y = rng.integers(0, N_CLASSES, len(x))
    client = Client(0, client_data(x, y, np.arange(len(x))), model.config(), seed=4, n_classes=N_CLASSES,
                    options=ClientOptions(conv_targets=conv_targets))
    bases = target_bases(model, 4, conv_targets)
    assert any(basis is not None for basis in bases), "the case must exercise a layer with a narrower code"
    for position, basis in enumerate(bases):
        G_t, C_t, _, _ = client._statistics(position, 4, None)
        G_t, C_t = G_t.copy(), C_t.copy()  # the next call recycles the buffers
        if basis is None:
            with pytest.raises(ValueError, match=f"layer {position + 1} has no label code narrower than its "
                                                 f"{C_t.shape[1]} outputs"):
                client._statistics(position, 4, None, coordinates=True)
        else:
            G_c, C_c, _, _ = client._statistics(position, 4, None, coordinates=True)
            assert_close(np.triu(G_c), np.triu(G_t), np.float64, rtol=1e-12)
            assert C_c.shape == (C_t.shape[0], basis.shape[0]) and basis.shape[0] < C_t.shape[1]
            assert_close(C_c @ basis, C_t, np.float64, rtol=1e-10)
        client.set_weights(position, rng.standard_normal(C_t.shape))


@pytest.mark.parametrize("make, conv_targets", CASES, ids=IDS)
def test_weights_and_bytes_of_the_two_uploads(rng, make, conv_targets):
    """FedACnnL over 3 clients: the same weights from coordinates as from X^T Z, for fewer bytes up."""
    model, x = make(rng, 30)
    y = rng.integers(0, N_CLASSES, len(x))
    parts = np.array_split(rng.permutation(len(x)), 3)

    def run(upload):
        clients = [Client(i, client_data(x, y, p), model.config(), seed=6, n_classes=N_CLASSES,
                          options=ClientOptions(conv_targets=conv_targets)) for i, p in enumerate(parts)]
        return run_protocol(InProcessTransport(clients), len(model.trainable), Variant(adaptive=False),
                            ServerOptions(seed=6, upload=upload, batch=BatchPolicy(5)),
                            layers=ModelLayers(target_bases(model, 6, conv_targets)))

    coordinates, targets = run("coordinates"), run("targets")
    for W_coordinates, W_targets in zip(coordinates["group_weights"][0], targets["group_weights"][0]):
        assert_close(W_coordinates, W_targets, np.float64, rtol=1e-9)
    for position, basis in enumerate(target_bases(model, 6, conv_targets)):
        up = [r["bytes_up"] for r in (coordinates["rounds"][position], targets["rounds"][position])]
        assert up[0] < up[1] if basis is not None else up[0] == up[1]


def test_server_refuses_coordinates_of_the_wrong_width(rng):
    basis = rng.standard_normal((4, 16))
    C = rng.standard_normal((9, 4))
    assert_close(targets_cross(C, basis, 0), C @ basis, np.float64, rtol=1e-12)
    with pytest.raises(ValueError, match=r"layer 2: asked for X\^T Y's coordinates in the label code \(4 columns\), "
                                         r"the clients' sum has 7"):
        targets_cross(rng.standard_normal((9, 7)), basis, 1)


def test_protocol_refuses_an_unknown_upload(rng):
    model, x = _dnn(rng, 5)
    client = Client(0, client_data(x, np.arange(5) % N_CLASSES, np.arange(5)), model.config(), seed=0,
                    n_classes=N_CLASSES)
    with pytest.raises(ValueError, match=r"upload must be one of \('coordinates', 'targets'\), got 'both'"):
        run_protocol(InProcessTransport([client]), 3, Variant(adaptive=False), ServerOptions(groups=1, upload="both"))
