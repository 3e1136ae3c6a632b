"""Points where a caller may act inside an MPI job: fault injection and tracing for the tests.

Production runs use these classes as they are: every method does nothing.
A test builds a subclass (of one or of both) and passes it to
:func:`fedlayer.mpi.serve` (``hooks=``) and :class:`fedlayer.mpi.MPITransport`
(``hooks=``), or to ``fedlayer.cli.main(argv, mpi_hooks=...)`` from the
script ``mpiexec`` starts on every rank.
"""

from __future__ import annotations

__all__ = ["ServerHooks", "WorkerHooks"]


class WorkerHooks:
    """What a worker rank (1..R-1) calls out to; the defaults do nothing."""

    def before_call(self, cid: int, method: str, kwargs: dict) -> None:
        """Before client ``cid`` runs ``method(**kwargs)`` outside a sum.

        An exception raised here is the client's: the worker reports it and
        rank 0 ends the job naming the client.
        """

    def before_sum_step(self, cid: int, method: str, kwargs: dict) -> None:
        """Before client ``cid`` runs ``method(**kwargs)`` for a sum.

        An exception raised here is the client's: it drops out of that sum,
        as if ``method`` had raised it.
        """

    def group_started(self, seq: int, group: int) -> None:
        """The rank starts its clients of group ``group`` (0-based) of sum command ``seq``."""


class ServerHooks:
    """What rank 0's :class:`~fedlayer.mpi.MPITransport` calls out to; the defaults do nothing."""

    def before_group(self, seq: int, group: int) -> None:
        """Rank 0 is about to take group ``group``'s sum of sum command ``seq`` (a slow server waits here)."""

    def partial_received(self, seq: int, group: int, source: int) -> None:
        """Rank 0 received rank ``source``'s partial sum of group ``group`` of sum command ``seq``."""
