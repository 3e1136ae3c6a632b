"""``fedlayer`` with injected faults, for the MPI tests.

    mpiexec -n 3 python tests/fedlayer/mpi/mpi_faults_entry.py run ...


mpiexec starts this script on every rank; it builds an :class:`InjectedFaults`
from the environment the test gave the job and passes it to
``fedlayer.cli.main`` as the ranks' hooks. fedlayer itself reads none of
these variables:

FEDLAYER_TEST_FAIL_CLIENT=cid
    the client fails in every sum (a dropout of each);
FEDLAYER_TEST_FAIL_STEP=method:cid:position
    the client fails in ``method``'s sum of layer ``position`` only;
FEDLAYER_TEST_HANG_CLIENT=cid
    the client never returns from its first sum (a hung rank);
FEDLAYER_TEST_FAIL_CALL=method:cid
    the client fails in ``method`` called outside a sum (the job ends);
FEDLAYER_TEST_TRACE=path
    each rank appends one JSON line per event (worker: ``group_started``;
    rank 0: ``partial_received``) with its fields, the wall time and the rank;
FEDLAYER_TEST_DELAY_SUMS=seconds
    rank 0 waits this long before taking each group's sum (a slow server).
"""

from __future__ import annotations

import json
import os
import sys
import time

from fedlayer.mpi import ServerHooks, WorkerHooks


class InjectedFaults(WorkerHooks, ServerHooks):
    """Both sides' hooks of a test job: faults of the worker's clients, a slow rank 0, a trace of both."""

    def __init__(self, fail_client=None, fail_step=None, hang_client=None, fail_call=None, trace=None,
                 delay_sums=0.0):
        self.fail_client, self.fail_step, self.hang_client = fail_client, fail_step, hang_client
        self.fail_call, self.trace_path, self.delay_sums = fail_call, trace, float(delay_sums)

    @classmethod
    def from_environ(cls, environ):
        def get(name):
            return environ.get(f"FEDLAYER_TEST_{name}") or None

        return cls(fail_client=get("FAIL_CLIENT"), fail_step=get("FAIL_STEP"), hang_client=get("HANG_CLIENT"),
                   fail_call=get("FAIL_CALL"), trace=get("TRACE"), delay_sums=get("DELAY_SUMS") or 0.0)

    def before_call(self, cid, method, kwargs):
        if self.fail_call == f"{method}:{cid}":
            raise RuntimeError(f"injected failure of {method} for client {cid} (FEDLAYER_TEST_FAIL_CALL)")

    def before_sum_step(self, cid, method, kwargs):
        if self.fail_client == str(cid):
            raise RuntimeError(f"injected failure for client {cid} (FEDLAYER_TEST_FAIL_CLIENT)")
        if self.fail_step == f"{method}:{cid}:{kwargs.get('position')}":
            raise RuntimeError(f"injected failure of {method} for client {cid} (FEDLAYER_TEST_FAIL_STEP)")
        if self.hang_client == str(cid):
            while True:
                time.sleep(3600)

    def group_started(self, seq, group):
        self._trace("group_started", seq=seq, group=group)

    def before_group(self, seq, group):
        time.sleep(self.delay_sums)

    def partial_received(self, seq, group, source):
        self._trace("partial_received", seq=seq, group=group, source=source)

    def _trace(self, event, **fields):
        if self.trace_path:
            from mpi4py import MPI

            line = json.dumps({"event": event, "rank": MPI.COMM_WORLD.Get_rank(), "t": time.time(), **fields})
            with open(self.trace_path, "a") as trace:
                trace.write(line + "\n")


if __name__ == "__main__":
    from fedlayer.cli import main

    sys.exit(main(sys.argv[1:], mpi_hooks=InjectedFaults.from_environ(os.environ)))
