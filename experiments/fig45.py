"""Fig. 4/5: accuracy per round and averaged total training time per client.

    python experiments/fig45.py --dataset mnist [--seeds 0 1 2] [--budget N [ALGORITHM=N ...]] [--out docs/results]
        [--algorithms ...] [--forward batch|cached] [--tag TAG] [--accuracy-only]

Runs FedACnnL, FedACnnL-WA, FedAvg, FedZO and BAFFLE on the same data,
splits, DNN, client cores and clock. The paper trains the baselines for 20
rounds on MNIST and 600 on Synthetic. Each baseline runs twice: its
accuracy curve over the paper's whole budget on the batched engine (all
clients step together, checkpointed every 10 rounds under
``--checkpoints``), and its time per client on the per-client engine, which
times each client alone; ``--budget`` caps the rounds of that timed run
(``N`` for all, ``ALGORITHM=N`` for one; default 20), whose time per client
is then also given extrapolated to the paper's round count from the
measured per-round time. ``--accuracy-only`` runs just the accuracy runs and
leaves their checkpoints, for a machine shared with other jobs (their
curves do not depend on it, the timings would): the timed run then resumes
them at once.
With several seeds (each draws its own data split, client cores and
initialization) the table gives the mean over seeds with each seed's values,
and the idle-time ratio of FedACnnL to FedACnnL-WA per seed.
The analytic methods forward every batch from the input layer, as the
paper's Algorithm 1 does (``--forward batch``), so that eq. (7)'s batch sizes
act on the forward passes too, as the paper's timings assume; ``--forward
cached`` times the project's default instead. Writes
fig45_<dataset>[_TAG].json, .md and two PNGs.
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


def round_one_bound(adaptive, fixed, over_seeds=None):
    """What round 1 leaves eq. (7) to win: lines for the report.

    ``adaptive``, ``fixed``: per seed, the mean idle seconds per client in
    each round, for FedACnnL and FedACnnL-WA. Round 1 runs B_1 in both, so
    FedACnnL's idle time there stays whatever eq. (7) does later: its share
    of -WA's whole idle time is the lowest ratio FedACnnL / -WA could reach
    even if rounds 2.. had no idle time at all. The ratio over rounds 2..
    alone is then what eq. (7) itself achieves.
    """
    over_seeds = over_seeds or (lambda values, digits=2: f"{np.mean(values):.{digits}f}")
    floor = [a[0] / sum(f) for a, f in zip(adaptive, fixed)]
    later = [sum(a[1:]) / sum(f[1:]) for a, f in zip(adaptive, fixed)]
    return [f"Round 1 alone (B_1 in both algorithms) is {over_seeds(floor)} of FedACnnL-WA's idle time: the "
            "lowest FedACnnL / -WA ratio reachable with no idle time at all after round 1. Over rounds 2 on, "
            f"where eq. (7) acts, FedACnnL / -WA is {over_seeds(later)}."]


def accuracy_run(algorithm, args, seed, dataset, rounds):
    """A baseline's accuracy curve over ``rounds`` on the batched engine: {"engine", "rounds", "accuracy", "curve"}.

    The batched engine gives the per-client engine's parameters (to rounding:
    tests/fedlayer/baselines/test_baseline_engines.py), so this is the timed run's curve,
    continued to the paper's budget. Its checkpoint stays until the seed's
    results are written (a finished one resumes to the same results at once).
    """
    checkpoint = Path(args.checkpoints) / f"fig45-{args.dataset}-{algorithm}-seed{seed}.npz"
    config = RunConfig(algorithm=algorithm, dataset=args.dataset, model="dnn", seed=seed, rounds=rounds,
                       eval_every=args.eval_every or max(1, rounds // 100), engine="batched",
                       checkpoint=str(checkpoint), resume=True, checkpoint_every=10)
    results = run(config, dataset=dataset)
    return {"engine": "batched", "rounds": rounds, "accuracy": results["accuracy"], "checkpoint": str(checkpoint),
            "curve": [list(point) for point in accuracy_curve(results)]}


def final_accuracy(results):
    """The accuracy after the paper's budget: the batched run's for a baseline, else the run's own."""
    return results.get("accuracy_run", results)["accuracy"]


def accuracy_curve(results):
    """(round, accuracy) points: the batched run's over the paper's budget for a baseline."""
    if "accuracy_run" in results:
        return [tuple(point) for point in results["accuracy_run"]["curve"]]
    return [(int(k), r["accuracy"]) for k, r in results["rounds"].items() if r["accuracy"] is not None]


def render(by_seed, args, rounds, paper_rounds):
    """The report's markdown lines from every seed's runs (``rounds``: the baselines' timed rounds)."""
    def total(runs, algorithm, extrapolate=True):
        results = runs[algorithm]
        scale = paper_rounds / len(results["rounds"]) if algorithm in BASELINE and extrapolate else 1.0
        return {k: v * scale for k, v in results["time_per_client"].items()}

    def over_seeds(values, digits=2):
        """Mean, and each seed's value when there are several."""
        mean = float(np.mean(values))
        if len(values) == 1:
            return f"{mean:.{digits}f}"
        return f"{mean:.{digits}f} ({' / '.join(f'{v:.{digits}f}' for v in values)})"

    seeds = list(by_seed)
    algorithms = list(by_seed[seeds[0]])
    seed_text = " ".join(map(str, seeds))
    lines = [
        f"# Fig. 4/5 on {args.dataset}-DNN",
        "",
        f"Command: `python experiments/fig45.py --dataset {args.dataset} --seeds {seed_text}"
        + (f" --budget {' '.join(args.budget)}" if args.budget else "")
        + (f" --algorithms {' '.join(args.algorithms)}" if args.algorithms != ANALYTIC + BASELINE else "")
        + f" --forward {args.forward}" + (f" --tag {args.tag}" if args.tag else "") + f"` on "
        f"{platform.machine()}, {fastls.available_cores()} cores (clients run one at a time, each under its own "
        f"core limit of 1-{fastls.available_cores()}), 100 clients, simulated 100 Gbit/s links."
        + (" Baselines timed over: " + ", ".join(f"{a} {rounds[a]}" for a in BASELINE if a in algorithms)
           + f" rounds (paper: {paper_rounds}); hyperparameters in `fedlayer/baselines/hyper.py`."
           if set(BASELINE) & set(algorithms) else "")
        + (f" Mean over seeds {', '.join(map(str, seeds))}, then each seed's value in brackets." if len(seeds) > 1
           else "")
        + (" Accuracy of the baselines: the batched engine over the paper's budget; their times: the per-client "
           "engine over the rounds run." if set(BASELINE) & set(algorithms) else ""),
        "",
        "| algorithm | rounds timed | final acc (%) | time/client, measured (s) | compute | idle | comm "
        f"| time/client at {paper_rounds} rounds (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for algorithm in algorithms:
        per_seed = [by_seed[s_][algorithm] for s_ in seeds]
        measured = [total(by_seed[s_], algorithm, False) for s_ in seeds]
        full = [total(by_seed[s_], algorithm)["total_s"] for s_ in seeds]
        lines.append(
            f"| {algorithm} | {len(per_seed[0]['rounds'])} | "
            f"{over_seeds([100 * final_accuracy(r) for r in per_seed])} | "
            f"{over_seeds([t['total_s'] for t in measured])} | {over_seeds([t['compute_s'] for t in measured])} | "
            f"{over_seeds([t['idle_s'] for t in measured], 3)} | {over_seeds([t['comm_s'] for t in measured], 4)} | "
            f"{over_seeds(full, 1)} |")
    claims = PAPER_CLAIMS[args.dataset]
    lines += ["", "| FedACnnL reduces | measured here | paper |", "|---|---|---|"]
    if "fedacnnl" in algorithms:
        for baseline in BASELINE:
            if baseline in algorithms:
                cut = [100 * (1 - total(by_seed[s_], "fedacnnl")["total_s"] / total(by_seed[s_], baseline)["total_s"])
                       for s_ in seeds]
                lines.append(f"| total time of {baseline} (at {paper_rounds} rounds) | {over_seeds(cut, 1)}% | "
                             f"{claims[baseline]}% |")
        if "fedacnnl-wa" in algorithms:
            ratio = [total(by_seed[s_], "fedacnnl")["idle_s"] / total(by_seed[s_], "fedacnnl-wa")["idle_s"]
                     for s_ in seeds]
            lines.append(f"| idle time of fedacnnl-wa | {over_seeds([100 * (1 - r) for r in ratio], 1)}% | "
                         f"{claims['idle_vs_wa']}% |")
            lines += ["", f"Idle time of FedACnnL / FedACnnL-WA: {over_seeds(ratio, 2)} "
                          f"(paper: {1 - claims['idle_vs_wa'] / 100:.2f})."]
            if len(seeds) > 1:
                # Fig. 5 compares averaged bars: the ratio of the seeds' mean idle times, which a
                # seed with little idle time in both cannot swing the way it swings a ratio.
                means = [float(np.mean([total(by_seed[s_], a)["idle_s"] for s_ in seeds]))
                         for a in ("fedacnnl", "fedacnnl-wa")]
                lines += ["", f"Ratio of the mean idle times over the {len(seeds)} seeds (Fig. 5's averaged bars): "
                              f"{means[0] / means[1]:.2f}."]
            lines += ["", "Where the idle time goes: mean idle seconds per client in each round (eq. 7 sets the "
                          "batch sizes from round 2 on; round 1 runs B_1 = 64 in both), mean over seeds:", "",
                      "| round | " + " | ".join(["fedacnnl", "fedacnnl-wa", "ratio"]) + " |", "|---|---|---|---|"]
            n_rounds = len(by_seed[seeds[0]]["fedacnnl"]["rounds"])
            per_round = {a: [[float(np.mean([c["idle_s"] for c in by_seed[s_][a]["rounds"][str(k)]["clients"]
                                             .values()])) for k in range(1, n_rounds + 1)] for s_ in seeds]
                         for a in ("fedacnnl", "fedacnnl-wa")}
            for k in range(n_rounds):
                idle = {a: float(np.mean([rounds_[k] for rounds_ in per_round[a]])) for a in per_round}
                lines.append(f"| {k + 1} | {idle['fedacnnl']:.4f} | {idle['fedacnnl-wa']:.4f} | "
                             f"{idle['fedacnnl'] / idle['fedacnnl-wa']:.2f} |")
            lines += ["", *round_one_bound(per_round["fedacnnl"], per_round["fedacnnl-wa"], over_seeds)]
    return lines

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(PAPER_ROUNDS), default="mnist")
    parser.add_argument("--budget", nargs="+", default=["20"],
                        help="cap on the baselines' timed (per-client engine) rounds: N (all) and/or ALGORITHM=N "
                             "entries (default 20); their accuracy runs the paper's budget on the batched engine")
    parser.add_argument("--checkpoints", default="experiments/checkpoints",
                        help="folder of the batched accuracy runs' checkpoints (every 10 rounds), for resuming")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--algorithms", nargs="+", default=ANALYTIC + BASELINE)
    parser.add_argument("--forward", choices=["batch", "cached"], default="batch",
                        help="the analytic methods' forward passes: every batch from the input layer, as in the "
                             "paper's Algorithm 1 (default), or the cached activations of the layer before")
    parser.add_argument("--tag", default="", help="suffix of the output files' names (fig45_DATASET_TAG.md, ...)")
    parser.add_argument("--accuracy-only", action="store_true",
                        help="run only the baselines' batched accuracy runs, checkpointed, and time nothing: on a "
                             "shared machine, so that the later timed run (without this flag) resumes them at once")
    args = parser.parse_args(argv)
    use_shared_data()  # the checkout's ../shared/data unless FEDLAYER_DATA_DIR says otherwise
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.dataset + (f"_{args.tag}" if args.tag else "")
    paper_rounds = PAPER_ROUNDS[args.dataset]
    rounds = {algorithm: paper_rounds for algorithm in BASELINE}
    for entry in args.budget:
        capped, _, value = entry.rpartition("=")
        if capped and capped not in BASELINE:
            parser.error(f"--budget {entry}: {capped!r} is not one of the baselines {BASELINE}")
        for algorithm in [capped] if capped else BASELINE:
            rounds[algorithm] = min(paper_rounds, int(value))

    if args.accuracy_only:
        return accuracy_runs_only(args, paper_rounds)
    by_seed = {}
    for seed in args.seeds:
        try:
            dataset = load_dataset(RunConfig(dataset=args.dataset, seed=seed))
        except FileNotFoundError as err:
            print(f"{args.dataset} not found: {err}", file=sys.stderr)
            return 1
        runs = by_seed[seed] = {}
        for algorithm in args.algorithms:
            budget = rounds.get(algorithm)
            config = RunConfig(algorithm=algorithm, dataset=args.dataset, model="dnn", seed=seed, rounds=budget,
                               eval_every=args.eval_every or max(1, (budget or 1) // 50),
                               forward=args.forward if algorithm in ANALYTIC else "cached",
                               engine="per-client")
            results = run(config, dataset=dataset)
            for in_memory in ("group_weights", "params"):  # arrays: kept out of the JSON
                results.pop(in_memory, None)
            if algorithm in BASELINE:
                results["accuracy_run"] = accuracy_run(algorithm, args, seed, dataset, paper_rounds)
            runs[algorithm] = results
            t = results["time_per_client"]
            print(f"seed {seed} {algorithm}: accuracy {results['accuracy']:.4f}, total/client {t['total_s']:.2f} s, "
                  f"idle {t['idle_s']:.3f} s, wall {results['wall_s']:.0f} s", flush=True)
        finished = [results["accuracy_run"].pop("checkpoint") for results in runs.values() if "accuracy_run" in results]
        with open(out / f"fig45_{name}.json", "w") as f:
            json.dump({str(k): v for k, v in by_seed.items()}, f, indent=1)
        for checkpoint in finished:  # the seed's results are on disk now
            Path(checkpoint).unlink(missing_ok=True)

    lines = render(by_seed, args, rounds, paper_rounds)
    (out / f"fig45_{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plots(by_seed, out, args.dataset, name)
    return 0


def accuracy_runs_only(args, paper_rounds):
    """``--accuracy-only``: every selected baseline's batched accuracy run, left checkpointed for the timed run."""
    for seed in args.seeds:
        dataset = load_dataset(RunConfig(dataset=args.dataset, seed=seed))
        for algorithm in [a for a in args.algorithms if a in BASELINE]:
            result = accuracy_run(algorithm, args, seed, dataset, paper_rounds)
            best = max(accuracy for _, accuracy in result["curve"])
            print(f"seed {seed} {algorithm}: accuracy after {paper_rounds} rounds {100 * result['accuracy']:.2f} "
                  f"(best {100 * best:.2f}), checkpoint {result['checkpoint']}", flush=True)
    return 0


def _plots(by_seed, out, dataset, name):
    """Fig. 4 from the first seed's curves; Fig. 5 as the mean over seeds with each seed's range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = by_seed[next(iter(by_seed))]
    fig, ax = plt.subplots(figsize=(6, 4))
    for algorithm, results in runs.items():
        points = accuracy_curve(results)
        ax.plot([p[0] for p in points], [100 * p[1] for p in points], marker="." if len(points) > 20 else "o",
                label=algorithm)
    ax.set_xscale("log")
    ax.set_xlabel("training round")
    ax.set_ylabel("overall test accuracy (%)")
    ax.set_title(f"{dataset}-DNN, 100 clients (seed {next(iter(by_seed))})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"fig4_{name}_accuracy.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(runs)
    bottom = np.zeros(len(names))
    for part in ("compute_s", "idle_s", "comm_s"):
        values = np.array([[r[a]["time_per_client"][part] for r in by_seed.values()] for a in names])
        mean = values.mean(axis=1)
        ax.bar(names, mean, bottom=bottom, label=part[:-2],
               yerr=[mean - values.min(axis=1), values.max(axis=1) - mean] if values.shape[1] > 1 else None,
               capsize=3)
        bottom += mean
    ax.set_ylabel("time per client (s)")
    ax.set_title(f"{dataset}-DNN")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"fig5_{name}_time.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
