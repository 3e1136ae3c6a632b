"""The server's one question, the sum of statistics over clients: transports, dropouts, per-rank sums."""

import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlayer.client import Client, ClientDropout
from fedlayer.server import VARIANTS, AllClientsDropped, run_protocol, survivors_solution
from fedlayer.transport import InProcessTransport, Sum, fold
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from tests.numeric_checks import assert_close
from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, make_data

KEYS = ("G", "C", "zz", "rows")


def make_clients(rng, n_clients, n=240, **options):
    x, y = make_data(rng, n=n)
    parts = np.array_split(rng.permutation(n), n_clients)
    return [Client(i, client_data(x, y, p), dnn_config(x.shape[1]), seed=3, n_classes=N_CLASSES,
                   options=ClientOptions(**options))
            for i, p in enumerate(parts)], x, y, parts


def test_in_process_sum_is_the_sum_of_the_clients_statistics(rng):
    clients, *_ = make_clients(rng, 5)
    transport = InProcessTransport(clients)
    args = {c.client_id: {"position": 0, "batch_size": 16, "target_moments": True} for c in clients}
    outcome = transport.sum("local_stats", args, KEYS, upper=("G",))
    assert isinstance(outcome, Sum) and not outcome.dropped
    singles = [c.local_stats(0, 16, target_moments=True) for c in clients]
    assert_close(outcome.totals["G"], sum(s["G"] for s in singles), np.float64, 240)
    assert_close(outcome.totals["C"], sum(s["C"] for s in singles), np.float64, 240)
    assert outcome.totals["rows"] == sum(s["rows"] for s in singles) == 240
    # Receipts hold the scalars only; the statistics never come back per client.
    for cid, receipt in outcome.receipts.items():
        assert not set(receipt) & set(KEYS)
        assert receipt["n"] == clients[cid].data.n_train
        assert outcome.up_bytes[cid] == singles[cid]["G"].nbytes + singles[cid]["C"].nbytes + 16


def test_fold_keeps_integer_words_wrapping():
    totals = fold({}, {"w": np.array([2**63], dtype=np.uint64), "n": 3}, np.float64)
    fold(totals, {"w": np.array([2**63 + 5], dtype=np.uint64), "n": 4}, np.float64)
    assert totals["w"].dtype == np.uint64 and int(totals["w"][0]) == 5 and totals["n"] == 7


def test_fold_sums_upper_keys_on_their_upper_triangle(rng):
    first, second = rng.standard_normal((2, 6, 6))
    totals = fold({}, {"G": first, "C": first[:, :2]}, np.float64, upper=("G",))
    fold(totals, {"G": second, "C": second[:, :2]}, np.float64, upper=("G",))
    np.testing.assert_array_equal(np.triu(totals["G"]), np.triu(first + second))
    # The strict lower triangle is left zero, as a packed upper triangle unpacks.
    np.testing.assert_array_equal(np.tril(totals["G"], -1), 0)
    np.testing.assert_array_equal(totals["C"], first[:, :2] + second[:, :2])


class FailsOn:
    """A client that raises in ``method`` for the listed layers (a crash, not a simulated dropout)."""

    def __init__(self, client, positions, method="local_stats"):
        self.client, self.positions, self.method, self.client_id = client, positions, method, client.client_id

    def __getattr__(self, name):
        attribute = getattr(self.client, name)
        if name != self.method:
            return attribute

        def failing(position, *args, **kwargs):
            if position in self.positions:
                raise OSError(f"disk of client {self.client_id} failed")
            return attribute(position, *args, **kwargs)

        return failing


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), n_clients=st.integers(3, 8), probability=st.sampled_from([0.2, 0.4]))
def test_dropouts_leave_the_weights_of_centralized_acnnl_on_the_survivors(seed, n_clients, probability):
    rng = np.random.default_rng(seed)
    clients, *_ = make_clients(rng, n_clients, drop_probability=probability)
    n_layers = 3
    try:
        outcome = run_protocol(InProcessTransport(clients), n_layers, VARIANTS["fedacnnl"],
                               ServerOptions(batch=BatchPolicy(7)))
    except AllClientsDropped:
        return  # every client failed in some layer: nothing to compare (the error is tested below)
    plain, *_ = make_clients(np.random.default_rng(seed), n_clients)  # same data, no simulated failures
    reference = survivors_solution(plain, outcome["rounds"], outcome["group_weights"][0])
    for W, R in zip(outcome["group_weights"][0], reference, strict=True):
        assert_close(W, R, np.float64, rtol=1e-9)
    for record in outcome["rounds"]:
        assert set(record["clients"]).isdisjoint(record.get("dropped", {}))
        assert len(record["clients"]) + len(record.get("dropped", {})) == n_clients


def test_a_crashing_client_drops_out_of_its_rounds_only(rng):
    clients, *_ = make_clients(rng, 4)
    clients[2] = FailsOn(clients[2], positions={1})
    outcome = run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)))
    rounds = outcome["rounds"]
    assert "dropped" not in rounds[0] and "dropped" not in rounds[2]
    assert rounds[1]["dropped"] == {"2": "OSError: disk of client 2 failed"}
    assert "2" not in rounds[1]["clients"] and "2" in rounds[2]["clients"]
    # It still received the layer's weights and is evaluated with everyone.
    assert 0.0 < outcome["accuracy"] <= 1.0


def test_a_client_that_fails_to_personalize_a_layer_keeps_its_groups_layer(rng):
    """Personalization is local: a client whose step raises keeps the meta-model's layer, the others go on."""
    variant = VARIANTS["pfedacnnl-wc"]
    reference, *_ = make_clients(np.random.default_rng(7), 5)
    expected = run_protocol(InProcessTransport(reference), 3, variant, ServerOptions(batch=BatchPolicy(7)))
    clients, *_ = make_clients(np.random.default_rng(7), 5)
    clients[2] = FailsOn(clients[2], positions={1}, method="personalize")
    outcome = run_protocol(InProcessTransport(clients), 3, variant, ServerOptions(batch=BatchPolicy(7)))
    personal = [r for r in outcome["rounds"] if r["stage"] == "personalization"]
    assert personal[1]["dropped"] == {"2": "OSError: disk of client 2 failed"}
    assert "2" not in personal[1]["clients"] and "2" in personal[2]["clients"]
    assert "dropped" not in personal[0] and "dropped" not in personal[2]
    failed = clients[2].final_weights()["weights"]
    np.testing.assert_array_equal(failed[1], clients[2].meta_weights[1].astype(failed[1].dtype))
    # Layer 1 was personalized as in the run without the failure, and every other client as there
    # (eq. 7's timed batch sizes reorder the float64 sums between the two runs).
    assert_close(failed[0], reference[2].final_weights()["weights"][0], np.float64, rtol=1e-9)
    for client, same in zip(clients[:2] + clients[3:], reference[:2] + reference[3:]):
        for W, R in zip(client.final_weights()["weights"], same.final_weights()["weights"]):
            assert_close(W, R, np.float64, rtol=1e-9)
    assert 0.0 < outcome["accuracy"] <= 1.0 and expected["accuracy"] > 0.0


def test_simulated_dropouts_are_seeded_and_hit_the_given_fraction(rng):
    clients, *_ = make_clients(rng, 6, drop_probability=0.3)
    draws = {c.client_id: [_drops(c, 0, r) for r in range(60)] for c in clients}
    again, *_ = make_clients(np.random.default_rng(0), 6, drop_probability=0.3)  # other data, same seed
    assert draws == {c.client_id: [_drops(c, 0, r) for r in range(60)] for c in again}
    fraction = np.mean([d for per_client in draws.values() for d in per_client])
    assert 0.2 < fraction < 0.4  # 360 draws of p = 0.3: 4.5 standard deviations either side


def _drops(client, position, round_index):
    try:
        client.local_stats(position, 64, round_index=round_index)
    except ClientDropout as err:
        assert f"client {client.client_id}: simulated failure in layer {position + 1}" in str(err)
        return True
    return False


def test_missing_the_round_deadline_is_a_dropout(rng):
    clients, *_ = make_clients(rng, 3, round_deadline_s=1e-9)
    with pytest.raises(ClientDropout, match=r"client 0: busy .* s in layer 1, past the round deadline of 1e-09 s"):
        clients[0].local_stats(0, 64)
    with pytest.raises(AllClientsDropped, match=r"every client of group 0 dropped out of layer 1 \(3: \[0, 1, 2\]\)"):
        run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"])


class _SlowClient(Client):
    """A client that straggles: its statistics of one layer take ``delay_s`` more."""

    def __init__(self, *args, slow_layer=0, delay_s=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_layer, self.delay_s = slow_layer, delay_s

    def _statistics(self, position, *args, **kwargs):
        if position == self.slow_layer:
            time.sleep(self.delay_s)
        return super()._statistics(position, *args, **kwargs)


def test_only_the_clients_past_the_round_deadline_drop_out_of_that_round(rng):
    # Clients 1 and 3 straggle in layer 2 by 0.5 s against a 0.25 s deadline (the others need a few ms
    # here): they miss that round only, and the model equals the run in which they fail in it.
    x, y = make_data(rng, n=240)
    parts = np.array_split(rng.permutation(240), 5)

    def run(slow, deadline=None, fail=False, **straggling):
        clients = [_SlowClient(i, client_data(x, y, p), dnn_config(x.shape[1]), seed=3, n_classes=N_CLASSES,
                               options=ClientOptions(round_deadline_s=deadline), slow_layer=1,
                               **(straggling if i in slow else {}))
                   for i, p in enumerate(parts)]
        if fail:
            clients = [FailsOn(c, positions={1}) if c.client_id in slow else c for c in clients]
        return run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(16)))

    late = run({1, 3}, deadline=0.25, delay_s=0.5)
    rounds = late["rounds"]
    assert "dropped" not in rounds[0] and "dropped" not in rounds[2]
    assert sorted(rounds[1]["dropped"]) == ["1", "3"]
    for why in rounds[1]["dropped"].values():
        assert re.fullmatch(r"ClientDropout: client [13]: busy 0\.5\d+ s in layer 2, past the round deadline of "
                            r"0\.25 s", why), why
    failed = run({1, 3}, fail=True)
    # Eq. (7)'s batch sizes follow measured times, so two runs agree to rounding (docs/cli.md): at the weights'
    # scale, not per entry, where one near zero once differed by 1e-16, 1e-12 of itself.
    for W, V in zip(failed["group_weights"][0], late["group_weights"][0], strict=True):
        assert_close(V, W, np.float64, rtol=1e-12)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_drop_probability_out_of_range_is_refused(rng, bad):
    x, y = make_data(rng, n=20)
    with pytest.raises(ValueError, match=r"drop_probability must be in \[0, 1\)"):
        Client(0, client_data(x, y, np.arange(20)), dnn_config(12), seed=0, n_classes=N_CLASSES,
               options=ClientOptions(drop_probability=bad))


def test_each_round_draws_its_own_simulated_dropouts(rng):
    """--drop-clients draws per client and round: layer l's dropouts are the draws of round l, not of round 1."""
    clients, *_ = make_clients(rng, 10, drop_probability=0.4)
    outcome = run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(8)))
    recorded = [set(map(int, record.get("dropped", {}))) for record in outcome["rounds"]]
    expected = [{c.client_id for c in clients if _drops(c, position, position)} for position in range(3)]
    assert recorded == expected
    assert len({frozenset(s) for s in expected}) > 1  # the rounds' draws differ, so the check above tells them apart
