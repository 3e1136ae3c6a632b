"""Benchmark cases shared by the pytest-benchmark suite (bench/) and the report (experiments/kernels_report.py).

Every case has a full size (the targets of the issues are stated there) and a
small size that the test suite runs once, untimed, as a check of the
benchmarked code paths.
"""

import numpy as np
import scipy.linalg.blas as blas

import fastls

# Gram widths d = 65, 129, 785, 4609: the MNIST DNN's three layers (bias
# included) and the DCNN's second convolution; N rows.
GRAM_SHAPES = {"full": [(60000, 65), (60000, 129), (20000, 785), (8000, 4609)],
               "small": [(512, 65), (512, 129)]}
# The DCNN's convolutions after the first, at full width: (side, channels, images per call).
# A call of 64 images, and the about 450 a full-width client adds before one finish (CIFAR-10 over 100
# clients): the overlap's one pass over G is a fixed cost that the second amortizes as a run does.
CONV_LAYERS = {"full": [(14, 512, 64), (14, 512, 450), (6, 1024, 64), (6, 1024, 450), (4, 2048, 64),
                        (4, 2048, 450)],
               "small": [(14, 32, 4), (6, 64, 4), (4, 128, 4)]}
# The DCNN's 3x3 forward convolutions at full width: (side, channels, filters, images per call),
# the images of one 16 MiB forward step (fedlayer.client.FORWARD_STEP_BYTES).
FORWARD_CONVS = {"full": [(14, 512, 1024, 28), (6, 1024, 2048, 113), (4, 2048, 2048, 128)],
                 "small": [(6, 32, 33, 2), (5, 40, 32, 3)]}
# (n rows, d features, m right-hand sides) of a personalization solve: the DCNN's classifier on one client.
PROXIMAL_CASES = {"full": [(450, 8193, 10)], "small": [(30, 257, 10)]}
SOLVE_SIZES = {"full": [785, 4609, 9217], "small": [65]}
# Conv outputs the DCNN activates and pools, (images, side, channels): the first convolution's on
# 64 images, the second's on 64.
ACTIVATION_MAPS = {"full": [(64, 28, 512), (64, 12, 1024)], "small": [(2, 6, 8)]}
N_TARGETS = 10


def random_matrix(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    out = np.empty(shape, dtype=dtype)
    # Filled in row blocks: a (60000, 785) float64 draw is cheap, a large one in one go doubles peak memory.
    for start in range(0, shape[0], 4096):
        out[start:start + 4096] = rng.standard_normal((min(4096, shape[0] - start), *shape[1:]))
    return out


def gram_flops(n, d):
    """Flops counted as N d^2 (syrk's multiply-adds on one triangle, times 2)."""
    return float(n) * d * d


def gram_fastls(X, G):
    """fastls.gram_update as users call it: with its finiteness check."""
    G[...] = 0
    fastls.gram_update(G, X)
    return G


def gram_scipy(X, G):
    """SciPy's syrk into the same G (the BLAS floor: no check, no copy)."""
    syrk = blas.dsyrk if X.dtype == np.float64 else blas.ssyrk
    G[...] = 0
    return syrk(1.0, X.T, c=G, trans=0, lower=0, beta=1.0, overwrite_c=1)


def conv_inputs(side, channels, batch, seed=0):
    """float32 maps and per-image targets, as a client of the float32 DCNN has them."""
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, side, side, channels), dtype=np.float32)
    return images, rng.standard_normal((batch, N_TARGETS), dtype=np.float32)


def conv_zeros(channels):
    d = 9 * channels + 1
    return np.zeros((d, d)), np.zeros((d, N_TARGETS))


def zero_stats(G, C):
    """Start the statistics over: the caller's memset, which timings of the kernels leave out."""
    G[...] = 0
    C[...] = 0
    return G, C


def conv_stats(images, targets, G, C, method):
    """G, C += float64 statistics of a 3x3 valid convolution with a bias column by ``method`` of fastls.ConvStats."""
    fastls.conv_gram_update(G, C, images, targets, 3, append_ones=True, method=method,
                            scratch_bytes=4 * fastls.tuning.DEFAULT_SCRATCH_BYTES)
    return G, C


def conv_im2col_gram(images, targets, G, C):
    """The reference of the issue: the whole patch matrix, then gram_update and cross_update (G, C +=)."""
    P = fastls.im2col(images, 3, append_ones=True)
    per_image = P.shape[0] // images.shape[0]
    fastls.gram_update(G, P)
    fastls.cross_update(C, P, np.repeat(targets, per_image, axis=0))
    return G, C


def conv_flops(side, channels, batch):
    """Flops counted as N d^2 over the patch rows (the im2col count the rates are quoted in)."""
    out = side - 2
    return gram_flops(batch * out * out, 9 * channels + 1)


def forward_inputs(side, channels, filters, images, seed=0):
    """float32 maps and 3x3 kernels (with a bias row) scaled as trained weights are, for fastls.conv2d."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((images, side, side, channels), dtype=np.float32)
    W = rng.standard_normal((9 * channels + 1, filters), dtype=np.float32) / np.float32(np.sqrt(9 * channels))
    return x, W


def forward_flops(side, channels, filters, images):
    """2 x the multiply-adds of im2col + gemm (a 3x3 valid convolution with a bias row)."""
    return 2.0 * images * (side - 2) ** 2 * (9 * channels + 1) * filters


def proximal_problem(n, d, m, seed=0):
    """float32 rows X, targets Z and float64 meta-weights M."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d), dtype=np.float32)
    return X, rng.standard_normal((n, m), dtype=np.float32), rng.standard_normal((d, m))


def proximal_primal(X, Z, M, eps=2500.0):
    G = np.zeros((X.shape[1], X.shape[1]))
    C = np.zeros((X.shape[1], Z.shape[1]))
    fastls.gram_update(G, X)
    fastls.cross_update(C, X, Z)
    return fastls.proximal_solve(G, C, eps, M, overwrite_g=True, overwrite_c=True)


def proximal_dual(X, Z, M, eps=2500.0):
    return fastls.proximal_solve_dual(X, Z, eps, M)


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


# Widths of a server's GCV choice of gamma (--gamma auto): the DCNN's layers 2 to 4 at full width;
# d = 18433 (eigh: about 11 min) only in the report's --gcv-wide run.
GCV_SIZES = {"full": [2048, 4609, 9217], "small": [40]}
GCV_TARGETS = 40  # X^T Y's coordinates at the DCNN's fourth convolution: 10 classes x 2 x 2 positions


def gcv_problem(d, seed=0):
    """(G, C, tr(Z^T Z), n) for a GCV choice at width d: spd_system's G (cheap to build), float64."""
    G, _, _ = spd_system(d, np.float64, seed)
    C = np.random.default_rng(seed + 1).standard_normal((d, GCV_TARGETS))
    return G, C, float(d) * GCV_TARGETS, 8 * d


def gcv_choice(G, C, zz, n, method):
    """gamma by GCV and the weights solved with it, as the server's --gamma auto does; G is left alone."""
    path = fastls.RidgePath.from_statistics(G.copy(), C, zz, n, method=method, overwrite_g=True)
    gamma, _, _ = path.select("gcv")
    return gamma, path.solve(gamma)


# The thread grid (issue: threads chosen by problem size): every kernel kind at
# d x rows, 1 or 2 BLAS threads or the size rule's choice within a limit of 2.
THREAD_GRID = {"full": {"d": [16, 33, 65, 129, 257, 513, 785, 1153, 2305, 4609],
                        "rows": [64, 256, 1024, 4096, 16384, 65536]},
               "small": {"d": [16, 129], "rows": [64, 1024]}}
THREAD_KINDS = ["gram", "cross", "matmul", "solve"]
# Columns of the cross and forward products: a hidden layer's width (its encoded targets / units).
THREAD_COLUMNS = 128


def _zeroed(A):
    """A set to zero (d^2 or d m work, small next to the update): each timed call returns one fresh product."""
    A[...] = 0
    return A


def thread_case(kind, d, rows, dtype, seed=0):
    """(call, flops) of one grid case; ``solve`` ignores rows (a d x d ridge solve of THREAD_COLUMNS columns)."""
    m = THREAD_COLUMNS
    if kind == "solve":
        G = spd_system(d, dtype, seed)[0]
        C = random_matrix((d, m), dtype, seed + 1)
        return (lambda: fastls.ridge_solve(G, C, 1.0, check_finite=False)), d ** 3 / 3.0 + 2.0 * d * d * m
    X = random_matrix((rows, d), dtype, seed)
    if kind == "gram":
        G = np.zeros((d, d), dtype=dtype)
        return (lambda: fastls.gram_update(_zeroed(G), X, check_finite=False)), gram_flops(rows, d)
    if kind == "cross":
        Z, C = random_matrix((rows, m), dtype, seed + 1), np.zeros((d, m), dtype=dtype)
        return (lambda: fastls.cross_update(_zeroed(C), X, Z, check_finite=False)), 2.0 * rows * d * m
    if kind == "matmul":
        W, out = random_matrix((d, m), dtype, seed + 1), np.empty((rows, m), dtype=dtype)
        return (lambda: fastls.matmul(X, W, out=out, check_finite=False)), 2.0 * rows * d * m
    raise ValueError(f"unknown kind {kind!r}; expected one of {THREAD_KINDS}")
