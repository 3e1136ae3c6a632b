"""The server's half of the secure sums (:mod:`fedlayer.secure`): keys, contributors, masking, unmasking.

:class:`SecureSums` holds one run's secure session: the
:class:`fedlayer.secure.SecureServer` (neighbour graph, routing, unmasking)
and, per group, the contributor sets of its unmasked sums, which bind every
later sum of the group. Its steps run on :meth:`Transport.sum
<fedlayer.transport.Transport.sum>`: the clients mask their entries, the
transport sums words.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from collections.abc import Collection, Mapping

import numpy as np
import numpy.typing as npt

from ..messages import UPLOADED, UPPER, ClientMethod, Dropout
from ..secure import FixedPoint, SecureServer, admissible, choose_contributors, components, fraction_bits
from ..transport import Sum, Transport, unpack_upper

__all__ = ["EXCLUDED", "SECURE_ATTEMPTS", "SecureSums"]

#: Maskings of one sum: when failures after the contributors were chosen leave survivors the rules forbid
#: unmasking, the survivors mask again (fresh self masks, a new context) over an admissible set of them.
SECURE_ATTEMPTS = 3
#: The protocol step a client left out of a sum by the server's choice of contributors is recorded under.
_EXCLUDED_STEP = "secure"
_EXCLUDED_MESSAGE = ("excluded from this sum as if it had dropped (a group's unmasked sums have the same "
                     "contributors or contributors at least min_group_size={m} clients apart, and no component of "
                     "their neighbour graph below min_group_size)")
#: Why a client able to take part was left out of a sum, as the round's ``dropped`` record says it.
EXCLUDED = f"{_EXCLUDED_STEP}: {_EXCLUDED_MESSAGE}"


def _dropped_in(step, dropped):
    """Each dropout of ``dropped`` (cid -> Dropout), recorded under the protocol step ``step``."""
    return {cid: why.in_step(step) for cid, why in dropped.items()}


@dataclass
class _Masking:
    """One secure sum's progress over its maskings."""

    alive: list
    failed: dict                 # cid -> Dropout: out of the sum (its own failure, or a misbehaviour)
    protocol_s: dict             # cid -> seconds in the protocol's own steps
    sent: dict                   # cid -> bytes of the self-mask shares it sent
    uploaded: dict = field(default_factory=dict)  # cid -> bytes of the masked words it uploaded
    chosen: list | None = None
    survivors: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    upload: Sum | None = None
    context: tuple = ()
    frac_bits: int = 0
    n_terms: int = 0


class SecureSums:
    """One run's secure session on the server.

    Parameters
    ----------
    server : SecureServer
    """

    def __init__(self, server: SecureServer) -> None:
        self.server = server
        self.learned: dict[int, list[frozenset]] = {}
        self.record: dict | None = None  # what the key setup cost (:meth:`setup`)

    @property
    def min_group_size(self) -> int:
        return self.server.min_group_size

    def setup(self, transport: Transport, group_of: dict[int, int], rounds: Mapping[int, int]) -> dict:
        """Keys once per run: public keys up, the SecAgg+ graph per group, each client told its neighbours' keys.

        No secret is shared at setup: the masks of a client that drops out
        are removed per sum (:meth:`fedlayer.secure.SecureClientState.reveal`).
        ``rounds``: the records of a resumed run, whose unmasked sums bind
        the layers still to come. Returns the run's ``secure`` record (kept
        as :attr:`record`).
        """
        secure = self.server
        publics = {cid: result["public"] for cid, result in transport.call(
            ClientMethod.SECURE_KEYS, {cid: {"min_survivors": secure.min_group_size} for cid in group_of})}
        groups = {}
        for cid, k in group_of.items():
            groups.setdefault(k, []).append(cid)
        graph = secure.plan(groups)
        secure.public = publics
        for _ in transport.call(ClientMethod.SECURE_NEIGHBOURS,
                                {cid: {"public_keys": {nb: publics[nb] for nb in graph[cid]}} for cid in group_of}):
            pass  # call yields as the clients answer: run it to the end
        self.learned = {k: [] for k in range(max(group_of.values()) + 1)}
        for record in rounds:
            for k, parts in record.get("contributors", {}).items():
                self.learned[int(k)] += [frozenset(sorted(c for part in parts for c in part)), *map(frozenset, parts)]
        self.record = {"setup_bytes": sum(map(len, publics.values())),
                       "neighbours": {str(cid): len(nb) for cid, nb in sorted(secure.graph.items())}}
        return self.record

    def learn(self, k: int, survivors: Collection[int]) -> list:
        """Group ``k``'s sum over ``survivors`` was unmasked: the components of their graph the server decoded."""
        parts = components(self.server.graph, sorted(survivors))
        self.learned[k] += [frozenset(sorted(survivors)), *map(frozenset, parts)]
        return parts

    def group_sum(self, transport: Transport, k: int, args: dict, stat_dtype: npt.DTypeLike) -> tuple[Sum, str | None]:
        """Group ``k``'s sums by the secure protocol; returns (Sum with float totals, withheld).

        ``args``: cid -> the keyword arguments of its statistics
        (:meth:`fedlayer.messages.StatsRequest.kwargs`).

        1. each client computes its statistics and declares their magnitude
           exponent (a client that fails here has not masked anything: it
           simply drops out);
        2. the server chooses the contributors among the others
           (:func:`fedlayer.secure.choose_contributors`): no component of
           their neighbour graph below ``min_group_size``, and a set equal to
           or at least ``min_group_size`` clients away from each of the
           group's earlier unmasked sums; the rest are excluded as if they
           had dropped before masking, and nothing of theirs is revealed;
        3. the server fixes the fixed-point scale; the contributors share a
           fresh self mask with their neighbours among them (forwarded along
           the graph only; a sender whose share a receiver cannot open is
           dropped) and upload masked words; a client that fails before its
           upload is left out of the masks, one that fails in it is a dropout
           whose pairwise masks of this sum the survivors reveal the keys of;
        4. if the survivors still keep the rules, they reveal what the server
           needs to remove the masks (a survivor that masked with a dropped
           client must answer, or the sum cannot be unmasked); if not,
           nothing is revealed and the survivors mask again over an
           admissible set of them (up to :data:`SECURE_ATTEMPTS` times).

        The Sum's receipts are the contributors of the unmasked sum.
        ``withheld`` is None, or why the sum was not unmasked (the Sum then
        has no totals).
        """
        bound = transport.sum(ClientMethod.SECURE_BOUND, {c: {**kwargs, "summed": list(UPLOADED), "upper": list(UPPER)}
                                                          for c, kwargs in args.items()}, ())
        alive = sorted(bound.receipts)
        if not alive:
            return Sum({}, {}, {}, dict(bound.dropped)), None
        state = _Masking(alive, dict(bound.dropped), dict.fromkeys(alive, 0.0), dict.fromkeys(alive, 0))
        position = args[next(iter(args))]["position"]
        withheld = self._mask(transport, state, bound, position, (position, k), [frozenset(p) for p in self.learned[k]])
        m = self.min_group_size
        outcome = Sum({}, {}, {}, {}, state.upload.transport if state.chosen is not None else {})
        excluded = [c for c in alive if c not in state.failed and (state.chosen is None or c not in state.survivors)]
        outcome.dropped = {**state.failed,
                           **dict.fromkeys(excluded, Dropout(_EXCLUDED_MESSAGE.format(m=m), step=_EXCLUDED_STEP))}
        if state.chosen is None:
            return outcome, withheld
        for cid in state.survivors:
            receipt = dict(bound.receipts[cid])
            receipt["compute_s"] += state.protocol_s[cid]
            receipt["frac_bits"] = state.frac_bits
            outcome.receipts[cid] = receipt
        if not state.survivors:
            return outcome, None
        return outcome, self._unmask(transport, state, outcome, stat_dtype, self.learned[k])

    def _mask(self, transport, state, bound, position, context, history):
        """Mask the sum until its survivors may be unmasked (or the attempts run out); returns why it is
        withheld when no admissible set of contributors is left, else None."""
        m, graph = self.min_group_size, self.server.graph
        for attempt in range(SECURE_ATTEMPTS):
            state.context = context if attempt == 0 else (*context, attempt)
            able = [c for c in state.alive if c not in state.failed]
            # Fewer than the minimum: masked anyway and withheld below (so is a lone client's failure named).
            state.chosen = able if len(able) < m else choose_contributors(able, graph, history, m)
            if state.chosen is None:
                return (f"no set of the {len(able)} clients able to take part keeps the secure sums' rules "
                        f"(min_group_size={m}): not unmasked")
            state.n_terms = len(state.chosen)
            state.frac_bits = fraction_bits([bound.receipts[c]["exponent"] for c in state.chosen], state.n_terms)
            self._share_self_masks(transport, state)
            self._upload(transport, state, position)
            if len(state.survivors) < m or admissible(state.survivors, graph, history, m):
                return None
        return None

    def _share_self_masks(self, transport, state):
        """The contributors' fresh self masks, shared among them along the graph."""
        self_masks = transport.sum(ClientMethod.SECURE_SELF_MASK,
                                   {c: {"context": state.context, "members": state.chosen} for c in state.chosen}, ())
        state.failed.update(_dropped_in("secure_self_mask", self_masks.dropped))
        outgoing = {}
        for cid, r in self_masks.receipts.items():
            outgoing[cid] = r["shares"]
            state.protocol_s[cid] += r["compute_s"]
            state.sent[cid] += sum(len(blob) for blob in r["shares"].values())
        seconds, out = self._relay(transport, outgoing, state.chosen, state.context)
        for cid, value in seconds.items():
            state.protocol_s[cid] += value
        for cid, why in out.items():
            state.failed.setdefault(cid, why)

    def _upload(self, transport, state, position):
        """The masked words of the contributors still in the sum, summed by the transport."""
        members = [c for c in state.chosen if c not in state.failed]
        state.upload = transport.sum(ClientMethod.SECURE_UPLOAD, {
            c: {"position": position, "context": state.context, "frac_bits": state.frac_bits,
                "n_terms": state.n_terms, "members": members} for c in members}, UPLOADED, dtype=np.uint64)
        state.failed.update(_dropped_in("secure_upload", state.upload.dropped))
        state.survivors, state.dropped = sorted(state.upload.receipts), sorted(state.upload.dropped)
        for cid in state.survivors:
            state.protocol_s[cid] += state.upload.receipts[cid]["compute_s"]
        for cid in state.survivors:
            state.uploaded[cid] = state.uploaded.get(cid, 0) + state.upload.up_bytes[cid]

    def _relay(self, transport, outgoing, members, context):
        """Deliver encrypted shares (sender -> {receiver: bytes}) to the senders, along the neighbour graph only.

        ``members``: the clients the sum's self masks were shared among (a
        share to one of them that has failed since is simply not delivered).

        Returns (each receiver's seconds receiving, cid -> Dropout). A sender
        whose shares went off the graph, or whose share a receiver could not
        open, is the one out; the receiver stays (else any client could
        remove a chosen neighbour from a chosen sum).
        """
        incoming, offenders = self.server.route(outgoing, members)
        out = {cid: Dropout(why, step="secure_self_mask") for cid, why in offenders.items()}
        done = transport.sum(ClientMethod.SECURE_RECEIVE, {c: {"shares": incoming.get(c, {}), "context": context}
                                                           for c in sorted(outgoing)}, ())
        for receiver, receipt in sorted(done.receipts.items()):
            for sender, why in sorted(receipt.get("reports", {}).items()):
                out.setdefault(int(sender), Dropout(f"reported by client {receiver}: {why}", step="secure_self_mask"))
        out.update(_dropped_in("secure_receive (self-mask shares)", done.dropped))
        return {cid: r["compute_s"] for cid, r in done.receipts.items()}, out

    def _unmask(self, transport, state, outcome, stat_dtype, history):
        """Unmask the sum into ``outcome`` if its survivors keep the rules; returns why not, else None."""
        m, survivors = self.min_group_size, state.survivors
        withheld, revealed_bytes = None, {}
        if len(survivors) < m:
            withheld = (f"{len(survivors)} survivor(s) of the secure sum, fewer than min_group_size="
                        f"{m}: not unmasked")
        elif not admissible(survivors, self.server.graph, [frozenset(p) for p in history], m):
            withheld = (f"the {len(survivors)} survivors of {SECURE_ATTEMPTS} maskings break the secure sums' rules "
                        f"(min_group_size={m}): not unmasked")
        else:
            reveal = transport.sum(ClientMethod.SECURE_REVEAL, {c: {"context": state.context, "dropped": state.dropped,
                                                                    "survivors": survivors} for c in survivors}, ())
            revealed = {}
            for cid, r in reveal.receipts.items():
                revealed[cid] = r["shares"]
                outcome.receipts[cid]["compute_s"] += r["compute_s"]
                revealed_bytes[cid] = len(pickle.dumps(r["shares"], protocol=pickle.HIGHEST_PROTOCOL))
            outcome.dropped.update(_dropped_in("secure_reveal (its upload is in the sum)", reveal.dropped))
            outcome.totals = self._decode(state, revealed, stat_dtype)
        for cid in survivors:
            # The masked words, plus the protocol's own messages: the self-mask shares it sent and the shares it
            # revealed (pickled, as they travel under MPI).
            outcome.up_bytes[cid] = state.uploaded[cid] + state.sent[cid] + revealed_bytes.get(cid, 0)
        return withheld

    def _decode(self, state, revealed, stat_dtype):
        """The float totals of the unmasked words."""
        words = self.server.unmask(state.context, state.upload.totals, state.survivors, state.dropped, revealed,
                                   state.chosen)
        code = FixedPoint(state.frac_bits, state.n_terms)
        totals = {key: code.decode(w) for key, w in words.items()}
        totals.update({key: unpack_upper(totals[key]) for key in UPPER if key in totals})
        totals = {key: (value.astype(stat_dtype, copy=False) if value.ndim else float(value))
                  for key, value in totals.items()}
        if "rows" in totals:
            totals["rows"] = int(round(totals["rows"]))
        return totals
