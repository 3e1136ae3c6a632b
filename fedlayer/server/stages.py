"""The server's stages over one :class:`~fedlayer.server.state.ServerState`.

Every algorithm of the paper is the same sequence of stages, switched on or
off by :class:`Variant`:

1. :func:`initialize`: the seed is broadcast (clients build the same label
   encoders Q); with clustering, clients upload h_i (eq. 9) and the server
   groups them with K-means; secure runs exchange keys;
2. :func:`train_layer`, once per trainable layer (Algorithm 1): clients
   upload X_l^T X_l and X_l^T Z_l, the server sums them per group and solves
   eq. (5)/(11) with the layer's solver (:mod:`fedlayer.server.solvers`),
   clients take their group's weights; batch sizes adapt by eq. (7) unless
   disabled. A layer whose Gram does not fit the server (:func:`plan_forms`)
   is solved in the dual from the clients' rotated rows instead;
3. :func:`personalize`: each client solves eq. (13) layer by layer.

:func:`run_protocol` runs them. Time is accounted per client and round by
:mod:`fedlayer.timing`. See ``docs/design.md``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import numpy as np

import fastls

from ..checkpoint import Checkpointing
from ..messages import (FACTORED, UPLOADED, UPPER, ClientMethod, Dropout, PersonalizeReply, PersonalizeRequest,
                        StatsReceipt, StatsRequest)
from ..options import ServerOptions
from ..secure import SecureAggregationError, SecureServer
from ..timing import Clock, RoundLog, payload_bytes
from ..transport import Transport, overall_accuracy
from .grouping import cluster, merge_small_groups
from .secure_sums import SecureSums
from .solvers import (LayerSolver, RowStack, SummedStatistics, choose_solver, primal_bytes, remove_stale_stacks,
                      solve_form)
from .state import ServerState, shareable

__all__ = ["AllClientsDropped", "ModelLayers", "ProtocolRun", "VARIANTS", "Variant", "adaptive_batch_sizes",
           "initialize", "personalize", "plan_forms", "run_protocol", "targets_cross", "train_layer"]


class AllClientsDropped(RuntimeError):
    """Every client of a group dropped out of a round: its layer cannot be solved."""


@dataclass(frozen=True)
class Variant:
    """Which stages an algorithm runs."""

    adaptive: bool = True      # eq. (7) batch sizes; False = "-WA"
    cluster: bool = False      # K-means groups; False = one group ("-WC")
    personalize: bool = False  # local personalization, eq. (13); False = "-WP"


VARIANTS = {
    "acnnl": Variant(adaptive=False),  # centralized: run with a single client holding all data
    "fedacnnl": Variant(),
    "fedacnnl-wa": Variant(adaptive=False),
    "pfedacnnl": Variant(cluster=True, personalize=True),
    "pfedacnnl-wc": Variant(cluster=False, personalize=True),
    "pfedacnnl-wp": Variant(cluster=True, personalize=False),
}


def adaptive_batch_sizes(durations: dict[int, float], first_durations: dict[int, float], first_batch: dict[int, int],
                         max_batch: dict[int, int]) -> dict[int, int]:
    """Eq. (7): B_{l+1}^i = min(ceil((T_l^i - T_{l-1}^i) / min_j (T_1^j - T_0^j) * B_1^i), B_max^i).

    Parameters
    ----------
    durations : dict cid -> float
        This round's busy time of each client (compute + communication).
    first_durations : dict cid -> float
        The same in round 1.
    first_batch, max_batch : dict cid -> int

    Returns
    -------
    dict cid -> int
    """
    fastest = min(first_durations.values())
    if fastest <= 0:
        return dict(first_batch)
    return {
        cid: int(min(math.ceil(durations[cid] / fastest * first_batch[cid]), max_batch[cid]))
        for cid in durations
    }


def targets_cross(C: np.ndarray, basis: np.ndarray, position: int) -> np.ndarray:
    """X^T Z = (X^T Y) Q_l from the summed coordinates X^T Y the server asked for, (d, k) -> (d, m)."""
    if C.shape[1] != basis.shape[0]:
        raise ValueError(f"layer {position + 1}: asked for X^T Y's coordinates in the label code "
                         f"({basis.shape[0]} columns), the clients' sum has {C.shape[1]}")
    return fastls.matmul(C, basis.astype(C.dtype, copy=False), check_finite=False)


@dataclass(frozen=True)
class ModelLayers:
    """What the server knows of the model's trainable layers, each list one entry per layer.

    Attributes
    ----------
    bases : list of (ndarray or None) or None
        The label code Q_l the clients' targets were made with (Z_l = Y Q_l;
        None for the output layer). The server then solves on the n_classes
        columns of C Q_l^+ instead of the d_l columns of C
        (:func:`fastls.ridge_solve`'s ``rhs_basis``): the same weights.
    shapes : list of (int, int) or None
        The layer's least-squares (inputs, outputs): with them, a layer whose
        Gram does not fit ``ServerOptions.server_memory`` is solved in the dual
        (:func:`plan_forms`); without them, only ``server_solve="dual"`` is.
    """

    bases: Sequence | None = None
    shapes: Sequence | None = None

    def basis(self, position: int) -> np.ndarray | None:
        """Q_l of layer ``position`` (None: its targets are the one-hot labels, or no codes were given)."""
        return self.bases[position] if self.bases else None


@dataclass
class ProtocolRun:
    """What the stages of one run share and never change: the clients, the algorithm, its options.

    Attributes
    ----------
    transport : Transport
    n_layers : int
        Trainable layers of the model (rounds of the federated stage).
    variant : Variant
    options : ServerOptions
    first_batch, max_batch : dict cid -> int
        B_1^i and B_max^i (:meth:`fedlayer.options.BatchPolicy.sizes`).
    layers : ModelLayers
        The trainable layers' label codes and least-squares shapes.
    secure : SecureSums or None
    clock : Clock
    progress : callable(str) or None
    checkpoint : Checkpointing or None
    forms : list of (str, dict) or None
        Per layer, "primal" or "dual" and the record of the choice
        (:func:`plan_forms`, after :func:`initialize`).
    rows : dict cid -> list of int
        Each client's least-squares rows per layer, where the plan asked for them.
    """

    transport: Transport
    n_layers: int
    variant: Variant
    options: ServerOptions
    first_batch: dict
    max_batch: dict
    layers: ModelLayers = field(default_factory=ModelLayers)
    secure: SecureSums | None = None
    clock: Clock = field(default_factory=Clock)
    progress: Callable[[str], None] | None = None
    checkpoint: Checkpointing | None = None
    forms: list | None = None
    rows: dict = field(default_factory=dict)

    @property
    def total_rounds(self) -> int:
        return self.n_layers * (2 if self.variant.personalize else 1)

    def evaluated(self, done: int) -> bool:
        """Whether the ``done``-th training round (1-based) is evaluated."""
        return done % int(self.options.eval_every) == 0 or done == self.total_rounds

    def report(self, state: ServerState, what: str) -> None:
        """Tell ``progress`` that ``what`` is done, with the last round's accuracy."""
        if self.progress:
            accuracy = state.rounds[-1]["accuracy"]
            self.progress(f"{what}, {'not evaluated' if accuracy is None else f'accuracy {accuracy:.4f}'}")

    def client_counter(self) -> Callable[[int], None] | None:
        """A callback for a round's clients as they deliver (a transport's ``on_client``), which tells
        ``progress`` how many of the round's clients are done, when it can take it (a ``within_round(done,
        total)`` method): a round of the full-width DCNN takes minutes. None when it cannot."""
        within = getattr(self.progress, "within_round", None)
        if within is None:
            return None
        done, total = itertools.count(1), len(self.transport.client_ids)
        return lambda cid: within(next(done), total)

    def status(self, what: str) -> None:
        """Tell ``progress`` what the server does now that takes long without a client to count (a
        ``status(what)`` method, when it has one): the dual solve and the evaluation of a full-width
        round take minutes each."""
        status = getattr(self.progress, "status", None)
        if status is not None:
            status(what)

    def timed_accuracy(self, log: RoundLog, evaluate: bool = True, code_layer: int | None = None) -> float | None:
        """Overall test accuracy, its seconds kept in the round's log (evaluation is not training time).

        None, at no cost, when ``evaluate`` is false. ``code_layer``: score the
        label-code readout of that hidden layer instead of the network.
        """
        if not evaluate:
            return None
        self.status("evaluating on the test splits")
        start = time.perf_counter()
        args = None if code_layer is None else {cid: {"code_layer": code_layer} for cid in self.transport.client_ids}
        accuracy = overall_accuracy(self.transport, args)
        log.eval_s = time.perf_counter() - start
        return accuracy


# -- initialization -------------------------------------------------------------------------------------
def initialize(run: ProtocolRun, resume: ServerState | None = None) -> ServerState:
    """The state the federated stage starts from: groups (clustered when the variant asks), keys when secure.

    A ``resume`` state (:meth:`ServerState.from_checkpoint`) keeps its groups
    and rounds; its finished layers are sent to the clients again.
    """
    transport, options = run.transport, run.options
    remove_stale_stacks(options.scratch_dir)
    if resume is not None:
        state = resume
        state.group_weights = {k: [shareable(W, options.weights_in) for W in layers]
                               for k, layers in state.group_weights.items()}
    else:
        rounds = []
        group_of = _groups(run, rounds)
        state = ServerState(group_of, dict(run.first_batch), None,
                            {k: [] for k in range(max(group_of.values()) + 1)}, rounds, 0)
    if run.secure is not None:
        run.secure.setup(transport, state.group_of, state.rounds)
    for position in range(state.layers_done):
        _send_weights(run, state, position, {k: layers[position] for k, layers in state.group_weights.items()})
    return state


def _groups(run, rounds):
    """cid -> group: K-means on the label summaries when the variant clusters (its round appended to
    ``rounds``), else one group."""
    cids = run.transport.client_ids
    if not run.variant.cluster:
        return {cid: 0 for cid in cids}
    init = RoundLog("initialization", None, run.clock)
    summaries = {}
    for cid, result in run.transport.call(ClientMethod.LABEL_SUMMARY, {cid: {} for cid in cids}):
        summaries[cid] = result["h"]
        init.arrived(cid, 0.0, payload_bytes(result))
    start = time.perf_counter()
    group_of = cluster(summaries, run.options.groups, run.options.seed)
    if run.secure is not None:
        group_of = merge_small_groups(group_of, summaries, run.secure.min_group_size)
    init.server_s = time.perf_counter() - start
    rounds.append(init.record(None))
    return group_of


def _send_weights(run, state, position, weights, log=None):
    """Every client takes its group's weights of layer ``position`` (counted in ``log`` when given)."""
    set_args = {cid: {"position": position, "weights": weights[state.group_of[cid]]}
                for cid in run.transport.client_ids}
    for cid, _ in run.transport.call(ClientMethod.SET_WEIGHTS, set_args):
        if log is not None:
            log.sent(cid, weights[state.group_of[cid]].nbytes + 8)  # the weights and the next batch size


# -- how each layer is solved ---------------------------------------------------------------------------
def plan_forms(run: ProtocolRun, state: ServerState) -> list[tuple[str, dict]]:
    """Per layer, whether the server solves it from the Grams (primal) or the factored rows (dual), and why.

    The clients' row counts are asked for (:meth:`fedlayer.client.Client.train_rows`)
    only where the rule needs them: a forced dual, or a Gram larger than
    the server's memory. A secure run whose layer needs the dual is refused
    here, before any layer is trained: secure sums carry sums, not rows.
    """
    options, n_layers = run.options, run.n_layers
    memory = options.memory_bytes
    itemsize = np.dtype(options.stat_dtype).itemsize
    shapes = run.layers.shapes
    gcv = [options.gamma_of(position, n_layers) == "auto" for position in range(n_layers)]
    wide = shapes is not None and any(primal_bytes(d, itemsize, gcv[p]) > memory for p, (d, _) in enumerate(shapes))
    if options.server_solve == "dual" or (options.server_solve == "auto" and wide):
        args = {cid: {} for cid in run.transport.client_ids}
        run.rows = {cid: list(result["rows"]) for cid, result in run.transport.call(ClientMethod.TRAIN_ROWS, args)}
    forms = []
    for position in range(n_layers):
        d, n_out = shapes[position] if shapes is not None else (0, 0)
        basis = run.layers.basis(position)
        group_rows = _group_rows(run, state, position)
        form, record = solve_form(options.server_solve, position, d, max(group_rows.values()) if group_rows else None,
                                  n_out if basis is None else basis.shape[0], memory, itemsize, gcv[position])
        if form == "dual":  # a gamma the dual cannot choose is refused now, not after the layers before it
            choose_solver(options.gamma_of(position, n_layers), options.gamma_scope, state.n_groups, basis,
                          form="dual", position=position)
        if form == "dual" and run.secure is not None:
            raise ValueError(
                f"layer {position + 1} (d = {d}) must be solved in the dual: its Gram takes "
                f"{record['gram_bytes']:,} bytes ({record['gram_bytes'] / 2**30:.1f} GiB) against the server's "
                f"{memory / 2**30:.1f} GiB, and secure sums cannot carry the clients' factored rows. Run without "
                f"--secure, raise --server-memory so the Gram fits, or use a narrower model (--width)"
                if options.server_solve == "auto" else
                f"layer {position + 1} (d = {d}, a Gram of {record['gram_bytes']:,} bytes): --server-solve dual "
                f"uploads the clients' factored rows, which secure sums cannot carry. Run without --secure, or "
                f"with --server-solve auto or primal")
        forms.append((form, record))
    return forms


def _group_rows(run, state, position):
    """group -> least-squares rows of layer ``position`` its clients hold together (empty when not asked for)."""
    totals = {}
    for cid, rows in run.rows.items():
        k = state.group_of[cid]
        totals[k] = totals.get(k, 0) + rows[position]
    return totals


# -- federated optimization -----------------------------------------------------------------------------
@dataclass
class _LayerRound:
    """One federated round in progress: its log, its solver and what the groups gave."""

    position: int
    log: RoundLog
    solver: LayerSolver
    basis: np.ndarray | None
    coordinates: bool
    weights: dict = field(default_factory=dict)       # group -> the layer's weights
    withheld: dict = field(default_factory=dict)      # group -> why its secure sum was not unmasked
    contributors: dict = field(default_factory=dict)  # group -> the components of its unmasked secure sum
    solve: dict | None = None                         # a dual round's form and the cost rule's record


def train_layer(run: ProtocolRun, state: ServerState, position: int) -> None:
    """One federated round: layer ``position`` trained, sent to the clients, recorded (and checkpointed)."""
    log = RoundLog("federated", position, run.clock)
    log.batch = dict(state.batch)
    basis = run.layers.basis(position)
    gamma = run.options.gamma_of(position, run.n_layers)
    n_groups = state.n_groups
    form, plan = run.forms[position] if run.forms else ("primal", {})
    coordinates = run.options.upload == "coordinates" and basis is not None
    # Secure sums with groups: a group left with too few survivors to unmask is solved on the total of the
    # other groups' sums (those are unmasked anyway), so that total is kept.
    solver = choose_solver(gamma, run.options.gamma_scope, n_groups, basis,
                           keep_total=run.secure is not None and n_groups > 1, form=form,
                           expand=basis if coordinates else None, position=position)
    layer = _LayerRound(position, log, solver, basis, coordinates)
    # The dual's GCV needs no target moments: the rows carry them.
    moments = gamma == "auto" and form != "dual"
    request = {cid: StatsRequest(position, state.batch[cid], position, target_moments=moments,
                                 coordinates=layer.coordinates).kwargs() for cid in run.transport.client_ids}
    group_args = [(k, {cid: request[cid] for cid in run.transport.client_ids if state.group_of[cid] == k})
                  for k in range(n_groups)]
    on_client = run.client_counter()
    if form == "dual":
        layer.solve = {"form": form, **plan}
        for k, args in group_args:
            _take_rows(run, state, layer, k, args, on_client)
    else:
        # One group at a time: the server holds one group's sums and one client's statistics (docs/design.md).
        with contextlib.closing(_group_sums(run, group_args, on_client)) as sums:
            for k, outcome, why_withheld in sums:
                _take_group(run, state, layer, k, outcome, why_withheld)
    _finish_layer(run, state, layer)
    _end_round(run, state, layer)


def _group_sums(run, group_args, on_client=None):
    """(group, Sum, why it was withheld or None) per group; the transport's sums, or the secure protocol's.

    ``on_client(cid)`` as each client's statistics arrive (not in secure sums, whose steps each visit every client).
    """
    if run.secure is not None:
        for k, args in group_args:
            yield (k, *run.secure.group_sum(run.transport, k, args, run.options.stat_dtype))
        return
    stream = run.transport.sum_groups(ClientMethod.LOCAL_STATS, group_args, UPLOADED, dtype=run.options.stat_dtype,
                                      upper=UPPER, on_client=on_client)
    try:
        for k, outcome in stream:
            yield k, outcome, None
    finally:
        # A layer left early (an error): the transport takes the rest of the groups' messages now, so that
        # the clients' side can end this command before the next (or a stop).
        stream.close()


def _take_group(run, state, layer, k, outcome, why_withheld):
    """Record group ``k``'s sum and hand it to the layer's solver (or withhold the group, or stop the run)."""
    log, n_groups = layer.log, state.n_groups
    for cid, receipt in outcome.receipts.items():
        stats = StatsReceipt.from_result(receipt)
        log.arrived(cid, stats.compute_s, outcome.up_bytes[cid], parts=stats.parts)
    log.dropped.update({cid: str(why) for cid, why in outcome.dropped.items()})
    log.transport.update({f"group {k} {where}": v for where, v in outcome.transport.items()})
    if why_withheld is not None:
        if n_groups == 1:
            raise SecureAggregationError(f"layer {layer.position + 1}: {why_withheld}, and there is no other "
                                         f"group's sum to solve it on")
        layer.withheld[k] = why_withheld
        return
    if not outcome.receipts:
        if outcome.dropped and run.secure is not None and n_groups > 1:
            # Secure sums with groups: no survivor is the extreme of too few (solved the same way).
            layer.withheld[k] = f"every client of the group dropped out ({len(outcome.dropped)}): no secure sum"
        elif outcome.dropped:
            _all_dropped(k, layer.position, outcome.dropped)
        return
    if run.secure is not None:
        layer.contributors[k] = run.secure.learn(k, outcome.receipts)
    totals, outcome.totals = outcome.totals, {}  # the sums are the solver's from here (their memory too)
    C = targets_cross(totals["C"], layer.basis, layer.position) if layer.coordinates else totals["C"]
    sums = SummedStatistics(totals.pop("G"), C, float(totals.get("zz", 0.0)), int(totals.get("rows", 0)))
    del totals, C
    start = time.perf_counter()
    W = layer.solver.add(k, sums, log.selection)
    del sums
    if W is not None:
        layer.weights[k] = state.install(k, W, run.options.weights_in)
    log.server_s += time.perf_counter() - start


def _take_rows(run, state, layer, k, args, on_client=None):
    """Stack group ``k``'s factored uploads client by client and solve the group over its rows (a dual round)."""
    log, position = layer.log, layer.position
    capacity = sum(run.rows[cid][position] for cid in args)
    # The stacked rows take what the budget leaves beside the group's N x N system.
    stack = RowStack(capacity, run.options.memory_bytes - capacity * capacity * 8, run.options.scratch_dir,
                     f"rows_layer{position + 1}_group{k}")
    dropped = {}
    try:
        for cid, result in run.transport.call(ClientMethod.FACTORED_ROWS, args):
            if on_client is not None:
                on_client(cid)
            if "dropout" in result:
                dropped[cid] = Dropout(result["dropout"], "ClientDropout", str(ClientMethod.FACTORED_ROWS))
                continue
            stats = StatsReceipt.from_result({key: value for key, value in result.items() if key not in FACTORED})
            stack.append(result["F"], result["UZ"])
            log.arrived(cid, stats.compute_s, payload_bytes({key: result[key] for key in FACTORED}),
                        parts=stats.parts)
            del result
        log.dropped.update({cid: str(why) for cid, why in dropped.items()})
        if stack.rows == 0:  # every client holds a row (Client refuses an empty split): all of them dropped
            _all_dropped(k, position, dropped)
        layer.solve.setdefault("mapped", {})[str(k)] = stack.mapped
        run.status(f"server solving group {k} in the dual over {stack.rows:,} rows" if state.n_groups > 1 else
                   f"server solving in the dual over {stack.rows:,} rows")
        start = time.perf_counter()
        W = layer.solver.add(k, stack.stacked(), log.selection)
        if k in getattr(layer.solver, "refinements", {}):  # a DualSolve's: float32 products refined in float64
            layer.solve.setdefault("refinement", {})[str(k)] = layer.solver.refinements[k]
        layer.weights[k] = state.install(k, W, run.options.weights_in)
        log.server_s += time.perf_counter() - start
    finally:
        stack.close()


def _all_dropped(k, position, dropped):
    """Raise AllClientsDropped for group ``k``, naming one client per kind of failure (a simulated one, a secure
    step, ...): the last survivors of a secure sum drop for another reason than the clients before them."""
    kinds = {}
    for cid, why in dropped.items():
        kinds.setdefault(why.kind, f"client {cid}: {why}")
    raise AllClientsDropped(f"every client of group {k} dropped out of layer {position + 1} "
                            f"({len(dropped)}: {sorted(dropped)}); " + "; ".join(list(kinds.values())[:3]))


def _finish_layer(run, state, layer):
    """The groups the solver holds, and the withheld ones (solved on the other groups' total)."""
    if layer.withheld and layer.solver.total is None:
        raise SecureAggregationError(f"layer {layer.position + 1}: no group's secure sum could be unmasked ("
                                     + "; ".join(f"group {k}: {why}" for k, why in sorted(layer.withheld.items()))
                                     + ")")
    start = time.perf_counter()
    for k, W in layer.solver.finish(layer.withheld, layer.log.selection).items():
        layer.weights[k] = state.install(k, W, run.options.weights_in)
    for k, why in sorted(layer.withheld.items()):
        layer.log.withheld[k] = {"why": why, "solved_on": sorted(set(range(state.n_groups)) - set(layer.withheld))}
    layer.log.server_s += time.perf_counter() - start


def _end_round(run, state, layer):
    """Next batch sizes (eq. 7), weights to the clients, the round's record, the checkpoint, the progress."""
    log, cids = layer.log, run.transport.client_ids
    # Durations of this round drive the next round's batch sizes (eq. 7); a client that dropped out keeps its
    # batch size.
    durations = {cid: log.compute[cid] + log.up[cid] for cid in cids if cid in log.compute}
    state.first_durations = state.first_durations or durations
    if run.variant.adaptive:
        state.batch.update(adaptive_batch_sizes(durations, state.first_durations, run.first_batch, run.max_batch))
    _send_weights(run, state, layer.position, layer.weights, log)
    readout = run.options.round_accuracy == "codes" and layer.position < run.n_layers - 1
    record = log.record(run.timed_accuracy(log, run.evaluated(layer.position + 1),
                                           layer.position if readout else None))
    if readout and record["accuracy"] is not None:
        record["accuracy_of"] = "codes"  # the layer's label-code readout, not the network's prediction
    if layer.contributors:
        # Anyone can check the differencing rule from the run's record (docs/design.md, "Secure sums").
        record["contributors"] = {str(k): parts for k, parts in sorted(layer.contributors.items())}
    if layer.solve is not None:
        record["solve"] = layer.solve
    state.rounds.append(record)
    state.layers_done = layer.position + 1
    if run.checkpoint is not None:
        run.checkpoint.save(state)
    run.report(state, f"layer {layer.position + 1}/{run.n_layers} trained")


# -- local personalization ------------------------------------------------------------------------------
def personalize(run: ProtocolRun, state: ServerState) -> None:
    """Every client personalizes every layer around its group's weights (eq. 13), one round per layer.

    A client whose local step raises keeps its group's layer (recorded in
    the round's ``dropped``) instead of ending the run. Secure runs: the
    server learns each client's busy time only, not what it chose.

    With a checkpoint, each client keeps every layer it personalizes in the
    checkpoint's personal folder, and the server's checkpoint counts the
    rounds done: a run resumed from it has its clients read their layers
    back and personalizes the rest.
    """
    checkpoint = run.checkpoint
    keep = {} if checkpoint is None else {"keep_in": str(checkpoint.personal_folder), "tag": checkpoint.tag}
    if state.personalized:
        _restore_personalized(run, state, **keep)
    for position in range(state.personalized, run.n_layers):
        log = RoundLog("personalization", position, run.clock)
        args = {cid: PersonalizeRequest(position, run.options.eps_of(position, run.n_layers), run.max_batch[cid],
                                        private=run.secure is not None, **keep).kwargs()
                for cid in run.transport.client_ids}
        # A sum of nothing: the transport's per-client receipts and dropouts.
        outcome = run.transport.sum(ClientMethod.PERSONALIZE, args, keys=(), on_client=run.client_counter())
        log.dropped.update({cid: str(why) for cid, why in outcome.dropped.items()})
        for cid, result in outcome.receipts.items():
            reply = PersonalizeReply.from_result(result)
            log.arrived(cid, reply.compute_s, 0, parts=reply.parts)
            log.up[cid] = 0.0
            if reply.choice():
                log.chosen[cid] = reply.choice()
        state.rounds.append(log.record(run.timed_accuracy(log, run.evaluated(run.n_layers + position + 1))))
        state.personalized = position + 1
        if checkpoint is not None:
            checkpoint.save(state)
        run.report(state, f"layer {position + 1}/{run.n_layers} personalized")


def _restore_personalized(run, state, keep_in, tag):
    """Each client reads back the layers it personalized before the checkpoint (those of the rounds it was in)."""
    rounds = [r for r in state.rounds if r["stage"] == "personalization"][:state.personalized]
    args = {cid: {"positions": [r["layer"] for r in rounds if str(cid) in r["clients"]], "folder": keep_in, "tag": tag}
            for cid in run.transport.client_ids}
    run.status(f"clients reading back their {state.personalized} personalized layer(s)")
    for _ in run.transport.call(ClientMethod.RESTORE_PERSONALIZED, args):
        pass  # nothing comes back: the layers stay on the clients' side


# -- the whole protocol ---------------------------------------------------------------------------------
def run_protocol(transport: Transport, n_layers: int, variant: Variant, options: ServerOptions | None = None, *,
                 layers: ModelLayers | None = None, secure: SecureServer | None = None, clock: Clock = Clock(),
                 progress: Callable[[str], None] | None = None, checkpoint: Checkpointing | None = None,
                 resume: ServerState | None = None) -> dict:
    """Run one algorithm over ``transport``'s clients; returns the results record.

    Parameters
    ----------
    transport : Transport
    n_layers : int
        Trainable layers of the model (rounds of the federated stage).
    variant : Variant
    options : ServerOptions, default=ServerOptions()
    layers : ModelLayers, optional
        The label codes and least-squares shapes of the trainable layers
        (default: one-hot targets, and the dual only when forced).
    secure : fedlayer.secure.SecureServer or None
        Sum the statistics by the secure protocol (pairwise masks, fixed
        point; groups below ``secure.min_group_size`` merge first). A client
        whose statistics raise drops out of that round either way: the layer
        is solved on the others' sums and the round records it.
    clock : Clock
    progress : callable(str) or None
        Called with a short status after every round.
    checkpoint : fedlayer.checkpoint.Checkpointing or None
        Where the server's state is written (atomically) after every trained
        and every personalized layer.
    resume : ServerState or None
        A checkpoint's state (:meth:`ServerState.from_checkpoint`): finished
        layers are sent to the clients again instead of being trained, and
        the clients read back the layers they personalized (from
        ``checkpoint``'s personal folder) instead of personalizing them.

    Returns
    -------
    dict with "groups" (cid -> group), "rounds" (list of round records),
    "group_weights" (group -> list of (n_in, n_out) arrays), "accuracy", and
    "secure" (the key setup's record) in secure runs.
    """
    options = ServerOptions() if options is None else options
    if resume is not None and resume.personalized and checkpoint is None:
        raise ValueError(f"the resumed state has {resume.personalized} personalization round(s) done, whose layers "
                         "the clients keep beside its checkpoint: pass that checkpoint (or the state "
                         "without_personalization())")
    first_batch, max_batch = options.batch.sizes(transport.client_ids)
    run = ProtocolRun(transport, n_layers, variant, options, first_batch, max_batch,
                      ModelLayers() if layers is None else layers, None if secure is None else SecureSums(secure),
                      clock, progress, checkpoint)
    state = initialize(run, resume)
    run.forms = plan_forms(run, state)
    for position in range(state.layers_done, n_layers):
        train_layer(run, state, position)
    if variant.personalize:
        personalize(run, state)
    if state.rounds[-1]["accuracy"] is None:
        # Resumed after its last round from a checkpoint of a run that did not evaluate that round (a
        # personalized run with eval_every): the result needs it.
        start = time.perf_counter()
        state.rounds[-1]["accuracy"] = overall_accuracy(transport)
        state.rounds[-1]["eval_s"] = time.perf_counter() - start
    return {
        "groups": {str(cid): k for cid, k in state.group_of.items()},
        **({"secure": run.secure.record} if run.secure is not None else {}),
        "rounds": state.rounds,
        "group_weights": state.group_weights,
        "accuracy": state.rounds[-1]["accuracy"],
    }
