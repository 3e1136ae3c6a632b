"""Fig. 6's DCNN with 'valid' against 'same' padding, FedACnnL at the widths that fit this machine.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_padding.py \
        [--widths 0.0625 0.125 0.25] [--paddings valid same] [--work results/fig6-padding]

The paper does not give the DCNN's padding. With 'valid' padding (fedlayer's
default) the classifier sees 2 x 2 x 2048 features at full width; with 'same'
it sees 8 x 8 x 2048, a 131073^2 Gram (137 GB in float64) that no 24 GiB
machine holds. This script trains FedACnnL (100 clients, Dirichlet 0.1,
gamma 100, float32 data, 2 cores, codes per output position) both ways at
reduced widths, each cell in its own process so that its peak RSS is its own,
and scores the model on the clients' training splits as well as their test
splits (how far each model is from fitting its training data).

``--classifier-pool P`` is a diagnostic, not the paper's model: an AvgPool(P)
before the classifier, so that the classifier of a 'same' network sees fewer
positions (P = 4: the 2 x 2 of 'valid'). It separates what the wider
classifier brings from what the convolutions' own larger maps bring.

Rows are kept in ``--json`` across invocations (a cell rerun replaces its
row); the markdown table is rebuilt from all of them (``--report`` only
rebuilds it). Discussion:
docs/results/fig6_notes.md ("Padding").
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

from dev_layout import REPOSITORY, emit_report, use_shared_data
from fedlayer.models import DCNN_PADDINGS

FORWARD_BATCH = 256  # images per forward step when scoring


def pool_before_classifier(build, pool):
    """``fedlayer.run.build`` with an AvgPool(pool) inserted before the DCNN's Flatten (a diagnostic model)."""
    from fedlayer.models import model_from_layers

    def build_pooled(config, dataset):
        spec = build(config, dataset).config()
        layers = spec["layers"]
        flatten = next(i for i, layer in enumerate(layers) if layer["type"] == "flatten")
        layers.insert(flatten, {"type": "avgpool2d", "pool_size": pool, "stride": pool})
        return model_from_layers(layers, tuple(spec["input_shape"]), spec["dtype"])

    return build_pooled


def train_cell(width, padding, pool, work):
    """Train one cell in this process; returns its row (accuracies, time, memory, classifier width)."""
    from fedlayer.models import Model
    from fedlayer.run import RunConfig, load_dataset, run

    output = Path(work) / f"{padding}-{width:g}" if pool == 1 else Path(work) / f"{padding}-{width:g}-pool{pool}"
    config = RunConfig(algorithm="fedacnnl", dataset="cifar10", model="dcnn", width=width, padding=padding,
                       dtype="float32", cores=[2], eval_every=100, output=str(output))
    # The pooled model is not the paper's; run() builds its model through this module-level function only.
    run_module = sys.modules["fedlayer.run"]
    build = pool_before_classifier(run_module.build, pool) if pool > 1 else run_module.build
    start = time.perf_counter()
    dataset = load_dataset(config)  # timed, as run() would load it; then reused for the training accuracy
    with mock.patch.object(run_module, "build", build):
        results = run(config, dataset=dataset)
    wall = time.perf_counter() - start
    model, _ = Model.load(output / "model.npz")
    correct = total = 0
    for client in dataset.clients:
        if len(client.y_train):
            c, t = model.accuracy(client.x_train, client.y_train, batch_size=FORWARD_BATCH)
            correct, total = correct + c, total + t
    last = model.trainable[-1]
    accuracy = results["accuracy"]
    return {"width": width, "padding": padding, "classifier_pool": pool,
            "test_accuracy": accuracy[-1] if isinstance(accuracy, list) else accuracy,
            "train_accuracy": correct / total,
            "classifier_d": model.layers[last].ls_shape(model.input_shape_of(last))[0],
            "wall_s": wall, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def width_label(width):
    """A DCNN width as the tables print it: "1" or "1/16"."""
    return "1" if width == 1 else f"1/{1 / width:g}"


def table(rows):
    lines = ["| width | padding | pool before the classifier | classifier's d | test accuracy (%) | "
             "training accuracy (%) | wall (s) | peak RSS (GiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["width"], r["padding"] != "valid", -r.get("classifier_pool", 1))):
        pool = r.get("classifier_pool", 1)
        lines.append(f"| {width_label(r['width'])} | {r['padding']} | {'-' if pool == 1 else f'{pool}x{pool}'} | "
                     f"{r['classifier_d']:,} | "
                     f"{100 * r['test_accuracy']:.2f} | {100 * r['train_accuracy']:.2f} | {r['wall_s']:.0f} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=float, nargs="+", default=[0.0625, 0.125, 0.25])
    parser.add_argument("--paddings", nargs="+", choices=DCNN_PADDINGS, default=list(DCNN_PADDINGS))
    parser.add_argument("--work", default=str(REPOSITORY / "results" / "fig6-padding"),
                        help="run outputs (models, caches)")
    parser.add_argument("--json", default=str(REPOSITORY / "docs" / "results" / "fig6_padding.json"))
    parser.add_argument("--out", default=str(REPOSITORY / "docs" / "results" / "fig6_padding.md"))
    parser.add_argument("--classifier-pool", type=int, nargs="+", default=[1],
                        help="diagnostic: also AvgPool(P) before the classifier (1: the paper's DCNN)")
    parser.add_argument("--report", action="store_true", help="only rebuild the table from --json")
    parser.add_argument("--cell", nargs=3, metavar=("WIDTH", "PADDING", "POOL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    use_shared_data()
    if args.cell:
        print(json.dumps(train_cell(float(args.cell[0]), args.cell[1], int(args.cell[2]), args.work)))
        return 0
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.exists() else []
    cells = [] if args.report else [(w, p, q) for w in args.widths for p in args.paddings
                                    for q in args.classifier_pool]
    for cell in cells:
        child = subprocess.run([sys.executable, __file__, "--work", args.work, "--cell", *map(str, cell)],
                               check=True, stdout=subprocess.PIPE, text=True)
        row = json.loads(child.stdout.strip().splitlines()[-1])
        rows = [r for r in rows if (r["width"], r["padding"], r.get("classifier_pool", 1)) != cell] + [row]
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print(table([row])[-1], flush=True)
    emit_report(["# Fig. 6's DCNN: 'valid' against 'same' padding", "",
                 "Made by `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_padding.py --widths "
                 "W [W ...]`: FedACnnL, 100 clients, Dirichlet 0.1, gamma 100, float32, 2 cores, label codes per "
                 f"output position. Each invocation adds or replaces its cells' rows in {path.name}; the table shows "
                 "them all. Rows with a pool before the classifier (`--classifier-pool P`) are a diagnostic model, "
                 "not the paper's. The paper's 'same' DCNN at full width, which does not fit as a federated run, "
                 "is evaluated with its classifier solved in the dual in "
                 "[fig6_dual_classifier.md](fig6_dual_classifier.md). Discussion: [fig6_notes.md](fig6_notes.md), "
                 "\"Padding\".", ""]
                + table(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
