"""The client's half of the secure sums: a wrapper around a client, as Flower's SecAgg+ client mod wraps an app.

A run with ``secure`` hosts :class:`SecureClient` objects (built in one
place, :meth:`fedlayer.algorithms.AnalyticAlgorithm.make_client`): the
transports, the MPI worker included, call the ``secure_*`` steps on it by
name (:class:`fedlayer.messages.ClientMethod`), and every other method and
attribute is the wrapped client's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any
from collections.abc import Collection, Hashable, Sequence

import fastls

from .secure import FixedPoint, SecureClientState, magnitude_exponent
from .transport import pack_upper

if TYPE_CHECKING:
    from .client import Client

__all__ = ["SecureClient"]


class SecureClient:
    """A client that can take part in secure sums (:mod:`fedlayer.secure`).

    Parameters
    ----------
    client : Client
        The wrapped client: its statistics are what this wrapper masks.

    Attributes
    ----------
    client : Client
    client_id : int
    state : SecureClientState or None
        The keys and shares of the secure protocol, from :meth:`secure_keys` on.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.client_id = client.client_id
        self.state: SecureClientState | None = None
        self._pending = {}  # position -> (the statistics kept for masking, their magnitude exponent)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper lacks: the client's methods and attributes.
        if name == "client":  # not set yet (a copy being built): never recurse
            raise AttributeError(name)
        return getattr(self.client, name)

    def __repr__(self) -> str:
        return f"SecureClient({self.client!r})"

    def secure_keys(self, min_survivors: int = 1) -> dict:
        """Start the secure protocol: fresh X25519 mask and channel key pairs; returns their public keys.

        ``min_survivors``: the fewest clients of a sum this client reveals
        shares for (:meth:`fedlayer.secure.SecureClientState.reveal`).
        """
        self.state = SecureClientState(self.client_id, min_survivors)
        self._pending = {}
        return {"public": self.state.public_key()}

    def secure_neighbours(self, public_keys: dict) -> dict:
        """The neighbours' public keys (cid -> bytes)."""
        self.state.set_neighbours(public_keys)
        return {}

    def secure_receive(self, shares: dict, context: Hashable | None = None) -> dict:
        """Encrypted self-mask shares of sum ``context`` addressed to this client (sender cid -> bytes), relayed
        by the server; returns the senders whose share it could not open ("reports": sender -> why)."""
        start = time.perf_counter()
        reports = self.state.receive_shares(shares, context)
        return {"compute_s": time.perf_counter() - start, "reports": reports}

    def secure_bound(self, position: int, batch_size: int, summed: Sequence[str], round_index: int = 0,
                     target_moments: bool = False, upper: Sequence[str] = (), coordinates: bool = False) -> dict:
        """First half of a secure sum: compute the statistics, keep them, declare their magnitude exponent.

        ``summed`` names the entries of ``local_stats`` the server sums;
        those in ``upper`` are upper-triangular (G) and are kept, encoded and
        masked as their packed upper triangle, half the words.
        Returns the exponent (the power of two above the largest of them),
        the sample count and the busy time; those entries stay here until
        :meth:`secure_upload` masks them.
        """
        # Through this object: a wrapper's own local_stats (a test's injected failure) is the one that runs.
        result = self.local_stats(position, batch_size, round_index, target_moments, coordinates)
        start = time.perf_counter()
        kept = {key: result.pop(key) for key in summed if key in result}
        kept.update({key: pack_upper(kept[key]) for key in upper if key in kept})
        exponent = magnitude_exponent(kept.values())
        # Only this position's statistics are kept: those of a sum this client was excluded from go now.
        self._pending = {position: (kept, exponent)}
        # The packing and the exponent are the protocol's work: counted with the statistics' time.
        result["compute_s"] += time.perf_counter() - start
        return {**result, "exponent": exponent}

    def secure_self_mask(self, context: Hashable, members: Collection[int] | None = None) -> dict:
        """A fresh self mask for the sum ``context``, shared among its neighbours in ``members``; returns the shares."""
        start = time.perf_counter()
        shares = self.state.new_self_mask(context, members)
        return {"shares": shares, "compute_s": time.perf_counter() - start}

    def secure_upload(self, position: int, context: Hashable, frac_bits: int, n_terms: int,
                      members: Collection[int]) -> dict:
        """Second half: the kept statistics in fixed point, masked (only their sum over ``members`` decodes).

        The statistics stay until :meth:`secure_reveal` (or the next
        :meth:`secure_bound`): a sum whose survivors the server may not
        unmask is masked again, under a new ``context``, over fewer clients.
        """
        start = time.perf_counter()
        kept, exponent = self._pending[position]
        with fastls.limit_cores(self.client.cores):  # the masks' threads stay within the client's cores
            masked = self.state.mask(context, kept, members, code=FixedPoint(frac_bits, n_terms), exponent=exponent)
        return {**masked, "compute_s": time.perf_counter() - start}

    def secure_reveal(self, context: Hashable, dropped: Collection[int], survivors: Collection[int]) -> dict:
        """For unmasking the sum ``context``: this sum's pairwise keys with dropped neighbours, self-mask shares of
        surviving ones."""
        start = time.perf_counter()
        shares = self.state.reveal(context, set(dropped), set(survivors))
        self._pending.pop(context[0], None)
        return {"shares": shares, "compute_s": time.perf_counter() - start}
