"""``fedlayer`` command line: run, plot, predict.

    fedlayer run [--config FILE.json] [--algorithm pfedacnnl] [--dataset synthetic] ...
    fedlayer plot RESULTS.json [--out DIR]
    fedlayer predict MODEL.npz|DIR [--data-dir DIR]

Bad input ends with exit status 2 and one line naming the flag, file or value
that was wrong, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ._validation import Constraints, Interval, Options, parse_text
from .algorithms import ALGORITHMS
from .run import CONFIG_CONSTRAINTS, RunConfig

__all__ = ["flag_type", "main"]

_MPI_DEADLINE = [Interval(float, 0, None, closed="neither")]


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


def flag_type(constraints: Constraints, metavar: str) -> Callable[[str], Any]:
    """An argparse ``type`` parsing a flag's text under ``constraints``, as ``fedlayer run`` parses its flags.

    Parameters
    ----------
    constraints : list
        What the value may be, e.g. ``CONFIG_CONSTRAINTS["eps_output"]`` for a RunConfig field.
    metavar : str
        The value's name in argparse's messages.

    Returns
    -------
    callable
        ``str -> value``; raises ``argparse.ArgumentTypeError`` naming what was expected, and argparse
        names the flag.
    """

    def parse(text: str) -> Any:
        try:
            return parse_text(text, constraints)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = metavar  # argparse's fallback message names the type
    return parse


def _run_parser(sub):
    p = sub.add_parser("run", help="train with one of the algorithms",
                       epilog="algorithms: " + "; ".join(f"{a.name}: {a.summary}" for a in ALGORITHMS.values()))
    p.add_argument("--config", help="JSON file of RunConfig keys; flags given on the command line win")
    defaults = RunConfig()
    for field in dataclasses.fields(RunConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        constraints = CONFIG_CONSTRAINTS[field.name]
        # Choices only for flags that are nothing but a list of options (gamma is a number or "auto").
        options = constraints[0].values if len(constraints) == 1 and isinstance(constraints[0], Options) else None
        if field.name == "cores":
            p.add_argument(flag, type=flag_type(constraints, "cores"), default=None, metavar="N[,N...]",
                           help="comma-separated cores per client, cycled, each at most the cores this process "
                                "may run on (default: random 1..available per seed)")
        elif field.name == "hyper":
            p.add_argument(flag, type=_hyper_items, default=None, metavar="KEY=VALUE[,KEY=VALUE...]",
                           help="baseline hyperparameter overrides, e.g. lr=1e-4,b2=50 (defaults: "
                                "fedlayer.baselines.BASELINES)")
        elif isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=None, help=f"(default {default})")
        elif options is not None:
            p.add_argument(flag, choices=options, default=None, help=f"one of %(choices)s (default {default})")
        else:
            accepted = " or ".join(str(c) for c in constraints if c is not None)
            p.add_argument(flag, type=flag_type(constraints, field.name), default=None,
                           help=f"{accepted} (default {default})")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--mpi-deadline", type=flag_type(_MPI_DEADLINE, "seconds"), default=600.0,
                   help="under mpiexec: longest wait (s) for a rank's next result before aborting (default 600)")
    return p


def _read_config_file(path):
    """The dict in JSON file ``path``; errors name the file (and the line of a syntax error)."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise ValueError(f"config {path}: cannot read it ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"config {path}: not valid JSON ({err})") from None


def _config_from_args(args):
    values = _read_config_file(args.config) if args.config else {}
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig) if getattr(args, f.name) is not None}
    if isinstance(values, dict):  # anything else is refused by from_dict, naming the file
        values = {**values, **flags}
    return RunConfig.from_dict(values, f"config {args.config}: " if args.config else "")


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
            f"{max((c['compute_s'] for c in clients), default=0):>14.4f} "
            f"{max((c['idle_s'] for c in clients), default=0):>11.4f}"
        )
    layers = {r["layer"] for r in results["rounds"].values() if r["stage"] == "federated"}
    if any(r.get("accuracy_of") == "codes" for r in results["rounds"].values()):
        lines.append("(the hidden layers' rounds score each layer's label codes, --round-accuracy codes: the class "
                     "whose code is nearest the layer's output; the others score the network)")
    elif len(layers) > 1:
        lines.append(
            f"(accuracy stays near chance, 1/{results['n_classes']}, until the last layer is trained: hidden "
            "layers are fitted to encoded labels, and the output layer keeps its random initial weights until "
            "its own round; --round-accuracy codes scores each hidden layer by its label codes instead)")
    if cfg.get("resume"):
        unit = "round" if "resumed_from_round" in results else "layer"
        resumed = results.get(f"resumed_from_{unit}")
        personalized = results.get("resumed_personalized")
        also = f" and {personalized} personalized layer(s), read back by their clients" if personalized else ""
        lines.append(f"(resumed from the checkpoint after {unit} {resumed}{also})" if resumed is not None else
                     f"(--resume found no checkpoint at {RunConfig.from_dict(cfg).checkpoint_path()}, so "
                     f"the run started from its first {unit})")
    if results.get("engine") == "batched":
        lines.append("(batched engine: each client's compute time is its process's wall time shared evenly, not "
                     "measured per client; --engine per-client times each client)")
    lines.extend(_regularization_lines(results["rounds"]))
    lines.append(
        f"final accuracy {results['accuracy']:.4f}; averaged total training time per client {t['total_s']:.3f} s "
        f"(compute {t['compute_s']:.3f}, idle {t['idle_s']:.3f}, simulated communication {t['comm_s']:.4f}); "
        f"wall clock of the whole run, data loading included, {results['wall_s']:.1f} s"
    )
    return "\n".join(lines)


def _regularization_lines(rounds):
    """The gamma the server chose per layer (and group), and the spread of the eps clients chose."""
    lines = []
    for record in rounds.values():
        layer = "" if record["layer"] is None else record["layer"] + 1
        if "selection" in record:
            chosen = {k: v["gamma"] for k, v in record["selection"].items()}
            text = (f"{next(iter(chosen.values())):.4g}" if len(chosen) == 1
                    else ", ".join(f"group {k}: {g:.4g}" for k, g in sorted(chosen.items(), key=lambda kv: int(kv[0]))))
            lines.append(f"layer {layer}: gamma chosen by GCV {text}")
        eps = [c["eps"] for c in record["clients"].values() if "eps" in c]
        if eps:
            low, median, high = np.percentile(eps, [0, 50, 100])
            criteria = sorted({c["criterion"] for c in record["clients"].values() if "criterion" in c})
            lines.append(f"layer {layer}: eps chosen by {'/'.join(criteria)} over {len(eps)} clients: "
                         f"min {low:.4g}, median {median:.4g}, max {high:.4g}")
    return lines


class _ProgressBar:
    """tqdm bar drawn once the run announces its number of rounds (so it shows an ETA).

    Not before: a run refused while it loads its data prints its one error
    line without an empty bar in front of it.
    """

    def __init__(self, description):
        self.description, self.bar = description, None

    def start(self, total):
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(desc=self.description, unit="round", file=sys.stderr, total=total)
        else:
            self.bar.reset(total=total)

    def __call__(self, message):
        if self.bar is None:
            self.start(None)
        self.bar.update(1)
        self.bar.set_postfix_str(message)

    def within_round(self, done, total):
        """The clients of the running round done so far (the server calls it as each one delivers)."""
        self.status(f"{done}/{total} clients done")

    def status(self, what):
        """What the server does in the running round between the clients' deliveries and its end."""
        if self.bar is None:
            self.start(None)
        self.bar.set_postfix_str(f"round {self.bar.n + 1}: {what}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def cmd_run(args: argparse.Namespace, mpi_hooks: object | None = None) -> int:
    import fastls

    from .models import build_model  # noqa: F401  (import errors surface before data loading)
    from .run import run

    from . import mpi

    comm = mpi.world()  # None unless launched by mpiexec with more than one rank
    try:
        config = _config_from_args(args)
    except ValueError:
        if comm is not None and comm.Get_rank() > 0:
            return 2  # every rank read the same flags: rank 0 alone says what was wrong
        raise
    if not args.quiet and (comm is None or comm.Get_rank() == 0):
        # Options a sweep sets for every algorithm are not errors; a silent no-op would still mislead.
        for note in ALGORITHMS[config.algorithm].ignored_options(config):
            print(f"fedlayer run: note: {note}", file=sys.stderr)
    share = None
    if comm is not None:
        mpi.watch_ranks(comm)
        share, on_node = mpi.rank_cores(comm)  # every rank, at the same point: a collective call
    if comm is not None and comm.Get_rank() > 0:
        from .run import rank_clients

        bad_input = False
        try:
            clients = rank_clients(config, comm.Get_rank(), comm.Get_size(), max_cores=share)
        except Exception as err:
            mpi.report_startup_failure(comm, err)  # rank 0 prints it and stops the job
            clients, bad_input = None, isinstance(err, (ValueError, OSError))
        try:
            status = mpi.serve(comm, clients, hooks=mpi_hooks)
            return 2 if bad_input and status else status  # the job's status is that of bad input, as on rank 0
        finally:
            mpi.rank_finished(comm)  # in order, or with its own traceback: not a rank that died
    transport = None if comm is None else mpi.MPITransport(comm, deadline_s=args.mpi_deadline, hooks=mpi_hooks)
    if transport is not None:
        transport.machine = {"mpi": {"ranks": comm.Get_size(), "ranks_on_node": on_node, "cores_per_rank": share}}
    bar = None if args.quiet else _ProgressBar(config.algorithm)
    try:
        # Rank 0's own work (solves, evaluation) within its share of the node too.
        with contextlib.nullcontext() if share is None else fastls.limit_cores(share):
            results = run(config, transport=transport, progress=bar)
    except BaseException as err:
        if transport is not None:
            # Stops the workers (aborts the job if a rank hangs). They exit with rank 0's own status: mpiexec
            # ORs the ranks' statuses, so bad input (2 here) with workers at 1 came out as 3.
            transport.close(status=2 if isinstance(err, (ValueError, OSError)) else 1)
        if isinstance(err, KeyboardInterrupt):
            if bar is not None:
                bar.close()
            print(f"fedlayer run: interrupted; {_resume_hint(config)}", file=sys.stderr)
            return 130
        raise
    finally:
        if bar is not None:
            bar.close()
    if transport is not None:
        transport.close()
        mpi.rank_finished(comm)
    if not args.quiet:
        print(_summary(results))
        if config.output:
            print(f"results and models written to {config.output}/ (plots: fedlayer plot "
                  f"{Path(config.output) / 'results.json'})")
        elif config.checkpoint and Path(config.checkpoint).exists():
            print(f"only the checkpoint {config.checkpoint} was written: add --output DIR to keep results.json and "
                  "the trained models")
        else:
            print("nothing was written to disk: add --output DIR to keep results.json and the trained models")
    return 0


def _resume_hint(config):
    """What an interrupted run left to go on from."""
    from .algorithms import ALGORITHMS, BaselineAlgorithm
    from .checkpoint import Checkpointing

    checkpoint = config.checkpoint_path()
    baseline = isinstance(ALGORITHMS[config.algorithm], BaselineAlgorithm)
    if checkpoint is not None and checkpoint.exists():
        folder = Checkpointing(checkpoint).personal_folder
        kept = (f" (and the layers personalized so far, each client's under {folder})"
                if getattr(ALGORITHMS[config.algorithm], "personalized", False) else "")
        return (f"the {'rounds' if baseline else 'layers'} trained so far are in {checkpoint}{kept}: run the same "
                "command with --resume to go on")
    if checkpoint is not None:
        return (f"no checkpoint had been written yet (every {config.checkpoint_every} rounds)" if baseline
                else f"no layer had finished, so {checkpoint} was not written yet")
    return "no checkpoint was kept (give --output or --checkpoint to be able to --resume)"


def cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_results

    for path in plot_results(args.results, args.out):
        print(path)
    return 0


def _load_models(path):
    """[(file, Model, metadata)] of a model file, or of every ``*.npz`` model in a directory."""
    from .models import Model

    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.npz") if p.name != "checkpoint.npz")
        if not files:
            raise ValueError(f"{path} holds no model files (*.npz)")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"{path}: no such model file or directory")
    # Model.load names a damaged or foreign file itself (ValueError); an unreadable one stays an OSError.
    models = [(file, *Model.load(file)) for file in files]
    for file, model, _ in models:  # a model file may hold untrained layers (Model.save allows it); scoring may not
        missing = [i for i in model.trainable if model.layers[i].weights is None]
        if missing:
            raise ValueError(f"{file}: no weights stored for layer(s) {missing} of its model (a damaged file, or "
                             f"one saved before those layers were trained)")
        broken = [i for i in model.trainable if not np.isfinite(model.layers[i].weights).all()]
        if broken:
            raise ValueError(f"{file}: the weights of layer(s) {broken} hold NaN or Inf (a damaged file, or a model "
                             f"saved from a run that diverged)")
    return models


def _predict_split(models, args):
    """The split the models are scored on: the one saved with them.

    ``--dataset``/``--clients``/``--seed`` only name the split of model files
    that record none. Another split of a saved one would score training
    images: every split pools a dataset's images and deals them out again,
    so another seed or client count puts images this model was fitted on
    into the test sets (and on Synthetic another seed draws another task).
    """
    saved = [m.get("split") for _, _, m in models]
    if any(s != saved[0] for s in saved):
        raise ValueError("the model files were trained on different splits; score them one at a time")
    split = dict(saved[0] or RunConfig().split())
    for key, value in (("dataset", args.dataset), ("clients", args.clients), ("seed", args.seed)):
        if value is None or value == split[key]:
            continue
        if saved[0] is not None:
            if key == "dataset":
                why = f"another dataset's labels name other classes than {split[key]}'s"
            else:
                why = ("its test sets would hold images it was trained on (every split deals out all of the "
                       "dataset's images" + (", and on Synthetic another seed is another task"
                                             if split["dataset"] == "synthetic" else "") + ")")
            raise ValueError(f"{models[0][0].name} was trained on the split with {key}={split[key]!r}; on "
                             f"{key}={value!r} {why}: omit --{key}")
        split[key] = value
    return split


def _check_one_run(models):
    """The model files of a folder belong to one run: no client scored twice, one algorithm."""
    algorithms = {m.get("algorithm") for _, _, m in models}
    if len(algorithms) > 1:
        raise ValueError(f"the model files were written by different algorithms ({sorted(map(str, algorithms))}): "
                         f"a folder reused by another run keeps the older files; score them one at a time")
    owner = {}
    for file, _, metadata in models:
        for cid in metadata.get("clients") or []:
            if cid in owner:
                raise ValueError(f"{owner[cid].name} and {file.name} both hold client {cid}: files of two runs in one "
                                 f"folder? score them one at a time")
            owner[cid] = file


def cmd_predict(args: argparse.Namespace) -> int:
    from .run import load_dataset

    models = _load_models(args.model)
    _check_one_run(models)
    split = _predict_split(models, args)
    saved = models[0][2].get("split")
    dataset = load_dataset(dataclasses.replace(RunConfig(), **split, data_dir=args.data_dir))
    correct = total = 0
    scored = []
    for file, model, metadata in models:
        # A model of no saved split (or a centralized one) scores every client of the split.
        clients = (metadata.get("clients") if split == saved else None) or list(range(len(dataset.clients)))
        outside = [cid for cid in clients if not 0 <= cid < len(dataset.clients)]
        if outside:
            raise ValueError(f"{file.name} belongs to clients {outside}, which the split "
                             f"({len(dataset.clients)} clients) does not have")
        for cid in clients:
            c, n = model.accuracy(dataset.clients[cid].x_test, dataset.clients[cid].y_test)
            correct, total = correct + c, total + n
        scored.append({"model": str(file), "clients": len(clients), "metadata": metadata})
    print(json.dumps({"split": split, "models": scored, "test_samples": int(total),
                      "accuracy": correct / max(total, 1)}, indent=1, default=str))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line, as fedlayer's other bad input (no usage block).

    Under mpiexec every rank parses the same flags: rank 0 alone prints the error.
    """

    def error(self, message):
        from .mpi import launch_rank

        if launch_rank() > 0:
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def main(argv: list[str] | None = None, *, mpi_hooks: object | None = None) -> int:
    """Run the ``fedlayer`` command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    ``mpi_hooks``: under mpiexec, a :class:`fedlayer.mpi.WorkerHooks` and
    :class:`fedlayer.mpi.ServerHooks` both (each rank uses its side), how the
    tests inject faults into a run; None in production.
    """
    parser = _Parser(prog="fedlayer", description="Analytic federated learning: FedACnnL and pFedACnnL")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"run": _run_parser(sub)}
    p = commands["plot"] = sub.add_parser("plot", help="PNG plots of a results.json")
    p.add_argument("results")
    p.add_argument("--out", help="output directory (default: beside the results)")
    p = commands["predict"] = sub.add_parser("predict",
                                             help="accuracy of saved models on the local test splits they were "
                                                  "trained for",
                       description="Score a model file (model.npz, model_groupK.npz) or a directory of them (the "
                                   "run's output for the group models, OUTPUT/personalized for pFedACnnL's "
                                   "per-client models) on the split saved with them; each group or client model "
                                   "is scored on its own clients only.")
    p.add_argument("model", help="a model .npz file or a directory of them")
    p.add_argument("--dataset", choices=CONFIG_CONSTRAINTS["dataset"][0].values, default=None,
                   help="the dataset, for model files that record no split (default: the saved one)")
    p.add_argument("--clients", type=flag_type(CONFIG_CONSTRAINTS["clients"], "clients"), default=None,
                   help="the number of clients, for model files that record no split (default: the saved one)")
    p.add_argument("--seed", type=flag_type(CONFIG_CONSTRAINTS["seed"], "seed"), default=None,
                   help="the split seed, for model files that record no split (default: the saved one)")
    p.add_argument("--data-dir", default=None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's parser, whose --help lists its options
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    from .baselines.server import Diverged
    from .server import AllClientsDropped
    from .secure import SecureAggregationError

    try:
        if args.command == "run":
            return cmd_run(args, mpi_hooks)
        return {"plot": cmd_plot, "predict": cmd_predict}[args.command](args)
    except (ValueError, OSError) as err:
        print(f"fedlayer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (AllClientsDropped, SecureAggregationError, Diverged) as err:
        # The protocol could not go on (a group with no survivors, a secure sum that cannot be unmasked, a
        # baseline that diverged): the message says which clients and why; a traceback adds nothing.
        print(f"fedlayer {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
