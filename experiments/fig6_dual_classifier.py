"""The paper's DCNN with 'same' padding at full width: its classifier solved in the dual.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_dual_classifier.py \
        --model results/fig6-padding/same-1-pool2/model.npz --width 1 \
        [--reference MODEL] [--work DIR] [--out FILE] [--json FILE]

With 'same' padding the DCNN's classifier reads 8x8x2048 features at full
width: its Gram is 131,073^2 (137 GB in float64), which no 24 GiB machine
holds, so the federated run (``fig6_padding.py --classifier-pool 2``) had to
pool those maps 2x2 first. This script finishes the paper's own model from
that run without the pool:

- Its convolutions are the run's. Layer-wise training never looks forward:
  a convolution's statistics and targets depend on the layers before it and
  on the labels only, so the extra pool changes the classifier alone (the
  script checks that the two 1/16-width runs' convolutions are bit-identical
  when given ``--reference``).
- Its classifier is FedACnnL's, which equals centralized ridge regression on
  the union of the clients' training rows (the weight-invariant property,
  section 3): W = (X^T X + gamma I)^-1 X^T Y. With more features than rows
  (131,073 against about 45,000), the same W is X^T (X X^T + gamma I)^-1 Y,
  whose system is n x n (16 GB in float64). This is an evaluation of the
  paper's model, not a federated protocol: it needs every training row in
  one place. The convolutions' forward passes run once; their outputs go to
  a memory-mapped file under ``--work`` (position-major, so that the n x n
  Gram accumulates from contiguous blocks), removed at the end. This is
  ``fastls.proximal_solve_dual`` with M = 0, out of core: that function
  takes X in memory, here 23.6 GB.

``--reference`` names a run of the unpooled model at a width where it fits
(e.g. results/fig6-padding/same-0.0625/model.npz with the pooled 1/16 run as
``--model``): the script then reports how far its classifier is from that
run's, which checks the whole route against the primal, federated solve.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import fastls
from dev_layout import REPOSITORY, emit_report, use_shared_data
from fig6_classifier_gamma import FORWARD_BATCH, RUN_GAMMA
from fig6_padding import width_label
from fedlayer.models import Model, build_model
from fedlayer.run import RunConfig, load_dataset, pooled_data

FORWARD_IMAGES = 512  # images per forward step: 268 MB of full-width features
GRAM_FEATURES = 4096  # feature rows per Gram update: 1.5 GB once cast to float64 at n = 45,000


def exact_model(pooled_model, width, n_classes):
    """The paper's 'same' DCNN with ``pooled_model``'s convolutions, classifier unset.

    Returns
    -------
    model : Model
        ``build_model('dcnn', padding='same')``, float32; its convolutions' weights are the run's.
    conv_stop : int
        Index of the layer after the last convolution (the Flatten).
    """
    model = build_model("dcnn", pooled_model.input_shape_of(0), n_classes, width=width, dtype=np.float32,
                        padding="same")
    convs, source = model.trainable[:-1], pooled_model.trainable[:-1]
    if len(convs) != len(source):
        raise ValueError(f"{len(source)} trainable layers before the classifier in the run, "
                         f"expected the DCNN's {len(convs)}")
    for index, run_index in zip(convs, source):
        model.layers[index].set_weights(pooled_model.layers[run_index].weights)
    return model, convs[-1] + 1


def write_features(model, conv_stop, x, path):
    """The last convolution's outputs of every image, position-major, in a float32 memmap.

    Returns
    -------
    ndarray (memmap) of shape (positions, channels, N), float32
        ``out[p, c, i]`` is image i's channel c at spatial position p (row-major),
        so the row-major flattening of an image's (side, side, channels) map is
        ``out[:, :, i].ravel()``.
    """
    side, _, channels = model.input_shape_of(conv_stop)
    n = len(x)
    features = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(side * side, channels, n))
    for start in range(0, n, FORWARD_IMAGES):
        block = model.forward(x[start:start + FORWARD_IMAGES], stop=conv_stop, batch_size=FORWARD_BATCH)
        features[:, :, start:start + len(block)] = block.reshape(len(block), side * side, channels).transpose(1, 2, 0)
    features.flush()
    return features


def kernel_matrix(features, bias=True):
    """K = X X^T (upper triangle), float64, with X the rows ``features`` hold and a bias column of ones.

    Parameters
    ----------
    features : ndarray of shape (positions, channels, N), float32

    Returns
    -------
    K : ndarray of shape (N, N), float64; only its upper triangle is set
    """
    positions, channels, n = features.shape
    K = np.zeros((n, n), dtype=np.float64)
    step = max(1, GRAM_FEATURES // channels)
    for start in range(0, positions, step):
        # Products in float64, as the server's dual solve makes them: float32 sums of them put the
        # classifier 1.3e-4 from its exact solution (docs/results/fig6_dual_precision.md). The rows in
        # docs/results/fig6_dual_classifier.md were made before, with float32 products over 8,192 features.
        rows = np.asarray(features[start:start + step], dtype=np.float64).reshape(-1, n)
        fastls.gram_update(K, rows)
    if bias:
        for i in range(n):  # the upper triangle, as gram_update: the lower half's pages stay unallocated
            K[i, i:] += 1.0
    return K


def dual_weights(features, alpha, bias=True):
    """W = X^T alpha: the primal weights, bias last, from the dual coefficients.

    Parameters
    ----------
    features : ndarray of shape (positions, channels, N), float32
    alpha : ndarray of shape (N, m), float64

    Returns
    -------
    W : ndarray of shape (positions * channels + bias, m), float64, rows in the flattening order
    """
    positions, channels, n = features.shape
    W = np.empty((positions * channels + bias, alpha.shape[1]), dtype=np.float64)
    for p in range(positions):
        W[p * channels:(p + 1) * channels] = fastls.matmul(np.asarray(features[p], dtype=np.float64), alpha)
    if bias:
        W[-1] = alpha.sum(axis=0)
    return W


def solve_dual(features, y, n_classes, gamma):
    """FedACnnL's classifier from the features of all training rows, through the n x n dual system.

    Returns
    -------
    W : ndarray of shape (d + 1, n_classes), float64
    train_predictions : ndarray of shape (N,): argmax of X W = K alpha = Y - gamma alpha
    seconds : dict with 'gram', 'solve', 'weights'
    """
    Y = np.eye(n_classes)[y]
    start = time.perf_counter()
    K = kernel_matrix(features)
    gram_s = time.perf_counter() - start
    start = time.perf_counter()
    alpha = fastls.ridge_solve(K, Y, gamma, overwrite_g=True)
    del K
    solve_s = time.perf_counter() - start
    start = time.perf_counter()
    W = dual_weights(features, alpha)
    weights_s = time.perf_counter() - start
    train_predictions = (Y - gamma * alpha).argmax(axis=1)
    return W, train_predictions, {"gram": gram_s, "solve": solve_s, "weights": weights_s}


def classifier_weights(model):
    """The model's classifier (its last trainable layer), float64, bias last."""
    return model.layers[model.trainable[-1]].weights.astype(np.float64)


def same_convolutions(model, other):
    """Whether the two models' trainable layers before the classifier hold identical weights."""
    return all(np.array_equal(model.layers[i].weights, other.layers[j].weights)
               for i, j in zip(model.trainable[:-1], other.trainable[:-1]))


def relative_difference(W, reference):
    """||W - reference|| / ||reference|| (Frobenius)."""
    return float(np.linalg.norm(W - reference) / np.linalg.norm(reference))


def compare_reference(model, W, reference_path):
    """Relative difference of W to a primal run's classifier, and whether the convolutions are the same."""
    reference, _ = Model.load(reference_path)
    W_ref = classifier_weights(reference)
    if W_ref.shape != W.shape:
        raise ValueError(f"reference classifier has shape {W_ref.shape}, expected {W.shape}")
    return {"identical_convolutions": same_convolutions(model, reference),
            "relative_difference": relative_difference(W, W_ref)}


def report(rows):
    """The markdown report of the rows ``main`` measures, one per width."""
    lines = ["# Fig. 6's DCNN with 'same' padding: the classifier solved in the dual", "",
             "Made by `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_dual_classifier.py "
             "--model RUN/model.npz --width W [--reference UNPOOLED/model.npz]`, with RUN the run of "
             "`fig6_padding.py --classifier-pool 2` at that width: the paper's 'same' DCNN with that run's "
             "convolutions and FedACnnL's classifier (gamma 100, on the union of the clients' training splits), "
             "solved as X^T (X X^T + gamma I)^-1 Y; accuracies over the union of the clients' test splits, as in "
             "Fig. 6. The script's docstring says why this is the paper's model. Peak RSS counts the pages of the "
             "features' memory-mapped file while they are mapped (4 n d bytes: 23.6 GB at full width, reclaimable "
             "cache); the memory the process allocates is the n x n float64 system (15.1 GiB at n = 44,963) and one "
             "block of feature rows (1.4 GiB). Discussion: "
             "[fig6_notes.md](fig6_notes.md), \"Padding\".", "",
             "| width | classifier's d | training rows n | test accuracy (%) | training accuracy (%) | forward (s) | "
             "n x n Gram (s) | Cholesky (s) | X^T alpha (s) | test evaluation (s) | wall (s) | peak RSS (GiB) | "
             "against the unpooled federated run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["width"]):
        s = r["seconds"]
        ref = r.get("reference")
        check = ("-" if ref is None else
                 f"convolutions {'identical' if ref['identical_convolutions'] else 'DIFFERENT'}, classifier "
                 f"relative difference {ref['relative_difference']:.1e}")
        lines.append(f"| {width_label(r['width'])} | {r['classifier_inputs']:,} | {r['train_rows']:,} | "
                     f"{100 * r['test_accuracy']:.2f} | {100 * r['train_accuracy']:.2f} | {s['forward_train']:.0f} | "
                     f"{s['gram']:.0f} | {s['solve']:.0f} | {s['weights']:.0f} | {s['test_evaluation']:.0f} | "
                     f"{s['wall']:.0f} | "
                     f"{r['peak_rss_gib']:.2f} | {check} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model.npz of a finished 'same' DCNN run (pooled or not)")
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gamma", type=float, default=RUN_GAMMA)
    parser.add_argument("--reference", default=None, help="model.npz of the unpooled run at the same width")
    parser.add_argument("--work", default=None, help="folder for the features memmap (default: a temporary one "
                                                     "under results/)")
    parser.add_argument("--json", default=str(REPOSITORY / "docs" / "results" / "fig6_dual_classifier.json"),
                        help="rows of measured figures, one per width (this run's replaces its width's)")
    parser.add_argument("--out", default=str(REPOSITORY / "docs" / "results" / "fig6_dual_classifier.md"),
                        help="the markdown report of every row in --json")
    args = parser.parse_args(argv)
    use_shared_data()
    config = RunConfig(algorithm="fedacnnl", dataset="cifar10", model="dcnn", width=args.width, dtype="float32",
                       seed=args.seed, cores=[2], conv_targets="position", padding="same")
    wall = time.perf_counter()
    dataset = load_dataset(config)
    pooled = pooled_data(dataset)
    run_model, _ = Model.load(args.model)
    model, conv_stop = exact_model(run_model, args.width, dataset.n_classes)
    del run_model
    work = Path(args.work) if args.work else REPOSITORY / "results"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work, prefix="fig6-dual-") as folder:
        start = time.perf_counter()
        features = write_features(model, conv_stop, pooled.x_train, Path(folder) / "features.npy")
        forward_s = time.perf_counter() - start
        W, train_predictions, seconds = solve_dual(features, pooled.y_train, dataset.n_classes, args.gamma)
        del features
    model.layers[model.trainable[-1]].set_weights(W)
    start = time.perf_counter()
    correct, total = model.accuracy(pooled.x_test, pooled.y_test, batch_size=FORWARD_BATCH)
    evaluation_s = time.perf_counter() - start
    figures = {
        "width": args.width, "gamma": args.gamma, "classifier_inputs": int(W.shape[0]),
        "train_rows": int(len(pooled.y_train)), "test_rows": int(total),
        "test_accuracy": correct / total,  # fractions, as in fig6_padding.json
        "train_accuracy": float((train_predictions == pooled.y_train).mean()),
        "seconds": {"forward_train": forward_s, **seconds, "test_evaluation": evaluation_s,
                    "wall": time.perf_counter() - wall},
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "model": args.model,
    }
    if args.reference:
        figures["reference"] = {"model": args.reference, **compare_reference(model, W, args.reference)}
    path = Path(args.json)
    rows = [r for r in (json.loads(path.read_text()) if path.exists() else []) if r["width"] != args.width]
    rows.append(figures)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    emit_report(report(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
