"""How the server reaches its clients.

Two operations, both on a set of clients:

* :meth:`Transport.call` runs a client method and yields each client's result
  as it arrives (label summaries, weights, evaluation, personalization);
* :meth:`Transport.sum` runs it and returns only the **sum over the clients**
  of the named entries of the results (the statistics G, C, ...), with each
  client's other entries (its scalars: sample count, busy time). The server
  never asks for one client's statistics. :class:`InProcessTransport` folds
  them as they come (peak memory does not grow with the clients); the MPI
  transport sums each rank's clients on that rank and sends one message per
  rank. The secure protocol (:mod:`fedlayer.secure`) runs on top of these
  two operations: the clients mask their entries, the transports sum words.

A client whose method raises during :meth:`Transport.sum` is a *dropout*:
left out of the sum and named in :attr:`Sum.dropped` with its error
(a :class:`fedlayer.messages.Dropout`: the exception's type and message and
the method that raised).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import numpy.typing as npt
from scipy.linalg import lapack

import fastls

from .messages import ClientMethod, ClientProtocol, Dropout, EvaluateReply
from .timing import payload_bytes

__all__ = ["Transport", "InProcessTransport", "Sum", "overall_accuracy", "fold", "pack_upper", "unpack_upper"]


@dataclass
class Sum:
    """What :meth:`Transport.sum` returns.

    Attributes
    ----------
    totals : dict
        key -> sum over the clients that answered (arrays in the requested
        dtype, numbers as numbers); empty when none answered (nothing is
        folded for a dropout).
    receipts : dict
        cid -> that client's result without the summed entries.
    up_bytes : dict
        cid -> bytes of the client's summed entries as it uploads them.
    dropped : dict
        cid -> :class:`fedlayer.messages.Dropout`: why the client is not in the sum.
    transport : dict
        The transport's own measurements (e.g. per MPI rank, bytes and
        seconds rank 0 spent receiving); recorded as they are.
    """

    totals: dict = field(default_factory=dict)
    receipts: dict = field(default_factory=dict)
    up_bytes: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)
    transport: dict = field(default_factory=dict)


def pack_upper(G: np.ndarray) -> np.ndarray:
    """Upper triangle of square ``G`` row by row, as a contiguous 1-D array of d(d+1)/2 values."""
    d = G.shape[0]
    if G.flags.c_contiguous and G.dtype in (np.float64, np.float32) and d > 0:
        # Row by row of G's upper triangle is LAPACK's packed lower triangle of G^T (F-ordered, no copy).
        packed, _ = (lapack.dtrttp if G.dtype == np.float64 else lapack.strttp)(G.T, uplo="L")
        return packed
    out = np.empty(d * (d + 1) // 2, dtype=G.dtype)
    offset = 0
    for i in range(d):
        n = d - i
        out[offset:offset + n] = G[i, i:]
        offset += n
    return out


def unpack_upper(packed: np.ndarray, d: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_upper` (``d`` from the length when None); the strict lower triangle is zero."""
    if d is None:
        d = int(round(((8 * packed.size + 1) ** 0.5 - 1) / 2))
    if packed.size != d * (d + 1) // 2:
        raise ValueError(f"a packed upper triangle of a {d} x {d} matrix has {d * (d + 1) // 2} values, "
                         f"got {packed.size}")
    G = np.zeros((d, d), dtype=packed.dtype)
    offset = 0
    for i in range(d):
        n = d - i
        G[i, i:] = packed[offset:offset + n]
        offset += n
    return G


def fold(totals: dict, summed: Mapping, dtype: npt.DTypeLike, upper: Sequence[str] = ()) -> dict:
    """Add the entries of ``summed`` into ``totals`` (arrays of float kind in ``dtype``); returns ``totals``.

    Integer arrays (the secure protocol's fixed-point words) keep their
    dtype and wrap around, as modular sums must. Square matrices under a key
    of ``upper`` are summed on their upper triangle only (the strict lower
    triangle of the total stays zero, as after :func:`unpack_upper`): half
    the memory traffic.
    """
    for key, value in summed.items():
        if isinstance(value, np.ndarray):
            if key not in totals:
                totals[key] = np.zeros(value.shape, dtype=dtype if value.dtype.kind == "f" else value.dtype)
            total = totals[key]
            if (key in upper and value.ndim == 2 and value.shape[0] == value.shape[1]
                    and value.dtype == total.dtype and value.dtype.kind == "f"):
                fastls.add_upper(total, value)
            else:
                total += value
        else:
            totals[key] = totals.get(key, 0) + value
    return totals


class Transport(ABC):
    """Server-side handle on the clients."""

    @property
    @abstractmethod
    def client_ids(self) -> list[int]:
        """Ids of all clients, in a fixed order."""

    @abstractmethod
    def call(self, method: str, args: dict[int, dict]) -> Iterator[tuple[int, dict]]:
        """Run ``client.method(**args[cid])`` for every cid in ``args``.

        Yields ``(cid, result)`` pairs in arrival order; every cid in ``args``
        appears exactly once, or the call raises naming the failed clients.
        """

    @abstractmethod
    def sum(self, method: str, args: dict[int, dict], keys: Sequence[str], *, dtype: npt.DTypeLike = np.float64,
            upper: Sequence[str] = (), on_client: Callable[[int], None] | None = None) -> Sum:
        """Run ``client.method(**args[cid])`` for every cid and sum the entries ``keys`` of the results.

        Parameters
        ----------
        method : str
        args : dict cid -> keyword arguments
        keys : sequence of str
            Entries of each result that are summed (never seen per client).
        dtype : dtype
            Of the sums of float arrays; integer arrays (the secure protocol's
            fixed-point words) keep their own and wrap around.
        upper : sequence of str
            Summed entries that are upper-triangular matrices (a transport may
            move only their upper triangle).
        on_client : callable(cid) or None
            Called as each client's result (or dropout) reaches the server:
            how far a long round has come.

        Returns
        -------
        Sum
        """

    def sum_groups(self, method: str, group_args: Sequence[tuple], keys: Sequence[str], *,
                   dtype: npt.DTypeLike = np.float64, upper: Sequence[str] = (),
                   on_client: Callable[[int], None] | None = None) -> Iterator[tuple[Any, Sum]]:
        """:meth:`sum` for several groups of clients: yields ``(key, Sum)`` per group, in the order given.

        ``group_args``: sequence of (key, args) with args as in :meth:`sum`.
        The groups' sums are taken one at a time; a transport may start a
        group's clients before the previous group's sum has been taken (MPI:
        a rank's next client runs while its previous partial sum travels).
        """
        for key, args in group_args:
            yield key, self.sum(method, args, keys, dtype=dtype, upper=upper, on_client=on_client)

    def close(self) -> None:  # noqa: B027  (optional: an in-process transport has nothing to release)
        """Release the clients (and, for MPI, tell the ranks to stop)."""


def client_side_sum(clients: Mapping, method: str, args: Mapping[int, dict], keys: Sequence[str], dtype,
                    hooks: Callable | None = None, done: Callable | None = None,
                    upper: Sequence[str] = ()) -> tuple[dict, dict, dict, dict]:
    """Run and fold clients in this process: the rank-local part of a sum (in process: the whole sum).

    Returns (totals, receipts, up_bytes, dropped). ``hooks(cid, method, kwargs)``
    (optional) runs before each client (test fault injection on MPI ranks);
    ``done(cid, receipt, up_bytes, dropped_reason)`` (optional) after each
    (receipt and bytes None for a dropout, the :class:`fedlayer.messages.Dropout` None otherwise).
    """
    totals, receipts, up_bytes, dropped = {}, {}, {}, {}
    for cid, kwargs in args.items():
        try:
            client = clients[cid]
        except KeyError:
            raise KeyError(f"no client with id {cid}") from None
        try:
            if hooks is not None:
                hooks(cid, method, kwargs)
            result = getattr(client, method)(**kwargs)
            summed = {key: result[key] for key in keys if key in result}
        except MemoryError:
            raise
        except Exception as err:
            dropped[cid] = Dropout.from_error(err, method)
        else:
            up_bytes[cid] = payload_bytes(summed)
            receipts[cid] = {key: value for key, value in result.items() if key not in keys}
            fold(totals, summed, dtype, upper)
            del result, summed
        if done is not None:
            done(cid, receipts.get(cid), up_bytes.get(cid), dropped.get(cid))
    return totals, receipts, up_bytes, dropped


class InProcessTransport(Transport):
    """All clients in this process, run sequentially (a simulation)."""

    def __init__(self, clients: Iterable) -> None:
        self._clients = {c.client_id: c for c in clients}

    @property
    def client_ids(self) -> list[int]:
        return list(self._clients)

    def call(self, method: str, args: dict[int, dict]) -> Iterator[tuple[int, dict]]:
        for cid, kwargs in args.items():
            try:
                client = self._clients[cid]
            except KeyError:
                raise KeyError(f"no client with id {cid}") from None
            yield cid, getattr(client, method)(**kwargs)

    def sum(self, method: str, args: dict[int, dict], keys: Sequence[str], *, dtype: npt.DTypeLike = np.float64,
            upper: Sequence[str] = (), on_client: Callable[[int], None] | None = None) -> Sum:
        done = None if on_client is None else (lambda cid, *_: on_client(cid))
        totals, receipts, up_bytes, dropped = client_side_sum(self._clients, method, args, keys, dtype, done=done,
                                                              upper=upper)
        return Sum(totals, receipts, up_bytes, dropped)

    def client(self, cid: int) -> ClientProtocol:
        return self._clients[cid]


def overall_accuracy(transport: Transport, args: Mapping[int, dict] | None = None) -> float:
    """Correct predictions over test samples, summed over every client's local test split.

    ``args`` (cid -> keyword arguments of ``evaluate``) defaults to no
    arguments: each client scores its own current model. NaN when no client
    has a test sample.
    """
    args = {cid: {} for cid in transport.client_ids} if args is None else args
    correct = total = 0
    for _, result in transport.call(ClientMethod.EVALUATE, args):
        reply = EvaluateReply.from_result(result)
        correct += reply.correct
        total += reply.total
    return correct / total if total else float("nan")
