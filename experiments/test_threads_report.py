"""The thread report's reading of a grid cell."""

import json

import pytest

import threads_report


def _record(threads, one, two, chosen):
    return {"kind": "cross", "dtype": "float32", "d": 33, "rows": 256, "flops": 2e6, "threads": threads,
            "runs": {"one": one, "two": two, "chosen": chosen}}


def test_pooled_ratio_does_not_flag_a_lucky_run_of_the_same_calls():
    # The rule chose 2 threads: "two" and "chosen" are one code path. One fast "two" run is not a loss.
    record = _record(2, one=[2.0, 2.0], two=[1.065, 1.42, 1.43], chosen=[1.41, 1.42])
    threads_report.summarize(record, "min")
    assert threads_report.ratio(record) == pytest.approx(1.41 / 1.065)
    assert threads_report.pooled_ratio(record) == 1.0


def test_pooled_ratio_flags_the_slower_thread_count():
    # The rule chose 2 threads where 1 is faster on every run: a real loss, pooled or not.
    record = _record(2, one=[0.042, 0.043], two=[0.052, 0.051], chosen=[0.053, 0.052])
    assert threads_report.pooled_ratio(record) == pytest.approx(0.051 / 0.042)
    record = _record(1, one=[0.050, 0.049], two=[0.041, 0.042], chosen=[0.048])
    assert threads_report.pooled_ratio(record) == pytest.approx(0.048 / 0.041)


def test_a_saved_grid_is_rendered_without_measuring(tmp_path, monkeypatch, capsys):
    records = [_record(2, one=[2.0], two=[1.0], chosen=[1.0]), _record(2, one=[1.0], two=[1.2], chosen=[1.25])]
    for r in records:
        threads_report.summarize(r, "min")
    saved = tmp_path / "grid.json"
    saved.write_text(json.dumps({"flops_per_thread": 1e4, "records": records}))
    monkeypatch.setattr(threads_report, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr("sys.argv", ["threads_report.py", "--from-json", str(saved), "--kinds", "cross",
                                     "--out", str(tmp_path / "report.md")])
    threads_report.main()
    text = (tmp_path / "report.md").read_text()
    assert "1 of 2 cases above 1.10" in text
    assert "**Same calls pooled**" in text and "cross float32 d=33 rows=256 2t 1.20" in text
