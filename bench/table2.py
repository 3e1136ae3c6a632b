"""The paper's Table 2 protocol for the analytic methods: mean and std over seeds.

    python bench/table2.py [--seeds 5] [--out docs/table2.md]

FedACnnL, pFedACnnL-WC, -WP and pFedACnnL on MNIST-DNN, Synthetic-DNN,
MNIST-LR and Synthetic-LR with the paper's settings (100 clients, Dirichlet
beta = 0.1 for MNIST, power-law Synthetic(0.5, 0.5), gamma = 100, eps = 2500,
K = 10, 75/25 local splits). MNIST rows are skipped (and said so) when the
data files are absent.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np

import fastls
from fedlayer.run import RunConfig, load_dataset, run

ALGORITHMS = ["fedacnnl", "pfedacnnl-wc", "pfedacnnl-wp", "pfedme", "pfedzo", "pfedacnnl"]
SETTINGS = [("mnist", "dnn"), ("synthetic", "dnn"), ("mnist", "lr"), ("synthetic", "lr")]
PAPER = {  # Table 2 of the paper, in ALGORITHMS order
    ("mnist", "dnn"): [90.76, 96.85, 93.66, 96.92, 96.17, 96.23],
    ("synthetic", "dnn"): [86.09, 88.63, 89.22, 88.58, 89.05, 90.00],
    ("mnist", "lr"): [87.11, 96.24, 91.79, 93.22, 93.09, 95.81],
    ("synthetic", "lr"): [81.80, 87.81, 88.33, 83.13, 72.14, 88.96],
}
BASELINES = {"pfedme", "pfedzo"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="docs/table2.md")
    parser.add_argument("--json", default=None, help="also write every run's accuracy here")
    parser.add_argument("--baselines", nargs="*", default=[], choices=["pfedme", "pfedzo"],
                        help="also run these (best accuracy within --baseline-rounds)")
    parser.add_argument("--baseline-rounds", nargs="+", default=["1000"],
                        help="round budget: N for every baseline, or ALGORITHM=N entries")
    parser.add_argument("--baseline-seeds", type=int, default=None, help="seeds for the baselines (default --seeds)")
    parser.add_argument("--merge", default=None,
                        help="a --json file of an earlier run: its accuracies are kept and those runs skipped")
    args = parser.parse_args()

    accuracies = {}
    trends = {}
    notes = []
    baseline_seeds = args.seeds if args.baseline_seeds is None else args.baseline_seeds
    merged_from, merged_keys = None, set()
    if args.merge:
        with open(args.merge) as f:
            for key, values in json.load(f).items():
                accuracies[tuple(key.split("-", 2))] = values
                merged_keys.add(tuple(key.split("-", 2)))
        merged_from = args.merge
    budget = {name: 1000 for name in BASELINES}
    for item in args.baseline_rounds:
        name, _, value = item.rpartition("=")
        for target in ([name] if name else BASELINES):
            budget[target] = int(value)
    start = time.perf_counter()
    for dataset_name in dict.fromkeys(name for name, _ in SETTINGS):
        for seed in range(args.seeds):
            base = RunConfig(dataset=dataset_name, seed=seed)
            try:
                dataset = load_dataset(base)
            except FileNotFoundError as err:
                notes.append(f"{dataset_name}: skipped ({str(err).splitlines()[0]})")
                break
            for model in [m for d, m in SETTINGS if d == dataset_name]:
                for algorithm in ALGORITHMS:
                    if algorithm in BASELINES and (algorithm not in args.baselines or seed >= baseline_seeds):
                        continue
                    if (dataset_name, model, algorithm) in merged_keys:
                        continue
                    rounds = budget[algorithm] if algorithm in BASELINES else None
                    config = RunConfig(algorithm=algorithm, dataset=dataset_name, model=model, seed=seed,
                                       rounds=rounds, eval_every=max(1, (rounds or 1) // 50))
                    results = run(config, dataset=dataset)
                    acc = results.get("best_accuracy", results["accuracy"])
                    if algorithm in BASELINES:
                        curve = [r["accuracy"] for r in results["rounds"].values() if r["accuracy"] is not None]
                        half = len(curve) // 2
                        trends.setdefault((dataset_name, model, algorithm), []).append(
                            (100 * max(curve[:half] or curve), 100 * max(curve), len(results["rounds"])))
                    accuracies.setdefault((dataset_name, model, algorithm), []).append(100 * acc)
                    print(f"{dataset_name}-{model} {algorithm} seed {seed}: {100 * acc:.2f}", flush=True)
            del dataset
    elapsed = time.perf_counter() - start

    header = "| Dataset-Model | " + " | ".join(ALGORITHMS) + " |"
    command = f"python bench/table2.py --seeds {args.seeds}"
    if args.baselines:
        command += (f" --baselines {' '.join(args.baselines)} --baseline-rounds {' '.join(args.baseline_rounds)}"
                    f" --baseline-seeds {baseline_seeds}")
    if merged_from:
        command += f" --merge {merged_from} (the other cells come from that earlier run)"
    lines = [
        "# Table 2 measured here vs the paper",
        "",
        f"Command: `{command}` ({elapsed / 60:.1f} min on "
        f"{platform.machine()}, {fastls.available_cores()} cores, Python {platform.python_version()}, "
        f"NumPy {np.__version__}).",
        "Settings: 100 clients, Dirichlet beta = 0.1 (MNIST), power-law Synthetic(0.5, 0.5), gamma = 100, "
        "eps = 2500, K = 10, local 75/25 train/test splits, overall test accuracy (%), mean (std) over "
        f"seeds 0..{args.seeds - 1}; the paper's number follows in brackets.",
        "",
        header,
        "|---" * (len(ALGORITHMS) + 1) + "|",
    ]
    for dataset_name, model in SETTINGS:
        cells = []
        for algorithm, paper in zip(ALGORITHMS, PAPER[(dataset_name, model)]):
            values = accuracies.get((dataset_name, model, algorithm))
            if values:
                cells.append(f"{np.mean(values):.2f} ({np.std(values):.2f}) [{paper:.2f}]")
            else:
                cells.append(f"not run [{paper:.2f}]")
        lines.append(f"| {dataset_name}-{model} | " + " | ".join(cells) + " |")
    if trends:
        lines += ["", "Baselines report their best accuracy within the round budget. Is the curve still rising? "
                  "Best accuracy in the first half of the budget vs over the whole budget:", "",
                  "| setting | algorithm | rounds | best in first half | best overall |", "|---|---|---|---|---|"]
        for (dataset_name, model, algorithm), values in trends.items():
            first, best, n = np.mean(values, axis=0)
            lines.append(f"| {dataset_name}-{model} | {algorithm} | {int(n)} | {first:.2f} | {best:.2f} |")
    lines += ["", "Gaps over 1 point are investigated in [table2_gaps.md](table2_gaps.md).", *notes]
    report = "\n".join(lines) + "\n"
    print(report)
    with open(args.out, "w") as f:
        f.write(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"-".join(k): v for k, v in accuracies.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
