"""The batched engine against the per-client one, checkpoints of long baseline runs, and MPI."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fedlayer.baselines import BASELINES, BaselineClient, baseline_hyper, run_baseline
from fedlayer.baselines.cohort import ClientCohort
from fedlayer.baselines.server import BaselineCheckpoints, Diverged, load_baseline_checkpoint
from fedlayer.data import ClientData
from fedlayer.timing import Clock
from fedlayer.transport import InProcessTransport

N_FEATURES, N_CLASSES = 9, 4
#: Training rows per client: some below every batch size, one exactly two of FedAvg's batches, the rest ragged.
SIZES = (3, 7, 16, 20, 25, 40, 41, 64)


def ragged_clients(seed, sizes=SIZES):
    rng = np.random.default_rng(seed)
    clients = []
    for n in sizes:
        x = rng.standard_normal((n + 5, 3, 3))  # a feature shape: the models flatten it
        y = rng.integers(0, N_CLASSES, n + 5)
        clients.append(ClientData(x[:n], y[:n], x[n:], y[n:]))
    return clients


def small_hyper(algorithm, model):
    """The MNIST defaults, with batches that leave some clients a short last batch and fewer draws."""
    hyper = baseline_hyper(algorithm, "mnist", model)
    hyper.pop("rounds")
    for key, value in {"batch_size": 8, "K": 7 if algorithm == "baffle" else 3, "local_epochs": 3, "b1": 8,
                       "local_iters": 4, "b2": 5}.items():
        if key in hyper:
            hyper[key] = value
    return hyper


def train(data, algorithm, model, engine, rounds=3, chunk_bytes=None, cores=1, **kwargs):
    clients = [BaselineClient(i, d, model, N_CLASSES, 11, cores) for i, d in enumerate(data)]
    if engine == "batched":
        ClientCohort(clients, **({} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}))
    out = run_baseline(InProcessTransport(clients), algorithm, rounds, clock=Clock(),
                       **{**small_hyper(algorithm, model), **kwargs})
    return out, clients


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("model", ["lr", "dnn"])
@pytest.mark.parametrize("algorithm", sorted(BASELINES))
def test_batched_engine_gives_the_per_client_parameters(algorithm, model):
    data = ragged_clients(1)
    reference, ref_clients = train(data, algorithm, model, "per-client")
    batched, clients = train(data, algorithm, model, "batched")
    assert rel(batched["params"], reference["params"]) <= 1e-10
    assert batched["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)
    for mine, theirs in zip(clients, ref_clients):
        assert rel(mine.params, theirs.params) <= 1e-10
        if algorithm in ("pfedme", "pfedzo"):
            assert rel(mine.theta, theirs.theta) <= 1e-10


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 30), min_size=1, max_size=6), chunk_clients=st.integers(1, 7),
       algorithm=st.sampled_from(sorted(BASELINES)))
def test_any_partition_and_chunking_gives_the_per_client_parameters(sizes, chunk_clients, algorithm):
    data = ragged_clients(len(sizes), sizes)
    model = BaselineClient(0, data[0], "dnn", N_CLASSES, 0).model
    reference, _ = train(data, algorithm, "dnn", "per-client", rounds=2)
    # chunk_bytes as a number of clients of this model: every chunking of the stack, down to one client
    batched, _ = train(data, algorithm, "dnn", "batched", rounds=2, cores=1,
                       chunk_bytes=chunk_clients * model.n_params * 8 * 6)
    assert rel(batched["params"], reference["params"]) <= 1e-10


@pytest.mark.parametrize("algorithm", sorted(BASELINES))
def test_every_chunking_gives_the_same_parameters_bit_for_bit(algorithm, monkeypatch):
    # A run resumed with other chunk sizes (another machine's memory, a new release) repeats its rounding.
    from fedlayer.baselines import cohort as cohort_module

    data = ragged_clients(4)
    model = BaselineClient(0, data[0], "dnn", N_CLASSES, 0).model
    one, clients = train(data, algorithm, "dnn", "batched", rounds=2, cores=2, chunk_bytes=model.n_params * 8 * 6)
    singles = clients[0].cohort._chunks(algorithm, small_hyper(algorithm, "dnn"))
    monkeypatch.setattr(cohort_module, "CHUNKS_PER_CORE", 1)
    monkeypatch.setattr(cohort_module, "ZEROTH_ORDER_STACK_BYTES", 1 << 30)
    widest, clients = train(data, algorithm, "dnn", "batched", rounds=2, cores=1)
    assert len(clients[0].cohort._chunks(algorithm, small_hyper(algorithm, "dnn"))) < len(singles) == len(data)
    assert np.array_equal(one["params"], widest["params"])


@pytest.mark.parametrize("cores", [1, 2, 3])
@pytest.mark.parametrize("algorithm", sorted(BASELINES))
def test_chunks_hold_every_client_once_and_share_the_work_between_the_threads(algorithm, cores):
    from fedlayer.baselines import cohort as cohort_module

    sizes = (400, 90, 64, 50, 41, 40, 33, 25, 20, 20, 16, 7, 3, 2, 1, 1)
    clients = [BaselineClient(i, d, "dnn", N_CLASSES, 0) for i, d in enumerate(ragged_clients(5, sizes))]
    cohort = ClientCohort(clients, cores=cores)
    hyper = small_hyper(algorithm, "dnn")
    chunks = cohort._chunks(algorithm, hyper)
    assert sorted(i for lo, hi in chunks for i in range(lo, hi)) == list(range(len(sizes)))
    n_train = [c.data.n_train for c in cohort.members]
    epoch_based = algorithm in cohort_module.EPOCH_BASED
    work = [sum(n_train[lo:hi]) if epoch_based else hi - lo for lo, hi in chunks]
    assert work == sorted(work, reverse=True)  # the costliest first
    assert len(chunks) >= min(cores, len(sizes))
    if algorithm in cohort_module.ZEROTH_ORDER:
        share = (sum(n_train) if epoch_based else len(sizes)) / (cohort_module.CHUNKS_PER_CORE * cores)
        assert all(w <= share or hi - lo == 1 for w, (lo, hi) in zip(work, chunks))
    if not epoch_based:
        batch = hyper.get("b1" if algorithm == "fedzo" else "batch_size")
        assert all(len({min(batch, n) for n in n_train[lo:hi]}) == 1 for lo, hi in chunks)


def test_a_cohort_refuses_clients_of_different_models():
    data = ragged_clients(2, (10, 12))
    clients = [BaselineClient(0, data[0], "lr", N_CLASSES, 0), BaselineClient(1, data[1], "dnn", N_CLASSES, 0)]
    with pytest.raises(ValueError, match="share one model"):
        ClientCohort(clients)


def test_batched_results_say_they_are_not_timed_per_client():
    data = ragged_clients(3, (10, 30))
    out, _ = train(data, "fedavg", "lr", "batched", rounds=1)
    times = [c["compute_s"] for c in out["rounds"][0]["clients"].values()]
    assert times[0] == times[1] > 0  # the cohort's wall time, shared evenly


# --------------------------------------------------------------------------- #
# Checkpoints
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("algorithm", ["pfedzo", "fedavg"])
def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path, algorithm):
    data = ragged_clients(4)
    straight, _ = train(data, algorithm, "dnn", "batched", rounds=5)
    path = tmp_path / "checkpoint.npz"
    fingerprint = {"algorithm": algorithm}
    checkpoints = BaselineCheckpoints(path, every=2, fingerprint=fingerprint)
    train(data, algorithm, "dnn", "batched", rounds=3, checkpoints=checkpoints)
    state = load_baseline_checkpoint(path, fingerprint)
    assert len(state["rounds"]) == 3  # every 2 rounds and after the last
    resumed, _ = train(data, algorithm, "dnn", "batched", rounds=5, checkpoints=checkpoints, resume=state)
    assert np.array_equal(resumed["params"], straight["params"])
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in straight["rounds"]]
    assert resumed["best_accuracy"] == straight["best_accuracy"]
    with pytest.raises(ValueError, match="holds 5 rounds of .* more than the 4 asked for"):
        train(data, algorithm, "dnn", "batched", rounds=4, resume=load_baseline_checkpoint(path, fingerprint))


def test_a_checkpoint_of_other_hyperparameters_is_refused_naming_both(tmp_path):
    path = tmp_path / "c.npz"
    train(ragged_clients(5), "fedavg", "lr", "batched", rounds=1,
          checkpoints=BaselineCheckpoints(path, fingerprint={"hyperparameter lr": 0.02}))
    with pytest.raises(ValueError, match=r"'hyperparameter lr': \(0.02, 0.5\)"):
        load_baseline_checkpoint(path, {"hyperparameter lr": 0.5})


class _BlowsUpInRound3(BaselineClient):
    def local_train(self, algorithm, params, round_index, **hyper):
        result = super().local_train(algorithm, params, round_index, **hyper)
        if round_index == 2:
            result["params"] = np.full_like(result["params"], np.inf)
        return result


def test_divergence_names_the_round_the_step_size_and_what_was_kept(tmp_path):
    path = tmp_path / "c.npz"
    fingerprint = {"algorithm": "fedavg"}
    clients = [_BlowsUpInRound3(i, d, "lr", N_CLASSES, 0) for i, d in enumerate(ragged_clients(6))]
    with pytest.raises(Diverged, match=r"fedavg diverged in round 3: .*\{'lr': 0.02, 'beta': 1.0\}.*"
                                       r"c.npz holds the state after round 2"):
        run_baseline(InProcessTransport(clients), "fedavg", 10, lr=0.02, batch_size=8,
                     checkpoints=BaselineCheckpoints(path, every=2, fingerprint=fingerprint))
    state = load_baseline_checkpoint(path, fingerprint)  # still readable, and finite
    assert len(state["rounds"]) == 2 and np.isfinite(state["params"]).all()
    # A step size that overflows in the first round: no checkpoint yet, and the message says no more.
    with pytest.raises(Diverged, match=r"diverged in round 1: .*'lr': 1000000.0, 'beta': 1.0\}\); lower the step "
                                       r"sizes \(--hyper\)$"):
        train(ragged_clients(6), "fedavg", "dnn", "batched", rounds=5, lr=1e6)


def test_a_run_that_grows_without_bound_is_diverged_before_it_overflows():
    # pFedMe's inner steps grow geometrically once personal_lr * lamda > 2: finite for hundreds of rounds.
    with pytest.raises(Diverged, match=r"pfedme diverged in round \d+: its global parameters reach .* in absolute "
                                       r"value .*'lamda': 100000.0"):
        train(ragged_clients(7), "pfedme", "lr", "batched", rounds=60, lamda=1e5)


def test_going_on_past_an_unscheduled_last_evaluation_repeats_the_straight_run(tmp_path):
    data, path, fingerprint = ragged_clients(8), tmp_path / "c.npz", {"algorithm": "fedavg"}
    straight, _ = train(data, "fedavg", "lr", "batched", rounds=4, eval_every=2)
    train(data, "fedavg", "lr", "batched", rounds=3, eval_every=2,
          checkpoints=BaselineCheckpoints(path, fingerprint=fingerprint))
    resumed, _ = train(data, "fedavg", "lr", "batched", rounds=4, eval_every=2,
                       resume=load_baseline_checkpoint(path, fingerprint))
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in straight["rounds"]]
    assert resumed["best_accuracy"] == straight["best_accuracy"]


def test_the_batched_engine_takes_the_local_updates_default_batch_size():
    data = ragged_clients(9, (5, 30, 50))
    for engine in ("per-client", "batched"):
        clients = [BaselineClient(i, d, "lr", N_CLASSES, 0) for i, d in enumerate(data)]
        if engine == "batched":
            ClientCohort(clients)
        results = [c.local_train("pfedme", clients[0].initial_params()["params"], 0, lr=0.01, personal_lr=0.05,
                                 lamda=15.0) for c in clients]
        if engine == "per-client":
            expected = results
    assert all(np.array_equal(a["params"], b["params"]) for a, b in zip(results, expected))


# --------------------------------------------------------------------------- #
# Under mpiexec
# --------------------------------------------------------------------------- #

MPIEXEC = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                    reason="mpiexec or mpi4py is not installed")
def test_batched_engine_under_mpi_gives_the_in_process_per_client_parameters(tmp_path):
    args = ["--algorithm", "pfedzo", "--model", "lr", "--clients", "9", "--rounds", "2", "--quiet",
            "--hyper", "local_epochs=3,b2=4"]
    reference = tmp_path / "inproc"
    proc = subprocess.run([sys.executable, "-m", "fedlayer", "run", *args, "--engine", "per-client",
                           "--output", str(reference)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    distributed = tmp_path / "mpi"
    proc = subprocess.run([MPIEXEC, "-n", "3", sys.executable, "-m", "fedlayer", "run", *args,
                           "--output", str(distributed)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(np.load(distributed / "params.npy"), np.load(reference / "params.npy"))


def test_clients_of_several_cores_give_the_batched_parameters():
    # NumPy's OpenBLAS rounds a product differently on 2 threads than on 1; FedZO amplifies a loss's last bit
    # to the percent. Both engines evaluate the estimates' losses on one BLAS thread, whatever a client's cores.
    rng = np.random.default_rng(10)
    data = [ClientData(rng.random((n, 784)), rng.integers(0, N_CLASSES, n), rng.random((3, 784)),
                       rng.integers(0, N_CLASSES, 3)) for n in (40, 25, 33)]
    outcomes = []
    for engine in ("per-client", "batched"):
        clients = [BaselineClient(i, d, "dnn", N_CLASSES, 11, cores=2) for i, d in enumerate(data)]
        if engine == "batched":
            ClientCohort(clients)
        hyper = {**small_hyper("fedzo", "dnn"), "b1": 20, "b2": 8, "local_iters": 6}
        outcomes.append(run_baseline(InProcessTransport(clients), "fedzo", 2, clock=Clock(), **hyper)["params"])
    assert rel(outcomes[1], outcomes[0]) <= 1e-10


@pytest.mark.parametrize("every", [0, -2, 1.5, True])
def test_checkpoints_are_written_every_whole_number_of_rounds(tmp_path, every):
    with pytest.raises(ValueError, match=r"every n >= 1 rounds, got every="):
        BaselineCheckpoints(tmp_path / "c.npz", every=every)
