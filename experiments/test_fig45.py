"""The Fig. 4/5 script's account of where the idle time goes."""

import pytest

import fig45


def test_round_one_bound_is_round_one_share_and_later_ratio():
    # Two seeds, three rounds of mean idle seconds per client.
    adaptive = [[0.03, 0.01, 0.01], [0.02, 0.004, 0.006]]
    fixed = [[0.03, 0.02, 0.03], [0.02, 0.02, 0.01]]
    (line,) = fig45.round_one_bound(adaptive, fixed)
    floor = [0.03 / 0.08, 0.02 / 0.05]
    later = [0.02 / 0.05, 0.01 / 0.03]
    assert f"is {sum(floor) / 2:.2f} of FedACnnL-WA's idle time" in line
    assert f"FedACnnL / -WA is {sum(later) / 2:.2f}." in line


def test_round_one_bound_per_seed_format():
    seeds_text = []

    def over_seeds(values, digits=2):
        seeds_text.append(values)
        return " / ".join(f"{v:.{digits}f}" for v in values)

    (line,) = fig45.round_one_bound([[1.0, 1.0], [2.0, 0.0]], [[2.0, 2.0], [2.0, 2.0]], over_seeds)
    assert seeds_text == [pytest.approx([0.25, 0.5]), pytest.approx([0.5, 0.0])]
    assert "is 0.25 / 0.50 of" in line and "is 0.50 / 0.00." in line


def test_baselines_report_the_batched_runs_accuracy_and_curve():
    timed = {"accuracy": 0.5, "rounds": {"1": {"accuracy": 0.4}, "2": {"accuracy": None}, "3": {"accuracy": 0.5}}}
    assert fig45.final_accuracy(timed) == 0.5
    assert fig45.accuracy_curve(timed) == [(1, 0.4), (3, 0.5)]
    timed["accuracy_run"] = {"engine": "batched", "rounds": 600, "accuracy": 0.8, "curve": [[6, 0.6], [600, 0.8]]}
    assert fig45.final_accuracy(timed) == 0.8
    assert fig45.accuracy_curve(timed) == [(6, 0.6), (600, 0.8)]


def _fake_run(accuracy, compute, idle, n_rounds=2, accuracy_run=None):
    clients = {"0": {"compute_s": compute, "idle_s": idle, "comm_s": 0.001},
               "1": {"compute_s": compute, "idle_s": 0.0, "comm_s": 0.001}}
    results = {"accuracy": accuracy,
               "rounds": {str(k): {"accuracy": accuracy, "clients": clients} for k in range(1, n_rounds + 1)},
               "time_per_client": {"compute_s": compute * n_rounds, "idle_s": idle * n_rounds / 2,
                                   "comm_s": 0.002 * n_rounds, "total_s": (compute + idle / 2 + 0.002) * n_rounds}}
    if accuracy_run:
        results["accuracy_run"] = accuracy_run
    return results


def test_the_report_names_the_batched_accuracy_and_the_timed_rounds():
    import argparse

    args = argparse.Namespace(dataset="synthetic", budget=["2"], algorithms=["fedacnnl", "fedacnnl-wa", "fedavg"],
                              forward="batch", tag="")
    batched = {"engine": "batched", "rounds": 600, "accuracy": 0.81, "curve": [[6, 0.7], [600, 0.81]]}
    by_seed = {0: {"fedacnnl": _fake_run(0.86, 0.01, 0.002), "fedacnnl-wa": _fake_run(0.86, 0.01, 0.004),
                   "fedavg": _fake_run(0.75, 0.5, 0.1, accuracy_run=batched)}}
    text = "\n".join(fig45.render(by_seed, args, {"fedavg": 2, "fedzo": 600, "baffle": 600}, 600))
    assert "Baselines timed over: fedavg 2 rounds (paper: 600)" in text
    assert "Accuracy of the baselines: the batched engine over the paper's budget" in text
    assert "| fedavg | 2 | 81.00 |" in text  # the batched run's accuracy after 600 rounds, not the timed 75 %
    assert "| fedacnnl | 2 | 86.00 |" in text
    assert "| total time of fedavg (at 600 rounds) |" in text


def test_accuracy_only_leaves_checkpoints_the_timed_run_resumes(tmp_path, monkeypatch, capsys):
    """--accuracy-only runs the batched accuracy runs and keeps their checkpoints; run again, it resumes them."""
    monkeypatch.setitem(fig45.PAPER_ROUNDS, "synthetic", 2)
    argv = ["--dataset", "synthetic", "--algorithms", "fedavg", "fedacnnl", "--accuracy-only",
            "--checkpoints", str(tmp_path), "--out", str(tmp_path / "out")]
    assert fig45.main(argv) == 0
    first = capsys.readouterr().out
    assert "seed 0 fedavg: accuracy after 2 rounds" in first and "fedacnnl" not in first
    checkpoint = tmp_path / "fig45-synthetic-fedavg-seed0.npz"
    assert checkpoint.exists() and not (tmp_path / "out" / "fig45_synthetic.md").exists()
    ran = []
    real_run = fig45.run
    monkeypatch.setattr(fig45, "run", lambda config, **kw: ran.append(config.resume) or real_run(config, **kw))
    assert fig45.main(argv) == 0
    assert capsys.readouterr().out == first and ran == [True]
