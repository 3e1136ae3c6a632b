"""Assemble a run: configuration, data, clients, transport, results.

:func:`run` is what ``fedlayer run`` calls; it is also the library entry
point for scripts::

    from fedlayer import RunConfig, run
    results = run(RunConfig(algorithm="fedacnnl", dataset="synthetic", model="dnn"))

What differs between algorithms (their clients, their training loop, the
files they write) comes from :data:`fedlayer.algorithms.ALGORITHMS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable

import numpy as np

import fastls

from ._validation import Boolean, InstanceOf, Interval, ListOf, Options, check_params
from .algorithms import ALGORITHMS
from .options import (CONV_TARGETS, EPS_CRITERIA, FORWARD_MODES, GAMMA_SCOPES, ROUND_ACCURACIES, SERVER_SOLVES,
                      UPLOAD_MODES)
from .data import KNOWN_DATASETS, ClientData, FederatedDataset, load_federated
from .models import DCNN_PADDINGS, KNOWN_MODELS, Model, build_model, check_padding
from .timing import Clock, time_summary
from .transport import InProcessTransport, Transport

__all__ = ["RunConfig", "run", "make_clients", "client_cores", "load_dataset", "pooled_data", "CONFIG_CONSTRAINTS"]

_POSITIVE_INT = [Interval(int, 1, None)]
_POSITIVE = [Interval(float, 0, None, closed="neither")]
_PATH = [None, InstanceOf(str, "a path")]

#: What each RunConfig key accepts; the CLI's flags parse through the same constraints.
CONFIG_CONSTRAINTS = {
    "algorithm": [Options(*ALGORITHMS)],
    "dataset": [Options(*KNOWN_DATASETS)],
    "model": [Options(*KNOWN_MODELS)],
    "clients": _POSITIVE_INT,
    "beta": _POSITIVE,
    "gamma": _POSITIVE + [Options("auto")],
    "gamma_output": [None] + _POSITIVE + [Options("auto")],
    "eps": _POSITIVE + [Options("auto")],
    "eps_output": [None] + _POSITIVE + [Options("auto", "inf")],
    "eps_criterion": [Options(*EPS_CRITERIA)],
    "gamma_scope": [Options(*GAMMA_SCOPES)],
    "groups": _POSITIVE_INT,
    "seed": [Interval(int, 0, None)],
    "batch_size": _POSITIVE_INT,
    "max_batch_size": _POSITIVE_INT,
    "width": _POSITIVE,
    "padding": [Options(*DCNN_PADDINGS)],
    "conv_targets": [Options(*CONV_TARGETS)],
    "forward": [Options(*FORWARD_MODES)],
    "upload": [Options(*UPLOAD_MODES)],
    "dtype": [Options("float32", "float64")],
    "cores": [None, ListOf(Interval(int, 1, None))],
    "bandwidth_gbps": _POSITIVE,
    "latency_ms": [Interval(float, 0, None)],
    "train_fraction": [Interval(float, 0, 1, closed="neither")],
    "min_samples": [Interval(int, 0, None)],
    "synthetic_alpha": [Interval(float, 0, None)],
    "synthetic_beta": [Interval(float, 0, None)],
    "data_dir": _PATH,
    "output": _PATH,
    "checkpoint": _PATH,
    "resume": [Boolean()],
    "rounds": [None, Interval(int, 1, None)],
    "eval_every": _POSITIVE_INT,
    "round_accuracy": [Options(*ROUND_ACCURACIES)],
    "engine": [Options("batched", "per-client")],
    "checkpoint_every": _POSITIVE_INT,
    "hyper": [None, InstanceOf(dict, "a dict of hyperparameter names to numbers")],
    "drop_clients": [Interval(float, 0, 1, closed="left")],
    "round_deadline": [None] + _POSITIVE,
    "secure": [Boolean()],
    "min_group_size": [Interval(int, 2, None)],
    "h_noise": [Interval(float, 0, None)],
    "server_solve": [Options(*SERVER_SOLVES)],
    "server_memory": [None] + _POSITIVE,
}

#: The RunConfig keys that define the clients' data and its train/test split.
SPLIT_KEYS = ("dataset", "clients", "beta", "seed", "train_fraction", "min_samples", "synthetic_alpha",
              "synthetic_beta", "dtype")


@dataclass
class RunConfig:
    """Everything that defines a run (the CLI flags and config-file keys)."""

    algorithm: str = "pfedacnnl"
    dataset: str = "synthetic"
    model: str = "dnn"
    clients: int = 100
    beta: float = 0.1            # Dirichlet concentration of the label skew
    gamma: float | str = 100.0   # ridge regularization, eqs. (5), (11); "auto": GCV per layer on the server
    gamma_output: float | str | None = None  # the output layer's gamma where it differs (e.g. "auto"); None: gamma
    eps: float | str = 2500.0    # proximal weight, eq. (13); "auto": leave-one-out / GCV per client and layer
    eps_output: float | str | None = None  # the output layer's eps where it differs; "inf": the group's kept
    eps_criterion: str = "loo"   # what eps="auto" minimizes: squared error ("loo") or class errors ("loo_class")
    gamma_scope: str = "all"     # gamma="auto" with groups: one gamma from all groups' sums, or one per "group"
    groups: int = 10             # K of K-means
    seed: int = 0
    batch_size: int = 64         # B_1, the first round's batch size
    max_batch_size: int = 1024   # B_max
    width: float = 1.0           # channel multiplier of the DCNN
    padding: str = "valid"       # zero padding of the DCNN's convolutions: "valid" (none) or "same"
    conv_targets: str = "position"  # a convolution's label code: one per output position, or one per "image"
    forward: str = "cached"      # layer inputs of a round: cached activations, or each "batch" from the input layer
    upload: str = "coordinates"  # a hidden layer's cross statistics: X^T Y's coordinates, or X^T Z ("targets")
    dtype: str = "float64"       # data and model dtype; statistics are float64
    cores: list[int] | None = None   # per-client cores (cycled); None = random 1..available per seed
    bandwidth_gbps: float = 100.0
    latency_ms: float = 0.005
    train_fraction: float = 0.75
    min_samples: int = 10
    synthetic_alpha: float = 0.5
    synthetic_beta: float = 0.5
    data_dir: str | None = None
    output: str | None = None    # directory for results.json and the models
    checkpoint: str | None = None  # server checkpoint after every layer (default: OUTPUT/checkpoint.npz)
    resume: bool = False         # continue from the checkpoint's last finished layer (baselines: round)
    checkpoint_every: int = 10   # baselines only: rounds between checkpoints (and after the last)
    rounds: int | None = None    # baselines only: training rounds (default: the paper's, see BASELINES)
    eval_every: int = 1          # evaluate every this many training rounds (and the last)
    round_accuracy: str = "network"  # analytic methods: a hidden layer's round scores the network, or its "codes"
    engine: str = "batched"      # baselines only: all of a process's clients step together, or "per-client" (timed)
    hyper: dict | None = None    # baselines only: hyperparameter overrides, e.g. {"lr": 1e-4} (see BASELINES)
    drop_clients: float = 0.0    # analytic methods: chance that a client fails in a round (seeded; simulated)
    round_deadline: float | None = None  # analytic methods: a client busy longer (s) in a round drops out of it
    secure: bool = False         # analytic methods: statistics summed by pairwise masking (fedlayer.secure)
    min_group_size: int = 3      # with secure: smaller K-means groups merge into the nearest one
    h_noise: float = 0.0         # std of Gaussian noise each client adds to its label summary h_i (eq. 9)
    server_solve: str = "auto"   # analytic methods: solve from the Grams ("primal"), the factored rows ("dual"), auto
    server_memory: float | None = None  # GiB the server's solve of a layer may hold (None: 3/4 of the physical memory)

    def validate(self, where: str = "") -> RunConfig:
        """Check every value against :data:`CONFIG_CONSTRAINTS` and the algorithm's own rules.

        ``where`` prefixes the messages (e.g. the config file's name).
        """
        check_params(dataclasses.asdict(self), CONFIG_CONSTRAINTS, where)
        if self.batch_size > self.max_batch_size:
            raise ValueError(f"{where}batch_size ({self.batch_size}) must not exceed max_batch_size "
                             f"({self.max_batch_size})")
        if self.resume and self.checkpoint_path() is None:
            raise ValueError(f"{where}resume needs a checkpoint to resume from: give output or checkpoint")
        try:
            check_padding(self.model, self.padding)
            ALGORITHMS[self.algorithm].check_config(self)
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
        return self

    @classmethod
    def from_dict(cls, values: dict, where: str = "") -> RunConfig:
        """A validated RunConfig from a dict of its keys (a parsed config file).

        ``where`` prefixes the messages (e.g. ``"config run.json: "``).
        """
        if not isinstance(values, dict):
            raise ValueError(f"{where}expected a JSON object of RunConfig keys, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}unknown configuration keys {unknown}; known keys: {sorted(known)}")
        return cls(**values).validate(where)

    def checkpoint_path(self) -> Path | None:
        if self.checkpoint:
            return Path(self.checkpoint)
        return Path(self.output) / "checkpoint.npz" if self.output else None

    def split(self) -> dict:
        """The settings that define the clients' data and train/test split (saved with the models)."""
        return {key: getattr(self, key) for key in SPLIT_KEYS}

    def fingerprint(self) -> dict:
        """The settings that determine the trained weights (checked on resume).

        "algorithm" is the algorithm whose federated stage this run trains
        (:attr:`fedlayer.algorithms.AnalyticAlgorithm.federated_stage`): a
        ``pfedacnnl-wc`` run resumes from a ``fedacnnl`` checkpoint and a
        ``pfedacnnl`` run from a ``pfedacnnl-wp`` one.
        """
        algorithm = ALGORITHMS[self.algorithm]
        return {"algorithm": getattr(algorithm, "federated_stage", self.algorithm), "model": self.model,
                "gamma": self.gamma, "groups": self.groups,
                "gamma_scope": self.gamma_scope,
                # Only when set, so that checkpoints written before the key existed still resume.
                **({"gamma_output": self.gamma_output} if self.gamma_output is not None else {}),
                "width": self.width, "padding": self.padding, "conv_targets": self.conv_targets, **self.split()}

    def personalization_fingerprint(self) -> dict:
        """The settings besides :meth:`fingerprint` that determine the personalized layers (eq. 13)."""
        return {"algorithm": self.algorithm, "eps": self.eps,
                # Only when set, so that personalization checkpoints written before the key existed still resume.
                **({"eps_output": self.eps_output} if self.eps_output is not None else {}),
                "eps_criterion": self.eps_criterion, "dtype": self.dtype}


def client_cores(n_clients: int, seed: int, cores: list[int] | None = None, available: int | None = None) -> list[int]:
    """Cores per client: the given list cycled, or random 1..available per seed (the paper's 1-4)."""
    if cores:
        return [int(cores[i % len(cores)]) for i in range(n_clients)]
    available = available or fastls.available_cores()
    rng = np.random.default_rng([seed, 0xC0])
    return [int(c) for c in rng.integers(1, available + 1, size=n_clients)]


def pooled_data(dataset: FederatedDataset) -> ClientData:
    """All clients' training data as one client (centralized ACnnL), their test splits together."""
    clients = dataset.clients
    return ClientData(
        x_train=np.concatenate([c.x_train for c in clients]),
        y_train=np.concatenate([c.y_train for c in clients]),
        x_test=np.concatenate([c.x_test for c in clients]),
        y_test=np.concatenate([c.y_test for c in clients]),
    )


def make_clients(config: RunConfig, dataset: FederatedDataset, model_config: dict,
                 client_ids: Iterable[int] | None = None, max_cores: int | None = None) -> list:
    """The client objects for ``client_ids`` (all when None), deterministically from the config.

    ``max_cores``: a cap on every client's cores (an MPI rank's share of its node).
    """
    algorithm = ALGORITHMS[config.algorithm]
    if max_cores is None:
        check_cores(config)  # under MPI the rank's share caps them instead (docs/design.md, "MPI")
    cores = client_cores(len(dataset.clients), config.seed, config.cores)
    if max_cores is not None:
        cores = [min(c, int(max_cores)) for c in cores]
    if algorithm.centralized:
        # The centralized reference: one client of every client's training data, on the most cores of any.
        return [algorithm.make_client(0, pooled_data(dataset), config, dataset.n_classes, model_config, max(cores))]
    ids = range(len(dataset.clients)) if client_ids is None else client_ids
    clients = []
    for cid in ids:
        data = dataset.clients[cid]
        if data.n_train == 0:
            raise ValueError(f"client {cid} has no training samples; lower --clients or raise --min-samples")
        clients.append(algorithm.make_client(cid, data, config, dataset.n_classes, model_config, cores[cid]))
        del data
    algorithm.host(clients, config)
    return clients


def rank_clients(config: RunConfig, rank: int, size: int, max_cores: int | None = None) -> list:
    """The clients MPI rank ``rank`` (> 0) of ``size`` hosts: ``1 + cid % (size - 1) == rank``.

    Every rank loads the dataset itself (same seed, same partition), builds
    its own clients and drops the rest; the pooled client of a centralized
    run lives on rank 1. ``max_cores`` caps each client's cores (the rank's
    share of its node, :func:`fedlayer.mpi.rank_cores`).
    """
    from .mpi import hosting_rank

    dataset = load_dataset(config)
    model_config = build(config, dataset).config()
    if ALGORITHMS[config.algorithm].centralized:
        ids = [0] if rank == 1 else []
    else:
        ids = [cid for cid in range(len(dataset.clients)) if hosting_rank(cid, size) == rank]
    return make_clients(config, dataset, model_config, client_ids=ids, max_cores=max_cores) if ids else []


def load_dataset(config: RunConfig) -> FederatedDataset:
    return load_federated(
        config.dataset,
        n_clients=config.clients,
        beta=config.beta,
        seed=config.seed,
        data_dir=config.data_dir,
        train_fraction=config.train_fraction,
        min_samples=config.min_samples,
        dtype=np.dtype(config.dtype),
        synthetic_alpha=config.synthetic_alpha,
        synthetic_beta=config.synthetic_beta,
    )


def build(config: RunConfig, dataset) -> Model:
    """The run's model architecture (untrained) for ``dataset``."""
    return build_model(config.model, dataset.feature_shape, dataset.n_classes, width=config.width,
                       dtype=np.dtype(config.dtype), padding=config.padding)


def check_cores(config: RunConfig) -> None:
    """Refuse clients of more cores than this process may run on, before any work is done."""
    available = fastls.available_cores()
    if config.cores and max(config.cores) > available:
        # A client timed on fewer cores than it stands for would make eq. (7) and the idle times describe
        # another machine: refuse rather than record 4-core clients that ran on 2.
        raise ValueError(f"cores: a client of {max(config.cores)} cores needs that many cores to run on, but this "
                         f"process may run on {available}; give --cores values of at most {available}")


def check_output_paths(config: RunConfig) -> list[Path]:
    """Refuse an output or checkpoint path that cannot be written, before any work is done.

    Creates the output directory (and the checkpoint's) and writes a probe
    file in it, so a path naming a file, a read-only folder or a full disk is
    reported now rather than after training. Returns the directories it
    created, deepest first (see :func:`_remove_empty`).
    """
    directories, created = [], []
    if config.output:
        output = Path(config.output)
        if output.exists() and not output.is_dir():
            raise ValueError(f"output {str(output)!r} is a file; give a directory (created if missing)")
        directories.append(("output", output))
    checkpoint = config.checkpoint_path()
    if checkpoint is not None:
        if checkpoint.is_dir():
            raise ValueError(f"checkpoint {str(checkpoint)!r} is a directory; give a file path, "
                             f"e.g. {str(checkpoint / 'checkpoint.npz')!r}")
        directories.append(("checkpoint", checkpoint.parent))
    for key, directory in directories:
        missing = [directory, *directory.parents]
        created += [d for d in missing[:next(i for i, d in enumerate(missing) if d.exists())] if d not in created]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError as err:
            raise ValueError(f"{key} directory {str(directory)!r} is not writable: "
                             f"{err.strerror or err}") from None
    return sorted(created, key=lambda d: len(d.parts), reverse=True)


def _remove_empty(directories):
    """Remove those of ``directories`` (deepest first) that a failed run left empty; keep any with files."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only an empty directory goes


def run(config: RunConfig, transport: Transport | None = None, progress: Callable[[str], None] | None = None,
        dataset: FederatedDataset | None = None) -> dict:
    """Run ``config`` in process (or over ``transport``); returns the results dict and writes it if asked.

    Parameters
    ----------
    config : RunConfig
    transport : Transport or None
        Where the clients are; None builds them in this process.
    progress : callable(str) or None
        Called with a short status after every round.
    dataset : FederatedDataset or None
        ``load_dataset(config)`` when the caller already holds it.

    Returns
    -------
    dict
        The content of ``results.json`` plus in-memory entries (the trained
        ``group_weights`` of the analytic methods, the ``params`` of the
        baselines).
    """
    config.validate()
    if transport is None:
        check_cores(config)
    created = check_output_paths(config)
    try:
        return _run_checked(config, transport, progress, dataset)
    except BaseException:
        _remove_empty(created)  # a run that failed before writing anything leaves no empty folder behind
        raise


def _run_checked(config, transport, progress, dataset):
    algorithm = ALGORITHMS[config.algorithm]
    start = time.perf_counter()
    dataset = load_dataset(config) if dataset is None else dataset
    if not any(c.n_test for c in dataset.clients):
        raise ValueError("no client has a test sample: the accuracy a run reports would be undefined")
    model = build(config, dataset)
    if transport is None:
        transport = InProcessTransport(make_clients(config, dataset, model.config()))
    # The centralized reference moves no data: its links are free.
    clock = (Clock(float("inf")) if algorithm.centralized
             else Clock(config.bandwidth_gbps * 1e9 / 8, config.latency_ms / 1e3))
    outcome = algorithm.train(config, transport, model, clock, progress)
    results = {
        "config": dataclasses.asdict(config),
        "machine": {"python": platform.python_version(), "cores": fastls.available_cores(), "numpy": np.__version__,
                    **getattr(transport, "machine", {})},
        "n_clients": len(transport.client_ids),
        "n_classes": dataset.n_classes,
        "accuracy": outcome.accuracy,
        "rounds": {str(i + 1): record for i, record in enumerate(outcome.rounds)},
        "time_per_client": time_summary(outcome.rounds),
        **outcome.results,
    }
    results["wall_s"] = time.perf_counter() - start
    if config.output:
        _write(Path(config.output), results, outcome.files)
    return {**results, **outcome.in_memory}


def _write(out, results, files):
    """``results.json``, then the algorithm's files, each written whole or not at all.

    The record goes first: a model that cannot be written (a disk filled by a
    hundred personalized full-width models) still raises, but the run's
    measurements are on disk by then.
    """
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, out / "results.json")
    for name, write in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
