"""fastls: compiled least-squares kernels for analytic learning.

Gram accumulation (syrk), cross and forward products (gemm), im2col and
Winograd F(2x2, 3x3) convolutions, average pooling, leaky ReLU in place, a
streaming convolution Gram, Cholesky ridge and proximal solves, ridge paths
with GCV and leave-one-out selection of the shift, all float32/float64 with C-
or Fortran-ordered inputs and the GIL released, plus core limits through
threadpoolctl and fewer BLAS threads where fewer are faster.
"""

from ._core import (
    DEFAULT_SCRATCH_BYTES,
    add_upper,
    ConvStats,
    avg_pool2d,
    conv_gram_update,
    conv_output_shape,
    conv_stats_cost,
    conv_stats_method,
    cross_update,
    gram_update,
    im2col,
    matmul,
    proximal_cost,
    proximal_solve,
    proximal_solve_dual,
    ridge_solve,
    scale_negatives,
    symmetrize,
)
from ._conv import WINOGRAD_MIN_CHANNELS, conv2d, conv2d_method, winograd_filters
from ._draws import normal_rows
from ._select import DEFAULT_GRID, RidgePath
from ._workspace import recycled_array, recycled_nbytes
from ._workspace import release as release_recycled
from ._threads import (
    FLOPS_PER_THREAD,
    available_cores,
    blas_info,
    get_flops_per_thread,
    limit_cores,
    reset_thread_trials,
    set_flops_per_thread,
    sized_threads,
    thread_trials,
    threads_for,
)

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
    "gram_update",
    "cross_update",
    "symmetrize",
    "add_upper",
    "im2col",
    "conv2d",
    "conv2d_method",
    "winograd_filters",
    "WINOGRAD_MIN_CHANNELS",
    "conv_output_shape",
    "avg_pool2d",
    "scale_negatives",
    "conv_gram_update",
    "ConvStats",
    "conv_stats_cost",
    "conv_stats_method",
    "DEFAULT_SCRATCH_BYTES",
    "ridge_solve",
    "proximal_solve",
    "proximal_solve_dual",
    "proximal_cost",
    "RidgePath",
    "StreamingRidge",
    "StreamingRidgeClassifier",
    "recycled_array",
    "release_recycled",
    "recycled_nbytes",
    "DEFAULT_GRID",
    "matmul",
    "normal_rows",
    "limit_cores",
    "available_cores",
    "blas_info",
    "threads_for",
    "sized_threads",
    "get_flops_per_thread",
    "set_flops_per_thread",
    "FLOPS_PER_THREAD",
    "thread_trials",
    "reset_thread_trials",
]
