"""How far each way of solving the 'same' DCNN's classifier is from the exact ridge solution.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_dual_precision.py --width 0.25 \
        --run primal=results/prec/primal/model.npz --run dual=results/prec/dual/model.npz \
        [--run NAME=MODEL ...] [--work DIR] [--json FILE] [--out FILE]

Every ``--run`` is a finished FedACnnL run of the 'same' DCNN at ``--width``
with the same convolutions (runs resumed from one checkpoint of the
convolutions, differing only in how the server solved the classifier).
The reference is the classifier's ridge solution computed in float64
throughout: W = (X^T X + gamma I)^-1 X^T Y over the union of the clients'
float32 training features X (bias column last), each block of rows cast to
float64 before its product, so that X^T X is exact to float64 rounding. The
runs' classifiers, the exact solution over features each perturbed by one
float32 rounding (what a float32 forward pass's other order of sums would
give: the sensitivity of this classifier to float32 data), and the
computation outside the protocol of
``fig6_dual_classifier.py`` (float64 products since this measurement; it
was made with float32 products over blocks of 8,192 features summed into
float64), are reported as relative Frobenius
differences from it. A width where the d x d Gram fits in RAM is needed
(1/4: d = 32,769, 8.6 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import fastls
from dev_layout import REPOSITORY, emit_report, use_shared_data
from fig6_classifier_gamma import RUN_GAMMA
from fig6_dual_classifier import (classifier_weights, exact_model, relative_difference, same_convolutions, solve_dual,
                                  write_features)
from fig6_padding import width_label
from fedlayer.models import Model
from fedlayer.run import RunConfig, load_dataset, pooled_data

EXACT_BLOCK_ROWS = 4096  # training rows cast to float64 per Gram update: 1 GiB at d = 32,769


def exact_ridge(features, y, n_classes, gamma, perturbation=0.0, seed=0):
    """W = (X^T X + gamma I)^-1 X^T Y with X = [features | 1] multiplied in float64 throughout.

    Parameters
    ----------
    features : ndarray of shape (positions, channels, N), float32
        As :func:`fig6_dual_classifier.write_features` writes them.
    perturbation : float
        Each feature x becomes x (1 + perturbation r), r uniform in [-1, 1]
        (seeded): with 2^-24, one float32 rounding of every feature, the
        size of the difference any other float32 order of the forward pass's
        sums makes.

    Returns
    -------
    W : ndarray of shape (positions * channels + 1, n_classes), float64, bias last
    """
    positions, channels, n = features.shape
    d = positions * channels
    X_T = np.asarray(features).reshape(d, n)
    Y = np.eye(n_classes)[y]
    G = np.zeros((d + 1, d + 1))
    C = np.zeros((d + 1, n_classes))
    rng = np.random.default_rng(seed)
    for start in range(0, n, EXACT_BLOCK_ROWS):
        block = np.ones((min(EXACT_BLOCK_ROWS, n - start), d + 1))
        block[:, :d] = X_T[:, start:start + len(block)].T
        if perturbation:
            block[:, :d] *= 1.0 + perturbation * rng.uniform(-1.0, 1.0, (len(block), d))
        fastls.gram_update(G, block)
        C += block.T @ Y[start:start + len(block)]
    return fastls.ridge_solve(G, C, gamma, overwrite_g=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, metavar="NAME=MODEL",
                        help="a finished run's model.npz, named in the report")
    parser.add_argument("--width", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gamma", type=float, default=RUN_GAMMA)
    parser.add_argument("--skip-outside", action="store_true",
                        help="leave out fig6_dual_classifier.py's computation (its N x N system)")
    parser.add_argument("--skip-perturbed", action="store_true",
                        help="leave out the exact solution over perturbed features (another d x d Gram)")
    parser.add_argument("--work", default=None, help="folder for the features memmap (default: results/)")
    parser.add_argument("--json", default=str(REPOSITORY / "docs" / "results" / "fig6_dual_precision.json"))
    parser.add_argument("--out", default=str(REPOSITORY / "docs" / "results" / "fig6_dual_precision.md"))
    args = parser.parse_args(argv)
    runs = dict(item.split("=", 1) for item in args.run)
    use_shared_data()
    config = RunConfig(algorithm="fedacnnl", dataset="cifar10", model="dcnn", width=args.width, dtype="float32",
                       seed=args.seed, cores=[2], conv_targets="position", padding="same")
    dataset = load_dataset(config)
    pooled = pooled_data(dataset)
    models = {name: Model.load(path)[0] for name, path in runs.items()}
    first_name, first = next(iter(models.items()))
    for name, other in models.items():
        if not same_convolutions(first, other):
            raise ValueError(f"run {name} ({runs[name]}) has other convolutions than {first_name}: resume every "
                             f"run from one checkpoint of the convolutions")
    model, conv_stop = exact_model(first, args.width, dataset.n_classes)
    classifiers = {name: classifier_weights(other) for name, other in models.items()}
    work = Path(args.work) if args.work else REPOSITORY / "results"
    work.mkdir(parents=True, exist_ok=True)
    seconds = {}
    with tempfile.TemporaryDirectory(dir=work, prefix="fig6-precision-") as folder:
        start = time.perf_counter()
        features = write_features(model, conv_stop, pooled.x_train, Path(folder) / "features.npy")
        seconds["forward"] = time.perf_counter() - start
        start = time.perf_counter()
        W_exact = exact_ridge(features, pooled.y_train, dataset.n_classes, args.gamma)
        seconds["exact"] = time.perf_counter() - start
        differences = {name: relative_difference(W, W_exact) for name, W in classifiers.items()}
        if not args.skip_perturbed:
            start = time.perf_counter()
            W_perturbed = exact_ridge(features, pooled.y_train, dataset.n_classes, args.gamma,
                                      perturbation=2.0**-24)
            seconds["perturbed"] = time.perf_counter() - start
            differences["exact, every feature perturbed by one float32 rounding (2^-24 relative)"] = \
                relative_difference(W_perturbed, W_exact)
            del W_perturbed
        if not args.skip_outside:
            start = time.perf_counter()
            W_outside, _, _ = solve_dual(features, pooled.y_train, dataset.n_classes, args.gamma)
            seconds["outside"] = time.perf_counter() - start
            differences["outside the protocol (fig6_dual_classifier.py)"] = relative_difference(W_outside, W_exact)
        del features
    row = {"width": args.width, "gamma": args.gamma, "classifier_inputs": int(W_exact.shape[0]),
           "train_rows": int(len(pooled.y_train)), "runs": runs, "relative_difference": differences,
           "seconds": seconds}
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.exists() else []
    for earlier in (r for r in rows if r["width"] == args.width):
        # Solves measured by an earlier invocation at this width stay, unless measured again.
        row = {**earlier, **row, "runs": {**earlier["runs"], **runs},
               "relative_difference": {**earlier["relative_difference"], **differences},
               "seconds": {**earlier["seconds"], **seconds}}
    rows = [r for r in rows if r["width"] != args.width] + [row]
    path.write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# The 'same' DCNN's classifier: each solve against the exact ridge solution", "",
             "Made by `experiments/fig6_dual_precision.py` (its docstring says how each run was made): relative "
             "Frobenius difference ||W - W_exact|| / ||W_exact|| of each classifier from the ridge solution "
             "multiplied in float64 throughout, over the same float32 features. Discussion: "
             "[fig6_notes.md](fig6_notes.md), \"'Same' padding through the protocol\".", "",
             "| width | classifier's d | training rows | solve | relative difference |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["width"]):
        for name, difference in r["relative_difference"].items():
            lines.append(f"| {width_label(r['width'])} | {r['classifier_inputs']:,} | {r['train_rows']:,} | {name} | "
                         f"{difference:.1e} |")
    emit_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
