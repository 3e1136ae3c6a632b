"""FedACnnL / pFedACnnL protocol: weight invariance, personalization, clustering, time, memory, errors."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastls
from fedlayer.client import Client, encoder_for_clustering, label_encoders
from fedlayer.data import ClientData
from fedlayer.server import VARIANTS, Variant, adaptive_batch_sizes, run_protocol
from fedlayer.models import build_model
from fedlayer.timing import Clock, time_summary
from fedlayer.transport import InProcessTransport
from fedlayer.options import BatchPolicy, ServerOptions
from tests.numeric_checks import assert_close

from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, make_data, run_clients


@settings(max_examples=25, deadline=None)
@given(
    n_clients=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    adaptive=st.booleans(),
    data=st.data(),
)
def test_fedacnnl_equals_centralized_acnnl(n_clients, seed, adaptive, data):
    """The weight-invariant property: any partition, batch sizes, client order and forward mode give ACnnL's weights."""
    rng = np.random.default_rng(seed)
    x, y = make_data(rng)
    config = dnn_config(x.shape[1])
    central, _ = run_clients([client_data(x, y, np.arange(len(x)))], Variant(adaptive=False), config=config,
                             batch_size=len(x), max_batch_size=len(x))
    # Random disjoint partition covering every sample (clients may be very unequal).
    cuts = np.sort(rng.choice(np.arange(1, len(x)), size=n_clients - 1, replace=False))
    parts = np.split(rng.permutation(len(x)), cuts)
    batches = {i: data.draw(st.integers(1, 64)) for i in range(n_clients)}
    order = data.draw(st.permutations(range(n_clients)))
    federated, _ = run_clients([client_data(x, y, p) for p in parts], Variant(adaptive=adaptive), config=config,
                               batch_size=batches, max_batch_size={i: 64 for i in range(n_clients)}, order=order,
                               forward=data.draw(st.sampled_from(["cached", "batch"])))
    for W_fed, W_central in zip(federated["group_weights"][0], central["group_weights"][0]):
        assert_close(W_fed, W_central, np.float64, rtol=1e-10)


def test_centralized_acnnl_matches_numpy_layer_by_layer(rng):
    """ACnnL itself: each layer is the ridge solution of eq. (2) on the previous layer's outputs."""
    x, y = make_data(rng, n=150, d=7)
    config = dnn_config(7)
    outcome, transport = run_clients([client_data(x, y, np.arange(150))], Variant(adaptive=False), config=config,
                                     batch_size=150, max_batch_size=150, gamma=3.0)
    client = transport.client(0)
    encoders = label_encoders(3, N_CLASSES, [32, 16, N_CLASSES])
    Y = np.eye(N_CLASSES)[y]
    h = x
    for position, W in enumerate(outcome["group_weights"][0]):
        A = np.hstack([h, np.ones((len(h), 1))])
        Z = Y @ encoders[position] if position < len(encoders) else Y
        W_ref = np.linalg.solve(A.T @ A + 3.0 * np.eye(A.shape[1]), A.T @ Z)
        assert_close(W, W_ref, np.float64, rtol=1e-10)
        h = np.maximum(A @ W_ref, 0) if position < 2 else A @ W_ref
    assert client.evaluate()["total"] == 5


def test_personalization_solves_eq13(rng):
    x, y = make_data(rng, n=60, d=5)
    config = build_model("lr", (5,), N_CLASSES).config()
    client = Client(0, client_data(x, y, np.arange(60)), config, seed=0, n_classes=N_CLASSES)
    M = rng.standard_normal((6, N_CLASSES))
    client.set_weights(0, M)
    client.personalize(0, eps=7.0, batch_size=13)
    A = np.hstack([x, np.ones((60, 1))])
    Y = np.eye(N_CLASSES)[y]
    W_ref = np.linalg.solve(A.T @ A + 7.0 * np.eye(6), A.T @ Y + 7.0 * M)
    assert_close(client.model.layers[client.model.trainable[0]].weights, W_ref, np.float64, rtol=1e-12)


def test_label_summary_is_eq9(rng):
    x, y = make_data(rng, n=40, d=5)
    config = dnn_config(5)
    client = Client(0, client_data(x, y, np.arange(40)), config, seed=11, n_classes=N_CLASSES)
    encoders = label_encoders(11, N_CLASSES, [32, 16, N_CLASSES])
    Q_enc = encoder_for_clustering(encoders, N_CLASSES)
    assert Q_enc.shape == (N_CLASSES, 16)  # the narrowest hidden layer (eq. 8)
    expected = np.bincount(y, minlength=N_CLASSES) / 40 @ Q_enc
    assert_close(client.label_summary()["h"], expected, np.float64)


def test_clustering_groups_clients_with_the_same_labels(rng):
    x, y = make_data(rng, n=400, d=6)
    by_class = [np.flatnonzero(y == c) for c in range(N_CLASSES)]
    # Clients 0-2 hold classes {0, 1}; clients 3-5 hold classes {2, 3}.
    parts = [np.concatenate([by_class[0][i::3], by_class[1][i::3]]) for i in range(3)]
    parts += [np.concatenate([by_class[2][i::3], by_class[3][i::3]]) for i in range(3)]
    outcome, transport = run_clients([client_data(x, y, p) for p in parts], VARIANTS["pfedacnnl"],
                                     config=dnn_config(6), groups=2)
    groups = outcome["groups"]
    assert len({groups[str(i)] for i in range(3)}) == 1
    assert len({groups[str(i)] for i in range(3, 6)}) == 1
    assert groups["0"] != groups["3"]
    assert len(outcome["group_weights"]) == 2
    # Personalization ran: each client's last layer differs from its group's meta-model.
    stages = [r["stage"] for r in outcome["rounds"]]
    assert stages == ["initialization"] + ["federated"] * 3 + ["personalization"] * 3
    client = transport.client(0)
    assert not np.allclose(client.model.layers[client.model.trainable[-1]].weights,
                           outcome["group_weights"][groups["0"]][-1])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_runs_and_learns(rng, name):
    x, y = make_data(rng, n=300, d=8)
    parts = np.array_split(rng.permutation(300), 6)
    outcome, _ = run_clients([client_data(x, y, p, n_test=60) for p in parts], VARIANTS[name],
                             config=dnn_config(8), groups=2)
    assert outcome["accuracy"] > 0.8  # well-separated classes
    variant = VARIANTS[name]
    assert ("initialization" in [r["stage"] for r in outcome["rounds"]]) == variant.cluster
    assert ("personalization" in [r["stage"] for r in outcome["rounds"]]) == variant.personalize


@pytest.mark.parametrize("eval_every", [2, 3, 7])
def test_eval_every_skips_evaluations_not_training(rng, eval_every):
    x, y = make_data(rng, n=300, d=8)
    datas = [client_data(x, y, p, n_test=60) for p in np.array_split(rng.permutation(300), 6)]
    variant = Variant(adaptive=False, cluster=True, personalize=True)  # fixed batches: bit-identical weights
    every, _ = run_clients(datas, variant, config=dnn_config(8), groups=2)
    some, _ = run_clients(datas, variant, config=dnn_config(8), groups=2, eval_every=eval_every)
    trained = [r for r in some["rounds"] if r["stage"] != "initialization"]
    evaluated = [i + 1 for i, r in enumerate(trained) if r["accuracy"] is not None]
    assert evaluated == sorted({i for i in range(1, 7) if i % eval_every == 0} | {6})
    assert all("eval_s" not in r for r in trained if r["accuracy"] is None)  # no evaluation, no time
    assert some["accuracy"] == every["accuracy"]  # the last round is always evaluated
    with pytest.raises(ValueError, match="eval_every must be >= 1"):
        run_clients(datas, variant, config=dnn_config(8), eval_every=0)


def test_groups_larger_than_clients_is_an_error(rng):
    x, y = make_data(rng, n=40)
    with pytest.raises(ValueError, match=r"groups \(K=10\) cannot exceed the number of clients \(2\)"):
        run_clients([client_data(x, y, np.arange(20)), client_data(x, y, np.arange(20, 40))],
                    VARIANTS["pfedacnnl"], config=dnn_config(12), groups=10)


@pytest.mark.parametrize("split", ["train", "test"])
def test_nan_in_client_data_is_a_clear_error(rng, split):
    # Refused where the client's data is made, before any client runs (a NaN test sample was scored silently).
    x, y = make_data(rng, n=40)
    x[3, 2] = np.nan
    data = {"x_train": x[4:], "y_train": y[4:], "x_test": x[4:], "y_test": y[4:], f"x_{split}": x[:8],
            f"y_{split}": y[:8]}
    with pytest.raises(ValueError, match=f"x_{split} contains NaN or Inf; expected finite inputs"):
        ClientData(**data)


@pytest.mark.parametrize("labels,message", [
    ([0, 1, -1], "y_train must hold class indices \\(integers >= 0\\)"),
    ([0.0, 1.0, 2.0], "y_train must hold class indices"),
    ([0, 1, N_CLASSES], f"y_train holds class {N_CLASSES}, but the model has {N_CLASSES} classes"),
])
def test_labels_outside_the_classes_are_a_clear_error(rng, labels, message):
    x = rng.standard_normal((3, 12))
    with pytest.raises(ValueError, match=message):
        data = ClientData(x, np.array(labels), x, np.array(labels))
        Client(0, data, dnn_config(12), seed=0, n_classes=N_CLASSES)


def test_a_split_without_test_samples_is_refused_before_training(rng):
    from fedlayer.run import RunConfig, load_dataset, run

    dataset = load_dataset(RunConfig(clients=4, model="lr"))
    dataset.clients[:] = [ClientData(c.x_train, c.y_train, c.x_test[:0], c.y_test[:0]) for c in dataset.clients]
    with pytest.raises(ValueError, match="no client has a test sample"):
        run(RunConfig(clients=4, model="lr", groups=2), dataset=dataset)


def test_adaptive_batch_sizes_eq7():
    first = {0: 1.0, 1: 2.0, 2: 4.0}
    now = {0: 1.5, 1: 2.0, 2: 8.0}
    sizes = adaptive_batch_sizes(now, first, {0: 10, 1: 10, 2: 10}, {0: 100, 1: 100, 2: 50})
    assert sizes == {0: 15, 1: 20, 2: 50}  # ceil(1.5/1*10), ceil(2/1*10), capped at B_max


def test_time_accounting(rng):
    x, y = make_data(rng, n=200)
    parts = np.array_split(np.arange(200), 4)
    clock = Clock(bandwidth_bytes_per_s=1e6, latency_s=1e-3)
    outcome, _ = run_clients([client_data(x, y, p) for p in parts], VARIANTS["fedacnnl-wa"], config=dnn_config(12),
                             clock=clock)
    for record in outcome["rounds"]:
        clients = record["clients"]
        arrivals = {cid: t["arrival_s"] for cid, t in clients.items()}
        slowest = max(arrivals.values())
        for _cid, t in clients.items():
            assert t["idle_s"] == pytest.approx(slowest - t["arrival_s"])
            assert t["comm_s"] > 1e-3  # latency up and down, plus bytes / bandwidth
        assert min(t["idle_s"] for t in clients.values()) == 0.0
    # First layer: G is 13 x 13 and C 13 x 32 in float64 uploaded at 1 MB/s.
    first = outcome["rounds"][0]["clients"]["0"]
    up = 1e-3 + (13 * 13 + 13 * 32) * 8 / 1e6
    down = 1e-3 + (13 * 32 * 8 + 8) / 1e6
    assert first["comm_s"] == pytest.approx(up + down)
    summary = time_summary(outcome["rounds"])
    assert summary["total_s"] == pytest.approx(summary["compute_s"] + summary["idle_s"] + summary["comm_s"])


def test_server_memory_does_not_grow_with_clients(rng):
    """Statistics are folded as they arrive: peak memory is flat in the number of clients."""
    d = 300
    x = rng.standard_normal((1200, d))
    y = rng.integers(0, N_CLASSES, size=1200)
    config = build_model("lr", (d,), N_CLASSES).config()
    peaks = {}
    for n_clients in (2, 40):
        parts = np.array_split(np.arange(1200), n_clients)
        clients = [Client(i, client_data(x, y, p), config, seed=0, n_classes=N_CLASSES) for i, p in enumerate(parts)]
        transport = InProcessTransport(clients)
        tracemalloc.start()
        run_protocol(transport, 1, VARIANTS["fedacnnl-wa"], ServerOptions(batch=BatchPolicy(16)))
        peaks[n_clients] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    stat_bytes = (d + 1) * (d + 1) * 8
    # Holding every client's G would need 40 of them (29 MB); folding needs a few.
    assert peaks[40] < peaks[2] + 4 * stat_bytes


def test_client_cores_limit_blas_threads(rng, monkeypatch):
    x, y = make_data(rng, n=50)
    client = Client(0, client_data(x, y, np.arange(50)), dnn_config(12), seed=0, n_classes=N_CLASSES, cores=1)
    seen = []
    original = fastls.gram_update

    def spy(G, X, **kwargs):
        seen.append(max(lib["num_threads"] for lib in fastls.blas_info()))
        return original(G, X, **kwargs)

    monkeypatch.setattr(fastls, "gram_update", spy)
    client.local_stats(0, 16)
    assert seen and set(seen) == {1}


def test_a_float32_model_is_kept_sent_and_shared_in_float32(rng):
    # At full DCNN width ten groups' float64 weights were 4.9 GB of the server's memory on top of the
    # clients' float32 copies; kept in the model's float32 they are one copy, shared by the clients.
    x, y = make_data(rng, n=300, d=8)
    datas = [client_data(x.astype(np.float32), y, p, n_test=60) for p in np.array_split(rng.permutation(300), 6)]
    config = build_model("dnn", (8,), N_CLASSES, width=0.25, dtype=np.float32).config()
    variant = Variant(adaptive=False, cluster=True, personalize=True)  # fixed batches: the same sums
    kept64, _ = run_clients(datas, variant, config=config, groups=2)
    kept32, transport = run_clients(datas, variant, config=config, groups=2, weights_dtype=np.float32)
    assert kept32["groups"] == kept64["groups"]
    for k, layers in kept32["group_weights"].items():
        for W32, W64 in zip(layers, kept64["group_weights"][k]):
            assert W32.dtype == np.float32 and W64.dtype == np.float64
            # the clients computed in float32 either way: the same sums, the same solve, rounded once
            np.testing.assert_array_equal(W32, W64.astype(np.float32))
    for cid in transport.client_ids:
        client = transport.client(cid)
        group = kept32["groups"][str(cid)]
        for position, M in client.meta_weights.items():
            assert M is kept32["group_weights"][group][position]  # shared, not copied
    # Personalization around the float32 meta-model: the float64 one rounded, so the same to float32 rounding.
    client32, client64 = transport.client(0), run_clients(datas, variant, config=config, groups=2)[1].client(0)
    for index in client32.model.trainable:
        assert_close(client32.model.layers[index].weights, client64.model.layers[index].weights, np.float32,
                     rtol=1e-4)


def test_eq7_batch_sizes_of_a_run_come_from_round_one_and_reach_the_clients(rng, monkeypatch):
    """Each round's batch sizes are eq. (7) of the arrival times recorded: T_l / min_j T_1^j * B_1, capped.

    A slow link makes the upload part of each arrival (eq. 7 counts it) and the ratios differ per layer,
    so a rule that took the current round as reference, left out the upload, compounded B_l instead of
    B_1, or recorded sizes the clients never used would not match.
    """
    seen = []
    real = Client.local_stats

    def spy(self, position, batch_size, *args, **kwargs):
        seen.append((position, self.client_id, batch_size))
        return real(self, position, batch_size, *args, **kwargs)

    monkeypatch.setattr(Client, "local_stats", spy)
    x, y = make_data(rng, n=200)
    parts = np.array_split(np.arange(200), 4)
    first = {i: 5 + 3 * i for i in range(4)}
    cap = {0: 10**6, 1: 10**6, 2: 10**6, 3: 15}
    outcome, _ = run_clients([client_data(x, y, p) for p in parts], VARIANTS["fedacnnl"], config=dnn_config(12),
                             batch_size=first, max_batch_size=cap, clock=Clock(bandwidth_bytes_per_s=2e5))
    rounds = outcome["rounds"]
    assert len(rounds) == 3
    used = {(position, cid): batch for position, cid, batch in seen}
    arrivals = [{int(cid): t["arrival_s"] for cid, t in record["clients"].items()} for record in rounds]
    for cid in range(4):
        assert used[(0, cid)] == rounds[0]["clients"][str(cid)]["batch_size"] == first[cid]
    for position in (1, 2):
        expected = adaptive_batch_sizes(arrivals[position - 1], arrivals[0], first, cap)
        for cid in range(4):
            assert rounds[position]["clients"][str(cid)]["batch_size"] == expected[cid] == used[(position, cid)]
            # The upload alone (the layer's G and C at 0.2 MB/s) is most of an arrival here.
            assert rounds[position - 1]["clients"][str(cid)]["comm_s"] > rounds[position - 1]["clients"][
                str(cid)]["compute_s"]
    assert used[(2, 3)] == 15  # client 3 at its cap (B_1 = 14)
    # The rule's inputs differ between the rounds, so the checks above could tell the rounds apart.
    assert len({round(min(a.values()), 9) for a in arrivals}) == 3
    assert any(used[(2, cid)] != used[(1, cid)] for cid in range(3))


def test_fedacnnl_wa_keeps_the_first_batch_sizes(rng):
    x, y = make_data(rng, n=120)
    parts = np.array_split(np.arange(120), 3)
    outcome, _ = run_clients([client_data(x, y, p) for p in parts], VARIANTS["fedacnnl-wa"], config=dnn_config(12),
                             batch_size={0: 7, 1: 9, 2: 11}, clock=Clock(bandwidth_bytes_per_s=2e5))
    for record in outcome["rounds"]:
        assert {cid: t["batch_size"] for cid, t in record["clients"].items()} == {"0": 7, "1": 9, "2": 11}


def test_personalization_of_a_run_uses_eps_not_gamma(rng):
    """pFedACnnL-WC's personalized layer is eq. (13) with eps around the meta-model (gamma elsewhere)."""
    x, y = make_data(rng, n=90, d=5)
    config = build_model("lr", (5,), N_CLASSES).config()
    parts = np.array_split(np.arange(90), 3)
    outcome, transport = run_clients([client_data(x, y, p) for p in parts], VARIANTS["pfedacnnl-wc"], config=config,
                                     gamma=2.0, eps=50.0, groups=1)
    A = np.hstack([x, np.ones((90, 1))])
    Y = np.eye(N_CLASSES)[y]
    M = np.linalg.solve(A.T @ A + 2.0 * np.eye(6), A.T @ Y)
    assert_close(outcome["group_weights"][0][0], M, np.float64, rtol=1e-10)
    for cid, p in enumerate(parts):
        W_ref = np.linalg.solve(A[p].T @ A[p] + 50.0 * np.eye(6), A[p].T @ Y[p] + 50.0 * M)
        W = transport.client(cid).model.layers[transport.client(cid).model.trainable[0]].weights
        assert_close(W, W_ref, np.float64, rtol=1e-9)


def test_time_summary_is_the_mean_over_clients_of_their_summed_rounds():
    rounds = [{"clients": {"0": {"compute_s": 1.0, "idle_s": 3.0, "comm_s": 0.5},
                           "1": {"compute_s": 4.0, "idle_s": 0.0, "comm_s": 0.5}}},
              {"clients": {"0": {"compute_s": 2.0, "idle_s": 0.0, "comm_s": 0.25},
                           "1": {"compute_s": 1.0, "idle_s": 1.0, "comm_s": 0.25}}}]
    summary = time_summary(rounds)
    assert summary == pytest.approx({"compute_s": 4.0, "idle_s": 2.0, "comm_s": 0.75, "total_s": 6.75})
