"""Gradient and zeroth-order baselines of the paper's section 5.1, in NumPy only.

The analytic methods (FedACnnL, pFedACnnL) are compared against

* **FedAvg** (McMahan et al. 2017): ``E`` local epochs of minibatch SGD,
  sample-weighted averaging of the returned parameters;
* **FedZO** (Fang et al. 2022): ``H`` local iterations of zeroth-order SGD
  with the two-point random-direction estimator (:func:`zo_sphere_gradient`);
* **BAFFLE** (Feng et al. 2025): forward-difference Stein estimator with
  Gaussian perturbations (:func:`stein_gradient`), coordinate clipping,
  one FedAvg-style local epoch per round;
* **pFedMe** (Dinh et al. 2020): Moreau-envelope personalization;
* **pFedZO** (Chen et al. 2024): pFedMe with the inner gradient replaced by
  the two-point zeroth-order estimate.

Models (:class:`BaselineModel`) are the paper's LR (multinomial logistic
regression) and DNN ([128, 64] ReLU hidden layers), float64, with
hand-written backpropagation. Parameters are one flat vector; the model knows
the shapes and hands out views (:meth:`BaselineModel.unpack`), so
perturbations and averaging are plain vector arithmetic.

Clients (:class:`BaselineClient`) are called by method name through a
:class:`fedlayer.transport.Transport`, exactly like :class:`fedlayer.client.Client`,
so the same code can run in process or under MPI. The server loop is
:func:`run_baseline`; its round records have the format of
:mod:`fedlayer.federated` (stage ``"federated"``, layer ``None``).

Estimators (w in R^d, f the mean cross-entropy on the current minibatch)
-------------------------------------------------------------------------
FedZO / pFedZO (two-point, directions uniform on the unit sphere)::

    v_j = u_j / ||u_j||,  u_j ~ N(0, I_d),  j = 1..b2
    g   = d / (b2 * mu) * sum_j [f(w + mu v_j) - f(w)] v_j

The same minibatch (size b1) is used for all b2 directions. E[g] is the
gradient of the sphere-smoothed loss, which tends to grad f as mu -> 0.

BAFFLE (forward-difference Stein estimator, Gaussian perturbations)::

    delta_k ~ N(0, sigma^2 I_d),  k = 1..K
    g = 1 / (K * sigma^2) * sum_k [f(w + delta_k) - f(w)] delta_k
    g <- clip(g, -c, c)            (coordinate-wise, c = 0.3)

The clipping bounds the infinity norm of the estimate by ``c`` (our reading
of BAFFLE's "gradient clipping at 0.3"; set ``clip=None`` to disable).

Hyperparameters
---------------
:data:`BASELINES` holds per-algorithm, per-dataset (``"mnist"``,
``"synthetic"``), per-model (``"lr"``, ``"dnn"``) defaults;
:func:`baseline_hyper` merges overrides. Sources:

=========  =========  =====================================================================
algorithm  dataset    values and source
=========  =========  =====================================================================
FedAvg     MNIST      b=20, lr=0.02 (LR and DNN), E=1, 20 rounds. lr/b: pFedMe README,
                      "Fine-tuned Parameters" (FedAvg Mnist mclr/dnn lr 0.02, batch 20);
                      rounds: paper 5.1 ("20 on MNIST according to BAFFLE"); E=1: BAFFLE's
                      one local epoch.
FedAvg     Synthetic  b=20, lr=0.02 (LR) / 0.03 (DNN), E=1, 600 rounds. pFedMe README
                      fine-tuned; rounds: paper 5.1 (600 on synthetic, after pFedMe).
FedZO      both       b2=20, mu=1e-3 (brief / FedZO reference defaults); H=20, b1=20:
                      project choice. lr=3e-2 (MNIST) / 1e-2 (Synthetic): tuned here on
                      the DNN, seed 0, 2-3 rounds (docs/results/fedzo_lr.md); LR reuses it.
BAFFLE     both       K=100, sigma=1e-4 (BAFFLE README, "MNIST ... sigma=10^-4", --K 100),
                      clip 0.3, one local epoch, b=64, lr=0.01. BAFFLE's reference steps
                      with Adam(lr 1e-2)+EMA; we use plain SGD steps (project choice).
pFedMe     MNIST      LR: lr=0.01, personal_lr=0.1, lambda=15, beta=2; DNN: lr=0.01,
                      personal_lr=0.05, lambda=30, beta=2; K=5, b=20, R=20 local rounds.
                      Source: pFedMe README (github.com/CharlieDinh/pFedMe), "Fine-tuned
                      Parameters", MNIST mclr/dnn; K=5 from its main_plot example.
pFedMe     Synthetic  LR: lr=0.01, personal_lr=0.01, lambda=20, beta=2; DNN: lr=0.01,
                      personal_lr=0.01, lambda=30, beta=2; K=5, b=20, R=20. Same source.
pFedZO     both       pFedMe's values with the inner gradient from the two-point estimator
                      (b2=20, mu=1e-3); personal_lr divided by 10 (project choice: the
                      estimator's variance grows with d/b2).
=========  =========  =====================================================================

In the pFedMe reference, ``local_epochs`` counts *local rounds* R, each on one
minibatch (``get_next_train_batch``), not passes over the data; we follow it.
The reference aggregates the clients' local models sample-weighted
(``persionalized_aggregate_parameters``: ratio ``train_samples / total_train``)
before the beta-mix, and so do we. The personalized model theta starts each
round at the received global w and is warm-started across local rounds, as
in the reference's ``UserpFedMe.train``.
"""

from __future__ import annotations

import time

import numpy as np

import fastls

from .data import ClientData
from .federated import Clock, RoundLog
from .transport import payload_bytes

__all__ = [
    "BASELINES",
    "BaselineClient",
    "BaselineModel",
    "baseline_hyper",
    "make_baseline_model",
    "run_baseline",
    "stein_gradient",
    "zo_sphere_gradient",
]

MODEL_HIDDEN = {"lr": (), "dnn": (128, 64)}
ALGORITHMS = ("fedavg", "fedzo", "baffle", "pfedme", "pfedzo")
PERSONALIZED = ("pfedme", "pfedzo")
SERVER_KEYS = ("beta",)  # hyperparameters used by the server loop only


# --------------------------------------------------------------------------- #
# Models
# --------------------------------------------------------------------------- #


class BaselineModel:
    """Fully connected softmax classifier with hand-written backpropagation.

    Layers ``n_features -> hidden... -> n_classes``; ReLU after every hidden
    layer; softmax + cross-entropy (mean over the batch) at the output.
    Parameters: one flat float64 vector, layer by layer ``W_l`` (n_in, n_out,
    row-major) then ``b_l`` (n_out,).
    """

    def __init__(self, name, n_features, n_classes, hidden=()):
        self.name = name
        self.n_features = int(n_features)
        self.n_classes = int(n_classes)
        sizes = [self.n_features, *map(int, hidden), self.n_classes]
        self.layer_sizes = tuple(sizes)
        self.shapes = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            self.shapes += [(n_in, n_out), (n_out,)]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        self.n_params = int(self.offsets[-1])

    def __repr__(self):
        return f"BaselineModel({self.name!r}, layers={self.layer_sizes}, n_params={self.n_params})"

    # -- parameters ----------------------------------------------------------
    def unpack(self, params):
        """Views ``[W_1, b_1, W_2, b_2, ...]`` into the flat vector ``params``."""
        params = np.asarray(params)
        if params.shape != (self.n_params,):
            raise ValueError(f"expected a flat vector of {self.n_params} parameters, got shape {params.shape}")
        return [params[a:b].reshape(s) for a, b, s in zip(self.offsets[:-1], self.offsets[1:], self.shapes)]

    def init_params(self, seed):
        """PyTorch-default-like init: W and b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), seeded."""
        rng = np.random.default_rng([int(seed), 0xBA5E])
        params = np.empty(self.n_params)
        views = self.unpack(params)
        for l in range(len(views) // 2):
            W, b = views[2 * l], views[2 * l + 1]
            bound = 1.0 / np.sqrt(W.shape[0])  # fan_in
            W[...] = rng.uniform(-bound, bound, size=W.shape)
            b[...] = rng.uniform(-bound, bound, size=b.shape)
        return params

    # -- forward / backward --------------------------------------------------
    def _input(self, x):
        x = np.asarray(x)
        return x.reshape(x.shape[0], -1).astype(np.float64, copy=False)

    def _forward(self, params, x):
        views = self.unpack(params)
        acts = [self._input(x)]
        n_layers = len(views) // 2
        for l in range(n_layers):
            z = acts[-1] @ views[2 * l] + views[2 * l + 1]
            if l < n_layers - 1:
                z = np.maximum(z, 0.0)
            acts.append(z)
        return acts  # acts[-1] are the logits

    @staticmethod
    def _log_softmax(logits):
        shifted = logits - logits.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    def logits(self, params, x):
        return self._forward(params, x)[-1]

    def loss(self, params, x, y):
        """Mean cross-entropy of the softmax outputs on (x, y)."""
        y = np.asarray(y)
        logp = self._log_softmax(self.logits(params, x))
        return float(-logp[np.arange(len(y)), y].mean())

    def loss_and_grad(self, params, x, y):
        """(loss, flat gradient) by exact backpropagation."""
        y = np.asarray(y)
        n = len(y)
        acts = self._forward(params, x)
        logp = self._log_softmax(acts[-1])
        loss = float(-logp[np.arange(n), y].mean())
        delta = np.exp(logp)
        delta[np.arange(n), y] -= 1.0
        delta /= n
        views = self.unpack(params)
        grad = np.empty(self.n_params)
        gviews = self.unpack(grad)
        for l in range(len(views) // 2 - 1, -1, -1):
            gviews[2 * l][...] = acts[l].T @ delta
            gviews[2 * l + 1][...] = delta.sum(axis=0)
            if l > 0:
                delta = (delta @ views[2 * l].T) * (acts[l] > 0)
        return loss, grad

    def grad(self, params, x, y):
        """Flat gradient of :meth:`loss` (exact backpropagation)."""
        return self.loss_and_grad(params, x, y)[1]

    def predict(self, params, x, chunk=8192):
        """Predicted labels, evaluated in chunks of ``chunk`` samples."""
        n = len(x)
        out = np.empty(n, dtype=np.int64)
        for start in range(0, n, chunk):
            out[start:start + chunk] = self.logits(params, x[start:start + chunk]).argmax(axis=1)
        return out


def make_baseline_model(name, n_features, n_classes, seed=None):
    """``"lr"`` or ``"dnn"`` model; with ``seed``, returns ``(model, initial params)``.

    ``n_features`` may be an int or a feature shape (it is flattened).
    """
    key = str(name).lower()
    if key not in MODEL_HIDDEN:
        raise ValueError(f"unknown baseline model {name!r}; choose one of {sorted(MODEL_HIDDEN)}")
    n_in = int(np.prod(n_features))
    model = BaselineModel(key, n_in, n_classes, MODEL_HIDDEN[key])
    if seed is None:
        return model
    return model, model.init_params(seed)


# --------------------------------------------------------------------------- #
# Zeroth-order estimators
# --------------------------------------------------------------------------- #


def zo_sphere_gradient(f, w, b2, mu, rng, f0=None):
    """Two-point estimate g = d / (b2 mu) * sum_j [f(w + mu v_j) - f(w)] v_j, v_j uniform on the unit sphere.

    ``f`` maps a flat parameter vector to a scalar; ``f0 = f(w)`` may be given.
    Costs b2 (+1) evaluations of ``f``.
    """
    d = w.size
    f0 = f(w) if f0 is None else f0
    g = np.zeros(d)
    for _ in range(int(b2)):
        v = rng.standard_normal(d)
        v /= np.linalg.norm(v)
        g += (f(w + mu * v) - f0) * v
    g *= d / (b2 * mu)
    return g


def stein_gradient(f, w, K, sigma, rng, clip=0.3, f0=None):
    """BAFFLE's estimate g = 1 / (K sigma^2) * sum_k [f(w + delta_k) - f(w)] delta_k, delta_k ~ N(0, sigma^2 I).

    With ``clip`` (default 0.3), every coordinate of g is clipped to
    ``[-clip, clip]`` (infinity-norm clipping); ``clip=None`` returns the raw
    estimate. Costs K (+1) evaluations of ``f``.
    """
    d = w.size
    f0 = f(w) if f0 is None else f0
    g = np.zeros(d)
    for _ in range(int(K)):
        delta = sigma * rng.standard_normal(d)
        g += (f(w + delta) - f0) * delta
    g /= K * sigma**2
    if clip is not None:
        np.clip(g, -clip, clip, out=g)
    return g


# --------------------------------------------------------------------------- #
# Hyperparameters
# --------------------------------------------------------------------------- #


def _both(lr_model, dnn_model):
    return {"lr": lr_model, "dnn": dnn_model}


_FEDZO = {"local_iters": 20, "b1": 20, "b2": 20, "mu": 1e-3}
_FEDZO_LR = {"mnist": 3e-2, "synthetic": 1e-2}
_BAFFLE = {"local_epochs": 1, "batch_size": 64, "K": 100, "sigma": 1e-4, "clip": 0.3, "lr": 0.01}
_PFEDME_MNIST = _both(
    {"lr": 0.01, "personal_lr": 0.1, "lamda": 15.0, "beta": 2.0, "K": 5, "batch_size": 20, "local_epochs": 20},
    {"lr": 0.01, "personal_lr": 0.05, "lamda": 30.0, "beta": 2.0, "K": 5, "batch_size": 20, "local_epochs": 20},
)
_PFEDME_SYNTHETIC = _both(
    {"lr": 0.01, "personal_lr": 0.01, "lamda": 20.0, "beta": 2.0, "K": 5, "batch_size": 20, "local_epochs": 20},
    {"lr": 0.01, "personal_lr": 0.01, "lamda": 30.0, "beta": 2.0, "K": 5, "batch_size": 20, "local_epochs": 20},
)


def _zo_variant(table):
    return {m: {**h, "personal_lr": h["personal_lr"] / 10, "b2": 20, "mu": 1e-3} for m, h in table.items()}


#: BASELINES[algorithm][dataset][model] -> default hyperparameters (see the module docstring
#: for sources). "rounds" is the paper's number of training rounds (5.1); the
#: personalized comparison instead reports the best accuracy within 1,000 rounds.
BASELINES = {
    "fedavg": {
        "mnist": _both({"local_epochs": 1, "batch_size": 20, "lr": 0.02, "rounds": 20},
                       {"local_epochs": 1, "batch_size": 20, "lr": 0.02, "rounds": 20}),
        "synthetic": _both({"local_epochs": 1, "batch_size": 20, "lr": 0.02, "rounds": 600},
                           {"local_epochs": 1, "batch_size": 20, "lr": 0.03, "rounds": 600}),
    },
    "fedzo": {
        dataset: {model: {**_FEDZO, "lr": _FEDZO_LR[dataset], "rounds": rounds} for model in MODEL_HIDDEN}
        for dataset, rounds in (("mnist", 20), ("synthetic", 600))
    },
    "baffle": {
        "mnist": _both({**_BAFFLE, "rounds": 20}, {**_BAFFLE, "rounds": 20}),
        "synthetic": _both({**_BAFFLE, "rounds": 600}, {**_BAFFLE, "rounds": 600}),
    },
    "pfedme": {
        "mnist": {m: {**h, "rounds": 1000} for m, h in _PFEDME_MNIST.items()},
        "synthetic": {m: {**h, "rounds": 1000} for m, h in _PFEDME_SYNTHETIC.items()},
    },
    "pfedzo": {
        "mnist": {m: {**h, "rounds": 1000} for m, h in _zo_variant(_PFEDME_MNIST).items()},
        "synthetic": {m: {**h, "rounds": 1000} for m, h in _zo_variant(_PFEDME_SYNTHETIC).items()},
    },
}
# Fashion-MNIST and CIFAR-10 have no reference values; fall back to MNIST's.
_DATASET_ALIAS = {"fashion-mnist": "mnist", "cifar10": "mnist"}


def baseline_hyper(algorithm, dataset, model, **overrides):
    """Default hyperparameters of ``algorithm`` on ``dataset`` with ``model``, updated by ``overrides``.

    The result includes ``"rounds"``; pass the rest to :func:`run_baseline`
    (``rounds`` separately).
    """
    algorithm, dataset, model = str(algorithm).lower(), str(dataset).lower(), str(model).lower()
    if algorithm not in BASELINES:
        raise ValueError(f"unknown baseline {algorithm!r}; choose one of {sorted(BASELINES)}")
    dataset = _DATASET_ALIAS.get(dataset, dataset)
    try:
        hyper = dict(BASELINES[algorithm][dataset][model])
    except KeyError:
        raise ValueError(f"no defaults for {algorithm} on dataset {dataset!r} with model {model!r}") from None
    unknown = sorted(set(overrides) - set(hyper) - {"rounds"})
    if unknown:
        raise ValueError(f"unknown hyperparameters {unknown} for {algorithm}; it takes {sorted(hyper)}")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise ValueError(f"hyperparameter {key} must be a finite number, got {value!r}")
    hyper.update(overrides)
    return hyper


# --------------------------------------------------------------------------- #
# Client
# --------------------------------------------------------------------------- #


class BaselineClient:
    """One client of the baselines; the server calls its methods by name through a transport.

    Parameters
    ----------
    client_id : int
    data : ClientData
    model_name : "lr" or "dnn"
    n_classes : int
    seed : int
        Run seed: initial parameters (identical on every client) and, with
        the client id and round index, this client's minibatch and
        perturbation draws.
    cores : int
        Local work runs under ``fastls.limit_cores(cores)``.
    """

    def __init__(self, client_id, data: ClientData, model_name, n_classes, seed, cores=1):
        self.client_id = int(client_id)
        self.data = data
        self.n_classes = int(n_classes)
        self.seed = int(seed)
        self.cores = int(cores)
        self.model = make_baseline_model(model_name, data.x_train.shape[1:], n_classes)
        self.params = None  # last local parameters (w)
        self.theta = None   # personalized model (pFedMe / pFedZO)
        fastls.blas_info()  # build threadpoolctl's controller outside the timed rounds

    # -- helpers --------------------------------------------------------------
    def _rng(self, round_index, tag):
        return np.random.default_rng([self.seed, self.client_id, int(round_index), tag])

    def _batch(self, idx):
        return self.data.x_train[idx], self.data.y_train[idx]

    def _sample(self, rng, size):
        n = self.data.n_train
        return rng.choice(n, size=min(int(size), n), replace=False)

    def _f(self, x, y):
        model = self.model
        return lambda p: model.loss(p, x, y)

    # -- methods the server calls ---------------------------------------------
    def initial_params(self):
        """The seeded initial parameters (the same on every client)."""
        return {"params": self.model.init_params(self.seed)}

    def local_train(self, algorithm, params, round_index, **hyper):
        """Local update of one round; returns ``{"params", "n", "compute_s"}``."""
        algorithm = str(algorithm).lower()
        method = getattr(self, f"_{algorithm}", None)
        if algorithm not in ALGORITHMS or method is None:
            raise ValueError(f"unknown baseline {algorithm!r}; choose one of {list(ALGORITHMS)}")
        w = np.array(params, dtype=np.float64)  # own copy
        start = time.perf_counter()
        with fastls.limit_cores(self.cores):
            w = method(w, round_index, **hyper)
        compute_s = time.perf_counter() - start
        self.params = w
        return {"params": w, "n": self.data.n_train, "compute_s": compute_s}

    def evaluate(self, params=None):
        """(correct, total) on the local test split; ``params=None`` = this client's personalized model."""
        if params is None:
            params = self.theta if self.theta is not None else self.params
        total = self.data.n_test
        if total == 0 or params is None:
            return {"correct": 0, "total": int(total)}
        pred = self.model.predict(np.asarray(params, dtype=np.float64), self.data.x_test)
        return {"correct": int((pred == self.data.y_test).sum()), "total": int(total)}

    # -- local updates --------------------------------------------------------
    def _fedavg(self, w, round_index, *, lr, batch_size, local_epochs=1):
        rng = self._rng(round_index, 1)
        for _ in range(int(local_epochs)):
            order = rng.permutation(self.data.n_train)
            for s in range(0, len(order), int(batch_size)):
                x, y = self._batch(order[s:s + int(batch_size)])
                w -= lr * self.model.grad(w, x, y)
        return w

    def _fedzo(self, w, round_index, *, lr, local_iters, b1, b2=20, mu=1e-3):
        rng = self._rng(round_index, 2)
        for _ in range(int(local_iters)):
            x, y = self._batch(self._sample(rng, b1))
            w -= lr * zo_sphere_gradient(self._f(x, y), w, b2, mu, rng)
        return w

    def _baffle(self, w, round_index, *, lr, batch_size, K=100, sigma=1e-4, clip=0.3, local_epochs=1):
        rng = self._rng(round_index, 3)
        for _ in range(int(local_epochs)):
            order = rng.permutation(self.data.n_train)
            for s in range(0, len(order), int(batch_size)):
                x, y = self._batch(order[s:s + int(batch_size)])
                w -= lr * stein_gradient(self._f(x, y), w, K, sigma, rng, clip=clip)
        return w

    def _moreau(self, w, round_index, inner_grad, *, lr, personal_lr, lamda, K, batch_size, local_epochs):
        """pFedMe's local rounds; ``inner_grad(theta, x, y, rng)`` is the gradient (or its estimate) of f."""
        rng = self._rng(round_index, 4)
        theta = w.copy()
        for _ in range(int(local_epochs)):
            x, y = self._batch(self._sample(rng, batch_size))
            # theta ~ argmin f(theta; batch) + lamda/2 ||theta - w||^2, by K gradient steps (warm start).
            for _ in range(int(K)):
                theta -= personal_lr * (inner_grad(theta, x, y, rng) + lamda * (theta - w))
            w -= lr * lamda * (w - theta)
        self.theta = theta
        return w

    def _pfedme(self, w, round_index, *, lr, personal_lr, lamda, K=5, batch_size=20, local_epochs=20):
        return self._moreau(w, round_index, lambda p, x, y, rng: self.model.grad(p, x, y), lr=lr,
                            personal_lr=personal_lr, lamda=lamda, K=K, batch_size=batch_size,
                            local_epochs=local_epochs)

    def _pfedzo(self, w, round_index, *, lr, personal_lr, lamda, K=5, batch_size=20, local_epochs=20,
                b2=20, mu=1e-3):
        def inner(p, x, y, rng):
            return zo_sphere_gradient(self._f(x, y), p, b2, mu, rng)

        return self._moreau(w, round_index, inner, lr=lr, personal_lr=personal_lr, lamda=lamda, K=K,
                            batch_size=batch_size, local_epochs=local_epochs)


# --------------------------------------------------------------------------- #
# Server
# --------------------------------------------------------------------------- #


def _accuracy(transport, params):
    args = {cid: ({} if params is None else {"params": params}) for cid in transport.client_ids}
    correct = total = 0
    for _, result in transport.call("evaluate", args):
        correct += result["correct"]
        total += result["total"]
    return correct / total if total else float("nan")


def run_baseline(transport, algorithm, rounds, *, clock=Clock(), eval_every=1, progress=None,
                 init_params=None, **hyper):
    """Run a baseline for ``rounds`` rounds over ``transport``'s clients (all participate every round).

    Parameters
    ----------
    transport : Transport of :class:`BaselineClient`
    algorithm : one of "fedavg", "fedzo", "baffle", "pfedme", "pfedzo"
    rounds : int
    clock : Clock
        Communication time of the parameter vector, down and up, per client and round.
    eval_every : int
        Overall test accuracy after every ``eval_every``-th round and the last
        one (``accuracy`` is None in the other records).
    progress : callable(str) or None
    init_params : flat ndarray or None
        Initial global parameters; None asks the first client for the seeded ones.
    **hyper
        Local hyperparameters (see :data:`BASELINES`); ``beta`` is the
        server's pFedMe/pFedZO mixing weight (default 1).

    Returns
    -------
    dict with "rounds" (records as in :mod:`fedlayer.federated`), "accuracy"
    (of the last round), "best_accuracy" (best evaluated round) and "params"
    (final global parameters).

    Accuracy is the overall test accuracy: correct / total summed over all
    clients' local test splits, of the global model (FedAvg, FedZO, BAFFLE)
    or of each client's personalized model theta (pFedMe, pFedZO).
    """
    algorithm = str(algorithm).lower()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown baseline {algorithm!r}; choose one of {list(ALGORITHMS)}")
    if int(rounds) < 1 or int(eval_every) < 1:
        raise ValueError("rounds and eval_every must be >= 1")
    hyper = dict(hyper)
    hyper.pop("rounds", None)
    beta = float(hyper.pop("beta", 1.0))
    personalized = algorithm in PERSONALIZED
    cids = transport.client_ids
    if init_params is None:
        (_, first), = transport.call("initial_params", {cids[0]: {}})
        init_params = first["params"]
    w = np.array(init_params, dtype=np.float64)

    records, best = [], None
    for r in range(int(rounds)):
        log = RoundLog("federated", None, clock)
        down = clock.transfer(w.nbytes)
        args = {cid: {"algorithm": algorithm, "params": w, "round_index": r, **hyper} for cid in cids}
        total_n = 0
        acc_sum = np.zeros_like(w)
        for cid, result in transport.call("local_train", args):
            log.arrived(cid, result["compute_s"], payload_bytes({"params": result["params"], "n": result["n"]}))
            log.down[cid] = down
            log.down_bytes += w.nbytes
            acc_sum += result["n"] * result["params"]
            total_n += result["n"]
            del result
        start = time.perf_counter()
        mean = acc_sum / total_n
        w = (1.0 - beta) * w + beta * mean if personalized else mean
        log.server_s = time.perf_counter() - start
        accuracy = None
        if (r + 1) % int(eval_every) == 0 or r + 1 == int(rounds):
            accuracy = _accuracy(transport, None if personalized else w)
            best = accuracy if best is None or accuracy > best else best
        records.append(log.record(accuracy))
        if progress:
            progress(f"{algorithm} round {r + 1}/{rounds}"
                     + (f", accuracy {accuracy:.4f}" if accuracy is not None else ""))
    return {"rounds": records, "accuracy": records[-1]["accuracy"], "best_accuracy": best, "params": w}
