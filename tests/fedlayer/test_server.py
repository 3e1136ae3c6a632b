"""The server as stages over one state: the state, the stages, the solvers, and checkpoints written before them."""

from pathlib import Path

import numpy as np
import pytest

import fastls
from fedlayer.checkpoint import Checkpointing, load_checkpoint
from fedlayer.client import Client
from fedlayer.options import BatchPolicy, ServerOptions
from fedlayer.server import (FixedGamma, GroupGCV, PooledGCV, ProtocolRun, ServerState, SummedStatistics, Variant,
                             choose_solver, initialize, personalize, run_protocol, train_layer)
from fedlayer.server.solvers import gcv_choice
from fedlayer.timing import Clock
from fedlayer.transport import InProcessTransport
from tests.numeric_checks import assert_close
from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, make_data

DATA = Path(__file__).parents[1] / "data"
#: What tests/data/make_format2_checkpoint.py ran: two K-means groups, fixed batch sizes, GCV pooled over the groups.
BEFORE = Variant(adaptive=False, cluster=True)
BEFORE_OPTIONS = ServerOptions(groups=2, batch=BatchPolicy(7), gamma="auto")


def _fixture_clients():
    x, y = make_data(np.random.default_rng(44), n=120)
    return [Client(i, client_data(x, y, p), dnn_config(12), seed=3, n_classes=N_CLASSES)
            for i, p in enumerate(np.array_split(np.arange(120), 4))]


def _statistics(rng, n=60, d=7, m=3):
    X = rng.standard_normal((n, d))
    Z = X @ rng.standard_normal((d, m)) + 0.1 * rng.standard_normal((n, m))
    return SummedStatistics(X.T @ X, X.T @ Z, float(np.sum(Z * Z)), n)


def _copy(sums):
    return SummedStatistics(sums.G.copy(), sums.C.copy(), sums.zz, sums.rows)


@pytest.mark.parametrize("gamma,scope,n_groups,expected", [
    (100.0, "all", 3, FixedGamma), (100.0, "group", 1, FixedGamma), ("auto", "all", 1, GroupGCV),
    ("auto", "group", 3, GroupGCV), ("auto", "all", 3, PooledGCV),
])
def test_the_solver_of_a_layer_is_chosen_once_from_its_gamma_scope_and_groups(gamma, scope, n_groups, expected):
    assert type(choose_solver(gamma, scope, n_groups, None)) is expected


def test_a_fixed_gamma_solves_each_group_as_it_arrives(rng):
    sums = [_statistics(rng) for _ in range(2)]
    solver = choose_solver(30.0, "all", 2, None)
    for k, s in enumerate(sums):
        np.testing.assert_array_equal(solver.add(k, _copy(s), {}), fastls.ridge_solve(s.G, s.C, 30.0))
    assert solver.finish({}, {}) == {}


def test_gcv_per_group_records_each_group_s_choice(rng):
    sums = [_statistics(rng) for _ in range(2)]
    solver, selection = choose_solver("auto", "group", 2, None), {}
    for k, s in enumerate(sums):
        gamma, path, _ = gcv_choice(_copy(s), None)
        np.testing.assert_array_equal(solver.add(k, _copy(s), selection), path.solve(gamma))
        assert selection[str(k)]["gamma"] == gamma and selection[str(k)]["criterion"] == "gcv"


def test_pooled_gcv_chooses_one_gamma_on_the_total_and_solves_every_group_with_it(rng):
    sums = [_statistics(rng) for _ in range(3)]
    solver, selection = choose_solver("auto", "all", 3, None), {}
    assert all(solver.add(k, _copy(s), selection) is None for k, s in enumerate(sums))
    total = SummedStatistics(sum(s.G for s in sums), sum(s.C for s in sums), sum(s.zz for s in sums),
                             sum(s.rows for s in sums))
    gamma, _, _ = gcv_choice(total, None)
    solved = solver.finish({}, selection)
    assert selection["all"]["gamma"] == gamma
    for k, s in enumerate(sums):
        np.testing.assert_array_equal(solved[k], fastls.ridge_solve(s.G, s.C, gamma))


def test_a_withheld_group_is_solved_on_the_total_of_the_others(rng):
    sums = [_statistics(rng) for _ in range(2)]
    solver = choose_solver(30.0, "all", 3, None, keep_total=True)
    for k, s in enumerate(sums):
        solver.add(k, _copy(s), {})
    solved = solver.finish({2: "too few survivors"}, {})
    assert list(solved) == [2]
    assert_close(solved[2], fastls.ridge_solve(sums[0].G + sums[1].G, sums[0].C + sums[1].C, 30.0), np.float64,
                 rtol=1e-12)


def test_the_stages_run_one_by_one_are_run_protocol(rng):
    """initialize, train_layer per layer and personalize over one state: the weights and records of run_protocol."""
    x, y = make_data(rng, n=160)
    parts = np.array_split(np.arange(160), 4)

    def clients():
        return [Client(i, client_data(x, y, p), dnn_config(12), seed=3, n_classes=N_CLASSES)
                for i, p in enumerate(parts)]

    variant = Variant(adaptive=False, cluster=True, personalize=True)
    options = ServerOptions(groups=2, batch=BatchPolicy(9))
    whole = run_protocol(InProcessTransport(clients()), 3, variant, options)
    transport = InProcessTransport(clients())
    first, most = options.batch.sizes(transport.client_ids)
    run = ProtocolRun(transport, 3, variant, options, first, most, clock=Clock())
    state = initialize(run)
    assert state.layers_done == 0 and state.group_of == {int(c): k for c, k in whole["groups"].items()}
    for position in range(3):
        train_layer(run, state, position)
        assert state.layers_done == position + 1
    personalize(run, state)
    for k, layers in whole["group_weights"].items():
        for W, V in zip(layers, state.group_weights[k], strict=True):
            np.testing.assert_array_equal(V, W)
            assert not V.flags.writeable
    assert [r["stage"] for r in state.rounds] == [r["stage"] for r in whole["rounds"]]
    assert [r["accuracy"] for r in state.rounds] == [r["accuracy"] for r in whole["rounds"]]


def test_the_state_is_what_a_checkpoint_holds(tmp_path, rng):
    state = ServerState(group_of={0: 1, 1: 0}, batch={0: 7, 1: 9}, first_durations={0: 0.5, 1: 0.25},
                        group_weights={0: [rng.standard_normal((3, 2))], 1: [rng.standard_normal((3, 2))]},
                        rounds=[{"stage": "federated", "accuracy": 0.5}], layers_done=1)
    Checkpointing(tmp_path / "c.npz", {"test": 1}).save(state)
    loaded = ServerState.from_checkpoint(load_checkpoint(tmp_path / "c.npz", {"test": 1}))
    assert (loaded.group_of, loaded.batch, loaded.first_durations, loaded.rounds, loaded.layers_done) == \
        (state.group_of, state.batch, state.first_durations, state.rounds, state.layers_done)
    for k in state.group_weights:
        np.testing.assert_array_equal(loaded.group_weights[k][0], state.group_weights[k][0])


def test_a_checkpoint_written_before_the_server_stages_resumes(tmp_path):
    """tests/data/make_format2_checkpoint.py wrote it with the code before fedlayer.server: resumed, the run ends
    with the weights of the same run uninterrupted, and the old code's weights to rounding."""
    saved = load_checkpoint(DATA / "checkpoint_format2_layer1.npz", {"test": "before the server stages"})
    resumed = run_protocol(InProcessTransport(_fixture_clients()), 3, BEFORE, BEFORE_OPTIONS,
                           resume=ServerState.from_checkpoint(saved))
    whole = run_protocol(InProcessTransport(_fixture_clients()), 3, BEFORE, BEFORE_OPTIONS)
    assert resumed["groups"] == whole["groups"]
    with np.load(DATA / "weights_before_server_stages.npz") as before:
        for k, layers in whole["group_weights"].items():
            for i, W in enumerate(layers):
                np.testing.assert_array_equal(resumed["group_weights"][k][i], W)
                assert_close(W, before[f"w_{k}_{i}"], np.float64, rtol=1e-12)
    assert [r["stage"] for r in resumed["rounds"]] == ["initialization", "federated", "federated", "federated"]


class _Progress:
    """A progress display that takes the clients done within a round."""

    def __init__(self):
        self.events = []

    def __call__(self, message):
        self.events.append(("round", message))

    def within_round(self, done, total):
        self.events.append((done, total))


@pytest.mark.parametrize("server_solve", ["primal", "dual"])
def test_the_progress_display_counts_the_clients_done_within_each_round(server_solve):
    clients = _fixture_clients()
    progress = _Progress()
    run_protocol(InProcessTransport(clients), 3, Variant(cluster=True, personalize=True),
                 ServerOptions(groups=2, batch=BatchPolicy(7), server_solve=server_solve), progress=progress)
    rounds, within = [], []
    for event in progress.events:
        if event[0] == "round":
            rounds.append(within)
            within = []
        else:
            within.append(event)
    # Every round (3 federated, 3 personalization): clients 1..4 of 4, across the groups, then the round.
    assert len(rounds) == 6 and all(counts == [(i, 4) for i in range(1, 5)] for counts in rounds)


class _ProgressWithStatus(_Progress):
    """A progress display that also takes what the server does between the clients and the round's end."""

    def status(self, what):
        self.events.append(("status", what))


def test_the_progress_display_says_when_the_server_solves_in_the_dual_and_evaluates():
    clients = _fixture_clients()
    progress = _ProgressWithStatus()
    run_protocol(InProcessTransport(clients), 3, Variant(), ServerOptions(batch=BatchPolicy(7), server_solve="dual"),
                 progress=progress)
    rows = sum(c.train_rows()["rows"][0] for c in clients)
    statuses = [event[1] for event in progress.events if event[0] == "status"]
    assert statuses[0] == f"server solving in the dual over {rows:,} rows"
    assert statuses.count("evaluating on the test splits") == 3
    # Each status comes after the round's last client and before the round's end.
    first = progress.events.index(("status", statuses[0]))
    assert progress.events[first - 1] == (4, 4) and progress.events[first + 1] == ("status", statuses[1])
    assert progress.events[first + 2][0] == "round"


def test_the_progress_bar_shows_the_round_s_clients(capsys):
    from fedlayer.cli import _ProgressBar

    bar = _ProgressBar("test")
    bar.start(3)
    bar("layer 1/3 trained, accuracy 0.5000")
    bar.within_round(7, 10)
    assert bar.bar.postfix == "round 2: 7/10 clients done"
    bar.status("server solving in the dual over 44,963 rows")
    assert bar.bar.postfix == "round 2: server solving in the dual over 44,963 rows"
    bar.close()
