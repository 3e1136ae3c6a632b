"""The clock every algorithm is timed by: simulated links, per-round records, the paper's metric.

Compute time is measured by the clients; communication time is simulated
from the bytes a message carries (:func:`payload_bytes`) over a configured
bandwidth and latency (:class:`Clock`); idle time is the wait for the slowest
client of a round. :class:`RoundLog` turns one round's measurements into the
results record shared by the analytic methods and the baselines, and
:func:`time_summary` gives the averaged total training time per client. See
``docs/design.md`` ("Time").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Clock", "RoundLog", "payload_bytes", "time_summary"]


def payload_bytes(obj: Any) -> int:
    """Bytes a message carries: the sum of its NumPy buffers (scalars count 8).

    Parameters
    ----------
    obj : ndarray, dict, list, tuple or scalar
        Dicts, lists and tuples are walked; every other value counts 8 bytes.

    Returns
    -------
    int
    """
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 8


@dataclass(frozen=True)
class Clock:
    """Simulated links: time = latency + bytes / bandwidth, per message."""

    bandwidth_bytes_per_s: float = 100e9 / 8  # the paper's 100 Gbit/s InfiniBand
    latency_s: float = 5e-6

    def transfer(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` takes (0 on an infinite-bandwidth clock: no network)."""
        if math.isinf(self.bandwidth_bytes_per_s):
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


class RoundLog:
    """Per-client timings of one round, turned into the results record.

    Parameters
    ----------
    stage : str
        ``"initialization"``, ``"federated"`` or ``"personalization"``.
    position : int or None
        The trainable layer of the round (None for whole-model rounds).
    clock : Clock
    """

    stage: str
    position: int | None
    clock: Clock
    compute: dict[int, float]
    up: dict[int, float]
    down: dict[int, float]
    batch: dict[int, int]
    parts: dict[int, dict[str, float]]
    server_s: float
    eval_s: float | None
    selection: dict[Any, dict[str, Any]]
    chosen: dict[int, dict[str, Any]]
    dropped: dict[int, Any]
    withheld: dict[Any, dict[str, Any]]
    transport: dict[str, Any]
    up_bytes: int
    down_bytes: int

    def __init__(self, stage: str, position: int | None, clock: Clock) -> None:
        self.stage, self.position, self.clock = stage, position, clock
        self.compute, self.up, self.down, self.batch, self.parts = {}, {}, {}, {}, {}
        self.server_s = 0.0
        self.eval_s = None
        self.selection = {}  # "all" or a group -> the server's choice of gamma (criterion, grid, scores)
        self.chosen = {}     # cid -> a client's own choice (eps and its criterion)
        self.dropped = {}    # cid -> why the client is not in this round's sums
        self.withheld = {}   # group -> why its secure sum was not unmasked, and the groups it was solved on
        self.transport = {}  # the transport's own measurements, recorded as they are
        self.up_bytes = self.down_bytes = 0

    def arrived(self, cid: int, compute_s: float, up_bytes: int, parts: Mapping[str, float] | None = None) -> None:
        """Client ``cid`` finished after ``compute_s`` and uploaded ``up_bytes``.

        Parameters
        ----------
        cid : int
        compute_s : float
            The client's compute seconds in this round.
        up_bytes : int
            Bytes of its upload, timed by the :class:`Clock`.
        parts : dict of str to float, optional
            Splits ``compute_s``, e.g. forward / statistics / solve seconds.
        """
        if parts:
            self.parts[cid] = dict(parts)
        self.compute[cid] = compute_s
        self.up[cid] = self.clock.transfer(up_bytes)
        self.up_bytes += up_bytes

    def sent(self, cid: int, down_bytes: int) -> None:
        """The server sent ``down_bytes`` to client ``cid``."""
        self.down[cid] = self.clock.transfer(down_bytes)
        self.down_bytes += down_bytes

    def record(self, accuracy: float | None) -> dict[str, Any]:
        """The round's results record (``accuracy`` None when the round was not evaluated).

        Returns
        -------
        dict
            JSON-able: ``stage``, ``layer``, ``accuracy``, ``server_s``,
            ``bytes_up``, ``bytes_down``, ``clients`` (per client id as a
            string: ``compute_s``, ``comm_s``, ``idle_s``, ``arrival_s``), and
            the optional entries this log holds (``eval_s``, ``selection``,
            ``dropped``, ``withheld``, ``transport``).
        """
        arrival = {cid: self.compute[cid] + self.up[cid] for cid in self.compute}
        latest = max(arrival.values(), default=0.0)
        clients = {
            str(cid): {
                "compute_s": self.compute[cid],
                "comm_s": self.up[cid] + self.down.get(cid, 0.0),
                "idle_s": latest - arrival[cid],
                "arrival_s": arrival[cid],
                **({"batch_size": self.batch[cid]} if cid in self.batch else {}),
                **({"parts": self.parts[cid]} if cid in self.parts else {}),
                **self.chosen.get(cid, {}),
            }
            for cid in self.compute
        }
        return {
            "stage": self.stage,
            "layer": self.position,
            "accuracy": accuracy,
            "server_s": self.server_s,
            **({"eval_s": self.eval_s} if self.eval_s is not None else {}),
            "bytes_up": self.up_bytes,
            "bytes_down": self.down_bytes,
            **({"selection": {str(k): v for k, v in self.selection.items()}} if self.selection else {}),
            **({"dropped": {str(cid): why for cid, why in sorted(self.dropped.items())}} if self.dropped else {}),
            **({"withheld": {str(k): v for k, v in sorted(self.withheld.items())}} if self.withheld else {}),
            **({"transport": self.transport} if self.transport else {}),
            "clients": clients,
        }


def time_summary(rounds: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Averaged total training time per client = compute + idle + communication (paper's metric).

    Parameters
    ----------
    rounds : iterable of dict
        Records of :meth:`RoundLog.record`.

    Returns
    -------
    dict
        ``compute_s``, ``idle_s``, ``comm_s`` (each client's sum over the
        rounds, averaged over the clients) and ``total_s``, their sum; all 0
        without rounds.
    """
    totals = {}
    for record in rounds:
        for cid, t in record["clients"].items():
            acc = totals.setdefault(cid, {"compute_s": 0.0, "idle_s": 0.0, "comm_s": 0.0})
            for key in acc:
                acc[key] += t[key]
    if not totals:
        return {"compute_s": 0.0, "idle_s": 0.0, "comm_s": 0.0, "total_s": 0.0}
    mean = {key: float(np.mean([t[key] for t in totals.values()])) for key in ("compute_s", "idle_s", "comm_s")}
    mean["total_s"] = sum(mean.values())
    return mean
