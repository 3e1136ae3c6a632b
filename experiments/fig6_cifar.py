"""Fig. 6: CIFAR-10 with the DCNN for FedACnnL, -WA, pFedACnnL, -WC, -WP.

    python experiments/fig6_cifar.py [--width 0.125] [--out docs/results]

Writes fig6.json, fig6_accuracy.png and fig6.md (accuracy per round and the
averaged total training time per client, next to the paper's numbers). As in
the paper, algorithms without a personalization stage carry their final
accuracy over the rounds the others spend personalizing.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

import fastls
from fedlayer.models import build_model
from fedlayer.run import RunConfig, load_dataset, run

ALGORITHMS = ["fedacnnl", "fedacnnl-wa", "pfedacnnl-wp", "pfedacnnl-wc", "pfedacnnl"]
PAPER = {"fedacnnl": 70.06, "pfedacnnl-wp": 74.03, "pfedacnnl-wc": 72.88, "pfedacnnl": 74.40}


def gram_flops(model, n_train):
    """sum over trainable layers of (rows of its least-squares input) x d^2."""
    total = 0.0
    for index in model.trainable:
        shape = model.input_shape_of(index)
        layer = model.layers[index]
        d, _ = layer.ls_shape(shape)
        positions = int(np.prod(layer.output_shape(shape)[:-1])) if len(shape) == 3 else 1
        total += n_train * positions * d * d
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=0.125)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    base = RunConfig(dataset="cifar10", model="dcnn", width=args.width, dtype="float32", seed=args.seed)
    try:
        dataset = load_dataset(base)
    except FileNotFoundError as err:
        print(f"CIFAR-10 not found, nothing to do: {err}", file=sys.stderr)
        return 1
    n_train = sum(c.n_train for c in dataset.clients)
    runs = {}
    for algorithm in args.algorithms:
        config = RunConfig(algorithm=algorithm, dataset="cifar10", model="dcnn", width=args.width, dtype="float32",
                           seed=args.seed)
        start = time.perf_counter()
        results = run(config, dataset=dataset, progress=lambda msg: print(f"  {algorithm}: {msg}", flush=True))
        results.pop("group_weights")
        runs[algorithm] = results
        print(f"{algorithm}: accuracy {results['accuracy']:.4f}, wall {time.perf_counter() - start:.0f} s", flush=True)
    with open(out / "fig6.json", "w") as f:
        json.dump(runs, f, indent=1)

    # Measured rate -> full-width estimate (the Gram flops dominate).
    model = build_model("dcnn", dataset.feature_shape, dataset.n_classes, width=args.width)
    full = build_model("dcnn", dataset.feature_shape, dataset.n_classes, width=1.0)
    flops_here, flops_full = gram_flops(model, n_train), gram_flops(full, n_train)
    first = next(iter(runs.values()))
    compute_here = sum(sum(c["compute_s"] for c in r["clients"].values())
                       for r in first["rounds"].values() if r["stage"] == "federated")
    rate = flops_here / compute_here

    curves = {}
    for algorithm, results in runs.items():
        accs = [r["accuracy"] for r in results["rounds"].values() if r["accuracy"] is not None]
        curves[algorithm] = accs + [accs[-1]] * (10 - len(accs)) if len(accs) < 10 else accs
    lines = [
        "# Fig. 6: CIFAR-10, DCNN",
        "",
        f"Command: `python experiments/fig6_cifar.py --width {args.width} --seed {args.seed}` on {platform.machine()}, "
        f"{fastls.available_cores()} cores; 100 clients, Dirichlet beta = 0.1, gamma = 100, eps = 2500, K = 10, "
        f"float32 data with float64 statistics. DCNN channel width x{args.width} "
        f"({', '.join(str(model.layers[i].ls_shape(model.input_shape_of(i))) for i in model.trainable)} "
        f"least-squares shapes).",
        "",
        "| algorithm | final accuracy (%) | paper (%) | avg total time per client (s) | compute | idle | comm | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, results in runs.items():
        t = results["time_per_client"]
        paper = PAPER.get(algorithm)
        lines.append(f"| {algorithm} | {100 * results['accuracy']:.2f} | {paper if paper else '-'} | "
                     f"{t['total_s']:.2f} | {t['compute_s']:.2f} | {t['idle_s']:.2f} | {t['comm_s']:.4f} | "
                     f"{results['wall_s']:.0f} |")
    lines += [
        "",
        "Accuracy per round (rounds after the last trained layer repeat the final accuracy for "
        "algorithms without personalization, as in the paper):",
        "",
        "| algorithm | " + " | ".join(str(i + 1) for i in range(max(len(c) for c in curves.values()))) + " |",
        "|---" * (1 + max(len(c) for c in curves.values())) + "|",
    ]
    lines += [f"| {a} | " + " | ".join(f"{100 * v:.1f}" for v in c) + " |" for a, c in curves.items()]
    lines += [
        "",
        f"Full width: the Gram flops grow from {flops_here / 1e12:.2f} to {flops_full / 1e12:.1f} TFLOP. At the "
        f"rate measured here ({rate / 1e9:.0f} GFLOP/s summed over the clients' compute time, "
        f"under their 1-2 core limits) one full-width FedACnnL run needs about {flops_full / rate / 3600:.1f} h of "
        f"client compute on this machine.",
    ]
    (out / "fig6.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algorithm, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), [100 * v for v in curve], marker="o", label=algorithm)
    ax.set_xlabel("round")
    ax.set_ylabel("overall test accuracy (%)")
    ax.set_title(f"CIFAR-10, DCNN width x{args.width}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "fig6_accuracy.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
