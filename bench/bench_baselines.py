"""One round of each baseline on MNIST-shaped clients, per engine (pytest-benchmark).

With ``--benchmark-enable`` a case is a whole round of the paper's MNIST-DNN
setting (100 clients of the MNIST partition's sizes, the default
hyperparameters) on the batched engine; the per-client engine's rounds take
minutes (pFedZO: about 8), so ``bench/baselines_report.py`` times those and
prints the ratios. In the test suite (benchmarks disabled) every case runs
once on 4 small clients and one local epoch, and checks that both engines
return the same parameters.
"""

import numpy as np
import pytest

from baseline_cases import ALGORITHMS, client_sizes, hyper_of, make_clients, round_runner


@pytest.fixture(scope="module")
def full_size(request):
    return bool(request.config.getoption("benchmark_enable", False))


def _small_hyper(algorithm):
    small = {"local_epochs": 1, "local_iters": 2, "K": 2 if algorithm != "baffle" else 5, "b2": 3}
    return hyper_of(algorithm, **{k: v for k, v in small.items() if k in hyper_of(algorithm)})


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_round_batched(benchmark, full_size, algorithm):
    sizes = client_sizes() if full_size else [30, 21, 9, 64]
    hyper = hyper_of(algorithm) if full_size else _small_hyper(algorithm)
    benchmark.group = f"{algorithm} round, MNIST-DNN"
    batched = round_runner(make_clients(sizes, cores=2), algorithm, "batched", hyper, cores=2)
    results = benchmark.pedantic(batched, rounds=3 if full_size else 1, iterations=1)
    if not full_size:
        reference = round_runner(make_clients(sizes), algorithm, "per-client", hyper, cores=1)()
        for mine, theirs in zip(results, reference):
            assert np.array_equal(mine["params"], theirs["params"]) or \
                np.abs(mine["params"] - theirs["params"]).max() <= 1e-10 * np.abs(theirs["params"]).max()
