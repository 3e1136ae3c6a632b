"""Ranks 1..R-1 of an MPI job: host this rank's clients and answer rank 0's commands until told to stop."""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..transport import client_side_sum
from .hooks import WorkerHooks
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

__all__ = ["Worker", "report_startup_failure", "serve"]


def _error_header(rank, cid, method, err):
    """The ERROR message of a failure in ``method`` (``"startup"``: building the rank's clients)."""
    return {"op": Op.ERROR, "rank": rank, "cid": cid, "method": method,
            "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def report_startup_failure(comm: MPI.Intracomm, err: BaseException) -> None:
    """Tell rank 0 that this rank could not build its clients (it then stops the job naming this rank)."""
    comm.send(_error_header(comm.Get_rank(), None, "startup", err), dest=0, tag=TAG_RESULT)


def serve(comm: MPI.Intracomm, clients: Iterable | None, hooks: WorkerHooks | None = None) -> int:
    """Worker loop of ranks 1..R-1: host ``clients`` (this rank's) until told to stop; returns the exit status.

    Parameters
    ----------
    comm : mpi4py communicator (COMM_WORLD), rank > 0
    clients : list of client objects, or None after :func:`report_startup_failure`
        (the rank then only waits for the stop).
    hooks : WorkerHooks or None
        Called at the points :class:`~fedlayer.mpi.hooks.WorkerHooks` names
        (the tests' fault injection and trace); None: no hooks.

    Returns
    -------
    int
        The status rank 0's STOP carried, or 130 after a KeyboardInterrupt
        (which this rank reports to rank 0 before returning).
    """
    return Worker(comm, clients, hooks).serve()


class Worker:
    """One worker rank's loop; each operation of rank 0's commands is a method (see :func:`serve`)."""

    comm: MPI.Intracomm
    rank: int
    chunk: int
    hooks: WorkerHooks
    clients: dict[int, Any]

    def __init__(self, comm: MPI.Intracomm, clients: Iterable | None, hooks: WorkerHooks | None = None) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.rank = comm.Get_rank()
        self.chunk = configured_chunk_bytes()
        self.hooks = WorkerHooks() if hooks is None else hooks
        self._says_hello = clients is not None  # None: its startup failed and was reported; it awaits the stop
        self.clients = {} if clients is None else {c.client_id: c for c in clients}
        self._status = MPI.Status()
        self._partial_sends = []  # the last command's partial sums in flight: (Isend request, buffers it reads)

    def serve(self) -> int:
        """Answer commands until a STOP; returns its status (130 when interrupted by Ctrl-C)."""
        if self._says_hello:
            self.comm.send({"op": Op.HELLO, "clients": sorted(self.clients)}, dest=0, tag=TAG_RESULT)
        try:
            while True:
                command = self._next_command()
                self._finish_partials()
                if command["op"] is Op.STOP:
                    return self._bye(command)
                args = self._receive_args(command)
                if command["op"] is Op.SUMS:
                    self._sums(command, args)
                    continue
                stop = self._calls(command, args)
                if stop is not None:
                    return self._bye(stop)
        except KeyboardInterrupt:
            # Ctrl-C reaches every rank of the job: say so, or rank 0 waits for this rank until its deadline.
            self.comm.send({"op": Op.BYE, "rank": self.rank, "interrupted": True}, dest=0, tag=TAG_RESULT)
            return 130

    # -- messages ---------------------------------------------------------------

    def _next_command(self, block=True):
        """Rank 0's next command header, or None when none is waiting and not ``block``."""
        delay = 1e-4
        while not self.comm.Iprobe(source=0, tag=TAG_CMD, status=self._status):
            if not block:
                return None
            delay = backoff(delay)
        return self.comm.recv(source=0, tag=TAG_CMD)

    def _receive_args(self, command):
        """{cid: kwargs} of a CALL or SUMS command, its arrays received after the header."""
        from mpi4py import MPI

        descs = command["arrays"]
        buffers, requests = post_receives(self.comm, descs, 0, TAG_CMD_DATA, self.chunk)
        MPI.Request.Waitall(requests)
        arrays = unwire(buffers, descs)
        return {cid: inflate(skeleton, arrays) for cid, skeleton in command["clients"]}

    def _send(self, header, payload, blocking=True, tags=(TAG_RESULT, TAG_DATA)):
        """Send ``header`` then ``payload``'s buffers; the Isend requests when not ``blocking``."""
        self.comm.send(header, dest=0, tag=tags[0])
        return send_buffers(self.comm, payload.arrays, 0, tags[1], self.chunk, blocking=blocking)

    def _error(self, cid, method, err):
        self.comm.send(_error_header(self.rank, cid, method, err), dest=0, tag=TAG_RESULT)

    def _bye(self, stop):
        self.comm.send({"op": Op.BYE, "rank": self.rank}, dest=0, tag=TAG_RESULT)
        return int(stop.get("status", 0))

    def _finish_partials(self):
        """Wait for the previous command's partial sums to leave (their buffers are then released)."""
        from mpi4py import MPI

        if self._partial_sends:
            MPI.Request.Waitall([request for request, _ in self._partial_sends])
            self._partial_sends = []

    # -- operations ---------------------------------------------------------------

    def _calls(self, command, args):
        """CALL: run the method on each client in turn, one RESULT each; a STOP that arrives meanwhile, or None.

        A client's exception is reported as an ERROR and ends the command
        (rank 0 then stops the job).
        """
        method, seq = command["method"], command["seq"]
        for cid, kwargs in args.items():
            stop = self._next_command(block=False)  # only a stop can arrive during a call
            if stop is not None:
                return stop
            try:
                self.hooks.before_call(cid, method, kwargs)
                result = getattr(self.clients[cid], method)(**kwargs)
            except Exception as err:
                self._error(cid, method, err)
                return None
            payload = Payload()
            skeleton = payload.flatten(result)
            del result
            self._send({"op": Op.RESULT, "seq": seq, "cid": cid, "result": skeleton, "arrays": payload.descs},
                       payload)
        return None

    def _sums(self, command, args):
        """SUMS: the rank's clients group by group, each group's partial sum sent without blocking.

        Each group's partial leaves while the next group's clients run; at
        most one partial is in flight while the next is computed, so the rank
        holds at most two groups' sums. An exception outside a client's own
        step (which would be its dropout) is reported as an ERROR and ends the
        command.
        """
        from mpi4py import MPI

        in_flight = []
        for index, cids in enumerate(command["groups"]):
            while len(in_flight) > 1:
                MPI.Request.Waitall([request for request, _ in in_flight.pop(0)])
            self.hooks.group_started(command["seq"], index)
            try:
                requests = self._group_sum(command, index, {cid: args[cid] for cid in cids})
            except Exception as err:
                self._error(None, command["method"], err)
                break
            in_flight.append(requests)
        self._partial_sends = [pair for pairs in in_flight for pair in pairs]

    def _group_sum(self, command, index, group_args):
        """Group ``index``: a RECEIPT or DROPPED per client as it finishes, then the PARTIAL; its (request, buffers)."""
        seq, method = command["seq"], command["method"]
        tags = group_tags(index)

        def report(cid, receipt, nbytes, reason):
            if reason is not None:
                self.comm.send({"op": Op.DROPPED, "seq": seq, "group": index, "cid": cid, "error": reason},
                               dest=0, tag=tags[0])
                return
            payload = Payload()
            skeleton = payload.flatten(receipt)
            self._send({"op": Op.RECEIPT, "seq": seq, "group": index, "cid": cid, "result": skeleton,
                        "arrays": payload.descs, "nbytes": nbytes}, payload, tags=tags)

        totals = client_side_sum(self.clients, method, group_args, command["keys"], np.dtype(command["dtype"]),
                                 hooks=self.hooks.before_sum_step, done=report, upper=command["upper_keys"])[0]
        payload = Payload()
        skeleton = payload.flatten(totals, packed_keys=command["packed_keys"])
        del totals
        requests = self._send({"op": Op.PARTIAL, "seq": seq, "group": index, "result": skeleton,
                               "arrays": payload.descs, "nbytes": payload.nbytes}, payload, blocking=False, tags=tags)
        return [(request, payload.arrays) for request in requests]
