"""The client side of FedACnnL / pFedACnnL: local statistics, weights, personalization.

A client owns its data and its copy of the model. Everything it does is
called by the server through a transport (in-process or MPI), by method name,
so the same code runs in both.
"""

from __future__ import annotations

import time

import numpy as np

import fastls

from .data import ClientData, one_hot
from .models import Model

__all__ = ["Client", "label_encoders", "encoder_for_clustering", "init_weights"]


def label_encoders(seed, n_classes, widths):
    """The set Q = {Q_l} of label-encoding matrices, identical on every client.

    Parameters
    ----------
    seed : int
        The seed the server broadcasts (Algorithm 1, line 1).
    n_classes : int
    widths : list of int
        Output width d_l of every trainable layer; the last one (the output
        layer, whose target is Y itself) gets no encoder.

    Returns
    -------
    list of ndarray of shape (n_classes, d_l), float64, standard normal
    """
    rng = np.random.default_rng([seed, 0x51])
    return [rng.standard_normal((n_classes, width)) for width in widths[:-1]]


def encoder_for_clustering(encoders, n_classes):
    """Q_enc: the encoder of the narrowest layer (eq. 8).

    A one-layer model (LR) has no hidden encoder; the identity is used then,
    so h_i is the client's normalized label histogram.
    """
    if not encoders:
        return np.eye(n_classes)
    return min(encoders, key=lambda Q: Q.shape[1])


def init_weights(model, seed):
    """Seeded initial weights (scaled normal), identical on every client.

    FedACnnL replaces every layer's weights, so the initial ones only matter
    for the per-round accuracy of a model whose later layers are untrained.
    """
    rng = np.random.default_rng([seed, 0x1A])
    for index in model.trainable:
        layer = model.layers[index]
        n_in, n_out = layer.ls_shape(model.input_shape_of(index))
        layer.set_weights(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in))


class Client:
    """One federated client.

    Parameters
    ----------
    client_id : int
    data : ClientData
        Local train/test split; x of shape (n, *feature_shape).
    model_config : dict
        ``Model.config()`` of the shared architecture.
    seed : int
        Broadcast seed: label encoders and initial weights.
    n_classes : int
    cores : int
        Cores this client may use; its local computation runs under
        ``fastls.limit_cores(cores)`` (the paper's 1-4-core edge devices).
    stat_dtype : numpy dtype, default float64
        dtype of the uploaded statistics X^T X and X^T Z.
    scratch_bytes : int
        Working memory bound for convolution statistics.
    """

    def __init__(self, client_id, data: ClientData, model_config, seed, n_classes, cores=1,
                 stat_dtype=np.float64, scratch_bytes=64 * 2**20):
        self.client_id = int(client_id)
        self.data = data
        self.model = Model.from_config(model_config)
        self.seed = int(seed)
        self.n_classes = int(n_classes)
        self.cores = int(cores)
        self.stat_dtype = np.dtype(stat_dtype)
        self.scratch_bytes = int(scratch_bytes)
        init_weights(self.model, self.seed)
        widths = [self.model.layers[i].ls_shape(self.model.input_shape_of(i))[1] for i in self.model.trainable]
        self.encoders = label_encoders(self.seed, self.n_classes, widths)
        self.meta_weights = {}  # position -> the group's meta-model weights, kept for personalization
        # The first core limit in a process builds threadpoolctl's controller
        # (it inspects every loaded library); do it now, outside the timed rounds.
        fastls.blas_info()

    # -- helpers -----------------------------------------------------------
    def _targets(self, position, labels):
        """Z_l = Y Q_l for a hidden layer, Y for the output layer."""
        Y = one_hot(labels, self.n_classes, dtype=self.model.dtype)
        if position < len(self.encoders):
            return Y @ self.encoders[position].astype(self.model.dtype, copy=False)
        return Y

    def _statistics(self, position, batch_size, rng):
        """(X_l^T X_l, X_l^T Z_l) over the local training set, batch by batch (eq. 6)."""
        layer_index = self.model.trainable[position]
        layer = self.model.layers[layer_index]
        n_in, n_out = layer.ls_shape(self.model.input_shape_of(layer_index))
        G = np.zeros((n_in, n_in), dtype=self.stat_dtype)
        C = np.zeros((n_in, n_out), dtype=self.stat_dtype)
        order = rng.permutation(self.data.n_train) if rng is not None else np.arange(self.data.n_train)
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            x = self.model.forward(self.data.x_train[batch], stop=layer_index)
            layer.accumulate(G, C, x, self._targets(position, self.data.y_train[batch]),
                             scratch_bytes=self.scratch_bytes)
        return G, C

    # -- methods the server calls -------------------------------------------
    def label_summary(self):
        """h_i = (mean label vector of the local training set) Q_enc (eq. 9)."""
        Y = one_hot(self.data.y_train, self.n_classes, dtype=np.float64)
        return {"h": Y.mean(axis=0) @ encoder_for_clustering(self.encoders, self.n_classes)}

    def local_stats(self, position, batch_size, round_index=0):
        """Local computation of one round: the two items uploaded to the server.

        Batches of ``batch_size`` samples are drawn without replacement in a
        seeded random order; the sums do not depend on it (weight invariance).
        """
        if batch_size < 1:
            raise ValueError(f"client {self.client_id}: batch_size must be >= 1, got {batch_size}")
        rng = np.random.default_rng([self.seed, self.client_id, round_index])
        start = time.perf_counter()
        with fastls.limit_cores(self.cores):
            G, C = self._statistics(position, int(batch_size), rng)
        return {"G": G, "C": C, "n": self.data.n_train, "compute_s": time.perf_counter() - start}

    def set_weights(self, position, weights):
        """Replace layer ``position`` by the (group's) trained weights."""
        self.model.layers[self.model.trainable[position]].set_weights(weights)
        self.meta_weights[position] = weights
        return {}

    def personalize(self, position, eps, batch_size):
        """Local personalization of one layer (eq. 13), through this client's own earlier layers."""
        start = time.perf_counter()
        with fastls.limit_cores(self.cores):
            G, C = self._statistics(position, int(batch_size), None)
            W = fastls.proximal_solve(G, C, eps, self.meta_weights[position].astype(self.stat_dtype, copy=False),
                                      overwrite_g=True, overwrite_c=True)
        self.model.layers[self.model.trainable[position]].set_weights(np.ascontiguousarray(W))
        return {"compute_s": time.perf_counter() - start}

    def evaluate(self, batch_size=4096):
        """(correct, total) of this client's current model on its local test split, in batches."""
        correct, total = self.model.accuracy(self.data.x_test, self.data.y_test, batch_size=batch_size)
        return {"correct": int(correct), "total": int(total)}

    def final_weights(self):
        """Weights of every trainable layer (for checks and saving)."""
        return {"weights": [self.model.layers[i].weights for i in self.model.trainable]}
