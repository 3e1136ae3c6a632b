"""FedACnnL end to end: per-round and total time, against the round's flop floor.

    python -m pytest bench/bench_fedacnnl.py --benchmark-enable -s

Each round's client computation is at least its flops: the Gram N d_{l-1}^2
(d including the bias), the cross term 2 N d_{l-1} d_l and the forward pass
through the earlier layers, 2 N d_in d_out each. The floor is that count at
the better of the 1- and 2-thread syrk rates measured in the same run at the
first layer's width (clients here have 1 or 2 cores). MNIST cases skip when the data files are absent.
"""

import time

import numpy as np
import pytest

import fastls
from fedlayer.run import RunConfig, load_dataset, run


def syrk_rate(d, threads):
    """GFLOP/s of fastls.gram_update (float64) at width d, measured now."""
    X = np.random.default_rng(0).standard_normal((20000, d))
    G = np.zeros((d, d))
    with fastls.limit_cores(threads):
        best = min(_timed(fastls.gram_update, G, X) for _ in range(3))
    return 20000 * d * d / best / 1e9


def _timed(fn, *args):
    start = time.perf_counter()
    fn(*args, check_finite=False)
    return time.perf_counter() - start


@pytest.mark.parametrize("dataset", ["synthetic", "mnist"])
def test_fedacnnl_dnn_100_clients(benchmark, dataset):
    config = RunConfig(algorithm="fedacnnl", dataset=dataset, model="dnn", clients=100)
    try:
        data = load_dataset(config)
    except FileNotFoundError as err:
        pytest.skip(f"{dataset} data not found: {str(err).splitlines()[0]}")
    benchmark.group = f"fedacnnl {dataset}-dnn 100 clients"
    results = benchmark.pedantic(run, args=(config,), kwargs={"dataset": data}, rounds=1, iterations=1)
    n_total = sum(c.n_train for c in data.clients)
    widths = [int(np.prod(data.feature_shape)) + 1, 129, 65]
    outputs = [128, 64, data.n_classes]
    rates = {threads: syrk_rate(widths[0], threads) for threads in (1, 2)}
    report = []
    for position, ((key, record), d) in enumerate(zip(results["rounds"].items(), widths)):
        compute = sum(c["compute_s"] for c in record["clients"].values())
        flops = n_total * (d * d + 2 * d * outputs[position]
                           + sum(2 * widths[p] * outputs[p] for p in range(position)))
        floor = flops / (max(rates.values()) * 1e9)
        report.append({"round": key, "layer_inputs": d, "sum_compute_s": compute, "floor_s": floor,
                       "ratio": compute / floor, "max_idle_s": max(c["idle_s"] for c in record["clients"].values())})
    benchmark.extra_info.update({"rounds": report, "syrk_gflops": rates, "time_per_client": results["time_per_client"]})
    for row in report:
        print(row)
    print("syrk GFLOP/s", rates, "time per client", results["time_per_client"])
    assert results["accuracy"] > 0.6
    assert len(report) == 3 and all(row["ratio"] > 0 for row in report)
