"""``fedlayer`` command line: run, plot, predict.

    fedlayer run [--config FILE.json] [--algorithm pfedacnnl] [--dataset synthetic] ...
    fedlayer plot RESULTS.json [--out DIR]
    fedlayer predict MODEL.npz --dataset mnist [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .run import ALGORITHMS, RunConfig

__all__ = ["main"]


def _hyper_items(text):
    """``"lr=1e-4,K=5"`` -> ``{"lr": 0.0001, "K": 5}`` (integers stay integers)."""
    items = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            items[key] = int(value)
        except ValueError:
            try:
                items[key] = float(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{key}: expected a number, got {value!r}") from None
    return items


def _run_parser(sub):
    p = sub.add_parser("run", help="train with one of the algorithms")
    p.add_argument("--config", help="JSON file of RunConfig keys; flags given on the command line win")
    defaults = RunConfig()
    for field in dataclasses.fields(RunConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        if field.name == "cores":
            p.add_argument(flag, type=lambda s: [int(c) for c in s.split(",")], default=None,
                           help="comma-separated cores per client, cycled (default: random 1..available per seed)")
        elif field.name == "hyper":
            p.add_argument(flag, type=_hyper_items, default=None, metavar="KEY=VALUE[,KEY=VALUE...]",
                           help="baseline hyperparameter overrides, e.g. lr=1e-4,b2=50 (defaults: "
                                "fedlayer.baselines.BASELINES)")
        elif isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=None, help=f"(default {default})")
        elif field.name == "algorithm":
            p.add_argument(flag, choices=ALGORITHMS, default=None, help=f"(default {default})")
        else:
            kind = type(default) if default is not None else {"int": int, "float": float}.get(
                str(field.type).split("|")[0].strip(), str)
            p.add_argument(flag, type=kind, default=None, help=f"(default {default})")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--mpi-deadline", type=float, default=600.0,
                   help="under mpiexec: longest wait (s) for a rank's next result before aborting (default 600)")
    return p


def _config_from_args(args):
    values = {}
    if args.config:
        with open(args.config) as f:
            values.update(json.load(f))
    for field in dataclasses.fields(RunConfig):
        value = getattr(args, field.name)
        if value is not None:
            values[field.name] = value
    return RunConfig.from_dict(values)


def _summary(results):
    t = results["time_per_client"]
    cfg = results["config"]
    lines = [
        f"{cfg['algorithm']} on {cfg['dataset']}-{cfg['model']}, {results['n_clients']} clients, seed {cfg['seed']}",
        f"{'round':>5} {'stage':<16} {'layer':>5} {'accuracy':>9} {'max compute s':>14} {'max idle s':>11}",
    ]
    for key, record in results["rounds"].items():
        clients = record["clients"].values()
        acc = "" if record["accuracy"] is None else f"{record['accuracy']:.4f}"
        layer = "" if record["layer"] is None else record["layer"] + 1
        lines.append(
            f"{key:>5} {record['stage']:<16} {layer:>5} {acc:>9} "
            f"{max((c['compute_s'] for c in clients), default=0):>14.4f} {max((c['idle_s'] for c in clients), default=0):>11.4f}"
        )
    lines.append(
        f"final accuracy {results['accuracy']:.4f}; averaged total time per client {t['total_s']:.3f} s "
        f"(compute {t['compute_s']:.3f}, idle {t['idle_s']:.3f}, communication {t['comm_s']:.4f}); wall {results['wall_s']:.1f} s"
    )
    return "\n".join(lines)


def cmd_run(args):
    from tqdm import tqdm

    from .models import build_model  # noqa: F401  (import errors surface before data loading)
    from .run import run

    config = _config_from_args(args)
    config.validate()
    from . import mpi

    comm = mpi.world()  # None unless launched by mpiexec with more than one rank
    if comm is not None and comm.Get_rank() > 0:
        return mpi.serve(comm, config)
    transport = None if comm is None else mpi.MPITransport(comm, deadline_s=args.mpi_deadline)
    bar = None if args.quiet else tqdm(desc=f"{config.algorithm}", unit="round", file=sys.stderr)

    def progress(message):
        bar.update(1)
        bar.set_postfix_str(message)

    try:
        results = run(config, transport=transport, progress=None if bar is None else progress)
    except BaseException:
        if transport is not None:
            transport.close(status=1)  # stops the workers (aborts the job if a rank hangs)
        raise
    if transport is not None:
        transport.close()
    if bar is not None:
        bar.close()
    if not args.quiet:
        print(_summary(results))
        if config.output:
            print(f"results and models written to {config.output}/")
    return 0


def cmd_plot(args):
    from .plot import plot_results

    for path in plot_results(args.results, args.out):
        print(path)
    return 0


def cmd_predict(args):
    from .data import load_federated
    from .models import Model

    model, metadata = Model.load(args.model)
    dataset = load_federated(args.dataset, n_clients=args.clients, seed=args.seed, data_dir=args.data_dir,
                             dtype=model.dtype)
    correct = total = 0
    for client in dataset.clients:
        c, n = model.accuracy(client.x_test, client.y_test)
        correct, total = correct + c, total + n
    print(json.dumps({"model": str(args.model), "metadata": metadata, "dataset": args.dataset,
                      "test_samples": int(total), "accuracy": correct / max(total, 1)}, indent=1, default=str))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fedlayer", description="Analytic federated learning: FedACnnL and pFedACnnL")
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    p = sub.add_parser("plot", help="PNG plots of a results.json")
    p.add_argument("results")
    p.add_argument("--out", help="output directory (default: beside the results)")
    p = sub.add_parser("predict", help="accuracy of a saved model on a dataset's local test splits")
    p.add_argument("model")
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    try:
        return {"run": cmd_run, "plot": cmd_plot, "predict": cmd_predict}[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"fedlayer {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
