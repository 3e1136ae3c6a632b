"""Choosing a ridge shift from the data: every ridge solution from one factorization.

With G = X^T X = V diag(lambda) V^T and B = V^T X^T R, the ridge solution
for any shift a is W(a) = V diag(1 / (lambda + a)) B, and the criteria below
are sums over the d eigenpairs: O(d k) per shift once the factorization is
known (k columns of B).

For large d from statistics alone, the eigendecomposition's reduction to a
tridiagonal matrix runs half at memory speed (d^3 / 3 symv flops); instead G
is reduced to a band, G = Q B Q^T, by gemm only, and each shift is one banded
Cholesky of B + a I: RSS from (B + a I)^-1 Q^T X^T R and the degrees of
freedom from the trace of the banded inverse (Takahashi's recurrence), both
O(d band^2 + d band k) per shift.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import scipy.linalg
import scipy.optimize
from numpy.typing import ArrayLike

from . import _kernels
from ._products import gram_update, matmul, symmetrize
from ._solve import _basis_coordinates, _check_basis_shape, _check_system
from ._threads import sized_threads
from ._validation import _check_array, _check_finite, _check_finite_upper

__all__ = ["RidgePath", "DEFAULT_GRID"]

#: Shifts tried by :meth:`RidgePath.select` when none are given, as multiples
#: of the mean eigenvalue trace(G) / d (then refined between grid neighbours).
DEFAULT_GRID = np.geomspace(1e-9, 1e3, 25)

_CRITERIA = ("gcv", "loo", "loo_class")
_METHODS = ("auto", "eigh", "band")
#: 'auto' reduces G to a band from this d on (below, one eigendecomposition is faster).
BAND_MIN_DIMENSION = 2048
#: Bandwidth of the band route: its panels are gemm of this many columns (2x it in the update).
DEFAULT_BAND = 64
# Fitted values held at once by the vectorized leave-one-out (8 MB of float64).
_LOO_BATCH_VALUES = 1 << 20
# The refinement stops within 1 % of the minimizing shift: the criteria are flat there.
_LOG_TOLERANCE = 0.01


def _rows_basis(rhs_basis, Z):
    """``rhs_basis`` as float64 (None stays None), checked against rows ``Z`` that hold its coordinates."""
    if rhs_basis is None:
        return None
    _check_array("rhs_basis", rhs_basis, 2)
    basis = np.asarray(rhs_basis, dtype=np.float64)
    if basis.shape[0] != Z.shape[1] or basis.shape[0] >= basis.shape[1]:
        raise ValueError(f"with rhs_basis of shape {basis.shape}, Z must hold its {basis.shape[0]} "
                         f"coordinates per row, got shape {Z.shape}")
    return basis


class RidgePath:
    """Ridge regressions of R on X for every shift, from one factorization.

    Build it with :meth:`from_statistics` (G = X^T X, C = X^T Z, tr(Z^T Z)
    and the row count: generalized cross-validation) or :meth:`from_rows`
    (X and Z themselves: GCV and exact leave-one-out). With ``center=M`` the
    regression is of the residual R = Z - X M, the solution is M + W(a), and
    a is a proximal weight (pFedACnnL's eq. 13: (G + a I)^-1 (C + a M)).

    Attributes
    ----------
    eigenvalues : ndarray of shape (r,), float64
        Eigenvalues of G (squared singular values of X), clipped at 0.
    n : int
        Rows of X.
    """

    def __init__(self, eigenvalues: np.ndarray, V: np.ndarray, B: np.ndarray, residual_ss: float, n: int,
                 center: np.ndarray | None, basis: np.ndarray | None, U: np.ndarray | None = None,
                 UtR: np.ndarray | None = None, R: np.ndarray | None = None, Z: np.ndarray | None = None,
                 features: int | None = None) -> None:
        """From a factorization; build it with :meth:`from_statistics`, :meth:`from_rows` or :meth:`from_kernel`.

        G = V diag(eigenvalues) V^T, B = V^T C, ``residual_ss`` = tr(R^T R);
        from rows also X = U diag(s) V^T with U^T R and R itself (Z: the
        targets); from a kernel V is None. ``features``: d, when the
        eigenvalues are fewer (the default grid's scale is trace(G) / d).
        """
        self.eigenvalues = eigenvalues
        self.n = n
        self._features = features
        self._V, self._B = V, B
        self._rss0 = residual_ss
        self._center, self._basis = center, basis
        # Squared norms of B's rows in the metric of the target space (Q Q^T with a basis).
        metric = None if basis is None else basis @ basis.T
        self._metric = metric
        self._b2 = _row_norms(B, metric)
        self._U, self._UtR, self._R, self._Z = U, UtR, R, Z
        self._U2 = None  # U * U, the leverages' weights, made on first use
        if U is not None:
            self._c2 = _row_norms(UtR, metric)
            self._outside = float(_row_norms(R - _dot(U, UtR), metric).sum())

    # -- construction --------------------------------------------------------
    @classmethod
    def from_statistics(cls, G: np.ndarray, C: np.ndarray, zz: float, n: int, *, center: np.ndarray | None = None,
                        rhs_basis: np.ndarray | None = None, overwrite_g: bool = False,
                        method: Literal["auto", "eigh", "band"] = "auto", band: int = DEFAULT_BAND) -> RidgePath:
        """The path from summed statistics: GCV only.

        Parameters
        ----------
        G : ndarray of shape (d, d), float32 or float64
            X^T X; only its upper triangle is read.
        C : ndarray of shape (d, m), dtype of G
            X^T Z.
        zz : float
            tr(Z^T Z), the targets' sum of squares.
        n : int
            Rows of X (samples, or patches for a convolution).
        center : ndarray of shape (d, m), optional
            M: regress R = Z - X M instead of Z; solutions are M + W.
        rhs_basis : ndarray of shape (k, m), k < m, optional
            Q with C = B Q (and M = M_k Q): the path runs on k columns; the
            squared norms are taken in the metric Q Q^T, so every criterion
            equals the one on the m columns.
        overwrite_g : bool, default=False
            Let the factorization destroy G.
        method : {'auto', 'eigh', 'band'}, default='auto'
            'eigh': one eigendecomposition (O(d k) per shift after it).
            'band': G reduced to a band by gemm, then a banded Cholesky per
            shift (module docstring); its ``eigenvalues`` is None. Shifts
            so small that G + a I does not factor in float64 score inf
            there. 'auto': 'band' from
            ``BAND_MIN_DIMENSION`` on.
        band : int, default=64
            Bandwidth of the band route.

        Returns
        -------
        RidgePath
        """
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        if isinstance(band, bool) or not isinstance(band, (int, np.integer)) or band < 1:
            raise ValueError(f"band must be an int >= 1, got {band!r}")
        G = _check_system(G, C)
        _check_finite_upper(G)
        _check_finite("C", C)
        zz = _check_real("zz", zz, "tr(Z^T Z), the targets' sum of squares", minimum=0.0)
        n = _check_rows(n)
        # Every argument is checked before the band route may overwrite G.
        M = None if center is None else _check_center(center, C.shape)
        if rhs_basis is not None:
            _check_basis_shape(rhs_basis, C.shape[1])
        C64 = np.asarray(C, dtype=np.float64)
        G64 = np.asarray(G, dtype=np.float64)
        # d = 0 has no band to reduce: its path (one value per shift) is the eigh route's.
        banded = G.shape[0] > 0 and (method == "band" or (method == "auto" and G.shape[0] >= BAND_MIN_DIMENSION))
        # The band route works on both triangles of a float64 copy, or of G itself when allowed.
        full = _full_symmetric(G64, inplace=(overwrite_g and G64.flags.writeable) or G64 is not G) \
            if banded else None
        if M is not None:
            # R = Z - X M: X^T R = C - G M, tr(R^T R) = tr(Z^T Z) - 2 tr(M^T C) + tr(M^T G M).
            GM = _dot(symmetrize(G64) if full is None else full, M)
            zz = zz - 2.0 * float(np.vdot(M, C64)) + float(np.vdot(M, GM))
            C64 = C64 - GM
        C64, basis, M = _in_basis(C64, M, rhs_basis)
        if banded:
            return _BandPath(full, C64, max(zz, 0.0), n, M, basis, int(band))
        evals, V = scipy.linalg.eigh(G64, lower=False, overwrite_a=overwrite_g and G64 is G and G64.flags.writeable,
                                     check_finite=False,
                                     driver="evd")
        evals = np.maximum(evals, 0.0)
        return cls(evals, V, _dot(V.T, C64), max(zz, 0.0), n, M, basis)

    @classmethod
    def from_rows(cls, X: np.ndarray, Z: np.ndarray, *, center: np.ndarray | None = None,
                  rhs_basis: np.ndarray | None = None) -> RidgePath:
        """The path from the rows themselves (a thin SVD of X, from its smaller Gram): GCV and exact leave-one-out.

        Parameters
        ----------
        X : ndarray of shape (n, d), float32 or float64
        Z : ndarray of shape (n, m) or, with ``rhs_basis``, (n, k)
            Targets, or their coordinates in the basis (Z = Y Q: pass Y).
        center : ndarray of shape (d, m), optional
            As in :meth:`from_statistics`.
        rhs_basis : ndarray of shape (k, m), optional

        Returns
        -------
        RidgePath
        """
        _check_array("X", X, 2)
        _check_array("Z", Z, 2)
        if Z.shape[0] != X.shape[0]:
            raise ValueError(f"Z must have one row per row of X ({X.shape[0]}), got shape {Z.shape}")
        if X.shape[0] == 0:
            raise ValueError("X has no rows: a path needs at least one sample (n >= 1)")
        _check_finite("X", X)
        _check_finite("Z", Z)
        X64 = np.asarray(X, dtype=np.float64)
        R = np.asarray(Z, dtype=np.float64)
        if rhs_basis is not None:
            _check_array("rhs_basis", rhs_basis, 2)
        m = R.shape[1] if rhs_basis is None else rhs_basis.shape[1]
        M = None if center is None else _check_center(center, (X.shape[1], m))
        basis = _rows_basis(rhs_basis, Z)
        if basis is not None:
            if M is not None:
                M, _ = _basis_coordinates("center", M, basis, np.float64)
        Z64 = R
        if M is not None:
            R = R - _dot(X64, M)
        U, lam, V = _thin_svd(X64)
        UtR = _dot(U.T, R)
        # B = V^T X^T R = diag(s) U^T R over the r = min(n, d) directions X spans.
        return cls(lam, V, np.sqrt(lam)[:, None] * UtR,
                   float(_row_norms(R, None if basis is None else basis @ basis.T).sum()),
                   X.shape[0], M, basis, U=U, UtR=UtR, R=R, Z=Z64)

    @classmethod
    def from_kernel(cls, K: np.ndarray, Z: np.ndarray, n_features: int, *, rhs_basis: np.ndarray | None = None,
                    overwrite_k: bool = False) -> RidgePath:
        """The path from the rows' kernel K = X X^T and their targets: the dual of :meth:`from_statistics`.

        One eigendecomposition of the n x n kernel instead of the d x d Gram,
        for rows fewer than features: K = U diag(lambda) U^T gives X's left
        singular vectors and squared singular values, so GCV and leave-one-out
        are those of :meth:`from_rows` on X. The path holds no X, so
        :meth:`solve` cannot form W; :meth:`dual_coefficients` gives
        alpha(a) = (K + a I)^-1 R, and W(a) = X^T alpha(a) (times the basis).
        The criteria are unchanged when X and Z are replaced by U_0 X and
        U_0 Z for an orthogonal U_0 (rows uploaded behind a rotation).

        Parameters
        ----------
        K : ndarray of shape (n, n), float32 or float64
            X X^T; only its upper triangle is read.
        Z : ndarray of shape (n, m) or, with ``rhs_basis``, (n, k)
            Targets, or their coordinates in the basis.
        n_features : int
            d, the columns of X: the default grid is scaled by trace(K) / d,
            as :meth:`from_statistics`'s by trace(G) / d.
        rhs_basis : ndarray of shape (k, m), optional
        overwrite_k : bool, default=False
            Let the eigendecomposition destroy K.

        Returns
        -------
        RidgePath
        """
        _check_array("K", K, 2)
        _check_array("Z", Z, 2)
        n = K.shape[0]
        if K.shape != (n, n) or Z.shape[0] != n:
            raise ValueError(f"K must be square (n, n) and Z have its n rows, got K {K.shape} and Z {Z.shape}")
        if n == 0:
            raise ValueError("K has no rows: a path needs at least one sample (n >= 1)")
        n_features = _check_rows(n_features)
        _check_finite_upper(K)
        _check_finite("Z", Z)
        basis = _rows_basis(rhs_basis, Z)
        K64 = np.asarray(K, dtype=np.float64)
        R = np.asarray(Z, dtype=np.float64)
        # LAPACK works in place only on Fortran order: a C-ordered K's upper triangle is its transpose's lower.
        in_place = overwrite_k and K64 is K and K.flags.writeable
        A, lower = (K64.T, True) if K64.flags.c_contiguous and not K64.flags.f_contiguous else (K64, False)
        lam, U = scipy.linalg.eigh(A, lower=lower, overwrite_a=in_place, check_finite=False, driver="evd")
        # As _thin_svd: eigenvalues below the kernel's rounding are 0 (their directions stay in U, with the
        # part of R outside X's row space).
        top = max(float(lam[-1]), 0.0)
        lam = np.where(lam > top * n * np.finfo(np.float64).eps, lam, 0.0)
        UtR = _dot(U.T, R)
        metric = None if basis is None else basis @ basis.T
        return cls(lam, None, np.sqrt(lam)[:, None] * UtR, float(_row_norms(R, metric).sum()), n, None, basis,
                   U=U, UtR=UtR, R=R, Z=R, features=n_features)

    def dual_coefficients(self, shift: float) -> np.ndarray:
        """alpha(a) = (K + a I)^-1 R of a path from a kernel (:meth:`from_kernel`): W(a) = X^T alpha(a).

        Returns
        -------
        alpha : ndarray of shape (n, k), float64 (k: the basis's coordinates, or the targets' columns)
        """
        if self._V is not None or self._U is None:
            raise ValueError("dual coefficients belong to a path from a kernel (RidgePath.from_kernel); "
                             "this path solves for W itself (solve)")
        a = float(_shifts([shift])[0])
        return _dot(self._U, self._UtR / (self.eigenvalues + a)[:, None])

    # -- criteria -------------------------------------------------------------
    def residual_ss(self, shifts: ArrayLike) -> np.ndarray:
        """RSS(a) = tr(R^T R) - sum_j ||B_j||^2 (lambda_j + 2 a) / (lambda_j + a)^2, per shift.

        From rows the same sum is formed without cancellation, as the part of R
        outside X's column space plus sum_j ||(U^T R)_j||^2 (a / (lambda_j + a))^2;
        from statistics alone the difference above is all there is, so an RSS
        far below tr(R^T R) (a near-interpolating fit) keeps only its absolute
        accuracy, about eps * tr(R^T R).
        """
        a = _shifts(shifts)
        lam = self.eigenvalues[None, :]
        if self._U is not None:
            return self._outside + ((a[:, None] / (lam + a[:, None])) ** 2) @ self._c2
        fit = ((lam + 2.0 * a[:, None]) / (lam + a[:, None]) ** 2) @ self._b2
        return np.maximum(self._rss0 - fit, 0.0)

    def dof(self, shifts: ArrayLike) -> np.ndarray:
        """Effective degrees of freedom sum_j lambda_j / (lambda_j + a), per shift."""
        a = _shifts(shifts)
        lam = self.eigenvalues[None, :]
        return (lam / (lam + a[:, None])).sum(axis=1)

    def gcv(self, shifts: ArrayLike) -> np.ndarray:
        """GCV(a) = n RSS(a) / (n - dof(a))^2, per shift (inf where dof >= n).

        From statistics, RSS is tr(R^T R) minus the fit, accurate to about
        d eps tr(R^T R): shifts whose RSS falls below ``STATISTICS_RSS_FLOOR``
        times that (a near-interpolating fit, as when n <= d and a -> 0, where
        GCV is 0/0) cannot be scored from the statistics and score inf.
        """
        rss, df = self.residual_ss(shifts), self.dof(shifts)
        slack = self.n - df
        if self._U is None:
            d = len(self.eigenvalues) if self.eigenvalues is not None else self._lower.shape[1]
            floor = STATISTICS_RSS_FLOOR * max(d, 1) * np.finfo(np.float64).eps * self._rss0
            slack = np.where(rss > floor, slack, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(slack > 0, self.n * rss / np.where(slack > 0, slack, 1.0) ** 2, np.inf)

    def loo(self, shifts: ArrayLike) -> np.ndarray:
        """Mean squared leave-one-out error (1/n) sum_i ||r_i - x_i W_(-i)(a)||^2, per shift (from_rows only).

        Exact: e_i = (r_i - x_i W(a)) / (1 - h_ii(a)) with the hat matrix
        H(a) = U diag(s^2 / (s^2 + a)) U^T.
        """
        return self._loo_scores(_shifts(shifts))[0]

    def loo_errors(self, shifts: ArrayLike, labels: ArrayLike) -> np.ndarray:
        """Share of rows whose leave-one-out prediction is nearer another class's code than its own (from_rows only).

        The codes are the unit vectors of the targets' coordinates: the
        classes of one-hot targets (the output layer), or, with a basis Q,
        the rows of Q (Z = Y Q), nearness measured in the metric Q Q^T.

        Parameters
        ----------
        shifts : array-like of float > 0
        labels : array-like of int, shape (n,)
            The class of each row, in [0, k).
        """
        return self._loo_scores(_shifts(shifts), labels)[1]

    def _loo_scores(self, a, labels=None):
        """(mean squared leave-one-out error, error rate of the class decision or None) per shift, in one pass."""
        if self._U is None:
            raise ValueError("leave-one-out needs the rows: build the path with RidgePath.from_rows")
        if labels is not None:
            labels = np.asarray(labels)
            if labels.shape != (self.n,) or labels.dtype.kind not in "iu":
                raise ValueError(f"labels must be {self.n} integer classes, one per row, got shape {labels.shape} "
                                 f"and dtype {labels.dtype}")
            k = self._Z.shape[1]
            if labels.size and (labels.min() < 0 or labels.max() >= k):
                raise ValueError(f"labels must be classes in [0, {k}) (one per target column), got values from "
                                 f"{labels.min()} to {labels.max()}")
        squared = np.empty(len(a))
        errors = None if labels is None else np.empty(len(a))
        S = np.eye(self._Z.shape[1]) if self._metric is None else self._metric
        for batch, held_out in self._held_out(a):
            weighted = held_out if self._metric is None else _dot_rows(held_out, self._metric)
            squared[batch] = (weighted * held_out).sum(axis=(1, 2)) / self.n
            if labels is not None:
                predicted = self._Z - held_out                               # (s, n, k)
                # Nearest code c: argmax_c 2 (p S)_c - S_cc.
                nearest = np.argmax(2.0 * _dot_rows(predicted, S) - np.diag(S), axis=2)
                errors[batch] = (nearest != labels).mean(axis=1)
        return squared, errors

    def _held_out(self, a):
        """(slice, leave-one-out residuals (s, n, k)) for batches of the shifts a."""
        lam = self.eigenvalues
        n, k = self._R.shape
        if self._U2 is None:
            self._U2 = self._U * self._U
        # Shifts in batches of about _LOO_BATCH_VALUES fitted values: one gemm each.
        step = max(1, _LOO_BATCH_VALUES // max(n * k, 1))
        for first in range(0, len(a), step):
            shrink = lam / (lam + a[first:first + step, None])              # (s, r)
            s = shrink.shape[0]
            leverage = _dot(shrink, self._U2.T)                              # (s, n)
            # U diag(shrink_i) U^T R for every shift i in one product: (n, r) x (r, s k).
            scaled = (shrink[:, :, None] * self._UtR).transpose(1, 0, 2).reshape(-1, s * k)
            fitted = _dot(self._U, scaled).reshape(n, s, k).transpose(1, 0, 2)  # (s, n, k)
            # A row with leverage 1 is fitted exactly by any shift: it carries no held-out information.
            held_out = (self._R - fitted) / np.maximum(1.0 - leverage, np.finfo(np.float64).eps)[:, :, None]
            yield slice(first, first + step), held_out

    def criterion(self, name: Literal["gcv", "loo", "loo_class"], shifts: ArrayLike,
                  labels: ArrayLike | None = None) -> np.ndarray:
        """``gcv``, ``loo`` or ``loo_class`` per shift.

        ``loo_class`` is the leave-one-out error rate of the class decision
        (:meth:`loo_errors`, needs ``labels``) plus the mean squared
        leave-one-out error scaled below one misclassified row, so that
        among shifts with as many errors the better fit wins.
        """
        if name not in _CRITERIA:
            raise ValueError(f"criterion must be one of {_CRITERIA}, got {name!r}")
        if name != "loo_class":
            return getattr(self, name)(shifts)
        if labels is None:
            raise ValueError("criterion 'loo_class' needs the labels of the rows")
        squared, errors = self._loo_scores(_shifts(shifts), labels)
        # Monotone in the squared error and below 1 / (2 n), half of one misclassified row.
        scale = max(self._rss0 / self.n, np.finfo(np.float64).tiny)
        return errors + squared / (squared + scale) / (2.0 * self.n)

    def default_grid(self) -> np.ndarray:
        """:data:`DEFAULT_GRID` times the mean eigenvalue (times 1 when G is 0)."""
        scale = float(self.eigenvalues.sum()) / max(self._features or len(self.eigenvalues), 1)
        return DEFAULT_GRID * (scale if scale > 0 else 1.0)

    def select(self, criterion: Literal["gcv", "loo", "loo_class"] = "gcv", shifts: ArrayLike | None = None,
               refine: bool = True, labels: ArrayLike | None = None) -> tuple[float, np.ndarray, np.ndarray]:
        """The shift that minimizes the criterion.

        Parameters
        ----------
        criterion : {'gcv', 'loo', 'loo_class'}, default='gcv'
            See :meth:`criterion`.
        shifts : array-like of float > 0, optional
            The grid searched; default :meth:`default_grid`.
        refine : bool, default=True
            Then minimize in log(shift) between the best grid point's neighbours
            (bounded Brent; not for ``loo_class``, a step function).
        labels : array-like of int, optional
            The rows' classes, for ``loo_class``.

        Returns
        -------
        shift : float
        grid : ndarray of float
        scores : ndarray of float
            The criterion on the grid (what a plot of the curve needs).
        """
        grid = self.default_grid() if shifts is None else _shifts(shifts)
        scores = self.criterion(criterion, grid, labels)
        best = int(np.argmin(scores))
        shift = float(grid[best])
        if refine and criterion != "loo_class" and len(grid) > 1 and np.isfinite(scores[best]):
            low, high = np.log(grid[max(best - 1, 0)]), np.log(grid[min(best + 1, len(grid) - 1)])
            if high > low:
                # A bracket end may score inf (unscorable shifts): Brent's parabola steps then meet inf - inf
                # and fall back to golden sections, which is what we want, without NumPy's warning.
                with np.errstate(invalid="ignore"):
                    found = scipy.optimize.minimize_scalar(
                        lambda t: float(self.criterion(criterion, [np.exp(t)])[0]),
                        bounds=(low, high), method="bounded", options={"xatol": _LOG_TOLERANCE})
                if found.fun <= scores[best]:
                    shift = float(np.exp(found.x))
        return shift, grid, scores

    # -- solutions ------------------------------------------------------------
    def solve(self, shift: float) -> np.ndarray:
        """W(a) = V diag(1 / (lambda + a)) B, plus the center when there is one.

        Returns
        -------
        W : ndarray of shape (d, m), float64, Fortran-ordered
        """
        if self._V is None:
            raise ValueError("a path from a kernel (RidgePath.from_kernel) holds no X to form W: "
                             "W = X^T dual_coefficients(shift)")
        a = float(_shifts([shift])[0])
        W = _dot(self._V, self._B / (self.eigenvalues + a)[:, None])
        if self._center is not None:
            W = W + self._center
        if self._basis is not None:
            W = _dot(W, self._basis)
        return np.asfortranarray(W)


#: See :meth:`RidgePath.gcv`: an RSS from statistics below this many times d eps tr(R^T R) scores inf.
STATISTICS_RSS_FLOOR = 100.0


class _BandPath(RidgePath):
    """A RidgePath from statistics on the band route: G = Q B Q^T, one banded Cholesky per shift.

    ``eigenvalues`` is None; the criteria and :meth:`solve` are those of
    RidgePath (equal to its eigendecomposition route up to rounding), each
    shift factoring B + a I once (cached).
    """

    def __init__(self, full, C, residual_ss, n, center, basis, band):
        d = full.shape[0]
        band = min(band, max(d - 1, 1))
        self.eigenvalues = None
        self.n = n
        self._rss0 = residual_ss
        self._center, self._basis = center, basis
        self._metric = None if basis is None else _dot(basis, basis.T)
        self._U = None
        self._trace = float(np.trace(full))
        panels = max(0, -(-(d - band - 1) // band))
        self._factors = np.zeros((max(panels, 1), band, band))
        W = np.array(C, dtype=np.float64, order="F")  # never the caller's C: reduced in place
        # Q^T G Q (4/3 d^3 flops, nearly all gemm) and Q^T C.
        with sized_threads(4.0 / 3.0 * d ** 3):
            done = _kernels.band_reduce(full, band, self._factors, W)
        self._reduced, self._band, self._panels = full, band, done
        # LAPACK's lower band storage: entry [t, i] is B[i + t, i].
        self._lower = np.zeros((band + 1, d))
        for t in range(band + 1):
            self._lower[t, :d - t] = np.diagonal(full, -t)
        self._W = W
        self._WS = W if self._metric is None else _dot(W, self._metric)
        self._at = {}

    def _factor(self, a):
        """Cholesky factor of B + a I in band storage, or None where it does not factor."""
        shifted = self._lower.copy(order="F")
        shifted[0] += a
        factor, info = scipy.linalg.lapack.dpbtrf(shifted, lower=1, overwrite_ab=1)
        return factor if info == 0 else None

    def _terms(self, a):
        """(fit, trace((G + a I)^-1)), fit = sum_j ||B_j||^2 (lambda_j + 2 a) / (lambda_j + a)^2 (NaN: no factor)."""
        if a not in self._at:
            factor = self._factor(a)
            if factor is None:
                self._at[a] = (np.nan, np.nan)
            else:
                S, _ = scipy.linalg.lapack.dpbtrs(factor, self._W, lower=1)
                SS = S if self._metric is None else _dot(S, self._metric)
                # tr(W^T (B + aI)^-1 W) + a ||(B + aI)^-1 W||^2 in the target metric; einsum, not NumPy's BLAS.
                fit = float(np.einsum("ij,ij->", self._WS, S)) + a * float(np.einsum("ij,ij->", SS, S))
                self._at[a] = (fit, _kernels.banded_inverse_trace(factor))
        return self._at[a]

    def residual_ss(self, shifts: ArrayLike) -> np.ndarray:
        """As :meth:`RidgePath.residual_ss` (NaN where G + a I does not factor)."""
        fit = np.array([self._terms(a)[0] for a in _shifts(shifts)])
        return np.maximum(self._rss0 - fit, 0.0)

    def dof(self, shifts: ArrayLike) -> np.ndarray:
        """Effective degrees of freedom d - a trace((G + a I)^-1), per shift (NaN where it does not factor)."""
        a = _shifts(shifts)
        return self._lower.shape[1] - a * np.array([self._terms(value)[1] for value in a])

    def default_grid(self) -> np.ndarray:
        """:data:`DEFAULT_GRID` times the mean eigenvalue trace(G) / d (times 1 when G is 0)."""
        scale = self._trace / self._lower.shape[1]
        return DEFAULT_GRID * (scale if scale > 0 else 1.0)

    def solve(self, shift: float) -> np.ndarray:
        """W(a) = Q (B + a I)^-1 Q^T C, plus the center when there is one (as :meth:`RidgePath.solve`)."""
        a = float(_shifts([shift])[0])
        factor = self._factor(a)
        if factor is None:
            raise np.linalg.LinAlgError(f"G + {a:g} I is not positive definite in float64: take a larger shift")
        S, _ = scipy.linalg.lapack.dpbtrs(factor, self._W, lower=1)
        S = np.asfortranarray(S)
        _kernels.band_apply_q(self._reduced, self._band, self._factors, self._panels, S)
        W = S if self._center is None else S + self._center
        if self._basis is not None:
            W = _dot(W, self._basis)
        return np.asfortranarray(W)


def _full_symmetric(G, inplace):
    """Both triangles from G's upper one (:func:`symmetrize`), Fortran-ordered: G itself when allowed."""
    if not inplace or not (G.flags.f_contiguous or G.flags.c_contiguous):
        G = np.array(G, order="F")
    symmetrize(G, inplace=True)
    # Symmetric now, so a C-ordered G's transpose is the same matrix in Fortran order.
    return G if G.flags.f_contiguous else G.T


def _thin_svd(X):
    """(U, s^2, V) of X = U diag(s) V^T over its r = min(n, d) directions, from the smaller Gram's eigenpairs.

    One eigendecomposition of X X^T (n < d) or X^T X costs a few times less
    than an SVD of X. Directions whose s^2 is below the Gram's rounding
    (s^2 < r eps max s^2) get a zero singular value and a zero partner
    vector: every ridge quantity weighs them by s^2 / (s^2 + a), so they drop
    out for any shift a well above that rounding.
    """
    n, d = X.shape
    wide = n < d
    # The upper triangle of X X^T (n < d) or X^T X, through syrk.
    gram = gram_update(np.zeros((min(n, d),) * 2), X.T if wide else X, check_finite=False)
    lam, vectors = scipy.linalg.eigh(gram, lower=False, overwrite_a=True, check_finite=False, driver="evd")
    lam = lam[::-1].copy()
    vectors = vectors[:, ::-1]
    kept = lam > max(lam[0], 0.0) * len(lam) * np.finfo(np.float64).eps if len(lam) else lam > 0
    lam = np.where(kept, lam, 0.0)
    scale = np.where(kept, 1.0 / np.sqrt(np.where(kept, lam, 1.0)), 0.0)
    partner = _dot(X.T if wide else X, vectors) * scale
    used = int(kept.sum())
    if used > 1 and lam[used - 1] < PARTNER_REORTHOGONALIZE * lam[0]:
        # X v_j / s_j loses orthogonality as eps * cond(X)^2 (5e-3 at cond 1e7), and the RSS and leave-one-out
        # sums assume orthonormal columns: Gram-Schmidt in the order of decreasing s (a QR) keeps the well-
        # determined leading columns and makes the trailing ones orthogonal to them, as the true ones are.
        Q, Rq = scipy.linalg.qr(partner[:, :used], mode="economic", check_finite=False)
        partner[:, :used] = Q * np.where(np.diagonal(Rq) < 0, -1.0, 1.0)
    return (vectors, lam, partner) if wide else (partner, lam, vectors)


#: _thin_svd orthonormalizes the partner vectors once s_min^2 / s_max^2 falls below this (cond(X) above 1e4,
#: where their loss of orthogonality, eps cond^2, reaches 1e-8).
PARTNER_REORTHOGONALIZE = 1e-8


def _dot(A, B):
    """A @ B in float64 on SciPy's BLAS (:func:`fastls.matmul`).

    NumPy's ``@`` runs NumPy's own OpenBLAS, whose thread pool then spins
    beside SciPy's between the products and the eigendecomposition
    (docs/results/kernels_notes.md).
    """
    return matmul(np.asarray(A, dtype=np.float64), np.asarray(B, dtype=np.float64), check_finite=False)


def _dot_rows(A, B):
    """A @ B for a stack A (..., k) of rows and B (k, m), as one :func:`_dot` (SciPy's BLAS, not NumPy's)."""
    return _dot(A.reshape(-1, A.shape[-1]), B).reshape(*A.shape[:-1], B.shape[1])


def _row_norms(B, metric):
    """||B_j||^2 per row, in the metric when one is given (B_j S B_j^T)."""
    if metric is None:
        return np.einsum("ij,ij->i", B, B)
    return np.einsum("ij,ij->i", B @ metric, B)


def _shifts(shifts):
    a = np.atleast_1d(np.asarray(shifts, dtype=np.float64))
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"shifts must be a non-empty 1-D sequence of numbers > 0, got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"shifts must be finite and > 0, got {a[~(np.isfinite(a) & (a > 0))][:3].tolist()}")
    return a


def _check_real(name, value, meaning, minimum):
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} ({meaning}) must be a real number, got {value!r}") from None
    if not np.isfinite(number) or number < minimum:
        raise ValueError(f"{name} ({meaning}) must be finite and >= {minimum:g}, got {value!r}")
    return number


def _check_rows(n):
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (rows of X) must be an int >= 1, got {n!r}")
    return int(n)


def _check_center(center, shape):
    _check_array("center", center, 2)
    if center.shape != tuple(shape):
        raise ValueError(f"center must have shape {tuple(shape)} like the solution, got {center.shape}")
    _check_finite("center", center)
    return np.asarray(center, dtype=np.float64)


def _in_basis(C, M, rhs_basis):
    """(C, basis, M) in the basis' coordinates when one is given."""
    if rhs_basis is None:
        return C, None, M
    B, Q = _basis_coordinates("C", C, rhs_basis, np.float64)
    if M is not None:
        M, _ = _basis_coordinates("center", M, Q, np.float64)
    return np.asarray(B), Q, M
