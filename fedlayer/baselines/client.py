"""A client of the baselines: local SGD, zeroth-order or Moreau-envelope updates of one round.

This is the per-client engine: each client trains alone, one minibatch at a
time, under its own clock (the compute times of Fig. 5).
:class:`fedlayer.baselines.cohort.ClientCohort` is the batched engine; both
draw minibatches from :meth:`BaselineClient.rng` and directions from
:meth:`BaselineClient.directions` in the same order, and step with the
functions below.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import fastls

from ..data import ClientData
from .estimators import DirectionStream, directional_estimate
from .hyper import BASELINES
from .models import BaselineModel, make_baseline_model

if TYPE_CHECKING:
    from .cohort import ClientCohort

__all__ = ["BaselineClient", "moreau_inner_step", "moreau_outer_step"]


def moreau_inner_step(theta: npt.NDArray[np.float64], w: npt.NDArray[np.float64], grad: npt.NDArray[np.float64],
                      personal_lr: float, lamda: float, work: npt.NDArray[np.float64] | None = None) -> None:
    """theta -= personal_lr * (grad + lamda * (theta - w)), in place (any matching shapes).

    ``work`` (theta's shape) holds the intermediate; the operations are the
    expression's, one at a time, so the rounding is the expression's.
    """
    work = np.subtract(theta, w, out=work)
    work *= lamda
    work += grad
    work *= personal_lr
    theta -= work


def moreau_outer_step(w: npt.NDArray[np.float64], theta: npt.NDArray[np.float64], lr: float, lamda: float,
                      work: npt.NDArray[np.float64] | None = None) -> None:
    """w -= lr * lamda * (w - theta), in place: pFedMe's local update of the global model."""
    work = np.subtract(w, theta, out=work)
    work *= lr * lamda
    w -= work


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
    cores : int, default=1
        Local work runs under ``fastls.limit_cores(cores)``.

    Raises
    ------
    ValueError
        A label of ``data`` is not below ``n_classes``, or ``model_name`` is
        not a baseline model.
    """

    client_id: int
    data: ClientData
    n_classes: int
    seed: int
    cores: int
    model: BaselineModel
    params: npt.NDArray[np.float64] | None
    theta: npt.NDArray[np.float64] | None
    cohort: ClientCohort | None

    def __init__(self, client_id: int, data: ClientData, model_name: str, n_classes: int, seed: int,
                 cores: int = 1) -> None:
        self.client_id = int(client_id)
        self.data = data
        self.n_classes = int(n_classes)
        data.check_classes(self.n_classes)
        self.seed = int(seed)
        self.cores = int(cores)
        self.model = make_baseline_model(model_name, data.x_train.shape[1:], n_classes)
        self.params = None  # last local parameters (w)
        self.theta = None   # personalized model (pFedMe / pFedZO)
        self.cohort = None  # the batched engine (ClientCohort) this client's rounds run in, or None
        fastls.blas_info()  # build threadpoolctl's controller outside the timed rounds

    # -- helpers --------------------------------------------------------------
    def rng(self, round_index: int, algorithm: str) -> np.random.Generator:
        """This client's minibatch generator for round ``round_index`` of ``algorithm`` (both engines draw alike).

        Seeded by (run seed, client id, round, algorithm): the same draws in
        process and under MPI, and on resuming from a checkpoint.
        """
        return np.random.default_rng([self.seed, self.client_id, int(round_index), _RNG_TAGS[algorithm]])

    def directions(self, round_index: int, algorithm: str) -> DirectionStream:
        """This client's random directions for round ``round_index`` of ``algorithm``, seeded as :meth:`rng`."""
        return DirectionStream([self.seed, self.client_id, int(round_index), _RNG_TAGS[algorithm], _DIRECTIONS])

    def _batch(self, idx):
        return self.data.x_train[idx], self.data.y_train[idx]

    def sample(self, rng: np.random.Generator, size: int) -> npt.NDArray[np.int64]:
        """Row indices (int64) of a minibatch of ``min(size, n_train)`` rows, drawn from ``rng`` without replacement."""
        n = self.data.n_train
        return rng.choice(n, size=min(int(size), n), replace=False)

    def _estimate(self, w, x, y, stream, count, step, sphere):
        """The zeroth-order estimate at w on the batch (x, y): the batched engine's arithmetic for one client.

        On one BLAS thread, as the batched engine's: OpenBLAS rounds a product differently on two threads,
        and the estimate amplifies a loss's last bit (docs/results/fedlayer_notes.md gives the drift measured).
        """
        x = x.reshape(len(x), -1).astype(np.float64, copy=False)[None]
        with fastls.limit_cores(1):
            f0, losses = self.model.directional_losses(w[None], x, np.asarray(y)[None])
            buffer = np.empty((1, min(int(count), DIRECTION_BLOCK), w.size))
            return directional_estimate(f0, losses, [stream], count, step, sphere=sphere, buffer=buffer)[0]

    # -- methods the server calls ---------------------------------------------
    def initial_params(self) -> dict[str, npt.NDArray[np.float64]]:
        """The seeded initial parameters (the same on every client)."""
        return {"params": self.model.init_params(self.seed)}

    def local_train(self, algorithm: str, params: npt.ArrayLike, round_index: int, **hyper: Any) -> dict[str, Any]:
        """Local update of one round from the global ``params``.

        Parameters
        ----------
        algorithm : {"fedavg", "fedzo", "baffle", "pfedme", "pfedzo"}
        params : array_like of shape (n_params,)
            The global parameters; not modified.
        round_index : int
            Seeds the round's minibatches and directions.
        **hyper
            The algorithm's local hyperparameters (:func:`baseline_hyper`).

        Returns
        -------
        dict
            ``"params"`` (n_params,) float64, ``"n"`` (training samples),
            ``"compute_s"``, and ``"engine"`` when a cohort ran the round.

        Raises
        ------
        ValueError
            Unknown algorithm.
        """
        algorithm = str(algorithm).lower()
        method = getattr(self, f"_{algorithm}", None)
        if algorithm not in BASELINES or method is None:
            raise ValueError(f"unknown baseline {algorithm!r}; choose one of {sorted(BASELINES)}")
        # Step sizes that overflow are reported by the server, which names the round and the hyperparameters
        # (Diverged); NumPy's overflow warnings on the way there would only bury that message.
        with np.errstate(over="ignore", invalid="ignore"):
            if self.cohort is not None:
                return self.cohort.local_train(self, algorithm, params, round_index, hyper)
            w = np.array(params, dtype=np.float64)  # own copy
            start = time.perf_counter()
            with fastls.limit_cores(self.cores):
                w = method(w, round_index, **hyper)
        compute_s = time.perf_counter() - start
        self.params = w
        return {"params": w, "n": self.data.n_train, "compute_s": compute_s}

    def evaluate(self, params: npt.ArrayLike | None = None) -> dict[str, int]:
        """``{"correct", "total"}`` on the local test split; ``params=None`` = this client's personalized model."""
        if params is None:
            params = self.theta if self.theta is not None else self.params
        total = self.data.n_test
        if total == 0 or params is None:
            return {"correct": 0, "total": int(total)}
        pred = self.model.predict(np.asarray(params, dtype=np.float64), self.data.x_test)
        return {"correct": int((pred == self.data.y_test).sum()), "total": int(total)}

    # -- local updates --------------------------------------------------------
    def _fedavg(self, w, round_index, *, lr, batch_size, local_epochs=1):
        rng = self.rng(round_index, "fedavg")
        for _ in range(int(local_epochs)):
            order = rng.permutation(self.data.n_train)
            for s in range(0, len(order), int(batch_size)):
                x, y = self._batch(order[s:s + int(batch_size)])
                w -= lr * self.model.grad(w, x, y)
        return w

    def _fedzo(self, w, round_index, *, lr, local_iters, b1, b2=20, mu=1e-3):
        rng, stream = self.rng(round_index, "fedzo"), self.directions(round_index, "fedzo")
        for _ in range(int(local_iters)):
            x, y = self._batch(self.sample(rng, b1))
            w -= lr * self._estimate(w, x, y, stream, b2, mu, sphere=True)
        return w

    def _baffle(self, w, round_index, *, lr, batch_size, K=100, sigma=1e-4, clip=0.3, local_epochs=1):
        rng, stream = self.rng(round_index, "baffle"), self.directions(round_index, "baffle")
        for _ in range(int(local_epochs)):
            order = rng.permutation(self.data.n_train)
            for s in range(0, len(order), int(batch_size)):
                x, y = self._batch(order[s:s + int(batch_size)])
                g = self._estimate(w, x, y, stream, K, sigma, sphere=False)
                if clip is not None:
                    np.clip(g, -clip, clip, out=g)
                w -= lr * g
        return w

    def _moreau(self, w, round_index, inner_grad, *, lr, personal_lr, lamda, K, batch_size, local_epochs):
        """pFedMe's local rounds; ``inner_grad(theta, x, y, stream)`` is the gradient (or its estimate) of f."""
        rng = self.rng(round_index, "pfedme")
        stream = self.directions(round_index, "pfedme")
        theta = w.copy()
        for _ in range(int(local_epochs)):
            x, y = self._batch(self.sample(rng, batch_size))
            # theta ~ argmin f(theta; batch) + lamda/2 ||theta - w||^2, by K gradient steps (warm start).
            for _ in range(int(K)):
                moreau_inner_step(theta, w, inner_grad(theta, x, y, stream), personal_lr, lamda)
            moreau_outer_step(w, theta, lr, lamda)
        self.theta = theta
        return w

    def _pfedme(self, w, round_index, *, lr, personal_lr, lamda, K=5, batch_size=20, local_epochs=20):
        return self._moreau(w, round_index, lambda p, x, y, stream: self.model.grad(p, x, y), lr=lr,
                            personal_lr=personal_lr, lamda=lamda, K=K, batch_size=batch_size,
                            local_epochs=local_epochs)

    def _pfedzo(self, w, round_index, *, lr, personal_lr, lamda, K=5, batch_size=20, local_epochs=20,
                b2=20, mu=1e-3):
        def inner(p, x, y, stream):
            return self._estimate(p, x, y, stream, b2, mu, sphere=True)

        return self._moreau(w, round_index, inner, lr=lr, personal_lr=personal_lr, lamda=lamda, K=K,
                            batch_size=batch_size, local_epochs=local_epochs)


#: The last word of each client generator's seed: the tags the per-client engine always used
#: (pFedZO shares pFedMe's, as it shares its local rounds).
_RNG_TAGS = {"fedavg": 1, "fedzo": 2, "baffle": 3, "pfedme": 4, "pfedzo": 4}
#: One more word that keys the direction streams apart from the minibatch generators.
_DIRECTIONS = 0xD1
#: Directions drawn and evaluated at a time by the per-client engine (any number gives the same estimate).
DIRECTION_BLOCK = 4
