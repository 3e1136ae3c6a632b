"""Per-round time of FedACnnL, one pytest-benchmark case per round's job, tracked against a saved baseline.

A FedACnnL round l is the clients' statistics (X_l^T X_l and X_l^T Z_l over
their data, :meth:`fedlayer.client.Client.local_stats`) and the server's
solve of the summed system (:func:`fastls.ridge_solve`). Each is a benchmark
case of its own, for every layer of the MNIST DNN, in float32 and float64 data,
at the first round's batch size B_1 = 64 and at B_max = 1024, so
``--benchmark-compare`` checks every round's time, not only a run's total.

The statistics case is one client holding a whole round's samples (52,500:
the 100 MNIST clients' 75 % training shares), under one core; values are
random with MNIST's shape, since the time does not depend on them. With
``--benchmark-enable`` the cases run at that full size, several rounds each;
in the test suite (benchmarks disabled) they run once on 512 samples, as
checks that the benchmarked paths work. See bench/README.md for the commands
that save, compare and fail on a regression.
"""

import numpy as np
import pytest

import fastls
from fedlayer.client import Client
from fedlayer.data import ClientData
from fedlayer.models import build_model
from tests.numeric_checks import assert_close

N_FEATURES, N_CLASSES = 784, 10   # MNIST
FULL_SAMPLES, SMALL_SAMPLES = 52500, 512
LAYERS = [0, 1, 2]                # the DNN's trainable layers: 785 -> 128, 129 -> 64, 65 -> 10
BATCHES = {"B_1": 64, "B_max": 1024}
GAMMA = 100.0
ROUNDS = 5


@pytest.fixture(scope="module")
def full_size(request):
    """Full-size shapes when the benchmarks are timed, small ones when the suite runs them once."""
    return bool(request.config.getoption("benchmark_enable", False))


@pytest.fixture(scope="module")
def clients(full_size):
    """dtype name -> a one-core Client of the MNIST DNN holding a round's samples (cached per module)."""
    n = FULL_SAMPLES if full_size else SMALL_SAMPLES
    rng = np.random.default_rng(0)
    x = rng.random((n, N_FEATURES))
    y = rng.integers(0, N_CLASSES, n)
    built = {}
    for dtype in ("float32", "float64"):
        model = build_model("dnn", (N_FEATURES,), N_CLASSES, dtype=np.dtype(dtype))
        data = ClientData(x_train=x.astype(dtype), y_train=y, x_test=x[:1].astype(dtype), y_test=y[:1])
        built[dtype] = Client(0, data, model.config(), seed=0, n_classes=N_CLASSES, cores=1)
    return built


def _timed(benchmark, fn, **kwargs):
    """Several timed rounds when benchmarking (one untimed warm-up), a single call in the test suite."""
    return benchmark.pedantic(fn, kwargs=kwargs, rounds=ROUNDS, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("batch", sorted(BATCHES), ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: f"layer{layer + 1}")
def test_round_client_statistics(benchmark, clients, layer, dtype, batch):
    client = clients[dtype]
    benchmark.group = f"client statistics, layer {layer + 1}"
    result = _timed(benchmark, client.local_stats, position=layer, batch_size=BATCHES[batch])
    G, C = result["G"], result["C"]
    n_inputs = client.model.layers[client.model.trainable[layer]].ls_shape(
        client.model.input_shape_of(client.model.trainable[layer]))[0]
    assert G.shape == (n_inputs, n_inputs) and C.shape[0] == n_inputs
    # The bias column is constant 1: its diagonal entry counts the samples, whatever the batch size.
    assert G[-1, -1] == client.data.n_train


@pytest.mark.parametrize("layer", LAYERS, ids=lambda layer: f"layer{layer + 1}")
def test_round_server_solve(benchmark, clients, layer):
    statistics = clients["float64"].local_stats(position=layer, batch_size=BATCHES["B_max"])
    G, C = statistics["G"], statistics["C"]
    benchmark.group = f"server solve, layer {layer + 1}"
    W = _timed(benchmark, fastls.ridge_solve, G=G, C=C, gamma=GAMMA)
    full = fastls.symmetrize(G)
    assert_close(full @ W + GAMMA * W, C, np.float64, rtol=1e-8)


@pytest.mark.parametrize("cores", [1, 2])
def test_round_secure_masks(benchmark, full_size, cores):
    # --secure's extra work on round 1's upload: G's packed triangle and C's coordinates at the DNN's first
    # layer (d = 785), encoded in fixed point and masked by 15 AES-CTR keystreams (14 neighbours, the self mask).
    from fedlayer.secure import FixedPoint, _add_masks, keystream_words

    d = N_FEATURES + 1 if full_size else 40
    rng = np.random.default_rng(1)
    pieces = [rng.standard_normal(d * N_CLASSES), rng.standard_normal(d * (d + 1) // 2) * 1e3]
    offsets = [0, pieces[0].size]
    pairs = [(bytes(rng.integers(0, 256, 16, dtype=np.uint8)), 1 if i % 2 else -1) for i in range(15)]
    code = FixedPoint(30, 100)
    flat = np.empty(sum(p.size for p in pieces), dtype=np.uint64)
    benchmark.group = "secure masks, round 1"

    def masked():
        with fastls.limit_cores(cores):
            return _add_masks(flat, pairs, list(zip(offsets, pieces)), code, checked=True)

    _timed(benchmark, masked)
    expected = np.concatenate([code.encode(p) for p in pieces])
    for key, sign in pairs:
        stream = keystream_words(key, flat.size)
        expected = expected + stream if sign > 0 else expected - stream
    np.testing.assert_array_equal(flat, expected)
