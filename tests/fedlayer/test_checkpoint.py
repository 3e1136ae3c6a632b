"""Checkpoint/resume: a run killed mid-way and resumed ends with the uninterrupted run's weights."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fedlayer.checkpoint import Checkpointing, load_checkpoint
from fedlayer.models import Model
from fedlayer.run import RunConfig, run
from fedlayer.server import ServerState

ARGS = ["--algorithm", "fedacnnl-wa", "--dataset", "synthetic", "--model", "dnn", "--clients", "100", "--seed", "2"]


def config(output, resume=False):
    return RunConfig(algorithm="fedacnnl-wa", dataset="synthetic", model="dnn", clients=100, seed=2,
                     output=str(output), resume=resume)


def test_killed_run_resumes_to_identical_weights(tmp_path):
    reference = run(config(tmp_path / "reference"))
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "fedlayer", "run", *ARGS, "--output", str(out), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = out / "checkpoint.npz"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    state = load_checkpoint(checkpoint, config(out).fingerprint())
    assert 1 <= state["layers_done"] < 3
    assert not (out / "model.npz").exists()

    done = subprocess.run([sys.executable, "-m", "fedlayer", "run", *ARGS, "--output", str(out), "--resume", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    resumed, _ = Model.load(out / "model.npz")
    uninterrupted, _ = Model.load(tmp_path / "reference" / "model.npz")
    for index in resumed.trainable:
        np.testing.assert_array_equal(resumed.layers[index].weights, uninterrupted.layers[index].weights)
    import json

    results = json.loads((out / "results.json").read_text())
    assert results["resumed_from_layer"] == state["layers_done"]
    assert results["accuracy"] == reference["accuracy"]
    assert len(results["rounds"]) == 3  # the checkpointed rounds plus the resumed ones


def test_resume_refuses_another_configuration(tmp_path):
    run(RunConfig(algorithm="fedacnnl", clients=10, model="lr", output=str(tmp_path)))
    with pytest.raises(ValueError, match="another configuration.*to start over"):
        run(RunConfig(algorithm="fedacnnl", clients=10, model="lr", gamma=5.0, output=str(tmp_path), resume=True))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A crash while writing leaves the previous checkpoint intact and no temporary file."""
    run(RunConfig(algorithm="fedacnnl", clients=10, model="lr", output=str(tmp_path)))
    before = (tmp_path / "checkpoint.npz").read_bytes()
    import fedlayer.checkpoint as ck

    def broken_savez(f, **arrays):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path / "checkpoint.npz", fingerprint={}, layers_done=1, group_of={0: 0},
                           group_weights={0: [np.ones((2, 2))]}, batch={0: 1}, first_durations=None, rounds=[])
    assert (tmp_path / "checkpoint.npz").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


@pytest.mark.parametrize("personalized,shared", [("pfedacnnl-wc", "fedacnnl"), ("pfedacnnl", "pfedacnnl-wp")])
def test_personalization_resumes_from_the_run_without_it(tmp_path, personalized, shared):
    # the personalized variant trains the same federated stage: resuming skips it and personalizes its layers
    base = dict(dataset="synthetic", model="dnn", clients=20, groups=3, seed=1)
    without = run(RunConfig(algorithm=shared, output=str(tmp_path / "shared"), **base))
    direct = run(RunConfig(algorithm=personalized, output=str(tmp_path / "direct"), **base))
    resumed = run(RunConfig(algorithm=personalized, output=str(tmp_path / "resumed"), resume=True,
                            checkpoint=str(tmp_path / "shared" / "checkpoint.npz"), **base))
    n_layers = sum(r["stage"] == "federated" for r in without["rounds"].values())
    assert resumed["resumed_from_layer"] == n_layers
    shared_rounds = [r for r in resumed["rounds"].values() if r["stage"] != "personalization"]
    assert shared_rounds == list(without["rounds"].values())  # the stage's records are those of the run resumed
    assert len(resumed["rounds"]) == len(direct["rounds"])
    for path in sorted((tmp_path / "direct" / "personalized").glob("client*.npz")):
        ours, _ = Model.load(tmp_path / "resumed" / "personalized" / path.name)
        theirs, _ = Model.load(path)
        for index in ours.trainable:
            # eq. (7)'s batches follow measured times, so the sums' order differs: equal to rounding
            np.testing.assert_allclose(ours.layers[index].weights, theirs.layers[index].weights, rtol=1e-9, atol=1e-12)
    assert abs(resumed["accuracy"] - direct["accuracy"]) < 1e-3


def test_resume_refuses_another_federated_stage(tmp_path):
    run(RunConfig(algorithm="fedacnnl", clients=10, model="lr", output=str(tmp_path)))
    with pytest.raises(ValueError, match="another configuration.*'fedacnnl', 'pfedacnnl-wp'"):
        run(RunConfig(algorithm="pfedacnnl", clients=10, groups=2, model="lr", output=str(tmp_path), resume=True))


def test_resumed_after_its_last_round_the_run_still_reports_its_accuracy(tmp_path):
    # pfedacnnl-wc with eval_every=10 leaves FedACnnL's last federated round unevaluated in its checkpoint
    base = dict(dataset="synthetic", model="lr", clients=10, seed=1)
    run(RunConfig(algorithm="pfedacnnl-wc", output=str(tmp_path / "wc"), eval_every=10, **base))
    resumed = run(RunConfig(algorithm="fedacnnl", output=str(tmp_path / "fed"), resume=True,
                            checkpoint=str(tmp_path / "wc" / "checkpoint.npz"), **base))
    direct = run(RunConfig(algorithm="fedacnnl", output=str(tmp_path / "direct"), **base))
    assert resumed["accuracy"] is not None
    assert abs(resumed["accuracy"] - direct["accuracy"]) < 1e-3


def test_a_key_added_to_the_fingerprint_matches_its_earlier_behaviour(tmp_path):
    # checkpoints written before gamma_scope existed behaved as gamma_scope="all", and before the DCNN's
    # padding was a choice it was 'valid'
    path = tmp_path / "checkpoint.npz"
    from fedlayer.checkpoint import save_checkpoint

    save_checkpoint(path, fingerprint={"gamma": 100.0}, layers_done=1, group_of={0: 0},
                    group_weights={0: [np.ones((2, 2))]}, batch={0: 1}, first_durations=None, rounds=[])
    now = {"gamma": 100.0, "gamma_scope": "all", "padding": "valid"}
    assert load_checkpoint(path, now)["layers_done"] == 1
    with pytest.raises(ValueError, match=r"'gamma_scope': \('all', 'group'\)"):
        load_checkpoint(path, {**now, "gamma_scope": "group"})
    with pytest.raises(ValueError, match=r"'padding': \('valid', 'same'\)"):
        load_checkpoint(path, {**now, "padding": "same"})
    # a key the run no longer has is named too
    with pytest.raises(ValueError, match=r"'gamma': \(100.0, None\)"):
        load_checkpoint(path, {"gamma_scope": "all", "padding": "valid"})


@pytest.mark.parametrize("written_by, stage", [("pfedacnnl", "pfedacnnl-wp"), ("pfedacnnl-wc", "fedacnnl")])
def test_a_checkpoint_naming_its_run_resumes_as_the_stage_it_trained(tmp_path, written_by, stage):
    # before the fingerprint named the federated stage, a personalized run's checkpoint named the run itself
    path = tmp_path / "checkpoint.npz"
    from fedlayer.checkpoint import save_checkpoint

    save_checkpoint(path, fingerprint={"algorithm": written_by}, layers_done=1, group_of={0: 0},
                    group_weights={0: [np.ones((2, 2))]}, batch={0: 1}, first_durations=None, rounds=[])
    assert load_checkpoint(path, {"algorithm": stage, "gamma_scope": "all", "padding": "valid"})["layers_done"] == 1
    with pytest.raises(ValueError, match="another configuration"):
        load_checkpoint(path, {"algorithm": "acnnl", "gamma_scope": "all", "padding": "valid"})


def test_resumed_clients_share_the_checkpointed_weights(tmp_path, monkeypatch):
    # at full DCNN width a group's weights are 490 MB: a copy per client in one process would not fit in memory
    from fedlayer.client import Client

    base = dict(dataset="synthetic", model="dnn", clients=6, seed=3)
    run(RunConfig(algorithm="fedacnnl", output=str(tmp_path / "fed"), **base))
    installed = {}
    set_weights = Client.set_weights

    def recording(self, position, weights):
        out = set_weights(self, position, weights)
        installed.setdefault(position, []).append(self.model.layers[self.model.trainable[position]].weights)
        return out

    monkeypatch.setattr(Client, "set_weights", recording)
    run(RunConfig(algorithm="pfedacnnl-wc", output=str(tmp_path / "wc"), resume=True,
                  checkpoint=str(tmp_path / "fed" / "checkpoint.npz"), **base))
    assert sorted(installed) == [0, 1, 2]
    for position, arrays in installed.items():
        assert len(arrays) == 6
        assert all(np.shares_memory(arrays[0], other) for other in arrays[1:]), position


def test_a_checkpoint_resumes_with_the_fingerprint_it_was_saved_with(tmp_path):
    """Through the API too: a fingerprint without the keys added since (defaults on both sides), tuples as lists."""
    from fedlayer.checkpoint import save_checkpoint

    for fingerprint in ({}, {"h": (1, 2)}, {"padding": "valid"}):
        save_checkpoint(tmp_path / "c.npz", fingerprint=fingerprint, layers_done=0, group_of={}, group_weights={},
                        batch={}, first_durations=None, rounds=[])
        assert load_checkpoint(tmp_path / "c.npz", fingerprint)["layers_done"] == 0


def test_an_adaptive_run_checkpoints_eq7s_reference_and_next_batch_sizes(tmp_path, rng):
    """A resumed FedACnnL needs round 1's arrivals (eq. 7's reference) and the batch sizes of the next round."""
    from fedlayer.server import VARIANTS, adaptive_batch_sizes
    from fedlayer.timing import Clock
    from tests.fedlayer.cases import client_data, dnn_config, make_data, run_clients

    x, y = make_data(rng, n=160)
    parts = np.array_split(np.arange(160), 4)
    first = {i: 5 + i for i in range(4)}
    cap = dict.fromkeys(range(4), 10**6)
    path = tmp_path / "checkpoint.npz"
    outcome, _ = run_clients([client_data(x, y, p) for p in parts], VARIANTS["fedacnnl"], config=dnn_config(12),
                             batch_size=first, max_batch_size=cap, clock=Clock(bandwidth_bytes_per_s=2e5),
                             checkpoint=Checkpointing(path, {"test": 1}))
    state = load_checkpoint(path, {"test": 1})
    arrivals = [{int(c): t["arrival_s"] for c, t in record["clients"].items()} for record in outcome["rounds"]]
    assert state["layers_done"] == 3
    assert {int(c): v for c, v in state["first_durations"].items()} == pytest.approx(arrivals[0], rel=1e-12)
    assert {int(c): v for c, v in state["batch"].items()} == adaptive_batch_sizes(arrivals[2], arrivals[0], first, cap)
    assert state["batch"] != {str(c): b for c, b in first.items()}


class _Killed(Exception):
    """Stands for the end of a process killed after a given round."""


def _killed_after(what):
    def progress(message):
        if message.startswith(what):
            raise _Killed(message)
    return progress


PERSONAL = dict(algorithm="pfedacnnl-wc", dataset="synthetic", model="dnn", clients=20, seed=3, eval_every=1)


def personalized_anew(checkpoint, output, **settings):
    """The run that personalizes every layer of ``checkpoint``'s federated stage (a copy without its
    personalization rounds): the uninterrupted run's models, bit for bit."""
    config = RunConfig(output=str(output), resume=True, **settings)
    state = ServerState.from_checkpoint(load_checkpoint(checkpoint, config.fingerprint()))
    Checkpointing(config.checkpoint_path(), config.fingerprint(), config.personalization_fingerprint()).save(
        state.without_personalization())
    return run(config)


def test_a_run_killed_while_personalizing_resumes_with_its_clients_layers(tmp_path):
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        run(RunConfig(output=str(out), **PERSONAL), progress=_killed_after("layer 2/3 personalized"))
    direct = personalized_anew(out / "checkpoint.npz", tmp_path / "direct", **PERSONAL)
    saved = load_checkpoint(out / "checkpoint.npz", RunConfig(**PERSONAL).fingerprint())
    assert (saved["layers_done"], saved["personalized"]) == (3, 2)
    kept = sorted(p.name for p in (out / "checkpoint.personal").iterdir())
    assert kept == sorted(f"client{c}_layer{p}.npz" for c in range(20) for p in range(2))
    before = [r for r in saved["rounds"] if r["stage"] == "personalization"]

    resumed = run(RunConfig(output=str(out), resume=True, **PERSONAL))
    assert (resumed["resumed_from_layer"], resumed["resumed_personalized"]) == (3, 2)
    rounds = list(resumed["rounds"].values())
    assert len(rounds) == len(direct["rounds"])
    # the two layers personalized before the kill are read back, not personalized again: their records stand
    assert [r for r in rounds if r["stage"] == "personalization"][:2] == before
    for path in sorted((tmp_path / "direct" / "personalized").glob("client*.npz")):
        ours, _ = Model.load(out / "personalized" / path.name)
        theirs, _ = Model.load(path)
        for index in ours.trainable:
            np.testing.assert_array_equal(ours.layers[index].weights, theirs.layers[index].weights)
    assert resumed["accuracy"] == direct["accuracy"]


def test_personalized_layers_of_other_settings_are_personalized_anew(tmp_path):
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        run(RunConfig(output=str(out), **PERSONAL), progress=_killed_after("layer 1/3 personalized"))
    other = {**PERSONAL, "eps": 100.0}
    direct = run(RunConfig(output=str(tmp_path / "direct"), **other))
    resumed = run(RunConfig(output=str(out), resume=True, **other))
    assert resumed["resumed_from_layer"] == 3 and "resumed_personalized" not in resumed
    assert len(resumed["rounds"]) == len(direct["rounds"])
    assert abs(resumed["accuracy"] - direct["accuracy"]) < 1e-3
    # and the run without personalization that resumes from it has its federated rounds only
    fed = run(RunConfig(**{**PERSONAL, "algorithm": "fedacnnl"}, output=str(tmp_path / "fed"), resume=True,
                        checkpoint=str(out / "checkpoint.npz")))
    assert [r["stage"] for r in fed["rounds"].values()] == ["federated"] * 3


@pytest.mark.parametrize("damage", ["missing", "corrupt", "another client's"])
def test_a_personalized_layer_that_cannot_be_read_back_is_refused_by_name(tmp_path, damage):
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        run(RunConfig(output=str(out), **PERSONAL), progress=_killed_after("layer 2/3 personalized"))
    layer = out / "checkpoint.personal" / "client7_layer1.npz"
    if damage == "missing":
        layer.unlink()
        expected = r"client 7's personalized layer 2 is not at .*client7_layer1\.npz: each client writes"
    elif damage == "corrupt":
        data = bytearray(layer.read_bytes())
        data[len(data) // 2] ^= 0xFF
        layer.write_bytes(bytes(data))
        expected = r"client7_layer1\.npz (is damaged|cannot be read)"
    else:
        layer.write_bytes((out / "checkpoint.personal" / "client8_layer1.npz").read_bytes())
        expected = r"holds client 8's layer 2 of the run \w+, not client 7's layer 2"
    with pytest.raises(ValueError, match=expected + ".*to start over"):
        run(RunConfig(output=str(out), resume=True, **PERSONAL))


def test_a_secure_run_resumed_while_personalizing_keeps_what_each_client_chose_to_itself(tmp_path):
    secure = {**PERSONAL, "secure": True, "model": "lr"}
    out = tmp_path / "killed"
    with pytest.raises(_Killed):
        run(RunConfig(output=str(out), **secure), progress=_killed_after("layer 1/1 personalized"))
    resumed = run(RunConfig(output=str(out), resume=True, **secure))
    assert resumed["resumed_personalized"] == 1
    # the server's records hold busy times only; each client's model file has the form it chose, read back
    assert all(set(c) == {"compute_s", "comm_s", "idle_s", "arrival_s"} | ({"parts"} & set(c))
               for r in resumed["rounds"].values() if r["stage"] == "personalization" for c in r["clients"].values())
    for path in sorted((out / "personalized").glob("client*.npz")):
        _, metadata = Model.load(path)
        assert metadata["personalization"]["0"]["form"] in ("primal", "dual")
