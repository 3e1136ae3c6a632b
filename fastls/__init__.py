"""fastls: compiled least-squares kernels for analytic learning.

Gram accumulation (syrk), cross and forward products (gemm), im2col and
Winograd F(2x2, 3x3) convolutions, average pooling, leaky ReLU in place, a
streaming convolution Gram, Cholesky ridge and proximal solves, ridge paths
with GCV and leave-one-out selection of the shift, all float32/float64 with C-
or Fortran-ordered inputs and the GIL released, plus core limits through
threadpoolctl. How the kernels pick thread counts, methods and scratch sizes
is exposed in :mod:`fastls.tuning`.

Conventions shared by every kernel:

* Matrices are float32 or float64 NumPy arrays, C- or Fortran-ordered.
  Outputs updated in place must be writable and contiguous; inputs of any
  layout are accepted (non-contiguous ones are copied once).
* Gram matrices hold their data in the **upper triangle** (``G[i, j]`` with
  ``i <= j``); the strict lower triangle is never read or written by the
  kernels. :func:`symmetrize` gives the full matrix.
* A float64 output may accumulate float32 inputs: products run in float32
  BLAS over at most ``block_rows`` rows and are added to the float64 output,
  so the float32 rounding error is bounded by the block, not by N.
* Images are NHWC (batch, height, width, channels), channels last, so that a
  kernel row inside the image is one contiguous run of memory and a patch
  row is laid out (ky, kx, channel) with the channel fastest.
* Invalid arguments raise TypeError (wrong type or dtype) or ValueError
  (shape, value, NaN/Inf, overflow) before any output is written; a shifted
  Gram that is not positive definite raises ``numpy.linalg.LinAlgError``.
"""

from . import tuning as tuning  # the submodule: fastls.tuning after a bare "import fastls"
from ._conv import avg_pool2d, conv2d, scale_negatives, winograd_filters
from ._conv_stats import ConvStats, conv_gram_update
from ._draws import normal_rows
from ._patches import conv_output_shape, im2col
from ._products import add_upper, cross_update, gram_update, matmul, symmetrize
from ._select import DEFAULT_GRID, RidgePath
from ._solve import proximal_cost, proximal_solve, proximal_solve_dual, refined_ridge_solve, ridge_solve
from ._threads import available_cores, blas_info, limit_cores
from ._workspace import recycled_array, recycled_nbytes
from ._workspace import release as release_recycled

__version__ = "0.1.0"

# The scikit-learn estimators import scikit-learn (0.4 s): loaded on first use, so the kernels' callers do not pay.
_ESTIMATORS = ("StreamingRidge", "StreamingRidgeClassifier")


def __getattr__(name):
    if name in _ESTIMATORS:
        from . import _estimators

        return getattr(_estimators, name)
    raise AttributeError(f"module 'fastls' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_ESTIMATORS))


__all__ = [
    # Products and Gram matrices
    "gram_update",
    "cross_update",
    "matmul",
    "add_upper",
    "symmetrize",
    # Convolutions
    "im2col",
    "conv_output_shape",
    "conv2d",
    "winograd_filters",
    "avg_pool2d",
    "scale_negatives",
    "conv_gram_update",
    "ConvStats",
    # Solves
    "ridge_solve",
    "refined_ridge_solve",
    "proximal_solve",
    "proximal_solve_dual",
    "proximal_cost",
    "RidgePath",
    "DEFAULT_GRID",
    "StreamingRidge",
    "StreamingRidgeClassifier",
    # Random rows, recycled memory, cores
    "normal_rows",
    "recycled_array",
    "release_recycled",
    "recycled_nbytes",
    "limit_cores",
    "available_cores",
    "blas_info",
]
