"""Benchmark cases shared by the pytest-benchmark suite and the report script."""

import numpy as np
import scipy.linalg.blas as blas

import fastls

# (N, d): MNIST input with its bias column, conv patches of 3x3x512 and 3x3x1024.
GRAM_SHAPES = [(60000, 785), (20000, 4608), (5000, 9216)]
# (channels, image side, batch): 3x3 'same' convolutions.
CONV_CASES = [(64, 16, 256), (64, 14, 256), (512, 16, 48), (512, 14, 64)]
SOLVE_SIZES = [785, 4608, 9216]
THREADS = [1, 2]
N_TARGETS = 64


def random_matrix(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    out = np.empty(shape, dtype=dtype)
    # Fill in row blocks: a (60000, 785) float64 normal draw is cheap, a
    # (5000, 9216) one in one go doubles peak memory for nothing.
    for start in range(0, shape[0], 4096):
        out[start:start + 4096] = rng.standard_normal((min(4096, shape[0] - start), *shape[1:]))
    return out


def gram_flops(n, d):
    """Flops counted as N d^2 (syrk's multiply-adds on one triangle, times 2)."""
    return float(n) * d * d


def gram_fastls(X, G):
    G[...] = 0
    fastls.gram_update(G, X, check_finite=False)
    return G


def gram_scipy(X, G):
    # scipy's wrapper wants X^T X; pass the Fortran view to avoid a copy.
    syrk = blas.dsyrk if X.dtype == np.float64 else blas.ssyrk
    return syrk(1.0, X.T, trans=0, lower=0)


def gram_numpy(X, G):
    return X.T @ X


def conv_inputs(channels, side, batch, dtype, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, side, side, channels)).astype(dtype)
    targets = rng.standard_normal((batch, N_TARGETS)).astype(dtype)
    return images, targets


def conv_streaming(images, targets, G, C, scratch_bytes=64 * 2**20):
    G[...] = 0
    C[...] = 0
    fastls.conv_gram_update(G, C, images, targets, 3, padding=1, scratch_bytes=scratch_bytes, check_finite=False)
    return G, C


def conv_im2col(images, targets, G, C):
    """Reference: materialize the whole patch matrix, then syrk and gemm."""
    G[...] = 0
    C[...] = 0
    P = fastls.im2col(images, 3, padding=1)
    per_image = P.shape[0] // images.shape[0]
    fastls.gram_update(G, P, check_finite=False)
    fastls.cross_update(C, P, np.repeat(targets, per_image, axis=0), check_finite=False)
    return G, C


def spd_system(d, dtype, seed=0):
    """A well-conditioned SPD G (upper triangle used), C and M; O(d^2) to build.

    Solve time does not depend on the values, so G is d I plus a symmetric
    uniform perturbation (eigenvalues within d +- 2 sqrt(d)) instead of a
    Gram product that would cost more than the solve being measured.
    """
    rng = np.random.default_rng(seed)
    R = rng.uniform(-1.0, 1.0, size=(d, d))
    G = ((R + R.T) / 2 + d * np.eye(d)).astype(dtype)
    return G, rng.standard_normal((d, 10)).astype(dtype), rng.standard_normal((d, 10)).astype(dtype)
