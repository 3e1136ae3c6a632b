"""The job around the ranks: whether mpiexec started this process, where clients live, cores, ends of ranks.

MPI is imported lazily and only when the process was started by ``mpiexec``
(see :func:`world`), so plain runs never initialize it.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["ABORT_GRACE_S", "abort_job", "hosting_rank", "launch_rank", "node_share", "rank_cores", "rank_finished",
           "watch_ranks", "world"]

_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_RANK")
ABORT_GRACE_S = 1.0   # pause before MPI_Abort so the explaining error reaches stderr


def launch_rank() -> int:
    """This process's rank as the launcher's environment gives it (0 when not under mpiexec), without MPI."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def world() -> MPI.Intracomm | None:
    """``MPI.COMM_WORLD`` when launched by mpiexec with more than one rank, else None.

    mpi4py is only imported when one of the launcher's environment variables
    is set, so a plain ``fedlayer run`` never initializes MPI.
    """
    if not any(os.environ.get(name) for name in _LAUNCH_VARS):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


def hosting_rank(cid: int, size: int) -> int:
    """Rank hosting client ``cid`` in a world of ``size`` ranks (rank 0 is the server)."""
    return 1 + cid % (size - 1)


def node_share(affinities: Sequence[Sequence[int]], mine: Sequence[int]) -> int:
    """Cores a rank may use: each CPU it may run on counts 1 / (ranks of the node that may run on it).

    ``affinities``: the CPU sets of every rank on the node (``mine`` among
    them). Ranks bound to their own cores keep them all; ranks that share
    every core split them evenly; at least 1.
    """
    sharing = {}
    for cpus in affinities:
        for cpu in cpus:
            sharing[cpu] = sharing.get(cpu, 0) + 1
    return max(1, int(sum(1.0 / sharing[cpu] for cpu in mine) + 1e-9))


def rank_cores(comm: MPI.Intracomm) -> tuple[int, int]:
    """(this rank's share of its node's cores, ranks on the node): a collective call over ``comm``.

    Ranks on one node run at the same time (a worker's clients, and the
    server's solves while the workers run the next group); each running BLAS
    on every core would put two or more threads per core, where OpenBLAS's
    waiting threads spin. The share is :func:`node_share` of the node's ranks'
    CPU affinities.
    """
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        affinities = local.allgather(mine)
    finally:
        local.Free()
    return node_share(affinities, mine), len(affinities)


_marker_dir = None  # this host's folder of "rank ended for a reason fedlayer printed" markers
_lifeline = None    # this rank's pipe, both ends open for its life (see watch_ranks)


def watch_ranks(comm: MPI.Intracomm) -> None:
    """Start this host's watcher of dead ranks (:mod:`fedlayer.mpi._rankwatch`); collective over ``comm``.

    Every rank calls it once at startup; the first rank on each host starts
    the watcher with its host's (rank, pid, lifeline) triples. Each rank then
    calls :func:`rank_finished` when it ends in an orderly way (its error, if
    any, already printed), so that only a rank that dies unexplained is named.
    Nothing is started where Linux pidfds are missing; a watcher that cannot
    be started is reported on stderr and the job goes on.

    Each rank also holds a pipe open for its whole life, its "lifeline": the
    watcher opens the read end through /proc, and a rank's death closes the
    write end in the kernel's first steps of its exit, before mpiexec (which
    learns of the death from the same closing files) can kill the others; a
    pidfd signals only once the teardown is over.
    """
    from mpi4py import MPI

    global _marker_dir, _lifeline
    if _lifeline is None:
        _lifeline = os.pipe()  # not inherited by the processes a rank starts
    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        triples = host_comm.gather((comm.Get_rank(), os.getpid(), _lifeline[0]), root=0)
        marker_dir = None
        if host_comm.Get_rank() == 0 and _pidfds_work():
            marker_dir = _start_watcher(comm.Get_rank(), triples)
        _marker_dir = host_comm.bcast(marker_dir, root=0)
    finally:
        host_comm.Free()


def _start_watcher(rank, triples):
    """Start the watcher script over ``triples`` (rank, pid, lifeline fd); its marker folder, or None if it failed."""
    import socket
    import subprocess
    import tempfile

    marker_dir = None
    try:
        marker_dir = tempfile.mkdtemp(prefix="fedlayer-ranks-")
        watcher = Path(__file__).with_name("_rankwatch.py")
        # A session of its own: mpiexec's cleanup, which kills the ranks, must not take the watcher along.
        subprocess.Popen([sys.executable, str(watcher), marker_dir, socket.gethostname(),
                          *(f"{r}:{pid}:{fd}" for r, pid, fd in triples)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    except OSError as err:  # a diagnostic must not stop the job
        print(f"fedlayer (MPI rank {rank}): no watcher of dead ranks on this host ({err})",
              file=sys.stderr, flush=True)
        if marker_dir is not None:
            shutil.rmtree(marker_dir, ignore_errors=True)
        return None
    return marker_dir


def _pidfds_work():
    """Whether this kernel has pidfd_open (Linux >= 5.3), not only this Python."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def rank_finished(comm: MPI.Intracomm, aborting: bool = False) -> None:
    """Mark this rank's end as explained (see :func:`watch_ranks`); idempotent.

    ``aborting``: this rank stops the whole job (MPI_Abort) after printing why,
    so no rank on this host that the abort kills is to be named either.
    """
    if _marker_dir is not None:
        try:
            Path(_marker_dir, "abort" if aborting else str(comm.Get_rank())).touch()
        except OSError:
            pass  # the watcher is gone already: nothing left to tell it


def abort_job(comm: MPI.Intracomm) -> None:
    """MPI_Abort, after giving mpiexec's proxies :data:`ABORT_GRACE_S` to forward what this rank already wrote.

    The abort kills every process at once, the proxies included; without the
    pause the error that explains the abort can be lost from the job's stderr.
    """
    rank_finished(comm, aborting=True)  # the reason is on stderr: the ranks it kills did not die
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    comm.Abort(1)
