"""The options of a run's server and clients, each built once from the run's configuration.

:class:`ServerOptions` (with its :class:`BatchPolicy`) is what
:func:`fedlayer.server.run_protocol` reads; :class:`ClientOptions` is what
:class:`fedlayer.client.Client` reads. Both are frozen: a run's settings do
not change under it. ``from_config`` is the one place a
:class:`fedlayer.run.RunConfig` key becomes an option, so a new run option
is the config field, the line that copies it here, and its consumer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

import fastls

if TYPE_CHECKING:
    from .run import RunConfig

__all__ = ["BatchPolicy", "ClientOptions", "ServerOptions", "CLIENT_SCRATCH_BYTES", "CONV_TARGETS", "EPS_CRITERIA",
           "FORWARD_MODES", "GAMMA_SCOPES", "ROUND_ACCURACIES", "SERVER_SOLVES", "UPLOAD_MODES"]

#: A client computes one layer's statistics at a time, so it can afford four times fastls's default chunk
#: (the measurement is in docs/results/protocol_notes.md).
CLIENT_SCRATCH_BYTES = 4 * fastls.tuning.DEFAULT_SCRATCH_BYTES
CONV_TARGETS = ("position", "image")
EPS_CRITERIA = ("loo", "loo_class")
#: Where a round's statistics get their layer inputs: the cached activations of the layer before (each sample
#: passes each trained layer once per stage), or each batch's own forward pass from the input (Algorithm 1, line 8).
FORWARD_MODES = ("cached", "batch")
#: What the server asks a hidden layer's cross statistics to hold: X^T Y's coordinates in the label code Q_l
#: ("coordinates", n_classes columns per code; the server multiplies by Q_l) or X^T Z = X^T Y Q_l itself
#: ("targets", as the paper's Algorithm 1 uploads it).
UPLOAD_MODES = ("coordinates", "targets")
#: With gamma="auto" and several groups: one gamma per layer from all groups' sums, or one per group.
GAMMA_SCOPES = ("all", "group")
#: How the server solves a layer: the primal wherever its Gram fits the server's memory and the dual
#: elsewhere ("auto"), or always one form (fedlayer.server.solvers.solve_form).
SERVER_SOLVES = ("auto", "primal", "dual")
#: What the accuracy after a federated round of a hidden layer scores: the whole network, its later layers
#: still at their initial weights ("network"), or the layer just trained, each test sample given the class
#: whose label code is nearest the layer's output ("codes"; only that layer's forward pass of the test split).
ROUND_ACCURACIES = ("network", "codes")


def _same_named(cls, config, names=None):
    """The fields of options class ``cls`` that ``config`` has under the same name (of ``names`` when given)."""
    return {f.name: getattr(config, f.name) for f in fields(cls)
            if hasattr(config, f.name) and (names is None or f.name in names)}


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class BatchPolicy:
    """Each client's batch sizes: B_1^i in the first round and the cap B_max^i of eq. (7).

    Attributes
    ----------
    first, max : int or mapping cid -> int
        One size for every client, or one per client id.
    """

    first: int | Mapping[int, int] = 64
    max: int | Mapping[int, int] = 1024

    def sizes(self, cids: Iterable[int]) -> tuple[dict[int, int], dict[int, int]]:
        """(B_1, B_max) per client of ``cids``.

        Raises
        ------
        ValueError
            If a client's first batch size is not within 1..its maximum.
        """
        first = dict(self.first) if isinstance(self.first, Mapping) else {cid: int(self.first) for cid in cids}
        most = dict(self.max) if isinstance(self.max, Mapping) else {cid: int(self.max) for cid in cids}
        for cid in cids:
            if not 1 <= first[cid] <= most[cid]:
                raise ValueError(f"client {cid}: need 1 <= batch_size ({first[cid]}) <= max_batch_size ({most[cid]})")
        return first, most


@dataclass(frozen=True)
class ServerOptions:
    """How the server trains: regularization, grouping, batch sizes, evaluation, what it asks the clients for.

    Attributes
    ----------
    gamma : float or "auto", default=100.0
        Ridge regularization (eqs. 5, 11); ``"auto"``: per layer, the server
        minimizes GCV from the summed statistics (the clients upload
        tr(Z^T Z) and their row count besides G and C).
    gamma_output : float, "auto" or None, default=None
        The output layer's gamma where it differs from the hidden layers'
        (None: ``gamma``).
    gamma_scope : {"all", "group"}, default="all"
        With an automatic gamma and several groups: one gamma per layer
        from the sums over all groups, or one per group from its own sums.
    eps : float or "auto", default=2500.0
        Proximal weight of the personalization (eq. 13); ``"auto"``: each
        client chooses its own per layer.
    eps_output : float, "auto", "inf" or None, default=None
        The output layer's eps where it differs from the hidden layers'
        (None: ``eps``); ``"inf"``: eq. (13)'s limit, every client keeps its
        group's output layer.
    groups : int, default=10
        K of K-means when the variant clusters.
    seed : int, default=0
        Seed of the clustering.
    batch : BatchPolicy
    eval_every : int, default=1
        Overall test accuracy after every ``eval_every``-th training round
        (federated and personalization rounds counted together) and after
        the last; the others record None.
    round_accuracy : {"network", "codes"}, default="network"
        What the accuracy after a federated round of a hidden layer scores
        (:data:`ROUND_ACCURACIES`): the network with its later layers
        untrained, or the layer's label-code readout (the client's
        ``evaluate(code_layer=...)``). The output layer's round and the
        personalization rounds score the network either way.
    upload : {"coordinates", "targets"}, default="coordinates"
        What a hidden layer's cross statistics hold where the layer has a
        label code narrower than its outputs (:data:`UPLOAD_MODES`): the
        same weights either way.
    stat_dtype : dtype, default=float64
        Of the server's sums and solves.
    weights_dtype : dtype or None, default=None (``stat_dtype``)
        In which the server keeps each solved layer and sends it.
    server_solve : {"auto", "primal", "dual"}, default="auto"
        How each layer is solved (:func:`fedlayer.server.solvers.solve_form`):
        from the summed Grams (primal), from the clients' factored rows
        (dual), or the primal wherever its Gram fits ``server_memory`` and
        the dual elsewhere.
    server_memory : float or None, default=None
        GiB of RAM the server's solve of a layer may hold (the Gram, or the
        dual's N x N system and stacked rows; rows beyond it are
        memory-mapped under ``scratch_dir``). None: three quarters of the
        machine's physical memory (the rest for the clients' data and caches).
    scratch_dir : path or None
        Where stacked rows that exceed ``server_memory`` are memory-mapped
        (a run's output folder); None: the temporary folder.
    """

    gamma: float | str = 100.0
    gamma_output: float | str | None = None
    gamma_scope: str = "all"
    eps: float | str = 2500.0
    eps_output: float | str | None = None
    groups: int = 10
    seed: int = 0
    batch: BatchPolicy = field(default_factory=BatchPolicy)
    eval_every: int = 1
    round_accuracy: str = "network"
    upload: str = "coordinates"
    stat_dtype: Any = np.float64
    weights_dtype: Any = None
    server_solve: str = "auto"
    server_memory: float | None = None
    scratch_dir: str | Path | None = None

    def __post_init__(self):
        if int(self.eval_every) < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        _check_choice("upload", self.upload, UPLOAD_MODES)
        _check_choice("round_accuracy", self.round_accuracy, ROUND_ACCURACIES)
        _check_choice("gamma_scope", self.gamma_scope, GAMMA_SCOPES)
        _check_choice("server_solve", self.server_solve, SERVER_SOLVES)
        if self.server_memory is not None and not self.server_memory > 0:
            raise ValueError(f"server_memory must be > 0 GiB (or None), got {self.server_memory!r}")

    @property
    def memory_bytes(self) -> int:
        """The server's memory budget in bytes (``server_memory``, or three quarters of the physical memory)."""
        if self.server_memory is not None:
            return int(self.server_memory * 2**30)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4

    @property
    def weights_in(self) -> np.dtype:
        """The dtype the server keeps and sends weights in."""
        return np.dtype(self.stat_dtype if self.weights_dtype is None else self.weights_dtype)

    def gamma_of(self, position: int, n_layers: int) -> float | str:
        """The gamma of layer ``position`` of ``n_layers``: ``gamma_output`` for the last one where set."""
        if self.gamma_output is not None and position == n_layers - 1:
            return self.gamma_output
        return self.gamma

    def eps_of(self, position: int, n_layers: int) -> float | str:
        """The eps of layer ``position`` of ``n_layers``: ``eps_output`` for the last one where set."""
        if self.eps_output is not None and position == n_layers - 1:
            return self.eps_output
        return self.eps

    @classmethod
    def from_config(cls, config: RunConfig, weights_dtype: npt.DTypeLike | None = None) -> ServerOptions:
        """The options of a :class:`fedlayer.run.RunConfig`, the model's weights kept in ``weights_dtype``.

        Every field the config has under the same name is copied: a new
        server option named as its config key needs no line here.
        """
        # Stacked rows too large for RAM go under the run's output folder (else a temporary one).
        scratch_dir = Path(config.output) / "server" if config.output else None
        return cls(**_same_named(cls, config), batch=BatchPolicy(config.batch_size, config.max_batch_size),
                   weights_dtype=weights_dtype, scratch_dir=scratch_dir)


#: The client options the centralized reference's pooled client takes from a run's configuration.
_POOLED_CLIENT = ("conv_targets", "eps_criterion", "forward")


@dataclass(frozen=True)
class ClientOptions:
    """How a client of the analytic methods computes, caches and fails.

    Attributes
    ----------
    stat_dtype : dtype, default=float64
        Of the uploaded statistics X^T X and X^T Z.
    scratch_bytes : int, default=CLIENT_SCRATCH_BYTES (256 MiB)
        Working memory bound for convolution statistics and forward chunks.
    cache_dir : path or None
        Where activations too large for RAM (over ``cache_ram_bytes``) are
        kept as memory-mapped ``.npy`` files; None: a temporary folder,
        removed with the client. Files of the client's id already there
        (left by a process that was killed) are removed when it is built.
    cache_ram_bytes : int, default=16 MiB
        Activations of one split up to this size stay in memory.
    conv_targets : {"position", "image"}, default="position"
        How a convolution's targets encode the label
        (:func:`fedlayer.client.encoder_widths`).
    forward : {"cached", "batch"}, default="cached"
        Where the statistics of a round get the layer's inputs: the cached
        inputs of the layer before, moved one layer forward once per round,
        or every batch's own pass from the input layer through all trained
        layers, as in the paper's Algorithm 1 (line 8).
    eps_criterion : {"loo", "loo_class"}, default="loo"
        What ``eps="auto"`` minimizes where it takes leave-one-out: the
        squared error of the targets, or the error rate of the class
        decision.
    drop_probability : float in [0, 1), default=0
        Chance that the client fails in a round (seeded; simulated).
    round_deadline_s : float or None
        A client busy longer in a round drops out of it.
    h_noise : float >= 0, default=0
        Std of the Gaussian noise the client adds to its label summary h_i (eq. 9).
    rotate_rows : bool, default=True
        Hide the rows of a factored upload behind a secret rotation
        (:meth:`fedlayer.client.Client.factored_rows`). The centralized
        reference's pooled client does not (:mod:`fedlayer.algorithms`): its
        rows are pooled already, and the rotation of all of them would be an
        N x N matrix.
    """

    stat_dtype: Any = np.float64
    scratch_bytes: int = CLIENT_SCRATCH_BYTES
    cache_dir: str | Path | None = None
    cache_ram_bytes: int = 16 * 2**20
    conv_targets: str = "position"
    forward: str = "cached"
    eps_criterion: str = "loo"
    drop_probability: float = 0.0
    round_deadline_s: float | None = None
    h_noise: float = 0.0
    rotate_rows: bool = True

    def __post_init__(self):
        _check_choice("conv_targets", self.conv_targets, CONV_TARGETS)
        _check_choice("eps_criterion", self.eps_criterion, EPS_CRITERIA)
        _check_choice("forward", self.forward, FORWARD_MODES)
        if not 0.0 <= self.drop_probability < 1.0:
            raise ValueError(f"drop_probability must be in [0, 1), got {self.drop_probability!r}")
        if not self.h_noise >= 0:
            raise ValueError(f"h_noise must be >= 0, got {self.h_noise!r}")

    @classmethod
    def from_config(cls, config: RunConfig, centralized: bool = False) -> ClientOptions:
        """The options of a :class:`fedlayer.run.RunConfig`'s clients.

        Every field the config has under the same name is copied: a new
        client option named as its config key needs no line here. The
        centralized reference's one pooled client takes only how it computes
        (:data:`_POOLED_CLIENT`): it neither fails nor adds noise, and keeps
        its activations in a temporary folder.
        """
        if centralized:
            return cls(**_same_named(cls, config, _POOLED_CLIENT))
        # Activations too large for RAM go under the run's output folder (else a temporary one).
        cache_dir = Path(config.output) / "activations" if config.output else None
        return cls(**_same_named(cls, config), cache_dir=cache_dir, drop_probability=config.drop_clients,
                   round_deadline_s=config.round_deadline)
