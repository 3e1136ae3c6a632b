"""The MNIST equality script of the two baseline engines, at a tiny size."""

import pytest

import engine_equality


def test_engine_equality_reports_equal_parameters_on_mnist(tmp_path, capsys):
    out = tmp_path / "equality.md"
    try:
        engine_equality.main(["--clients", "3", "--rounds", "1", "--models", "lr", "--algorithms", "fedavg",
                              "pfedzo", "--out", str(out)])
    except FileNotFoundError as error:
        pytest.skip(f"real MNIST files not found (set FEDLAYER_DATA_DIR to enable). {error}")
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| lr |")]
    assert [row[2].strip() for row in rows] == ["fedavg", "pfedzo"]
    assert all(float(row[3]) <= 1e-10 for row in rows)
