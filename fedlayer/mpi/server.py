"""Rank 0's side of an MPI job: :class:`MPITransport`, the server's view of the clients on ranks 1..R-1."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..transport import Sum, Transport, fold
from .hooks import ServerHooks
from .launch import abort_job, rank_finished
from .wire import (
    TAG_CMD,
    TAG_CMD_DATA,
    TAG_DATA,
    TAG_RESULT,
    Op,
    Payload,
    backoff,
    configured_chunk_bytes,
    group_tags,
    inflate,
    post_receives,
    send_buffers,
    unwire,
)

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPITransport"]

_GROUP_OPS = (Op.RECEIPT, Op.DROPPED, Op.PARTIAL)


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
        as their packed upper triangles: half the bytes. None reads
        ``FEDLAYER_MPI_PACK_UPPER`` (default 1; 0 sends the full matrices).
    chunk_bytes : int or None
        Largest single MPI message; None: :func:`fedlayer.mpi.wire.configured_chunk_bytes`.
    hooks : ServerHooks or None
        Called at the points :class:`~fedlayer.mpi.hooks.ServerHooks` names
        (the tests' slow server and trace); None: no hooks.
    """

    comm: MPI.Intracomm
    deadline_s: float
    pack_upper: bool
    chunk: int
    workers: list[int]
    hooks: ServerHooks

    def __init__(self, comm: MPI.Intracomm, deadline_s: float = 600.0, pack_upper: bool | None = None,
                 chunk_bytes: int | None = None, hooks: ServerHooks | None = None) -> None:
        if comm.Get_rank() != 0:
            raise ValueError("MPITransport runs on rank 0")
        self.comm = comm
        self.deadline_s = float(deadline_s)
        if pack_upper is None:
            pack_upper = os.environ.get("FEDLAYER_MPI_PACK_UPPER", "1") not in ("", "0")
        self.pack_upper = bool(pack_upper)
        self.chunk = int(chunk_bytes or configured_chunk_bytes())
        self.workers = list(range(1, comm.Get_size()))
        self._rank_of = None
        self._seq = 0
        self._sends = []          # outstanding Isend requests (and the buffers they read)
        self._closed = False
        self._dead = None         # message of a deadline failure: close() aborts
        self._failed = False
        self._gone = set()        # ranks that said bye on their own (interrupted): close() waits for none of them
        self.hooks = ServerHooks() if hooks is None else hooks

    # -- handshake: every worker reports its clients (lazy, so rank 0 loads its data meanwhile)
    def _hosts(self):
        """{client id: its rank}, from the workers' HELLOs (awaited the first time)."""
        if self._rank_of is None:
            self._rank_of = {}
            waiting = set(self.workers)
            last = {r: time.monotonic() for r in self.workers}
            for source, header, _ in self._messages(waiting, last, lambda: {r: "startup" for r in waiting}):
                if header["op"] is Op.HELLO:
                    for cid in header["clients"]:
                        self._rank_of[cid] = source
                    waiting.discard(source)
                else:
                    self._unexpected(source, header)
            if not self._rank_of:
                raise RuntimeError("no MPI rank hosts any client")
        return self._rank_of

    @property
    def client_ids(self) -> list[int]:
        return sorted(self._hosts())

    def rank_of(self, cid: int) -> int:
        """The rank hosting client ``cid``."""
        return self._hosts()[cid]

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
            payload = Payload()
            clients = [(cid, payload.flatten(args[cid])) for cid in args if rank_of[cid] == r]
            header = {"op": op, "seq": self._seq, "method": method, "clients": clients, "arrays": payload.descs,
                      **(extra or {}), **(per_rank(r, pending[r]) if per_rank else {})}
            self._sends.append((self.comm.isend(header, dest=r, tag=TAG_CMD), None))
            for request in send_buffers(self.comm, payload.arrays, r, TAG_CMD_DATA, self.chunk, blocking=False):
                self._sends.append((request, payload.arrays))
        return self._seq, pending

    def call(self, method: str, args: Mapping[int, dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        seq, pending = self._dispatch(Op.CALL, method, args)
        busy = {r for r in self.workers if pending[r]}
        last = {r: time.monotonic() for r in busy}

        def still_waiting():
            return {r: sorted(pending[r]) for r in busy}

        for source, header, _ in self._messages(busy, last, still_waiting):
            if header["op"] is Op.RESULT and header["seq"] == seq and header["cid"] in pending[source]:
                cid = header["cid"]
                pending[source].discard(cid)
                if not pending[source]:
                    busy.discard(source)
                yield cid, header["result"]
            else:
                self._unexpected(source, header)
        self._reap_sends(wait=True)

    def sum(self, method: str, args: Mapping[int, dict[str, Any]], keys: Sequence[str], *,
            dtype: npt.DTypeLike = np.float64, upper: Sequence[str] = (),
            on_client: Callable[[int], None] | None = None) -> Sum:
        # One group of :meth:`sum_groups`: the same command and messages.
        (_, outcome), = self.sum_groups(method, [(None, args)], keys, dtype=dtype, upper=upper, on_client=on_client)
        return outcome

    def sum_groups(self, method: str, group_args: Iterable[tuple[Any, Mapping[int, dict[str, Any]]]],
                   keys: Sequence[str], *, dtype: npt.DTypeLike = np.float64,
                   upper: Sequence[str] = (),
                   on_client: Callable[[int], None] | None = None) -> Iterator[tuple[Any, Sum]]:
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

        seq, pending = self._dispatch(Op.SUMS, method, args, extra, per_rank)
        ranks = [r for r in self.workers if pending[r]]
        taken = 0
        try:
            for index, key in enumerate(order):
                self.hooks.before_group(seq, index)
                outcome = self._group_sum(seq, index, key, ranks, pending, group_of, dtype, upper, on_client)
                taken = index + 1
                yield key, outcome
        finally:
            # Left early (the server raised between groups): the ranks still send every group of
            # this command, and must be able to, before they take the next command (or a stop).
            if not self._closed and not self._failed:
                for index in range(taken, len(order)):
                    self._group_sum(seq, index, order[index], ranks, pending, group_of, dtype, upper)
            self._reap_sends(wait=True)

    def _group_sum(self, seq, index, key, ranks, pending, group_of, dtype, upper, on_client=None):
        """Group ``index``'s Sum of a multi-group command: its receipts and every rank's partial."""
        waiting = {r: {cid for cid in pending[r] if group_of[cid] == index} for r in ranks}
        return self._collect(seq, waiting, dtype, upper, index, "its partial sum" + ("" if key is None else
                                                                                     f" of group {key}"), on_client)

    def _collect(self, seq, waiting, dtype, upper, group, what, on_client=None):
        """One group's messages: a receipt or dropout per client of ``waiting`` (rank -> cids), then each partial.

        Every rank of ``waiting`` is busy until its partial, which comes after its last client.
        """
        tags = group_tags(group)
        busy = set(waiting)
        last = {r: time.monotonic() for r in busy}
        outcome = Sum()

        def still_waiting():
            return {r: sorted(waiting[r]) if waiting[r] else what for r in busy}

        for source, header, recv_s in self._messages(busy, last, still_waiting, tags):
            op = header["op"]
            if header.get("seq") != seq or header.get("group") != group or op not in _GROUP_OPS:
                self._unexpected(source, header)
            if op is Op.PARTIAL:
                if waiting[source] or source not in busy:
                    self._unexpected(source, header)
                self.hooks.partial_received(seq, group, source)
                fold(outcome.totals, header["result"], dtype, upper)
                outcome.transport[f"rank {source}"] = {"bytes": header["nbytes"], "receive_s": recv_s}
                busy.discard(source)
                continue
            cid = header["cid"]
            if cid not in waiting[source]:
                self._unexpected(source, header)
            waiting[source].discard(cid)
            if op is Op.DROPPED:
                outcome.dropped[cid] = header["error"]
            else:
                outcome.receipts[cid] = header["result"]
                outcome.up_bytes[cid] = header["nbytes"]
            if on_client is not None:
                on_client(cid)
        return outcome

    def _unexpected(self, source, header):
        """A worker's error report (or a protocol violation): stop every rank, then raise.

        A rank interrupted by Ctrl-C (which reaches every rank of the job) raises
        KeyboardInterrupt here too; one that could not build its clients, the
        ValueError of bad input (its message, without the remote traceback).
        """
        self._failed = True
        op = header.get("op")
        if op is Op.BYE and header.get("interrupted"):
            self._gone.add(source)
            self.close(status=1)
            raise KeyboardInterrupt(f"MPI rank {source} was interrupted")
        if op is Op.ERROR and header.get("method") == "startup":
            self.close(status=1)
            raise ValueError(f"MPI rank {header['rank']} could not build its clients: {header['error']}")
        if op is Op.ERROR:
            text = (f"client {header['cid']} on MPI rank {header['rank']} failed in {header['method']}: "
                    f"{header['error']}")
            detail = f"\n--- remote traceback (rank {header['rank']}) ---\n{header['traceback']}"
        else:
            text, detail = f"unexpected message from MPI rank {source}: {getattr(op, 'value', op)!r}", ""
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
                    or (header_tag != TAG_RESULT
                        and comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULT, status=status))):
                source, tag = status.Get_source(), status.Get_tag()
                header = comm.recv(source=source, tag=tag)
                start = time.perf_counter()
                if header.get("arrays"):
                    buffers, requests = post_receives(comm, header["arrays"], source, data_tag, self.chunk)
                    delay_b = 1e-5
                    while not MPI.Request.Testall(requests):
                        if time.monotonic() - start > self.deadline_s:
                            self._deadline({source: still_waiting().get(source, "a transfer")})
                        delay_b = backoff(delay_b)
                    arrays = unwire(buffers, header["arrays"])
                    header["result"] = inflate(header["result"], arrays)
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
            delay = backoff(delay)

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
                delay = backoff(delay)
            self._sends = []
        else:
            self._sends = [(req, keep) for req, keep in self._sends if not req.Test()]

    def close(self, status: int = 0) -> None:
        """Tell every worker to stop and wait for their acknowledgements (aborting on a hung rank)."""
        if self._closed:
            return
        self._closed = True
        comm = self.comm
        if self._dead is not None:
            abort_job(comm)
        status = 1 if self._failed else status
        if status:
            # Marked before the stop: workers told status 1 exit non-zero, and mpiexec may then kill this rank
            # at once; its error is its own, not a death for the watcher to report.
            rank_finished(comm)
        for r in self.workers:
            if r not in self._gone:
                comm.isend({"op": Op.STOP, "status": status}, dest=r, tag=TAG_CMD).Wait()
        waiting = set(self.workers) - self._gone
        last = {r: time.monotonic() for r in self.workers}
        try:
            # results, errors or a late handshake still in flight are drained and dropped
            for source, header, _ in self._messages(waiting, last, lambda: {r: "shutdown" for r in waiting}):
                if header["op"] is Op.BYE:
                    waiting.discard(source)
            self._reap_sends(wait=True)
        except RuntimeError:
            abort_job(comm)

