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
* worker -> rank 0, tag ``TAG_RESULT``: per client, as soon as it finishes, a
  pickled header (result skeleton, shapes, dtypes, scalars) followed by the
  raw buffers (``Send``, tag ``TAG_DATA``); or an error header naming rank,
  client and exception; or ``{"op": "bye"}`` acknowledging a stop.

Buffers over ``chunk_bytes`` (2**30) travel as several messages (MPI counts
are C ints). With ``pack_upper`` the statistics ``G`` of ``local_stats`` --
whose lower triangle the clients never touch -- travel as their packed upper
triangle, d(d+1)/2 values instead of d^2 (off by default: slower over shared
memory, see :class:`MPITransport` and ``experiments/mpi_pack.py``).

Each result dict gains ``"mpi_recv_s"``: seconds rank 0 spent receiving its
buffers (not added to ``label_summary``, whose whole payload is counted as
upload bytes).

MPI is imported lazily and only when the process was started by ``mpiexec``
(see :func:`world`), so plain runs never initialize it.
"""

from __future__ import annotations

import os
import pickle  # noqa: F401  (headers are pickled by mpi4py's lowercase calls)
import sys
import time
import traceback

import numpy as np

from .transport import Transport

__all__ = ["MPITransport", "serve", "world", "hosting_rank", "CHUNK_BYTES"]

TAG_CMD, TAG_CMD_DATA, TAG_RESULT, TAG_DATA = 11, 12, 13, 14
CHUNK_BYTES = 2**30
_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_RANK")
_MAX_SLEEP = 0.005
ABORT_GRACE_S = 1.0   # pause before MPI_Abort so the explaining error reaches stderr


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

def _flatten(obj, arrays, descs, memo, pack=False):
    """Replace arrays by _Ref placeholders; buffers go to ``arrays``, (shape, dtype, packed) to ``descs``."""
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
        return {k: _flatten(v, arrays, descs, memo, pack and k == "G") for k, v in obj.items()}
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


def pack_upper(G):
    """Upper triangle of square ``G`` row by row, as a contiguous 1-D array of d(d+1)/2 values."""
    d = G.shape[0]
    out = np.empty(d * (d + 1) // 2, dtype=G.dtype)
    offset = 0
    for i in range(d):
        n = d - i
        out[offset:offset + n] = G[i, i:]
        offset += n
    return out


def unpack_upper(packed, d):
    """Inverse of :func:`pack_upper`; the strict lower triangle is zero (as the clients leave it)."""
    G = np.zeros((d, d), dtype=packed.dtype)
    offset = 0
    for i in range(d):
        n = d - i
        G[i, i:] = packed[offset:offset + n]
        offset += n
    return G


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
        Send the ``G`` of ``local_stats`` as its packed upper triangle. Off by
        default (None reads ``FEDLAYER_MPI_PACK_UPPER``, default 0): measured
        over shared memory on a 2-core machine, packing and unpacking
        (~50 ms for d=4609) cost more than the halved transfer saves; it pays
        on links slower than about 1.7 GB/s.
    chunk_bytes : int
        Largest single MPI message (default 2**30).
    """

    def __init__(self, comm, deadline_s=600.0, pack_upper=None, chunk_bytes=None):
        if comm.Get_rank() != 0:
            raise ValueError("MPITransport runs on rank 0")
        self.comm = comm
        self.deadline_s = float(deadline_s)
        if pack_upper is None:
            pack_upper = os.environ.get("FEDLAYER_MPI_PACK_UPPER", "0") not in ("", "0")
        self.pack_upper = bool(pack_upper)
        self.chunk = int(chunk_bytes or _chunk_bytes())
        self.workers = list(range(1, comm.Get_size()))
        self._rank_of = None
        self._seq = 0
        self._sends = []          # outstanding Isend requests (and the buffers they read)
        self._closed = False
        self._dead = None         # message of a deadline failure: close() aborts
        self._failed = False

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

    def call(self, method, args):
        if self._closed:
            raise RuntimeError("MPITransport is closed")
        rank_of = {cid: self.rank_of(cid) for cid in args}
        self._seq += 1
        seq = self._seq
        pending = {r: set() for r in self.workers}
        for cid, r in rank_of.items():
            pending[r].add(cid)
        for r in self.workers:
            if not pending[r]:
                continue
            arrays, descs, memo = [], [], {}
            clients = [(cid, _flatten(args[cid], arrays, descs, memo)) for cid in args if rank_of[cid] == r]
            header = {"op": "call", "seq": seq, "method": method, "pack_upper": self.pack_upper,
                      "clients": clients, "arrays": descs}
            self._sends.append((self.comm.isend(header, dest=r, tag=TAG_CMD), None))
            for request in _send_buffers(self.comm, arrays, r, TAG_CMD_DATA, self.chunk, blocking=False):
                self._sends.append((request, arrays))
        busy = {r for r in self.workers if pending[r]}
        last = {r: time.monotonic() for r in busy}

        def still_waiting():
            return {r: sorted(pending[r]) for r in busy}

        for source, header, recv_s in self._messages(busy, last, still_waiting):
            op = header["op"]
            if op == "result" and header["seq"] == seq and header["cid"] in pending[source]:
                cid = header["cid"]
                pending[source].discard(cid)
                if not pending[source]:
                    busy.discard(source)
                result = header["result"]
                if isinstance(result, dict) and method != "label_summary":
                    # label_summary's whole payload is counted as uploaded bytes; keep it unchanged.
                    result["mpi_recv_s"] = recv_s
                yield cid, result
            else:
                self._unexpected(source, header)
        self._reap_sends(wait=True)

    def _unexpected(self, source, header):
        """A worker's error report (or a protocol violation): stop every rank, then raise."""
        self._failed = True
        if header.get("op") == "error":
            text = (f"client {header['cid']} on MPI rank {header['rank']} failed in {header['method']}: "
                    f"{header['error']}")
            detail = "\n--- remote traceback (rank %s) ---\n%s" % (header["rank"], header["traceback"])
        else:
            text, detail = f"unexpected message from MPI rank {source}: {header.get('op')!r}", ""
        self.close(status=1)
        raise RuntimeError(text + detail)

    def _messages(self, busy, last, still_waiting):
        """Yield (source, header with arrays inflated, receive seconds) while ``busy`` is not empty."""
        from mpi4py import MPI

        comm = self.comm
        status = MPI.Status()
        delay = 1e-4
        while busy:
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULT, status=status):
                source = status.Get_source()
                header = comm.recv(source=source, tag=TAG_RESULT)
                start = time.perf_counter()
                if header.get("arrays"):
                    buffers, requests = _post_receives(comm, header["arrays"], source, TAG_DATA, self.chunk)
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
        for r in self.workers:
            comm.isend({"op": "stop", "status": status}, dest=r, tag=TAG_CMD).Wait()
        waiting = set(self.workers)
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
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    comm.Abort(1)


# -- worker side ----------------------------------------------------------------

def _test_hooks(method, cid):
    """Test-only failure injection (environment variables read by the worker)."""
    if method != "local_stats":
        return
    if os.environ.get("FEDLAYER_TEST_FAIL_CLIENT") == str(cid):
        raise RuntimeError(f"injected failure for client {cid} (FEDLAYER_TEST_FAIL_CLIENT)")
    if os.environ.get("FEDLAYER_TEST_HANG_CLIENT") == str(cid):
        while True:
            time.sleep(3600)


def serve(comm, config):
    """Worker loop of ranks 1..R-1: host this rank's clients until told to stop; returns the exit status."""
    from mpi4py import MPI

    from .algorithms import ALGORITHMS
    from .run import build, load_dataset, make_clients

    rank, size = comm.Get_rank(), comm.Get_size()
    chunk = _chunk_bytes()
    try:
        dataset = load_dataset(config)
        model_config = build(config, dataset).config()
        if ALGORITHMS[config.algorithm].centralized:
            ids = [0] if rank == 1 else []
        else:
            ids = [cid for cid in range(len(dataset.clients)) if hosting_rank(cid, size) == rank]
        clients = {c.client_id: c for c in make_clients(config, dataset, model_config, client_ids=ids)} if ids else {}
        del dataset  # the other clients' data goes with it
        comm.send({"op": "hello", "clients": sorted(clients)}, dest=0, tag=TAG_RESULT)
    except Exception as err:
        comm.send({"op": "error", "rank": rank, "cid": None, "method": "startup",
                   "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()},
                  dest=0, tag=TAG_RESULT)
        clients = {}

    status = MPI.Status()

    def next_command(block=True):
        delay = 1e-4
        while not comm.Iprobe(source=0, tag=TAG_CMD, status=status):
            if not block:
                return None
            delay = _sleep(delay)
        return comm.recv(source=0, tag=TAG_CMD)

    while True:
        command = next_command()
        if command["op"] == "stop":
            comm.send({"op": "bye", "rank": rank}, dest=0, tag=TAG_RESULT)
            return int(command.get("status", 0))
        descs = command["arrays"]
        buffers, requests = _post_receives(comm, descs, 0, TAG_CMD_DATA, chunk)
        MPI.Request.Waitall(requests)
        arrays = _unwire(buffers, descs)
        method = command["method"]
        stop = None
        for cid, skeleton in command["clients"]:
            stop = next_command(block=False)  # only a stop can arrive during a call
            if stop is not None:
                break
            try:
                kwargs = _inflate(skeleton, arrays)
                _test_hooks(method, cid)
                result = getattr(clients[cid], method)(**kwargs)
            except Exception as err:
                comm.send({"op": "error", "rank": rank, "cid": cid, "method": method,
                           "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()},
                          dest=0, tag=TAG_RESULT)
                break
            out, out_descs = [], []
            skeleton_out = _flatten(result, out, out_descs, {}, pack=command["pack_upper"] and method == "local_stats")
            comm.send({"op": "result", "seq": command["seq"], "cid": cid, "result": skeleton_out,
                       "arrays": out_descs}, dest=0, tag=TAG_RESULT)
            _send_buffers(comm, out, 0, TAG_DATA, chunk, blocking=True)
            del result, out
        if stop is not None:
            comm.send({"op": "bye", "rank": rank}, dest=0, tag=TAG_RESULT)
            return int(stop.get("status", 0))
