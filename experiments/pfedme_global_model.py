"""pFedMe or pFedZO: the personalized models' accuracy (Table 2's) beside the global model's, every 10 rounds.

    python experiments/pfedme_global_model.py [--algorithm pfedme] [--setting mnist-dnn] [--seed 0] [--rounds 1000]

Table 2 scores each client's personalized theta on its own test split, as
pFedMe's reference does; the paper does not say which model it scored. This
runs the same trajectory as ``table2.py``'s cell (same data, seed and
hyperparameters, the batched engine) ten rounds at a time and scores the
global w after each ten as well. Prints one line per ten rounds.
"""

from __future__ import annotations

import argparse
import time

from dev_layout import use_shared_data

from fedlayer.baselines import baseline_hyper, run_baseline
from fedlayer.run import RunConfig, build, load_dataset, make_clients
from fedlayer.transport import InProcessTransport, overall_accuracy

EVERY = 10


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=["pfedme", "pfedzo"], default="pfedme")
    parser.add_argument("--setting", default="mnist-dnn", help="DATASET-MODEL, as in table2.py")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1000)
    args = parser.parse_args(argv)
    use_shared_data()
    dataset_name, model = args.setting.split("-")
    config = RunConfig(algorithm=args.algorithm, dataset=dataset_name, model=model, seed=args.seed)
    dataset = load_dataset(config)
    transport = InProcessTransport(make_clients(config, dataset, build(config, dataset).config()))
    hyper = {k: v for k, v in baseline_hyper(args.algorithm, dataset_name, model).items() if k != "rounds"}
    state, start = None, time.perf_counter()
    for stop in range(EVERY, args.rounds + 1, EVERY):
        # Resuming from the last state repeats the uninterrupted run round for round (the clients' draws are
        # keyed by the round's index), so this is table2.py's trajectory.
        out = run_baseline(transport, args.algorithm, stop, eval_every=EVERY, resume=state, **hyper)
        state = {"params": out["params"], "rounds": out["rounds"], "best_accuracy": out["best_accuracy"]}
        global_accuracy = overall_accuracy(transport, {cid: {"params": out["params"]} for cid in transport.client_ids})
        print(f"round {stop}: personalized {100 * out['accuracy']:.2f} global {100 * global_accuracy:.2f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
