"""The paper's Table 2 protocol: mean and std of the test accuracy over seeds.

    python experiments/table2.py [--seeds 5] [--out docs/table2.md]

FedACnnL, pFedACnnL-WC, -WP and pFedACnnL (and, with ``--baselines``, pFedMe
and pFedZO) on MNIST-DNN, Synthetic-DNN, MNIST-LR and Synthetic-LR with the
paper's settings (100 clients, Dirichlet beta = 0.1 for MNIST, power-law
Synthetic(0.5, 0.5), gamma = 100, eps = 2500, K = 10, 75/25 local splits).
MNIST rows are skipped (and said so) when the data files are absent.

The baselines report their best accuracy within a round budget (the paper:
1,000 rounds). ``--baseline-rounds`` takes ``N`` (every baseline),
``ALGORITHM=N`` or ``ALGORITHM:DATASET-MODEL=N``, later entries winning.

Long runs can be split: ``--settings`` and ``--algorithms`` select cells,
``--json`` keeps a run's accuracies, curves and command, ``--merge`` reads
such files back (their cells are not run again), and the markdown names
every run that contributed.

The baselines run on the batched engine (``--engine batched``, the same
parameters as the per-client engine) and write a checkpoint every 10 rounds
under ``--checkpoints``: an interrupted cell goes on from its last
checkpoint when the same command runs again, and its checkpoint is removed
once the cell is in the ``--json`` file; ``--progress`` lists the seeds
finished and the cells in progress without running anything. They are
evaluated every ``--eval-every`` rounds (every ``budget // 50`` of shorter
budgets) and after the last; "best accuracy" is the best of those evaluations.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

import numpy as np

import fastls
from fedlayer.baselines.server import load_baseline_checkpoint
from fedlayer.run import RunConfig, load_dataset, run

from dev_layout import use_shared_data

ALGORITHMS = ["fedacnnl", "pfedacnnl-wc", "pfedacnnl-wp", "pfedme", "pfedzo", "pfedacnnl"]
SETTINGS = ["mnist-dnn", "synthetic-dnn", "mnist-lr", "synthetic-lr"]
PAPER = {  # Table 2 of the paper, in ALGORITHMS order
    "mnist-dnn": [90.76, 96.85, 93.66, 96.92, 96.17, 96.23],
    "synthetic-dnn": [86.09, 88.63, 89.22, 88.58, 89.05, 90.00],
    "mnist-lr": [87.11, 96.24, 91.79, 93.22, 93.09, 95.81],
    "synthetic-lr": [81.80, 87.81, 88.33, 83.13, 72.14, 88.96],
}
BASELINES = ("pfedme", "pfedzo")
PAPER_ROUNDS = 1000


def cell_key(setting, algorithm):
    return f"{setting}-{algorithm}"


def checkpoint_path(folder, setting, algorithm, seed):
    """Where a baseline cell's seed keeps its checkpoint while it runs."""
    return os.path.join(folder, f"{cell_key(setting, algorithm)}-seed{seed}.npz")


def parse_budget(entries):
    """``{(setting, algorithm): rounds}`` for every baseline cell from ``--baseline-rounds`` entries."""
    budget = {(s, a): PAPER_ROUNDS for s in SETTINGS for a in BASELINES}
    for entry in entries:
        target, _, value = entry.rpartition("=")
        algorithm, _, setting = target.partition(":")
        if algorithm and algorithm not in BASELINES:
            raise SystemExit(f"--baseline-rounds {entry!r}: unknown baseline {algorithm!r}; choose from {BASELINES}")
        if setting and setting not in SETTINGS:
            raise SystemExit(f"--baseline-rounds {entry!r}: unknown setting {setting!r}; choose from {SETTINGS}")
        for cell in budget:
            if (not algorithm or cell[1] == algorithm) and (not setting or cell[0] == setting):
                budget[cell] = int(value)
    return budget


def load_runs(paths):
    """Earlier ``--json`` files: their runs (for the provenance list) and cells."""
    runs, cells = [], {}
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        runs += saved["runs"]
        for key, cell in saved["cells"].items():
            if key in cells:
                raise SystemExit(f"{path}: cell {key} is also in an earlier --merge file")
            cells[key] = cell
    return runs, cells


def replace_cells(runs, cells, replacing_runs, replacing_cells):
    """``cells`` with ``replacing_cells`` in place of the same cells, and the runs that made what is left.

    A run of ``runs`` keeps only its cells not replaced, and goes when none is left; ``replacing_runs`` follow.
    """
    cells = {**cells, **replacing_cells}
    kept = [{**run, "cells": [c for c in run["cells"] if c not in replacing_cells]} for run in runs]
    return [run for run in kept if run["cells"]] + replacing_runs, cells


def seeded_datasets(settings, seeds, todo_for):
    """(seed, dataset, todo) per dataset of ``settings`` and seed with work left, loading each split once.

    ``todo_for(settings of the dataset, seed)`` lists what is left; a dataset
    whose files are absent is skipped with a message naming it.
    """
    for dataset_name in dict.fromkeys(s.split("-")[0] for s in settings):
        own = [s for s in settings if s.startswith(dataset_name + "-")]
        for seed in range(seeds):
            todo = todo_for(own, seed)
            if not todo:
                continue
            try:
                dataset = load_dataset(RunConfig(dataset=dataset_name, seed=seed))
            except FileNotFoundError as err:
                print(f"{dataset_name}: skipped ({str(err).splitlines()[0]})", flush=True)
                break
            yield seed, dataset, todo


def run_cells(args, budget, cells, on_cell=None):
    """Run the selected cells (seeds) that ``cells`` lacks, adding them; ``on_cell()`` follows each one."""

    def todo_for(settings, seed):
        todo = [(s, a) for s in settings for a in args.algorithms
                if cell_key(s, a) not in cells or seed >= len(cells[cell_key(s, a)]["accuracy"])]
        return [(s, a) for s, a in todo if a not in BASELINES or seed < args.baseline_seeds]

    for seed, dataset, todo in seeded_datasets(args.settings, args.seeds, todo_for):
        for setting, algorithm in todo:
            model = setting.split("-")[1]
            rounds = budget[(setting, algorithm)] if algorithm in BASELINES else None
            checkpoint = (checkpoint_path(args.checkpoints, setting, algorithm, seed)
                          if algorithm in BASELINES else None)
            config = RunConfig(algorithm=algorithm, dataset=setting.split("-")[0], model=model, seed=seed,
                               rounds=rounds, eval_every=min(args.eval_every, max(1, (rounds or 1) // 50)),
                               cores=args.cores, checkpoint=checkpoint, resume=checkpoint is not None,
                               checkpoint_every=10)
            cell = cells.setdefault(cell_key(setting, algorithm), {"accuracy": [], "curves": [], "minutes": []})
            if cell.get("rounds", rounds) != rounds:  # checked before spending the run
                raise SystemExit(f"{cell_key(setting, algorithm)}: merged seeds ran {cell['rounds']} rounds, "
                                 f"this run's budget is {rounds}")
            start = time.perf_counter()
            results = run(config, dataset=dataset)
            cell["accuracy"].append(100 * results.get("best_accuracy", results["accuracy"]))
            walls = [record.get("wall_s") for record in results["rounds"].values()]
            # A resumed cell's wall time is this run's share only: its rounds' own wall times add up the whole.
            minutes = (sum(walls) if walls and None not in walls else time.perf_counter() - start) / 60
            cell["minutes"].append(minutes)
            if algorithm in BASELINES:
                cell["rounds"] = rounds
                cell["curves"].append([[int(r), 100 * rec["accuracy"]] for r, rec in results["rounds"].items()
                                       if rec["accuracy"] is not None])
            print(f"{setting} {algorithm} seed {seed}: {cell['accuracy'][-1]:.2f} "
                  f"({cell['minutes'][-1]:.1f} min)", flush=True)
            if on_cell:
                on_cell()
            if checkpoint is not None and args.json and os.path.exists(checkpoint):
                os.remove(checkpoint)  # the cell is in the JSON file now (without one, the checkpoint keeps it)
        del dataset


def progress(cells, seeds, checkpoints):
    """Lines of markdown: each baseline cell's seeds so far, then the cells in progress in ``checkpoints``.

    A complete cell (``seeds`` seeds) adds its mean and std over seeds
    (``np.std``, ddof = 0, "-" for one seed, as the table); minutes are the cell's wall time.
    """
    lines = []
    for key, cell in cells.items():
        if "rounds" not in cell:  # an analytic method: no round budget, nothing in progress
            continue
        accuracy = cell["accuracy"]
        done = f"{len(accuracy)} of {seeds} seeds"
        if len(accuracy) >= seeds:
            done += f"; mean {np.mean(accuracy):.2f} (std {spread(accuracy)})"
        lines.append(f"- {key}: {', '.join(f'{a:.2f}' for a in accuracy)} "
                     f"({done}; {sum(cell['minutes']):.0f} min in all)")
    # Only the names run_cells gives its checkpoints: other scripts (fig45.py) share the folder.
    paths = [checkpoint_path(checkpoints, setting, algorithm, seed)
             for setting in SETTINGS for algorithm in BASELINES for seed in range(seeds)]
    for path in filter(os.path.exists, paths):
        state = load_baseline_checkpoint(path, None)
        best = state["best_accuracy"]
        lines.append(f"- in progress: `{os.path.basename(path)}`, {len(state['rounds'])} rounds done, best so far "
                     + ("none yet" if best is None else f"{100 * best:.2f}"))
    return lines


def curve_trend(curves):
    """Mean over seeds of the best accuracy in the first half of the budget and over all of it."""
    first, best = [], []
    for curve in curves:
        rounds, acc = np.array(curve).T
        half = rounds <= rounds.max() / 2
        first.append(acc[half].max() if half.any() else acc[0])
        best.append(acc.max())
    return float(np.mean(first)), float(np.mean(best))


def spread(values):
    """The std over seeds (ddof = 0) as the table prints it; "-" for one seed, whose std says nothing."""
    return f"{np.std(values):.2f}" if len(values) > 1 else "-"


def render(runs, cells, seeds, command):
    lines = [
        "# Table 2 measured here vs the paper",
        "",
        "Settings: 100 clients, Dirichlet beta = 0.1 (MNIST), power-law Synthetic(0.5, 0.5), gamma = 100, "
        "eps = 2500, K = 10, local 75/25 train/test splits, overall test accuracy (%), mean (std) over "
        f"seeds 0..{seeds - 1}; the paper's number follows in brackets. pFedMe and pFedZO report their best "
        "accuracy within the round budget given below (the paper's is 1,000 rounds).",
        "",
        "| Dataset-Model | " + " | ".join(ALGORITHMS) + " |",
        "|---" * (len(ALGORITHMS) + 1) + "|",
    ]
    for setting in SETTINGS:
        row = []
        for algorithm, paper in zip(ALGORITHMS, PAPER[setting]):
            cell = cells.get(cell_key(setting, algorithm))
            if cell and cell["accuracy"]:
                values = cell["accuracy"]
                budget = f", {cell['rounds']} rounds" if algorithm in BASELINES else ""
                seeds_note = f", {len(values)} seed{'s' * (len(values) > 1)}" if len(values) != seeds else ""
                row.append(f"{np.mean(values):.2f} ({spread(values)}{budget}{seeds_note}) [{paper:.2f}]")
            else:
                row.append(f"not run [{paper:.2f}]")
        lines.append(f"| {setting} | " + " | ".join(row) + " |")
    trend_rows = []
    for setting in SETTINGS:
        for algorithm in BASELINES:
            cell = cells.get(cell_key(setting, algorithm))
            if cell and cell["curves"]:
                first, best = curve_trend(cell["curves"])
                per_round = 60 * np.mean(cell["minutes"]) / cell["rounds"]
                state = "rising" if best - first > 0.5 else "flat"
                ours = cells.get(cell_key(setting, "pfedacnnl"), {"accuracy": []})["accuracy"]
                paired = np.subtract(ours[:len(cell["accuracy"])], cell["accuracy"][:len(ours)])
                margin = f"{paired.mean():+.2f} ({spread(paired)})" if paired.size else "-"
                trend_rows.append(f"| {setting} | {algorithm} | {cell['rounds']} | {per_round:.1f} | "
                                  f"{first:.2f} | {best:.2f} | {state} | {margin} |")
    if trend_rows:
        lines += ["", "Round budgets of the baselines and whether their curves were still rising: best accuracy "
                  "(mean over seeds) within the first half of the budget and within all of it; \"rising\" when "
                  "the second half gained more than 0.5 points. Seconds per round include the evaluations "
                  "(wall time of the run that measured them). The last column is pFedACnnL minus the baseline "
                  "on the same seeds, i.e. the same generated data and partitions: mean (std).", "",
                  "| setting | algorithm | rounds | s / round | best in first half | best overall | curve "
                  "| pFedACnnL - baseline, paired |",
                  "|---|---|---|---|---|---|---|---|", *trend_rows]
    lines += ["", "Runs that produced these cells (machine: "
              f"{platform.machine()}, {fastls.available_cores()} cores, Python {platform.python_version()}, "
              f"NumPy {np.__version__}):", ""]
    for entry in runs:
        lines.append(f"- `{entry['command']}`: {entry['minutes']:.1f} min ({', '.join(entry['cells'])})")
    lines += ["", f"This file: `{command}`.",
              "", "Gaps over 1 point are investigated in [table2_gaps.md](table2_gaps.md)."]
    return "\n".join(lines) + "\n"


def plot_curves(cells, path):
    """One panel per setting: the baselines' mean accuracy per round, the analytic methods' final accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, setting in zip(axes.flat, SETTINGS):
        for algorithm in ALGORITHMS:
            cell = cells.get(cell_key(setting, algorithm))
            if not cell or not cell["accuracy"]:
                continue
            if algorithm in BASELINES:
                curves = [np.array(c) for c in cell["curves"]]
                length = min(len(c) for c in curves)  # seeds of one cell share the budget
                mean = np.mean([c[:length, 1] for c in curves], axis=0)
                ax.plot(curves[0][:length, 0], mean, marker="o" if length < 10 else None, label=algorithm)
            else:
                ax.axhline(np.mean(cell["accuracy"]), linestyle="--", linewidth=1, label=algorithm,
                           color=f"C{2 + ALGORITHMS.index(algorithm)}")
        ax.set_title(setting)
        ax.set_xlabel("training round (baselines)")
        ax.set_ylabel("overall test accuracy (%)")
        ax.grid(alpha=0.3)
    legend = {}
    for ax in axes.flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(ALGORITHMS), fontsize="small")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default="docs/table2.md")
    parser.add_argument("--json", default=None,
                        help="write this run's cells (and merged ones) here; cells already in the file are kept "
                             "and not run again, so the same command continues an interrupted run")
    parser.add_argument("--plot", default=None, help="PNG of the baselines' curves against the analytic results")
    parser.add_argument("--settings", nargs="+", default=SETTINGS, choices=SETTINGS)
    parser.add_argument("--algorithms", nargs="+", default=[a for a in ALGORITHMS if a not in BASELINES],
                        choices=ALGORITHMS, help="default: the analytic methods only")
    parser.add_argument("--baselines", nargs="*", default=[], choices=BASELINES,
                        help="shorthand for adding these to --algorithms")
    parser.add_argument("--baseline-rounds", nargs="+", default=[],
                        help="round budget: N, ALGORITHM=N or ALGORITHM:DATASET-MODEL=N (default 1000)")
    parser.add_argument("--baseline-seeds", type=int, default=None, help="seeds for the baselines (default --seeds)")
    parser.add_argument("--cores", type=int, nargs="+", default=None,
                        help="per-client cores (default: the protocol's random 1..available); accuracy does "
                             "not depend on it, so parallel jobs may pin 1")
    parser.add_argument("--merge", nargs="+", default=[], help="--json files of earlier runs; their cells are kept")
    parser.add_argument("--replace", nargs="+", default=[],
                        help="--json files whose cells replace the same cells of --merge (e.g. the baselines at "
                             "1,000 rounds in place of shorter budgets); the replaced cells' runs leave the list")
    parser.add_argument("--checkpoints", default="experiments/checkpoints",
                        help="folder of the baselines' checkpoints (every 10 rounds), to resume interrupted cells")
    parser.add_argument("--eval-every", type=_positive, default=10,
                        help="baselines: evaluate at most every N rounds (every round of budgets under 100) "
                             "and the last")
    parser.add_argument("--progress", action="store_true",
                        help="print the baselines' seeds so far (from --json and --merge) and the cells in "
                             "progress (from --checkpoints), run nothing")
    args = parser.parse_args(argv)
    use_shared_data()  # the checkout's ../shared/data unless FEDLAYER_DATA_DIR says otherwise
    args.algorithms = list(dict.fromkeys(args.algorithms + args.baselines))
    args.baseline_seeds = args.seeds if args.baseline_seeds is None else args.baseline_seeds
    budget = parse_budget(args.baseline_rounds)

    # Running the same command again continues it: the cells its --json file already holds are kept, not rerun.
    own = [args.json] if args.json and os.path.exists(args.json) else []
    if own and any(os.path.samefile(own[0], path) for path in args.merge):
        own = []
    runs, cells = load_runs(args.merge + own)
    if args.replace:
        runs, cells = replace_cells(runs, cells, *load_runs(args.replace))
    if args.progress:
        print("\n".join(progress(cells, args.baseline_seeds, args.checkpoints)))
        return 0
    lengths = {key: len(cell["accuracy"]) for key, cell in cells.items()}
    given = sys.argv[1:] if argv is None else argv
    command = "python experiments/table2.py " + " ".join(shlex.quote(a) for a in given)
    this_run = {"command": command, "minutes": 0.0, "cells": []}
    start = time.perf_counter()

    def save():
        """Write the JSON (after every cell, so an interrupted run keeps what it measured); returns all runs."""
        this_run["minutes"] = (time.perf_counter() - start) / 60
        this_run["cells"] = [k for k in cells if len(cells[k]["accuracy"]) != lengths.get(k, 0)]
        all_runs = runs + ([this_run] if this_run["cells"] else [])
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump({"runs": all_runs, "cells": cells}, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
        return all_runs

    run_cells(args, budget, cells, on_cell=save)
    report = render(save(), cells, args.seeds, command)
    print(report)
    with open(args.out, "w") as f:
        f.write(report)
    if args.plot:
        plot_curves(cells, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
