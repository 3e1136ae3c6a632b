"""Fig. 6's report and runs: which clients personalized in the dual, and the 'same' DCNN through the server's dual
solve (no data needed)."""

import dataclasses
import time
from types import SimpleNamespace

import numpy as np

from fedlayer.client import personalization_costs, target_bases
from fedlayer.data import ClientData, FederatedDataset
from fedlayer.models import build_model
from fedlayer.run import run
from fig6_cifar import (PeakDisk, _readout_note, allocated_bytes, config_for, dual_ids, dual_server_note,
                        factored_upload_flops)


def test_dual_clients_follow_the_recorded_form_else_the_clients_cost_rule():
    model = build_model("dcnn", (32, 32, 3), 10, width=1 / 64, dtype=np.dtype("float32"))
    bases = target_bases(model, seed=0, conv_targets="position")
    samples = [3, 400, 2000]
    dataset = SimpleNamespace(clients=[SimpleNamespace(n_train=n) for n in samples])
    position = len(model.trainable) - 1  # the classifier: 2 * 2 * 32 + 1 inputs
    index = model.trainable[position]
    layer, shape = model.layers[index], model.input_shape_of(index)
    rule = {}
    for cid, n in enumerate(samples):
        costs = personalization_costs(layer, shape, n, bases[position])
        rule[str(cid)] = "dual" if costs["dual"] < costs["primal"] else "primal"
    assert rule == {"0": "dual", "1": "primal", "2": "primal"}  # only the few-row client
    unrecorded = {"clients": {cid: {"compute_s": 1.0} for cid in rule}}
    assert dual_ids(unrecorded, model, position, dataset, bases[position]) == ["0"]
    recorded = {"clients": {"0": {"form": "primal"}, "1": {"form": "dual"}, "2": {}}}
    assert dual_ids(recorded, model, position, dataset, bases[position]) == ["1"]


def _fake_cifar(rng, n_clients=3, n_train=10, n_test=4):
    def client():
        return ClientData(x_train=rng.random((n_train, 32, 32, 3), dtype=np.float32),
                          y_train=rng.integers(0, 10, n_train),
                          x_test=rng.random((n_test, 32, 32, 3), dtype=np.float32),
                          y_test=rng.integers(0, 10, n_test))
    return FederatedDataset("cifar10", 10, (32, 32, 3), [client() for _ in range(n_clients)])


def test_same_padding_runs_its_classifier_through_the_dual_at_a_server_memory_it_exceeds(tmp_path):
    """At width 1/64 the 'same' classifier's Gram is 2,049^2 (34 MB): with 2 MiB for the server it is solved in
    the dual, the convolutions in the primal, and the weights are the primal run's."""
    dataset = _fake_cifar(np.random.default_rng(0))
    args = SimpleNamespace(width=1 / 64, padding="same", seed=0, conv_targets="position", server_solve="auto",
                           server_memory=2.0 ** -9, round_accuracy="codes", eps_output=None)
    config = dataclasses.replace(config_for("fedacnnl", args, output=str(tmp_path / "dual")), clients=3)
    assert (config.server_solve, config.server_memory, config.padding) == ("auto", 2.0 ** -9, "same")
    dual = run(config, dataset=dataset)
    primal = run(dataclasses.replace(config, server_solve="primal", output=None), dataset=dataset)
    forms = [r.get("solve", {"form": "primal"})["form"] for r in dual["rounds"].values()]
    assert forms == ["primal"] * 4 + ["dual"]
    # The convolutions' rounds score their label codes, the classifier's the network.
    assert [r.get("accuracy_of") for r in dual["rounds"].values()] == ["codes"] * 4 + [None]
    for W_dual, W_primal in zip(dual["group_weights"][0], primal["group_weights"][0]):
        assert np.linalg.norm(W_dual - W_primal) <= 1e-5 * np.linalg.norm(W_primal)
    record = list(dual["rounds"].values())[-1]
    rows = sum(len(c.y_train) for c in dataset.clients[:3])
    note = dual_server_note(record, 4, rate=1e9, rate64=5e8)
    assert note.startswith(f"layer 5 was solved by the server in the dual over a group's N = {rows:,} rows (stacked ")
    # float32 rows: K from float32 products (the float32 rate), refined in float64 passes over F.
    assert f"{record['solve']['flops']['dual'] / 1e9:.0f} s at the float32 gemm rate" in note
    passes = record["solve"]["refinement"]["0"]["iterations"]
    assert f"refined against float64 products with F in {passes} pass(es)" in note
    unrefined = {**record, "solve": {k: v for k, v in record["solve"].items() if k != "refinement"}}
    assert f"{record['solve']['flops']['dual'] / 5e8:.0f} s at the float64 gemm rate" in dual_server_note(
        unrefined, 4, rate=1e9, rate64=5e8)


def test_the_floor_of_a_factored_upload_is_the_rotation_times_the_rows():
    model = build_model("dcnn", (32, 32, 3), 10, width=1 / 64, padding="same")
    classifier = len(model.trainable) - 1  # one row per image, 8 * 8 * 32 + 1 inputs
    assert factored_upload_flops(model, classifier, [3, 5]) == sum(2.0 * n * n * 2049 + 4.0 / 3.0 * n ** 3
                                                                  for n in (3, 5))


def test_the_peak_disk_counts_a_file_that_came_and_went_while_sampled(tmp_path):
    with PeakDisk(tmp_path, period_s=0.01) as disk:
        big = tmp_path / "cache" / "activations.npy"
        big.parent.mkdir()
        big.write_bytes(np.random.default_rng(0).bytes(3_000_000))
        deadline = time.monotonic() + 30
        while disk.peak < 3_000_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        big.unlink()
    assert 3_000_000 <= disk.peak < 3_100_000
    assert allocated_bytes(tmp_path) < 100_000


def test_the_report_says_which_runs_scored_rounds_1_to_4_by_their_label_codes():
    def rounds(*marks):
        return {"rounds": {str(i + 1): ({"accuracy_of": m} if m else {}) for i, m in enumerate(marks)}}

    network, codes = rounds(None, None, None, None, None), rounds("codes", "codes", "codes", "codes", None)
    assert _readout_note({"fedacnnl": network, "pfedacnnl": network}) == ""
    assert "rounds 1-4 score the layer just trained by its label codes" in _readout_note({"fedacnnl": codes})
    mixed = _readout_note({"fedacnnl": codes, "pfedacnnl-wc": network})
    assert "rounds 1-4 of fedacnnl score" in mixed and "those of the others the network" in mixed
