"""Options built once from a run's configuration, and one construction path for the clients."""

import dataclasses

import numpy as np
import pytest

from fedlayer.algorithms import ALGORITHMS
from fedlayer.client import Client
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from fedlayer.run import RunConfig, build, load_dataset, make_clients
from fedlayer.secure_client import SecureClient


def test_server_options_copy_the_run_s_settings():
    config = RunConfig(gamma="auto", gamma_output=7.0, gamma_scope="group", eps=3.0, groups=4, seed=9, batch_size=16,
                       max_batch_size=32, eval_every=2, upload="targets")
    options = ServerOptions.from_config(config, weights_dtype=np.float32)
    assert options == ServerOptions(gamma="auto", gamma_output=7.0, gamma_scope="group", eps=3.0, groups=4, seed=9,
                                    batch=BatchPolicy(16, 32), eval_every=2, upload="targets",
                                    weights_dtype=np.float32)
    assert options.gamma_of(0, 3) == "auto" and options.gamma_of(2, 3) == 7.0
    assert options.weights_in == np.float32 and ServerOptions().weights_in == np.float64


def test_client_options_copy_the_run_s_settings(tmp_path):
    config = RunConfig(conv_targets="image", eps_criterion="loo_class", forward="batch", drop_clients=0.25,
                       round_deadline=2.0, h_noise=0.5, output=str(tmp_path))
    assert ClientOptions.from_config(config) == ClientOptions(
        conv_targets="image", eps_criterion="loo_class", forward="batch", drop_probability=0.25,
        round_deadline_s=2.0, h_noise=0.5, cache_dir=tmp_path / "activations")
    # The pooled client of the centralized reference neither fails nor adds noise.
    assert ClientOptions.from_config(config, centralized=True) == ClientOptions(
        conv_targets="image", eps_criterion="loo_class", forward="batch")


@pytest.mark.parametrize("make,message", [
    (lambda: ServerOptions(eval_every=0), "eval_every must be >= 1, got 0"),
    (lambda: ServerOptions(upload="both"), r"upload must be one of \('coordinates', 'targets'\), got 'both'"),
    (lambda: ServerOptions(gamma_scope="layer"), "gamma_scope must be one of"),
    (lambda: ClientOptions(forward="lazy"), r"forward must be one of \('cached', 'batch'\), got 'lazy'"),
    (lambda: ClientOptions(drop_probability=1.0), r"drop_probability must be in \[0, 1\), got 1.0"),
    (lambda: ClientOptions(h_noise=-1.0), "h_noise must be >= 0, got -1.0"),
    (lambda: BatchPolicy(65, 64).sizes([0]), r"client 0: need 1 <= batch_size \(65\) <= max_batch_size \(64\)"),
])
def test_an_option_out_of_range_is_named_when_the_options_are_built(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerOptions().gamma = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientOptions().h_noise = 1.0


def test_a_batch_policy_gives_each_client_its_sizes():
    assert BatchPolicy(8, 64).sizes([0, 1]) == ({0: 8, 1: 8}, {0: 64, 1: 64})
    assert BatchPolicy({0: 4, 1: 5}, 64).sizes([0, 1]) == ({0: 4, 1: 5}, {0: 64, 1: 64})


@pytest.mark.parametrize("algorithm,secure", [("acnnl", False), ("fedacnnl", False), ("fedacnnl", True)])
def test_every_analytic_client_is_built_by_its_algorithm(monkeypatch, algorithm, secure):
    """One construction path: the centralized reference's pooled client too; secure runs host the wrapper."""
    config = RunConfig(algorithm=algorithm, clients=4, secure=secure, min_group_size=2, h_noise=0.25)
    dataset = load_dataset(config)
    built = []
    make_client = type(ALGORITHMS[algorithm]).make_client

    def counting(self, cid, *args):
        built.append(cid)
        return make_client(self, cid, *args)

    monkeypatch.setattr(type(ALGORITHMS[algorithm]), "make_client", counting)
    clients = make_clients(config, dataset, build(config, dataset).config())
    assert built == [c.client_id for c in clients] == ([0] if algorithm == "acnnl" else [0, 1, 2, 3])
    assert all(isinstance(c, SecureClient) == secure for c in clients)
    inner = [c.client if secure else c for c in clients]
    assert all(type(c) is Client for c in inner)
    assert [c.h_noise for c in inner] == [0.0 if algorithm == "acnnl" else 0.25] * len(inner)
