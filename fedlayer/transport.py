"""How the server reaches its clients.

The algorithms only call :meth:`Transport.call`: run a client method on a set
of clients and receive the results *as they arrive*, so the server can fold
each client's statistics into its sums and drop them (peak memory does not
grow with the number of clients). :class:`InProcessTransport` runs the
clients in this process, one after the other; the MPI transport runs them on
other ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

__all__ = ["Transport", "InProcessTransport", "overall_accuracy"]


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

    def close(self):
        """Release the clients (and, for MPI, tell the ranks to stop)."""


class InProcessTransport(Transport):
    """All clients in this process, run sequentially (a simulation)."""

    def __init__(self, clients):
        self._clients = {c.client_id: c for c in clients}

    @property
    def client_ids(self):
        return list(self._clients)

    def call(self, method, args):
        for cid, kwargs in args.items():
            try:
                client = self._clients[cid]
            except KeyError:
                raise KeyError(f"no client with id {cid}") from None
            yield cid, getattr(client, method)(**kwargs)

    def client(self, cid):
        return self._clients[cid]


def overall_accuracy(transport, args=None):
    """Correct predictions over test samples, summed over every client's local test split.

    ``args`` (cid -> keyword arguments of ``evaluate``) defaults to no
    arguments: each client scores its own current model. NaN when no client
    has a test sample.
    """
    args = {cid: {} for cid in transport.client_ids} if args is None else args
    correct = total = 0
    for _, result in transport.call("evaluate", args):
        correct += result["correct"]
        total += result["total"]
    return correct / total if total else float("nan")
