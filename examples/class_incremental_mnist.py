"""Analytic class-incremental learning on MNIST with fastls.StreamingRidgeClassifier.

    python examples/class_incremental_mnist.py [--subset N] [--features 1000] [--phases 5] [--alpha 1.0]
    python examples/class_incremental_mnist.py --synthetic       # no MNIST needed

The ten digits arrive in phases (two new classes each by default). Each phase's images are seen once,
through ``partial_fit``, and never again; the classifier is a ridge regression on a fixed random-feature
expansion phi(x) = max(0, x W + b) of the pixels (W, b drawn once), as in analytic continual learning.
Because the estimator keeps the sums X^T X, X^T Y, the new classes' columns follow exactly from them
(earlier rows are coded -1 for a class they never were), so after the last phase the classifier is the
one fitted on all the data at once: the script prints, per phase, the test accuracy on the classes seen
so far, then how far the phase-by-phase coefficients are from a joint ``fit`` and from scikit-learn's
``RidgeClassifier(solver='cholesky')`` on the same features, and whether their predictions agree.

MNIST is read from ``$FEDLAYER_DATA_DIR/mnist`` (or ``./data/mnist``); when it is absent the script says
so and exits without error (pass ``--synthetic`` to run on generated digits-like data instead).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sklearn.linear_model import RidgeClassifier

import fastls


def load_digits_data(args):
    """(x_train, y_train, x_test, y_test) as float64 rows in [0, 1] and int labels, or None without MNIST."""
    if args.synthetic:
        return synthetic_digits(args.subset or 3000, args.seed)
    from fedlayer.data import load_mnist

    try:
        x_train, y_train, x_test, y_test = load_mnist()
    except FileNotFoundError as error:
        print(f"MNIST is absent, skipping the example. {error}\nRun with --synthetic to use generated data.")
        return None
    rng = np.random.default_rng(args.seed)
    if args.subset:
        keep = rng.choice(len(x_train), size=min(args.subset, len(x_train)), replace=False)
        x_train, y_train = x_train[keep], y_train[keep]
        test = rng.choice(len(x_test), size=min(args.subset, len(x_test)), replace=False)
        x_test, y_test = x_test[test], y_test[test]
    flat = lambda images: images.reshape(len(images), -1).astype(np.float64) / 255.0  # noqa: E731
    return flat(x_train), y_train, flat(x_test), y_test


def synthetic_digits(n, seed, classes=10, pixels=784):
    """Ten Gaussian clusters in [0, 1]^784 with prototypes of their own: a stand-in with MNIST's shapes."""
    rng = np.random.default_rng(seed)
    prototypes = rng.uniform(0.0, 1.0, (classes, pixels)) * (rng.uniform(size=(classes, pixels)) < 0.2)

    def draw(count):
        labels = rng.integers(0, classes, count)
        return np.clip(prototypes[labels] + 0.3 * rng.standard_normal((count, pixels)), 0.0, 1.0), labels

    x_train, y_train = draw(n)
    x_test, y_test = draw(max(n // 5, 100))
    return x_train, y_train, x_test, y_test


class RandomFeatures:
    """phi(x) = max(0, x W + b): a fixed random expansion, drawn once, float64."""

    def __init__(self, inputs, features, seed):
        rng = np.random.default_rng(seed)
        self.W = rng.standard_normal((inputs, features)) / np.sqrt(inputs)
        self.b = rng.standard_normal((1, features))

    def __call__(self, x):
        out = fastls.matmul(x, self.W)
        out += self.b
        return np.maximum(out, 0.0, out=out)


def phases_of(labels, count):
    """The classes split into ``count`` consecutive groups: [0, 1], [2, 3], ... for 10 classes and 5 phases."""
    return [group.tolist() for group in np.array_split(np.unique(labels), count)]


def run(args):
    data = load_digits_data(args)
    if data is None:
        return None
    x_train, y_train, x_test, y_test = data
    phi = RandomFeatures(x_train.shape[1], args.features, args.seed)
    model = fastls.StreamingRidgeClassifier(alpha=args.alpha)
    seen = []
    print(f"{len(x_train):,} training and {len(x_test):,} test images, {args.features} random features, "
          f"alpha = {args.alpha:g}\n")
    print("| phase | new classes | rows added | test accuracy on the classes seen | seconds |")
    print("| ---: | --- | ---: | ---: | ---: |")
    accuracies = []
    for phase, classes in enumerate(phases_of(y_train, args.phases), start=1):
        start = time.perf_counter()
        rows = np.isin(y_train, classes)
        seen += classes
        # Only this phase's rows: the earlier phases' images are never looked at again.
        model.partial_fit(phi(x_train[rows]), y_train[rows], classes=seen)
        test = np.isin(y_test, seen)
        accuracy = model.score(phi(x_test[test]), y_test[test])
        accuracies.append(accuracy)
        print(f"| {phase} | {classes} | {int(rows.sum()):,} | {accuracy:.4f} | {time.perf_counter() - start:.2f} |")

    features = phi(x_train)
    joint = fastls.StreamingRidgeClassifier(alpha=args.alpha).fit(features, y_train)
    reference = RidgeClassifier(alpha=args.alpha, solver="cholesky").fit(features, y_train)
    test_features = phi(x_test)
    scale = np.abs(joint.coef_).max()
    result = {
        "accuracies": accuracies,
        "joint_difference": float(np.abs(model.coef_ - joint.coef_).max() / scale),
        "sklearn_difference": float(np.abs(model.coef_ - reference.coef_).max() / scale),
        "same_predictions_as_joint": bool(np.array_equal(model.predict(test_features), joint.predict(test_features))),
        "same_predictions_as_sklearn": bool(np.array_equal(model.predict(test_features),
                                                           reference.predict(test_features))),
    }
    print(f"\nAfter the last phase, against a joint fit on all {len(x_train):,} rows at once:")
    print(f"- max |coef difference| / max |coef|: {result['joint_difference']:.1e} (fastls fit), "
          f"{result['sklearn_difference']:.1e} (scikit-learn RidgeClassifier, solver='cholesky')")
    print(f"- identical test predictions: {result['same_predictions_as_joint']} (fastls fit), "
          f"{result['same_predictions_as_sklearn']} (scikit-learn)")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", type=int, default=0, help="training (and test) images used; 0: all")
    parser.add_argument("--features", type=int, default=1000, help="random features (default 1000)")
    parser.add_argument("--phases", type=int, default=5, help="phases the classes arrive in (default 5)")
    parser.add_argument("--alpha", type=float, default=1.0, help="ridge regularization (default 1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic", action="store_true", help="generated data instead of MNIST")
    args = parser.parse_args(argv)
    if args.subset < 0 or args.features < 1 or not 1 <= args.phases <= 10 or not args.alpha > 0:
        parser.error("--subset must be >= 0, --features >= 1, --phases in 1..10 and --alpha > 0")
    return run(args)


if __name__ == "__main__":
    main()
