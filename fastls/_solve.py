"""Cholesky solves of shifted Gram systems: ridge, proximal, and the proximal solve's dual form."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable
from typing import Literal

import numpy as np
import scipy.linalg

from . import _kernels
from ._products import DEFAULT_BLOCK_ROWS, gram_update, matmul, symmetrize
from ._threads import sized_threads
from ._validation import (_FLOATS, _as_input, _check_array, _check_count, _check_disjoint, _check_finite,
                          _check_finite_upper, _check_pair_dtypes, _check_positive, _layout)
from ._workspace import DEFAULT_SCRATCH_BYTES

__all__ = ["ridge_solve", "refined_ridge_solve", "proximal_solve", "proximal_solve_dual", "proximal_cost"]

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


def _shifted(G, shift, overwrite_g):
    """G + shift I (upper triangle), to be factored: in G itself when ``overwrite_g`` allows, else in a copy."""
    in_place = overwrite_g and G.flags.writeable and (G.flags.c_contiguous or G.flags.f_contiguous)
    A = G if in_place else G.copy(order="F" if G.flags.f_contiguous else "C")
    _kernels.add_diagonal(A, shift)
    return A


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
    A = _shifted(G, shift, overwrite_g)
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


def ridge_solve(G: np.ndarray, C: np.ndarray, gamma: float, *, overwrite_g: bool = False, overwrite_c: bool = False,
                on_failure: Literal["raise", "eigh"] = "raise", check_finite: bool = True,
                rhs_basis: np.ndarray | None = None) -> np.ndarray:
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

    Raises
    ------
    TypeError
        If G or C is not a float32/float64 array, or their dtypes differ.
    ValueError
        If the shapes do not match, gamma is not a finite number > 0 representable
        in G's dtype, an overwritten array shares memory with another argument,
        (with ``check_finite``) G's upper triangle or C holds NaN/Inf, or C is not
        in the row space of ``rhs_basis``.
    numpy.linalg.LinAlgError
        If G + gamma I is not positive definite and ``on_failure='raise'``.
    """
    # With rhs_basis the solve runs on new coordinates: C is not written, whatever overwrite_c says.
    G, gamma = _check_solve(G, C, gamma, "gamma", "the ridge regularization", on_failure, overwrite_g,
                            check_finite, overwrite_c=overwrite_c and rhs_basis is None)
    if rhs_basis is not None:
        B, Q = _basis_coordinates("C", C, rhs_basis, G.dtype)
        return _expand(_spd_solve(G, B, gamma, "gamma", overwrite_g, on_failure, "ridge_solve"), Q)
    rhs = _working_rhs(C, overwrite_c)
    return _spd_solve(G, rhs, gamma, "gamma", overwrite_g, on_failure, "ridge_solve")


#: Corrections of :func:`refined_ridge_solve` at most this fraction of W (Frobenius) end the refinement.
REFINE_TOLERANCE = 1e-9
#: Where corrections stop halving (the float64 residuals' rounding reached), the refinement has converged when
#: the last correction is at most this multiple of its ``tol``.
REFINE_FLOOR = 100.0
#: Residual evaluations :func:`refined_ridge_solve` makes at most.
REFINE_MAX_ITER = 30


def refined_ridge_solve(G: np.ndarray, C: np.ndarray, gamma: float, gram_product: Callable[[np.ndarray], np.ndarray],
                        *, overwrite_g: bool = False, tol: float = REFINE_TOLERANCE, max_iter: int = REFINE_MAX_ITER,
                        check_finite: bool = True) -> tuple[np.ndarray, dict]:
    """W = (A + gamma I)^-1 C by the Cholesky factor of an approximation G of A, refined against exact products A V.

    Mixed-precision iterative refinement, the scheme of LAPACK's ``dsposv``
    (whose approximation is a single-precision factor; here it is G): with
    L L^T = G + gamma I,

        W_0 = (G + gamma I)^-1 C,
        R_k = C - (gram_product(W_k) + gamma W_k),   W_{k+1} = W_k + (G + gamma I)^-1 R_k,

    which converges to (A + gamma I)^-1 C when ||(G + gamma I)^-1 (A - G)|| < 1:
    e.g. G = X X^T summed from float32 products, and A V = X (X^T V) multiplied in
    float64, a pass over X per step instead of a float64 Gram.

    Parameters
    ----------
    G : ndarray of shape (d, d), float64
        The approximation of A; only its upper triangle is read.
    C : ndarray of shape (d, m), float64
        Not written.
    gamma : float > 0
    gram_product : callable, ndarray (d, m) float64 -> ndarray (d, m) float64
        A V for the symmetric positive semidefinite A, in float64.
    overwrite_g : bool, default=False
        Factorize G in place; G is destroyed.
    tol : float > 0, default=REFINE_TOLERANCE
        The refinement ends, converged, once a correction is at most ``tol`` ||W||
        (Frobenius norms).
    max_iter : int >= 1, default=REFINE_MAX_ITER
        Residual evaluations (calls of ``gram_product``) at most.
    check_finite : bool, default=True

    Returns
    -------
    W : ndarray of shape (d, m), Fortran-ordered, float64
    report : dict
        ``"iterations"`` (calls of ``gram_product``), ``"correction"`` (the
        last correction over ||W||) and ``"converged"``. The refinement also
        ends when a correction is not at most half the previous one: it has
        then reached the rounding of the float64 residuals (as accurate as a
        solve with the exact A would be), and counts as converged when that
        correction is at most ``REFINE_FLOOR`` x ``tol``; above it, G is too
        far from A, and the caller solves with an exact Gram.

    Raises
    ------
    TypeError
        If G or C is not float64.
    ValueError
        As :func:`ridge_solve`, and if ``gram_product`` returns anything but a float64
        array of its argument's shape, or one holding NaN/Inf.
    numpy.linalg.LinAlgError
        If G + gamma I is not positive definite (a G too far from A, or A + gamma I
        too close to singular for G's rounding).
    """
    G, gamma = _check_solve(G, C, gamma, "gamma", "the ridge regularization", "raise", overwrite_g, check_finite)
    if G.dtype != np.float64:
        raise TypeError(f"refined_ridge_solve refines in float64: G and C must be float64, got {G.dtype}")
    tol = _check_positive("tol", tol, "the relative size of the last correction")
    max_iter = _check_count("max_iter", max_iter)
    d = G.shape[0]
    W = _working_rhs(C, False)
    if d == 0:
        return W, {"iterations": 0, "correction": 0.0, "converged": True}
    A = _shifted(G, gamma, overwrite_g)
    with sized_threads(d ** 3 / 3.0 + 2.0 * d * d * W.shape[1]):
        info = _kernels.cholesky_solve(A, *_layout(A), W)
    if info > 0:
        raise np.linalg.LinAlgError(
            f"refined_ridge_solve: G + gamma I is not positive definite (Cholesky failed at column {info}, "
            f"gamma={gamma:g}); G must approximate a Gram matrix (upper triangle read) closely enough, else "
            f"solve with the exact Gram (ridge_solve)")
    if info < 0:  # pragma: no cover - an argument error is a bug here
        raise RuntimeError(f"LAPACK potrf/potrs rejected argument {-info}")
    return W, _refine(A, C, W, gamma, gram_product, tol, max_iter)


def _refine(factor, C, W, gamma, gram_product, tol, max_iter):
    """The refinement steps of :func:`refined_ridge_solve` on W in place, ``factor`` the Cholesky factor of
    G + gamma I; returns the report."""
    d = factor.shape[0]
    report = {"iterations": 0, "correction": float("inf"), "converged": False}
    previous = float("inf")
    for _ in range(max_iter):
        product = gram_product(W)
        report["iterations"] += 1
        if not isinstance(product, np.ndarray) or product.shape != W.shape or product.dtype != np.float64:
            got = (f"{product.dtype} array of shape {product.shape}" if isinstance(product, np.ndarray)
                   else type(product).__name__)
            raise ValueError(f"gram_product must return a float64 array of the shape of its argument {W.shape}, "
                             f"got {got}")
        _check_finite("gram_product(W)", product)
        residual = np.array(C, dtype=np.float64, order="F")
        residual -= product
        residual -= gamma * W
        with sized_threads(2.0 * d * d * W.shape[1]):
            _kernels.cholesky_solve(factor, *_layout(factor), residual, True)
        W += residual
        scale = float(np.linalg.norm(W))
        report["correction"] = correction = float(np.linalg.norm(residual)) / scale if scale > 0 else 0.0
        if correction <= tol:
            report["converged"] = True
            break
        if correction > 0.5 * previous:
            report["converged"] = correction <= REFINE_FLOOR * tol
            break
        previous = correction
    return report


def proximal_solve(G: np.ndarray, C: np.ndarray, eps: float, M: np.ndarray, *, overwrite_g: bool = False,
                   overwrite_c: bool = False, on_failure: Literal["raise", "eigh"] = "raise", check_finite: bool = True,
                   rhs_basis: np.ndarray | None = None) -> np.ndarray:
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

    Raises
    ------
    TypeError
        As :func:`ridge_solve`, and if M is wider than G.
    ValueError
        As :func:`ridge_solve` (for eps), and if M's shape is not C's, M holds
        NaN/Inf, or C + eps M overflows.
    numpy.linalg.LinAlgError
        If G + eps I is not positive definite and ``on_failure='raise'``.
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


def proximal_cost(n: float, d: float, m: float, *, gram_flops: float | None = None) -> dict[str, float]:
    """Flops of the proximal solve in its primal and its dual form.

    primal: G = X^T X (n d^2, or ``gram_flops``), Cholesky of d x d (d^3 / 3),
    two triangular solves with m right-hand sides (2 d^2 m).
    dual: X X^T (n^2 d), Cholesky of n x n (n^3 / 3), X M and X^T S
    (4 n d m), the triangular solves (2 n^2 m).

    Returns
    -------
    dict with "primal" and "dual" (float flops)

    Raises
    ------
    ValueError
        If n, d or m is not a finite number >= 0.
    """
    for name, value in (("n", n), ("d", d), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    n, d, m = float(n), float(d), float(m)
    gram = n * d * d if gram_flops is None else float(gram_flops)
    return {"primal": gram + d ** 3 / 3 + 2 * d * d * m,
            "dual": n * n * d + n ** 3 / 3 + 4 * n * d * m + 2 * n * n * m}


def proximal_solve_dual(X: np.ndarray, Z: np.ndarray, eps: float, M: np.ndarray, *,
                        block_rows: int = DEFAULT_BLOCK_ROWS, check_finite: bool = True,
                        rhs_basis: np.ndarray | None = None) -> np.ndarray:
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

    Raises
    ------
    TypeError
        If an argument is not a float32/float64 array, or M is float32 with float64 X.
    ValueError
        If the shapes or dtypes of X, Z and M do not match, eps is not a finite
        number > 0, (with ``check_finite``) an input holds NaN/Inf, or Z or M is
        not in the row space of ``rhs_basis``.
    numpy.linalg.LinAlgError
        If X X^T + eps I is not positive definite (eps below its rounding).
    """
    _check_array("X", X, 2)
    _check_array("Z", Z, 2)
    _check_array("M", M, 2)
    n, d = X.shape
    if Z.shape[0] != n or Z.dtype != X.dtype:
        raise ValueError(f"Z must have shape ({n}, m) and the dtype of X ({X.dtype}), got {Z.shape} {Z.dtype}")
    if M.shape != (d, Z.shape[1]):
        raise ValueError(f"M must have shape (d, m) = ({d}, {Z.shape[1]}) for X {X.shape} and Z {Z.shape}, "
                         f"got {M.shape}")
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
