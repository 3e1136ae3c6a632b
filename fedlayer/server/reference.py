"""The centralized reference of a run with dropouts: each layer solved on the clients that did not drop out of it."""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Mapping, Sequence

import numpy as np

import fastls

if TYPE_CHECKING:
    from ..client import Client

__all__ = ["survivors_solution"]


def survivors_solution(clients: Sequence[Client], rounds: Sequence[Mapping], group_weights: Sequence[np.ndarray],
                       gamma: float = 100.0) -> list[np.ndarray]:
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
