"""scikit-learn estimators over the fastls kernels: ridge models that stream, merge and forget.

Both estimators keep the weighted sums of the data seen, never the data:

* ``gram_ = sum_i w_i x_i x_i^T`` (upper triangle, float64, d x d),
* ``x_sum_ = sum_i w_i x_i`` and ``weight_sum_ = sum_i w_i``,
* the targets' sums: ``cross_ = sum_i w_i x_i y_i^T``, ``y_sum_`` and
  ``y_square_sum_`` for the regressor; for the classifier, per class, the
  sum of its rows ``class_x_sum_`` and of its weights ``class_weight_sum_``
  (the ±1 targets of :class:`sklearn.linear_model.RidgeClassifier` follow
  from them, for any set of classes).

That is O(d^2 + d t) memory whatever the number of rows, and it makes the
three operations of analytic learning exact: ``partial_fit`` adds a batch's
sums, :meth:`merge` adds another estimator's (the federated sum) and
``partial_unfit`` subtracts a batch's (forgetting). The intercept comes from
the sums too: the centred system is G - x_sum x_sum^T / W, C - x_sum y_sum^T
/ W, formed when the coefficients are solved, so no pass centres the data.
Its rounding grows with (feature mean / feature spread)^2, as for any
uncentred accumulation.

The coefficients are solved (Cholesky, :func:`fastls.ridge_solve`) by
``fit``, and after ``partial_fit``, ``merge`` or ``partial_unfit`` when they
are first used (``predict``, ``coef_``...): a stream of batches costs their
Gram updates, not one solve each.
"""

from __future__ import annotations

from numbers import Real
from typing import Literal

import numpy as np
import scipy.linalg.blas
from numpy.typing import ArrayLike
from sklearn.base import BaseEstimator, ClassifierMixin, MultiOutputMixin, RegressorMixin, _fit_context
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import _check_sample_weight, check_is_fitted, column_or_1d, validate_data

from ._products import add_upper, cross_update, gram_update, matmul
from ._solve import ridge_solve
from ._select import RidgePath

__all__ = ["StreamingRidge", "StreamingRidgeClassifier"]

# Rows turned into targets (and weighted copies of X) at a time: the "one batch" of extra memory
# whatever the rows passed (16,384 x 785 float32 is 51 MB). A multiple of the kernels' 4,096-row blocks.
BLOCK_ROWS = 16384

# Sums of the same batch agree to float64 rounding: a removal leaving a weight or a class below this
# many times the total is taken as removing everything (or more than) was seen.
_REMOVAL_RTOL = 1e-9


def _check_alphas(alphas):
    """The GCV grid as a 1-D float64 array of finite numbers > 0, or None."""
    if alphas is None:
        return None
    grid = np.asarray(alphas, dtype=np.float64).reshape(-1) if np.ndim(alphas) <= 1 else None
    if grid is None or grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError(f"alphas must be a non-empty 1-D sequence of finite numbers > 0 (the GCV grid), "
                         f"got {alphas!r}")
    return grid


def _check_alpha(alpha, n_targets):
    """alpha as a float, 'gcv', or an array of one value per target (validated here, not in __init__)."""
    if isinstance(alpha, str):
        return alpha
    values = np.asarray(alpha, dtype=np.float64).reshape(-1)
    if values.size not in (1, n_targets) or np.ndim(alpha) > 1:
        raise ValueError(f"alpha must be a number or hold one value per target ({n_targets}), got shape "
                         f"{np.shape(alpha)}")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"alpha must be finite and > 0 for every target (fastls.ridge_solve factors G + alpha I), "
                         f"got {values.tolist()}")
    return values if values.size > 1 else float(values[0])


def _center(G, C, x_sum, y_sum, weight_sum, fit_intercept):
    """(G - x_sum x_sum^T / W, C - x_sum y_sum^T / W): the system of the centred data, without the data.

    G is read in its upper triangle and copied once (Fortran order, the rank-one update in place by BLAS
    syr): the solve then factors the copy in place, so the centring and the solve together hold one d x d
    array beside the estimator's own.
    """
    G = np.array(G, order="F")
    C = np.array(C, dtype=np.float64)
    if fit_intercept and weight_sum > 0:
        if G.shape[0]:
            G = scipy.linalg.blas.dsyr(-1.0 / weight_sum, x_sum, lower=0, a=G, overwrite_a=1)
        C -= np.outer(x_sum, y_sum / weight_sum)
    return G, C


def _scaled_blocks(X, Y, sample_weight, weighted, rows_too=True):
    """(sqrt(w) X, sqrt(w) [Y 1]) over blocks of ``BLOCK_ROWS`` rows, in X's dtype; X's rows as given (a view)
    when unweighted, None when not ``rows_too``."""
    n, m = Y.shape
    for start in range(0, n, BLOCK_ROWS):
        rows = slice(start, min(start + BLOCK_ROWS, n))
        root = np.sqrt(sample_weight[rows]).astype(X.dtype)[:, None]
        Z = np.empty((root.shape[0], m + 1), dtype=X.dtype)
        np.multiply(Y[rows], root, out=Z[:, :m])
        Z[:, m:] = root
        if not rows_too:
            yield None, Z
        else:
            yield (X[rows] * root if weighted else X[rows]), Z


def _solve_alpha(G, C, alpha, on_failure="raise"):
    """(G + alpha_j I)^-1 C_j per target j, (d, t) float64. With on_failure='raise' the last solve factors G
    in place (no d x d copy); 'eigh' keeps G for its fallback."""
    alpha = np.broadcast_to(np.asarray(alpha, dtype=np.float64), (C.shape[1],))
    W = np.empty_like(C, order="F")
    # One factorization per distinct alpha, over the targets that share it.
    distinct = np.unique(alpha)
    for i, value in enumerate(distinct):
        columns = np.flatnonzero(alpha == value)
        last = i == len(distinct) - 1 and on_failure == "raise"
        W[:, columns] = ridge_solve(G, C[:, columns], float(value), overwrite_g=last, on_failure=on_failure)
    return W


class _StreamingRidgeBase(BaseEstimator):
    """Statistics, their three operations and the solve, shared by the regressor and the classifier.

    Subclasses say how targets become columns (``_target_columns``), which sums describe them
    (``_TARGET_SUMS``) and how the solve's (C, y_sum, y_square_sum) follow from those sums
    (``_target_system``).
    """

    _parameter_constraints: dict = {
        "alpha": [Interval(Real, 0, None, closed="neither"), "array-like", StrOptions({"gcv"})],
        "fit_intercept": ["boolean"],
        "alphas": ["array-like", None],
    }

    #: Names of the fitted sums that describe the targets (besides the Gram, x_sum_ and the weights).
    _TARGET_SUMS: tuple = ()

    def __init__(self, alpha: float | Literal["gcv"] | ArrayLike = 1.0, *, fit_intercept: bool = True,
                 alphas: ArrayLike | None = None) -> None:
        self.alpha = alpha
        self.fit_intercept = fit_intercept
        self.alphas = alphas

    def __sklearn_is_fitted__(self):
        return hasattr(self, "gram_")

    # -- statistics -----------------------------------------------------------------------------------
    def _validate_batch(self, X, y, sample_weight, reset):
        X, y = validate_data(self, X, y, reset=reset, dtype=[np.float64, np.float32], multi_output=True,
                             y_numeric=not isinstance(self, ClassifierMixin))
        sample_weight = _check_sample_weight(sample_weight, X, dtype=np.float64, ensure_non_negative=True)
        return X, y, sample_weight

    def _empty_sums(self, d, m):
        """Zeroed (gram, x_sum, weight sum, target sums) for d features and m target columns."""
        return {"gram_": np.zeros((d, d), order="F"), "x_sum_": np.zeros(d), "weight_sum_": 0.0,
                "n_samples_seen_": 0, **self._empty_target_sums(d, m)}

    def _batch_sums(self, X, Y, sample_weight, gram=None):
        """The sums of one batch (rows X, target columns Y in X's dtype), as a dict like ``_empty_sums``.

        With ``gram``, the batch's X^T W X is added into that array (the estimator's own, so that
        ``partial_fit`` of unweighted rows needs no d x d temporary) and returned under ``gram_``.
        Every refusal (values whose products overflow) comes before ``gram`` is touched.
        """
        n, d = X.shape
        m = Y.shape[1]
        weighted = not np.all(sample_weight == 1.0)
        fresh = gram is None
        gram = np.zeros((d, d), order="F") if fresh else gram
        # [Y 1]^T [Y 1] and X^T [Y 1] of the rows scaled by sqrt(w): y_sum, the weight sum, the targets'
        # squares, the cross terms and x_sum, in float64 from two products of the kernels.
        targets = np.zeros((m + 1, m + 1))
        try:
            for _, Zb in _scaled_blocks(X, Y, sample_weight, weighted, rows_too=False):
                gram_update(targets, Zb)
        except ValueError:
            raise ValueError(f"y holds values whose squares overflow {X.dtype} when summed (largest |y| "
                             f"{float(np.abs(Y).max()):.3g}); pass float64 data") from None
        cross = np.zeros((d, m + 1))
        if weighted:
            # The scaled rows exist one block at a time: summed apart, so that a refused block leaves gram as it was.
            part = gram if fresh else np.zeros((d, d), order="F")
            for Xb, Zb in _scaled_blocks(X, Y, sample_weight, weighted):
                gram_update(part, Xb)
                cross_update(cross, Xb, Zb, check_finite=False)
            if not fresh:
                add_upper(gram, part)
        else:
            # The rows as given, in one call: its finiteness check and thread set-up once, not per block.
            gram_update(gram, X)
            for Xb, Zb in _scaled_blocks(X, Y, sample_weight, weighted):
                # Both Grams refused values whose squares, summed over the kernels' blocks of rows, overflow;
                # then by Cauchy-Schwarz no block sum of X^T Z does: no third pass over X to check it.
                cross_update(cross, Xb, Zb, check_finite=False)
        return {"gram_": gram, "x_sum_": cross[:, m].copy(), "weight_sum_": float(targets[m, m]),
                "n_samples_seen_": n,
                **self._target_sums(cross[:, :m], targets[:m, m], np.diagonal(targets)[:m].copy())}

    def _accumulate(self, X, Y, sample_weight):
        """Add a batch's sums to the estimator's, the Gram in place."""
        batch = self._batch_sums(X, Y, sample_weight, gram=self.gram_)
        self.x_sum_ += batch["x_sum_"]
        self.weight_sum_ += batch["weight_sum_"]
        self.n_samples_seen_ += batch["n_samples_seen_"]
        for name in self._TARGET_SUMS:
            getattr(self, name)[...] += batch[name]
        self._solution = None

    def _set_sums(self, sums):
        for name, value in sums.items():
            setattr(self, name, value)
        self._solution = None

    # -- solve ----------------------------------------------------------------------------------------
    def _solve(self, sums, on_failure="eigh"):
        """The coefficients from sums: {'coef': (t, d), 'intercept': (t,), 'alpha': ..., and the GCV curve}."""
        C, y_sum, y_square_sum = self._target_system(sums)
        W, n, x_sum = sums["weight_sum_"], sums["n_samples_seen_"], sums["x_sum_"]
        G, C = _center(sums["gram_"], C, x_sum, y_sum, W, self.fit_intercept)
        alpha = _check_alpha(self.alpha, C.shape[1])
        solution = {}
        if isinstance(alpha, str):
            alpha, solution["gcv_alphas"], solution["gcv_values"] = self._gcv(G, C, y_sum, y_square_sum, W, n)
        try:
            coef = _solve_alpha(G, C, alpha)
        except np.linalg.LinAlgError:
            # G + alpha I does not factor: alpha is below the rounding of G. Refused when removing rows (they
            # were not all seen); otherwise solved again through eigh, which says so (a RuntimeWarning),
            # as Ridge's Cholesky falls back to lstsq with a warning.
            if on_failure == "raise":
                raise
            G, C = _center(sums["gram_"], self._target_system(sums)[0], x_sum, y_sum, W, self.fit_intercept)
            coef = _solve_alpha(G, C, alpha, on_failure="eigh")
        if self.fit_intercept and W > 0:
            intercept = (y_sum - x_sum @ coef) / W
        else:
            intercept = np.zeros(C.shape[1])
        solution.update(coef=np.ascontiguousarray(coef.T), intercept=intercept, alpha=alpha)
        return solution

    def _gcv(self, G, C, y_sum, y_square_sum, W, n):
        """(alpha_, grid, GCV on the grid) from the centred statistics: the grid's argmin, no refinement.

        GCV(a) = n RSS(a) / (n - tr H(a))^2 with n the rows seen (weights scale rows, as in RidgeCV's
        GCV) and tr H the ridge's degrees of freedom plus one for the intercept. RidgePath scores
        with n - 1 rows in place of n in both places; the factor n / (n - 1) restores the numerator.
        """
        rows = n - int(self.fit_intercept)
        if rows < 1:
            raise ValueError(f"alpha='gcv' needs more samples than the intercept uses: {n} sample(s) seen with "
                             f"fit_intercept={self.fit_intercept}")
        centred = float(np.sum(y_square_sum - (y_sum ** 2 / W if self.fit_intercept and W > 0 else 0.0)))
        path = RidgePath.from_statistics(G, C, max(centred, 0.0), rows)
        grid = path.default_grid() if self.alphas is None else _check_alphas(self.alphas)
        if centred <= 0.0:
            # Constant targets (C is then 0 too): every alpha fits them exactly, RSS = 0, which RidgePath
            # cannot tell from an interpolating fit and scores inf. The coefficients are 0 whatever alpha.
            scores = np.zeros(len(grid))
        else:
            scores = path.gcv(grid) * (n / rows)
        if not np.isfinite(scores).any():
            raise ValueError(f"GCV cannot score any alpha of the grid ({grid.min():g} to {grid.max():g}) from these "
                             f"statistics: every fit interpolates the {n} samples seen. Pass larger alphas or a "
                             f"number")
        return float(grid[int(np.argmin(scores))]), grid, scores

    def _solved(self):
        check_is_fitted(self)
        if self._solution is None:
            self._solution = self._solve(self._sums())
        return self._solution

    def _sums(self):
        names = ("gram_", "x_sum_", "weight_sum_", "n_samples_seen_", *self._TARGET_SUMS)
        return {name: getattr(self, name) for name in names}

    @property
    def alpha_(self) -> float | np.ndarray:
        """float or ndarray of shape (n_targets,): the alpha of the solve (GCV's choice with alpha='gcv')."""
        return self._solved()["alpha"]

    @property
    def gcv_alphas_(self) -> np.ndarray:
        """ndarray of shape (n_alphas,): the grid GCV searched (alpha='gcv' only)."""
        return self._gcv_attribute("gcv_alphas")

    @property
    def gcv_values_(self) -> np.ndarray:
        """ndarray of shape (n_alphas,): GCV(alpha) on ``gcv_alphas_``, summed over targets (alpha='gcv' only)."""
        return self._gcv_attribute("gcv_values")

    def _gcv_attribute(self, key):
        solution = self._solved()
        if key not in solution:
            raise AttributeError(f"{key}_ is set by alpha='gcv' only; this {type(self).__name__} has "
                                 f"alpha={self.alpha!r}")
        return solution[key]

    def _linear(self, X):
        """X @ coef^T + intercept in X's dtype (float32 data are predicted in float32 BLAS), (n, t)."""
        solution = self._solved()
        X = validate_data(self, X, reset=False, dtype=[np.float64, np.float32])
        coef = np.asarray(solution["coef"].T, dtype=X.dtype)
        out = matmul(X, coef, check_finite=False)
        out += solution["intercept"].astype(X.dtype)
        return out

    # -- the three operations ---------------------------------------------------------------------------
    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X: ArrayLike, y: ArrayLike, sample_weight: float | ArrayLike | None = None) -> _StreamingRidgeBase:
        """Fit on X, y alone (earlier statistics are discarded), and solve.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            float32 or float64 (other dtypes are cast to float64).
        y : array-like of shape (n_samples,) or, for the regressor, (n_samples, n_targets)
            Regressor: cast to X's dtype. Classifier: labels; the classes are those of y (at least 2).
        sample_weight : float or array-like of shape (n_samples,), default=None
            Non-negative, not all zero; frequencies (weight 2 is the row twice).

        Returns
        -------
        self
        """
        self._fit(X, y, sample_weight, reset=True)
        self._solved()
        return self

    def partial_unfit(self, X: ArrayLike, y: ArrayLike,
                      sample_weight: float | ArrayLike | None = None) -> _StreamingRidgeBase:
        """Remove a batch seen before: the sums are downdated, exactly.

        After ``partial_fit(A)``, ``partial_fit(B)``, ``partial_unfit(B)`` the coefficients equal
        ``fit(A)``'s to float64 rounding.

        Parameters
        ----------
        X, y, sample_weight : as given to ``partial_fit``

        Returns
        -------
        self

        Raises
        ------
        ValueError
            The removal would leave no samples or no weight; a class would keep less than none (the
            classifier; labels outside ``classes_`` too); or G + alpha I would not be positive
            definite (rows never seen). The estimator is then unchanged.
        """
        return self._unfit(X, y, sample_weight)

    def _fit(self, X, y, sample_weight, reset, classes=None):
        X, y, sample_weight = self._validate_batch(X, y, sample_weight, reset=reset)
        Y = self._target_columns(X, y, reset=reset, classes=classes)
        if reset:
            self._set_sums(self._empty_sums(X.shape[1], Y.shape[1]))
        self._accumulate(X, Y, sample_weight)
        return self

    def merge(self, other: _StreamingRidgeBase) -> _StreamingRidgeBase:
        """Add another estimator's statistics to this one's: the fit on both estimators' data.

        Parameters
        ----------
        other : estimator of the same class, fitted
            Same features, targets, ``fit_intercept`` (and classes for the classifier). Its
            statistics are added, not its coefficients; the hyperparameters (alpha) are this
            estimator's. An unfitted ``self`` takes a copy of ``other``'s statistics.

        Returns
        -------
        self

        Raises
        ------
        TypeError
            ``other`` is not an estimator of this class.
        ValueError
            The two differ in features, targets, ``fit_intercept`` or classes (both are named).
        """
        if type(other) is not type(self):
            raise TypeError(f"merge needs another {type(self).__name__}, got {type(other).__name__}")
        check_is_fitted(other, msg=f"merge needs a fitted {type(self).__name__} to add; the other one is not fitted")
        if not self.__sklearn_is_fitted__():
            for name in ("n_features_in_", "feature_names_in_", *self._LAYOUT):
                if hasattr(other, name):
                    setattr(self, name, getattr(other, name))
            self._set_sums({name: np.copy(value) if isinstance(value, np.ndarray) else value
                            for name, value in other._sums().items()})
            return self
        self._check_mergeable(other, "merge")
        add_upper(self.gram_, other.gram_)
        self.x_sum_ += other.x_sum_
        self.weight_sum_ += other.weight_sum_
        self.n_samples_seen_ += other.n_samples_seen_
        for name in self._TARGET_SUMS:
            getattr(self, name)[...] += getattr(other, name)
        self._solution = None
        return self

    def _check_mergeable(self, other, verb):
        mine, theirs = self._describe(), other._describe()
        if mine != theirs:
            raise ValueError(f"cannot {verb}: this {type(self).__name__} has {mine}, the other has {theirs}")

    def _describe(self):
        return (f"{self.n_features_in_} features, {self._target_shape()} and "
                f"fit_intercept={self.fit_intercept}")

    def _unfit(self, X, y, sample_weight):
        check_is_fitted(self, msg=f"This {type(self).__name__} has seen no data: partial_unfit has nothing to "
                                  f"remove")
        X, y, sample_weight = self._validate_batch(X, y, sample_weight, reset=False)
        Y = self._target_columns(X, y, reset=False, classes=None, removing=True)
        n = X.shape[0]
        if n >= self.n_samples_seen_:
            raise ValueError(f"partial_unfit would remove {n} samples, but {self.n_samples_seen_} were seen and at "
                             f"least one must remain. Nothing was removed.")
        batch = self._batch_sums(X, Y, sample_weight)
        sums = {name: (value - batch[name]) for name, value in self._sums().items()}
        scale = max(self.weight_sum_, 1.0)
        if sums["weight_sum_"] <= _REMOVAL_RTOL * scale:
            raise ValueError(f"partial_unfit would remove a total weight of {batch['weight_sum_']:g} of the "
                             f"{self.weight_sum_:g} seen, leaving none: these rows were not all seen. "
                             f"Nothing was removed.")
        self._check_removal(sums, scale)
        try:
            solution = self._solve(sums, on_failure="raise")
        except np.linalg.LinAlgError as error:
            raise ValueError(f"partial_unfit refused: after removing these {n} samples the system G + alpha I "
                             f"would not be positive definite, so they were not all among the samples seen "
                             f"({error}). Nothing was removed.") from None
        self._set_sums(sums)
        self._solution = solution
        return self

    def _check_removal(self, sums, scale):
        """Hook: refuse a removal whose target sums show rows never seen (the classifier's classes)."""


class StreamingRidge(MultiOutputMixin, RegressorMixin, _StreamingRidgeBase):
    """Ridge regression from streamed, merged and removed statistics (fastls kernels).

    Minimizes ``||y - X w - b||^2_W + alpha ||w||^2`` like
    ``sklearn.linear_model.Ridge(solver='cholesky')``, from sums of the data kept in float64: rows
    can be added (:meth:`partial_fit`), added from another estimator (:meth:`merge`) and removed
    (:meth:`partial_unfit`), exactly.

    Parameters
    ----------
    alpha : float > 0, array-like of shape (n_targets,) or 'gcv', default=1.0
        Regularization strength; an array holds one per target. ``'gcv'`` chooses it by
        generalized cross-validation from the statistics alone, over ``alphas`` (one alpha for all
        targets, their GCV summed).
    fit_intercept : bool, default=True
        Fit an unpenalized intercept, exactly, from the running sums (no centring pass).
    alphas : array-like of shape (n_alphas,), default=None
        The grid of ``alpha='gcv'`` (the minimizer on it, no refinement). None: fastls's
        ``DEFAULT_GRID`` (1e-9 to 1e3) times the mean eigenvalue of the centred Gram matrix.

    Attributes
    ----------
    coef_ : ndarray of shape (n_features,) or (n_targets, n_features), float64
    intercept_ : float or ndarray of shape (n_targets,)
        A float for 1-D y or with ``fit_intercept=False`` (Ridge's shapes).
    alpha_ : float or ndarray of shape (n_targets,)
        The alpha used (GCV's choice with ``alpha='gcv'``).
    gcv_alphas_, gcv_values_ : ndarray of shape (n_alphas,)
        With ``alpha='gcv'``: the grid and GCV on it, n RSS / (n - dof)^2 summed over targets,
        with n the rows seen and dof counting the intercept.
    gram_ : ndarray of shape (n_features, n_features), float64
        sum_i w_i x_i x_i^T, upper triangle (the strict lower one is not kept up to date).
    x_sum_ : ndarray of shape (n_features,), float64
        sum_i w_i x_i.
    cross_ : ndarray of shape (n_features, n_targets), float64
        sum_i w_i x_i y_i^T.
    y_sum_, y_square_sum_ : ndarray of shape (n_targets,), float64
        sum_i w_i y_i and sum_i w_i y_i^2.
    weight_sum_ : float
        sum_i w_i.
    n_samples_seen_ : int
        Rows added minus rows removed.
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (n_features_in_,)
        When X had string column names.

    Notes
    -----
    float32 data are multiplied in float32 BLAS over blocks of 4,096 rows added in float64
    (:func:`fastls.gram_update`), so their statistics carry float32 rounding per block, not per
    data set. Memory is O(n_features^2 + n_features n_targets) whatever the rows: the statistics,
    one more d x d array while accumulating (the kernel's finiteness check, or with sample weights
    the batch's Gram) and while solving, and targets (and, with sample weights, rows) of 16,384
    rows at a time. Sample weights are frequencies: weight 2 is the row twice.

    ``fit`` solves; after ``partial_fit``, ``merge`` or ``partial_unfit`` the solve waits for the
    first use of the coefficients (``predict``, ``score``, ``coef_``, ``alpha_``), so that a stream
    of batches pays one solve, not one per batch.

    Examples
    --------
    >>> import numpy as np
    >>> from fastls import StreamingRidge
    >>> rng = np.random.default_rng(0)
    >>> X, y = rng.standard_normal((100, 3)), rng.standard_normal(100)
    >>> model = StreamingRidge(alpha=0.5).partial_fit(X[:60], y[:60]).partial_fit(X[60:], y[60:])
    >>> bool(np.allclose(model.coef_, StreamingRidge(alpha=0.5).fit(X, y).coef_))
    True
    """

    _TARGET_SUMS = ("cross_", "y_sum_", "y_square_sum_")
    _LAYOUT = ("_y_1d",)

    @_fit_context(prefer_skip_nested_validation=True)
    def partial_fit(self, X: ArrayLike, y: ArrayLike, sample_weight: float | ArrayLike | None = None) -> StreamingRidge:
        """Add a batch's statistics (the first call starts them; later ones need the same features and targets).

        Parameters
        ----------
        X, y, sample_weight : as in :meth:`fit`

        Returns
        -------
        self
        """
        return self._fit(X, y, sample_weight, reset=not self.__sklearn_is_fitted__())

    def predict(self, X: ArrayLike) -> np.ndarray:
        """Predicted targets.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        y : ndarray of shape (n_samples,) or (n_samples, n_targets), X's dtype (float32 or float64)
        """
        out = self._linear(X)
        return out[:, 0] if self._y_1d else out

    @property
    def coef_(self) -> np.ndarray:
        coef = self._solved()["coef"]
        return coef[0] if self._y_1d else coef

    @property
    def intercept_(self) -> float | np.ndarray:
        intercept = self._solved()["intercept"]
        # Ridge's: a float for one target or without an intercept.
        return float(intercept[0]) if self._y_1d or not self.fit_intercept else intercept

    def _target_columns(self, X, y, reset, classes=None, removing=False):
        y = np.asarray(y)
        if reset:
            self._y_1d = y.ndim == 1
        Y = (y[:, None] if y.ndim == 1 else y).astype(X.dtype, copy=False)
        if not reset and Y.shape[1] != self.cross_.shape[1]:
            raise ValueError(f"y has {Y.shape[1]} target(s) but this StreamingRidge was fitted with "
                             f"{self.cross_.shape[1]}")
        return Y

    def _empty_target_sums(self, d, m):
        return {"cross_": np.zeros((d, m)), "y_sum_": np.zeros(m), "y_square_sum_": np.zeros(m)}

    def _target_sums(self, cross, y_sum, y_square_sum):
        return {"cross_": cross.copy(), "y_sum_": y_sum.copy(), "y_square_sum_": y_square_sum}

    def _target_system(self, sums):
        return sums["cross_"], sums["y_sum_"], sums["y_square_sum_"]

    def _target_shape(self):
        return f"{self.cross_.shape[1]} target(s)"


class StreamingRidgeClassifier(ClassifierMixin, _StreamingRidgeBase):
    """Ridge classifier from streamed, merged and removed statistics (fastls kernels).

    Codes the classes as ``sklearn.linear_model.RidgeClassifier`` does (±1: one column for two
    classes, one per class otherwise) and fits :class:`StreamingRidge` to the codes; the
    statistics are kept per class, so classes can be added later (``classes=`` of
    :meth:`partial_fit`) and the codes of earlier rows follow exactly.

    Parameters
    ----------
    alpha, fit_intercept, alphas : as in :class:`StreamingRidge`
        An array ``alpha`` holds one value per column of ``coef_``.

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
    coef_ : ndarray of shape (n_features,) for two classes, else (n_classes, n_features), float64
        RidgeClassifier's shapes.
    intercept_ : ndarray of shape (1,) or (n_classes,), or 0.0 with ``fit_intercept=False``
    alpha_, gcv_alphas_, gcv_values_, gram_, x_sum_, weight_sum_, n_samples_seen_ :
        as in :class:`StreamingRidge`.
    class_x_sum_ : ndarray of shape (n_features, n_classes), float64
        Per class, sum_i w_i x_i over its rows.
    class_weight_sum_ : ndarray of shape (n_classes,), float64
        Per class, sum_i w_i over its rows.
    n_features_in_ : int
    feature_names_in_ : ndarray of shape (n_features_in_,)

    Examples
    --------
    >>> import numpy as np
    >>> from fastls import StreamingRidgeClassifier
    >>> rng = np.random.default_rng(0)
    >>> X, y = rng.standard_normal((90, 4)), np.repeat([0, 1, 2], 30)
    >>> model = StreamingRidgeClassifier().partial_fit(X[:30], y[:30], classes=[0, 1])
    >>> model = model.partial_fit(X[30:], y[30:], classes=[0, 1, 2])  # a class arrives
    >>> bool(np.allclose(model.coef_, StreamingRidgeClassifier().fit(X, y).coef_))
    True
    """

    _TARGET_SUMS = ("class_x_sum_", "class_weight_sum_")
    _LAYOUT = ("classes_",)

    @_fit_context(prefer_skip_nested_validation=True)
    def partial_fit(self, X: ArrayLike, y: ArrayLike, classes: ArrayLike | None = None,
                    sample_weight: float | ArrayLike | None = None) -> StreamingRidgeClassifier:
        """Add a batch's statistics.

        Parameters
        ----------
        X, y, sample_weight : as in :meth:`fit`
        classes : array-like of shape (n_classes,), default=None
            Required on the first call: every class (at least 2), including those not in this
            batch. A later call may pass more classes (a superset of ``classes_``): they are
            added exactly, earlier rows coded -1 for them. Labels of y outside the classes are
            refused.

        Returns
        -------
        self
        """
        first = not self.__sklearn_is_fitted__()
        if first and classes is None:
            raise ValueError("classes must be passed on the first call to partial_fit: every class the stream "
                             "will hold so far (more can be added by later calls)")
        return self._fit(X, y, sample_weight, reset=first, classes=classes)

    def decision_function(self, X: ArrayLike) -> np.ndarray:
        """Confidence scores: the ridge fit of the ±1 codes.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Scored in its dtype, float32 or float64 (others are cast to float64).

        Returns
        -------
        scores : ndarray of shape (n_samples,) for two classes (positive: ``classes_[1]``), else
            (n_samples, n_classes); X's dtype
        """
        scores = self._linear(X)
        return scores[:, 0] if scores.shape[1] == 1 else scores

    def predict(self, X: ArrayLike) -> np.ndarray:
        """Predicted class labels (the highest score; for two classes, ``classes_[1]`` where it is > 0).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            As in :meth:`decision_function`.

        Returns
        -------
        y : ndarray of shape (n_samples,), dtype of ``classes_``
        """
        scores = self.decision_function(X)
        index = (scores > 0).astype(int) if scores.ndim == 1 else scores.argmax(axis=1)
        return self.classes_[index]

    @property
    def coef_(self) -> np.ndarray:
        coef = self._solved()["coef"]
        # RidgeClassifier's shapes: (n_features,) for two classes (intercept_ stays (1,)).
        return coef[0] if coef.shape[0] == 1 else coef

    @property
    def intercept_(self) -> float | np.ndarray:
        # RidgeClassifier's: 0.0 without an intercept.
        return self._solved()["intercept"] if self.fit_intercept else 0.0

    def _target_columns(self, X, y, reset, classes=None, removing=False):
        """One-hot columns of y over ``classes_`` (in X's dtype); sets or extends the classes first."""
        y = column_or_1d(y, warn=True)
        check_classification_targets(y)
        if reset:
            self.classes_ = _check_classes(np.unique(y) if classes is None else classes)
        elif classes is not None:
            self._extend_classes(_check_classes(classes))
        present = np.isin(y, self.classes_)
        if not present.all():
            unknown = np.unique(y[~present])[:5].tolist()
            if removing:
                raise ValueError(f"y holds labels {unknown} outside classes_ {self.classes_.tolist()}: those rows "
                                 f"were never seen. Nothing was removed.")
            raise ValueError(f"y holds labels {unknown} outside classes_ {self.classes_.tolist()}; to add classes, "
                             f"pass classes= holding the old and the new ones to partial_fit")
        Y = np.zeros((len(y), len(self.classes_)), dtype=X.dtype)
        Y[np.arange(len(y)), np.searchsorted(self.classes_, y)] = 1
        return Y

    def _extend_classes(self, classes):
        """Make room for new classes: zero sums, as their rows so far number none (their codes were -1)."""
        missing = np.setdiff1d(self.classes_, classes)
        if missing.size:
            raise ValueError(f"classes= must hold every class seen so far {self.classes_.tolist()} (classes are "
                             f"added, never dropped), missing {missing[:5].tolist()}")
        if classes.size == self.classes_.size:
            return
        old = np.searchsorted(classes, self.classes_)
        x_sum = np.zeros((self.class_x_sum_.shape[0], classes.size))
        x_sum[:, old] = self.class_x_sum_
        weight_sum = np.zeros(classes.size)
        weight_sum[old] = self.class_weight_sum_
        self.classes_, self.class_x_sum_, self.class_weight_sum_ = classes, x_sum, weight_sum
        self._solution = None

    def _empty_target_sums(self, d, m):
        return {"class_x_sum_": np.zeros((d, m)), "class_weight_sum_": np.zeros(m)}

    def _target_sums(self, cross, y_sum, y_square_sum):
        return {"class_x_sum_": cross.copy(), "class_weight_sum_": y_sum.copy()}

    def _target_system(self, sums):
        """(C, y_sum, y_square_sum) of RidgeClassifier's ±1 codes, 2 [y = k] - 1, from the per-class sums."""
        W = sums["weight_sum_"]
        C = 2.0 * sums["class_x_sum_"] - sums["x_sum_"][:, None]
        y_sum = 2.0 * sums["class_weight_sum_"] - W
        # Two classes: one column, +1 for classes_[1].
        keep = slice(1, 2) if C.shape[1] == 2 else slice(None)
        return C[:, keep], y_sum[keep], np.full(y_sum[keep].shape, W)

    def _check_removal(self, sums, scale):
        left = sums["class_weight_sum_"]
        below = left < -_REMOVAL_RTOL * scale
        if below.any():
            names = self.classes_[below][:5].tolist()
            raise ValueError(f"partial_unfit would remove more weight of classes {names} than was seen "
                             f"({self.class_weight_sum_[below][:5].tolist()}). Nothing was removed.")

    def _check_mergeable(self, other, verb):
        super()._check_mergeable(other, verb)
        if not np.array_equal(self.classes_, other.classes_):
            raise ValueError(f"cannot {verb}: this {type(self).__name__} has classes {self.classes_.tolist()}, the "
                             f"other has classes {other.classes_.tolist()}")

    def _target_shape(self):
        return f"{len(self.classes_)} classes"


def _check_classes(classes):
    """Sorted unique classes, at least 2."""
    classes = np.unique(np.asarray(classes))
    if classes.size < 2:
        raise ValueError(f"StreamingRidgeClassifier needs at least 2 classes, got {classes.size} class: "
                         f"{classes.tolist()}")
    return classes
