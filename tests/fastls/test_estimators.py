"""fastls.StreamingRidge and StreamingRidgeClassifier: scikit-learn's own estimator checks, equality with
Ridge / RidgeClassifier, GCV against a brute force from the rows, and the exactness of streaming, merging
and forgetting."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import Ridge, RidgeClassifier
from sklearn.preprocessing import LabelBinarizer
from sklearn.utils._param_validation import InvalidParameterError
from sklearn.utils.estimator_checks import parametrize_with_checks

import fastls
from tests.numeric_checks import assert_close

# The bound on the relative difference to scikit-learn, float64.
RTOL = 1e-10
ROOT = Path(__file__).resolve().parents[2]


# No check is skipped or expected to fail. scikit-learn's checks skip themselves (SkipTest) where the
# environment lacks what they need: pandas for the pandas-input checks, SCIPY_ARRAY_API for array API.
@parametrize_with_checks([fastls.StreamingRidge(), fastls.StreamingRidgeClassifier(),
                          fastls.StreamingRidge(alpha="gcv"), fastls.StreamingRidgeClassifier(alpha="gcv")])
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)


def regression(rng, n=120, d=7, targets=None, offset=3.0):
    """Features off-centre (the intercept matters) and targets linear in them plus noise."""
    X = rng.standard_normal((n, d)) + offset
    shape = (d,) if targets is None else (d, targets)
    y = X @ rng.standard_normal(shape) + 0.5 * rng.standard_normal((n,) if targets is None else (n, targets))
    return X, y


def classification(rng, n=150, d=6, classes=3):
    y = rng.integers(0, classes, n)
    X = rng.standard_normal((n, d)) + y[:, None] * 0.7 + 1.0
    return X, y


def state(model):
    """Every fitted statistic and the coefficients, copied: what a refusal must leave as it was."""
    names = [name for name in vars(model) if name.endswith("_") and not name.startswith("_")]
    return {name: np.copy(getattr(model, name)) for name in names} | {"coef_": np.copy(model.coef_)}


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


# ---------------------------------------------------------------------------------------------------------
# Equal to scikit-learn
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("targets", [None, 3])
@pytest.mark.parametrize("alpha", [0.3, 25.0])
def test_equals_ridge_cholesky(rng, fit_intercept, weighted, targets, alpha):
    X, y = regression(rng, targets=targets)
    w = rng.uniform(0.1, 3.0, len(X)) if weighted else None
    ours = fastls.StreamingRidge(alpha=alpha, fit_intercept=fit_intercept).fit(X, y, sample_weight=w)
    theirs = Ridge(alpha=alpha, fit_intercept=fit_intercept, solver="cholesky").fit(X, y, sample_weight=w)
    assert np.shape(ours.coef_) == np.shape(theirs.coef_)
    assert np.shape(ours.intercept_) == np.shape(theirs.intercept_)
    assert_close(ours.coef_, theirs.coef_, np.float64, rtol=RTOL)
    assert_close(ours.intercept_, theirs.intercept_, np.float64, rtol=RTOL)
    assert_close(ours.predict(X), theirs.predict(X), np.float64, rtol=RTOL)


def test_alpha_per_target_equals_ridge(rng):
    X, y = regression(rng, targets=3)
    alpha = np.array([0.1, 4.0, 0.1])
    ours = fastls.StreamingRidge(alpha=alpha).fit(X, y)
    theirs = Ridge(alpha=alpha, solver="cholesky").fit(X, y)
    assert_close(ours.coef_, theirs.coef_, np.float64, rtol=RTOL)
    np.testing.assert_array_equal(ours.alpha_, alpha)


def test_float32_data_give_float64_statistics(rng):
    X, y = regression(rng, n=5000, targets=2)
    ours = fastls.StreamingRidge(alpha=2.0).fit(X.astype(np.float32), y.astype(np.float32))
    assert ours.gram_.dtype == ours.cross_.dtype == ours.coef_.dtype == np.float64
    assert ours.predict(X.astype(np.float32)).dtype == np.float32
    # The data are rounded to float32 once; the rest is float32 products over 4,096-row blocks in float64.
    reference = Ridge(alpha=2.0, solver="cholesky").fit(X.astype(np.float32).astype(np.float64),
                                                        y.astype(np.float32).astype(np.float64))
    assert_close(ours.coef_, reference.coef_, np.float32, n_terms=4096)


@pytest.mark.parametrize("classes", [2, 4])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fit_intercept", [True, False])
def test_classifier_equals_ridge_classifier(rng, classes, weighted, fit_intercept):
    X, y = classification(rng, classes=classes)
    labels = np.array(["ant", "bee", "cat", "dog"])[y]
    w = rng.uniform(0.1, 3.0, len(X)) if weighted else None
    ours = fastls.StreamingRidgeClassifier(alpha=0.5, fit_intercept=fit_intercept).fit(X, labels, sample_weight=w)
    theirs = RidgeClassifier(alpha=0.5, fit_intercept=fit_intercept, solver="cholesky").fit(X, labels,
                                                                                           sample_weight=w)
    np.testing.assert_array_equal(ours.classes_, theirs.classes_)
    np.testing.assert_array_equal(ours.predict(X), theirs.predict(X))
    assert np.shape(ours.coef_) == np.shape(theirs.coef_)
    assert np.shape(ours.intercept_) == np.shape(theirs.intercept_)
    assert_close(ours.coef_, theirs.coef_, np.float64, rtol=RTOL)
    assert_close(ours.decision_function(X), theirs.decision_function(X), np.float64, rtol=RTOL)


# ---------------------------------------------------------------------------------------------------------
# GCV from the statistics against a brute force from the rows
# ---------------------------------------------------------------------------------------------------------

def brute_force_gcv(X, Y, alphas, fit_intercept, w=None):
    """n RSS_w(a) / (n - tr H(a))^2 from the rows, one explicit hat matrix per alpha (intercept unpenalized)."""
    n = len(X)
    root = np.sqrt(np.ones(n) if w is None else w)
    Y = Y.reshape(n, -1)
    A = np.column_stack([np.ones(n), X]) if fit_intercept else X
    A = A * root[:, None]
    scores = []
    for a in alphas:
        penalty = a * np.eye(A.shape[1])
        if fit_intercept:
            penalty[0, 0] = 0.0
        H = A @ np.linalg.solve(A.T @ A + penalty, A.T)
        residual = root[:, None] * Y - H @ (root[:, None] * Y)
        scores.append(n * float((residual ** 2).sum()) / (n - np.trace(H)) ** 2)
    return np.array(scores)


@pytest.mark.parametrize("fit_intercept", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("targets", [None, 3])
def test_gcv_equals_brute_force_from_rows(rng, fit_intercept, weighted, targets):
    X, y = regression(rng, n=60, d=8, targets=targets)
    w = rng.uniform(0.2, 2.0, len(X)) if weighted else None
    alphas = np.geomspace(1e-2, 1e4, 13)
    model = fastls.StreamingRidge(alpha="gcv", alphas=alphas, fit_intercept=fit_intercept).fit(X, y, sample_weight=w)
    expected = brute_force_gcv(X, y, alphas, fit_intercept, w)
    np.testing.assert_allclose(model.gcv_values_, expected, rtol=1e-8)
    np.testing.assert_array_equal(model.gcv_alphas_, alphas)
    assert model.alpha_ == alphas[np.argmin(expected)]
    reference = Ridge(alpha=model.alpha_, fit_intercept=fit_intercept, solver="cholesky").fit(X, y, sample_weight=w)
    assert_close(model.coef_, reference.coef_, np.float64, rtol=RTOL)


def test_classifier_gcv_is_the_regressor_gcv_of_the_codes(rng):
    X, y = classification(rng, classes=3)
    alphas = np.geomspace(1e-2, 1e3, 9)
    model = fastls.StreamingRidgeClassifier(alpha="gcv", alphas=alphas).fit(X, y)
    codes = LabelBinarizer(neg_label=-1).fit_transform(y)
    np.testing.assert_allclose(model.gcv_values_, brute_force_gcv(X, codes, alphas, True), rtol=1e-8)


def test_gcv_default_grid_and_attributes(rng):
    X, y = regression(rng)
    model = fastls.StreamingRidge(alpha="gcv").fit(X, y)
    assert model.gcv_alphas_.shape == model.gcv_values_.shape == fastls.DEFAULT_GRID.shape
    assert model.alpha_ in model.gcv_alphas_
    with pytest.raises(AttributeError, match="alpha='gcv' only"):
        fastls.StreamingRidge(alpha=1.0).fit(X, y).gcv_values_  # noqa: B018  (the access is what raises)


# ---------------------------------------------------------------------------------------------------------
# Streaming, merging, forgetting
# ---------------------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), cuts=st.lists(st.integers(1, 89), max_size=8, unique=True),
       float32=st.booleans())
def test_partial_fit_any_batches_equals_fit(seed, cuts, float32):
    rng = np.random.default_rng(seed)
    X, y = regression(rng, n=90, d=5, targets=2)
    w = rng.uniform(0.0, 2.0, len(X))
    dtype = np.float32 if float32 else np.float64
    X, y = X.astype(dtype), y.astype(dtype)
    whole = fastls.StreamingRidge(alpha=0.8).fit(X, y, sample_weight=w)
    streamed = fastls.StreamingRidge(alpha=0.8)
    for rows in np.split(np.arange(len(X)), sorted(cuts)):
        streamed.partial_fit(X[rows], y[rows], sample_weight=w[rows])
    # float32 rows: the products are float32 within a batch, so other batches round differently.
    assert_close(streamed.coef_, whole.coef_, dtype, n_terms=90, rtol=RTOL if not float32 else None)
    assert streamed.n_samples_seen_ == len(X)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), cuts=st.lists(st.integers(1, 99), max_size=6, unique=True))
def test_classifier_partial_fit_any_batches_equals_fit(seed, cuts):
    rng = np.random.default_rng(seed)
    X, y = classification(rng, n=100, classes=4)
    whole = fastls.StreamingRidgeClassifier().fit(X, y)
    streamed = fastls.StreamingRidgeClassifier()
    for rows in np.split(np.arange(len(X)), sorted(cuts)):
        streamed.partial_fit(X[rows], y[rows], classes=[0, 1, 2, 3])
    assert_close(streamed.coef_, whole.coef_, np.float64, rtol=RTOL)
    np.testing.assert_array_equal(streamed.predict(X), whole.predict(X))


def test_classes_added_later_equal_the_joint_fit(rng):
    """Class-incremental: phases bring new classes; earlier rows are coded -1 for them, exactly."""
    X, y = classification(rng, n=200, classes=5)
    model = fastls.StreamingRidgeClassifier(alpha=2.0)
    for phase in ([0, 1], [2, 3], [4]):
        rows = np.isin(y, phase)
        seen = np.unique(y[np.isin(y, np.arange(max(phase) + 1))])
        model.partial_fit(X[rows], y[rows], classes=seen)
    joint = RidgeClassifier(alpha=2.0, solver="cholesky").fit(X, y)
    assert_close(model.coef_, joint.coef_, np.float64, rtol=RTOL)
    np.testing.assert_array_equal(model.predict(X), joint.predict(X))


@pytest.mark.parametrize("alpha", [1.5, "gcv"])
def test_fit_then_unfit_equals_fit_of_the_rest(rng, alpha):
    X, y = regression(rng, n=150, targets=2)
    A, B = slice(0, 80), slice(80, None)
    w = rng.uniform(0.5, 2.0, len(X))
    alphas = np.geomspace(1e-2, 1e3, 11)
    model = fastls.StreamingRidge(alpha=alpha, alphas=alphas)
    model.partial_fit(X[A], y[A], sample_weight=w[A]).partial_fit(X[B], y[B], sample_weight=w[B])
    model.partial_unfit(X[B], y[B], sample_weight=w[B])
    only_a = fastls.StreamingRidge(alpha=alpha, alphas=alphas).fit(X[A], y[A], sample_weight=w[A])
    assert model.n_samples_seen_ == 80
    assert model.alpha_ == only_a.alpha_
    assert_close(model.coef_, only_a.coef_, np.float64, rtol=RTOL)
    assert_close(model.intercept_, only_a.intercept_, np.float64, rtol=RTOL)


def test_classifier_unfit_equals_fit_of_the_rest(rng):
    X, y = classification(rng, n=160, classes=3)
    model = fastls.StreamingRidgeClassifier().fit(X, y)
    model.partial_unfit(X[100:], y[100:])
    assert_close(model.coef_, fastls.StreamingRidgeClassifier().fit(X[:100], y[:100]).coef_, np.float64, rtol=RTOL)


@pytest.mark.parametrize("kind", ["regressor", "classifier"])
def test_merge_equals_fit_on_the_concatenation(rng, kind):
    if kind == "regressor":
        X, y = regression(rng, n=140, targets=3)
        make = lambda: fastls.StreamingRidge(alpha=0.7)  # noqa: E731
    else:
        X, y = classification(rng, n=140, classes=3)
        make = lambda: fastls.StreamingRidgeClassifier(alpha=0.7)  # noqa: E731
    parts = np.split(np.arange(len(X)), [30, 90])
    models = [make().fit(X[rows], y[rows]) for rows in parts]
    merged = make()  # an unfitted estimator takes the first one's statistics
    for model in models:
        merged.merge(model)
    whole = make().fit(X, y)
    assert merged.n_samples_seen_ == len(X)
    assert_close(merged.coef_, whole.coef_, np.float64, rtol=RTOL)
    assert_close(merged.intercept_, whole.intercept_, np.float64, rtol=RTOL)
    # merge adds statistics: the parts are left as they were
    assert models[0].n_samples_seen_ == 30


def test_cholesky_failure_falls_back_with_a_warning(rng):
    """alpha below the rounding of a singular G: fit says it solved through eigh (as Ridge warns for lstsq)."""
    X = rng.standard_normal((50, 4)) * 1e6
    X = np.column_stack([X, X[:, 0]])  # a repeated column: G is singular
    y = rng.standard_normal(50)
    with pytest.warns(RuntimeWarning, match="solving through eigh"):
        model = fastls.StreamingRidge(alpha=1e-9, fit_intercept=False).fit(X, y)
    assert np.isfinite(model.coef_).all()
    assert model.coef_[0] == pytest.approx(model.coef_[-1])  # the pseudo-inverse splits the twin columns evenly


def test_state_does_not_grow_with_rows(rng):
    """O(d^2 + d t) memory: the fitted statistics of 100 and of 20,000 rows take the same bytes."""
    def state_bytes(n):
        X, y = regression(rng, n=n, d=9, targets=2)
        model = fastls.StreamingRidge().fit(X, y)
        return sum(np.asarray(value).nbytes for value in vars(model).values() if isinstance(value, np.ndarray))

    assert state_bytes(100) == state_bytes(20000) < 2 * (9 * 9 + 9 * 2 * 2) * 8


# ---------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------

def test_merge_refusals_name_both_sides(rng):
    X, y = regression(rng, targets=2)
    model = fastls.StreamingRidge().fit(X, y)
    with pytest.raises(ValueError, match=r"has 7 features, 2 target\(s\).*other has 6 features, 2 target"):
        model.merge(fastls.StreamingRidge().fit(X[:, :6], y))
    with pytest.raises(ValueError, match=r"2 target\(s\).*other has 7 features, 1 target"):
        model.merge(fastls.StreamingRidge().fit(X, y[:, 0]))
    with pytest.raises(ValueError, match="fit_intercept=True.*fit_intercept=False"):
        model.merge(fastls.StreamingRidge(fit_intercept=False).fit(X, y))
    with pytest.raises(TypeError, match="needs another StreamingRidge, got StreamingRidgeClassifier"):
        model.merge(fastls.StreamingRidgeClassifier().fit(X, rng.integers(0, 2, len(X))))
    with pytest.raises(ValueError, match="not fitted"):
        model.merge(fastls.StreamingRidge())
    Xc, yc = classification(rng, classes=3)
    classifier = fastls.StreamingRidgeClassifier().fit(Xc, yc)
    other = fastls.StreamingRidgeClassifier().partial_fit(Xc, yc, classes=[0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"3 classes.*other has 6 features, 4 classes"):
        classifier.merge(other)
    before = state(model)
    assert_same_state(before, state(model))


def test_unfit_refusals_change_nothing(rng):
    X, y = regression(rng, n=100, targets=2)
    model = fastls.StreamingRidge(alpha=1e-3).fit(X[:50], y[:50])
    before = state(model)
    with pytest.raises(ValueError, match="remove 60 samples, but 50 were seen and at least one must remain"):
        model.partial_unfit(X[:60], y[:60])
    # Rows never seen, far larger than those seen: the downdated Gram is indefinite.
    with pytest.raises(ValueError, match="not be positive definite.*Nothing was removed"):
        model.partial_unfit(10.0 * X[50:60], y[50:60])
    with pytest.raises(ValueError, match="leaving none"):
        model.partial_unfit(X[:10], y[:10], sample_weight=np.full(10, 100.0))
    with pytest.raises(ValueError, match="y has 1 target"):
        model.partial_unfit(X[:10], y[:10, 0])
    assert_same_state(before, state(model))
    with pytest.raises(ValueError, match="has seen no data"):
        fastls.StreamingRidge().partial_unfit(X, y)


@pytest.mark.parametrize("weighted", [False, True])
def test_partial_fit_refuses_float32_overflow_before_changing_anything(rng, weighted):
    X, y = regression(rng, n=60, d=3)
    model = fastls.StreamingRidge().fit(X.astype(np.float32), y.astype(np.float32))
    before = state(model)
    w = np.full(60, 2.0) if weighted else None
    huge_rows = X.astype(np.float32)
    huge_rows[40:] = 1e19  # squares overflow float32
    with pytest.raises(ValueError, match="X contains NaN or Inf .or values whose squares overflow float32"):
        model.partial_fit(huge_rows, y.astype(np.float32), sample_weight=w)
    with pytest.raises(ValueError, match="y holds values whose squares overflow float32"):
        model.partial_fit(X.astype(np.float32), np.full(60, 1e19, dtype=np.float32), sample_weight=w)
    assert_same_state(before, state(model))


def test_classifier_unfit_refusals_change_nothing(rng):
    X, y = classification(rng, n=90, classes=3)
    model = fastls.StreamingRidgeClassifier().fit(X, y)
    before = state(model)
    with pytest.raises(ValueError, match=r"outside classes_ \[0, 1, 2\].*never seen"):
        model.partial_unfit(X[:5], np.full(5, 7))
    seen = int((y == 0).sum())
    with pytest.raises(ValueError, match=r"more weight of classes \[0\] than was seen"):
        model.partial_unfit(X[:seen + 5], np.zeros(seen + 5, dtype=int))
    assert_same_state(before, state(model))


def test_classifier_classes_refusals(rng):
    X, y = classification(rng, classes=3)
    with pytest.raises(ValueError, match="classes must be passed on the first call"):
        fastls.StreamingRidgeClassifier().partial_fit(X, y)
    model = fastls.StreamingRidgeClassifier().partial_fit(X[y < 2], y[y < 2], classes=[0, 1])
    with pytest.raises(ValueError, match=r"labels \[2\] outside classes_ \[0, 1\]; to add classes"):
        model.partial_fit(X, y)
    with pytest.raises(ValueError, match=r"missing \[0\]"):
        model.partial_fit(X, y, classes=[1, 2])
    with pytest.raises(ValueError, match="at least 2 classes, got 1"):
        fastls.StreamingRidgeClassifier().fit(X, np.zeros(len(X)))


@pytest.mark.parametrize("alpha, message", [
    (0.0, "The 'alpha' parameter of StreamingRidge must be a float in the range"),
    ("loo", "The 'alpha' parameter"),
])
def test_invalid_alpha_is_named(rng, alpha, message):
    X, y = regression(rng)
    with pytest.raises(InvalidParameterError, match=message):
        fastls.StreamingRidge(alpha=alpha).fit(X, y)


@pytest.mark.parametrize("alpha, alphas, message", [
    ([1.0, 2.0], None, r"one value per target \(3\), got shape \(2,\)"),
    ([1.0, -2.0, 1.0], None, r"finite and > 0 for every target.*-2.0"),
    ("gcv", [1.0, 0.0], "alphas must be a non-empty 1-D sequence of finite numbers > 0"),
])
def test_invalid_alpha_values_are_named(rng, alpha, alphas, message):
    X, y = regression(rng, targets=3)
    with pytest.raises(ValueError, match=message):
        fastls.StreamingRidge(alpha=alpha, alphas=alphas).fit(X, y)


# ---------------------------------------------------------------------------------------------------------
# The report and the worked example, at CI size
# ---------------------------------------------------------------------------------------------------------

def test_import_fastls_leaves_scikit_learn_for_the_estimators():
    """The kernels' callers do not pay for scikit-learn's import; the estimators load it on first use."""
    code = ("import sys, fastls; assert 'sklearn' not in sys.modules; fastls.StreamingRidge; "
            "assert 'sklearn' in sys.modules; assert 'StreamingRidgeClassifier' in dir(fastls)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_estimators_report_runs_at_ci_size():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "estimators_report.py"), "--rows", "20000",
                           "--features", "129", "--batches", "10"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| `StreamingRidge.fit` |" in done.stdout
    assert "| `StreamingRidge.partial_fit` x 10 + `coef_` |" in done.stdout
    assert "Memory budget of the issue" in done.stdout


def load_example():
    spec = importlib.util.spec_from_file_location("class_incremental_mnist",
                                                  ROOT / "examples" / "class_incremental_mnist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_example_result(result):
    assert result["joint_difference"] < 1e-9
    assert result["sklearn_difference"] < 1e-9
    assert result["same_predictions_as_joint"] and result["same_predictions_as_sklearn"]


def test_class_incremental_example_on_synthetic_data():
    check_example_result(load_example().main(["--synthetic", "--subset", "800", "--features", "150"]))


def test_class_incremental_example_on_an_mnist_subset():
    example = load_example()
    from fedlayer.data import load_mnist

    try:
        load_mnist()
    except FileNotFoundError as error:
        pytest.skip(f"MNIST is absent: {error}")
    result = example.main(["--subset", "2000", "--features", "300"])
    check_example_result(result)
    assert result["accuracies"][0] > 0.95  # two digits, 300 random features
