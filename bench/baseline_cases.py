"""Shared cases of the baselines' benchmarks: MNIST-shaped clients, one round per engine, flop counts.

The clients have MNIST's shape (784 features, 10 classes) and the training
sizes of the paper's MNIST partition (100 clients, Dirichlet beta = 0.1,
75 % of each client's samples; 52,466 rows in all) when the MNIST files are
found, else sizes drawn from the same kind of skew. Pixels are random: a
round's time does not depend on them.
"""

from __future__ import annotations

import numpy as np

from fedlayer.baselines import BASELINES, BaselineClient, baseline_hyper
from fedlayer.baselines.cohort import ClientCohort
from fedlayer.baselines.models import make_baseline_model
from fedlayer.data import ClientData

N_FEATURES, N_CLASSES = 784, 10


def client_sizes(n_clients=100, seed=0):
    """Training rows per client: MNIST's partition when its files are found, else a Dirichlet-skewed draw."""
    try:
        from fedlayer.run import RunConfig, load_dataset

        dataset = load_dataset(RunConfig(dataset="mnist", clients=n_clients, seed=seed))
        return [c.n_train for c in dataset.clients]
    except FileNotFoundError:
        rng = np.random.default_rng(seed)
        shares = rng.dirichlet(np.full(n_clients, 0.5))
        return [max(8, int(s)) for s in shares * 52466]


def make_clients(sizes, model="dnn", cores=1, seed=0):
    rng = np.random.default_rng(seed)
    clients = []
    for cid, n in enumerate(sizes):
        x = rng.random((n, N_FEATURES)).astype(np.float32)
        y = rng.integers(0, N_CLASSES, n)
        clients.append(BaselineClient(cid, ClientData(x, y, x[:1], y[:1]), model, N_CLASSES, seed, cores))
    return clients


def round_runner(clients, algorithm, engine, hyper, cores):
    """A callable that runs one local round of every client from the same global parameters."""
    if engine == "batched":
        ClientCohort(clients, cores=cores)
    w = clients[0].initial_params()["params"]
    counter = iter(range(1 << 30))

    def one_round():
        r = next(counter)  # a fresh round index each call: the cohort never reuses a finished round
        return [c.local_train(algorithm, w, r, **hyper) for c in clients]

    return one_round


def hyper_of(algorithm, model="dnn", dataset="mnist", **overrides):
    """The local round's hyperparameters: the defaults but the round count and the server's beta."""
    hyper = baseline_hyper(algorithm, dataset, model, **overrides)
    hyper.pop("rounds")
    hyper.pop("beta", None)
    return hyper


def round_flops(algorithm, sizes, model="dnn", hyper=None):
    """Multiply-adds x 2 of one round's model products (forward, and backward where there is one)."""
    net = make_baseline_model(model, N_FEATURES, N_CLASSES)
    per_row = 2 * sum(a * b for a, b in zip(net.layer_sizes[:-1], net.layer_sizes[1:]))  # one forward
    hyper = hyper or hyper_of(algorithm, model)
    if algorithm == "fedavg":
        return 3 * per_row * sum(sizes) * hyper["local_epochs"]  # forward + the two backward products
    if algorithm == "baffle":
        return (hyper["K"] + 1) * per_row * sum(sizes) * hyper["local_epochs"]
    if algorithm == "fedzo":
        rows = sum(min(hyper["b1"], n) for n in sizes)
        return (hyper["b2"] + 1) * per_row * rows * hyper["local_iters"]
    rows = sum(min(hyper["batch_size"], n) for n in sizes) * hyper["local_epochs"] * hyper["K"]
    return (3 if algorithm == "pfedme" else hyper["b2"] + 1) * per_row * rows


def draws(algorithm, sizes, model="dnn", hyper=None):
    """Normal draws of one round (zeroth-order baselines)."""
    n_params = make_baseline_model(model, N_FEATURES, N_CLASSES).n_params
    hyper = hyper or hyper_of(algorithm, model)
    if algorithm == "baffle":
        batches = sum(-(-n // hyper["batch_size"]) for n in sizes) * hyper["local_epochs"]
        return batches * hyper["K"] * n_params
    if algorithm == "fedzo":
        return len(sizes) * hyper["local_iters"] * hyper["b2"] * n_params
    if algorithm == "pfedzo":
        return len(sizes) * hyper["local_epochs"] * hyper["K"] * hyper["b2"] * n_params
    return 0


ALGORITHMS = sorted(BASELINES)
