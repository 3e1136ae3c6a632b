"""Assemble a run: configuration, data, clients, transport, results.

:func:`run` is what ``fedlayer run`` calls; it is also the library entry
point for scripts::

    from fedlayer.run import RunConfig, run
    results = run(RunConfig(algorithm="fedacnnl", dataset="synthetic", model="dnn"))
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import fastls

from .baselines import BASELINES, BaselineClient, baseline_hyper, run_baseline
from .client import Client
from .data import ClientData, load_federated
from .federated import VARIANTS, Clock, run_protocol, time_summary
from .models import build_model
from .transport import InProcessTransport

__all__ = ["RunConfig", "run", "make_clients", "client_cores", "ALGORITHMS"]

#: The analytic algorithms (one parametrized protocol) and the gradient / zeroth-order baselines.
ALGORITHMS = sorted(VARIANTS) + sorted(BASELINES)


@dataclass
class RunConfig:
    """Everything that defines a run (the CLI flags and config-file keys)."""

    algorithm: str = "pfedacnnl"
    dataset: str = "synthetic"
    model: str = "dnn"
    clients: int = 100
    beta: float = 0.1            # Dirichlet concentration of the label skew
    gamma: float = 100.0         # ridge regularization, eqs. (5), (11)
    eps: float = 2500.0          # proximal weight, eq. (13)
    groups: int = 10             # K of K-means
    seed: int = 0
    batch_size: int = 64         # B_1, the first round's batch size
    max_batch_size: int = 1024   # B_max
    width: float = 1.0           # channel multiplier of the DCNN
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
    resume: bool = False         # continue from the checkpoint's last finished layer
    rounds: int | None = None    # baselines only: training rounds (default: the paper's, see BASELINES)
    eval_every: int = 1          # baselines only: evaluate every this many rounds (and the last)
    hyper: dict | None = None    # baselines only: hyperparameter overrides, e.g. {"lr": 1e-4} (see BASELINES)

    def validate(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.rounds is not None and (not isinstance(self.rounds, int) or self.rounds < 1):
            raise ValueError(f"rounds must be an integer >= 1, got {self.rounds!r}")
        for name in ("clients", "groups", "batch_size", "max_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("gamma", "eps", "beta", "bandwidth_gbps", "width"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.cores is not None and (not self.cores or any(not isinstance(c, int) or c < 1 for c in self.cores)):
            raise ValueError(f"cores must be a non-empty list of integers >= 1, got {self.cores!r}")
        if self.batch_size > self.max_batch_size:
            raise ValueError(f"batch_size ({self.batch_size}) must not exceed max_batch_size ({self.max_batch_size})")
        if self.hyper and self.algorithm not in BASELINES:
            raise ValueError(f"hyper overrides baseline hyperparameters; {self.algorithm!r} is not a baseline "
                             f"(baselines: {sorted(BASELINES)})")
        if self.algorithm in BASELINES:
            baseline_hyper(self.algorithm, self.dataset, self.model, **(self.hyper or {}))  # names unknown keys
        if self.algorithm in VARIANTS and VARIANTS[self.algorithm].cluster and self.groups > self.clients:
            raise ValueError(f"groups (K={self.groups}) cannot exceed the number of clients ({self.clients})")
        return self

    @classmethod
    def from_dict(cls, values):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown configuration keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

    def checkpoint_path(self):
        if self.checkpoint:
            return Path(self.checkpoint)
        return Path(self.output) / "checkpoint.npz" if self.output else None

    def fingerprint(self):
        """The settings that determine the trained weights (checked on resume)."""
        keys = ("algorithm", "dataset", "model", "clients", "beta", "gamma", "groups", "seed", "width", "dtype",
                "train_fraction", "min_samples", "synthetic_alpha", "synthetic_beta")
        return {key: getattr(self, key) for key in keys}


def client_cores(n_clients, seed, cores=None, available=None):
    """Cores per client: the given list cycled, or random 1..available per seed (the paper's 1-4)."""
    if cores:
        return [int(cores[i % len(cores)]) for i in range(n_clients)]
    available = available or fastls.available_cores()
    rng = np.random.default_rng([seed, 0xC0])
    return [int(c) for c in rng.integers(1, available + 1, size=n_clients)]


def _pooled(dataset):
    """All clients' training data as one client (centralized ACnnL), tests kept together."""
    clients = dataset.clients
    return ClientData(
        x_train=np.concatenate([c.x_train for c in clients]),
        y_train=np.concatenate([c.y_train for c in clients]),
        x_test=np.concatenate([c.x_test for c in clients]),
        y_test=np.concatenate([c.y_test for c in clients]),
    )


def make_clients(config: RunConfig, dataset, model_config, client_ids=None):
    """The Client objects for ``client_ids`` (all when None), deterministically from the config."""
    cores = client_cores(len(dataset.clients), config.seed, config.cores)
    if config.algorithm == "acnnl":
        return [Client(0, _pooled(dataset), model_config, config.seed, dataset.n_classes, max(cores), np.float64)]
    ids = range(len(dataset.clients)) if client_ids is None else client_ids
    clients = []
    for cid in ids:
        data = dataset.clients[cid]
        if data.n_train == 0:
            raise ValueError(f"client {cid} has no training samples; lower --clients or raise --min-samples")
        if config.algorithm in BASELINES:
            clients.append(BaselineClient(cid, data, config.model, dataset.n_classes, config.seed, cores[cid]))
        else:
            clients.append(Client(cid, data, model_config, config.seed, dataset.n_classes, cores[cid], np.float64))
        del data
    return clients


def load_dataset(config: RunConfig):
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


def build(config: RunConfig, dataset):
    """The run's model architecture (untrained) for ``dataset``."""
    return build_model(config.model, dataset.feature_shape, dataset.n_classes, width=config.width,
                       dtype=np.dtype(config.dtype))


def run(config: RunConfig, transport=None, progress=None, dataset=None):
    """Run ``config`` in process (or over ``transport``); returns the results dict and writes it if asked.

    ``dataset`` skips loading when the caller already holds ``load_dataset(config)``.
    """
    config.validate()
    start = time.perf_counter()
    dataset = load_dataset(config) if dataset is None else dataset
    model = build(config, dataset)
    if transport is None:
        transport = InProcessTransport(make_clients(config, dataset, model.config()))
    centralized = config.algorithm == "acnnl"
    clock = Clock(float("inf")) if centralized else Clock(config.bandwidth_gbps * 1e9 / 8, config.latency_ms / 1e3)
    if config.algorithm in BASELINES:
        return _run_baseline(config, transport, dataset, clock, progress, start)
    variant = VARIANTS[config.algorithm]
    checkpoint = config.checkpoint_path()
    resume_state = None
    if config.resume:
        if checkpoint is None:
            raise ValueError("resume needs a checkpoint: give output or checkpoint")
        if checkpoint.exists():
            from .checkpoint import load_checkpoint

            resume_state = load_checkpoint(checkpoint, config.fingerprint())
    outcome = run_protocol(
        transport,
        len(model.trainable),
        variant,
        gamma=config.gamma,
        eps=config.eps,
        groups=config.groups,
        seed=config.seed,
        batch_size=config.batch_size,
        max_batch_size=config.max_batch_size,
        clock=clock,
        progress=progress,
        checkpoint=checkpoint,
        resume=resume_state,
        fingerprint=config.fingerprint(),
    )
    results = _results(config, transport, dataset, outcome, start)
    results["groups"] = outcome["groups"]
    results["resumed_from_layer"] = resume_state["layers_done"] if resume_state else None
    if config.output:
        _write(config, results, model, outcome["group_weights"])
    results["group_weights"] = outcome["group_weights"]
    return results


def _results(config, transport, dataset, outcome, start):
    """The results record shared by every algorithm (keyed by round)."""
    return {
        "config": dataclasses.asdict(config),
        "machine": {"python": platform.python_version(), "cores": fastls.available_cores(), "numpy": np.__version__},
        "n_clients": len(transport.client_ids),
        "n_classes": dataset.n_classes,
        "accuracy": outcome["accuracy"],
        "rounds": {str(i + 1): record for i, record in enumerate(outcome["rounds"])},
        "time_per_client": time_summary(outcome["rounds"]),
        "wall_s": time.perf_counter() - start,
    }


def _run_baseline(config, transport, dataset, clock, progress, start):
    hyper = baseline_hyper(config.algorithm, config.dataset, config.model, **(config.hyper or {}))
    default_rounds = hyper.pop("rounds")
    rounds = config.rounds or default_rounds
    outcome = run_baseline(transport, config.algorithm, rounds, clock=clock, eval_every=config.eval_every,
                           progress=progress, **hyper)
    results = _results(config, transport, dataset, outcome, start)
    results["hyperparameters"] = hyper
    results["best_accuracy"] = outcome["best_accuracy"]
    if config.output:
        out = Path(config.output)
        out.mkdir(parents=True, exist_ok=True)
        _write_json(out / "results.json", results)
        np.save(out / "params.npy", outcome["params"])
    return results


def _write_json(path, results):
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    tmp.replace(path)


def _write(config, results, model, group_weights):
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "results.json", results)
    for k, weights in group_weights.items():
        trained = model.copy()
        for index, W in zip(trained.trainable, weights):
            trained.layers[index].set_weights(W)
        name = "model.npz" if len(group_weights) == 1 else f"model_group{k}.npz"
        trained.save(out / name, metadata={"algorithm": config.algorithm, "dataset": config.dataset,
                                           "group": k, "seed": config.seed, "gamma": config.gamma})
