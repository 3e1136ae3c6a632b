"""How the fixtures of tests/test_server.py were made, with fedlayer as it was before fedlayer.server (commit 6900a3b).

    PYTHONPATH=<checkout of 6900a3b> python tests/data/make_format2_checkpoint.py \
        tests/data/checkpoint_format2_layer1.npz tests/data/weights_before_server_stages.npz

The first file is the checkpoint that code wrote after layer 1 of a
pFedACnnL-WP-like run (two K-means groups, fixed batch sizes, gamma by GCV
pooled over the groups); the second holds the weights of the whole run (three
layers) per group. The data are tests/test_federated.py's make_data at seed 44.
"""

import sys

import numpy as np

from fedlayer.client import Client
from fedlayer.data import ClientData
from fedlayer.federated import Variant, run_protocol
from fedlayer.models import build_model
from fedlayer.transport import InProcessTransport

N_CLASSES = 4


def make_data(rng, n=240, d=12):
    centers = rng.standard_normal((N_CLASSES, d)) * 2
    y = rng.integers(0, N_CLASSES, size=n)
    x = centers[y] + rng.standard_normal((n, d))
    return x, y


def client_data(x, y, idx, n_test=5):
    test = np.arange(n_test) % len(x)
    return ClientData(x_train=x[idx], y_train=y[idx], x_test=x[test], y_test=y[test])


def clients():
    x, y = make_data(np.random.default_rng(44), n=120)
    config = build_model("dnn", (12,), N_CLASSES, width=0.25).config()
    return [Client(i, client_data(x, y, p), config, seed=3, n_classes=N_CLASSES)
            for i, p in enumerate(np.array_split(np.arange(120), 4))]


if __name__ == "__main__":
    variant = Variant(adaptive=False, cluster=True)
    run_protocol(InProcessTransport(clients()), 1, variant, groups=2, batch_size=7, gamma="auto",
                 checkpoint=sys.argv[1], fingerprint={"test": "before the server stages"})
    whole = run_protocol(InProcessTransport(clients()), 3, variant, groups=2, batch_size=7, gamma="auto")
    np.savez(sys.argv[2], **{f"w_{k}_{i}": W for k, layers in whole["group_weights"].items()
                             for i, W in enumerate(layers)})
