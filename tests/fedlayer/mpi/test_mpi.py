"""``mpiexec -n 3 python -m fedlayer run ...``: same results as in process, scale, failures.

Each test launches a bounded subprocess; skipped when mpiexec or mpi4py is missing.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests.numeric_checks import assert_close

MPIEXEC = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))

pytestmark = [
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found on PATH"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed"),
]

SMALL = ["--clients", "12", "--groups", "3", "--model", "dnn", "--seed", "0"]
_TEST_VARS = ("FEDLAYER_TEST_FAIL_CLIENT", "FEDLAYER_TEST_FAIL_CALL", "FEDLAYER_TEST_FAIL_STEP",
              "FEDLAYER_TEST_HANG_CLIENT", "FEDLAYER_TEST_TRACE", "FEDLAYER_TEST_DELAY_SUMS",
              "FEDLAYER_MPI_CHUNK_BYTES", "FEDLAYER_MPI_PACK_UPPER")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _TEST_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


# Faults are injected by a test-owned entry script, which hands fedlayer its hooks (fedlayer reads no test variable).
FAULTS_ENTRY = str(Path(__file__).with_name("mpi_faults_entry.py"))


def _job(args, ranks=3, faults=False):
    """mpiexec's command line: ``fedlayer run`` itself, or through the entry script that injects ``faults``."""
    entry = [FAULTS_ENTRY] if faults else ["-m", "fedlayer"]
    return [MPIEXEC, "-n", str(ranks), sys.executable, *entry, "run", *args]


def mpirun(args, timeout=120, ranks=3, **env):
    faults = any(name.startswith("FEDLAYER_TEST_") for name in env)
    return subprocess.run(_job(args, ranks, faults), capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))


def _models(out):
    from fedlayer.models import Model

    models = {}
    for path in sorted(Path(out).glob("model*.npz")):
        model, _ = Model.load(path)
        models[path.name] = [model.layers[i].weights for i in model.trainable]
    return models


def test_factored_uploads_travel_to_rank_0_and_give_the_in_process_weights(tmp_path):
    """--server-solve dual under mpiexec: each client's F and UZ reach rank 0 in 4 KiB chunks, rank 0 stacks
    them per group, and the weights are the in-process run's (each run's secret rotations differ: to rounding)."""
    # A tenth of the samples for training: the dual's systems are as large as a group's rows.
    flags = ["--algorithm", "pfedacnnl", "--clients", "6", "--groups", "2", "--model", "dnn", "--seed", "0",
             "--train-fraction", "0.1", "--server-solve", "dual", "--drop-clients", "0.2"]
    reference = tmp_path / "inproc"
    proc = subprocess.run([sys.executable, "-m", "fedlayer", "run", *flags, "--quiet", "--output", str(reference)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr
    distributed = tmp_path / "mpi"
    proc = mpirun([*flags, "--output", str(distributed)], FEDLAYER_MPI_CHUNK_BYTES=4096)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, actual = _models(reference), _models(distributed)
    assert expected and sorted(expected) == sorted(actual)
    for name in expected:
        for W, V in zip(expected[name], actual[name], strict=True):
            assert np.linalg.norm(V - W) <= 1e-10 * np.linalg.norm(W)
    ref = json.loads((reference / "results.json").read_text())
    got = json.loads((distributed / "results.json").read_text())
    assert got["groups"] == ref["groups"]
    for key, record in ref["rounds"].items():
        assert got["rounds"][key].get("dropped") == record.get("dropped"), key
        assert got["rounds"][key]["bytes_up"] == record["bytes_up"], key
        if record["stage"] == "federated":
            assert got["rounds"][key]["solve"]["form"] == record["solve"]["form"] == "dual"
    assert any(record.get("dropped") for record in ref["rounds"].values())


@pytest.mark.parametrize("algorithm,extra_env,flags", [
    ("fedacnnl", {}, []),
    # full G instead of its packed upper triangle (the default), and 4 KiB chunks: the same numbers must come out
    ("pfedacnnl", {"FEDLAYER_MPI_PACK_UPPER": "0", "FEDLAYER_MPI_CHUNK_BYTES": "4096"}, []),
    # seeded dropouts: the same clients drop on their ranks as in process
    ("fedacnnl", {}, ["--drop-clients", "0.25"]),
    # secure sums with dropouts: exact integer sums, so the same numbers as the secure run in process
    ("pfedacnnl", {}, ["--secure", "--drop-clients", "0.1"]),
    # the hidden layers' rounds scored by their label-code readout, on each client's rank
    ("fedacnnl", {}, ["--round-accuracy", "codes", "--drop-clients", "0.25"]),
])
def test_same_as_in_process(tmp_path, algorithm, extra_env, flags):
    reference = tmp_path / "inproc"
    proc = subprocess.run([sys.executable, "-m", "fedlayer", "run", "--algorithm", algorithm, *SMALL, *flags,
                           "--quiet", "--output", str(reference)], capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == 0, proc.stderr
    distributed = tmp_path / "mpi"
    proc = mpirun(["--algorithm", algorithm, *SMALL, *flags, "--output", str(distributed)], **extra_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "12 clients" in proc.stdout

    expected, actual = _models(reference), _models(distributed)
    assert expected and sorted(expected) == sorted(actual)
    for name in expected:
        for W, V in zip(expected[name], actual[name], strict=True):
            assert W.dtype == V.dtype == np.float64 and W.shape == V.shape
            assert_close(V, W, np.float64, rtol=1e-10)

    ref = json.loads((reference / "results.json").read_text())
    got = json.loads((distributed / "results.json").read_text())
    assert got["n_clients"] == ref["n_clients"] == 12
    # Three ranks on one node share its cores (mpiexec here binds no rank to its own).
    assert got["machine"]["mpi"] == {"ranks": 3, "ranks_on_node": 3,
                                     "cores_per_rank": max(1, len(os.sched_getaffinity(0)) // 3)}
    assert "mpi" not in ref["machine"]
    assert got["groups"] == ref["groups"]
    assert abs(got["accuracy"] - ref["accuracy"]) <= 1e-10
    for key, record in ref["rounds"].items():
        if record["accuracy"] is not None:
            assert abs(got["rounds"][key]["accuracy"] - record["accuracy"]) <= 1e-10, key
        assert got["rounds"][key].get("dropped") == record.get("dropped"), key
        # Each client's upload is counted as in process: its bytes, and the time the clock gives them. Secure
        # runs draw fresh X25519 keys, so their pickled key shares differ by a few bytes from run to run.
        rel = 1e-4 if "--secure" in flags else 1e-12
        assert got["rounds"][key]["bytes_up"] == pytest.approx(record["bytes_up"], rel=rel), key
        for cid, t in record["clients"].items():
            assert got["rounds"][key]["clients"][cid]["comm_s"] == pytest.approx(t["comm_s"], rel=rel), (key, cid)
    if flags:
        assert any(record.get("dropped") for record in ref["rounds"].values())
    if "codes" in flags:
        assert [r.get("accuracy_of") for r in got["rounds"].values()] == [
            r.get("accuracy_of") for r in ref["rounds"].values()] == ["codes"] * (len(ref["rounds"]) - 1) + [None]
    # Rank 0 received one partial sum per rank and group, never one client's statistics.
    for record in got["rounds"].values():
        if record["stage"] == "federated":
            parts = record["transport"]
            assert parts and all(key.split()[-2:][0] == "rank" for key in parts)
            assert len(parts) <= 2 * len(set(got["groups"].values()))


def test_a_rank_runs_its_next_group_while_its_partial_sum_travels(tmp_path):
    # pFedACnnL, 3 groups: rank 0 takes each layer's groups one at a time and, here, waits 0.3 s before
    # each. Each worker has started its next group's clients before rank 0 received its partial sum of
    # the previous group, in every layer.
    trace = tmp_path / "trace.jsonl"
    proc = mpirun(["--algorithm", "pfedacnnl", *SMALL, "--quiet", "--output", str(tmp_path / "out")],
                  FEDLAYER_TEST_TRACE=str(trace), FEDLAYER_TEST_DELAY_SUMS="0.3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    started = {(e["seq"], e["rank"], e["group"]): e["t"] for e in events if e["event"] == "group_started"}
    received = {(e["seq"], e["source"], e["group"]): e["t"] for e in events if e["event"] == "partial_received"}
    commands = {seq for seq, _, group in started if group > 0}  # personalization rounds are one-group sums
    assert len(commands) == 3  # one multi-group command per layer of the DNN
    for (seq, rank, group), t in received.items():
        if (seq, rank, group + 1) in started:
            assert started[(seq, rank, group + 1)] < t, (seq, rank, group)
    assert sum((seq, rank, group + 1) in started for seq, rank, group in received) == 3 * 2 * 2


def test_a_layer_left_early_under_mpi_ends_the_job_promptly():
    # With --drop-clients 0.99 every client of the first group drops out of layer 1: the server raises in
    # the middle of the layer's multi-group command, while the ranks still send the other groups. The job
    # ends with the server's error and an orderly stop, not a deadline abort.
    start = time.monotonic()
    proc = mpirun(["--algorithm", "pfedacnnl", *SMALL, "--drop-clients", "0.99", "--quiet", "--mpi-deadline", "30"],
                  timeout=90)
    assert proc.returncode != 0
    assert "every client of group 0 dropped out of layer 1" in proc.stderr, proc.stderr[-3000:]
    assert "no answer from MPI rank" not in proc.stderr
    assert time.monotonic() - start < 25


@pytest.mark.parametrize("affinities,mine,share", [
    ([[0, 1], [0, 1], [0, 1]], [0, 1], 1),               # 3 ranks sharing 2 cores
    ([[0, 1, 2, 3, 4, 5, 6, 7]] * 2, list(range(8)), 4),  # 2 ranks sharing 8 cores
    ([[0, 1, 2, 3], [4, 5, 6, 7]], [0, 1, 2, 3], 4),      # bound to their own cores
    ([[0, 1], [1, 2]], [0, 1], 1),                        # one core shared: 1 + 1/2
    ([[0, 1, 2], [2, 3, 4]], [0, 1, 2], 2),               # 2 + 1/2
])
def test_a_rank_gets_its_share_of_the_cores_it_may_run_on(affinities, mine, share):
    from fedlayer.mpi import node_share

    assert node_share(affinities, mine) == share


def test_hundred_clients_on_three_ranks(tmp_path):
    proc = mpirun(["--algorithm", "pfedacnnl", "--clients", "100", "--model", "lr", "--output", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "100 clients" in proc.stdout
    assert "without an error of their own" not in proc.stderr  # an orderly end names no rank
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["n_clients"] == 100
    assert all(len(record["clients"]) == 100 for record in results["rounds"].values())
    assert 0.0 < results["accuracy"] <= 1.0


def test_client_failure_is_a_dropout(tmp_path):
    # client 5 lives on rank 1 + 5 % 2 = 2; it fails in every layer, the others carry on
    proc = mpirun(["--algorithm", "fedacnnl", *SMALL, "--quiet", "--output", str(tmp_path)], timeout=90,
                  FEDLAYER_TEST_FAIL_CLIENT=5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    federated = [r for r in results["rounds"].values() if r["stage"] == "federated"]
    assert federated and all(r["dropped"] == {"5": "RuntimeError: injected failure for client 5 "
                                                    "(FEDLAYER_TEST_FAIL_CLIENT)"} for r in federated)
    assert all("5" not in r["clients"] for r in federated)


def test_a_secure_dropout_after_masking_is_removed_and_matches_the_plain_run(tmp_path):
    # Client 5 (rank 2) fails in its masked upload of layer 1 only: its neighbours, on their ranks, reveal the
    # keys of that sum's masks with it. A later sum with it would differ from layer 1's by client 5 alone
    # (their difference would be its statistics): it is excluded from layers 2 and 3 as if it had dropped,
    # and the model equals the plain run where it misses every layer.
    runs = {}
    for name, extra, env in (("secure", ["--secure"], {"FEDLAYER_TEST_FAIL_STEP": "secure_upload:5:0"}),
                             ("plain", [], {"FEDLAYER_TEST_FAIL_CLIENT": "5"})):
        out = tmp_path / name
        proc = mpirun(["--algorithm", "fedacnnl", *SMALL, *extra, "--quiet", "--output", str(out)], timeout=120,
                      **env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads((out / "results.json").read_text())
    federated = [r for r in runs["secure"]["rounds"].values() if r["stage"] == "federated"]
    assert federated[0]["dropped"] == {"5": "secure_upload: RuntimeError: injected failure of secure_upload for "
                                            "client 5 (FEDLAYER_TEST_FAIL_STEP)"}
    assert all(list(r["dropped"]) == ["5"] and r["dropped"]["5"].startswith("secure: excluded from this sum")
               and "5" not in r["clients"] for r in federated[1:])
    assert all(r["contributors"] == {"0": [[c for c in range(12) if c != 5]]} for r in federated)
    assert runs["secure"]["accuracy"] == runs["plain"]["accuracy"]


def test_each_rank_writes_its_own_clients_personalized_models(tmp_path):
    # Under mpiexec the personalized weights stay on the rank hosting the client, which writes the file; the
    # models are those of the run in one process (where the clients write them too).
    runs = {}
    for name in ("inproc", "mpi"):
        out = tmp_path / name
        args = ["--algorithm", "pfedacnnl", *SMALL, "--secure", "--quiet", "--output", str(out)]
        proc = (mpirun(args) if name == "mpi" else
                subprocess.run([sys.executable, "-m", "fedlayer", "run", *args], capture_output=True, text=True,
                               timeout=120, env=_env()))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = sorted((out / "personalized").glob("client*.npz"))
    assert [p.name for p in runs["mpi"]] == [p.name for p in runs["inproc"]] and len(runs["mpi"]) == 12
    from fedlayer.models import Model

    for a, b in zip(runs["inproc"], runs["mpi"], strict=True):
        (ma, meta_a), (mb, meta_b) = Model.load(a), Model.load(b)
        assert meta_a == meta_b
        for i in ma.trainable:
            assert_close(mb.layers[i].weights, ma.layers[i].weights, np.float64, rtol=1e-10)


def test_client_error_outside_a_sum_ends_the_job_naming_it():
    # client 3 (rank 2) fails in its evaluation, which is not a sum: no dropout there, the job stops in order
    proc = mpirun(["--algorithm", "pfedacnnl", *SMALL, "--quiet"], timeout=90,
                  FEDLAYER_TEST_FAIL_CALL="evaluate:3")
    assert proc.returncode != 0
    assert "client 3 on MPI rank 2 failed in evaluate: RuntimeError: injected failure" in proc.stderr
    assert "without an error of their own" not in proc.stderr  # every rank ended for a reason it printed


def test_a_rank_that_cannot_build_its_clients_is_bad_input_in_one_line(tmp_path):
    run = [sys.executable, "-m", "fedlayer", "run", "--dataset", "mnist", "--clients", "6", "--groups", "3", "--quiet"]
    # rank 0 finds a (tiny, fake) MNIST, rank 1 does not: the job ends as bad input, as it would on rank 0
    from tests.fedlayer.test_data import write_fake_mnist

    write_fake_mnist(tmp_path / "mnist", n_train=400, n_test=100)
    cmd = [MPIEXEC, "-n", "1", "-env", "FEDLAYER_DATA_DIR", str(tmp_path), *run,
           ":", "-n", "1", "-env", "FEDLAYER_DATA_DIR", str(tmp_path / "nowhere"), *run]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "fedlayer run: error: MPI rank 1 could not build its clients: FileNotFoundError: mnist not found" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctrl_c_stops_every_rank_at_once_and_says_how_to_resume(tmp_path):
    # Rank 0 waits 1 s before each group's sum, so the run is still going when SIGINT reaches the job.
    out = tmp_path / "out"
    cmd = _job(["--algorithm", "pfedacnnl", *SMALL, "--quiet", "--output", str(out), "--mpi-deadline", "600"],
               faults=True)
    # SIGINT at its default in the job: a shell starts background jobs (CI's, this suite's) with it ignored.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(FEDLAYER_TEST_DELAY_SUMS="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (out / "checkpoint.npz").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert (out / "checkpoint.npz").exists(), "the first layer never finished"
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)  # mpiexec forwards it to every rank, as a Ctrl-C does
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - interrupted < 30  # not the 600 s deadline
    assert f"fedlayer run: interrupted; the layers trained so far are in {out / 'checkpoint.npz'}" in stderr
    assert "no answer from MPI rank" not in stderr and "Traceback" not in stderr


def test_a_bad_flag_is_reported_once_not_once_per_rank():
    proc = mpirun(["--clients", "6", "--groups", "10", "--quiet"], timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("fedlayer run: error: groups (K=10) cannot exceed the number of clients (6)") == 1


def test_bad_input_found_after_the_ranks_started_exits_2_as_in_process(tmp_path):
    """rank 0 finds --output naming a file once every rank is up: the job's status is still bad input's, 2."""
    taken = tmp_path / "afile"
    taken.write_text("")
    proc = mpirun(["--clients", "6", "--groups", "3", "--quiet", "--output", str(taken)], timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]  # the ranks' statuses are ORed: workers at 1 made it 3
    assert proc.stderr.count(f"output {str(taken)!r} is a file") == 1


def test_a_client_that_fails_to_personalize_is_a_dropout_of_that_round(tmp_path):
    proc = mpirun(["--algorithm", "pfedacnnl", *SMALL, "--quiet", "--output", str(tmp_path)], timeout=90,
                  FEDLAYER_TEST_FAIL_STEP="personalize:3:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    personal = [r for r in json.loads((tmp_path / "results.json").read_text())["rounds"].values()
                if r["stage"] == "personalization"]
    assert personal[1]["dropped"] == {"3": "RuntimeError: injected failure of personalize for client 3 "
                                           "(FEDLAYER_TEST_FAIL_STEP)"}
    assert "3" in personal[0]["clients"] and "3" in personal[2]["clients"]


def test_hung_rank_hits_the_deadline():
    # client 3 lives on rank 2, which then never answers
    proc = mpirun(["--algorithm", "fedacnnl", *SMALL, "--quiet", "--mpi-deadline", "5"], timeout=90,
                  FEDLAYER_TEST_HANG_CLIENT=3)
    assert proc.returncode != 0
    assert "no answer from MPI rank(s) [2]" in proc.stderr
    assert "client ids [3," in proc.stderr
    assert "without an error of their own" not in proc.stderr  # rank 0 aborts the job itself: no rank is named


def _processes_of_job(token):
    """{pid: (PMI_RANK or None, command line)} of the live processes whose environment holds ``token``."""
    from fedlayer.mpi._rankwatch import processes_with_env

    return processes_with_env("FEDLAYER_TEST_JOB", token)


def _pidfds(pid):
    """How many pidfds process ``pid`` holds (their fdinfo names a Pid)."""
    count = 0
    try:
        for info in Path(f"/proc/{pid}/fdinfo").iterdir():
            count += "\nPid:" in "\n" + info.read_text()
    except OSError:
        pass
    return count


@pytest.mark.skipif(not hasattr(os, "pidfd_open") or not Path("/proc/self/environ").exists(),
                    reason="the dead-rank watcher needs Linux pidfds; the test finds ranks through /proc")
def test_dead_rank_is_named():
    # rank 2 (client 3's) waits in layer 1 and is killed from outside, as the OOM killer would do it
    token = uuid.uuid4().hex
    cmd = _job(["--algorithm", "fedacnnl", *SMALL, "--quiet", "--mpi-deadline", "120"], faults=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(FEDLAYER_TEST_HANG_CLIENT=3, FEDLAYER_TEST_JOB=token))
    try:
        deadline, victim = time.monotonic() + 60, None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            job = _processes_of_job(token)
            watching = any("_rankwatch" in cmdline and _pidfds(pid) == 3 for pid, (_, cmdline) in job.items())
            ranks = {rank: pid for pid, (rank, cmdline) in job.items() if "_rankwatch" not in cmdline}
            if watching and "2" in ranks:
                victim = ranks["2"]
            else:
                time.sleep(0.1)
        assert victim is not None, "rank 2 or the watcher never started"
        from fedlayer.mpi._rankwatch import _shared_memory_files

        segments = _shared_memory_files([victim])  # MPICH's shared memory, which a killed job leaves behind
        assert segments, "rank 2 maps nothing under /dev/shm: MPICH's segments were expected there"
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    # Named alone, or with the ranks the launcher killed while it was still exiting ("ended together").
    assert f"rank 2 (pid {victim}" in stderr, stderr[-3000:]
    assert stderr.count("without an error of their own") == 1  # the ranks mpiexec stopped afterwards are not named
    # The watcher unlinks the segments once every rank of the job has ended.
    deadline = time.monotonic() + 30
    while any(Path(p).exists() for p in segments) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in segments if Path(p).exists()], segments


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="lifelines are opened through /proc/PID/fd (Linux)")
def test_the_watcher_names_a_process_whose_lifeline_closes(tmp_path):
    """The watcher script on a stand-in rank: its lifeline pipe, opened through /proc, reports the kill."""
    import select

    from fedlayer.mpi import _rankwatch

    rank = subprocess.Popen([sys.executable, "-c", "import os, time; r, w = os.pipe(); print(r, flush=True); "
                             "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        fd_number = int(rank.stdout.readline())
        lifeline = _rankwatch._open_lifeline(rank.pid, fd_number)
        assert lifeline is not None
        poller = select.poll()
        poller.register(lifeline, select.POLLIN)
        assert poller.poll(0) == []  # open while the rank lives
        watcher = subprocess.Popen([sys.executable, _rankwatch.__file__, str(tmp_path / "markers"), "testhost",
                                    f"7:{rank.pid}:{fd_number}"], stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the watcher opens its handles
        rank.kill()
        assert poller.poll(10_000), "the lifeline did not report the kill"
        _, stderr = watcher.communicate(timeout=30)
        os.close(lifeline)
    finally:
        rank.kill()
        rank.wait()
    assert f"MPI rank 7 (pid {rank.pid}" in stderr and "on testhost ended at" in stderr, stderr
    assert _rankwatch._open_lifeline(rank.pid, fd_number) is None  # gone: nothing to open


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watcher reads /proc/PID/stat (Linux)")
def test_the_watcher_sees_a_rank_that_has_begun_to_exit():
    from fedlayer.mpi._rankwatch import _exiting

    assert not _exiting(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not _exiting(child.pid) and time.monotonic() < deadline:  # a zombie until reaped
        time.sleep(0.01)
    assert _exiting(child.pid)
    child.wait()
    assert _exiting(child.pid)  # gone


def test_ranks_read_back_the_layers_their_clients_personalized_before_a_kill(tmp_path):
    """A personalized run killed after its first personalized layer resumes under mpiexec: the ranks'
    clients read their kept layers back, and the models are those of an uninterrupted in-process run from the
    same federated stage (to rounding: a rank's BLAS threads its products otherwise than one process's)."""
    from fedlayer.models import Model
    from fedlayer.run import RunConfig, run
    from tests.fedlayer.test_checkpoint import _killed_after, _Killed, personalized_anew

    base = dict(algorithm="pfedacnnl-wc", dataset="synthetic", model="dnn", clients=12, seed=0)
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        run(RunConfig(output=str(out), **base), progress=_killed_after("layer 1/3 personalized"))
    personalized_anew(out / "checkpoint.npz", tmp_path / "direct", **base)
    proc = mpirun(["--algorithm", "pfedacnnl-wc", "--clients", "12", "--model", "dnn", "--seed", "0", "--quiet",
                   "--output", str(out), "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (results["resumed_from_layer"], results["resumed_personalized"]) == (3, 1)
    for path in sorted((tmp_path / "direct" / "personalized").glob("client*.npz")):
        ours, _ = Model.load(out / "personalized" / path.name)
        theirs, _ = Model.load(path)
        for index in ours.trainable:
            np.testing.assert_allclose(ours.layers[index].weights, theirs.layers[index].weights, rtol=1e-9, atol=1e-13)
