"""Fig. 6's accuracy against the ridge gamma of the DCNN's classifier, from one finished full-width run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_classifier_gamma.py \
        --model results/fig6-v13/fedacnnl/model.npz [--width 1.0] [--seed 0] [--out FILE]

FedACnnL's weights are centralized ACnnL's on the union of the clients' data
(the weight-invariant property, section 3), so the last layer of a finished
run can be solved again for any gamma from the statistics of its inputs: every
training image passes the trained convolutions once, the classifier's G and C
are summed over all clients' rows, and one eigendecomposition of G gives the
solution and the generalized cross-validation score (fastls.RidgePath) for
every gamma. Accuracies are over the union of the clients' test splits, the
figure's overall accuracy; at the run's gamma (100) they must reproduce its
final accuracy, which checks the whole pipeline. The convolutions keep the
run's weights: this varies the classifier's gamma only.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import fastls
from dev_layout import emit_report, use_shared_data
from fedlayer.models import Model
from fedlayer.run import RunConfig, load_dataset, pooled_data

RUN_GAMMA = 100.0
GAMMAS = [1e-2, 1e-1, 1.0, 10.0, RUN_GAMMA, 1e3, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7]
FORWARD_BATCH = 256  # images per forward step: bounds the full-width activations


def classifier_rows(model, x):
    """The classifier's least-squares rows (its inputs with the bias column), float32."""
    index = model.trainable[-1]
    features = model.forward(x, stop=index, batch_size=FORWARD_BATCH)
    return model.layers[index].ls_rows(features)


def classifier_gamma_table(model, dataset, gammas, stat_dtype=np.float64):
    """Accuracy and GCV of the model's classifier re-solved for each gamma (its other layers kept).

    Returns
    -------
    rows : list of (gamma, test accuracy in %, GCV score), the GCV choice added to ``gammas``
    gcv_gamma : float
    timings : dict, seconds: forward (training images), solve (statistics and eigendecomposition)
    """
    pooled = pooled_data(dataset)
    x_train, y_train, x_test, y_test = pooled.x_train, pooled.y_train, pooled.x_test, pooled.y_test
    start = time.perf_counter()
    A = classifier_rows(model, x_train)
    forward_s = time.perf_counter() - start
    d, n_classes = A.shape[1], dataset.n_classes
    G, C = np.zeros((d, d), dtype=stat_dtype), np.zeros((d, n_classes), dtype=stat_dtype)
    start = time.perf_counter()
    fastls.gram_update(G, A)
    fastls.cross_update(C, A, np.eye(n_classes, dtype=A.dtype)[y_train])
    del A
    n = len(y_train)
    path = fastls.RidgePath.from_statistics(G, C, float(n), n, overwrite_g=True)
    solve_s = time.perf_counter() - start
    A_test = classifier_rows(model, x_test)
    gcv_gamma = path.select("gcv")[0]
    gammas = sorted(set(gammas) | {gcv_gamma})
    rows = []
    for gamma, score in zip(gammas, path.gcv(gammas)):
        W = path.solve(gamma).astype(A_test.dtype)
        accuracy = 100.0 * float((fastls.matmul(A_test, W).argmax(axis=1) == y_test).mean())
        rows.append((gamma, accuracy, float(score)))
    return rows, gcv_gamma, {"forward": forward_s, "solve": solve_s, "rows": (n, len(y_test), d)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model.npz of a finished FedACnnL run")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    use_shared_data()
    config = RunConfig(algorithm="fedacnnl", dataset="cifar10", model="dcnn", width=args.width, dtype="float32",
                       seed=args.seed, cores=[2], conv_targets="position")
    model, _ = Model.load(args.model)
    rows, gcv_gamma, timings = classifier_gamma_table(model, load_dataset(config), GAMMAS)
    n_train, n_test, d = timings["rows"]
    command = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `python experiments/fig6_classifier_gamma.py {command}` ({n_train} training and {n_test} "
             f"test images, classifier d = {d}; forward passes {timings['forward']:.0f} s, statistics and "
             f"eigendecomposition {timings['solve']:.0f} s)", "",
             "| gamma | test accuracy (%) | GCV |", "|---|---|---|"]
    for gamma, accuracy, score in rows:
        mark = " (the run's)" if gamma == RUN_GAMMA else (" (GCV's choice)" if gamma == gcv_gamma else "")
        lines.append(f"| {gamma:.4g}{mark} | {accuracy:.2f} | {score:.6g} |")
    emit_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
