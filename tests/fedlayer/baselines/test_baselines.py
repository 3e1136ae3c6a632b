"""Baselines: backprop, zeroth-order estimators, the five algorithms and their time records."""

import numpy as np
import pytest

from fedlayer.baselines import (
    BASELINES,
    DirectionStream,
    BaselineClient,
    baseline_hyper,
    make_baseline_model,
    run_baseline,
    stein_gradient,
    zo_sphere_gradient,
)
from fedlayer.data import ClientData
from fedlayer.timing import Clock, time_summary
from fedlayer.transport import InProcessTransport
from tests.numeric_checks import assert_close

N_FEATURES, N_CLASSES = 10, 3


def make_problem(seed=0, n_clients=4, n=120, spread=2.0, noise=0.5, shared_centers=True):
    """Gaussian blobs per class (separable for the default spread/noise), 75/25 split per client."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((N_CLASSES, N_FEATURES)) * spread
    clients = []
    for _ in range(n_clients):
        c = centers if shared_centers else rng.standard_normal((N_CLASSES, N_FEATURES)) * spread
        y = rng.integers(0, N_CLASSES, n)
        x = c[y] + noise * rng.standard_normal((n, N_FEATURES))
        k = int(0.75 * n)
        clients.append(ClientData(x[:k], y[:k], x[k:], y[k:]))
    return clients


def transport_for(data, model="lr", seed=0, cores=1):
    return InProcessTransport([BaselineClient(i, d, model, N_CLASSES, seed, cores) for i, d in enumerate(data)])


def pooled(data):
    return np.concatenate([d.x_train for d in data]), np.concatenate([d.y_train for d in data])


def initial(model="lr", seed=0):
    return make_baseline_model(model, N_FEATURES, N_CLASSES, seed=seed)


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["lr", "dnn"])
def test_backprop_matches_central_differences(name, rng):
    model = make_baseline_model(name, (2, 3), 4)  # feature shape is flattened
    params = model.init_params(int(rng.integers(1 << 30)))
    x = rng.standard_normal((7, 2, 3))
    y = rng.integers(0, 4, 7)
    g = model.grad(params, x, y)
    assert g.shape == (model.n_params,)
    # All coordinates for LR, a random subset (including every bias block) for the DNN.
    idx = np.arange(model.n_params) if name == "lr" else np.unique(np.concatenate(
        [rng.choice(model.n_params, 400, replace=False), model.offsets[1:-1] - 1]))
    h = 1e-5
    fd = np.empty(len(idx))
    for k, i in enumerate(idx):
        e = np.zeros(model.n_params)
        e[i] = h
        fd[k] = (model.loss(params + e, x, y) - model.loss(params - e, x, y)) / (2 * h)
    rel = np.linalg.norm(g[idx] - fd) / np.linalg.norm(fd)
    assert rel < 1e-6, rel


def test_model_shapes_init_and_views():
    model, p = make_baseline_model("dnn", 784, 10, seed=3)
    assert model.layer_sizes == (784, 128, 64, 10)
    assert model.n_params == 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    W1, b1, W2, b2, W3, b3 = model.unpack(p)
    assert np.abs(W1).max() <= 1 / np.sqrt(784) and np.abs(b3).max() <= 1 / np.sqrt(64)
    W1[0, 0] = 42.0  # views, not copies
    assert p[0] == 42.0
    _, p_again = make_baseline_model("dnn", 784, 10, seed=3)
    _, p_other = make_baseline_model("dnn", 784, 10, seed=4)
    assert np.array_equal(p_again[1:], p[1:]) and not np.array_equal(p_other, p_again)
    lr = make_baseline_model("lr", (28, 28, 1), 10)
    assert lr.layer_sizes == (784, 10)
    with pytest.raises(ValueError):
        make_baseline_model("cnn", 10, 2)


# --------------------------------------------------------------------------- #
# Estimators
# --------------------------------------------------------------------------- #


def _mean_cosine(estimate, g, draws):
    cos = []
    for seed in range(draws):
        e = estimate(seed)
        cos.append(e @ g / (np.linalg.norm(e) * np.linalg.norm(g)))
    return float(np.mean(cos))


def _lr_objective(seed=1):
    """The losses of a stack of LR parameter vectors (J, P) -> (J,) on 32 rows, a point p, and the gradient there."""
    data = make_problem(seed, n_clients=1)[0]
    model, p = initial("lr", seed)
    x, y = data.x_train[:32], data.y_train[:32]
    return (lambda W: np.array([model.loss(w, x, y) for w in W])), p, model.grad(p, x, y)


def test_fedzo_estimator_approaches_gradient():
    f, w, g = _lr_objective()
    cosines = [_mean_cosine(lambda s: zo_sphere_gradient(f, w, b2, 1e-4, DirectionStream(s)), g, 8)
               for b2 in (1, 10, 100, 1000)]
    assert all(a < b for a, b in zip(cosines, cosines[1:])), cosines
    assert cosines[-1] > 0.9, cosines
    # Unbiased (up to O(mu)): the average of many one-direction estimates points along g.
    mean = np.mean([zo_sphere_gradient(f, w, 1, 1e-4, DirectionStream(s)) for s in range(3000)], axis=0)
    assert mean @ g / (np.linalg.norm(mean) * np.linalg.norm(g)) > 0.9


def test_fedzo_estimator_is_the_two_point_formula_without_numpys_norm(monkeypatch):
    # The directions are normalized without np.linalg.norm, whose dot runs on NumPy's BLAS and
    # made a FedZO round 5x slower under 2 cores next to the model's products on SciPy's BLAS.
    f, w, _ = _lr_objective()
    b2, mu, d = 7, 1e-3, w.size
    draws = np.empty((b2, d))
    DirectionStream(3).rows(draws)
    directions = [v / np.sqrt(v @ v) for v in draws]
    expected = d / (b2 * mu) * sum((f([w + mu * v])[0] - f([w])[0]) * v for v in directions)

    def refuse(*args, **kwargs):
        raise AssertionError("zo_sphere_gradient called np.linalg.norm")

    monkeypatch.setattr(np.linalg, "norm", refuse)
    estimates = [zo_sphere_gradient(f, w, b2, mu, DirectionStream(3), block=block) for block in (1, 3, 7)]
    # The estimator steps by (mu / ||u||) u rather than mu (u / ||u||): a loss's rounding, divided by a
    # difference of order mu |g . v|, leaves about 1e-12 relative between the two ways of writing it.
    assert_close(estimates[0], expected, np.float64, rtol=1e-10)
    for other in estimates[1:]:  # any block of directions at a time: the same numbers
        assert np.array_equal(other, estimates[0])


def test_direction_streams_are_normal_and_depend_on_key_and_index_only():
    from scipy import stats

    draws = np.empty((50, 4000))
    sumsq = DirectionStream(11).rows(draws)
    assert stats.kstest(draws.ravel(), "norm").pvalue > 1e-3
    assert_close(sumsq, (draws * draws).sum(axis=1), np.float64, rtol=1e-12)
    # In pieces: the same numbers, whatever the rows' shape.
    stream = DirectionStream(11)
    first, rest = np.empty((1, 7)), np.empty((3, 66_664))
    stream.rows(first)
    stream.rows(rest)
    assert np.array_equal(np.concatenate([first.ravel(), rest.ravel()]), draws.ravel()[:7 + 3 * 66_664])
    other = np.empty((1, 4000))
    DirectionStream(12).rows(other)
    assert abs(np.corrcoef(other[0], draws[0])[0, 1]) < 0.1
    # A seed sequence is hashed to a key: one stream per (seed, client, round, algorithm).
    assert DirectionStream([0, 1, 2, 4, 0xD1]).key != DirectionStream([0, 2, 2, 4, 0xD1]).key


def test_baffle_stein_estimator_approaches_gradient_and_clips():
    f, w, g = _lr_objective()
    cosines = [_mean_cosine(lambda s: stein_gradient(f, w, K, 1e-4, DirectionStream(s), clip=None), g, 8)
               for K in (1, 10, 100, 1000)]
    assert all(a < b for a, b in zip(cosines, cosines[1:])), cosines
    assert cosines[-1] > 0.9, cosines
    raw = stein_gradient(f, w, 50, 1e-4, DirectionStream(0), clip=None)
    clipped = stein_gradient(f, w, 50, 1e-4, DirectionStream(0), clip=0.3)
    assert np.abs(raw).max() > 0.3  # the test exercises the clipping
    assert np.abs(clipped).max() <= 0.3
    assert_close(clipped, np.clip(raw, -0.3, 0.3), np.float64)


# --------------------------------------------------------------------------- #
# Algorithms
# --------------------------------------------------------------------------- #


def test_fedavg_learns_separable_problem():
    data = make_problem(0)
    model, p0 = initial("lr")
    x, y = pooled(data)
    out = run_baseline(transport_for(data), "fedavg", 3, clock=Clock(), lr=0.1, batch_size=16, local_epochs=1)
    assert model.loss(out["params"], x, y) < 0.5 * model.loss(p0, x, y)
    assert out["accuracy"] > 0.8
    assert out["best_accuracy"] >= out["accuracy"]
    assert [r["stage"] for r in out["rounds"]] == ["federated"] * 3
    assert all(r["layer"] is None for r in out["rounds"])


def test_fedavg_dnn_learns():
    data = make_problem(1)
    out = run_baseline(transport_for(data, "dnn"), "fedavg", 3, clock=Clock(), lr=0.1, batch_size=16)
    assert out["accuracy"] > 0.8


@pytest.mark.parametrize("algorithm,hyper", [
    ("fedzo", dict(lr=0.05, local_iters=10, b1=16, b2=20, mu=1e-3)),
    ("baffle", dict(lr=0.1, batch_size=32, K=30, sigma=1e-4, clip=0.3)),
])
def test_zeroth_order_baselines_decrease_loss(algorithm, hyper):
    data = make_problem(2)
    model, p0 = initial("lr")
    x, y = pooled(data)
    out = run_baseline(transport_for(data), algorithm, 3, clock=Clock(), **hyper)
    assert model.loss(out["params"], x, y) < 0.7 * model.loss(p0, x, y)
    assert out["accuracy"] > 0.6


def _local_optimum(model, w, data, steps=3000, lr=0.5):
    w = w.copy()
    for _ in range(steps):
        w -= lr * model.grad(w, data.x_train, data.y_train)
    return w


def test_pfedme_personalizes_toward_local_optimum():
    # Heterogeneous, overlapping clients (each its own class centers, noisy): finite local optima.
    data = make_problem(3, n_clients=3, spread=1.0, noise=1.0, shared_centers=False)
    transport = transport_for(data)
    model, p0 = initial("lr")
    acc0 = sum(transport.client(c).evaluate(p0)["correct"] for c in transport.client_ids) / sum(
        d.n_test for d in data)
    out = run_baseline(transport, "pfedme", 4, clock=Clock(), lr=0.05, personal_lr=0.05, lamda=15.0, K=5,
                       batch_size=16, local_epochs=10, beta=1.0)
    w = out["params"]
    for cid, d in zip(transport.client_ids, data):
        theta = transport.client(cid).theta
        w_star = _local_optimum(model, w, d)
        assert np.linalg.norm(theta - w_star) < np.linalg.norm(w - w_star)
        assert model.loss(theta, d.x_train, d.y_train) < model.loss(w, d.x_train, d.y_train)
    assert out["accuracy"] > acc0 + 0.2
    # Personalized accuracy (evaluate() without params) is what the run reports.
    correct = sum(transport.client(c).evaluate()["correct"] for c in transport.client_ids)
    assert out["accuracy"] == pytest.approx(correct / sum(d.n_test for d in data))


def test_pfedme_beta_mixes_global_model():
    data = make_problem(4, n_clients=2)
    _, p0 = initial("lr")
    hyper = dict(lr=0.05, personal_lr=0.05, lamda=15.0, K=2, batch_size=8, local_epochs=2)
    full = run_baseline(transport_for(data), "pfedme", 1, clock=Clock(), beta=1.0, **hyper)["params"]
    half = run_baseline(transport_for(data), "pfedme", 1, clock=Clock(), beta=0.5, **hyper)["params"]
    assert_close(half, 0.5 * p0 + 0.5 * full, np.float64)


def test_pfedzo_runs_and_decreases_loss():
    data = make_problem(5, n_clients=3)
    transport = transport_for(data)
    model, p0 = initial("lr")
    x, y = pooled(data)
    out = run_baseline(transport, "pfedzo", 3, clock=Clock(), lr=0.05, personal_lr=0.01, lamda=15.0, K=3,
                       batch_size=16, local_epochs=8, b2=10, mu=1e-3, beta=1.0)
    assert model.loss(out["params"], x, y) < 0.8 * model.loss(p0, x, y)
    for cid, d in zip(transport.client_ids, data):
        theta = transport.client(cid).theta
        assert model.loss(theta, d.x_train, d.y_train) < model.loss(p0, d.x_train, d.y_train)


def test_defaults_registry_runs_every_algorithm():
    data = make_problem(6, n_clients=2, n=60)
    for algorithm in BASELINES:
        assert set(BASELINES[algorithm]) == {"mnist", "synthetic"}
        for dataset in ("mnist", "synthetic"):
            assert set(BASELINES[algorithm][dataset]) == {"lr", "dnn"}
        hyper = baseline_hyper(algorithm, "synthetic", "lr", lr=0.01)
        assert hyper["lr"] == 0.01 and hyper.pop("rounds") >= 1
        out = run_baseline(transport_for(data), algorithm, 1, clock=Clock(), **hyper)
        assert np.isfinite(out["params"]).all() and 0.0 <= out["accuracy"] <= 1.0
    assert baseline_hyper("pfedme", "mnist", "dnn")["lamda"] == 30.0
    assert baseline_hyper("baffle", "fashion-mnist", "lr")["K"] == 100
    with pytest.raises(ValueError):
        baseline_hyper("fedprox", "mnist", "lr")
    with pytest.raises(ValueError):
        run_baseline(transport_for(data), "fedsgd", 1)


# --------------------------------------------------------------------------- #
# Time records
# --------------------------------------------------------------------------- #


def test_time_records():
    data = make_problem(7, n_clients=3)
    transport = transport_for(data, cores=1)
    clock = Clock(bandwidth_bytes_per_s=1e6, latency_s=1e-3)
    n_params = initial("lr")[0].n_params
    messages = []
    out = run_baseline(transport, "fedavg", 3, clock=clock, eval_every=2, progress=messages.append,
                       lr=0.1, batch_size=16)
    assert len(messages) == 3
    assert [r["accuracy"] is None for r in out["rounds"]] == [True, False, False]  # rounds 2 and 3 (last)
    assert out["best_accuracy"] == max(r["accuracy"] for r in out["rounds"] if r["accuracy"] is not None)
    down = clock.transfer(n_params * 8)
    up = clock.transfer(n_params * 8 + 8)  # the parameters plus the sample count
    for record in out["rounds"]:
        assert set(record) == {"stage", "layer", "accuracy", "server_s", "bytes_up", "bytes_down", "clients",
                               "wall_s"}
        assert record["wall_s"] >= max(t["compute_s"] for t in record["clients"].values())
        assert record["bytes_up"] > 0 and record["bytes_down"] > 0
        assert record["server_s"] >= 0
        clients = record["clients"]
        assert set(clients) == {str(c) for c in transport.client_ids}
        latest = max(t["arrival_s"] for t in clients.values())
        slowest = max(clients, key=lambda c: clients[c]["arrival_s"])
        assert clients[slowest]["idle_s"] == 0.0
        for t in clients.values():
            assert t["compute_s"] > 0
            assert t["comm_s"] == pytest.approx(up + down) and t["comm_s"] > 0
            assert t["arrival_s"] == pytest.approx(t["compute_s"] + up)
            assert t["idle_s"] == pytest.approx(latest - t["arrival_s"])
    summary = time_summary(out["rounds"])
    assert summary["comm_s"] == pytest.approx(3 * (up + down))
    # An infinite-bandwidth clock moves the parameters for free.
    free = run_baseline(transport, "fedavg", 1, clock=Clock(float("inf")), lr=0.1, batch_size=16)
    assert all(t["comm_s"] == 0.0 for t in free["rounds"][0]["clients"].values())


def test_fedavg_averages_the_clients_weighted_by_their_samples():
    """McMahan et al.'s FedAvg: the new global model is sum_i n_i w_i / sum_i n_i, not the plain mean."""
    data = make_problem(6, n_clients=2)
    data[1] = ClientData(data[1].x_train[:20], data[1].y_train[:20], data[1].x_test, data[1].y_test)
    _, p0 = initial("lr")
    hyper = dict(lr=0.1, batch_size=8, local_epochs=1)
    out = run_baseline(transport_for(data), "fedavg", 1, clock=Clock(), init_params=p0, **hyper)
    local = [BaselineClient(i, d, "lr", N_CLASSES, 0, 1).local_train("fedavg", p0, 0, **hyper)
             for i, d in enumerate(data)]
    assert [r["n"] for r in local] == [90, 20]
    expected = (90 * local[0]["params"] + 20 * local[1]["params"]) / 110
    assert_close(out["params"], expected, np.float64, rtol=1e-12)
    assert not np.allclose(out["params"], (local[0]["params"] + local[1]["params"]) / 2)
