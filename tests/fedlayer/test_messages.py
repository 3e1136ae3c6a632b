"""The messages between server and clients: the method enum, the client protocol, requests, replies, dropouts."""

import copy
import pickle

import numpy as np
import pytest

from fedlayer.client import Client, ClientDropout
from fedlayer.messages import (ClientMethod, ClientProtocol, Dropout, EvaluateReply, PersonalizeReply,
                               PersonalizeRequest, StatsReceipt, StatsRequest)
from fedlayer.secure_client import SecureClient
from fedlayer.transport import InProcessTransport
from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, make_data


@pytest.fixture
def client(rng):
    x, y = make_data(rng, n=40)
    return Client(0, client_data(x, y, np.arange(40)), dnn_config(12), seed=0, n_classes=N_CLASSES)


def test_every_client_method_is_a_method_of_the_hosted_object_by_its_value(client):
    """The transports (the MPI worker too) run ``getattr(client, method)``: the enum's values are the names."""
    secure = SecureClient(client)
    for method in ClientMethod:
        assert isinstance(method, str) and method == method.value
        assert callable(getattr(secure, method))
        assert callable(getattr(client, method, None)) == (not method.startswith("secure_"))
    assert pickle.loads(pickle.dumps(ClientMethod.LOCAL_STATS)) is ClientMethod.LOCAL_STATS


def test_clients_and_their_secure_wrappers_follow_the_client_protocol(client):
    assert isinstance(client, ClientProtocol)
    assert isinstance(SecureClient(client), ClientProtocol)
    assert not isinstance(object(), ClientProtocol)


def test_the_secure_wrapper_is_the_client_plus_the_secure_steps(client):
    secure = SecureClient(client)
    assert secure.client_id == client.client_id and secure.model is client.model and secure.state is None
    assert not hasattr(client, "secure_keys") and not hasattr(client, "_secure")
    assert "public" in secure.secure_keys(min_survivors=2) and secure.state is not None
    np.testing.assert_array_equal(secure.local_stats(0, 16)["G"], client.local_stats(0, 16)["G"])
    copy.copy(secure)  # a copy is built without the wrapped client first: no endless lookup


def test_a_dropout_records_the_exception_and_the_step_without_a_string_to_parse():
    dropout = Dropout.from_error(ClientDropout("client 3: simulated failure in layer 2"), ClientMethod.LOCAL_STATS)
    assert (dropout.error_type, dropout.method, dropout.step) == ("ClientDropout", "local_stats", None)
    assert dropout.kind == "ClientDropout"
    assert str(dropout) == "ClientDropout: client 3: simulated failure in layer 2"
    in_step = dropout.in_step("secure_upload")
    assert in_step.kind == "secure_upload" and in_step.error_type == "ClientDropout"
    assert str(in_step) == "secure_upload: ClientDropout: client 3: simulated failure in layer 2"
    decided = Dropout("reported by client 6: bad share", step="secure_self_mask")
    assert decided.error_type is None and str(decided) == "secure_self_mask: reported by client 6: bad share"
    assert pickle.loads(pickle.dumps(in_step)) == in_step  # as an MPI rank sends it


def test_a_dropout_in_a_sum_arrives_as_a_record(client):
    class Failing(SecureClient):
        def local_stats(self, *args, **kwargs):
            raise OSError("disk full")

    outcome = InProcessTransport([Failing(client)]).sum(ClientMethod.LOCAL_STATS, {0: StatsRequest(0, 8).kwargs()},
                                                         ("G", "C"))
    assert outcome.dropped == {0: Dropout("disk full", "OSError", "local_stats")}


def test_requests_send_only_the_flags_set_and_run_as_keyword_arguments(client):
    assert StatsRequest(1, 8, 1).kwargs() == {"position": 1, "batch_size": 8, "round_index": 1}
    kwargs = StatsRequest(0, 8, target_moments=True).kwargs()
    assert kwargs == {"position": 0, "batch_size": 8, "round_index": 0, "target_moments": True}
    result = client.local_stats(**kwargs)
    assert StatsReceipt.from_result({k: v for k, v in result.items() if k not in ("G", "C", "zz", "rows")}).n == 40
    assert PersonalizeRequest(0, 10.0, 64, private=True).kwargs() == {"position": 0, "eps": 10.0, "batch_size": 64,
                                                                      "private": True}
    assert "private" not in PersonalizeRequest(0, 10.0, 64).kwargs()


def test_replies_are_read_from_what_the_clients_return(client):
    assert EvaluateReply.from_result(client.evaluate()).total == 5
    chosen = PersonalizeReply.from_result({"compute_s": 0.1, "eps": 3, "method": "loo"})
    assert chosen.choice() == {"eps": 3.0, "criterion": "loo"}
    assert PersonalizeReply.from_result({"compute_s": 0.1, "form": "dual"}).choice() == {"form": "dual"}
    assert PersonalizeReply.from_result({"compute_s": 0.1}).choice() == {}
