"""Fig. 6's report: which clients solved a personalization round in the dual (no data needed)."""

from types import SimpleNamespace

import numpy as np

from fedlayer.client import personalization_costs, target_bases
from fedlayer.models import build_model
from fig6_cifar import dual_ids


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
