"""Two checks on Fig. 6's accuracy gap: horizontal flips, and the mean of the clients' own accuracies.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_gap_checks.py flips [--width 0.0625]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_gap_checks.py per-client \
        --model results/fig6-v13/fedacnnl/model.npz [--width 1.0]

``flips`` trains centralized ACnnL (FedACnnL's weights, by the weight-invariant
property) on the clients' training splits, then again with every training
image also present mirrored left to right, and prints both accuracies over
the clients' test splits. The paper states no augmentation; this measures
what one would be worth.

``per-client`` scores a finished run's model on each client's test split
alone and prints the pooled accuracy (Fig. 6's, correct over all test images)
next to the unweighted mean of the clients' accuracies, in case the paper's
"overall test accuracy of all clients" meant the latter.

Results and their reading: docs/results/fig6_notes.md ("The gap that remains").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from dev_layout import emit_report, use_shared_data
from fedlayer.data import ClientData
from fedlayer.models import Model
from fedlayer.run import RunConfig, load_dataset, run

FORWARD_BATCH = 256  # test images per forward step: bounds the full-width activations


def with_flips(dataset):
    """The dataset with every client's training images followed by their left-right mirrors (NHWC)."""
    clients = [ClientData(x_train=np.concatenate([c.x_train, c.x_train[:, :, ::-1, :]]),
                          y_train=np.concatenate([c.y_train, c.y_train]), x_test=c.x_test, y_test=c.y_test)
               for c in dataset.clients]
    return dataclasses.replace(dataset, clients=clients)


def flips(config):
    rows, given = [], load_dataset(config)
    for name, dataset in (("as given", given), ("with mirrored copies", with_flips(given))):
        start = time.perf_counter()
        accuracy = run(config, dataset=dataset)["accuracy"]
        accuracy = accuracy[-1] if isinstance(accuracy, list) else accuracy
        rows.append(f"| {name} | {sum(c.n_train for c in dataset.clients)} | {100 * accuracy:.2f} | "
                    f"{time.perf_counter() - start:.0f} |")
    return ["| training images | rows | test accuracy (%) | seconds |", "|---|---|---|---|"] + rows


def per_client(config, model_path):
    model, _ = Model.load(model_path)
    correct_total, images_total, accuracies = 0, 0, []
    for client in load_dataset(config).clients:
        if len(client.y_test) == 0:
            continue
        correct, total = model.accuracy(client.x_test, client.y_test, batch_size=FORWARD_BATCH)
        correct_total, images_total = correct_total + correct, images_total + total
        accuracies.append(correct / total)
    return ["| accuracy | % |", "|---|---|",
            f"| pooled over the {images_total} test images (Fig. 6) | {100 * correct_total / images_total:.2f} |",
            f"| mean of the {len(accuracies)} clients' own accuracies | {100 * float(np.mean(accuracies)):.2f} |"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["flips", "per-client"])
    parser.add_argument("--model", help="per-client: model.npz of a finished FedACnnL run")
    parser.add_argument("--width", type=float, default=None, help="DCNN width (flips: 0.0625, per-client: 1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    if args.check == "per-client" and not args.model:
        parser.error("per-client needs --model (the model.npz of a finished run)")
    use_shared_data()
    width = args.width if args.width is not None else (0.0625 if args.check == "flips" else 1.0)
    config = RunConfig(algorithm="acnnl" if args.check == "flips" else "fedacnnl", dataset="cifar10",
                       model="dcnn", width=width, dtype="float32", seed=args.seed, cores=[2],
                       conv_targets="position", eval_every=5)
    lines = flips(config) if args.check == "flips" else per_client(config, args.model)
    command = " ".join(argv if argv is not None else sys.argv[1:])
    emit_report([f"Command: `python experiments/fig6_gap_checks.py {command}` (DCNN width {width:g})", ""] + lines,
                args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
