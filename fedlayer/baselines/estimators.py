"""Zeroth-order gradient estimates of FedZO, pFedZO and BAFFLE, and the random draws behind them.

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

The draws (:func:`sphere_directions`, :func:`gaussian_perturbations`) and the
sums over directions (:func:`two_point_estimate`, :func:`stein_estimate`) are
shared by the per-client and the batched engine: both consume a client's
generator in the same order and add the directions in the same order, so the
two engines' parameters agree to rounding of the loss evaluations alone.
Generator: NumPy's ``default_rng`` (PCG64, ziggurat normals), seeded per
client, round and algorithm (:meth:`fedlayer.baselines.BaselineClient.rng`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["gaussian_perturbations", "sphere_directions", "stein_estimate", "stein_gradient", "two_point_estimate",
           "zo_sphere_gradient"]


def sphere_directions(rng, count, d, out=None):
    """``count`` directions uniform on the unit sphere of R^d: rows of N(0, I) draws over their norms.

    Returns (count, d) float64 (``out`` when given, C-contiguous). The
    draws fill the array in one call, which consumes ``rng`` exactly as
    ``count`` calls of ``rng.standard_normal(d)`` would.
    """
    v = rng.standard_normal((int(count), int(d))) if out is None else rng.standard_normal(out=out)
    # Not np.linalg.norm: its dot runs on NumPy's BLAS, whose threads then
    # fight the model's products on SciPy's (fastls.matmul) for the cores.
    # On MNIST's DNN under 2 cores that made a FedZO round 5x slower.
    v /= np.sqrt(np.einsum("ji,ji->j", v, v))[:, None]
    return v


def gaussian_perturbations(rng, count, d, sigma, out=None):
    """``count`` draws of N(0, sigma^2 I_d): (count, d) float64 (``out`` when given)."""
    delta = rng.standard_normal((int(count), int(d))) if out is None else rng.standard_normal(out=out)
    delta *= sigma
    return delta


def _weighted_sum(weights, vectors, out, work):
    """out = sum_j weights[..., j] vectors[..., j, :], added in order of j (both engines add alike)."""
    out = np.zeros(vectors.shape[:-2] + vectors.shape[-1:]) if out is None else out
    out[...] = 0.0
    for j in range(vectors.shape[-2]):
        work = np.multiply(weights[..., j, None], vectors[..., j, :], out=work)
        out += work
    return out


def two_point_estimate(f0, f, directions, mu, out=None, work=None):
    """g = d / (b2 mu) * sum_j (f_j - f0) v_j over directions (..., b2, d); f0 (...), f (..., b2).

    ``out`` and ``work`` (..., d) are optional buffers (the result is ``out``).
    """
    b2, d = directions.shape[-2:]
    g = _weighted_sum(f - np.asarray(f0)[..., None], directions, out, work)
    g *= d / (b2 * mu)
    return g


def stein_estimate(f0, f, deltas, sigma, clip, out=None, work=None):
    """g = 1 / (K sigma^2) * sum_k (f_k - f0) delta_k, clipped to [-clip, clip]; deltas (..., K, d)."""
    K = deltas.shape[-2]
    g = _weighted_sum(f - np.asarray(f0)[..., None], deltas, out, work)
    g /= K * sigma**2
    if clip is not None:
        np.clip(g, -clip, clip, out=g)
    return g


def zo_sphere_gradient(f, w, b2, mu, rng, f0=None):
    """Two-point estimate g = d / (b2 mu) * sum_j [f(w + mu v_j) - f(w)] v_j, v_j uniform on the unit sphere.

    ``f`` maps a stack of parameter vectors (J, d) to their losses (J,);
    ``f0 = f(w)`` may be given. Costs one evaluation of b2 (+1) vectors.
    """
    f0 = f(w[None])[0] if f0 is None else f0
    directions = sphere_directions(rng, b2, w.size)
    return two_point_estimate(f0, f(w + mu * directions), directions, mu)


def stein_gradient(f, w, K, sigma, rng, clip=0.3, f0=None):
    """BAFFLE's estimate g = 1 / (K sigma^2) * sum_k [f(w + delta_k) - f(w)] delta_k, delta_k ~ N(0, sigma^2 I).

    ``f`` maps a stack of parameter vectors (J, d) to their losses (J,).
    With ``clip`` (default 0.3), every coordinate of g is clipped to
    ``[-clip, clip]`` (infinity-norm clipping); ``clip=None`` returns the raw
    estimate. Costs one evaluation of K (+1) vectors.
    """
    f0 = f(w[None])[0] if f0 is None else f0
    deltas = gaussian_perturbations(rng, K, w.size, sigma)
    return stein_estimate(f0, f(w + deltas), deltas, sigma, clip)
