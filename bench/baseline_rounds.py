"""One round of a baseline on the batched engine, per setting of the paper, on the real data.

    python bench/baseline_rounds.py pfedzo mnist-dnn mnist-lr synthetic-dnn synthetic-lr [--engine per-client]

Every client of the setting (100, seed 0, default hyperparameters, 2 cores)
trains one local round from the seeded initial parameters; the time of that
round and of one evaluation of every client's model are printed. What
1,000-round budgets cost (docs/table2.md) is read from these.
"""

from __future__ import annotations

import argparse
import sys
import time

from pathlib import Path

from fedlayer.baselines import BASELINES
from fedlayer.run import RunConfig, build, load_dataset, make_clients
from fedlayer.transport import InProcessTransport, overall_accuracy

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).resolve().parents[1] / "experiments")]
from baseline_cases import hyper_of  # noqa: E402
from dev_layout import use_shared_data  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("algorithm", choices=sorted(BASELINES))
    parser.add_argument("settings", nargs="+", help="DATASET-MODEL, e.g. mnist-dnn synthetic-lr")
    parser.add_argument("--engine", choices=["batched", "per-client"], default="batched")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args(argv)
    use_shared_data()
    for setting in args.settings:
        dataset_name, model = setting.split("-")
        config = RunConfig(algorithm=args.algorithm, dataset=dataset_name, model=model, engine=args.engine,
                           cores=[args.cores])
        dataset = load_dataset(config)
        clients = make_clients(config, dataset, build(config, dataset).config())
        hyper = hyper_of(args.algorithm, model, dataset_name)
        w = clients[0].initial_params()["params"]
        start = time.perf_counter()
        for client in clients:
            client.local_train(args.algorithm, w, 0, **hyper)
        trained = time.perf_counter() - start
        start = time.perf_counter()
        overall_accuracy(InProcessTransport(clients))
        print(f"{args.engine} {args.algorithm} {setting}: round {trained:.2f} s, evaluation "
              f"{time.perf_counter() - start:.2f} s ({len(clients)} clients, {clients[0].model.n_params} parameters)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
