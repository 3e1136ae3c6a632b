"""Zeroth-order gradient estimates of FedZO, pFedZO and BAFFLE, and the random draws behind them.

Estimators (w in R^d, f the mean cross-entropy on the current minibatch)
-------------------------------------------------------------------------
FedZO / pFedZO (two-point, directions uniform on the unit sphere)::

    v_j = u_j / ||u_j||,  u_j ~ N(0, I_d),  j = 1..b2
    g   = d / (b2 * mu) * sum_j [f(w + mu v_j) - f(w)] v_j

The same minibatch (size b1) is used for all b2 directions. E[g] is the
gradient of the sphere-smoothed loss, which tends to grad f as mu -> 0.

BAFFLE (forward-difference Stein estimator, Gaussian perturbations)::

    delta_k = sigma u_k,  u_k ~ N(0, I_d),  k = 1..K
    g = 1 / (K * sigma^2) * sum_k [f(w + delta_k) - f(w)] delta_k
    g <- clip(g, -c, c)            (coordinate-wise, c = 0.3)

The clipping bounds the infinity norm of the estimate by ``c`` (our reading
of BAFFLE's "gradient clipping at 0.3"; set ``clip=None`` to disable).

Both are computed by :func:`directional_estimate` from the raw draws u_j
(never normalized in memory: ``v_j = u_j / ||u_j||`` enters as the scale
``mu / ||u_j||`` of the step and the weight ``1 / ||u_j||`` of the sum), a few
directions at a time so that each block of draws is still in cache when the
sum over directions reads it back. The per-client and the batched engine
both call it, so they agree bit for bit.

The draws: each client has one :class:`DirectionStream` per round and
algorithm, fastls' counter-based N(0, 1) stream (:func:`fastls.normal_rows`:
SplitMix64 words through a ziggurat; draw i depends on the key and i only).
Its key is derived from (seed, client, round, algorithm) by NumPy's
``SeedSequence``. Minibatches are drawn from a separate NumPy generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

import fastls

__all__ = ["DirectionStream", "directional_estimate", "stein_gradient", "zo_sphere_gradient"]


class DirectionStream:
    """Draws 0, 1, 2, ... of fastls' counter-based N(0, 1) stream ``key``, handed out a block of rows at a time.

    Parameters
    ----------
    key : int in [0, 2**64), or a sequence of ints hashed to one by ``np.random.SeedSequence``
    """

    key: int
    position: int

    def __init__(self, key: int | Sequence[int]) -> None:
        if not isinstance(key, (int, np.integer)):
            key = np.random.SeedSequence(list(map(int, key))).generate_state(1, np.uint64)[0]
        self.key = int(key)
        self.position = 0

    def rows(self, out: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Fill ``out`` (rows, d) with the next draws; returns each row's squared norm (rows,)."""
        sumsq = fastls.normal_rows(out, self.key, self.position)
        self.position += out.size
        return sumsq


def directional_estimate(f0: npt.NDArray[np.float64],
                         losses: Callable[[npt.NDArray[np.float64], npt.NDArray[np.float64]], npt.NDArray[np.float64]],
                         streams: Sequence[DirectionStream], count: int, step: float, *, sphere: bool,
                         buffer: npt.NDArray[np.float64], out: npt.NDArray[np.float64] | None = None,
                         work: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.float64]:
    """The two-point (``sphere=True``) or Stein estimate of each of C clients' gradients.

    Parameters
    ----------
    f0 : ndarray (C,)
        Each client's loss at its parameters w.
    losses : callable(U (C, J, d), scales (C, J)) -> (C, J)
        Each client's losses at w + scales[c, j] * U[c, j].
    streams : sequence of C DirectionStream
    count : int
        Directions per client: b2 (FedZO) or K (BAFFLE).
    step : float
        mu (the sphere's radius) or sigma (the perturbations' std).
    sphere : bool
        True: the two-point estimate over directions on the unit sphere;
        False: the Stein estimate over Gaussian perturbations.
    buffer : ndarray (C, J, d) float64
        Holds J directions per client at a time (J <= count); blocks of J
        give the same numbers as any other J.
    out, work : ndarray (C, d) float64, optional
        The result, and room for one direction's term of the sum.

    Returns
    -------
    g : ndarray (C, d)
        ``d / (count step) sum_j (f_j - f0) u_j / ||u_j||`` with f_j at
        ``w + step u_j / ||u_j||`` (sphere), or ``1 / (count step) sum_k
        (f_k - f0) u_k`` with f_k at ``w + step u_k`` (Stein, unclipped).
    """
    n_clients, block, d = buffer.shape
    g = np.zeros((n_clients, d)) if out is None else out
    g[...] = 0.0
    for first in range(0, int(count), block):
        U = buffer[:, :min(block, int(count) - first)]
        sumsq = np.stack([stream.rows(U[c]) for c, stream in enumerate(streams)])
        if sphere:
            norms = np.sqrt(sumsq)
            weights = losses(U, step / norms) - f0[:, None]
            weights /= norms
        else:
            weights = losses(U, np.full(sumsq.shape, float(step))) - f0[:, None]
        for j in range(U.shape[1]):
            work = np.multiply(weights[:, j, None], U[:, j], out=work)
            g += work
    g *= d / (int(count) * step) if sphere else 1.0 / (int(count) * step)
    return g


def _one_client(f, w):
    """f0 and the losses function of :func:`directional_estimate` for one vector w and a function f of a stack."""
    return (np.array([f(w[None])[0]]),
            lambda U, scales: f(w + scales[0][:, None] * U[0])[None])


def zo_sphere_gradient(f: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]],
                       w: npt.NDArray[np.float64], b2: int, mu: float, stream: DirectionStream,
                       block: int = 4) -> npt.NDArray[np.float64]:
    """Two-point estimate g = d / (b2 mu) * sum_j [f(w + mu v_j) - f(w)] v_j, v_j uniform on the unit sphere.

    ``f`` maps a stack of parameter vectors (J, d) to their losses (J,);
    ``w`` is (d,) float64; ``stream`` is a :class:`DirectionStream`, ``block``
    the directions evaluated at a time (any gives the same estimate). Costs
    b2 (+1) evaluations; returns g (d,) float64.
    """
    f0, losses = _one_client(f, w)
    buffer = np.empty((1, min(int(block), int(b2)), w.size))
    return directional_estimate(f0, losses, [stream], b2, mu, sphere=True, buffer=buffer)[0]


def stein_gradient(f: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]],
                   w: npt.NDArray[np.float64], K: int, sigma: float, stream: DirectionStream,
                   clip: float | None = 0.3, block: int = 4) -> npt.NDArray[np.float64]:
    """BAFFLE's estimate g = 1 / (K sigma^2) * sum_k [f(w + delta_k) - f(w)] delta_k, delta_k ~ N(0, sigma^2 I).

    ``f`` maps a stack of parameter vectors (J, d) to their losses (J,).
    With ``clip`` (default 0.3), every coordinate of g is clipped to
    ``[-clip, clip]`` (infinity-norm clipping); ``clip=None`` returns the raw
    estimate. ``w`` is (d,) float64, ``stream`` a :class:`DirectionStream`
    and ``block`` as in :func:`zo_sphere_gradient`. Costs K (+1)
    evaluations; returns g (d,) float64.
    """
    f0, losses = _one_client(f, w)
    buffer = np.empty((1, min(int(block), int(K)), w.size))
    g = directional_estimate(f0, losses, [stream], K, sigma, sphere=False, buffer=buffer)[0]
    if clip is not None:
        np.clip(g, -clip, clip, out=g)
    return g
