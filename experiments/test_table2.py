"""The Table 2 script: round budgets, merging split runs, the rendered table."""

import json

import pytest

import table2


def test_budget_entries_narrow_from_all_to_one_cell():
    budget = table2.parse_budget(["30", "pfedzo=4", "pfedzo:mnist-dnn=1"])
    assert budget[("synthetic-lr", "pfedme")] == 30
    assert budget[("mnist-lr", "pfedzo")] == 4
    assert budget[("mnist-dnn", "pfedzo")] == 1
    assert table2.parse_budget([])[("mnist-dnn", "pfedme")] == table2.PAPER_ROUNDS
    with pytest.raises(SystemExit, match="unknown baseline 'fedavg'"):
        table2.parse_budget(["fedavg=3"])
    with pytest.raises(SystemExit, match="unknown setting 'cifar-dnn'"):
        table2.parse_budget(["pfedme:cifar-dnn=3"])


def test_curve_trend_compares_halves_of_the_budget():
    rising = [[1, 50.0], [2, 60.0], [3, 70.0], [4, 80.0]]
    flat = [[1, 70.0], [2, 71.0], [3, 71.0], [4, 70.5]]
    assert table2.curve_trend([rising]) == (60.0, 80.0)
    assert table2.curve_trend([rising, flat]) == (65.5, 75.5)
    assert table2.curve_trend([[[1, 42.0]]]) == (42.0, 42.0)


def test_one_seed_of_several_prints_no_std():
    """A cell with one seed so far says so and prints "-" for its std, and so does its paired margin."""
    cells = {"synthetic-dnn-pfedzo": {"accuracy": [86.19], "curves": [[[1, 80.0], [2, 86.19]]], "minutes": [1.0],
                                      "rounds": 2},
             "synthetic-dnn-pfedacnnl": {"accuracy": [89.59, 91.0, 92.0], "curves": [], "minutes": [1.0] * 3}}
    report = table2.render([], cells, 3, "cmd")
    assert "86.19 (-, 2 rounds, 1 seed) [89.05]" in report
    assert "| synthetic-dnn | pfedzo | 2 |" in report and "| +3.40 (-) |" in report
    assert "90.86 (0.99) [90.00]" in report


def test_split_runs_merge_into_one_table(tmp_path):
    """Two short runs on disjoint cells, merged: every cell and both commands appear, nothing runs twice."""
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    # The baselines' checkpoints in tmp_path: experiments/checkpoints holds the real runs' cells in progress.
    common = ["--seeds", "1", "--settings", "synthetic-lr", "--cores", "1", "--out", str(tmp_path / "t.md"),
              "--checkpoints", str(tmp_path / "checkpoints")]
    assert table2.main([*common, "--algorithms", "fedacnnl", "--json", str(first)]) == 0
    assert table2.main([*common, "--algorithms", "pfedme", "--baseline-rounds", "2", "--json", str(second)]) == 0
    assert table2.main([*common, "--algorithms", "fedacnnl", "pfedme", "--merge", str(first), str(second),
                        "--json", str(tmp_path / "merged.json"), "--plot", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [run["cells"] for run in merged["runs"]] == [["synthetic-lr-fedacnnl"], ["synthetic-lr-pfedme"]]
    pfedme = merged["cells"]["synthetic-lr-pfedme"]
    assert pfedme["rounds"] == 2 and [r for r, _ in pfedme["curves"][0]] == [1, 2]
    assert pfedme["accuracy"][0] == max(acc for _, acc in pfedme["curves"][0])
    assert 10.0 < merged["cells"]["synthetic-lr-fedacnnl"]["accuracy"][0] <= 100.0
    report = (tmp_path / "t.md").read_text()
    assert "| synthetic-lr | pfedme | 2 |" in report
    assert "not run [96.92]" in report  # mnist-dnn pfedme was not asked for
    assert report.count("python experiments/table2.py") == 3  # the two runs, then the merge that wrote the file
    assert "This file: `python experiments/table2.py --seeds 1" in report
    with pytest.raises(SystemExit, match="merged seeds ran 2 rounds, this run's budget is 3"):
        table2.main([*common[:1], "2", *common[2:], "--algorithms", "pfedme", "--baseline-rounds", "3",
                     "--merge", str(second)])
    with pytest.raises(SystemExit, match="also in an earlier --merge file"):
        table2.main([*common, "--merge", str(first), str(first)])
    # A longer budget's cell replaces the merged one, and the run that made the old one leaves the list.
    longer = tmp_path / "longer.json"
    assert table2.main([*common, "--algorithms", "pfedme", "--baseline-rounds", "3", "--json", str(longer)]) == 0
    assert table2.main([*common, "--algorithms", "fedacnnl", "--merge", str(tmp_path / "merged.json"),
                        "--replace", str(longer)]) == 0
    report = (tmp_path / "t.md").read_text()
    assert "| synthetic-lr | pfedme | 3 |" in report and "| synthetic-lr | pfedme | 2 |" not in report
    assert "--baseline-rounds 3" in report and "--baseline-rounds 2" not in report


def test_the_same_command_again_keeps_its_cells_and_runs_only_the_missing(tmp_path, monkeypatch):
    """An interrupted run's --json file is its memory: running the command again adds seeds, never reruns them."""
    out = tmp_path / "cells.json"
    common = ["--settings", "synthetic-lr", "--cores", "1", "--out", str(tmp_path / "t.md"), "--algorithms",
              "pfedme", "--baseline-rounds", "2", "--checkpoints", str(tmp_path / "checkpoints"), "--json", str(out)]
    assert table2.main(["--seeds", "1", *common]) == 0
    first = json.loads(out.read_text())["cells"]["synthetic-lr-pfedme"]
    ran = []
    real_run = table2.run
    monkeypatch.setattr(table2, "run", lambda config, **kw: ran.append(config.seed) or real_run(config, **kw))
    assert table2.main(["--seeds", "2", *common]) == 0
    assert ran == [1]
    again = json.loads(out.read_text())
    cell = again["cells"]["synthetic-lr-pfedme"]
    assert cell["accuracy"][0] == first["accuracy"][0] and len(cell["accuracy"]) == 2
    assert [run["cells"] for run in again["runs"]] == [["synthetic-lr-pfedme"], ["synthetic-lr-pfedme"]]
    # Named in --merge as well, the file is read once, not refused as a duplicate.
    assert table2.main(["--seeds", "2", *common, "--merge", str(out)]) == 0
    assert ran == [1]


def test_progress_lists_seeds_so_far_and_cells_in_progress_without_running(tmp_path, monkeypatch, capsys):
    out, checkpoints = tmp_path / "cells.json", tmp_path / "checkpoints"
    common = ["--settings", "synthetic-lr", "--cores", "1", "--out", str(tmp_path / "t.md"), "--baseline-rounds",
              "2", "--checkpoints", str(checkpoints)]
    assert table2.main(["--seeds", "1", *common, "--algorithms", "pfedme", "--json", str(out)]) == 0
    capsys.readouterr()
    # Without --json a finished cell keeps its checkpoint: the listing reads it as a cell in progress.
    assert table2.main(["--seeds", "1", *common, "--algorithms", "pfedzo"]) == 0
    best_pfedzo = next(line.split(": ")[1].split()[0] for line in capsys.readouterr().out.splitlines()
                       if line.startswith("synthetic-lr pfedzo seed 0: "))
    pfedme = json.loads(out.read_text())["cells"]["synthetic-lr-pfedme"]

    monkeypatch.setattr(table2, "run", lambda config, **kw: pytest.fail("--progress ran a cell"))
    assert table2.main(["--progress", "--seeds", "2", *common, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"- synthetic-lr-pfedme: {pfedme['accuracy'][0]:.2f} "
                        f"(1 of 2 seeds; {pfedme['minutes'][0]:.0f} min in all)")
    assert lines[1:] == [f"- in progress: `synthetic-lr-pfedzo-seed0.npz`, 2 rounds done, best so far {best_pfedzo}"]
    # All seeds in: the mean and std over seeds, as the table gives them ("-" for the std of one seed).
    assert table2.main(["--progress", "--seeds", "1", *common, "--json", str(out)]) == 0
    assert f"(1 of 1 seeds; mean {pfedme['accuracy'][0]:.2f} (std -);" in capsys.readouterr().out
