"""Every algorithm ``fedlayer run`` knows, by name, and what runs it.

:data:`ALGORITHMS` maps a name to an :class:`Algorithm`: the analytic
methods (one parametrized protocol, :mod:`fedlayer.server`) and the
gradient / zeroth-order baselines (:mod:`fedlayer.baselines`). An algorithm
checks the parts of a configuration only it cares about, builds its
clients, trains over a transport and names the files it leaves in the
output directory; :func:`fedlayer.run.run` does the rest the same way for
all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from collections.abc import Callable

import numpy as np

from ._validation import Options, check_param
from .baselines import BASELINES, PERSONALIZED, BaselineClient, baseline_hyper, run_baseline
from .baselines.cohort import ClientCohort
from .baselines.models import MODEL_HIDDEN
from .baselines.server import BaselineCheckpoints, load_baseline_checkpoint
from .checkpoint import Checkpointing, load_checkpoint
from .client import Client, target_bases
from .messages import ClientMethod, ClientProtocol
from .options import ClientOptions, ServerOptions
from .secure import SecureServer
from .secure_client import SecureClient
from .server import VARIANTS, ModelLayers, ServerState, Variant, run_protocol

if TYPE_CHECKING:
    from .data import ClientData
    from .models import Model
    from .run import RunConfig
    from .timing import Clock
    from .transport import Transport

__all__ = ["ALGORITHMS", "Algorithm", "AnalyticAlgorithm", "BaselineAlgorithm", "Outcome"]


@dataclass
class Outcome:
    """What training produced.

    Attributes
    ----------
    rounds : list of dict
        :class:`fedlayer.timing.RoundLog` records, in order.
    accuracy : float
        Overall test accuracy after the last round.
    results : dict
        Algorithm-specific entries of ``results.json`` (JSON-able).
    in_memory : dict
        Entries of the returned results only (arrays, not written as JSON).
    files : dict
        Name relative to the output directory -> callable(path) writing it.
    """

    rounds: list
    accuracy: float
    results: dict = field(default_factory=dict)
    in_memory: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)


def announce_rounds(progress: Callable[[str], None] | None, total: int) -> None:
    """Tell ``progress`` how many rounds will report, when it can take it (a ``start(total)`` method)."""
    start = getattr(progress, "start", None)
    if start is not None:
        start(total)


class Algorithm:
    """An algorithm ``fedlayer run`` can run.

    Attributes
    ----------
    name : str
    summary : str
        One line for ``fedlayer run --help``.
    centralized : bool
        One client holding every client's training data, no communication.
    personalized : bool
        The accuracy is that of each client's own model.
    """

    name: str
    summary: str
    centralized = False
    personalized = False

    def check_config(self, config: RunConfig) -> None:
        """Raise ValueError for settings this algorithm cannot run with."""

    def ignored_options(self, config: RunConfig) -> list[str]:
        """Notes (str) on settings ``config`` changes from their defaults that this algorithm never reads."""
        return []

    def make_client(self, cid: int, data: ClientData, config: RunConfig, n_classes: int, model_config: dict,
                    cores: int) -> ClientProtocol | BaselineClient:
        """The client object for client ``cid`` holding ``data``."""
        raise NotImplementedError

    def host(self, clients: list, config: RunConfig) -> None:
        """Set up what the clients of one process share (called once per process with all its clients)."""

    def train(self, config: RunConfig, transport: Transport, model: Model, clock: Clock,
              progress: Callable[[str], None] | None) -> Outcome:
        """Train over ``transport``; returns an :class:`Outcome`."""
        raise NotImplementedError


def _changed(config: RunConfig, keys):
    """The keys among ``keys`` that ``config`` sets away from their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return [key for key in keys if getattr(config, key) != defaults[key]]


def _ignored(config: RunConfig, name, keys, applies_to):
    """A note naming the options set for ``name`` that it never reads, or None."""
    changed = _changed(config, keys)
    if not changed:
        return None
    one = len(changed) == 1
    return (f"{', '.join(changed)} appl{'ies' if one else 'y'} to {applies_to}; {name!r} ignores "
            f"{'it' if one else 'them'}")


class AnalyticAlgorithm(Algorithm):
    """FedACnnL, pFedACnnL and their ablations: :func:`fedlayer.server.run_protocol` with a :class:`Variant`."""

    def __init__(self, name: str, variant: Variant, summary: str, centralized: bool = False) -> None:
        self.name, self.variant, self.summary, self.centralized = name, variant, summary, centralized
        self.personalized = variant.personalize

    @property
    def federated_stage(self) -> str:
        """The algorithm whose initialization and federated rounds this one runs (its checkpoints fit both).

        pFedACnnL-WC trains FedACnnL's stage and personalizes it; pFedACnnL
        trains pFedACnnL-WP's. So a personalized run can resume from the
        checkpoint of the run without personalization.
        """
        for name, algorithm in ALGORITHMS.items():
            if (isinstance(algorithm, AnalyticAlgorithm) and not algorithm.variant.personalize
                    and algorithm.centralized == self.centralized
                    and (algorithm.variant.adaptive, algorithm.variant.cluster)
                    == (self.variant.adaptive, self.variant.cluster)):
                return name
        return self.name

    def ignored_options(self, config: RunConfig) -> list[str]:
        """Notes on the options ``config`` sets away from their defaults that this algorithm never reads."""
        notes = []
        if not self.variant.personalize:
            notes.append(_ignored(config, self.name, ("eps", "eps_criterion"),
                                  "the personalizing algorithms (pfedacnnl, pfedacnnl-wc)"))
        if not self.variant.cluster:
            notes.append(_ignored(config, self.name, ("groups", "gamma_scope", "h_noise"),
                                  "the grouping algorithms (pfedacnnl, pfedacnnl-wp)"))
        notes.append(_ignored(config, self.name, ("engine", "checkpoint_every"),
                              f"the baselines ({', '.join(BASELINES)})"))
        return [note for note in notes if note]

    def check_config(self, config: RunConfig) -> None:
        for key in ("hyper", "rounds"):
            if getattr(config, key) is not None:
                raise ValueError(f"{key} applies to the baselines ({', '.join(sorted(BASELINES))}); "
                                 f"{self.name!r} trains one round per layer and takes no {key}")
        if self.variant.cluster and config.groups > config.clients:
            raise ValueError(f"groups (K={config.groups}) cannot exceed the number of clients ({config.clients})")
        if config.secure and self.centralized:
            raise ValueError(f"secure sums hide clients' statistics from the server; {self.name!r} pools every "
                             "client's data in one (centralized ACnnL): there is nothing to sum securely")
        if config.drop_clients and self.centralized:
            raise ValueError(f"drop_clients simulates clients that fail; {self.name!r} has one pooled client, whose "
                             "failure would leave nothing to train on")
        if config.secure and config.server_solve == "dual":
            raise ValueError("server_solve='dual' solves from the clients' factored rows, which secure sums cannot "
                             "carry: run without secure, or with server_solve 'auto' or 'primal'")
        if config.secure and not self.centralized and config.clients < config.min_group_size:
            raise ValueError(f"secure sums need at least min_group_size={config.min_group_size} clients (a sum over "
                             f"fewer reveals too much of each), got clients={config.clients}")

    def make_client(self, cid: int, data: ClientData, config: RunConfig, n_classes: int, model_config: dict,
                    cores: int) -> ClientProtocol | BaselineClient:
        """The client of ``cid``; with ``secure``, wrapped to take part in secure sums (here and only here)."""
        options = ClientOptions.from_config(config, centralized=self.centralized)
        if self.centralized:
            # The pooled client's rows are every client's already, and their rotation would be N x N.
            options = dataclasses.replace(options, rotate_rows=False)
        client = Client(cid, data, model_config, config.seed, n_classes, cores, options)
        return SecureClient(client) if config.secure else client

    def train(self, config: RunConfig, transport: Transport, model: Model, clock: Clock,
              progress: Callable[[str], None] | None) -> Outcome:
        resume_state = None
        path = config.checkpoint_path()
        checkpoint = None if path is None else Checkpointing(path, config.fingerprint(),
                                                             config.personalization_fingerprint())
        if config.resume and path.exists():
            saved = load_checkpoint(path, config.fingerprint())
            resume_state = ServerState.from_checkpoint(saved)
            if not self.variant.personalize or saved["personal_tag"] != checkpoint.tag:
                # Rounds personalized by another run (another algorithm, eps...) are not this run's to go on from.
                resume_state = resume_state.without_personalization()
        n_layers = len(model.trainable)
        layers_done = resume_state.layers_done if resume_state else 0
        personalized = resume_state.personalized if resume_state else 0
        announce_rounds(progress, n_layers - layers_done + (n_layers - personalized if self.variant.personalize else 0))
        outcome = run_protocol(
            transport, n_layers, self.variant, ServerOptions.from_config(config, weights_dtype=model.dtype),
            layers=ModelLayers(target_bases(model, config.seed, config.conv_targets),
                               [model.layers[i].ls_shape(model.input_shape_of(i)) for i in model.trainable]),
            secure=SecureServer(config.seed, min_group_size=config.min_group_size) if config.secure else None,
            clock=clock, progress=progress,
            checkpoint=checkpoint, resume=resume_state,
        )
        group_of = {int(cid): k for cid, k in outcome["groups"].items()}
        group_weights = outcome["group_weights"]
        files = {}
        for k, weights in group_weights.items():
            name = "model.npz" if len(group_weights) == 1 else f"model_group{k}.npz"
            # The centralized reference's one pooled client stands for every client of the split.
            members = list(range(config.clients)) if self.centralized else \
                sorted(cid for cid, group in group_of.items() if group == k)
            files[name] = _model_writer(model, weights, config, members, group=k)
        if self.personalized and config.output:
            # Each client's personalized layers live only on the client, which writes its own file (under mpiexec,
            # its rank): personalization moves no bytes, and the weights never reach the server.
            for cid in transport.client_ids:
                files[f"personalized/client{cid}.npz"] = _personal_writer(transport, cid, config, group_of[cid])
        return Outcome(
            rounds=outcome["rounds"], accuracy=outcome["accuracy"],
            results={"groups": outcome["groups"],
                     **({"secure": outcome["secure"]} if "secure" in outcome else {}),
                     "resumed_from_layer": layers_done if resume_state else None,
                     **({"resumed_personalized": personalized} if personalized else {})},
            in_memory={"group_weights": group_weights}, files=files,
        )


def _personal_writer(transport, cid, config: RunConfig, group):
    """A writer of client ``cid``'s personalized model: the client writes it, on its side of the transport."""

    def write(path):
        for _ in transport.call(ClientMethod.SAVE_PERSONALIZED, {cid: {"path": str(path),
                                                            "metadata": _model_metadata(config, [cid], group)}}):
            pass  # only the bytes written come back

    return write


def _model_metadata(config: RunConfig, clients, group):
    """What a saved model records besides its weights: the run's settings, and the split and clients to score it on."""
    return {"algorithm": config.algorithm, "gamma": config.gamma,
            **({"gamma_output": config.gamma_output} if config.gamma_output is not None else {}),
            "eps": config.eps, **({"eps_output": config.eps_output} if config.eps_output is not None else {}),
            "group": group, "clients": clients, "split": config.split()}


def _model_writer(model, weights, config: RunConfig, clients, group):
    """A writer of ``model`` with ``weights``, and with the split and clients it is to be scored on."""

    def write(path):
        trained = model.copy()
        for index, W in zip(trained.trainable, weights):
            trained.layers[index].set_weights(W)
        trained.save(path, metadata=_model_metadata(config, clients, group))

    return write


class BaselineAlgorithm(Algorithm):
    """A gradient or zeroth-order baseline: :func:`fedlayer.baselines.run_baseline`."""

    def __init__(self, name: str, summary: str) -> None:
        self.name, self.summary = name, summary
        self.personalized = name in PERSONALIZED

    def ignored_options(self, config: RunConfig) -> list[str]:
        """Notes on the options ``config`` sets away from their defaults that this baseline never reads."""
        note = _ignored(config, self.name, ("gamma", "gamma_output", "eps", "eps_output", "eps_criterion", "groups",
                                            "gamma_scope", "min_group_size", "server_solve", "server_memory",
                                            "round_accuracy"),
                        "the analytic methods (fedacnnl, pfedacnnl and their variants)")
        return [note] if note else []

    def check_config(self, config: RunConfig) -> None:
        check_param("model", config.model, [Options(*MODEL_HIDDEN)])
        if config.drop_clients or config.round_deadline is not None or config.secure or config.h_noise \
                or config.forward != "cached":
            raise ValueError(f"drop_clients, round_deadline, secure, h_noise and forward apply to the analytic "
                             f"methods; {self.name!r} takes none of them")
        baseline_hyper(self.name, config.dataset, config.model, **(config.hyper or {}))  # names unknown keys

    def fingerprint(self, config: RunConfig, hyper: dict) -> dict:
        """The settings that determine a baseline's parameters and records (checked on resume).

        Each hyperparameter by name. Not the engine: both give the same
        parameters (to rounding), so a run may go on with the other.
        """
        return {"algorithm": self.name, "model": config.model, **config.split(), "eval_every": config.eval_every,
                **{f"hyperparameter {key}": value for key, value in sorted(hyper.items())}}

    def make_client(self, cid: int, data: ClientData, config: RunConfig, n_classes: int, model_config: dict,
                    cores: int) -> ClientProtocol | BaselineClient:
        return BaselineClient(cid, data, config.model, n_classes, config.seed, cores)

    def host(self, clients: list, config: RunConfig) -> None:
        """The batched engine joins a process's clients into one cohort; the per-client engine leaves them alone."""
        if config.engine == "batched" and clients:
            ClientCohort(clients)

    def train(self, config: RunConfig, transport: Transport, model: Model, clock: Clock,
              progress: Callable[[str], None] | None) -> Outcome:
        hyper = baseline_hyper(self.name, config.dataset, config.model, **(config.hyper or {}))
        rounds = config.rounds or hyper.pop("rounds")
        hyper.pop("rounds", None)
        fingerprint = self.fingerprint(config, hyper)
        checkpoint, resume = config.checkpoint_path(), None
        if config.resume and checkpoint.exists():
            resume = load_baseline_checkpoint(checkpoint, fingerprint)
        announce_rounds(progress, rounds - (len(resume["rounds"]) if resume else 0))
        checkpoints = checkpoint and BaselineCheckpoints(checkpoint, config.checkpoint_every, fingerprint)
        outcome = run_baseline(transport, self.name, rounds, clock=clock, eval_every=config.eval_every,
                               progress=progress, checkpoints=checkpoints, resume=resume, **hyper)
        params = outcome["params"]
        return Outcome(
            rounds=outcome["rounds"], accuracy=outcome["accuracy"],
            results={"hyperparameters": hyper, "best_accuracy": outcome["best_accuracy"], "engine": config.engine,
                     "resumed_from_round": len(resume["rounds"]) if resume else None},
            in_memory={"params": params},
            files={"params.npy": lambda path: np.save(path, params)},
        )


_ANALYTIC_SUMMARIES = {
    "acnnl": "centralized reference: one client holding all training data",
    "fedacnnl": "FedACnnL: one global model, adaptive batch sizes (eq. 7)",
    "fedacnnl-wa": "FedACnnL with fixed batch sizes",
    "pfedacnnl": "pFedACnnL: K-means groups, then local personalization",
    "pfedacnnl-wc": "pFedACnnL with one group",
    "pfedacnnl-wp": "pFedACnnL without personalization",
}
_BASELINE_SUMMARIES = {
    "fedavg": "FedAvg (local SGD, averaged)",
    "fedzo": "FedZO (two-point zeroth-order SGD)",
    "baffle": "BAFFLE (Stein zeroth-order estimate)",
    "pfedme": "pFedMe (Moreau-envelope personalization)",
    "pfedzo": "pFedZO (pFedMe with zeroth-order inner steps)",
}

#: name -> Algorithm, for every algorithm ``fedlayer run --algorithm`` accepts.
ALGORITHMS = {
    **{name: AnalyticAlgorithm(name, variant, _ANALYTIC_SUMMARIES[name], centralized=name == "acnnl")
       for name, variant in VARIANTS.items()},
    **{name: BaselineAlgorithm(name, _BASELINE_SUMMARIES[name]) for name in BASELINES},
}
