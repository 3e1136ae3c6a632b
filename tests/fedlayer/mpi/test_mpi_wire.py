"""The MPI package without mpiexec: operations and buffers on the wire, the hooks' defaults, no test variables.

These run in one process (no MPI initialized); tests/fedlayer/mpi/test_mpi.py runs jobs under mpiexec.
"""

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from tests.fedlayer.mpi.mpi_faults_entry import InjectedFaults

import fastls
import fedlayer
from fedlayer.mpi import MPITransport, Op, ServerHooks, WorkerHooks, wire
from fedlayer.messages import Dropout
from fedlayer.transport import client_side_sum


def _sources(package):
    root = Path(package.__file__).parent
    return sorted(p for pattern in ("*.py", "*.pyx", "*.pxd") for p in root.rglob(pattern))


def test_production_code_reads_no_test_variable():
    # Faults reach fedlayer as hooks objects (tests/fedlayer/mpi/mpi_faults_entry.py), never through its own
    # environment reads.
    sources = _sources(fedlayer) + _sources(fastls)
    assert any(p.name == "worker.py" for p in sources) and any(p.suffix == ".pyx" for p in sources)
    offenders = [str(p) for p in sources if "FEDLAYER_TEST_" in p.read_text()]
    assert offenders == []


def test_every_operation_is_named_once_and_survives_the_wire():
    assert len(Op) == 10 and len({op.value for op in Op}) == 10
    header = {"op": Op.SUMS, "seq": 3, "groups": [[1, 4]]}
    received = pickle.loads(pickle.dumps(header))
    assert received["op"] is Op.SUMS and received == header
    # no header of the package spells its operation as a bare string
    for path in Path(wire.__file__).parent.glob("*.py"):
        assert not re.search(r"""["']op["']\s*:\s*["']""", path.read_text()), path.name


def test_a_payload_sends_each_array_once_and_inflates_to_the_same_object(rng):
    weights = rng.standard_normal((3, 4))
    message = {"a": weights, "b": [weights, (1, "x")], "c": {"d": np.arange(5, dtype=np.int64)}, "n": 7}
    payload = wire.Payload()
    skeleton = payload.flatten(message)
    assert len(payload.arrays) == 2  # weights travels once
    assert payload.descs == [((3, 4), weights.dtype.str, False), ((5,), np.dtype(np.int64).str, False)]
    assert payload.nbytes == weights.nbytes + 5 * 8
    skeleton = pickle.loads(pickle.dumps(skeleton))
    restored = wire.inflate(skeleton, wire.unwire(payload.arrays, payload.descs))
    assert restored["n"] == 7 and restored["b"][1] == (1, "x") and isinstance(restored["b"][1], tuple)
    assert restored["a"] is restored["b"][0]
    np.testing.assert_array_equal(restored["a"], weights)
    np.testing.assert_array_equal(restored["c"]["d"], np.arange(5))


def test_packed_keys_send_the_upper_triangle_of_top_level_square_matrices(rng):
    G = np.triu(rng.standard_normal((4, 4)))
    payload = wire.Payload()
    skeleton = payload.flatten({"G": G, "C": rng.standard_normal((4, 2)), "inner": {"G": G}}, packed_keys=("G", "C"))
    assert [packed for _, _, packed in payload.descs] == [True, False, False]  # C is not square; nested G is not
    assert payload.arrays[0].shape == (10,)
    restored = wire.inflate(skeleton, wire.unwire(payload.arrays, payload.descs))
    np.testing.assert_array_equal(restored["G"], G)
    np.testing.assert_array_equal(restored["inner"]["G"], G)


@pytest.mark.parametrize("nbytes,chunk,pieces", [(0, 8, 0), (24, 8, 3), (25, 8, 4), (24, 2**30, 1)])
def test_buffers_travel_in_pieces_of_at_most_chunk_bytes(nbytes, chunk, pieces):
    parts = wire._chunks(np.zeros(nbytes, dtype=np.uint8), chunk)
    assert len(parts) == pieces and sum(p.size for p in parts) == nbytes
    assert all(p.size <= chunk for p in parts)


def test_each_group_of_a_sum_has_its_own_tags():
    tags = [wire.group_tags(g) for g in range(3)]
    flat = [t for pair in tags for t in pair]
    assert len(set(flat)) == 6
    assert not {wire.TAG_CMD, wire.TAG_CMD_DATA, wire.TAG_RESULT, wire.TAG_DATA} & set(flat)


def test_the_default_hooks_do_nothing():
    worker, server = WorkerHooks(), ServerHooks()
    assert worker.before_call(1, "evaluate", {}) is None
    assert worker.before_sum_step(1, "statistics", {"position": 0}) is None
    assert worker.group_started(1, 0) is None
    assert server.before_group(1, 0) is None
    assert server.partial_received(1, 0, 2) is None


class _Comm:
    def __init__(self, rank, size=3):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


def test_the_server_uses_the_hooks_it_is_given_and_none_by_default():
    assert type(MPITransport(_Comm(0)).hooks) is ServerHooks
    hooks = InjectedFaults(delay_sums=0.5)
    assert MPITransport(_Comm(0), hooks=hooks).hooks is hooks
    with pytest.raises(ValueError, match="rank 0"):
        MPITransport(_Comm(1))


class _Client:
    def __init__(self, client_id):
        self.client_id = client_id

    def statistics(self, position):
        return {"G": np.full((2, 2), float(self.client_id + 1)), "samples": 10 + self.client_id}


def test_a_sum_step_hook_that_raises_drops_that_client_as_in_process():
    clients = {cid: _Client(cid) for cid in range(3)}
    args = {cid: {"position": 0} for cid in clients}
    plain = client_side_sum(clients, "statistics", args, ["G"], np.float64)
    quiet = client_side_sum(clients, "statistics", args, ["G"], np.float64, hooks=WorkerHooks().before_sum_step)
    np.testing.assert_array_equal(quiet[0]["G"], plain[0]["G"])
    assert quiet[1:] == plain[1:]

    faults = InjectedFaults(fail_step="statistics:1:0")
    totals, receipts, _, dropped = client_side_sum(clients, "statistics", args, ["G"], np.float64,
                                                   hooks=faults.before_sum_step)
    assert list(dropped) == [1]
    assert dropped[1] == Dropout("injected failure of statistics for client 1 (FEDLAYER_TEST_FAIL_STEP)",
                                 "RuntimeError", "statistics")
    assert str(dropped[1]) == "RuntimeError: injected failure of statistics for client 1 (FEDLAYER_TEST_FAIL_STEP)"
    np.testing.assert_array_equal(totals["G"], np.full((2, 2), 1.0 + 3.0))
    assert sorted(receipts) == [0, 2]


def test_the_tests_faults_are_read_from_the_job_environment_by_the_entry_script():
    faults = InjectedFaults.from_environ({"FEDLAYER_TEST_FAIL_CALL": "evaluate:3", "FEDLAYER_TEST_DELAY_SUMS": "0.3",
                                          "FEDLAYER_TEST_FAIL_CLIENT": ""})
    assert faults.delay_sums == 0.3 and faults.fail_client is None
    faults.before_call(2, "evaluate", {})
    with pytest.raises(RuntimeError, match="injected failure of evaluate for client 3"):
        faults.before_call(3, "evaluate", {})
    assert InjectedFaults.from_environ({}).delay_sums == 0.0
