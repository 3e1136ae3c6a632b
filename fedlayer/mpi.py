"""Clients on other MPI ranks: ``mpiexec -n R fedlayer run ...``.

Rank 0 runs the server (:func:`fedlayer.run.run` over an :class:`MPITransport`);
ranks 1..R-1 run :func:`serve`, each hosting the clients ``cid`` with
``1 + cid % (R - 1) == rank`` (the single pooled client of ``acnnl`` lives on
rank 1). Every rank loads the dataset itself from the configuration (same
seed, same partition), builds only its own clients and drops the rest.

Protocol (all on ``COMM_WORLD``):

* rank 0 -> worker, tag ``TAG_CMD``: a small pickled header (``comm.isend``):
  ``{"op": "call", "method", "clients": [(cid, kwargs skeleton)], "arrays": [...]}``
  or ``{"op": "stop", "status"}``; the NumPy arrays of the kwargs follow as raw
  buffers (``Isend``, tag ``TAG_CMD_DATA``), never pickled;
* worker -> rank 0, tag ``TAG_RESULT``: for a ``call``, per client, as soon as
  it finishes, a pickled header (result skeleton, shapes, dtypes, scalars)
  followed by the raw buffers (``Send``, tag ``TAG_DATA``). Sums of one or
  more groups are one ``sums`` command (``{"op": "sums", ..., "groups",
  "keys", "dtype", "packed_keys"}``, ``"groups"``: the rank's clients per
  group, in order; :meth:`MPITransport.sum` is one group of it). Per group,
  per client a small ``receipt`` (its other entries) or ``dropped`` (its
  error), and after the rank's last client of the group one ``partial``: the
  rank's own sum of its clients' entries, sent without blocking while the
  rank runs the next group's clients. Rank 0 thus receives one set of
  matrices per rank and group of a layer, not one per client. Each group's
  messages have their own tags (``TAG_GROUPS + 2 g``, ``+ 1`` for the
  buffers), so rank 0 takes the groups one at a time; a rank waits for its
  older partial before starting a third group, so each side holds at most
  two groups' sums. Otherwise (on ``TAG_RESULT``) an error header naming
  rank, client and exception, or
  ``{"op": "bye"}`` acknowledging a stop.

Buffers over ``chunk_bytes`` (2**30) travel as several messages (MPI counts
are C ints). With ``pack_upper`` the entries a sum declares upper-triangular
(the Gram matrices, whose lower triangle the clients never touch) travel as
their packed upper triangle, d(d+1)/2 values instead of d^2 (off by default:
slower over shared memory, see :class:`MPITransport` and
``experiments/mpi_pack.py``).

A sum's :attr:`~fedlayer.transport.Sum.transport` holds, per rank, the bytes
of its partial sum and the seconds rank 0 spent receiving them.

MPI is imported lazily and only when the process was started by ``mpiexec``
(see :func:`world`), so plain runs never initialize it.
"""

from __future__ import annotations

import json
import os
import pickle  # noqa: F401  (headers are pickled by mpi4py's lowercase calls)
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from .transport import Sum, Transport, client_side_sum, fold, pack_upper, unpack_upper

__all__ = ["MPITransport", "serve", "report_startup_failure", "launch_rank", "world", "hosting_rank", "watch_ranks",
           "rank_finished", "CHUNK_BYTES"]

TAG_CMD, TAG_CMD_DATA, TAG_RESULT, TAG_DATA = 11, 12, 13, 14
# A multi-group sum's messages of group g travel under tags TAG_GROUPS + 2 g (headers) and
# TAG_GROUPS + 2 g + 1 (buffers), so that rank 0 can take one group at a time.
TAG_GROUPS = 100


def _group_tags(index):
    return TAG_GROUPS + 2 * index, TAG_GROUPS + 2 * index + 1
CHUNK_BYTES = 2**30
_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_RANK")
_MAX_SLEEP = 0.005
ABORT_GRACE_S = 1.0   # pause before MPI_Abort so the explaining error reaches stderr


def launch_rank():
    """This process's rank as the launcher's environment gives it (0 when not under mpiexec), without MPI."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def world():
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


def node_share(affinities, mine):
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


def rank_cores(comm):
    """(this rank's share of its node's cores, ranks on the node): a collective call over ``comm``.

    Ranks on one node run at the same time (a worker's clients, and the
    server's solves while the workers run the next group); each one running
    BLAS on every core would put two or more threads per core, and
    OpenBLAS's threads spin while they wait for work (measured here:
    pFedACnnL on MNIST-DNN, 3 ranks on 2 cores, 25.6-30.1 s with clients of
    1-2 cores against 6.1-7.3 s with 1).
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


def watch_ranks(comm):
    """Start this host's watcher of dead ranks (:mod:`fedlayer._rankwatch`); collective over ``comm``.

    Every rank calls it once at startup; the first rank on each host starts
    the watcher with its host's (rank, pid) pairs. Each rank then calls
    :func:`rank_finished` when it ends in an orderly way (its error, if any,
    already printed), so that only a rank that dies unexplained is named.
    Nothing is started where Linux pidfds are missing.

    Each rank also holds a pipe open for its whole life, its "lifeline": the
    watcher opens the read end through /proc, and a rank's death closes the
    write end in the kernel's first steps of its exit, before mpiexec, which
    learns of the death from the same closing files, can kill the others.
    The rank's pidfd, which signals only once its teardown is over, was
    readable after those of the ranks mpiexec killed next in 15 of 15 trials.
    """
    import socket
    import subprocess
    import tempfile

    from mpi4py import MPI

    global _marker_dir, _lifeline
    if _lifeline is None:
        _lifeline = os.pipe()  # not inherited by the processes a rank starts
    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        pairs = host_comm.gather((comm.Get_rank(), os.getpid(), _lifeline[0]), root=0)
        marker_dir = None
        if host_comm.Get_rank() == 0 and _pidfds_work():
            try:
                marker_dir = tempfile.mkdtemp(prefix="fedlayer-ranks-")
                watcher = Path(__file__).with_name("_rankwatch.py")
                # A session of its own: mpiexec's cleanup, which kills the ranks, must not take the watcher along.
                subprocess.Popen([sys.executable, str(watcher), marker_dir, socket.gethostname(),
                                  *(f"{rank}:{pid}:{fd}" for rank, pid, fd in pairs)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
            except OSError as err:  # a diagnostic must not stop the job
                print(f"fedlayer (MPI rank {comm.Get_rank()}): no watcher of dead ranks on this host ({err})",
                      file=sys.stderr, flush=True)
                if marker_dir is not None:
                    shutil.rmtree(marker_dir, ignore_errors=True)
                marker_dir = None
        _marker_dir = host_comm.bcast(marker_dir, root=0)
    finally:
        host_comm.Free()


def _pidfds_work():
    """Whether this kernel has pidfd_open (Linux >= 5.3), not only this Python."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def rank_finished(comm, aborting=False):
    """Mark this rank's end as explained (see :func:`watch_ranks`); idempotent.

    ``aborting``: this rank stops the whole job (MPI_Abort) after printing why,
    so no rank on this host that the abort kills is to be named either.
    """
    if _marker_dir is not None:
        try:
            Path(_marker_dir, "abort" if aborting else str(comm.Get_rank())).touch()
        except OSError:
            pass  # the watcher is gone already: nothing left to tell it


def hosting_rank(cid, size):
    """Rank hosting client ``cid`` in a world of ``size`` ranks (rank 0 is the server)."""
    return 1 + cid % (size - 1)


def _chunk_bytes():
    # FEDLAYER_MPI_CHUNK_BYTES (all ranks must agree) lets the tests exercise chunking with small buffers.
    return int(os.environ.get("FEDLAYER_MPI_CHUNK_BYTES", CHUNK_BYTES))


class _Ref:
    """Placeholder for the i-th buffer of a message."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


# -- (de)serialization: skeleton + raw buffers ---------------------------------

def _flatten(obj, arrays, descs, memo, pack=False, packed_keys=()):
    """Replace arrays by _Ref placeholders; buffers go to ``arrays``, (shape, dtype, packed) to ``descs``.

    Square matrices under a dict key of ``packed_keys`` travel as their packed upper triangle.
    """
    if isinstance(obj, np.ndarray):
        key = (id(obj), pack)
        if key in memo:
            return _Ref(memo[key])
        packed = pack and obj.ndim == 2 and obj.shape[0] == obj.shape[1]
        buffer = pack_upper(obj) if packed else np.ascontiguousarray(obj)
        memo[key] = len(arrays)
        arrays.append(buffer)
        descs.append((obj.shape, obj.dtype.str, packed))
        return _Ref(len(arrays) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, arrays, descs, memo, k in packed_keys) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(v, arrays, descs, memo) for v in obj)
    return obj


def _inflate(obj, arrays):
    if isinstance(obj, _Ref):
        return arrays[obj.i]
    if isinstance(obj, dict):
        return {k: _inflate(v, arrays) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_inflate(v, arrays) for v in obj)
    return obj


def _wire_shape(shape, packed):
    if packed:
        d = shape[0]
        return (d * (d + 1) // 2,)
    return tuple(shape)


def _chunks(buffer, chunk):
    """Byte views of ``buffer`` of at most ``chunk`` bytes (none for an empty buffer)."""
    raw = buffer.reshape(-1).view(np.uint8)
    return [raw[start:start + chunk] for start in range(0, raw.size, chunk)]


def _send_buffers(comm, arrays, dest, tag, chunk, blocking):
    from mpi4py import MPI

    requests = []
    for buffer in arrays:
        for part in _chunks(buffer, chunk):
            if blocking:
                comm.Send([part, MPI.BYTE], dest=dest, tag=tag)
            else:
                requests.append(comm.Isend([part, MPI.BYTE], dest=dest, tag=tag))
    return requests


def _post_receives(comm, descs, source, tag, chunk):
    """Allocate the wire buffers of ``descs`` and post their Irecvs."""
    from mpi4py import MPI

    buffers, requests = [], []
    for shape, dtype, packed in descs:
        buffer = np.empty(_wire_shape(shape, packed), dtype=np.dtype(dtype))
        buffers.append(buffer)
        for part in _chunks(buffer, chunk):
            requests.append(comm.Irecv([part, MPI.BYTE], source=source, tag=tag))
    return buffers, requests


def _unwire(buffers, descs):
    return [unpack_upper(b, shape[0]) if packed else b for b, (shape, _, packed) in zip(buffers, descs)]


def _sleep(delay):
    time.sleep(delay)
    return min(delay * 2, _MAX_SLEEP)


# -- server side ----------------------------------------------------------------

class MPITransport(Transport):
    """Server-side transport reaching the clients hosted on ranks 1..R-1.

    Parameters
    ----------
    comm : mpi4py communicator (COMM_WORLD); this process must be rank 0.
    deadline_s : float
        Longest wait for any rank with outstanding clients to deliver its next
        message; past it the call raises naming the clients and ranks still
        pending, and :meth:`close` aborts the job (a hung rank cannot be
        stopped otherwise).
    pack_upper : bool or None
        Send the entries a sum declares upper-triangular (the Gram matrices)
        as their packed upper triangles: half the bytes. On by default (None
        reads ``FEDLAYER_MPI_PACK_UPPER``, default 1; 0 sends the full
        matrices): over shared memory on a 2-core machine the packed sums took
        as long as the full ones (2026-11-29, ``experiments/mpi_pack.py``),
        and over any slower link the halved transfer is the gain.
    chunk_bytes : int
        Largest single MPI message (default 2**30).
    """

    def __init__(self, comm, deadline_s=600.0, pack_upper=None, chunk_bytes=None):
        if comm.Get_rank() != 0:
            raise ValueError("MPITransport runs on rank 0")
        self.comm = comm
        self.deadline_s = float(deadline_s)
        if pack_upper is None:
            pack_upper = os.environ.get("FEDLAYER_MPI_PACK_UPPER", "1") not in ("", "0")
        self.pack_upper = bool(pack_upper)
        self.chunk = int(chunk_bytes or _chunk_bytes())
        self.workers = list(range(1, comm.Get_size()))
        self._rank_of = None
        self._seq = 0
        self._sends = []          # outstanding Isend requests (and the buffers they read)
        self._closed = False
        self._dead = None         # message of a deadline failure: close() aborts
        self._failed = False
        self._gone = set()        # ranks that said bye on their own (interrupted): close() waits for none of them

    # -- handshake: every worker reports its clients (lazy, so rank 0 loads its data meanwhile)
    @property
    def client_ids(self):
        if self._rank_of is None:
            self._rank_of = {}
            waiting = set(self.workers)
            last = {r: time.monotonic() for r in self.workers}
            for source, header, _ in self._messages(waiting, last, lambda: {r: "startup" for r in waiting}):
                if header["op"] == "hello":
                    for cid in header["clients"]:
                        self._rank_of[cid] = source
                    waiting.discard(source)
                else:
                    self._unexpected(source, header)
            if not self._rank_of:
                raise RuntimeError("no MPI rank hosts any client")
        return sorted(self._rank_of)

    def rank_of(self, cid):
        self.client_ids
        return self._rank_of[cid]

    def _dispatch(self, op, method, args, extra=None, per_rank=None):
        """Send ``op`` for ``method`` to every rank hosting a client of ``args``; returns (seq, pending per rank).

        ``per_rank(rank, cids)`` (optional) adds entries to that rank's header.
        """
        if self._closed:
            raise RuntimeError("MPITransport is closed")
        rank_of = {cid: self.rank_of(cid) for cid in args}
        self._seq += 1
        pending = {r: set() for r in self.workers}
        for cid, r in rank_of.items():
            pending[r].add(cid)
        for r in self.workers:
            if not pending[r]:
                continue
            arrays, descs, memo = [], [], {}
            clients = [(cid, _flatten(args[cid], arrays, descs, memo)) for cid in args if rank_of[cid] == r]
            header = {"op": op, "seq": self._seq, "method": method, "clients": clients, "arrays": descs,
                      **(extra or {}), **(per_rank(r, pending[r]) if per_rank else {})}
            self._sends.append((self.comm.isend(header, dest=r, tag=TAG_CMD), None))
            for request in _send_buffers(self.comm, arrays, r, TAG_CMD_DATA, self.chunk, blocking=False):
                self._sends.append((request, arrays))
        return self._seq, pending

    def call(self, method, args):
        seq, pending = self._dispatch("call", method, args)
        busy = {r for r in self.workers if pending[r]}
        last = {r: time.monotonic() for r in busy}

        def still_waiting():
            return {r: sorted(pending[r]) for r in busy}

        for source, header, _ in self._messages(busy, last, still_waiting):
            if header["op"] == "result" and header["seq"] == seq and header["cid"] in pending[source]:
                cid = header["cid"]
                pending[source].discard(cid)
                if not pending[source]:
                    busy.discard(source)
                yield cid, header["result"]
            else:
                self._unexpected(source, header)
        self._reap_sends(wait=True)

    def sum(self, method, args, keys, *, dtype=np.float64, upper=()):
        # One group of :meth:`sum_groups`: the same command and messages.
        (_, outcome), = self.sum_groups(method, [(None, args)], keys, dtype=dtype, upper=upper)
        return outcome

    def sum_groups(self, method, group_args, keys, *, dtype=np.float64, upper=()):
        """As :meth:`Transport.sum_groups`: one command per rank for all the groups, the sums taken a group at a time.

        Each rank runs its clients group by group and sends each group's
        partial sum without blocking as soon as its last client of the group
        is done, then goes on to its next client (of the next group) while
        the partial travels. Rank 0 receives only the group it is summing
        (each group has its own tags); a rank keeps at most one partial in
        flight while it computes the next, so each side holds at most two
        groups' sums.
        """
        group_args = list(group_args)
        if not group_args:
            return
        order = [key for key, _ in group_args]
        args = {cid: kwargs for _, member_args in group_args for cid, kwargs in member_args.items()}
        group_of = {cid: index for index, (_, member_args) in enumerate(group_args) for cid in member_args}
        extra = {"keys": list(keys), "dtype": np.dtype(dtype).str, "upper_keys": list(upper),
                 "packed_keys": list(upper) if self.pack_upper else []}

        def per_rank(rank, cids):
            return {"groups": [[cid for cid in member_args if cid in cids] for _, member_args in group_args]}

        seq, pending = self._dispatch("sums", method, args, extra, per_rank)
        ranks = [r for r in self.workers if pending[r]]
        taken = 0
        delay = float(os.environ.get("FEDLAYER_TEST_DELAY_SUMS", "0") or 0)  # test-only: a slow server
        try:
            for index, key in enumerate(order):
                time.sleep(delay)
                outcome = self._group_sum(seq, index, key, ranks, pending, group_of, dtype, upper)
                taken = index + 1
                yield key, outcome
        finally:
            # Left early (the server raised between groups): the ranks still send every group of
            # this command, and must be able to, before they take the next command (or a stop).
            if not self._closed and not self._failed:
                for index in range(taken, len(order)):
                    self._group_sum(seq, index, order[index], ranks, pending, group_of, dtype, upper)
            self._reap_sends(wait=True)

    def _group_sum(self, seq, index, key, ranks, pending, group_of, dtype, upper):
        """Group ``index``'s Sum of a multi-group command: its receipts and every rank's partial."""
        waiting = {r: {cid for cid in pending[r] if group_of[cid] == index} for r in ranks}
        return self._collect(seq, waiting, dtype, upper, index, "its partial sum" + ("" if key is None else
                                                                                     f" of group {key}"))

    def _collect(self, seq, waiting, dtype, upper, group, what):
        """One group's messages: a receipt or dropout per client of ``waiting`` (rank -> cids), then each rank's partial.

        Every rank of ``waiting`` is busy until its partial, which comes after its last client.
        """
        tags = _group_tags(group)
        busy = set(waiting)
        last = {r: time.monotonic() for r in busy}
        outcome = Sum()

        def still_waiting():
            return {r: sorted(waiting[r]) if waiting[r] else what for r in busy}

        for source, header, recv_s in self._messages(busy, last, still_waiting, tags):
            op = header["op"]
            if header.get("seq") != seq or header.get("group") != group or op not in ("receipt", "dropped", "partial"):
                self._unexpected(source, header)
            if op == "partial":
                if waiting[source] or source not in busy:
                    self._unexpected(source, header)
                _test_trace("partial_received", seq=seq, group=group, source=source)
                fold(outcome.totals, header["result"], dtype, upper)
                outcome.transport[f"rank {source}"] = {"bytes": header["nbytes"], "receive_s": recv_s}
                busy.discard(source)
                continue
            cid = header["cid"]
            if cid not in waiting[source]:
                self._unexpected(source, header)
            waiting[source].discard(cid)
            if op == "dropped":
                outcome.dropped[cid] = header["error"]
            else:
                outcome.receipts[cid] = header["result"]
                outcome.up_bytes[cid] = header["nbytes"]
        return outcome

    def _unexpected(self, source, header):
        """A worker's error report (or a protocol violation): stop every rank, then raise.

        A rank interrupted by Ctrl-C (which reaches every rank of the job) raises
        KeyboardInterrupt here too; one that could not build its clients, the
        ValueError of bad input (its message, without the remote traceback).
        """
        self._failed = True
        if header.get("op") == "bye" and header.get("interrupted"):
            self._gone.add(source)
            self.close(status=1)
            raise KeyboardInterrupt(f"MPI rank {source} was interrupted")
        if header.get("op") == "error" and header.get("method") == "startup":
            self.close(status=1)
            raise ValueError(f"MPI rank {header['rank']} could not build its clients: {header['error']}")
        if header.get("op") == "error":
            text = (f"client {header['cid']} on MPI rank {header['rank']} failed in {header['method']}: "
                    f"{header['error']}")
            detail = "\n--- remote traceback (rank %s) ---\n%s" % (header["rank"], header["traceback"])
        else:
            text, detail = f"unexpected message from MPI rank {source}: {header.get('op')!r}", ""
        self.close(status=1)
        raise RuntimeError(text + detail)

    def _messages(self, busy, last, still_waiting, tags=(TAG_RESULT, TAG_DATA)):
        """Yield (source, header with arrays inflated, receive seconds) while ``busy`` is not empty.

        ``tags``: of the headers and of their buffers. Errors of a rank come
        under TAG_RESULT whatever they are.
        """
        from mpi4py import MPI

        comm = self.comm
        status = MPI.Status()
        delay = 1e-4
        header_tag, data_tag = tags
        while busy:
            if (comm.Iprobe(source=MPI.ANY_SOURCE, tag=header_tag, status=status)
                    or (header_tag != TAG_RESULT and comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULT, status=status))):
                source, tag = status.Get_source(), status.Get_tag()
                header = comm.recv(source=source, tag=tag)
                start = time.perf_counter()
                if header.get("arrays"):
                    buffers, requests = _post_receives(comm, header["arrays"], source, data_tag, self.chunk)
                    delay_b = 1e-5
                    while not MPI.Request.Testall(requests):
                        if time.monotonic() - start > self.deadline_s:
                            self._deadline({source: still_waiting().get(source, "a transfer")})
                        delay_b = _sleep(delay_b)
                    arrays = _unwire(buffers, header["arrays"])
                    header["result"] = _inflate(header["result"], arrays)
                recv_s = time.perf_counter() - start
                last[source] = time.monotonic()
                delay = 1e-4
                yield source, header, recv_s
                continue
            self._reap_sends(wait=False)
            now = time.monotonic()
            late = [r for r in busy if now - last[r] > self.deadline_s]
            if late:
                self._deadline({r: c for r, c in still_waiting().items() if r in late})
            delay = _sleep(delay)

    def _deadline(self, waiting):
        """``waiting``: rank -> list of client ids (or a phrase such as "startup")."""
        detail = "; ".join(f"rank {r}: clients {c}" if isinstance(c, list) else f"rank {r}: {c}"
                           for r, c in sorted(waiting.items()))
        cids = sorted(cid for c in waiting.values() if isinstance(c, list) for cid in c)
        text = (f"no answer from MPI rank(s) {sorted(waiting)} within the deadline of {self.deadline_s:g} s; "
                f"still waiting for client ids {cids} ({detail})")
        self._dead = text
        print(f"fedlayer (MPI rank 0): error: {text}; aborting the job", file=sys.stderr, flush=True)
        raise RuntimeError(text)

    def _reap_sends(self, wait):
        if wait:
            from mpi4py import MPI

            delay = 1e-5
            start = time.monotonic()
            while self._sends and not MPI.Request.Testall([req for req, _ in self._sends]):
                if time.monotonic() - start > self.deadline_s:
                    self._deadline({-1: "sending commands"})
                delay = _sleep(delay)
            self._sends = []
        else:
            self._sends = [(req, keep) for req, keep in self._sends if not req.Test()]

    def close(self, status=0):
        """Tell every worker to stop and wait for their acknowledgements (aborting on a hung rank)."""
        if self._closed:
            return
        self._closed = True
        comm = self.comm
        if self._dead is not None:
            _abort(comm)
        status = 1 if self._failed else status
        if status:
            # Marked before the stop: workers told status 1 exit non-zero, and mpiexec may then kill this rank
            # at once; its error is its own, not a death for the watcher to report.
            rank_finished(comm)
        for r in self.workers:
            if r not in self._gone:
                comm.isend({"op": "stop", "status": status}, dest=r, tag=TAG_CMD).Wait()
        waiting = set(self.workers) - self._gone
        last = {r: time.monotonic() for r in self.workers}
        try:
            # results, errors or a late handshake still in flight are drained and dropped
            for source, header, _ in self._messages(waiting, last, lambda: {r: "shutdown" for r in waiting}):
                if header["op"] == "bye":
                    waiting.discard(source)
            self._reap_sends(wait=True)
        except RuntimeError:
            _abort(comm)


def _abort(comm):
    """MPI_Abort, after giving mpiexec's proxies time to forward what this rank already wrote.

    The abort kills every process at once, the proxies included; without the pause the error that
    explains the abort is sometimes lost from the job's stderr (seen in about 1 run in 6).
    """
    rank_finished(comm, aborting=True)  # the reason is on stderr: the ranks it kills did not die
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    comm.Abort(1)


# -- worker side ----------------------------------------------------------------

def _test_call_hook(cid, method):
    """Test-only failure of a call (not a sum): FEDLAYER_TEST_FAIL_CALL=method:cid."""
    if os.environ.get("FEDLAYER_TEST_FAIL_CALL") == f"{method}:{cid}":
        raise RuntimeError(f"injected failure of {method} for client {cid} (FEDLAYER_TEST_FAIL_CALL)")


def _test_trace(event, **fields):
    """Test-only: append one JSON line (event, its fields, wall time, rank) to FEDLAYER_TEST_TRACE."""
    path = os.environ.get("FEDLAYER_TEST_TRACE")
    if path:
        from mpi4py import MPI

        line = json.dumps({"event": event, "rank": MPI.COMM_WORLD.Get_rank(), "t": time.time(), **fields})
        with open(path, "a") as trace:
            trace.write(line + "\n")


def _test_hooks(cid, method, kwargs):
    """Test-only failure injection in a sum (environment variables read by the worker).

    FEDLAYER_TEST_FAIL_CLIENT=cid fails the client in every sum;
    FEDLAYER_TEST_FAIL_STEP=method:cid:position in that method's sum of that layer only.
    """
    if os.environ.get("FEDLAYER_TEST_FAIL_CLIENT") == str(cid):
        raise RuntimeError(f"injected failure for client {cid} (FEDLAYER_TEST_FAIL_CLIENT)")
    if os.environ.get("FEDLAYER_TEST_FAIL_STEP") == f"{method}:{cid}:{kwargs.get('position')}":
        raise RuntimeError(f"injected failure of {method} for client {cid} (FEDLAYER_TEST_FAIL_STEP)")
    if os.environ.get("FEDLAYER_TEST_HANG_CLIENT") == str(cid):
        while True:
            time.sleep(3600)


def report_startup_failure(comm, err):
    """Tell rank 0 that this rank could not build its clients (it then stops the job naming this rank)."""
    comm.send({"op": "error", "rank": comm.Get_rank(), "cid": None, "method": "startup",
               "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()},
              dest=0, tag=TAG_RESULT)


def serve(comm, clients):
    """Worker loop of ranks 1..R-1: host ``clients`` (this rank's) until told to stop; returns the exit status.

    Parameters
    ----------
    comm : mpi4py communicator (COMM_WORLD), rank > 0
    clients : list of client objects, or None after :func:`report_startup_failure`
        (the rank then only waits for the stop).
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    chunk = _chunk_bytes()
    if clients is not None:
        clients = {c.client_id: c for c in clients}
        comm.send({"op": "hello", "clients": sorted(clients)}, dest=0, tag=TAG_RESULT)
    else:
        clients = {}
    status = MPI.Status()
    partial_sends = []  # the last partial sum's Isend requests and the buffers they read

    def next_command(block=True):
        delay = 1e-4
        while not comm.Iprobe(source=0, tag=TAG_CMD, status=status):
            if not block:
                return None
            delay = _sleep(delay)
        return comm.recv(source=0, tag=TAG_CMD)

    def send(header, arrays, blocking=True, tags=(TAG_RESULT, TAG_DATA)):
        comm.send(header, dest=0, tag=tags[0])
        return _send_buffers(comm, arrays, 0, tags[1], chunk, blocking=blocking)

    def error(cid, method, err):
        comm.send({"op": "error", "rank": rank, "cid": cid, "method": method,
                   "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()},
                  dest=0, tag=TAG_RESULT)

    try:
        while True:
            command = next_command()
            if partial_sends:
                MPI.Request.Waitall([request for request, _ in partial_sends])
                partial_sends = []
            if command["op"] == "stop":
                comm.send({"op": "bye", "rank": rank}, dest=0, tag=TAG_RESULT)
                return int(command.get("status", 0))
            descs = command["arrays"]
            buffers, requests = _post_receives(comm, descs, 0, TAG_CMD_DATA, chunk)
            MPI.Request.Waitall(requests)
            arrays = _unwire(buffers, descs)
            method, seq = command["method"], command["seq"]
            args = {cid: _inflate(skeleton, arrays) for cid, skeleton in command["clients"]}
            if command["op"] == "sums":
                # Group by group; each group's partial leaves without blocking while the next group's clients
                # run. At most one partial is in flight while the next is computed (two groups' sums held).
                in_flight = []
                for index, cids in enumerate(command["groups"]):
                    tags = _group_tags(index)
                    while len(in_flight) > 1:
                        MPI.Request.Waitall([request for request, _ in in_flight.pop(0)])
                    _test_trace("group_started", seq=seq, group=index)

                    def report(cid, receipt, nbytes, reason, index=index, tags=tags):
                        if reason is not None:
                            comm.send({"op": "dropped", "seq": seq, "group": index, "cid": cid, "error": reason},
                                      dest=0, tag=tags[0])
                            return
                        out, out_descs = [], []
                        skeleton = _flatten(receipt, out, out_descs, {})
                        send({"op": "receipt", "seq": seq, "group": index, "cid": cid, "result": skeleton,
                              "arrays": out_descs, "nbytes": nbytes}, out, tags=tags)

                    try:
                        totals = client_side_sum(clients, method, {cid: args[cid] for cid in cids}, command["keys"],
                                                 np.dtype(command["dtype"]), hooks=_test_hooks, done=report,
                                                 upper=command["upper_keys"])[0]
                    except Exception as err:
                        error(None, method, err)
                        break
                    out, out_descs = [], []
                    skeleton = _flatten(totals, out, out_descs, {}, packed_keys=command["packed_keys"])
                    requests = send({"op": "partial", "seq": seq, "group": index, "result": skeleton,
                                     "arrays": out_descs, "nbytes": int(sum(b.nbytes for b in out))}, out,
                                    blocking=False, tags=tags)
                    in_flight.append([(request, out) for request in requests])
                    del totals
                partial_sends = [pair for pairs in in_flight for pair in pairs]
                continue
            stop = None
            for cid, kwargs in args.items():
                stop = next_command(block=False)  # only a stop can arrive during a call
                if stop is not None:
                    break
                try:
                    _test_call_hook(cid, method)
                    result = getattr(clients[cid], method)(**kwargs)
                except Exception as err:
                    error(cid, method, err)
                    break
                out, out_descs = [], []
                skeleton_out = _flatten(result, out, out_descs, {})
                send({"op": "result", "seq": seq, "cid": cid, "result": skeleton_out, "arrays": out_descs}, out)
                del result, out
            if stop is not None:
                comm.send({"op": "bye", "rank": rank}, dest=0, tag=TAG_RESULT)
                return int(stop.get("status", 0))
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank of the job: say so, or rank 0 waits for this rank until its deadline.
        comm.send({"op": "bye", "rank": rank, "interrupted": True}, dest=0, tag=TAG_RESULT)
        return 130
