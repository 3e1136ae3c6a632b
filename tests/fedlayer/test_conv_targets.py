"""Label codes per output position for convolutions (conv_targets="position", the paper's d_l)."""

import fastls
import numpy as np
import pytest

from fedlayer.client import Client, encoder_widths, target_bases
from fedlayer.server import ModelLayers, Variant, run_protocol
from fedlayer.models import build_model
from fedlayer.transport import InProcessTransport
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from tests.numeric_checks import assert_close
from tests.fedlayer.cases import N_CLASSES, client_data

SHAPE = (32, 32, 2)


def small_dcnn(padding="valid"):
    return build_model("dcnn", SHAPE, N_CLASSES, width=1 / 256, padding=padding)


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


@pytest.mark.parametrize("padding", ["valid", "same"])
@pytest.mark.parametrize("conv_targets", ["position", "image"])
def test_client_statistics_equal_explicit_patch_rows(rng, conv_targets, padding):
    """G and C of every layer, from the client's streamed kernels, equal [P, 1]^T [P, 1] and [P, 1]^T Z by rows."""
    x, y = images(rng, 9)
    client = Client(0, client_data(x, y, np.arange(9)), small_dcnn(padding).config(), seed=2, n_classes=N_CLASSES,
                    options=ClientOptions(conv_targets=conv_targets))
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


@pytest.mark.parametrize("padding", ["valid", "same"])
def test_fedacnnl_with_position_codes_equals_centralized(rng, padding):
    x, y = images(rng, 40)
    config = small_dcnn(padding).config()

    def run(parts):
        clients = [Client(i, client_data(x, y, p), config, seed=5, n_classes=N_CLASSES) for i, p in enumerate(parts)]
        bases = target_bases(small_dcnn(padding), 5)
        return run_protocol(InProcessTransport(clients), 5, Variant(adaptive=False),
                            ServerOptions(batch=BatchPolicy(7)), layers=ModelLayers(bases))["group_weights"][0]

    central = run([np.arange(40)])
    federated = run(np.array_split(rng.permutation(40), 3))
    for W_fed, W_central in zip(federated, central):
        assert_close(W_fed, W_central, np.float64, rtol=1e-9)


def _wide_client(rng, n):
    """A client of a DCNN wide enough (1/16) that its last two convolutions have more filters than positions x
    classes."""
    x = rng.random((n, 32, 32, 3))
    y = rng.integers(0, N_CLASSES, n)
    model = build_model("dcnn", (32, 32, 3), N_CLASSES, width=1 / 16)
    return Client(0, client_data(x, y, np.arange(n)), model.config(), seed=3, n_classes=N_CLASSES), x, y


def test_position_codes_solve_on_their_stacked_codes(rng):
    """C = sum_p (X_p^T Y) Q_p lies in the row space of the stacked Q_p: server and client solves on its
    positions x classes coordinates give the weights of the solves on all the filters."""
    client, x, y = _wide_client(rng, 60)
    model = client.model
    bases = target_bases(model, 3)
    assert [basis is not None for basis in bases] == [False, False, True, True, False]
    for position, index in enumerate(model.trainable):
        G, C, _, _ = client._statistics(position, 16, None)
        W = fastls.ridge_solve(G, C, 100.0)
        if bases[position] is not None:
            layer = model.layers[index]
            assert bases[position].shape == (layer.rows_per_sample(model.input_shape_of(index)) * N_CLASSES,
                                             layer.filters)
            assert_close(fastls.ridge_solve(G, C, 100.0, rhs_basis=bases[position]), W, np.float64, rtol=1e-9)
        client.set_weights(position, W)
    eps = 2500.0
    # 60 images: 960 patch rows against 577 inputs at the third convolution (primal), 240 against 1153 at the
    # fourth (dual).
    for position, method in ((2, "primal"), (3, "dual")):
        index = model.trainable[position]
        A = model.layers[index].ls_rows(model.forward(x, stop=index))
        Z = client._row_targets(position, y)
        M = client.meta_weights[position]
        expected = np.linalg.solve(A.T @ A + eps * np.eye(A.shape[1]), A.T @ Z + eps * M)
        W, record = client._personalize(position, eps, 16)
        assert record["form"] == method
        assert_close(W, expected, np.float64, rtol=1e-9)
    # eps chosen by leave-one-out from the rows: the coordinates in the stacked codes pick what the full targets pick.
    A = model.layers[model.trainable[3]].ls_rows(model.forward(x, stop=model.trainable[3]))
    path = fastls.RidgePath.from_rows(A, client._row_targets(3, y), center=client.meta_weights[3])
    chosen, _, _ = path.select("loo")
    W, record = client._personalize(3, "auto", 16)
    # The minimizer of a flat criterion, and a near-interpolating solve (eps ~ 1e-5 on these random
    # inputs): both agree to the rounding of a system of condition (lambda_max + eps) / eps.
    assert record["method"] == "loo" and record["eps"] == pytest.approx(chosen, rel=1e-6)
    expected = np.linalg.solve(A.T @ A + chosen * np.eye(A.shape[1]),
                               A.T @ client._row_targets(3, y) + chosen * client.meta_weights[3])
    condition = (np.linalg.eigvalsh(A @ A.T).max() + chosen) / chosen
    assert_close(W, expected, np.float64, rtol=100 * condition * np.finfo(np.float64).eps)


def test_a_new_layer_releases_what_the_previous_layer_recycled(rng):
    """Recycled arrays sized for one layer (G, C, overlap products) are not held beside the next layer's."""
    fastls.release_recycled()
    x, y = images(rng, 64)
    model = build_model("dcnn", SHAPE, N_CLASSES, width=1 / 16, padding="same")
    client = Client(0, client_data(x, y, np.arange(64)), model.config(), seed=2, n_classes=N_CLASSES)
    last = len(client.model.trainable) - 1
    for position in range(last):
        G, C, _, _ = client._statistics(position, 64, None)
        client.set_weights(position, np.linalg.solve(np.triu(G) + np.triu(G, 1).T + 10 * np.eye(len(G)), C))
    # The last convolution's statistics recycled more than its G and C (the overlap's products).
    assert fastls.recycled_nbytes() > G.nbytes + C.nbytes
    del G, C
    G, C, _, _ = client._statistics(last, 64, None)
    assert fastls.recycled_nbytes() == G.nbytes + C.nbytes
