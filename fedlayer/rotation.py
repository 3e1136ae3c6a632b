"""A client's secret rotation: Haar-random orthogonal matrices from the operating system's randomness.

A client that uploads its rows F = U X and U Z instead of its Gram X^T X
and X^T Z (the server's dual solve, :mod:`fedlayer.server.solvers`) hides
them behind a fresh orthogonal U: F^T F = X^T X and F^T (U Z) = X^T Z, so
the server learns what the statistics would tell it and nothing more. U must
be unpredictable to the server, which knows the run's seed and every NumPy
generator seeded from it. Its Gaussian entries therefore come from a ChaCha20
keystream (the ``cryptography`` package) keyed with :func:`os.urandom`,
mapped to normals by the inverse normal CDF, never from NumPy's generators.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from scipy.special import ndtri

__all__ = ["haar_orthogonal", "secret_normals"]

#: Bits of a keystream word that become one uniform in (0, 1): a float64 mantissa's worth.
_UNIFORM_BITS = 53


def secret_normals(shape: int | tuple[int, ...]) -> np.ndarray:
    """Standard normal float64 draws of ``shape`` from a fresh ChaCha20 keystream keyed by ``os.urandom``.

    Each draw takes 64 keystream bits, keeps 53 of them as a uniform
    (k + 1/2) / 2^53 in the open interval (0, 1), and maps it through the
    inverse normal CDF (``scipy.special.ndtri``). No two calls share a key.

    Returns
    -------
    ndarray of ``shape``, float64
    """
    count = int(np.prod(shape, dtype=np.int64))
    encryptor = Cipher(algorithms.ChaCha20(os.urandom(32), os.urandom(16)), mode=None).encryptor()
    words = np.frombuffer(encryptor.update(bytes(8 * count)), dtype="<u8")
    uniform = ((words >> np.uint64(64 - _UNIFORM_BITS)).astype(np.float64) + 0.5) / 2.0 ** _UNIFORM_BITS
    return ndtri(uniform).reshape(shape)


def haar_orthogonal(n: int) -> np.ndarray:
    """A fresh n x n orthogonal matrix, uniform (Haar) over the orthogonal group, from secret randomness.

    The Q of a QR factorization of a Gaussian matrix, its columns' signs
    fixed by the signs of R's diagonal (Mezzadri, "How to generate random
    matrices from the classical compact groups", 2007): without the fix, Q
    is not Haar-distributed.

    Parameters
    ----------
    n : int >= 0

    Returns
    -------
    U : ndarray of shape (n, n), float64, U^T U = I to rounding
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n == 0:
        return np.zeros((0, 0))
    Q, R = np.linalg.qr(secret_normals((n, n)))
    signs = np.sign(np.diagonal(R))
    signs[signs == 0] = 1.0
    return Q * signs
