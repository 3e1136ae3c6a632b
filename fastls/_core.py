"""Public kernels: validation and dispatch to the typed code in ``_kernels``.

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
"""

from __future__ import annotations

import functools
import numbers
import threading
import time
import warnings
import weakref

import numpy as np
import scipy.linalg

from . import _kernels
from ._threads import narrow_gram_trials, run_spans, sized_threads, threads_for
from ._workspace import recycled_array

__all__ = [
    "gram_update",
    "cross_update",
    "symmetrize",
    "add_upper",
    "im2col",
    "conv_output_shape",
    "conv_gram_update",
    "ConvStats",
    "conv_stats_cost",
    "conv_stats_method",
    "DEFAULT_SCRATCH_BYTES",
    "ridge_solve",
    "proximal_solve",
    "proximal_solve_dual",
    "proximal_cost",
    "matmul",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
DEFAULT_BLOCK_ROWS = 4096
# Widest float32 tile of a float32-into-float64 product (26 MB of scratch); dimensions split evenly.
DEFAULT_TILE = 2560
DEFAULT_SCRATCH_BYTES = 64 * 2**20
# Pixels the overlap gathers at a time, measured best on the DCNN's 14 x 14 x 512 maps
# (12-16 MiB; 64 MiB was 10 % slower). ConvStats' scratch_bytes still bounds it.
OVERLAP_CHUNK_BYTES = 16 * 2**20


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

# BLAS and LAPACK take their sizes as 32-bit ints: a larger dimension would wrap around.
_BLAS_INT_MAX = 2**31 - 1


def _check_array(name, A, ndim):
    if not isinstance(A, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(A).__name__}")
    if A.dtype not in _FLOATS:
        raise TypeError(f"{name} must have dtype float32 or float64, got {A.dtype}")
    if A.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {A.shape}")
    if A.ndim and max(A.shape) > _BLAS_INT_MAX:
        raise ValueError(f"{name} has a dimension above 2^31 - 1 (shape {A.shape}), more than BLAS's 32-bit sizes "
                         f"can express; pass it in blocks of rows")


def _check_output(name, A, ndim):
    _check_array(name, A, ndim)
    if not A.flags.writeable:
        raise ValueError(f"{name} is read-only; it is updated in place and must be writable")
    if not (A.flags.c_contiguous or A.flags.f_contiguous):
        raise ValueError(
            f"{name} must be C- or Fortran-contiguous (it is updated in place), "
            f"got strides {A.strides} for shape {A.shape}"
        )


def _check_disjoint(out_name, out, **inputs):
    """Refuse an output that shares memory with an input it is computed from (it would read half-written values)."""
    for name, A in inputs.items():
        if isinstance(A, np.ndarray) and np.may_share_memory(out, A):
            try:
                overlap = np.shares_memory(out, A, max_work=100_000)
            except np.exceptions.TooHardError:  # pragma: no cover - views too intricate to tell apart
                overlap = True
            if overlap:
                raise ValueError(f"{out_name} shares memory with {name}: {out_name} is written while {name} is "
                                 f"read, which would give a wrong result; pass a copy of {name}")


def _check_accumulated(name, A, what):
    """After an in-place float32 accumulation: raise when it overflowed (``A`` holds Inf)."""
    if A.dtype == np.float32 and not np.isfinite(A).all():
        raise ValueError(f"{name} overflowed float32 while adding {what} (its previous values plus the update "
                         f"exceed {np.finfo(np.float32).max:.3g}); accumulate into a float64 {name}")


def _as_input(A):
    """A itself when BLAS can read it, else a C-contiguous copy."""
    if A.flags.c_contiguous or A.flags.f_contiguous:
        return A
    return np.ascontiguousarray(A)


def _layout(A):
    """(rowmajor, leading dimension) of a contiguous matrix, as BLAS needs."""
    if A.flags.c_contiguous:
        return True, max(1, A.shape[1])
    return False, max(1, A.shape[0])


def _check_finite(name, A):
    if A.size == 0:
        return
    if A.flags.c_contiguous or A.flags.f_contiguous:
        # The transpose of an F-ordered array is C-ordered: scan memory in order.
        flat = A if A.flags.c_contiguous else A.T
        finite = _kernels.all_finite(flat.reshape(flat.shape[0], -1))
    else:
        finite = bool(np.isfinite(A).all())  # a strided view (e.g. every other column)
    if not finite:
        raise ValueError(f"{name} contains NaN or Inf; expected finite values")


def _check_finite_upper(G):
    """The upper triangle of a Gram matrix (the part the solves read) is finite."""
    if G.shape[0] and not _kernels.upper_finite(G):
        raise ValueError("G contains NaN or Inf in its upper triangle; expected finite values")


def _check_pair_dtypes(out_name, out, in_name, inp):
    """Same dtype, or float32 input into a float64 output; returns mixed flag."""
    if out.dtype == inp.dtype:
        return False
    if out.dtype == np.float64 and inp.dtype == np.float32:
        return True
    raise TypeError(
        f"{in_name} is {inp.dtype} but {out_name} is {out.dtype}: accumulating "
        f"float64 data into float32 would lose precision; use a float64 {out_name}"
    )


def _check_positive(name, value, meaning):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 ({meaning}), got {value!r}")
    return float(value)


# Counts and sizes go to C as ssize_t.
_COUNT_MAX = 2**63 - 1


def _check_count(name, value, minimum=1):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not minimum <= value <= _COUNT_MAX:
        limit = " and below 2^63" if isinstance(value, numbers.Integral) and value > _COUNT_MAX else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{limit}, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------
# Gram and cross products
# ---------------------------------------------------------------------------

def gram_update(G, X, *, block_rows=DEFAULT_BLOCK_ROWS, check_finite=True):
    """G += X^T X in place, upper triangle, through BLAS syrk.

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64, C- or F-contiguous
        Accumulator; only its upper triangle is read and written.
    X : ndarray of shape (N, d), float32 or float64
        Rows are samples. float32 X into float64 G uses float32 BLAS on
        blocks of ``block_rows`` rows, accumulated in float64.
    block_rows : int, default=4096
        Rows per float32 block on the mixed-precision path.
    check_finite : bool, default=True
        Raise ValueError on NaN/Inf in X before G is touched.

    Returns
    -------
    G : ndarray of shape (d, d)
        The same array, updated.
    """
    _check_output("G", G, 2)
    _check_array("X", X, 2)
    d = X.shape[1]
    if G.shape != (d, d):
        raise ValueError(f"G must have shape (d, d) = ({d}, {d}) to match X of shape {X.shape}, got {G.shape}")
    mixed = _check_pair_dtypes("G", G, "X", X)
    block_rows = _check_count("block_rows", block_rows)
    _check_disjoint("G", G, X=X)
    if X.shape[0] == 0 or d == 0:
        return G
    X = _as_input(X)
    n = X.shape[0]
    if check_finite and d * d * G.dtype.itemsize <= _DIAGONAL_CHECK_BYTES and 4 * d <= n:
        # Cheaper than scanning X when d is small next to N: the diagonal of
        # X^T X is NaN or Inf exactly when a column of X holds one (or when
        # a square overflows, which would make G non-finite anyway). The
        # product goes to a zeroed d x d temporary, so a refused X leaves G
        # untouched.
        T = np.zeros_like(G)
        _gram_into(T, X, mixed, block_rows)
        if not np.isfinite(T.diagonal()).all():
            raise ValueError(
                f"X contains NaN or Inf (or values whose squares overflow {X.dtype}); expected finite values"
            )
        _kernels.add_upper(G, T)
    else:
        if check_finite:
            _check_gram_input(X, min(n, block_rows) if mixed else n)
        _gram_into(G, X, mixed, block_rows)
    if check_finite and G.dtype == np.float32:
        _check_accumulated("G", G.diagonal(), "X^T X")  # G + X^T X is PSD when G is: its diagonal bounds it
    return G


def _squares_fit(A, rows):
    """max a^2 * rows is finite in A's dtype (so A is finite): one pass over a contiguous A, no temporary.

    Then no sum of ``rows`` products of two such arrays' entries overflows
    (Cauchy-Schwarz).
    """
    flat = A if A.flags.c_contiguous else A.T
    return bool(_kernels.squares_finite(flat.reshape(flat.shape[0], -1), float(rows)))


def _overflow_error(name, A, what):
    verb = "hold" if " and " in name else "holds"
    return ValueError(f"{name} {verb} values whose products overflow {A.dtype} in {what} (largest |x| "
                      f"{float(np.abs(A).max()):.3g}); expected finite values that {A.dtype} can multiply and sum")


def _check_cross_input(X, Z, rows):
    """X and Z are finite and no entry of X^T Z, summed over ``rows`` consecutive rows in their dtype, overflows.

    The one-pass bound of :func:`_squares_fit` on both; only inputs that fail
    it pay for the exact products in float64, block by block.
    """
    if _squares_fit(X, rows) and _squares_fit(Z, rows):
        return
    _check_finite("X", X)
    _check_finite("Z", Z)
    limit = np.finfo(X.dtype).max
    for start in range(0, X.shape[0], rows):
        block = slice(start, start + rows)
        if (np.abs(X[block].astype(np.float64).T @ Z[block].astype(np.float64)) > limit).any():
            raise _overflow_error("X and Z", X if np.abs(X).max() >= np.abs(Z).max() else Z, "X^T Z")


def _check_gram_input(X, rows):
    """X is finite and no column's sum of squares over ``rows`` consecutive rows overflows X's dtype.

    The BLAS product sums squares in X's dtype (per block of ``rows`` on the
    mixed path), so a finite X can still make G infinite. One pass checks the
    bound max x^2 * rows; only an X that fails it pays for the exact sums.
    """
    if _squares_fit(X, rows):
        return
    _check_finite("X", X)
    limit = np.finfo(X.dtype).max
    for start in range(0, X.shape[0], rows):
        block = X[start:start + rows]
        if (np.einsum("ij,ij->j", block, block, dtype=np.float64) > limit).any():
            raise _overflow_error("X", X, "the Gram")


# Largest d x d temporary gram_update uses to check finiteness on the
# diagonal of the product instead of scanning X.
_DIAGONAL_CHECK_BYTES = 8 * 2**20


# Narrower Grams do not follow the flops rule. OpenBLAS's two-thread syrk splits
# the d x d output, and every thread streams all N rows: at d = 33 and 65 it ran
# up to 1.6x slower than one thread in both dtypes, on two days with machines 2x
# apart in speed, while from d = 129 it paid from a few hundred rows. But at
# d = 65 in float64 from 4,096 rows two threads were 1.13-1.18x faster on other
# days (docs/results/threads.md, "Narrow Grams"). So each kind of narrow Gram
# (dtype, d, rows to a power of two) is timed on its first calls with one thread
# and with the rule's, and keeps the faster (fastls._threads.ThreadTrials).
GRAM_MIN_THREADED_D = 96
# ... and Grams of less work (N d^2 flops) run one thread too. On this VM three grids
# measured two threads 0.82-0.92x of one at d = 129 and 64 rows (1.1e6 flops) in both
# dtypes, while from 4.2e6 (d = 129 and 256 rows, d = 257 and 64) two were at least as
# fast in float64 (1.02-1.28x) and within 0.92-1.11x in float32 (docs/results/threads.md,
# "A work floor for Grams").
GRAM_MIN_THREADED_FLOPS = 2e6


def _gram_thread_work(n, d):
    """The work (flops) the size rule sees for a Gram of n x d rows: 0 (one thread) below the work floor."""
    work = float(n) * d * d
    return work if work >= GRAM_MIN_THREADED_FLOPS else 0.0


def _gram_into(G, X, mixed, block_rows):
    g_layout, x_layout = _layout(G), _layout(X)
    n, d = X.shape
    flops = _gram_thread_work(n, d)
    work, trial = flops, None
    if flops and d < GRAM_MIN_THREADED_D:
        work, trial = narrow_gram_trials.plan((X.dtype.char, d, n.bit_length()), flops)
        start = time.perf_counter()
    with sized_threads(work):
        if mixed:
            _kernels.gram_mixed(G, *g_layout, X, *x_layout, block_rows, DEFAULT_TILE)
        else:
            _kernels.gram_same(G, *g_layout, X, *x_layout)
    if trial is not None:
        narrow_gram_trials.record(trial, time.perf_counter() - start, flops)


def cross_update(C, X, Z, *, block_rows=DEFAULT_BLOCK_ROWS, check_finite=True):
    """C += X^T Z in place through BLAS gemm.

    Parameters
    ----------
    C : ndarray of shape (d, m), float32 or float64, C- or F-contiguous
    X : ndarray of shape (N, d), float32 or float64
    Z : ndarray of shape (N, m), same dtype as X
        float32 X and Z into a float64 C take the blocked mixed path.
    block_rows : int, default=4096
    check_finite : bool, default=True

    Returns
    -------
    C : ndarray of shape (d, m)
    """
    _check_output("C", C, 2)
    _check_array("X", X, 2)
    _check_array("Z", Z, 2)
    if Z.shape[0] != X.shape[0]:
        raise ValueError(f"X and Z must have the same number of rows, got {X.shape} and {Z.shape}")
    if X.dtype != Z.dtype:
        raise TypeError(f"X and Z must share a dtype, got {X.dtype} and {Z.dtype}")
    if C.shape != (X.shape[1], Z.shape[1]):
        raise ValueError(
            f"C must have shape (d, m) = {(X.shape[1], Z.shape[1])} for X {X.shape} and Z {Z.shape}, got {C.shape}"
        )
    mixed = _check_pair_dtypes("C", C, "X", X)
    block_rows = _check_count("block_rows", block_rows)
    _check_disjoint("C", C, X=X, Z=Z)
    if X.shape[0] == 0 or C.size == 0:
        return C
    X, Z = _as_input(X), _as_input(Z)
    if check_finite:
        _check_cross_input(X, Z, min(X.shape[0], block_rows) if mixed else X.shape[0])
    layouts = (*_layout(C), X, *_layout(X), Z, *_layout(Z))
    with sized_threads(2.0 * X.shape[0] * X.shape[1] * Z.shape[1]):
        if mixed:
            _kernels.cross_mixed(C, *layouts, block_rows, DEFAULT_TILE)
        else:
            _kernels.cross_same(C, *layouts)
    if check_finite:
        _check_accumulated("C", C, "X^T Z")
    return C


def matmul(X, W, *, out=None, check_finite=True):
    """out = X W through BLAS gemm (the forward product of a layer).

    Runs on SciPy's BLAS under the same thread rule as the statistics, so that
    a forward pass and the statistics after it never wake two thread pools.

    Parameters
    ----------
    X : ndarray of shape (N, d), float32 or float64, any layout
    W : ndarray of shape (d, m), dtype of X, any layout
    out : ndarray of shape (N, m), dtype of X, C- or F-contiguous, optional
        Overwritten; a new C-ordered array when None.
    check_finite : bool, default=True
        Refuse NaN/Inf in X or W before anything is written.

    Returns
    -------
    out : ndarray of shape (N, m)
    """
    _check_array("X", X, 2)
    _check_array("W", W, 2)
    if W.dtype != X.dtype:
        raise TypeError(f"X and W must share a dtype, got {X.dtype} and {W.dtype}")
    if W.shape[0] != X.shape[1]:
        raise ValueError(f"W must have shape (d, m) with d = {X.shape[1]} (the columns of X {X.shape}), got {W.shape}")
    n, m = X.shape[0], W.shape[1]
    if out is None:
        out = np.empty((n, m), dtype=X.dtype)
    else:
        _check_output("out", out, 2)
        if out.shape != (n, m) or out.dtype != X.dtype:
            raise ValueError(f"out must have shape {(n, m)} and dtype {X.dtype}, got {out.shape} {out.dtype}")
    X, W = _as_input(X), _as_input(W)
    if check_finite:
        _check_finite("X", X)
        _check_finite("W", W)
    if out.size == 0:
        return out
    if X.shape[1] == 0:
        out[...] = 0
        return out
    # BLAS reads X and W while it writes out: an out that overlaps them gets a product of half-overwritten
    # inputs, so it receives the product through a temporary instead (as NumPy's matmul does).
    target = np.empty_like(out) if np.may_share_memory(out, X) or np.may_share_memory(out, W) else out
    with sized_threads(2.0 * n * X.shape[1] * m):
        _kernels.matmul_same(target, *_layout(target), X, *_layout(X), W, *_layout(W))
    if check_finite and not np.isfinite(target).all():
        raise ValueError(f"X W overflows {X.dtype}: finite X and W whose product exceeds "
                         f"{np.finfo(X.dtype).max:.3g}; multiply in float64")
    if target is not out:
        out[...] = target
    return out


def add_upper(G, T):
    """G += T on the upper triangle (i <= j) in place; the strict lower triangle of G is not touched.

    Sums Gram matrices, whose data is their upper triangle, at half the memory
    traffic of ``G += T`` (0.22 s against 0.38 s at d = 18,433 in float64).
    NaN and Inf propagate as in ``+=``: validate the summands where they come from.

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64
        Accumulator, C- or Fortran-contiguous and writable.
    T : ndarray of shape (d, d), same dtype as G
        Any layout; only its upper triangle is read.

    Returns
    -------
    G
    """
    _check_output("G", G, 2)
    _check_array("T", T, 2)
    if G.shape[0] != G.shape[1] or T.shape != G.shape:
        raise ValueError(f"G and T must be square matrices of one shape (d, d), got {G.shape} and {T.shape}")
    if T.dtype != G.dtype:
        raise TypeError(f"T must have G's dtype {G.dtype}, got {T.dtype}")
    _kernels.add_upper(G, T)
    return G


def symmetrize(G, *, inplace=False):
    """Full symmetric matrix from the upper triangle of G: triu(G) + triu(G, 1)^T.

    Parameters
    ----------
    G : ndarray of shape (d, d)
    inplace : bool, default=False
        Overwrite the lower triangle of G instead of returning a new array.

    Returns
    -------
    ndarray of shape (d, d)
    """
    (_check_output if inplace else _check_array)("G", G, 2)
    if G.shape[0] != G.shape[1]:
        raise ValueError(f"G must be a square matrix, got shape {G.shape}")
    out = G if inplace else G.copy()
    # By blocks of 512 columns: index arrays of the whole lower triangle would take 8 d^2 bytes.
    d, step = out.shape[0], 512
    for j0 in range(0, d, step):
        j1 = min(j0 + step, d)
        out[j1:, j0:j1] = out[j0:j1, j1:].T
        block = out[j0:j1, j0:j1]
        lower = np.tril_indices(j1 - j0, -1)
        block[lower] = block.T[lower]
    return out


# ---------------------------------------------------------------------------
# Convolution patches
# ---------------------------------------------------------------------------

def _pair(name, value):
    if isinstance(value, numbers.Integral):
        value = (value, value)
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (a, b)):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    if max(abs(a), abs(b)) > _COUNT_MAX:
        raise ValueError(f"{name} must be below 2^63, got {value!r}")
    return int(a), int(b)


def _image_shape(image_shape):
    """(H, W, channels) as positive ints, or ValueError (floats and strings are not truncated)."""
    try:
        H, W, channels = image_shape
    except (TypeError, ValueError):
        raise ValueError(f"image_shape must be (H, W, channels), got {image_shape!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and 1 <= v <= _COUNT_MAX
               for v in (H, W, channels)):
        raise ValueError(f"image_shape must be three positive ints (H, W, channels), got {image_shape!r}")
    return int(H), int(W), int(channels)


def _conv_geometry(image_hw, kernel_size, stride, padding):
    kh, kw = _pair("kernel_size", kernel_size)
    sh, sw = _pair("stride", stride)
    if kh < 1 or kw < 1 or sh < 1 or sw < 1:
        raise ValueError(f"kernel_size and stride must be >= 1, got {(kh, kw)} and {(sh, sw)}")
    if isinstance(padding, str):
        if padding == "valid":
            ph = pw = 0
        elif padding == "same":
            if (sh, sw) != (1, 1) or kh % 2 == 0 or kw % 2 == 0:
                raise ValueError("padding='same' needs stride 1 and an odd kernel size")
            ph, pw = kh // 2, kw // 2
        else:
            raise ValueError(f"padding must be 'valid', 'same', an int or a pair of ints, got {padding!r}")
    else:
        ph, pw = _pair("padding", padding)
        if ph < 0 or pw < 0:
            raise ValueError(f"padding must be >= 0, got {(ph, pw)}")
    H, W = _pair("image_hw", image_hw)
    if H < 1 or W < 1:
        raise ValueError(f"image_hw must be positive (H, W), got {(H, W)}")
    out_h = (H + 2 * ph - kh) // sh + 1
    out_w = (W + 2 * pw - kw) // sw + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(
            f"a {kh}x{kw} kernel with padding {(ph, pw)} does not fit a {H}x{W} image"
        )
    return kh, kw, sh, sw, ph, pw, out_h, out_w


def conv_output_shape(image_hw, kernel_size, stride=1, padding=0):
    """(out_h, out_w) = ((H + 2 ph - kh) // sh + 1, (W + 2 pw - kw) // sw + 1).

    ``padding`` is an int, a pair, ``'valid'`` (0) or ``'same'`` (k // 2).
    """
    return _conv_geometry(image_hw, kernel_size, stride, padding)[-2:]


def _check_images(images):
    _check_array("images", images, 4)
    return np.ascontiguousarray(images)


def im2col(images, kernel_size, *, stride=1, padding=0, append_ones=False):
    """Patch matrix P with P[(b, y, x)] = patch of image b at output (y, x).

    Parameters
    ----------
    images : ndarray of shape (B, H, W, C), float32 or float64 (NHWC)
    kernel_size, stride, padding : int or pair; padding also 'valid'/'same'
        Zero padding on both sides.
    append_ones : bool, default=False
        Append a constant-1 column (the bias input).

    Returns
    -------
    P : ndarray of shape (B * out_h * out_w, kh * kw * C + append_ones)
        C-ordered; columns ordered (ky, kx, channel), channel fastest; rows
        ordered (image, y, x), so ``P @ W`` reshapes to NHWC outputs.
    """
    images = _check_images(images)
    kh, kw, sh, sw, ph, pw, out_h, out_w = _conv_geometry(images.shape[1:3], kernel_size, stride, padding)
    d = kh * kw * images.shape[3] + int(bool(append_ones))
    out = np.empty((images.shape[0] * out_h * out_w, d), dtype=images.dtype)
    if out.size:
        _kernels.im2col_into(images, out, kh, kw, sh, sw, ph, pw, out_h, out_w, bool(append_ones))
    return out


def avg_pool2d(images, pool_size, stride=None):
    """out[b, y, x] = mean of the pool window of images[b] at output (y, x), NHWC.

    One pass over the input, bit-identical to summing the window's strided
    slices in row order and dividing by its area.

    Parameters
    ----------
    images : ndarray of shape (B, H, W, C), float32 or float64
    pool_size : int or pair
    stride : int or pair, optional
        The pool size when None.

    Returns
    -------
    out : ndarray of shape (B, (H - ph) // sh + 1, (W - pw) // sw + 1, C), dtype of images
    """
    images = _check_images(images)
    ph, pw = _pair("pool_size", pool_size)
    sh, sw = (ph, pw) if stride is None else _pair("stride", stride)
    if min(ph, pw, sh, sw) < 1:
        raise ValueError(f"pool_size and stride must be >= 1, got {(ph, pw)} and {(sh, sw)}")
    B, H, W, C = images.shape
    if H < ph or W < pw:
        raise ValueError(f"a {ph}x{pw} pooling window does not fit a {H}x{W} image")
    out = np.empty((B, (H - ph) // sh + 1, (W - pw) // sw + 1, C), dtype=images.dtype)
    if out.size:
        _kernels.avg_pool_into(images, out, ph, pw, sh, sw)
    return out


def scale_negatives(x, factor):
    """x[x < 0] *= factor, in place (a leaky ReLU with slope ``factor``).

    One vectorized pass, no mask or temporary: NumPy's ``where=`` form of
    the same update runs several times slower on large activations.

    Parameters
    ----------
    x : ndarray, float32 or float64, C- or Fortran-contiguous, writable
    factor : float, finite

    Returns
    -------
    x : the same array
    """
    _check_output("x", x, np.ndim(x))
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not np.isfinite(factor):
        raise ValueError(f"factor must be a finite number (the slope of the negative part), got {factor!r}")
    if x.size and abs(factor) > 1:  # only a steeper slope can overflow: checked before x is touched
        lowest = float(x.min())
        if lowest < 0 and abs(lowest * float(factor)) > float(np.finfo(x.dtype).max):
            raise ValueError(f"x * factor overflows {x.dtype} (most negative x {lowest:.3g}, factor {factor:.3g}); "
                             f"scale in float64")
    if x.size:
        _kernels.scale_negatives(x.reshape(-1, order="A"), float(factor))
    return x


def conv_gram_update(G, C, images, targets, kernel_size, *, stride=1, padding=0,
                     append_ones=False, scratch_bytes=DEFAULT_SCRATCH_BYTES,
                     block_rows=DEFAULT_BLOCK_ROWS, check_finite=True, method="auto"):
    """G += P^T P and C += P^T T for the patch matrix P of a batch, streamed.

    One call of :class:`ConvStats`; see there for the two exact methods.

    Parameters
    ----------
    G : ndarray of shape (d, d), d = kh * kw * channels + append_ones
        Upper-triangle accumulator (float32, or float64 for either input dtype).
    C : ndarray of shape (d, m), dtype of G
    images : ndarray of shape (B, H, W, channels), float32 or float64 (NHWC)
    targets : ndarray of shape (B, m) or (B, out_h, out_w, m), dtype of images
        Per-image targets (e.g. an encoded label) apply at every output
        position; that case costs a patch sum per image instead of a
        d x m product per patch.
    kernel_size, stride, padding, append_ones : as in :func:`im2col`
    scratch_bytes : int, default=64 MiB
        Upper bound on the working memory of the patches or gathered pixels,
        whatever B is.
    block_rows : int, default=4096
        Float32 block on the float32-into-float64 path.
    check_finite : bool, default=True
    method : {'auto', 'im2col', 'overlap'}, default='auto'

    Returns
    -------
    (G, C) : the same arrays, updated.
    """
    if not isinstance(images, np.ndarray):
        raise TypeError(f"images must be a NumPy array, got {type(images).__name__}")
    if not isinstance(targets, np.ndarray):
        raise TypeError(f"targets must be a NumPy array, got {type(targets).__name__}")
    _check_array("images", images, 4)
    stats = ConvStats(G, C, images.shape[1:], kernel_size, stride=stride, padding=padding,
                      append_ones=append_ones, per_image_targets=targets.ndim == 2, method=method,
                      scratch_bytes=scratch_bytes, block_rows=block_rows, images=images.shape[0])
    stats.update(images, targets, check_finite=check_finite)
    return stats.finish()


class ConvStats:
    """Running G += P^T P and C += P^T T over batches of images (P = patches).

    Two exact methods:

    * ``'im2col'`` builds patch rows chunk by chunk in a scratch buffer and
      multiplies them (any stride and padding, per-image or per-position
      targets).
    * ``'overlap'`` (stride 1, per-image targets) uses that neighbouring
      patches share pixels: block (a, b) of P^T P is the channel correlation
      of the map at displacement b - a, summed over the window of a. Each
      displacement is multiplied once per cell of the map (cells: the pieces
      into which the window edges cut it), cells that lie in the same windows
      in one product, and the k^2 x k^2 blocks are assembled from those
      products: about 2.85x fewer multiply-adds than im2col on a 14 x 14 map
      with a 3 x 3 kernel. The products are kept per group (one
      channels x channels matrix each, :attr:`state_bytes`) across calls and
      added into G's blocks by :meth:`finish`, so small batches do not pay
      a pass over G each; :meth:`finish` writes each block once from all the
      products feeding it, reading each product once, lines of the blocks
      split over the allowed threads. The
      products' memory is reused by the next ConvStats of the same shape
      (:func:`fastls.recycled_array`); :meth:`finish` leaves them zeroed,
      so that one's first products accumulate into them instead of BLAS
      zeroing them first.

    Parameters
    ----------
    G : ndarray of shape (d, d), d = kh * kw * channels + append_ones
        Upper-triangle accumulator, float32 or float64, C- or F-contiguous.
    C : ndarray of shape (d, m), dtype of G
    image_shape : (H, W, channels)
    kernel_size, stride, padding, append_ones : as in :func:`im2col`
    per_image_targets : bool, default=True
        Targets of shape (B, m), one per image (else (B, out_h, out_w, m)).
    method : {'auto', 'im2col', 'overlap'}, default='auto'
        'auto' takes the overlap path where it applies, the map has at
        least ``OVERLAP_MIN_CHANNELS`` channels and its multiply-adds are at
        most ``OVERLAP_MAX_COST_RATIO`` of im2col's (:func:`conv_stats_cost`).
    scratch_bytes : int, default=64 MiB
        Bound on the patch chunk or the gathered pixels of one call. The
        overlap gathers at most ``OVERLAP_CHUNK_BYTES`` (16 MiB) of pixels
        at a time, so that a product's operands are still in cache when BLAS
        packs them (10 % faster on 14 x 14 x 512 maps), unless that would
        leave the products fewer rows than half their channels: then
        writing the c x c products costs more than the cache saves.
    block_rows : int, default=4096
        On the float32-into-float64 path, rows summed in float32 before a
        product is added to the float64 G.
    images : int, optional
        Images the caller will add before :meth:`finish`, when known: 'auto'
        then weighs the overlap's one pass over G against that many images
        (:func:`conv_stats_method`).
    position_basis : ndarray of shape (out_h, out_w, k, m), optional
        Per-position targets in factored form: the target of image n at
        output position (y, x) is ``targets[n] @ position_basis[y, x]``, and
        :meth:`update` takes the (B, k) coordinates (e.g. one-hot labels when
        each position has its own label code). C is then formed from the k
        target-weighted sums of the images (patches are linear in the image):
        one im2col of k images and one (d, k P) x (k P, m) product at
        :meth:`finish`, so G keeps the per-image methods (the overlap)
        instead of im2col's per-position path.

    Notes
    -----
    G and C hold the complete statistics only after :meth:`finish` (or the
    end of a ``with`` block); :meth:`update` may add part of them earlier.

    Examples
    --------
    >>> with fastls.ConvStats(G, C, (14, 14, 512), 3, append_ones=True) as stats:
    ...     for images, targets in batches:
    ...         stats.update(images, targets)
    """

    def __init__(self, G, C, image_shape, kernel_size, *, stride=1, padding=0, append_ones=False,
                 per_image_targets=True, method="auto", scratch_bytes=DEFAULT_SCRATCH_BYTES,
                 block_rows=DEFAULT_BLOCK_ROWS, images=None, position_basis=None):
        _check_output("G", G, 2)
        _check_output("C", C, 2)
        H, W, channels = _image_shape(image_shape)
        geometry = _conv_geometry((H, W), kernel_size, stride, padding)
        kh, kw, sh, sw, ph, pw, out_h, out_w = geometry
        d = kh * kw * channels + int(bool(append_ones))
        if G.shape != (d, d):
            raise ValueError(f"G must have shape ({d}, {d}) (kh*kw*channels + append_ones), got {G.shape}")
        if C.ndim != 2 or C.shape[0] != d:
            raise ValueError(f"C must have shape ({d}, m), got {C.shape}")
        if G.dtype != C.dtype:
            raise TypeError(f"G and C must share a dtype, got {G.dtype} and {C.dtype}")
        _check_disjoint("C", C, G=G)
        self.G, self.C = G, C
        self.image_shape = (H, W, channels)
        self.geometry = geometry
        self.append_ones = bool(append_ones)
        self.per_image_targets = bool(per_image_targets)
        self._factored = None  # with a position basis: (basis, weighted image sums, target column sums)
        if position_basis is not None:
            _check_array("position_basis", position_basis, 4)
            if not per_image_targets:
                raise ValueError("position_basis takes per-image target coordinates: per_image_targets must be True")
            if position_basis.shape[:2] != (out_h, out_w) or position_basis.shape[3] != C.shape[1]:
                raise ValueError(f"position_basis must have shape ({out_h}, {out_w}, k, {C.shape[1]}) "
                                 f"(out_h, out_w, k, m), got {position_basis.shape}")
            _check_finite("position_basis", position_basis)
            k = position_basis.shape[2]
            self._factored = (np.asarray(position_basis, dtype=np.float64),
                              np.zeros((k, H * W * channels)), np.zeros(k))
            # The per-image kernels still form (sum of patches)^T targets: into a scratch (d, k) C.
            self.C = np.zeros((d, k), dtype=G.dtype)
            self._C_out = C
        self.scratch_bytes = _check_count("scratch_bytes", scratch_bytes)
        self.block_rows = _check_count("block_rows", block_rows)
        self.method = _pick_conv_method(method, self.image_shape, (kh, kw), (sh, sw), (ph, pw),
                                        self.per_image_targets, images)
        self._dtype = None        # of the images, fixed by the first update
        self._partial = None      # overlap: per-group products, their pending float32 rows, zeroed ones

    @property
    def state_bytes(self):
        """Memory held between calls by the per-group products (overlap; 0 otherwise)."""
        if self.method != "overlap":
            return 0
        kh, kw, _, _, _, _, out_h, out_w = self.geometry
        n_groups = len(_overlap_plan(kh, kw, out_h, out_w)[0])
        itemsize = (self._dtype or self.G.dtype).itemsize
        return n_groups * self.image_shape[2] ** 2 * itemsize

    def _check_batch(self, images, targets):
        _check_array("images", images, 4)
        if images.shape[1:] != self.image_shape:
            raise ValueError(f"images must have shape (B, {', '.join(map(str, self.image_shape))}), got {images.shape}")
        if not isinstance(targets, np.ndarray):
            raise TypeError(f"targets must be a NumPy array, got {type(targets).__name__}")
        if targets.dtype != images.dtype:
            raise TypeError(f"targets must have the dtype of images ({images.dtype}), got {targets.dtype}")
        B, m = images.shape[0], self.C.shape[1]
        out_h, out_w = self.geometry[-2:]
        expected = (B, m) if self.per_image_targets else (B, out_h, out_w, m)
        if targets.shape != expected:
            kind = "per-image" if self.per_image_targets else "per-position"
            raise ValueError(f"targets must have shape {expected} ({kind} targets), got {targets.shape}")
        mixed = _check_pair_dtypes("G", self.G, "images", images)
        for name, out in (("G", self.G), ("C", getattr(self, "_C_out", self.C))):
            _check_disjoint(name, out, images=images, targets=targets)
        if self._dtype is not None and images.dtype != self._dtype:
            raise TypeError(f"images must keep the dtype of the first batch ({self._dtype}), got {images.dtype}")
        return mixed

    def update(self, images, targets, *, check_finite=True):
        """Add one batch.

        Parameters
        ----------
        images : ndarray of shape (B, H, W, channels), float32 or float64 (NHWC)
        targets : ndarray of shape (B, m), or (B, out_h, out_w, m) without
            ``per_image_targets``; dtype of images
        check_finite : bool, default=True
            Refuse NaN/Inf before anything is added.

        Returns
        -------
        self
        """
        mixed = self._check_batch(images, targets)
        if images.shape[0] == 0:
            return self
        images = np.ascontiguousarray(images)
        targets = np.ascontiguousarray(targets.reshape(images.shape[0], -1) if self.per_image_targets
                                       else targets.reshape(int(np.prod(targets.shape[:-1])), targets.shape[-1]))
        if check_finite:
            # A statistic sums at most this batch's patch rows of products, in the dtype of the images:
            # the bound of _squares_fit (one pass, which also finds NaN/Inf), conservative (a refused batch
            # would need |x| near 1e17 in float32).
            rows = images.shape[0] * self.geometry[-2] * self.geometry[-1]
            for name, A in (("images", images), ("targets", targets)):
                if not _squares_fit(A, rows):
                    _check_finite(name, A)
                    raise _overflow_error(name, A, f"the patch statistics of {images.shape[0]} images")
        self._dtype = images.dtype
        d = self.G.shape[0]
        out_h, out_w = self.geometry[-2:]
        # Counted as im2col + Gram (the overlap method does less of the same kind of work).
        with sized_threads(float(images.shape[0]) * out_h * out_w * d * d):
            if self.method == "overlap":
                self._update_overlap(images, targets, mixed)
            else:
                self._update_im2col(images, targets, mixed)
            if self._factored is not None:
                _, sums, column_sums = self._factored
                # S_j += sum_n targets[n, j] images[n]: a (k x B) x (B x HWC) product in the images'
                # dtype over at most block_rows images, added in float64 (as G's blocks are), on
                # SciPy's BLAS: NumPy's would wake a second thread pool that spins beside it.
                pixels = images.reshape(images.shape[0], -1)
                for first in range(0, images.shape[0], self.block_rows):
                    rows = slice(first, first + self.block_rows)
                    sums += matmul(targets[rows].T, pixels[rows], check_finite=False)
                column_sums += targets.sum(axis=0, dtype=np.float64)
        return self

    def _update_overlap(self, images, targets, mixed):
        kh, kw, _, _, ph, pw, out_h, out_w = self.geometry
        groups, cells, blocks, rows_per_image, macs_per_image = _overlap_plan(kh, kw, out_h, out_w)
        channels, dtype = self.image_shape[2], images.dtype
        d, m = self.G.shape[0], self.C.shape[1]
        itemsize = dtype.itemsize
        # Fixed: the float32 tile of the mixed cross term. Per image: the two
        # gathered operands and its patch sums.
        fixed = min(d, DEFAULT_TILE) * min(m, DEFAULT_TILE) * 4 if mixed else 0
        per_image = (2 * rows_per_image * channels + d) * itemsize
        most = (self.scratch_bytes - fixed) // per_image
        if most < 1:
            raise ValueError(
                f"scratch_bytes={self.scratch_bytes} is too small for the overlap statistics of a "
                f"{'x'.join(map(str, self.image_shape))} map; need at least {fixed + per_image}"
            )
        B = images.shape[0]
        # Cache-sized chunks unless the products would get too thin (class docstring).
        thin = -(-channels // max(1, int(2 * macs_per_image / len(groups))))
        most = min(most, max(OVERLAP_CHUNK_BYTES // per_image, thin))
        chunk = -(-B // -(-B // most))  # equal chunks: no thin remainder
        if self._partial is None:
            # No zeroing: a group's first product overwrites its slot (no pending rows)
            # or, if the slot is known to be zero, accumulates into it.
            acc, clean = _group_products((len(groups), channels, channels), dtype)
            self._partial = (acc, np.zeros(len(groups), dtype=np.intp), clean)
        acc, pending, clean = self._partial
        # Scratch of one call; recycled, as fresh pages cost more to fault in than the gathers.
        buf_a = recycled_array("fastls.ConvStats.gather_a", (chunk * rows_per_image * channels,), dtype, zero=False)
        buf_b = recycled_array("fastls.ConvStats.gather_b", buf_a.shape, dtype, zero=False)
        sums = recycled_array("fastls.ConvStats.patch_sums", (chunk, d), dtype, zero=False)
        _kernels.overlap_accumulate(acc, pending, clean, *_layout(self.G), images, targets, groups, cells, blocks,
                                    buf_a, buf_b, sums, self.G, self.C, *_layout(self.C), kh, kw, ph, pw,
                                    out_h, out_w, self.append_ones, chunk, mixed, self.block_rows, DEFAULT_TILE)

    def _update_im2col(self, images, targets, mixed):
        kh, kw, sh, sw, ph, pw, out_h, out_w = self.geometry
        d, m = self.G.shape[0], self.C.shape[1]
        itemsize = images.dtype.itemsize
        tile = min(DEFAULT_TILE, d)
        tile_bytes = tile * max(tile, min(DEFAULT_TILE, m)) * 4 if mixed else 0
        row_bytes = d * itemsize
        per_img_rows = out_h * out_w
        per_image = self.per_image_targets
        # Chunk rows r and patch-sum rows s = r / per_img_rows + 2 share the budget.
        budget_rows = (self.scratch_bytes - tile_bytes) // row_bytes
        rows = int((budget_rows - (2 if per_image else 0)) / (1 + (1 / per_img_rows if per_image else 0)))
        if rows < 1:
            # The smallest budget the split above accepts: one patch row, plus
            # (with per-image targets) the patch-sum rows that go with it.
            need = tile_bytes + row_bytes * (4 if per_image else 1)
            raise ValueError(
                f"scratch_bytes={self.scratch_bytes} is too small for patches of {d} values; need at least {need}"
            )
        rows = min(rows, images.shape[0] * per_img_rows)
        scratch = np.empty((rows, d), dtype=images.dtype)
        sums = np.zeros((rows // per_img_rows + 2 if per_image else 1, d), dtype=images.dtype)
        geometry = (kh, kw, sh, sw, ph, pw, out_h, out_w, self.append_ones)
        G, C = self.G, self.C
        if mixed:
            _kernels.conv_stats_mixed(G, *_layout(G), C, *_layout(C), images, targets, per_image, scratch, sums,
                                      *geometry, self.block_rows, DEFAULT_TILE)
        else:
            _kernels.conv_stats_same(G, *_layout(G), C, *_layout(C), images, targets, per_image, scratch, sums,
                                     *geometry)

    def finish(self):
        """Add what is still held per group into G; returns (G, C), complete."""
        if self._partial is not None:
            kh, kw, _, _, _, _, out_h, out_w = self.geometry
            _assemble_blocks(*self._partial, _assembly_plan(kh, kw, out_h, out_w), self.G)
            self._partial = None
        if self._factored is not None:
            self._finish_factored()
            return self.G, self._C_out
        return self.G, self.C

    def _finish_factored(self):
        """C += sum_j im2col(S_j)^T B_j over positions, S_j the target-weighted image sums; then restart them."""
        basis, sums, column_sums = self._factored
        kh, kw, sh, sw, ph, pw, out_h, out_w = self.geometry
        k, m = basis.shape[2], basis.shape[3]
        patches = im2col(sums.reshape(k, *self.image_shape), (kh, kw), stride=(sh, sw), padding=(ph, pw))
        # Rows of the patches run (j, y, x); the basis rows must too.
        update = matmul(patches.T, basis.transpose(2, 0, 1, 3).reshape(k * out_h * out_w, m), check_finite=False)
        C = self._C_out
        C[:update.shape[0]] += update.astype(C.dtype, copy=False)
        if self.append_ones:
            # The bias column of a patch is 1: its row of C is sum_j (sum_n targets[n, j]) sum_positions B_j.
            C[-1] += (column_sums @ basis.sum(axis=(0, 1))).astype(C.dtype, copy=False)
        sums[:] = 0.0
        column_sums[:] = 0.0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        return False


# ---------------------------------------------------------------------------
# Convolution statistics from the overlap of patches
# ---------------------------------------------------------------------------

# The overlap path pays only where each displacement product is a real matrix
# product: below this many channels the C x C products are too thin for BLAS.
OVERLAP_MIN_CHANNELS = 32
# ... and, when the images per finish are unknown, only where it saves at least
# this share of im2col's multiply-adds.
OVERLAP_MAX_COST_RATIO = 0.8
_CONV_METHODS = ("auto", "im2col", "overlap")


@functools.lru_cache(maxsize=64)
def _overlap_plan(kh, kw, out_h, out_w):
    """Groups of cells per displacement, for a stride-1 kh x kw kernel on a padded map.

    The padded map is (out_h + kh - 1) x (out_w + kw - 1); the window of
    kernel offset (ay, ax) is rows [ay, ay + out_h) x columns [ax, ax + out_w).
    Cutting rows at every window edge makes each window a union of bands;
    the cells of one displacement (dy, dx) that lie in the same set of
    windows form one group, multiplied once and added into the block
    (a, a + delta) of each of those windows.

    Returns
    -------
    groups : int32 array (n_groups, 6): dy, dx, cell range, block range
    cells : int32 array (n_cells, 4): y0, y1, x0, x1
    blocks : int32 array (n_blocks, 2): kernel-offset indices a, b (b > a, or b == a)
    rows_per_image : int
        Rows of the largest group for one image (sizes the gather buffers).
    macs_per_image : float
        Multiply-adds per image per channel^2 (the diagonal at half cost).
    """
    def bands(k, out):
        cuts = sorted({*range(k), *range(out, out + k)})
        return list(zip(cuts[:-1], cuts[1:]))

    def members(band_list, k, out, shift):
        # Offsets a with a and a + shift inside the kernel whose window holds the band.
        valid = range(max(0, -shift), min(k, k - shift))
        return [tuple(a for a in valid if a <= lo and hi <= a + out) for lo, hi in band_list]

    row_bands, col_bands = bands(kh, out_h), bands(kw, out_w)
    groups, cells, blocks = [], [], []
    rows_per_image, macs = 0, 0.0
    for dy in range(kh):
        for dx in range(-(kw - 1), kw):
            if dy == 0 and dx < 0:
                continue  # the transposed block of (0, -dx)
            row_sets = members(row_bands, kh, out_h, dy)
            col_sets = members(col_bands, kw, out_w, dx)
            keys = sorted({(r, c) for r in row_sets if r for c in col_sets if c})
            for r_set, c_set in keys:
                first_cell, first_block = len(cells), len(blocks)
                area = 0
                for (y0, y1), rs in zip(row_bands, row_sets):
                    for (x0, x1), cs in zip(col_bands, col_sets):
                        if rs == r_set and cs == c_set:
                            cells.append((y0, y1, x0, x1))
                            area += (y1 - y0) * (x1 - x0)
                blocks += [(ay * kw + ax, (ay + dy) * kw + ax + dx) for ay in r_set for ax in c_set]
                groups.append((dy, dx, first_cell, len(cells), first_block, len(blocks)))
                rows_per_image = max(rows_per_image, area)
                macs += area * (0.5 if dy == dx == 0 else 1.0)
    as_array = functools.partial(np.array, dtype=np.int32)
    return (as_array(groups).reshape(-1, 6), as_array(cells).reshape(-1, 4), as_array(blocks).reshape(-1, 2),
            rows_per_image, macs)


@functools.lru_cache(maxsize=64)
def _assembly_plan(kh, kw, out_h, out_w):
    """The blocks of G the overlap groups feed, each once: (keys (n, 2), starts (n + 1,), groups), int32.

    Block k is (a, b) = keys[k] and is fed by groups[starts[k]:starts[k + 1]],
    in increasing group order.
    """
    groups, _, blocks, _, _ = _overlap_plan(kh, kw, out_h, out_w)
    feeders = {}
    for g, (*_, first, stop) in enumerate(groups):
        for a, b in blocks[first:stop]:
            feeders.setdefault((int(a), int(b)), []).append(g)
    keys = sorted(feeders)
    starts = np.cumsum([0] + [len(feeders[key]) for key in keys])
    members = [g for key in keys for g in feeders[key]]
    as_array = functools.partial(np.array, dtype=np.int32)
    return as_array(keys).reshape(-1, 2), as_array(starts), as_array(members)


def _assemble_blocks(acc, pending, clean, plan, G):
    """G's blocks += the pending per-group products (threads over disjoint lines), then restart the groups.

    The assembly zeroes the products it reads, so those groups are then clean.
    """
    keys, starts, members = plan
    channels = acc.shape[1]
    # Memory-bound adds; threads_for keeps within the caller's core limit. Threads take
    # disjoint lines of every block.
    threads = min(threads_for(2.0 * len(members) * channels * channels), channels)
    bounds = np.linspace(0, channels, threads + 1).astype(int).tolist()
    ranges = [(first, stop) for first, stop in zip(bounds[:-1], bounds[1:]) if stop > first]
    mixed = G.dtype != acc.dtype

    def assemble(line_range):
        _kernels.overlap_assemble(acc, pending, keys, starts, members, G, *_layout(G), mixed, *line_range)

    run_spans(assemble, ranges)
    clean[pending > 0] = 1
    pending[:] = 0


# Per-group products known to be zero, for the recycled products array:
# (weak reference to that array, one flag per group). A first product then
# accumulates (beta 1) instead of BLAS zeroing 4-16 MB before it.
_zeroed_groups = {}
_zeroed_lock = threading.Lock()


def _group_products(shape, dtype):
    """(products, clean): the recycled (n_groups, c, c) products, and which of them are known to be zero."""
    key = "fastls.ConvStats.overlap"
    with _zeroed_lock:
        acc = recycled_array(key, shape, dtype, zero=False)
        ref, clean = _zeroed_groups.get(key, (None, None))
        if ref is None or ref() is not acc:
            # New memory, or another products array meanwhile: nothing is known to be zero.
            clean = np.zeros(shape[0], dtype=np.uint8)
            _zeroed_groups[key] = (weakref.ref(acc), clean)
    return acc, clean


def conv_stats_cost(image_shape, kernel_size, *, stride=1, padding=0):
    """Multiply-adds per image of the patch Gram: (im2col + syrk, overlap or None).

    im2col counts out_h * out_w * d^2 / 2 (syrk's triangle, bias excluded);
    the overlap path counts its displacement products (None where it does
    not apply: stride > 1).

    Parameters
    ----------
    image_shape : (H, W, channels)
    kernel_size, stride, padding : as in :func:`im2col`

    Returns
    -------
    (float, float or None)
    """
    H, W, channels = _image_shape(image_shape)
    kh, kw, sh, sw, ph, pw, out_h, out_w = _conv_geometry((H, W), kernel_size, stride, padding)
    im2col_macs = out_h * out_w * (kh * kw * channels) ** 2 / 2
    if (sh, sw) != (1, 1):
        return im2col_macs, None
    return im2col_macs, _overlap_plan(kh, kw, out_h, out_w)[4] * channels ** 2


def conv_stats_method(image_shape, kernel_size, *, stride=1, padding=0, per_image_targets=True, images=None):
    """The method ``method='auto'`` of :class:`ConvStats` takes: 'overlap' or 'im2col'.

    ``images``, the images summed before each ``finish`` when known, adds the
    cost of adding the products into G (memory-bound, ``FOLD_COST_IN_MACS``
    per element) spread over them: on small maps with many channels the
    overlap pays only over enough images.
    """
    return _pick_conv_method("auto", tuple(image_shape), kernel_size, stride, padding, per_image_targets, images)


# Cost of one element of G read and written by a pass over it, in multiply-adds of
# a float32 gemm: memory-bound, so it is the ratio of the machine's gemm rate to
# its memory speed. The overlap's finish writes each block of G once and reads
# each group product (float32) once and zeroes it: half the bytes of a block.
# Refitted on 2026-11-28 (AVX-512 VM, float32 gemm 344 GFLOP/s; bench/README.md,
# "Run 13"), after the products were zeroed in the finish instead of by BLAS, to
# the measured crossovers of the two methods: about 23 images per finish on
# 6x6x1024 and 50-55 on 4x4x2048 (forced methods, best of 3). No single value
# places both; 295 switches at 2 / 19 / 63 images on 14x14x512 / 6x6x1024 /
# 4x4x2048, where the method it picks loses at most 5-8 % between its switch
# and the measured crossover. It also absorbs what the multiply-add counts leave
# out: the overlap's products on few images are thin (64-256 rows against a
# C x C output) and run below the gemm rate. Before: 400 with the products read
# only (a quarter of a block's bytes), 340 with a finish that read each product
# once per block it fed, 100 on a Haswell VM whose gemm ran at half the speed.
FOLD_COST_IN_MACS = 295
# A pass of im2col's float32-into-float64 path over G also writes and reads the
# float32 tile of the product: about 1.5 times the bytes of a plain pass.
IM2COL_PASS_COST_IN_MACS = 520


def _pick_conv_method(method, image_shape, kernel_size, stride, padding, per_image, images=None):
    if method not in _CONV_METHODS:
        raise ValueError(f"method must be one of {_CONV_METHODS}, got {method!r}")
    im2col_macs, overlap_macs = conv_stats_cost(image_shape, kernel_size, stride=stride, padding=padding)
    usable = overlap_macs is not None and per_image
    if method == "overlap" and not usable:
        raise ValueError(
            "method='overlap' needs stride 1 and per-image targets of shape (B, m); "
            f"got stride {stride} and {'per-image' if per_image else 'per-position'} targets"
        )
    if method == "auto":
        if usable and images:
            # Per finish, the overlap writes each block of G once and reads each
            # group product once; im2col passes over G once per block of
            # DEFAULT_BLOCK_ROWS rows.
            kh, kw = _pair("kernel_size", kernel_size)
            out_h, out_w = conv_output_shape(image_shape[:2], kernel_size, stride, padding)
            channels = image_shape[2]
            keys = _assembly_plan(kh, kw, out_h, out_w)[0]
            groups = _overlap_plan(kh, kw, out_h, out_w)[0]  # one product per group, each feeding some block
            d = kh * kw * channels
            passes = -(-images * out_h * out_w // DEFAULT_BLOCK_ROWS)
            overlap_macs += FOLD_COST_IN_MACS * (len(keys) + len(groups) / 2) * channels ** 2 / images
            im2col_macs += IM2COL_PASS_COST_IN_MACS * passes * d * d / 2 / images
        # With the passes over G counted, the cheaper one wins; without them,
        # the overlap must save a margin that covers its one pass.
        ratio = 1.0 if images else OVERLAP_MAX_COST_RATIO
        pays = usable and image_shape[2] >= OVERLAP_MIN_CHANNELS and overlap_macs <= ratio * im2col_macs
        method = "overlap" if pays else "im2col"
    return method

# ---------------------------------------------------------------------------
# Solves
# ---------------------------------------------------------------------------

_ON_FAILURE = ("raise", "eigh")


def _check_solve(G, C, shift, shift_name, meaning, on_failure, overwrite_g, check_finite, overwrite_c=False, M=None):
    """Every check of a solve, before any array is written; returns (G, shift).

    ``overwrite_c``: C will be solved into; ``M``: an array the solve reads
    after G or C is written (the proximal solve's centre). Neither may share
    memory with what is overwritten.
    """
    G = _check_system(G, C)
    shift = _check_positive(shift_name, shift, meaning)
    # A shift below the smallest normal number is lost in G's diagonal.
    tiny, huge = float(np.finfo(G.dtype).tiny), float(np.finfo(G.dtype).max)  # Python floats: no cast of shift
    if shift < tiny:
        raise ValueError(f"{shift_name} must be at least {tiny:g} (the smallest normal {G.dtype}), got {shift!r}")
    if shift > huge:
        raise ValueError(f"{shift_name} must be at most {huge:g} (the largest {G.dtype}), got {shift!r}")
    if overwrite_g:
        _check_disjoint("G (overwrite_g=True)", G, C=C, M=M)
    if overwrite_c:
        _check_disjoint("C (overwrite_c=True)", C, G=G, M=M)
    if on_failure not in _ON_FAILURE:
        raise ValueError(f"on_failure must be one of {_ON_FAILURE}, got {on_failure!r}")
    if on_failure == "eigh" and overwrite_g:
        raise ValueError("on_failure='eigh' needs the original G: it cannot be combined with overwrite_g=True")
    if check_finite:
        _check_finite_upper(G)
        _check_finite("C", C)
    return G, shift


def _spd_solve(G, rhs, shift, shift_name, overwrite_g, on_failure, what, prepare_rhs=None, failure=None):
    """(G + shift I)^-1 rhs, rhs already an F-ordered working array; arguments checked.

    ``prepare_rhs(rhs)`` runs once G + shift I has factored: a caller's array
    that rhs overwrites is then left as it was when the factorization fails.
    ``failure(column)``: the LinAlgError's message when G + shift I does not
    factor (default: one about a Gram matrix G and ``on_failure``).
    """
    d = G.shape[0]
    if d == 0:
        if prepare_rhs is not None:
            prepare_rhs(rhs)
        return rhs
    in_place = overwrite_g and G.flags.writeable and (G.flags.c_contiguous or G.flags.f_contiguous)
    A = G if in_place else G.copy(order="F" if G.flags.f_contiguous else "C")
    _kernels.add_diagonal(A, shift)
    with sized_threads(d ** 3 / 3.0 + 2.0 * d * d * rhs.shape[1]):
        if prepare_rhs is None:
            info = _kernels.cholesky_solve(A, *_layout(A), rhs)
        else:
            info = _kernels.cholesky_solve(A, *_layout(A), np.empty((d, 0), dtype=A.dtype, order="F"))
            if info == 0:
                prepare_rhs(rhs)
                info = _kernels.cholesky_solve(A, *_layout(A), rhs, True)
    if info == 0:
        return rhs
    if info < 0:  # pragma: no cover - an argument error is a bug here
        raise RuntimeError(f"LAPACK potrf/potrs rejected argument {-info}")
    if on_failure == "raise" and failure is not None:
        raise np.linalg.LinAlgError(failure(info))
    if on_failure == "raise":
        raise np.linalg.LinAlgError(
            f"{what}: G + {shift_name} I is not positive definite (Cholesky failed at column {info}, "
            f"{shift_name}={shift:g}). G must be a Gram matrix X^T X (upper triangle read); increase "
            f"{shift_name}, check how G was accumulated, or pass on_failure='eigh' to solve through a "
            f"symmetric eigendecomposition (pseudo-inverse)."
        )
    warnings.warn(
        f"{what}: G + {shift_name} I is not positive definite; solving through eigh (pseudo-inverse)",
        RuntimeWarning,
        stacklevel=3,
    )
    if prepare_rhs is not None:
        prepare_rhs(rhs)
    evals, evecs = scipy.linalg.eigh(symmetrize(np.asarray(G, dtype=rhs.dtype)), lower=False)
    evals = evals + shift
    tol = np.abs(evals).max() * d * np.finfo(rhs.dtype).eps
    inv = np.where(evals > tol, 1.0 / np.where(evals > tol, evals, 1.0), 0.0).astype(rhs.dtype)
    return np.asfortranarray(evecs @ (inv[:, None] * (evecs.T @ rhs)))


RHS_BASIS_TOLERANCE = 1e-4


def _check_basis_shape(basis, m, name="C"):
    """rhs_basis is a finite (k, m) array with k < m, ``m`` the columns of ``name``."""
    _check_array("rhs_basis", basis, 2)
    if basis.shape[1] != m or basis.shape[0] >= basis.shape[1]:
        raise ValueError(f"rhs_basis must have shape (k, m) with k < m = {m} columns of {name}, got {basis.shape}")
    _check_finite("rhs_basis", basis)


def _basis_coordinates(name, A, basis, dtype):
    """B with A = B @ basis for a full-row-rank basis (k, m), checked: A must lie in its row space."""
    _check_basis_shape(basis, A.shape[1], name)
    Q = np.asarray(basis, dtype=dtype)
    # B = A Q^+ with Q^+ = Q^T (Q Q^T)^-1: k x k normal equations, well posed for a full-row-rank Q.
    # Products on SciPy's BLAS (matmul), as everywhere next to a solve (see _dual_rest).
    A = np.asarray(A, dtype=dtype)
    B = scipy.linalg.solve(Q @ Q.T, matmul(Q, A.T, check_finite=False), assume_a="pos").T
    scale = np.linalg.norm(A)
    residual = np.linalg.norm(A - matmul(B, Q, check_finite=False))
    if scale and residual > RHS_BASIS_TOLERANCE * scale:
        raise ValueError(f"{name} is not in the row space of rhs_basis (relative residual {residual / scale:.2e} > "
                         f"{RHS_BASIS_TOLERANCE:g}); solve without rhs_basis")
    return np.asfortranarray(B), Q


def _expand(W_coordinates, Q):
    """(d, k) solution times the (k, m) basis, Fortran-ordered like the plain solves."""
    out = np.empty((W_coordinates.shape[0], Q.shape[1]), dtype=W_coordinates.dtype, order="F")
    return matmul(W_coordinates, Q.astype(W_coordinates.dtype, copy=False), out=out, check_finite=False)


def _check_system(G, C):
    _check_array("G", G, 2)
    _check_array("C", C, 2)
    if G.shape[0] != G.shape[1]:
        raise ValueError(f"G must be square (d, d), got {G.shape}")
    if C.shape[0] != G.shape[0]:
        raise ValueError(f"C must have shape (d, m) with d = {G.shape[0]} rows to match G, got {C.shape}")
    if C.dtype != G.dtype:
        raise TypeError(f"G and C must share a dtype, got {G.dtype} and {C.dtype}")
    G = _as_input(G)
    return G


def _working_rhs(C, overwrite_c):
    if overwrite_c and C.flags.f_contiguous and C.flags.writeable:
        return C
    return np.array(C, order="F", copy=True)


def ridge_solve(G, C, gamma, *, overwrite_g=False, overwrite_c=False, on_failure="raise", check_finite=True,
                rhs_basis=None):
    """W = (G + gamma I)^-1 C by Cholesky (potrf/potrs), never an explicit inverse.

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64
        Gram matrix; only its upper triangle is read.
    C : ndarray of shape (d, m), dtype of G
    gamma : float > 0
        Ridge regularization.
    overwrite_g : bool, default=False
        Factorize G in place (no d x d copy); G is destroyed.
    overwrite_c : bool, default=False
        Solve into C when it is Fortran-contiguous (else a d x m copy is made).
    on_failure : {'raise', 'eigh'}, default='raise'
        When G + gamma I is not positive definite: raise LinAlgError, or warn
        and solve by a symmetric eigendecomposition with a pseudo-inverse.
    check_finite : bool, default=True
    rhs_basis : ndarray of shape (k, m), k < m, optional
        A full-row-rank Q with C = B Q (e.g. targets encoded as Z = Y Q, so
        X^T Z = (X^T Y) Q): the solve runs on the k columns of B = C Q^+ and
        returns (G + gamma I)^-1 B Q, the same W for 2 d^2 k instead of
        2 d^2 m flops of triangular solves. C must lie in Q's row space (to
        a relative residual of ``RHS_BASIS_TOLERANCE``), else ValueError.

    Returns
    -------
    W : ndarray of shape (d, m), Fortran-ordered, dtype of G
    """
    # With rhs_basis the solve runs on new coordinates: C is not written, whatever overwrite_c says.
    G, gamma = _check_solve(G, C, gamma, "gamma", "the ridge regularization", on_failure, overwrite_g,
                            check_finite, overwrite_c=overwrite_c and rhs_basis is None)
    if rhs_basis is not None:
        B, Q = _basis_coordinates("C", C, rhs_basis, G.dtype)
        return _expand(_spd_solve(G, B, gamma, "gamma", overwrite_g, on_failure, "ridge_solve"), Q)
    rhs = _working_rhs(C, overwrite_c)
    return _spd_solve(G, rhs, gamma, "gamma", overwrite_g, on_failure, "ridge_solve")


def proximal_solve(G, C, eps, M, *, overwrite_g=False, overwrite_c=False, on_failure="raise", check_finite=True,
                   rhs_basis=None):
    """W = (G + eps I)^-1 (C + eps M): the least-squares step pulled towards M.

    Solves argmin_W ||Z - X W||^2 + eps ||W - M||^2 given G = X^T X and
    C = X^T Z (pFedACnnL's personalization, eq. 13).

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64 (upper triangle read)
    C : ndarray of shape (d, m), dtype of G
    eps : float > 0
        Proximal weight.
    M : ndarray of shape (d, m)
        The weights to stay near (the group's meta-model).
    overwrite_g, overwrite_c, on_failure, check_finite, rhs_basis : as in :func:`ridge_solve`
        With ``rhs_basis``, C + eps M must lie in its row space.

    Returns
    -------
    W : ndarray of shape (d, m), Fortran-ordered, dtype of G
    """
    G, eps = _check_solve(G, C, eps, "eps", "the proximal weight", on_failure, overwrite_g, check_finite,
                          overwrite_c=overwrite_c, M=M)
    _check_array("M", M, 2)
    if M.shape != C.shape:
        raise ValueError(f"M must have the shape of C {C.shape}, got {M.shape}")
    if M.dtype not in _FLOATS or (M.dtype == np.float64 and G.dtype == np.float32):
        raise TypeError(f"M must be float32 or float64 and not wider than G ({G.dtype}): the solve runs in G's "
                        f"dtype; got M of dtype {M.dtype}")
    if check_finite:
        _check_finite("M", _as_input(M))
        if C.size and float(np.abs(C).max()) + eps * float(np.abs(M).max()) > float(np.finfo(G.dtype).max):
            raise ValueError(f"C + eps M overflows {G.dtype} (max |C| {float(np.abs(C).max()):.3g}, eps "
                             f"{eps:.3g}, max |M| {float(np.abs(M).max()):.3g}); solve in float64")
    if rhs_basis is not None:
        rhs = _working_rhs(C, False)
        rhs += eps * M
        B, Q = _basis_coordinates("C + eps M", rhs, rhs_basis, G.dtype)
        return _expand(_spd_solve(G, B, eps, "eps", overwrite_g, on_failure, "proximal_solve"), Q)

    def add_pull(rhs):
        rhs += eps * M

    # eps M is added once G + eps I has factored, so a C solved into in place is intact after a LinAlgError.
    return _spd_solve(G, _working_rhs(C, overwrite_c), eps, "eps", overwrite_g, on_failure, "proximal_solve",
                      prepare_rhs=add_pull)


def proximal_cost(n, d, m, *, gram_flops=None):
    """Flops of the proximal solve in its primal and its dual form.

    primal: G = X^T X (n d^2, or ``gram_flops``), Cholesky of d x d (d^3 / 3),
    two triangular solves with m right-hand sides (2 d^2 m).
    dual: X X^T (n^2 d), Cholesky of n x n (n^3 / 3), X M and X^T S
    (4 n d m), the triangular solves (2 n^2 m).

    Returns
    -------
    dict with "primal" and "dual" (float flops)
    """
    for name, value in (("n", n), ("d", d), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    n, d, m = float(n), float(d), float(m)
    gram = n * d * d if gram_flops is None else float(gram_flops)
    return {"primal": gram + d ** 3 / 3 + 2 * d * d * m,
            "dual": n * n * d + n ** 3 / 3 + 4 * n * d * m + 2 * n * n * m}


def proximal_solve_dual(X, Z, eps, M, *, block_rows=DEFAULT_BLOCK_ROWS, check_finite=True, rhs_basis=None):
    """W = M + X^T (X X^T + eps I)^-1 (Z - X M): :func:`proximal_solve` without G.

    The same minimizer of ||Z - X W||^2 + eps ||W - M||^2 by the Woodbury
    identity, through an n x n system: the cheaper form when the rows n are
    fewer than the features d (see :func:`proximal_cost`).

    Parameters
    ----------
    X : ndarray of shape (n, d), float32 or float64
        float32 X with a float64 M is multiplied in float64 (X X^T from
        float32 blocks of ``block_rows`` columns accumulated in float64;
        X M and X^T S from float64 copies of ``block_rows`` rows at a time).
    Z : ndarray of shape (n, m), dtype of X
    eps : float > 0
    M : ndarray of shape (d, m), float32 or float64 (not float32 with float64 X)
        Sets the dtype of the computation and of W.
    block_rows : int, default=4096
    check_finite : bool, default=True
    rhs_basis : ndarray of shape (k, m), k < m, optional
        A full-row-rank Q with Z = Y Q and M = M' Q (encoded targets and a
        model fitted to them): everything after X X^T runs on k columns,
        and W = (M' + X^T S') Q. Z and M must lie in Q's row space.

    Returns
    -------
    W : ndarray of shape (d, m), dtype of M
    """
    _check_array("X", X, 2)
    _check_array("Z", Z, 2)
    _check_array("M", M, 2)
    n, d = X.shape
    if Z.shape[0] != n or Z.dtype != X.dtype:
        raise ValueError(f"Z must have shape ({n}, m) and the dtype of X ({X.dtype}), got {Z.shape} {Z.dtype}")
    if M.shape != (d, Z.shape[1]):
        raise ValueError(f"M must have shape (d, m) = ({d}, {Z.shape[1]}) for X {X.shape} and Z {Z.shape}, got {M.shape}")
    _check_pair_dtypes("M", M, "X", X)
    eps = _check_positive("eps", eps, "the proximal weight")
    block_rows = _check_count("block_rows", block_rows)
    X, Z, M = _as_input(X), _as_input(Z), np.ascontiguousarray(M)
    if check_finite:
        for name, A in (("X", X), ("Z", Z), ("M", M)):
            _check_finite(name, A)
    dtype = M.dtype
    Q = None
    if rhs_basis is not None:
        Z, Q = _basis_coordinates("Z", Z, rhs_basis, dtype)
        M, _ = _basis_coordinates("M", M, rhs_basis, dtype)
        M = np.ascontiguousarray(M)
    K = np.zeros((n, n), dtype=dtype)
    # X X^T, upper triangle; checked for overflow (X itself was checked above).
    gram_update(K, X.T, block_rows=block_rows, check_finite=check_finite)
    with sized_threads(4.0 * n * d * M.shape[1]):
        return _dual_rest(X, Z, M, Q, K, eps, d, dtype)


def _dual_rest(X, Z, M, Q, K, eps, d, dtype):
    """proximal_solve_dual after X X^T: the residual, the n x n solve and the update of M."""
    n = X.shape[0]
    # X M and X^T S in the dtype of M, over row slices of X cast at most
    # DEFAULT_SCRATCH_BYTES at a time.
    step = max(1, DEFAULT_SCRATCH_BYTES // (max(d, 1) * dtype.itemsize))
    slices = [slice(start, start + step) for start in range(0, n, step)]
    # The products run on SciPy's BLAS (matmul), like the Cholesky between them: NumPy's
    # would wake its own thread pool to spin beside SciPy's.
    R = np.array(Z, dtype=dtype)
    for rows in slices:
        R[rows] -= matmul(X[rows].astype(dtype, copy=False), M, check_finite=False)
    def failure(column):
        # Not the generic message: this function has no G and no on_failure.
        return (f"proximal_solve_dual: X X^T + eps I ({n} x {n}, {dtype}) is not positive definite (Cholesky "
                f"failed at column {column}, eps={eps:g}): eps is below the rounding of X X^T. Increase eps, or "
                f"solve the primal form with fastls.proximal_solve, which can fall back to an eigendecomposition.")

    S = _spd_solve(K, np.asfortranarray(R), eps, "eps", True, "raise", "proximal_solve_dual", failure=failure)
    W = M.copy()
    for rows in slices:
        W += matmul(X[rows].astype(dtype, copy=False).T, S[rows], check_finite=False)
    return W if Q is None else matmul(W, Q.astype(dtype, copy=False), check_finite=False)
