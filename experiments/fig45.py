"""Fig. 4/5: accuracy per round and averaged total training time per client.

    python experiments/fig45.py --dataset mnist [--budget N [ALGORITHM=N ...]] [--out docs/results]

Runs FedACnnL, FedACnnL-WA, FedAvg, FedZO and BAFFLE on the same data,
splits, DNN, client cores and clock. The paper trains the baselines for 20
rounds on MNIST and 600 on Synthetic; ``--budget`` caps the baselines' rounds
when that does not fit here (``N`` for all, ``ALGORITHM=N`` for one), and
their total time is then also given extrapolated to the paper's round count
from the measured per-round time.
Writes fig45_<dataset>.json, .md and two PNGs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

import fastls
from fedlayer.run import RunConfig, load_dataset, run

from dev_layout import use_shared_data

ANALYTIC = ["fedacnnl", "fedacnnl-wa"]
BASELINE = ["fedavg", "fedzo", "baffle"]
PAPER_ROUNDS = {"mnist": 20, "synthetic": 600}
# Section 5.2: FedACnnL's time reduction vs FedAvg / FedZO / BAFFLE (MNIST) and idle reduction vs -WA.
PAPER_CLAIMS = {"mnist": {"fedavg": 83, "fedzo": 98, "baffle": 99, "idle_vs_wa": 52},
                "synthetic": {"fedavg": 97, "fedzo": 97, "baffle": 97, "idle_vs_wa": 40}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(PAPER_ROUNDS), default="mnist")
    parser.add_argument("--budget", nargs="+", default=[],
                        help="cap on the baselines' rounds: N (all) and/or ALGORITHM=N entries")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--algorithms", nargs="+", default=ANALYTIC + BASELINE)
    args = parser.parse_args()
    use_shared_data()  # the checkout's ../shared/data unless FEDLAYER_DATA_DIR says otherwise
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paper_rounds = PAPER_ROUNDS[args.dataset]
    rounds = {algorithm: paper_rounds for algorithm in BASELINE}
    for entry in args.budget:
        name, _, value = entry.rpartition("=")
        if name and name not in BASELINE:
            parser.error(f"--budget {entry}: {name!r} is not one of the baselines {BASELINE}")
        for algorithm in [name] if name else BASELINE:
            rounds[algorithm] = min(paper_rounds, int(value))

    try:
        dataset = load_dataset(RunConfig(dataset=args.dataset, seed=args.seed))
    except FileNotFoundError as err:
        print(f"{args.dataset} not found: {err}", file=sys.stderr)
        return 1
    runs = {}
    for algorithm in args.algorithms:
        budget = rounds.get(algorithm)
        config = RunConfig(algorithm=algorithm, dataset=args.dataset, model="dnn", seed=args.seed, rounds=budget,
                           eval_every=args.eval_every or max(1, (budget or 1) // 50))
        results = run(config, dataset=dataset)
        results.pop("group_weights", None)
        runs[algorithm] = results
        t = results["time_per_client"]
        print(f"{algorithm}: accuracy {results['accuracy']:.4f}, total/client {t['total_s']:.2f} s, "
              f"wall {results['wall_s']:.0f} s", flush=True)
    with open(out / f"fig45_{args.dataset}.json", "w") as f:
        json.dump(runs, f, indent=1)

    def total(algorithm, extrapolate=True):
        results = runs[algorithm]
        scale = paper_rounds / len(results["rounds"]) if algorithm in BASELINE and extrapolate else 1.0
        return {k: v * scale for k, v in results["time_per_client"].items()}

    lines = [
        f"# Fig. 4/5 on {args.dataset}-DNN",
        "",
        f"Command: `python experiments/fig45.py --dataset {args.dataset}"
        + (f" --budget {' '.join(args.budget)}" if args.budget else "") + f" --seed {args.seed}` on "
        f"{platform.machine()}, {fastls.available_cores()} cores (clients run one at a time, each under its own "
        f"core limit of 1-{fastls.available_cores()}), 100 clients, simulated 100 Gbit/s links. Baselines: "
        + ", ".join(f"{a} {rounds[a]}" for a in BASELINE if a in runs)
        + f" rounds (paper: {paper_rounds}); hyperparameters in `fedlayer/baselines/hyper.py`.",
        "",
        "| algorithm | rounds run | final acc (%) | best acc (%) | time/client, measured (s) | compute | idle | comm "
        f"| time/client at {paper_rounds} rounds (s) | per round (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algorithm, results in runs.items():
        t, t_full = total(algorithm, False), total(algorithm)
        n = len(results["rounds"])
        best = results.get("best_accuracy", results["accuracy"])
        lines.append(f"| {algorithm} | {n} | {100 * results['accuracy']:.2f} | {100 * best:.2f} | {t['total_s']:.2f} | "
                     f"{t['compute_s']:.2f} | {t['idle_s']:.2f} | {t['comm_s']:.4f} | {t_full['total_s']:.1f} | "
                     f"{t['total_s'] / n:.3f} |")
    claims = PAPER_CLAIMS[args.dataset]
    lines += ["", "| FedACnnL reduces | measured here | paper |", "|---|---|---|"]
    if "fedacnnl" in runs:
        mine = total("fedacnnl")["total_s"]
        for baseline in BASELINE:
            if baseline in runs:
                lines.append(f"| total time of {baseline} (at {paper_rounds} rounds) | "
                             f"{100 * (1 - mine / total(baseline)['total_s']):.1f}% | {claims[baseline]}% |")
        if "fedacnnl-wa" in runs:
            idle, idle_wa = total("fedacnnl")["idle_s"], total("fedacnnl-wa")["idle_s"]
            lines.append(f"| idle time of fedacnnl-wa | {100 * (1 - idle / idle_wa):.1f}% | {claims['idle_vs_wa']}% |")
    (out / f"fig45_{args.dataset}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plots(runs, out, args.dataset, paper_rounds)
    return 0


def _plots(runs, out, dataset, paper_rounds):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algorithm, results in runs.items():
        points = [(int(k), r["accuracy"]) for k, r in results["rounds"].items() if r["accuracy"] is not None]
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="." if len(points) > 20 else "o",
                label=algorithm)
    ax.set_xscale("log")
    ax.set_xlabel("training round")
    ax.set_ylabel("overall test accuracy (%)")
    ax.set_title(f"{dataset}-DNN, 100 clients")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"fig4_{dataset}_accuracy.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(runs)
    bottom = np.zeros(len(names))
    for part in ("compute_s", "idle_s", "comm_s"):
        values = np.array([runs[a]["time_per_client"][part] for a in names])
        ax.bar(names, values, bottom=bottom, label=part[:-2])
        bottom += values
    ax.set_ylabel("time per client (s)")
    ax.set_title(f"{dataset}-DNN")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"fig5_{dataset}_time.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
