"""Small protocol cases shared by the protocol's tests: Gaussian classes, client splits, a quarter-width DNN."""

import numpy as np

from fedlayer.client import Client
from fedlayer.data import ClientData
from fedlayer.models import build_model
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from fedlayer.server import run_protocol
from fedlayer.timing import Clock
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


def dnn_config(d):
    return build_model("dnn", (d,), N_CLASSES, width=0.25).config()


def run_clients(datas, variant, *, config, batch_size=8, max_batch_size=1024, order=None, forward="cached",
                clock=Clock(), checkpoint=None, **options):
    clients = [Client(i, data, config, seed=3, n_classes=N_CLASSES, options=ClientOptions(forward=forward))
               for i, data in enumerate(datas)]
    if order is not None:
        clients = [clients[i] for i in order]
    transport = InProcessTransport(clients)
    n_layers = sum(1 for layer in config["layers"] if "units" in layer or "filters" in layer)
    outcome = run_protocol(transport, n_layers, variant,
                           ServerOptions(batch=BatchPolicy(batch_size, max_batch_size), **options), clock=clock,
                           checkpoint=checkpoint)
    return outcome, transport
