"""Label codes per output position for convolutions (conv_targets="position", the paper's d_l)."""

import numpy as np
import pytest

from fedlayer.client import Client, encoder_widths, target_bases
from fedlayer.federated import Variant, run_protocol
from fedlayer.models import build_model
from fedlayer.transport import InProcessTransport
from numeric_checks import assert_close
from test_federated import N_CLASSES, client_data

SHAPE = (32, 32, 2)


def small_dcnn():
    return build_model("dcnn", SHAPE, N_CLASSES, width=1 / 256)


def images(rng, n):
    return rng.random((n, *SHAPE)), rng.integers(0, N_CLASSES, n)


def test_encoders_span_each_layers_whole_output():
    model = small_dcnn()
    outputs = [int(np.prod(model.layers[i].output_shape(model.input_shape_of(i)))) for i in model.trainable]
    assert encoder_widths(model, "position") == outputs
    assert encoder_widths(model, "image")[:-1] == [model.layers[i].filters for i in model.trainable[:-1]]
    # A code per position has no n_classes-column form on the server; the classifier has no code at all.
    assert target_bases(model, 0, "position") == [None] * len(model.trainable)
    with pytest.raises(ValueError, match="conv_targets must be one of"):
        encoder_widths(model, "pixel")


@pytest.mark.parametrize("conv_targets", ["position", "image"])
def test_client_statistics_equal_explicit_patch_rows(rng, conv_targets):
    """G and C of every layer, from the client's streamed kernels, equal [P, 1]^T [P, 1] and [P, 1]^T Z by rows."""
    x, y = images(rng, 9)
    client = Client(0, client_data(x, y, np.arange(9)), small_dcnn().config(), seed=2, n_classes=N_CLASSES,
                    conv_targets=conv_targets)
    h = x
    for position, index in enumerate(client.model.trainable):
        layer = client.model.layers[index]
        G, C, _, _ = client._statistics(position, 4, None)
        h = client.model.forward(x, stop=index)
        A = layer.ls_rows(h)
        Z = client._row_targets(position, y)
        assert_close(np.triu(G), np.triu(A.T @ A), np.float64, n_terms=len(A))
        assert_close(C, A.T @ Z, np.float64, n_terms=len(A))
        W = np.linalg.solve(A.T @ A + 10 * np.eye(A.shape[1]), A.T @ Z)
        client.set_weights(position, W)


def test_fedacnnl_with_position_codes_equals_centralized(rng):
    x, y = images(rng, 40)
    config = small_dcnn().config()

    def run(parts):
        clients = [Client(i, client_data(x, y, p), config, seed=5, n_classes=N_CLASSES) for i, p in enumerate(parts)]
        bases = target_bases(small_dcnn(), 5)
        return run_protocol(InProcessTransport(clients), 5, Variant(adaptive=False), batch_size=7,
                            target_bases=bases)["group_weights"][0]

    central = run([np.arange(40)])
    federated = run(np.array_split(rng.permutation(40), 3))
    for W_fed, W_central in zip(federated, central):
        assert_close(W_fed, W_central, np.float64, rtol=1e-9)
