"""Zeroth-order gradient estimates of FedZO, pFedZO and BAFFLE.

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
"""

from __future__ import annotations

import numpy as np

__all__ = ["stein_gradient", "zo_sphere_gradient"]


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
        # Not np.linalg.norm: its dot runs on NumPy's BLAS, whose threads then
        # fight the model's products on SciPy's (fastls.matmul) for the cores.
        # On MNIST's DNN under 2 cores that made a FedZO round 5x slower.
        v /= np.sqrt(np.einsum("i,i->", v, v))
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
