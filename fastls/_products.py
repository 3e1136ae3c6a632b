"""Gram, cross and forward products: G += X^T X, C += X^T Z, X W and the upper-triangle helpers."""

from __future__ import annotations

import time

import numpy as np

from . import _kernels
from ._threads import narrow_gram_trials, sized_threads
from ._validation import (_as_input, _check_accumulated, _check_array, _check_count, _check_disjoint, _check_finite,
                          _check_output, _check_pair_dtypes, _layout, _overflow_error, _squares_fit)

__all__ = ["gram_update", "cross_update", "matmul", "add_upper", "symmetrize"]

#: Rows summed in float32 before a product is added to a float64 output (the ``block_rows`` default).
DEFAULT_BLOCK_ROWS = 4096
# Widest float32 tile of a float32-into-float64 product (26 MB of scratch); dimensions split evenly.
DEFAULT_TILE = 2560


def gram_update(G: np.ndarray, X: np.ndarray, *, block_rows: int = DEFAULT_BLOCK_ROWS,
                check_finite: bool = True) -> np.ndarray:
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

    Raises
    ------
    TypeError
        If G or X is not a float32/float64 array, or X is float64 with a float32 G.
    ValueError
        If the shapes do not match, G is read-only, non-contiguous or shares memory
        with X, or (with ``check_finite``) X holds NaN/Inf or values whose squares
        overflow, or a float32 G overflows. G is unchanged when X is refused.
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


# Largest d x d temporary gram_update uses to check finiteness on the
# diagonal of the product instead of scanning X.
_DIAGONAL_CHECK_BYTES = 8 * 2**20
# Narrower Grams do not follow the flops rule: whether OpenBLAS's two-thread syrk
# (which splits the d x d output, each thread streaming all N rows) beats one thread
# flips between machines and days, so each kind of narrow Gram (dtype, d, rows to a
# power of two) is timed on its first calls with one thread and with the rule's, and
# keeps the faster (fastls._threads.ThreadTrials; docs/results/kernels_notes.md).
GRAM_MIN_THREADED_D = 96
# ... and Grams of less work (N d^2 flops) run one thread too: below it a second
# thread did not pay in either dtype (docs/results/kernels_notes.md).
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


def cross_update(C: np.ndarray, X: np.ndarray, Z: np.ndarray, *, block_rows: int = DEFAULT_BLOCK_ROWS,
                 check_finite: bool = True) -> np.ndarray:
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

    Raises
    ------
    TypeError
        If an argument is not a float32/float64 array, X and Z differ in dtype, or
        they are float64 with a float32 C.
    ValueError
        If the shapes do not match, C is read-only, non-contiguous or shares memory
        with X or Z, or (with ``check_finite``) X or Z holds NaN/Inf or products
        that overflow, or a float32 C overflows.
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


def matmul(X: np.ndarray, W: np.ndarray, *, out: np.ndarray | None = None, check_finite: bool = True) -> np.ndarray:
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

    Raises
    ------
    TypeError
        If X or W is not a float32/float64 array, or their dtypes differ.
    ValueError
        If the shapes do not match or ``out`` is unfit, or (with ``check_finite``)
        X or W holds NaN/Inf or their product overflows.
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


def add_upper(G: np.ndarray, T: np.ndarray) -> np.ndarray:
    """G += T on the upper triangle (i <= j) in place; the strict lower triangle of G is not touched.

    Sums Gram matrices, whose data is their upper triangle, at half the memory
    traffic of ``G += T``.
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

    Raises
    ------
    TypeError
        If G or T is not a float32/float64 array, or T's dtype is not G's.
    ValueError
        If G and T are not square of one shape, or G is read-only or non-contiguous.
    """
    _check_output("G", G, 2)
    _check_array("T", T, 2)
    if G.shape[0] != G.shape[1] or T.shape != G.shape:
        raise ValueError(f"G and T must be square matrices of one shape (d, d), got {G.shape} and {T.shape}")
    if T.dtype != G.dtype:
        raise TypeError(f"T must have G's dtype {G.dtype}, got {T.dtype}")
    _kernels.add_upper(G, T)
    return G


def symmetrize(G: np.ndarray, *, inplace: bool = False) -> np.ndarray:
    """Full symmetric matrix from the upper triangle of G: triu(G) + triu(G, 1)^T.

    Parameters
    ----------
    G : ndarray of shape (d, d)
    inplace : bool, default=False
        Overwrite the lower triangle of G instead of returning a new array.

    Returns
    -------
    ndarray of shape (d, d)

    Raises
    ------
    ValueError
        If G is not square (or, with ``inplace``, read-only or non-contiguous).
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
