"""The server side: FedACnnL, its variants and pFedACnnL as one parametrized loop.

Every algorithm of the paper is the same sequence of stages, switched on or
off by :class:`Variant`:

1. *initialization*: the seed is broadcast (clients build the same label
   encoders Q); with clustering, clients upload h_i (eq. 9) and the server
   groups them with K-means;
2. *federated optimization*: one round per trainable layer (Algorithm 1):
   clients upload X_l^T X_l and X_l^T Z_l, the server sums them per group
   and solves eq. (5)/(11), clients take their group's weights; batch sizes
   adapt by eq. (7) unless disabled;
3. *local personalization*: each client solves eq. (13) layer by layer.

Time is accounted per client and round by :mod:`fedlayer.timing`: measured
compute time (under the client's core limit), communication time from the
bytes moved over a configured bandwidth and latency, and idle time waiting
for the slowest client. See ``docs/design.md``.
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass

import numpy as np

import fastls

from .secure import FixedPoint, SecureAggregationError, admissible, choose_contributors, components, fraction_bits
from .timing import Clock, RoundLog, payload_bytes
from .transport import Sum, overall_accuracy, unpack_upper

__all__ = ["Variant", "VARIANTS", "adaptive_batch_sizes", "run_protocol", "AllClientsDropped", "survivors_solution"]

#: What a client's local_stats result sends up (the rest is local timing).
UPLOADED = ("G", "C", "zz", "rows")
#: The uploaded entries that are upper-triangular (the clients never fill G's lower triangle).
_UPPER = ("G",)
#: What the server asks a hidden layer's cross statistics to hold: X^T Y's coordinates in the label code Q_l
#: ("coordinates", n_classes columns per code; the server multiplies by Q_l) or X^T Z = X^T Y Q_l itself
#: ("targets", as the paper's Algorithm 1 uploads it).
UPLOAD_MODES = ("coordinates", "targets")


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


def adaptive_batch_sizes(durations, first_durations, first_batch, max_batch):
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


def _cluster(summaries, n_groups, seed):
    from sklearn.cluster import KMeans

    cids = sorted(summaries)
    if n_groups > len(cids):
        raise ValueError(f"groups (K={n_groups}) cannot exceed the number of clients ({len(cids)})")
    H = np.stack([summaries[cid] for cid in cids])
    labels = KMeans(n_clusters=n_groups, random_state=seed, n_init=10).fit_predict(H)
    return {cid: int(label) for cid, label in zip(cids, labels)}


def merge_small_groups(group_of, summaries, min_size):
    """Merge every group of fewer than ``min_size`` clients into the group with the nearest centroid.

    A secure sum over one client would be that client's statistics: groups
    below the minimum size join the group whose mean h is closest to theirs
    (smallest group first, until none is below the size or one group is
    left). Groups are renumbered 0..K'-1 in order of their first member.
    """
    groups = {}
    for cid, k in group_of.items():
        groups.setdefault(k, []).append(cid)
    while len(groups) > 1:
        small = min(groups, key=lambda k: (len(groups[k]), k))
        if len(groups[small]) >= min_size:
            break
        centroid = {k: np.mean([summaries[c] for c in members], axis=0) for k, members in groups.items()}
        nearest = min((k for k in groups if k != small),
                      key=lambda k: (float(np.sum((centroid[k] - centroid[small]) ** 2)), k))
        groups[nearest] += groups.pop(small)
    order = sorted(groups, key=lambda k: min(groups[k]))
    return {cid: new for new, k in enumerate(order) for cid in groups[k]}


def _timed_accuracy(log, transport, evaluate=True):
    """Overall test accuracy, its seconds kept in the round's log (evaluation is not training time).

    None, at no cost, when ``evaluate`` is false.
    """
    if not evaluate:
        return None
    start = time.perf_counter()
    accuracy = overall_accuracy(transport)
    log.eval_s = time.perf_counter() - start
    return accuracy


def _targets_cross(C, basis, position):
    """X^T Z = (X^T Y) Q_l from the summed coordinates X^T Y the server asked for, (d, k) -> (d, m)."""
    if C.shape[1] != basis.shape[0]:
        raise ValueError(f"layer {position + 1}: asked for X^T Y's coordinates in the label code "
                         f"({basis.shape[0]} columns), the clients' sum has {C.shape[1]}")
    return fastls.matmul(C, basis.astype(C.dtype, copy=False), check_finite=False)


def _gcv_choice(G, C, zz, rows, basis):
    """(gamma, its RidgePath, the round's record of the choice) by GCV on summed statistics; G is destroyed."""
    path = fastls.RidgePath.from_statistics(G, C, zz, rows, rhs_basis=basis, overwrite_g=True)
    gamma, grid, scores = path.select("gcv")
    return gamma, path, {"gamma": gamma, "criterion": "gcv", "grid": grid.tolist(), "scores": scores.tolist()}


def _secure_setup(transport, secure, group_of):
    """Keys once per run: public keys up, the SecAgg+ graph per group, each client told its neighbours' keys.

    No secret is shared at setup: the masks of a client that drops out are
    removed per sum (:meth:`fedlayer.secure.SecureClientState.reveal`).
    Returns the bytes the clients uploaded for it (their public keys).
    """
    publics = {cid: result["public"] for cid, result in transport.call(
        "secure_keys", {cid: {"min_survivors": secure.min_group_size} for cid in group_of})}
    groups = {}
    for cid, k in group_of.items():
        groups.setdefault(k, []).append(cid)
    graph = secure.plan(groups)
    secure.public = publics
    for _ in transport.call("secure_neighbours", {cid: {"public_keys": {nb: publics[nb] for nb in graph[cid]}}
                                                  for cid in group_of}):
        pass  # call yields as the clients answer: run it to the end
    return sum(map(len, publics.values()))


def _relay(transport, secure, outgoing, members, context):
    """Deliver encrypted shares (sender -> {receiver: bytes}) to the senders, along the neighbour graph only.

    ``members``: the clients the sum's self masks were shared among (a share
    to one of them that has failed since is simply not delivered).

    Returns (each receiver's seconds receiving, cid -> why it is out of the
    sum). A sender whose shares went off the graph, or whose share a
    receiver could not open, is the one out; the receiver stays (else any
    client could remove a chosen neighbour from a chosen sum).
    """
    incoming, offenders = secure.route(outgoing, members)
    out = _dropped_in("secure_self_mask", offenders)
    done = transport.sum("secure_receive", {c: {"shares": incoming.get(c, {}), "context": context}
                                            for c in sorted(outgoing)}, ())
    for receiver, receipt in sorted(done.receipts.items()):
        for sender, why in sorted(receipt.get("reports", {}).items()):
            out.setdefault(int(sender), f"secure_self_mask: reported by client {receiver}: {why}")
    out.update(_dropped_in("secure_receive (self-mask shares)", done.dropped))
    return {cid: r["compute_s"] for cid, r in done.receipts.items()}, out


def _dropped_in(step, dropped):
    return {cid: f"{step}: {why}" for cid, why in dropped.items()}


#: Maskings of one sum: when failures after the contributors were chosen leave survivors the rules forbid
#: unmasking, the survivors mask again (fresh self masks, a new context) over an admissible set of them.
SECURE_ATTEMPTS = 3
#: Why a client able to take part was left out of a sum (recorded in the round's ``dropped``).
EXCLUDED = ("secure: excluded from this sum as if it had dropped (a group's unmasked sums have the same contributors "
            "or contributors at least min_group_size={m} clients apart, and no component of their neighbour graph "
            "below min_group_size)")


def _secure_sum(transport, secure, args, context, stat_dtype, history=()):
    """A group's sums by the secure protocol (fedlayer.secure); returns (Sum with float totals, withheld).

    1. each client computes its statistics and declares their magnitude exponent
       (a client that fails here has not masked anything: it simply drops out);
    2. the server chooses the contributors among the others
       (:func:`fedlayer.secure.choose_contributors`): no component of their
       neighbour graph below ``secure.min_group_size``, and a set equal to or
       at least ``min_group_size`` clients away from each of the group's
       earlier unmasked sums (``history``); the rest are excluded as if they
       had dropped before masking, and nothing of theirs is revealed;
    3. the server fixes the fixed-point scale; the contributors share a fresh
       self mask with their neighbours among them (forwarded along the graph
       only; a sender whose share a receiver cannot open is dropped) and
       upload masked words; a client that fails before its upload is left out
       of the masks, one that fails in it is a dropout whose pairwise masks of
       this sum the survivors reveal the keys of;
    4. if the survivors still keep the rules, they reveal what the server needs
       to remove the masks (a survivor that fails to answer withholds its own
       self-mask shares, which the threshold covers, but a survivor that
       masked with a dropped client must answer, or the sum cannot be
       unmasked); if not, nothing is revealed and the survivors mask again
       over an admissible set of them (up to :data:`SECURE_ATTEMPTS` times).

    The Sum's receipts are the contributors of the unmasked sum. ``withheld``
    is None, or why the sum was not unmasked (the Sum then has no totals).
    """
    m = secure.min_group_size
    bound = transport.sum("secure_bound", {c: {**kwargs, "summed": list(UPLOADED), "upper": list(_UPPER)}
                                           for c, kwargs in args.items()}, ())
    alive = sorted(bound.receipts)
    failed = dict(bound.dropped)  # cid -> why it is out of the sum (its own failure, or a misbehaviour)
    protocol_s = dict.fromkeys(alive, 0.0)  # each client's time in the protocol's own steps
    sent = dict.fromkeys(alive, 0)  # bytes of the self-mask shares each client sent
    uploaded = {}  # bytes of the masked words each client uploaded, over the maskings of this sum
    if not alive:
        return Sum({}, {}, {}, failed), None
    position = args[next(iter(args))]["position"]
    history = [frozenset(p) for p in history]
    withheld = None
    for attempt in range(SECURE_ATTEMPTS):
        sum_context = context if attempt == 0 else (*context, attempt)
        able = [c for c in alive if c not in failed]
        # Fewer than the minimum: masked anyway and withheld below (so is a lone client's failure named).
        chosen = able if len(able) < m else choose_contributors(able, secure.graph, history, m)
        if chosen is None:
            withheld = (f"no set of the {len(able)} clients able to take part keeps the secure sums' rules "
                        f"(min_group_size={m}): not unmasked")
            break
        n_terms = len(chosen)
        frac_bits = fraction_bits([bound.receipts[c]["exponent"] for c in chosen], n_terms)
        self_masks = transport.sum("secure_self_mask", {c: {"context": sum_context, "members": chosen}
                                                        for c in chosen}, ())
        failed.update(_dropped_in("secure_self_mask", self_masks.dropped))
        outgoing = {}
        for cid, r in self_masks.receipts.items():
            outgoing[cid] = r["shares"]
            protocol_s[cid] += r["compute_s"]
            sent[cid] += sum(len(blob) for blob in r["shares"].values())
        seconds, out = _relay(transport, secure, outgoing, chosen, sum_context)
        for cid, value in seconds.items():
            protocol_s[cid] += value
        for cid, why in out.items():
            failed.setdefault(cid, why)
        members = [c for c in chosen if c not in failed]
        upload = transport.sum("secure_upload", {c: {"position": position, "context": sum_context,
                                                     "frac_bits": frac_bits, "n_terms": n_terms, "members": members}
                                                 for c in members}, UPLOADED, dtype=np.uint64)
        failed.update(_dropped_in("secure_upload", upload.dropped))
        survivors, dropped = sorted(upload.receipts), sorted(upload.dropped)
        for cid in survivors:
            protocol_s[cid] += upload.receipts[cid]["compute_s"]
        for cid in survivors:
            uploaded[cid] = uploaded.get(cid, 0) + upload.up_bytes[cid]
        if len(survivors) < m or admissible(survivors, secure.graph, history, m):
            break
    outcome = Sum({}, {}, {}, {}, upload.transport if chosen is not None else {})
    excluded = [c for c in alive if c not in failed and (chosen is None or c not in survivors)]
    outcome.dropped = {**failed, **dict.fromkeys(excluded, EXCLUDED.format(m=m))}
    if chosen is None:
        return outcome, withheld
    revealed_bytes = {}
    for cid in survivors:
        receipt = dict(bound.receipts[cid])
        receipt["compute_s"] += protocol_s[cid]
        receipt["frac_bits"] = frac_bits
        outcome.receipts[cid] = receipt
    if not survivors:
        return outcome, None
    if len(survivors) < m:
        withheld = (f"{len(survivors)} survivor(s) of the secure sum, fewer than min_group_size="
                    f"{m}: not unmasked")
    elif not admissible(survivors, secure.graph, history, m):
        withheld = (f"the {len(survivors)} survivors of {SECURE_ATTEMPTS} maskings break the secure sums' rules "
                    f"(min_group_size={m}): not unmasked")
    else:
        reveal = transport.sum("secure_reveal", {c: {"context": sum_context, "dropped": dropped,
                                                     "survivors": survivors} for c in survivors}, ())
        revealed = {}
        for cid, r in reveal.receipts.items():
            revealed[cid] = r["shares"]
            outcome.receipts[cid]["compute_s"] += r["compute_s"]
            revealed_bytes[cid] = len(pickle.dumps(r["shares"], protocol=pickle.HIGHEST_PROTOCOL))
        outcome.dropped.update(_dropped_in("secure_reveal (its upload is in the sum)", reveal.dropped))
        words = secure.unmask(sum_context, upload.totals, survivors, dropped, revealed, chosen)
        code = FixedPoint(frac_bits, n_terms)
        totals = {key: code.decode(w) for key, w in words.items()}
        totals.update({key: unpack_upper(totals[key]) for key in _UPPER if key in totals})
        totals = {key: (value.astype(stat_dtype, copy=False) if value.ndim else float(value))
                  for key, value in totals.items()}
        if "rows" in totals:
            totals["rows"] = int(round(totals["rows"]))
        outcome.totals = totals
    for cid in survivors:
        # The masked words, plus the protocol's own messages: the self-mask shares it sent and the shares it
        # revealed (pickled, as they travel under MPI).
        outcome.up_bytes[cid] = uploaded[cid] + sent[cid] + revealed_bytes.get(cid, 0)
    return outcome, withheld


def survivors_solution(clients, rounds, group_weights, gamma=100.0):
    """FedACnnL's layers solved centrally, each on the clients that did not drop out of it: the reference of dropouts.

    For each federated round (in order), the clients not in its ``dropped``
    record compute their statistics in one batch with the run's weights of
    the earlier layers, which are summed here outside any transport and
    solved with ``gamma``. A run with dropouts should give these weights up
    to summation order (secure: also the fixed point's rounding).

    Parameters
    ----------
    clients : list of Client
        Fresh clients holding the run's data (no simulated failures).
    rounds : list of dict
        The run's round records (``run_protocol``'s "rounds", or
        ``results.json``'s values), federated ones read in order.
    group_weights : list of ndarray
        The run's weights per layer, one group (FedACnnL).
    gamma : float

    Returns
    -------
    list of ndarray, one (n_in, n_out) array per layer
    """
    federated = [r for r in rounds if r["stage"] == "federated"]
    reference = []
    for position, record in enumerate(federated):
        dropped = {int(cid) for cid in record.get("dropped", {})}
        G = C = None
        for client in clients:
            if client.client_id in dropped:
                continue
            for earlier in range(position):
                client.set_weights(earlier, group_weights[earlier])
            stats = client.local_stats(position, 10**9)
            G = stats["G"] if G is None else G + stats["G"]
            C = stats["C"] if C is None else C + stats["C"]
        basis = clients[0].bases[position] if clients[0].bases else None
        reference.append(fastls.ridge_solve(G, C, gamma, rhs_basis=basis))
    return reference


def _shareable(W, dtype):
    """W contiguous in ``dtype`` and read-only: clients in this process share it instead of copying it."""
    W = np.ascontiguousarray(W, dtype=dtype)
    W.flags.writeable = False
    return W


def run_protocol(transport, n_layers, variant: Variant, *, gamma=100.0, eps=2500.0, groups=10, seed=0,
                 batch_size=64, max_batch_size=1024, clock=Clock(), stat_dtype=np.float64, progress=None,
                 checkpoint=None, resume=None, fingerprint=None, target_bases=None, gamma_scope="all",
                 secure=None, eval_every=1, weights_dtype=None, gamma_output=None, upload="coordinates"):
    """Run one algorithm over ``transport``'s clients; returns the results record.

    Parameters
    ----------
    transport : Transport
    n_layers : int
        Trainable layers of the model (rounds of the federated stage).
    variant : Variant
    gamma, eps : float or "auto"
        Ridge regularization (eqs. 5, 11) and proximal weight (eq. 13).
        ``gamma="auto"``: per layer and group, the server minimizes GCV from
        the summed G, C, tr(Z^T Z) and row count (clients upload the two
        numbers besides G and C) and solves with the chosen gamma from the
        same eigendecomposition. ``eps="auto"``: each client chooses its own
        per layer (:meth:`fedlayer.client.Client.personalize`).
    gamma_output : float, "auto" or None, default=None
        The output layer's gamma, where it should differ from the hidden
        layers' (None: ``gamma``). Its targets are the labels themselves, so
        GCV there scores the fit the accuracy depends on, while a hidden
        layer's GCV scores the fit of random label codes: on the CIFAR-10
        DCNN, ``gamma="auto"`` on every layer lost 0.9 point to 100 at width
        1/2, and ``gamma_output="auto"`` stayed within -0.06 / +0.29 at
        every width (docs/results/auto_regularization_notes.md).
    gamma_scope : {"all", "group"}, default="all"
        With ``gamma="auto"`` and several groups: one gamma per layer from
        the sums over all groups (the server then holds every group's sums
        until the layer is solved), or one per group from its own sums.
    groups : int
        K of K-means when ``variant.cluster``.
    seed : int
    batch_size, max_batch_size : int or dict cid -> int
        B_1^i and B_max^i.
    clock : Clock
    stat_dtype : dtype of the server's sums.
    progress : callable(str) or None
        Called with a short status after every round.
    checkpoint : path or None
        Write the server's state here (atomically) after every trained layer.
    resume : dict or None
        A state from :func:`fedlayer.checkpoint.load_checkpoint`: finished
        layers are sent to the clients again instead of being trained.
    fingerprint : dict
        Identifies the configuration in checkpoints.
    target_bases : list of (ndarray or None), optional
        Per layer, the label encoder Q_l the clients' targets were made with
        (Z_l = Y Q_l; None for the output layer). The server then solves on
        the n_classes columns of C Q_l^+ instead of the d_l columns of C
        (:func:`fastls.ridge_solve`'s ``rhs_basis``): the same weights.
    upload : {"coordinates", "targets"}, default="coordinates"
        What the server asks the clients for where ``target_bases`` gives a
        layer a label code narrower than its outputs: X^T Y's coordinates in
        Q_l (k < m columns; the server forms X^T Z = (X^T Y) Q_l) or X^T Z
        itself, as the paper's Algorithm 1 uploads it. The same weights; the
        coordinates are fewer bytes to upload, mask and sum.

    secure : fedlayer.secure.SecureServer or None
        Sum the statistics by the secure protocol (pairwise masks, fixed
        point; groups below ``secure.min_group_size`` merge first). A client
        whose statistics raise drops out of that round either way: the layer
        is solved on the others' sums and the round records it.
    eval_every : int, default=1
        Overall test accuracy after every ``eval_every``-th training round
        (federated and personalization rounds counted together) and after
        the last; the others record None. At full DCNN width an evaluation
        through the still-untrained later layers costs minutes.
    weights_dtype : dtype or None, default=None (``stat_dtype``)
        Precision in which the server keeps each solved layer, sends it to
        the clients (who personalize around it, eq. 13) and returns it. The
        solve itself runs in ``stat_dtype``. Pass the model's dtype when it
        is float32: the clients compute in it anyway, and a model of K
        groups then costs the server half the memory (at full DCNN width
        with K = 10: 2.4 GB instead of 4.9 GB, plus the clients' float32
        copies, which it then shares).

    Returns
    -------
    dict with "groups" (cid -> group), "rounds" (list of round records),
    "group_weights" (group -> list of (n_in, n_out) arrays) and "accuracy".
    """
    weights_dtype = np.dtype(stat_dtype if weights_dtype is None else weights_dtype)
    cids = transport.client_ids
    first_batch = batch_size if isinstance(batch_size, dict) else {cid: int(batch_size) for cid in cids}
    max_batch = max_batch_size if isinstance(max_batch_size, dict) else {cid: int(max_batch_size) for cid in cids}
    for cid in cids:
        if not 1 <= first_batch[cid] <= max_batch[cid]:
            raise ValueError(f"client {cid}: need 1 <= batch_size ({first_batch[cid]}) <= max_batch_size ({max_batch[cid]})")
    rounds = []
    if int(eval_every) < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    if upload not in UPLOAD_MODES:
        raise ValueError(f"upload must be one of {UPLOAD_MODES}, got {upload!r}")
    total_rounds = n_layers * (2 if variant.personalize else 1)

    def evaluated(done):
        """Whether the ``done``-th training round (1-based) is evaluated."""
        return done % int(eval_every) == 0 or done == total_rounds

    def status():
        accuracy = rounds[-1]["accuracy"]
        return "not evaluated" if accuracy is None else f"accuracy {accuracy:.4f}"

    # -- initialization stage ------------------------------------------------
    if resume is not None:
        group_of = resume["group_of"]
        rounds = list(resume["rounds"])
    elif variant.cluster:
        init = RoundLog("initialization", None, clock)
        summaries = {}
        for cid, result in transport.call("label_summary", {cid: {} for cid in cids}):
            summaries[cid] = result["h"]
            init.arrived(cid, 0.0, payload_bytes(result))
        start = time.perf_counter()
        group_of = _cluster(summaries, groups, seed)
        if secure is not None:
            group_of = merge_small_groups(group_of, summaries, secure.min_group_size)
        init.server_s = time.perf_counter() - start
        rounds.append(init.record(None))
    else:
        group_of = {cid: 0 for cid in cids}
    n_groups = max(group_of.values()) + 1
    secure_record = None
    # Secure sums: per group, the contributor sets of its unmasked sums and of their graph components (the
    # sums the server can decode), which every later sum of the group must equal or keep min_group_size away from.
    learned = {k: [] for k in range(n_groups)}
    if secure is not None:
        secure_record = {"setup_bytes": _secure_setup(transport, secure, group_of),
                         "neighbours": {str(cid): len(nb) for cid, nb in sorted(secure.graph.items())}}
        for record in rounds:  # resumed: the sums already unmasked bind the layers still to come
            for k, parts in record.get("contributors", {}).items():
                learned[int(k)] += [frozenset(sorted(c for part in parts for c in part)), *map(frozenset, parts)]

    # -- federated optimization stage ---------------------------------------
    batch = dict(first_batch)
    first_durations = None
    group_weights = {k: [] for k in range(n_groups)}
    layers_done = 0
    if resume is not None:
        layers_done = resume["layers_done"]
        batch, first_durations = resume["batch"], resume["first_durations"]
        group_weights = {k: [_shareable(W, weights_dtype) for W in layers] for k, layers in resume["group_weights"].items()}
        for position in range(layers_done):
            set_args = {cid: {"position": position, "weights": group_weights[group_of[cid]][position]} for cid in cids}
            for _ in transport.call("set_weights", set_args):
                pass
    for position in range(layers_done, n_layers):
        log = RoundLog("federated", position, clock)
        log.batch = dict(batch)
        weights = {}
        basis = target_bases[position] if target_bases else None
        coordinates = upload == "coordinates" and basis is not None
        layer_gamma = gamma_output if gamma_output is not None and position == n_layers - 1 else gamma
        auto_gamma = layer_gamma == "auto"
        pooled_gamma = auto_gamma and gamma_scope == "all" and n_groups > 1
        pending, pooled = {}, None  # pooled gamma: each group's sums, and their total
        # Secure sums with groups: a group left with too few survivors to unmask is solved on the
        # total of the other groups' sums (those are unmasked anyway), so that total is kept.
        keep_total = secure is not None and n_groups > 1
        withheld = {}  # group -> why its secure sum was not unmasked
        contributors = {}  # group -> the components of its unmasked secure sum (what the server decoded)

        def install(k, W):
            weights[k] = _shareable(W, weights_dtype)
            group_weights[k].append(weights[k])

        # One group at a time: the server holds one group's sums and one
        # client's statistics (at full DCNN width a layer's G is 2.7 GB, so
        # ten groups' sums at once would not fit in memory). Under MPI a rank
        # runs the next group's clients while its last partial sum travels.
        group_args = [(k, {cid: {"position": position, "batch_size": batch[cid], "round_index": position,
                                 **({"target_moments": True} if auto_gamma else {}),
                                 **({"coordinates": True} if coordinates else {})}
                           for cid in cids if group_of[cid] == k}) for k in range(n_groups)]
        # The transport returns each group's sums only (never one client's statistics), a group at a time.
        stream = None
        if secure is not None:
            group_sums = ((k, *_secure_sum(transport, secure, args, (position, k), stat_dtype, learned[k]))
                          for k, args in group_args)
        else:
            stream = transport.sum_groups("local_stats", group_args, UPLOADED, dtype=stat_dtype, upper=_UPPER)
            group_sums = ((k, outcome, None) for k, outcome in stream)
        try:
            for k, outcome, why_withheld in group_sums:
                for cid, receipt in outcome.receipts.items():
                    log.arrived(cid, receipt["compute_s"], outcome.up_bytes[cid], parts=receipt.get("parts"))
                log.dropped.update(outcome.dropped)
                log.transport.update({f"group {k} {where}": v for where, v in outcome.transport.items()})
                if why_withheld is not None:
                    if n_groups == 1:
                        raise SecureAggregationError(f"layer {position + 1}: {why_withheld}, and there is no other "
                                                     f"group's sum to solve it on")
                    withheld[k] = why_withheld
                    continue
                if not outcome.receipts:
                    if outcome.dropped and keep_total:
                        # Secure sums with groups: no survivor is the extreme of too few (solved the same way).
                        withheld[k] = (f"every client of the group dropped out ({len(outcome.dropped)}): "
                                       "no secure sum")
                        continue
                    if outcome.dropped:
                        # One client per kind of reason (a simulated failure, a secure step, ...): the last
                        # survivors of a secure sum drop for another reason than the clients before them.
                        kinds = {}
                        for cid, why in outcome.dropped.items():
                            kinds.setdefault(why.split(":")[0], f"client {cid}: {why}")
                        raise AllClientsDropped(f"every client of group {k} dropped out of layer {position + 1} "
                                                f"({len(outcome.dropped)}: {sorted(outcome.dropped)}); "
                                                + "; ".join(list(kinds.values())[:3]))
                    continue
                if secure is not None:
                    survivors = sorted(outcome.receipts)
                    contributors[k] = components(secure.graph, survivors)
                    learned[k] += [frozenset(survivors), *map(frozenset, contributors[k])]
                G_sum, C_sum = outcome.totals["G"], outcome.totals["C"]
                if coordinates:
                    C_sum = _targets_cross(C_sum, basis, position)
                zz_sum, rows_sum = float(outcome.totals.get("zz", 0.0)), int(outcome.totals.get("rows", 0))
                del outcome
                start = time.perf_counter()
                if pooled_gamma or keep_total:
                    if pooled is None:
                        pooled = [np.zeros_like(G_sum), np.zeros_like(C_sum), 0.0, 0]
                    pooled[0] += G_sum
                    pooled[1] += C_sum
                    pooled[2] += zz_sum
                    pooled[3] += rows_sum
                if pooled_gamma:
                    # Solved below, with the gamma chosen on the sums over all groups.
                    pending[k] = (G_sum, C_sum)
                elif auto_gamma:
                    chosen, path, log.selection[str(k) if n_groups > 1 else "all"] = _gcv_choice(
                        G_sum, C_sum, zz_sum, rows_sum, basis)
                    install(k, path.solve(chosen))
                    del path
                else:
                    install(k, fastls.ridge_solve(G_sum, C_sum, layer_gamma, overwrite_g=True, overwrite_c=True,
                                                  rhs_basis=basis))
                del G_sum, C_sum
                log.server_s += time.perf_counter() - start
        finally:
            if stream is not None:
                # A layer left early (an error): the transport takes the rest of the groups' messages
                # now, so that the clients' side can end this command before the next (or a stop).
                stream.close()
        if withheld and pooled is None:
            raise SecureAggregationError(f"layer {position + 1}: no group's secure sum could be unmasked ("
                                         + "; ".join(f"group {k}: {why}" for k, why in sorted(withheld.items())) + ")")
        if pending or withheld:
            start = time.perf_counter()
            chosen = layer_gamma
            if pooled_gamma:
                G_all = pooled[0].copy() if withheld else pooled[0]
                chosen, _, log.selection["all"] = _gcv_choice(G_all, *pooled[1:], basis)
                del G_all
            elif auto_gamma and withheld:
                chosen, _, log.selection["withheld"] = _gcv_choice(pooled[0].copy(), *pooled[1:], basis)
            for k, (G_k, C_k) in sorted(pending.items()):
                install(k, fastls.ridge_solve(G_k, C_k, chosen, overwrite_g=True, overwrite_c=True, rhs_basis=basis))
            pending.clear()
            if withheld:
                # Each withheld group gets the layer solved on the other groups' total.
                W_others = fastls.ridge_solve(pooled[0], pooled[1], chosen, overwrite_g=True, rhs_basis=basis)
                for k, why in sorted(withheld.items()):
                    install(k, W_others)
                    log.withheld[k] = {"why": why, "solved_on": sorted(set(range(n_groups)) - set(withheld))}
            pooled = None
            log.server_s += time.perf_counter() - start
        # Durations of this round drive the next round's batch sizes (eq. 7); a
        # client that dropped out keeps its batch size.
        durations = {cid: log.compute[cid] + log.up[cid] for cid in cids if cid in log.compute}
        first_durations = first_durations or durations
        if variant.adaptive:
            batch.update(adaptive_batch_sizes(durations, first_durations, first_batch, max_batch))
        set_args = {cid: {"position": position, "weights": weights[group_of[cid]]} for cid in cids}
        for cid, _ in transport.call("set_weights", set_args):
            log.sent(cid, weights[group_of[cid]].nbytes + 8)  # the weights and the next batch size
        record = log.record(_timed_accuracy(log, transport, evaluated(position + 1)))
        if contributors:
            # Anyone can check the differencing rule from the run's record (docs/design.md, "Secure sums").
            record["contributors"] = {str(k): parts for k, parts in sorted(contributors.items())}
        rounds.append(record)
        if checkpoint is not None:
            from .checkpoint import save_checkpoint

            save_checkpoint(checkpoint, fingerprint=fingerprint or {}, layers_done=position + 1, group_of=group_of,
                            group_weights=group_weights, batch=batch, first_durations=first_durations, rounds=rounds)
        if progress:
            progress(f"layer {position + 1}/{n_layers} trained, {status()}")

    # -- local personalization stage ----------------------------------------
    if variant.personalize:
        for position in range(n_layers):
            log = RoundLog("personalization", position, clock)
            # Secure runs: the server learns each client's busy time only, not what it chose (eps, form).
            args = {cid: {"position": position, "eps": eps, "batch_size": max_batch[cid],
                          **({"private": True} if secure is not None else {})} for cid in cids}
            # A sum of nothing: the transport's per-client receipts and dropouts, so a client whose local
            # step raises keeps its group's layer (recorded in `dropped`) instead of ending the run.
            outcome = transport.sum("personalize", args, keys=())
            log.dropped.update(outcome.dropped)
            for cid, result in outcome.receipts.items():
                log.arrived(cid, result["compute_s"], 0, parts=result.get("parts"))
                log.up[cid] = 0.0
                if "eps" in result:
                    log.chosen[cid] = {"eps": float(result["eps"]), "criterion": result["method"]}
                elif "form" in result:
                    log.chosen[cid] = {"form": result["form"]}  # the proximal solve's primal or dual form
            rounds.append(log.record(_timed_accuracy(log, transport, evaluated(n_layers + position + 1))))
            if progress:
                progress(f"layer {position + 1}/{n_layers} personalized, {status()}")

    if rounds[-1]["accuracy"] is None:
        # Resumed after its last round from a checkpoint of a run that did not evaluate that round
        # (a personalized run with eval_every): the result needs it.
        start = time.perf_counter()
        rounds[-1]["accuracy"] = overall_accuracy(transport)
        rounds[-1]["eval_s"] = time.perf_counter() - start
    return {
        "groups": {str(cid): k for cid, k in group_of.items()},
        **({"secure": secure_record} if secure_record else {}),
        "rounds": rounds,
        "group_weights": group_weights,
        "accuracy": rounds[-1]["accuracy"],
    }
