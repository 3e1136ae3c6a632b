"""Clients on other MPI ranks: ``mpiexec -n R fedlayer run ...``.

Rank 0 runs the server (:func:`fedlayer.run.run` over an :class:`MPITransport`);
ranks 1..R-1 run :func:`serve`, each hosting the clients ``cid`` with
``1 + cid % (R - 1) == rank`` (:func:`hosting_rank`; the single pooled client
of ``acnnl`` lives on rank 1). Every rank loads the dataset itself from the
configuration (same seed, same partition), builds only its own clients and
drops the rest.

Modules: :mod:`~fedlayer.mpi.launch` (is this an MPI job, cores per rank, the
watcher of dead ranks), :mod:`~fedlayer.mpi.wire` (operations, tags, headers
and raw buffers), :mod:`~fedlayer.mpi.server` (rank 0),
:mod:`~fedlayer.mpi.worker` (ranks 1..R-1), :mod:`~fedlayer.mpi.hooks` (where
the tests inject faults).

Protocol (all on ``COMM_WORLD``; every header's ``"op"`` is an :class:`Op`):

* rank 0 -> worker, tag ``TAG_CMD``: a small pickled header (``comm.isend``):
  ``{"op": Op.CALL, "seq", "method", "clients": [(cid, kwargs skeleton)],
  "arrays": [...]}`` or ``{"op": Op.STOP, "status"}``; the NumPy arrays of the
  kwargs follow as raw buffers (``Isend``, tag ``TAG_CMD_DATA``), never pickled;
* worker -> rank 0, tag ``TAG_RESULT``: once, ``Op.HELLO`` with the rank's
  client ids; for a ``CALL``, per client, as soon as it finishes, an
  ``Op.RESULT`` header (result skeleton, shapes, dtypes, scalars) followed by
  the raw buffers (``Send``, tag ``TAG_DATA``); an ``Op.ERROR`` naming rank,
  client and exception; ``Op.BYE`` acknowledging a stop (or saying the rank
  was interrupted).
* Sums of one or more groups are one ``Op.SUMS`` command (its ``"groups"``:
  the rank's clients per group, in order; ``"keys"``, ``"dtype"``,
  ``"upper_keys"``, ``"packed_keys"``); :meth:`MPITransport.sum` is one group
  of it. Per group, per client a small ``Op.RECEIPT`` (its other entries) or
  ``Op.DROPPED`` (its reason), and after the rank's last client of the group
  one ``Op.PARTIAL``: the rank's own sum of its clients' entries, sent
  without blocking while the rank runs the next group's clients. Rank 0 thus
  receives one set of matrices per rank and group of a layer, not one per
  client. Each group's messages have their own tags
  (:func:`~fedlayer.mpi.wire.group_tags`), so rank 0 takes the groups one at
  a time; a rank waits for its older partial before starting a third group,
  so each side holds at most two groups' sums.

Buffers over 2**30 bytes travel as several messages (MPI counts are C ints).
The entries a sum declares upper-triangular (the Gram matrices, whose lower
triangle the clients never touch) travel as their packed upper triangle,
d(d+1)/2 values instead of d^2 (see :class:`MPITransport`'s ``pack_upper``).

A sum's :attr:`~fedlayer.transport.Sum.transport` holds, per rank, the bytes
of its partial sum and the seconds rank 0 spent receiving them.

MPI is imported lazily and only when the process was started by ``mpiexec``
(see :func:`world`), so plain runs never initialize it.
"""

from __future__ import annotations

from .hooks import ServerHooks, WorkerHooks
from .launch import hosting_rank, launch_rank, node_share, rank_cores, rank_finished, watch_ranks, world
from .server import MPITransport
from .wire import CHUNK_BYTES, Op
from .worker import report_startup_failure, serve

__all__ = ["CHUNK_BYTES", "MPITransport", "Op", "ServerHooks", "WorkerHooks", "hosting_rank", "launch_rank",
           "node_share", "rank_cores", "rank_finished", "report_startup_failure", "serve", "watch_ranks", "world"]
