"""Faults a user or a hostile tester can cause: exit status 2, one message naming what was wrong, no traceback.

Every case runs ``fedlayer`` as a user would (``main`` in process, or
``python -m fedlayer`` where the exit path matters) and checks the status,
the words of the message, and that no work was started or lost.
"""

import importlib
import io
import json
import os
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from fedlayer.cli import _summary, main

# The module, not the function fedlayer exports under the same name.
run_module = importlib.import_module("fedlayer.run")

SMALL = ["--clients", "12", "--groups", "3", "--quiet"]


def fedlayer(argv, capsys):
    """(exit status, stderr) of ``fedlayer argv``, whether main returns the status or argparse exits with it."""
    try:
        status = main(argv)
    except SystemExit as exit_info:
        status = exit_info.code
    return status, capsys.readouterr().err


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a run gets as far as loading its data (the error had to come first)."""

    def refuse(config):
        raise AssertionError("the run started loading data before refusing its arguments")

    monkeypatch.setattr(run_module, "load_dataset", refuse)


# --------------------------------------------------------------------------- #
# Output and checkpoint paths, refused before any work
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("algorithm", ["fedacnnl", "fedavg"])
def test_output_naming_a_file_is_refused_before_training(tmp_path, capsys, no_training, algorithm):
    existing = tmp_path / "results.txt"
    existing.write_text("keep me")
    status, err = fedlayer(["run", *SMALL, "--algorithm", algorithm, "--output", str(existing)], capsys)
    assert status == 2
    assert f"output '{existing}' is a file; give a directory" in err
    assert existing.read_text() == "keep me"


def test_output_below_a_file_is_not_writable(tmp_path, capsys, no_training):
    (tmp_path / "file").write_text("")
    status, err = fedlayer(["run", *SMALL, "--output", str(tmp_path / "file" / "run")], capsys)
    assert status == 2
    assert f"output directory '{tmp_path / 'file' / 'run'}' is not writable" in err


def _sys_is_read_only():
    try:
        os.mkdir("/sys/fedlayer-probe")
    except OSError:
        return os.path.isdir("/sys")
    os.rmdir("/sys/fedlayer-probe")
    return False


@pytest.mark.skipif(not _sys_is_read_only(),
                    reason="needs a directory no one may write into (Linux's /sys, even for root); not found here")
def test_output_in_a_read_only_folder_is_not_writable(capsys, no_training):
    status, err = fedlayer(["run", *SMALL, "--output", "/sys/fedlayer-run"], capsys)
    assert status == 2
    assert "output directory '/sys/fedlayer-run' is not writable" in err


def test_checkpoint_naming_a_folder_is_refused(tmp_path, capsys, no_training):
    status, err = fedlayer(["run", *SMALL, "--checkpoint", str(tmp_path)], capsys)
    assert status == 2
    assert f"checkpoint '{tmp_path}' is a directory; give a file path" in err


# --------------------------------------------------------------------------- #
# Resuming from a damaged or foreign checkpoint
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def finished_checkpoint(tmp_path_factory):
    """The bytes of a real checkpoint (fedacnnl, LR: one layer) and the flags that wrote it."""
    out = tmp_path_factory.mktemp("checkpointed")
    flags = ["--algorithm", "fedacnnl", "--model", "lr", "--clients", "6", "--quiet"]
    assert main(["run", *flags, "--output", str(out)]) == 0
    return (out / "checkpoint.npz").read_bytes(), flags


def _flip_in_weights(content):
    """``content`` with one bit flipped inside the stored weights (not in the zip directory)."""
    data = bytearray(content)
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        info = archive.getinfo("w_0_0.npy")
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + 200
    data[offset] ^= 0x01
    return bytes(data)


def _rewrite_a_weight(content):
    """``content`` saved again, a valid archive, with one weight changed under the same state and digest."""
    with np.load(io.BytesIO(content)) as data:
        stored = {name: data[name] for name in data.files}
    stored["w_0_0"] = stored["w_0_0"].copy()
    stored["w_0_0"].flat[0] += 1.0
    out = io.BytesIO()
    np.savez(out, **stored)
    return out.getvalue()


@pytest.mark.parametrize("damage,message", [
    (lambda content: b"", "cannot be read"),
    (lambda content: content[: len(content) // 2], "cannot be read"),
    (_flip_in_weights, "cannot be read|is damaged"),
    (_rewrite_a_weight, "is damaged"),  # only the digest over the arrays' bytes can tell
])
def test_resume_from_a_damaged_checkpoint_says_how_to_start_over(tmp_path, capsys, finished_checkpoint,
                                                                 damage, message):
    content, flags = finished_checkpoint
    checkpoint = tmp_path / "checkpoint.npz"
    checkpoint.write_bytes(damage(content))
    status, err = fedlayer(["run", *flags, "--output", str(tmp_path), "--resume"], capsys)
    assert status == 2
    assert f"checkpoint {checkpoint}" in err
    assert any(word in err for word in message.split("|"))
    assert f"remove {checkpoint} to start over" in err
    assert "Traceback" not in err


def test_resume_from_a_foreign_file_says_what_it_is(tmp_path, capsys, finished_checkpoint):
    _, flags = finished_checkpoint
    np.savez(tmp_path / "checkpoint.npz", weights=np.ones(3))
    status, err = fedlayer(["run", *flags, "--output", str(tmp_path), "--resume"], capsys)
    assert status == 2
    assert "is not a fedlayer checkpoint (it holds ['weights'])" in err


def test_resume_error_leaves_no_traceback_on_the_console(tmp_path, finished_checkpoint):
    """The installed entry point's path: exit status 2, one line on stderr."""
    _, flags = finished_checkpoint
    (tmp_path / "checkpoint.npz").write_bytes(b"")
    done = subprocess.run([sys.executable, "-m", "fedlayer", "run", *flags, "--output", str(tmp_path), "--resume"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("fedlayer run: error: checkpoint") and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- #
# Values of the wrong type or range, from flags and config files
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("argv,message", [
    (["--latency-ms", "nan"], "argument --latency-ms: must be a finite number >= 0, got 'nan'"),
    (["--seed", "-1"], "argument --seed: must be an int >= 0, got '-1'"),
    (["--seed", "1.5"], "argument --seed: must be an int >= 0, got '1.5'"),
    (["--cores", "a,b"], "argument --cores: must be a list of 1 or more values, each an int >= 1, got 'a,b'"),
    (["--cores", "2,0"], "argument --cores: must be a list of 1 or more values, each an int >= 1, got '2,0'"),
    (["--mpi-deadline", "0"], "argument --mpi-deadline: must be a finite number > 0, got '0'"),
    (["--mpi-deadline", "-5"], "argument --mpi-deadline: must be a finite number > 0, got '-5'"),
    (["--mpi-deadline", "nan"], "argument --mpi-deadline: must be a finite number > 0, got 'nan'"),
    (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["--min-samples", "100000"], "fewer than min_samples=100000"),
    (["--algorithm", "baffle", "--hyper", "K=0"], "hyperparameter K must be an int >= 1, got 0"),
    (["--algorithm", "fedavg", "--hyper", "batch_size=2.5"], "hyperparameter batch_size must be an int >= 1"),
    (["--algorithm", "fedzo", "--hyper", "lr=-1"], "hyperparameter lr must be a finite number > 0, got -1"),
])
def test_bad_flag_values_name_the_flag(argv, message, capsys):
    status, err = fedlayer(["run", *SMALL, *argv], capsys)
    assert status == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("content,message", [
    ("[1]", "expected a JSON object of RunConfig keys, got list"),
    ('{"latency_ms": "1"}', "latency_ms must be a finite number >= 0, got '1'"),
    ('{"seed": 1.5}', "seed must be an int >= 0, got 1.5"),
    ('{"resume": "no", "output": "x"}', "resume must be true or false, got 'no'"),
    ('{"clients": true}', "clients must be an int >= 1, got True"),
    ('{"cores": [1, "2"]}', "cores must be None or a list of 1 or more values, each an int >= 1, got [1, '2']"),
    ('{"hyper": [1]}', "hyper must be None or a dict of hyperparameter names to numbers, got [1]"),
    ('{"seed": 1,}', "not valid JSON"),
])
def test_config_values_of_the_wrong_type_name_the_file_and_key(tmp_path, capsys, no_training, content, message):
    config = tmp_path / "run.json"
    config.write_text(content)
    status, err = fedlayer(["run", "--config", str(config), "--quiet"], capsys)
    assert status == 2
    assert f"config {config}: " in err and message in err


def test_missing_config_file_is_named(tmp_path, capsys):
    status, err = fedlayer(["run", "--config", str(tmp_path / "absent.json")], capsys)
    assert status == 2
    assert f"config {tmp_path / 'absent.json'}: cannot read it" in err


def test_argparse_errors_are_one_line_too(capsys):
    status, err = fedlayer(["run", "--clients", "0"], capsys)
    assert status == 2
    assert err == ("fedlayer run: error: argument --clients: must be an int >= 1, got '0' (`fedlayer run --help` "
                   "lists the options)\n")


def test_predict_names_a_file_that_is_not_a_model(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text('{"config": {}}')
    status, err = fedlayer(["predict", str(path)], capsys)
    assert status == 2
    assert f"{path} is not a fedlayer model file" in err


def _damage_model(path, change):
    """Rewrite the model file ``path`` with its arrays passed through ``change(dict) -> dict``."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    np.savez(path, **change(arrays))


def _without_first_weights(arrays):
    first = min(name for name in arrays if name.startswith("weights_"))
    return {name: a for name, a in arrays.items() if name != first}


def _nan_weights(arrays):
    name = max(name for name in arrays if name.startswith("weights_"))
    broken = arrays[name].copy()
    broken.flat[0] = np.nan
    return {**arrays, name: broken}


def _short_weights(arrays):
    name = min(name for name in arrays if name.startswith("weights_"))
    return {**arrays, name: arrays[name][:-1]}


@pytest.mark.parametrize("change,message", [
    (_without_first_weights, r"no weights stored for layer\(s\) \[\d+\]"),
    (_nan_weights, r"the weights of layer\(s\) \[\d+\] hold NaN or Inf"),
    (_short_weights, r"Dense\(.*\) on input \(60,\) expects weights of shape"),
])
def test_predict_names_a_damaged_model_file(tmp_path, capsys, change, message):
    from fedlayer.models import build_model

    model = build_model("dnn", (60,), 10)
    for i in model.trainable:
        shape = model.layers[i].ls_shape(model.input_shape_of(i))
        model.layers[i].set_weights(np.random.default_rng(i).standard_normal(shape))
    path = tmp_path / "model.npz"
    model.save(path, {"algorithm": "fedacnnl"})
    _damage_model(path, change)
    status, err = fedlayer(["predict", str(path)], capsys)
    assert status == 2
    assert re.search(f"{re.escape(str(path))}: {message}", err), err


def test_unknown_flags_are_named_by_the_subcommand(capsys):
    status, err = fedlayer(["run", "--bogus", "1"], capsys)
    assert status == 2
    assert err == "fedlayer run: error: unrecognized arguments: --bogus 1 (`fedlayer run --help` lists the options)\n"
    status, err = fedlayer(["plot", "results.json", "--bogus"], capsys)
    assert status == 2 and err.startswith("fedlayer plot: error: unrecognized arguments: --bogus")


def test_options_the_algorithm_ignores_get_a_note_and_the_run_goes_on(capsys, monkeypatch):
    from fedlayer import cli

    monkeypatch.setattr(run_module, "run", lambda config, **kwargs: {"stopped": "before training"})
    monkeypatch.setattr(cli, "_summary", lambda results: "")
    argv = ["run", "--clients", "12", "--algorithm", "fedacnnl", "--eps", "auto", "--groups", "3"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ("fedlayer run: note: eps applies to the personalizing algorithms (pfedacnnl, pfedacnnl-wc); "
            "'fedacnnl' ignores it") in err
    assert "note: groups applies to the grouping algorithms (pfedacnnl, pfedacnnl-wp)" in err
    assert main(["run", "--algorithm", "fedavg", "--model", "dnn", "--gamma", "auto"]) == 0
    assert "note: gamma applies to the analytic methods" in capsys.readouterr().err
    assert main(["run", "--algorithm", "fedzo", "--model", "dnn", "--round-accuracy", "codes"]) == 0
    assert "note: round_accuracy applies to the analytic methods" in capsys.readouterr().err
    assert main([*argv, "--quiet"]) == 0  # --quiet: no notes either
    assert capsys.readouterr().err == ""
    assert main(["run", "--clients", "12", "--algorithm", "pfedacnnl", "--eps", "auto", "--groups", "3"]) == 0
    assert "note" not in capsys.readouterr().err


def test_a_run_refused_while_loading_data_prints_one_line_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new" / "out"
    status, err = fedlayer(["run", "--dataset", "mnist", "--data-dir", str(tmp_path / "missing"),
                            "--output", str(out)], capsys)
    assert status == 2
    assert err.startswith("fedlayer run: error: mnist not found"), err  # no empty progress bar before it
    assert not (tmp_path / "new").exists()  # the folders the run created for its output are gone again


def test_a_checkpoint_without_output_is_said_to_be_written(tmp_path, capsys):
    checkpoint = tmp_path / "ck.npz"
    assert main(["run", "--clients", "12", "--groups", "3", "--model", "lr", "--checkpoint", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert checkpoint.exists()
    assert f"only the checkpoint {checkpoint} was written" in out and "nothing was written" not in out


def test_clients_of_more_cores_than_the_process_has_are_refused(capsys, no_training):
    """A 4-core client timed on 2 cores would describe another machine: refused before any work."""
    import fastls

    too_many = fastls.available_cores() + 1
    status, err = fedlayer(["run", *SMALL, "--cores", f"1,{too_many}"], capsys)
    assert status == 2
    assert f"a client of {too_many} cores" in err and f"at most {fastls.available_cores()}" in err


_CONFIG = {"algorithm": "fedacnnl", "dataset": "synthetic", "model": "dnn"}
_CLIENT = {"compute_s": 0.1, "idle_s": 0.0, "comm_s": 0.01}


def _results(**round_fields):
    record = {"stage": "federated", "layer": 0, "accuracy": 0.5, "clients": {"0": dict(_CLIENT)}, **round_fields}
    return json.dumps({"config": _CONFIG, "n_clients": 1, "rounds": {"1": record}})


@pytest.mark.parametrize("content,message", [
    ("not json", "not JSON"),
    ("[1, 2]", "it lacks ['config', 'n_clients', 'rounds']"),
    ('{"config": {}}', "it lacks ['n_clients', 'rounds']"),
    ('{"config": {}, "n_clients": 1, "rounds": {}}', "config must hold the strings algorithm, dataset and model"),
    (json.dumps({"config": _CONFIG, "n_clients": 1, "rounds": [1]}), "rounds must map round numbers to records"),
    (_results(clients=None), "round '1': clients must map client ids to their times"),
    (_results(accuracy="high"), "round '1': accuracy must be a fraction in [0, 1] or null, got 'high'"),
    (_results(layer="one"), "round '1': layer must be an integer or null"),
    (_results(clients={"0": {"compute_s": 0.1}}), "client '0': expected compute_s, idle_s and comm_s"),
])
def test_plot_names_a_file_that_is_not_a_results_json(tmp_path, capsys, content, message):
    path = tmp_path / "results.json"
    path.write_text(content)
    status, err = fedlayer(["plot", str(path)], capsys)
    assert status == 2
    assert f"{path} is not a fedlayer results.json" in err and message in err
    assert not list(tmp_path.glob("*.png"))


def test_plot_names_a_missing_file_and_an_out_that_is_a_file(tmp_path, capsys):
    status, err = fedlayer(["plot", str(tmp_path / "missing.json")], capsys)
    assert status == 2 and "missing.json: cannot read it (No such file or directory)" in err
    path, taken = tmp_path / "results.json", tmp_path / "afile"
    path.write_text(_results())
    taken.write_text("")
    status, err = fedlayer(["plot", str(path), "--out", str(taken)], capsys)
    assert status == 2 and "is a file; give a directory" in err
    assert main(["plot", str(path)]) == 0  # the same minimal file plots
    assert (tmp_path / "accuracy.png").exists()


def _ctrl_c_after(monkeypatch, what):
    """Make ``fedlayer run`` get a Ctrl-C when its progress first reports a message containing ``what``."""
    real_run = run_module.run

    def interrupted(config, transport=None, progress=None, dataset=None):
        def progress_then_ctrl_c(message):
            if what in message:
                raise KeyboardInterrupt

        return real_run(config, transport=transport, progress=progress_then_ctrl_c, dataset=dataset)

    monkeypatch.setattr(run_module, "run", interrupted)


def test_ctrl_c_says_where_the_trained_layers_are_and_how_to_go_on(tmp_path, capsys, monkeypatch):
    """A KeyboardInterrupt after the first layer: one line (no traceback), exit 130, a checkpoint to resume."""
    _ctrl_c_after(monkeypatch, "")
    out = tmp_path / "run"
    status, err = fedlayer(["run", *SMALL, "--algorithm", "fedacnnl", "--output", str(out)], capsys)
    assert status == 130
    assert err == (f"fedlayer run: interrupted; the layers trained so far are in {out / 'checkpoint.npz'}: run the "
                   f"same command with --resume to go on\n")
    monkeypatch.undo()
    assert main(["run", *SMALL, "--algorithm", "fedacnnl", "--output", str(out), "--resume"]) == 0
    assert json.loads((out / "results.json").read_text())["resumed_from_layer"] == 1


def test_resume_without_a_checkpoint_says_it_started_over(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["run", "--algorithm", "fedacnnl", "--clients", "6", "--model", "lr", "--output", str(out), "--resume"]
    assert main(flags) == 0
    assert f"--resume found no checkpoint at {out / 'checkpoint.npz'}" in capsys.readouterr().out
    assert main(flags) == 0
    assert "(resumed from the checkpoint after layer 1)" in capsys.readouterr().out


# --------------------------------------------------------------------------- #
# fedlayer predict: the split saved with the model
# --------------------------------------------------------------------------- #


def _predicted(argv, capsys):
    capsys.readouterr()
    assert main(["predict", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_uses_the_split_saved_with_the_model(tmp_path, capsys):
    out = tmp_path / "fed"
    flags = ["--clients", "9", "--seed", "3", "--train-fraction", "0.6", "--model", "lr"]
    assert main(["run", "--algorithm", "fedacnnl", *flags, "--output", str(out), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    report = _predicted([str(out / "model.npz")], capsys)
    assert report["split"]["clients"] == 9 and report["split"]["seed"] == 3
    assert report["split"]["train_fraction"] == 0.6
    assert report["accuracy"] == pytest.approx(results["accuracy"], abs=1e-12)
    # Another split would deal the model's training images into the test sets: refused.
    for flag, value in (("--seed", "4"), ("--clients", "12")):
        status, err = fedlayer(["predict", str(out / "model.npz"), flag, value], capsys)
        assert status == 2
        assert "model.npz was trained on the split with" in err and "images it was trained on" in err
        assert "another task" in err  # Synthetic: another seed draws another task
    assert _predicted([str(out / "model.npz"), "--seed", "3"], capsys)["split"]["seed"] == 3  # its own: fine
    status, err = fedlayer(["predict", str(out / "model.npz"), "--dataset", "mnist"], capsys)
    assert status == 2 and "another dataset's labels name other classes than synthetic's: omit --dataset" in err


def test_group_and_personalized_models_recompute_the_run_accuracy(tmp_path, capsys):
    out = tmp_path / "pfed"
    assert main(["run", "--algorithm", "pfedacnnl", *SMALL, "--model", "lr", "--output", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    personalized = sorted(p.name for p in (out / "personalized").glob("*.npz"))
    assert personalized == sorted(f"client{cid}.npz" for cid in range(12))
    report = _predicted([str(out / "personalized")], capsys)
    assert report["accuracy"] == pytest.approx(results["accuracy"], abs=1e-12)
    assert sum(m["clients"] for m in report["models"]) == 12

    # The group models, each on its own group's clients: the accuracy after the federated stage.
    federated = [r for r in results["rounds"].values() if r["stage"] == "federated"][-1]
    report = _predicted([str(out)], capsys)
    assert report["accuracy"] == pytest.approx(federated["accuracy"], abs=1e-12)

    status, err = fedlayer(["predict", str(out / "model_group0.npz"), "--clients", "20"], capsys)
    assert status == 2
    assert "model_group0.npz was trained on the split with clients=12" in err and "omit --clients" in err


def test_a_model_file_that_cannot_be_written_loses_no_measurements(tmp_path):
    """results.json is written before the models: a full disk at the end keeps the run's record."""
    from fedlayer.run import _write

    def full_disk(path):
        raise OSError(28, "No space left on device", str(path))

    results = {"accuracy": [0.5, 0.8], "wall_s": 1234.5}
    with pytest.raises(OSError, match="No space left on device"):
        _write(tmp_path / "run", results, {"personalized/client_0.npz": full_disk})
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results
    assert not (tmp_path / "run" / "results.json.tmp").exists()


def test_predict_scores_every_client_of_a_centralized_model(tmp_path, capsys):
    from fedlayer.run import RunConfig, load_dataset

    out = tmp_path / "acnnl"
    assert main(["run", "--algorithm", "acnnl", "--clients", "6", "--model", "lr", "--output", str(out),
                 "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    report = _predicted([str(out)], capsys)
    assert report["accuracy"] == pytest.approx(results["accuracy"], abs=1e-12)  # all 6 clients, not client 0
    split = load_dataset(RunConfig(clients=6, model="lr"))
    assert report["test_samples"] == sum(len(c.y_test) for c in split.clients)


def test_predict_refuses_model_files_left_by_another_run_in_the_folder(tmp_path, capsys):
    out = tmp_path / "reused"
    for algorithm in ("pfedacnnl-wp", "fedacnnl"):
        assert main(["run", "--algorithm", algorithm, *SMALL, "--model", "lr", "--output", str(out)]) == 0
    status, err = fedlayer(["predict", str(out)], capsys)
    assert status == 2
    assert "written by different algorithms" in err and "score them one at a time" in err


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy's, on the way to NaN
def test_a_baseline_that_diverges_stops_saying_so(capsys):
    status, err = fedlayer(["run", *SMALL, "--algorithm", "fedavg", "--rounds", "3", "--hyper", "lr=1e4"], capsys)
    assert status == 1
    assert "fedlayer run: error: fedavg diverged in round" in err and "lower the step sizes" in err
    assert "Traceback" not in err


def test_ctrl_c_while_personalizing_says_where_the_clients_layers_are(tmp_path, capsys, monkeypatch):
    _ctrl_c_after(monkeypatch, "personalized")
    out = tmp_path / "run"
    status, err = fedlayer(["run", *SMALL, "--algorithm", "pfedacnnl-wc", "--output", str(out)], capsys)
    assert status == 130
    assert err == (f"fedlayer run: interrupted; the layers trained so far are in {out / 'checkpoint.npz'} (and the "
                   f"layers personalized so far, each client's under {out / 'checkpoint.personal'}): run the same "
                   f"command with --resume to go on\n")
    monkeypatch.undo()
    assert main(["run", *SMALL, "--algorithm", "pfedacnnl-wc", "--output", str(out), "--resume", "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert (results["resumed_from_layer"], results["resumed_personalized"]) == (3, 1)
    assert "(resumed from the checkpoint after layer 3 and 1 personalized layer(s), read back by their clients)" \
        in _summary(results)
