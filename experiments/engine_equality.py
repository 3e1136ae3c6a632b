"""The batched engine against the per-client one on MNIST: the parameters after 3 rounds, per baseline and model.

    python experiments/engine_equality.py [--clients 10] [--rounds 3] [--out docs/results/baselines_equality.md]

Each baseline runs ``--rounds`` rounds of the paper's MNIST setting (Dirichlet
beta = 0.1 over ``--clients`` clients, default hyperparameters) on both
engines from the same seed; the table gives the largest relative difference
of the final global parameters, max |batched - per-client| / max |per-client|
(the issue's bound: 1e-10), and each engine's wall time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from fedlayer.baselines import BASELINES
from fedlayer.run import RunConfig, load_dataset, run

from dev_layout import use_shared_data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["lr", "dnn"], choices=["lr", "dnn"])
    parser.add_argument("--algorithms", nargs="+", default=sorted(BASELINES), choices=sorted(BASELINES))
    parser.add_argument("--out", default=None, help="markdown file for the table (default: print only)")
    args = parser.parse_args(argv)
    use_shared_data()
    dataset = load_dataset(RunConfig(dataset="mnist", clients=args.clients))
    lines = [f"| model | algorithm | max rel. difference after {args.rounds} rounds | per-client s | batched s |",
             "|---|---|---|---|---|"]
    for model in args.models:
        for algorithm in args.algorithms:
            params, seconds = {}, {}
            for engine in ("per-client", "batched"):
                config = RunConfig(algorithm=algorithm, dataset="mnist", model=model, clients=args.clients,
                                   rounds=args.rounds, eval_every=args.rounds, engine=engine)
                start = time.perf_counter()
                params[engine] = run(config, dataset=dataset)["params"]
                seconds[engine] = time.perf_counter() - start
            reference = params["per-client"]
            difference = float(np.abs(params["batched"] - reference).max() / np.abs(reference).max())
            lines.append(f"| {model} | {algorithm} | {difference:.1e} | {seconds['per-client']:.1f} | "
                         f"{seconds['batched']:.1f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    command = "python experiments/engine_equality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# Batched vs per-client engine on MNIST\n\nCommand: `{command.strip()}`; {args.clients} clients "
                    f"of the MNIST partition (Dirichlet 0.1), default hyperparameters, seed 0.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
