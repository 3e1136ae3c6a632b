"""Secure sums: fixed point, Shamir, the SecAgg+ graph, the masking protocol, and what the server can see."""

import os

import numpy as np
import pytest

from fedlayer.client import Client
from fedlayer.server import EXCLUDED, VARIANTS, ModelLayers, merge_small_groups, run_protocol
from fedlayer.secure import (
    _CHUNK_WORDS,
    FixedPoint,
    SecureAggregationError,
    SecureClientState,
    SecureServer,
    choose_contributors,
    close_pairs,
    components,
    fraction_bits,
    keystream_words,
    magnitude_exponent,
    neighbour_graph,
    shamir_combine,
    shamir_split,
    threshold,
)
from fedlayer.transport import InProcessTransport, pack_upper, unpack_upper
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from fedlayer.checkpoint import Checkpointing
from fedlayer.server import ServerState
from fedlayer.secure_client import SecureClient
from tests.numeric_checks import assert_close
from tests.fedlayer.cases import N_CLASSES, client_data, dnn_config, make_data


# ---------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------

def test_fixed_point_sums_within_the_stated_bound(rng):
    n = 7
    code = FixedPoint(30, n)
    parts = [rng.standard_normal((20, 9)) * 10.0 ** rng.integers(-3, 4) for _ in range(n)]
    total = np.zeros((20, 9), dtype=np.uint64)
    for part in parts:
        total += code.encode(part)
    assert np.abs(code.decode(total) - sum(parts)).max() <= code.error_bound()


def test_fixed_point_refuses_what_would_wrap(rng):
    code = FixedPoint(40, 100)
    with pytest.raises(SecureAggregationError, match=r"client 4 G: largest magnitude 1e\+07 does not fit .* "
                                                     r"40 fractional bits and 100 clients\); the value would wrap"):
        code.encode(np.array([1.0, -1e7]), "client 4 G")
    # The limit is this term's share of 2^63: just below it encodes, and 100 such terms sum without wrapping.
    limit = 2.0 ** 63 / 100 / 2.0 ** 40
    assert code.limit == pytest.approx(limit, rel=1e-15)
    code.encode(np.array([0.99 * limit, -0.99 * limit]))
    with pytest.raises(SecureAggregationError, match="the value would wrap"):
        code.encode(np.array([1.01 * limit]))
    total = sum(code.encode(np.array([0.99 * limit])) for _ in range(100))
    assert code.decode(total)[0] == pytest.approx(99 * limit, rel=1e-12)


def test_fraction_bits_leave_room_for_the_sum():
    bits = fraction_bits([10, 12, 3], 100)
    assert bits == 63 - 1 - 12 - 7
    code = FixedPoint(bits, 100)
    assert code.limit >= 2.0 ** 12  # every declared value fits
    with pytest.raises(SecureAggregationError, match="need at least 8"):
        fraction_bits([55], 1000)


@pytest.mark.parametrize("n,t", [(2, 2), (5, 3), (14, 8)])
def test_any_t_shares_rebuild_the_secret_and_fewer_do_not(rng, n, t):
    secret = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    shares = shamir_split(secret, n, t)
    for _ in range(5):
        chosen = [shares[i] for i in rng.choice(n, size=t, replace=False)]
        assert shamir_combine(chosen) == secret
    if t > 1:
        with pytest.raises(SecureAggregationError):
            shamir_combine(shares[:t - 1])  # an unrelated value, almost never 32 bytes long


def test_shares_off_the_polynomial_or_repeated_are_refused(rng):
    secret = bytes(rng.integers(0, 256, 32, dtype=np.uint8))
    shares = shamir_split(secret, 14, 8)
    assert shamir_combine(shares, t=8) == secret
    for index in (0, 7, 13):  # among the t that rebuild, or one of the extra ones checked against them
        tampered = list(shares)
        tampered[index] = (tampered[index][0], tampered[index][1] + 1)
        with pytest.raises(SecureAggregationError, match="does not lie on the polynomial"):
            shamir_combine(tampered, t=8)
    with pytest.raises(SecureAggregationError, match="repeated indices"):
        shamir_combine(shares[:7] + shares[:1])


@pytest.mark.parametrize("what", ["self"])
def test_a_tampered_revealed_share_stops_the_unmasking_instead_of_decoding_garbage(rng, what):
    """Before, adding 1 to one revealed share of a self mask gave a sum of 36.8 where 2.49 was right."""
    cids = list(range(8))
    states, server = _setup(cids)
    code = FixedPoint(36, len(cids))
    data = {c: rng.standard_normal((6, 6)) for c in cids}
    dropped = [3]
    survivors = [c for c in cids if c not in dropped]
    _, total = _masked_sum(states, server, (0, 0), data, survivors, dropped, code)
    revealed = {c: states[c].reveal((0, 0), set(dropped), set(survivors)) for c in survivors}
    owner = 0 if what == "self" else 3
    revealer = next(c for c in survivors if revealed[c].get(owner, (None,))[0] == what)
    kind, (x, y) = revealed[revealer][owner]
    revealed[revealer][owner] = (kind, (x, y + 1))
    with pytest.raises(SecureAggregationError, match=f"client {owner}: the revealed shares of its"):
        server.unmask((0, 0), {"G": total}, survivors, dropped, revealed)


@pytest.mark.parametrize("n", [3, 10, 100, 1000])
def test_neighbour_graph_is_symmetric_with_logarithmic_degree(n):
    graph = neighbour_graph(range(n), seed=1)
    degrees = [len(v) for v in graph.values()]
    assert all(a in graph[b] for a in graph for b in graph[a])
    assert all(cid not in graph[cid] for cid in graph)
    assert max(degrees) <= min(n - 1, 2 * int(np.ceil(np.log2(n))) + 1)
    assert min(degrees) >= min(n - 1, 2)
    assert threshold(len(graph[0])) == len(graph[0]) // 2 + 1


def _setup(cids, seed=0, min_survivors=1):
    states = {c: SecureClientState(c, min_survivors) for c in cids}
    server = SecureServer(seed)
    server.plan({0: list(cids)})
    server.public = {c: states[c].public_key() for c in cids}
    for c in cids:
        states[c].set_neighbours({n: server.public[n] for n in server.graph[c]})
    return states, server


def _masked_sum(states, server, context, data, survivors, dropped, code):
    outgoing = {c: states[c].new_self_mask(context) for c in data}
    incoming, offenders = server.route(outgoing)
    assert not offenders
    for c, shares in incoming.items():
        assert states[c].receive_shares(shares, context) == {}
    members = sorted(data)
    uploads = {c: states[c].mask(context, {"G": code.encode(data[c])}, members) for c in survivors}
    total = np.zeros_like(uploads[survivors[0]]["G"])
    for c in survivors:
        total += uploads[c]["G"]
    return uploads, total


@pytest.mark.parametrize("dropped", [[], [3], [0, 5]])
def test_masks_cancel_and_dropped_clients_masks_are_removed(rng, dropped):
    cids = list(range(8))
    states, server = _setup(cids)
    code = FixedPoint(36, len(cids))
    data = {c: rng.standard_normal((6, 6)) for c in cids}
    survivors = [c for c in cids if c not in dropped]
    uploads, total = _masked_sum(states, server, (0, 0), data, survivors, dropped, code)
    revealed = {c: states[c].reveal((0, 0), set(dropped), set(survivors)) for c in survivors}
    plain = server.unmask((0, 0), {"G": total}, survivors, dropped, revealed)
    assert np.abs(code.decode(plain["G"]) - sum(data[c] for c in survivors)).max() <= code.error_bound()
    # What the server holds before unmasking says nothing about the data.
    for c in survivors:
        assert abs(np.corrcoef(code.decode(uploads[c]["G"]).ravel(), data[c].ravel())[0, 1]) < 0.9


@pytest.mark.parametrize("key_bytes", [16, 32])
def test_keystream_is_aes_ctr(rng, key_bytes):
    # against AES of the counter blocks 0, 1, 2, ... (ECB), an independent route to the same stream
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(rng.integers(0, 256, key_bytes, dtype=np.uint8))
    n_words = 2 * 37 + 1  # not a whole number of 16-byte blocks
    counters = b"".join(i.to_bytes(16, "big") for i in range(38))
    blocks = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(counters)
    expected = np.frombuffer(blocks[:8 * n_words], dtype=np.uint64)
    np.testing.assert_array_equal(keystream_words(key, n_words), expected)
    assert not np.array_equal(keystream_words(bytes(key_bytes), n_words), expected)


def test_mask_keys_are_aes128_keys_per_purpose_and_sum():
    from fedlayer.secure import _mask_key

    secret = bytes(range(32))
    key = _mask_key(secret, b"mask", (1, 0))
    assert len(key) == 16
    assert key != _mask_key(secret, b"self mask", (1, 0))
    assert key != _mask_key(secret, b"mask", (2, 0))
    assert key == _mask_key(secret, b"mask", (1, 0))


CHUNK = _CHUNK_WORDS  # the masks' chunk, in words


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("n_words", [1, 3, CHUNK - 1, CHUNK, 4 * CHUNK, 5 * CHUNK + 5])
def test_masks_are_added_chunk_by_chunk_as_whole_keystreams(rng, n_words, cores):
    # From 4 chunks on, 2 cores split the vector into spans whose keystreams start mid-stream.
    import fastls
    from fedlayer.secure import _add_masks

    flat = rng.integers(0, 2**63, n_words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    pairs = [(bytes(rng.integers(0, 256, 16, dtype=np.uint8)), sign) for sign in (+1, -1, -1, +1)]
    expected = flat.copy()
    for key, sign in pairs:
        if sign > 0:
            expected += keystream_words(key, n_words)
        else:
            expected -= keystream_words(key, n_words)
    with fastls.limit_cores(cores):
        np.testing.assert_array_equal(_add_masks(flat, pairs), expected)


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("sizes", [(7,), (CHUNK - 3, 10), (5, 3 * CHUNK + 1, 2 * CHUNK)])
def test_masks_encode_their_pieces_in_the_same_pass(rng, sizes, checked):
    import fastls
    from fedlayer.secure import _add_masks

    code = FixedPoint(30, 50)
    pieces = [rng.standard_normal(n) * 100.0 for n in sizes]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    pairs = [(bytes(rng.integers(0, 256, 16, dtype=np.uint8)), sign) for sign in (+1, -1, +1)]
    expected = np.concatenate([code.encode(p) for p in pieces])
    for key, sign in pairs:
        if sign > 0:
            expected += keystream_words(key, expected.size)
        else:
            expected -= keystream_words(key, expected.size)
    flat = np.empty(sum(sizes), dtype=np.uint64)
    with fastls.limit_cores(2):
        _add_masks(flat, pairs, list(zip(offsets, pieces)), code, checked)
    np.testing.assert_array_equal(flat, expected)


def test_a_value_that_does_not_fit_is_named_by_its_entry_and_nothing_is_returned(rng):
    states, server = _setup(list(range(4)))
    states[0].new_self_mask((0, 0))
    code = FixedPoint(40, 4)
    entries = {"C": rng.standard_normal((3, 2)), "G": rng.standard_normal(2 * CHUNK)}
    entries["G"][CHUNK + 7] = np.nan
    with pytest.raises(SecureAggregationError, match=r"client 0 G: a value is not finite or does not fit the sum's "
                                                     r"fixed point \(40 fractional bits, 4 clients\)") as err:
        states[0].mask((0, 0), entries, range(4), code=code)
    assert "nan" not in str(err.value)  # the reason reaches the server: it names the entry, not its values
    entries["G"][CHUNK + 7] = -1e300
    states[0].new_self_mask((0, 1))
    with pytest.raises(SecureAggregationError, match="client 0 G: a value") as err:
        states[0].mask((0, 1), entries, range(4), code=code)
    assert "1e+300" not in str(err.value)


def test_a_declared_exponent_that_fits_skips_the_scan_and_one_that_does_not_is_refused():
    code = FixedPoint(fraction_bits([12], 100), 100)
    assert code.fits(12)
    assert not code.fits(70)
    # the scan still runs when the exponent does not vouch for the values
    with pytest.raises(SecureAggregationError, match="largest magnitude"):
        code.encode_into(np.array([2.0 ** 60]), np.empty(1, dtype=np.uint64))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("d", [1, 7, 300])
def test_upper_triangle_packs_row_by_row(rng, dtype, order, d):
    # LAPACK's trttp on C-ordered G, a loop otherwise: the same order either way
    G = np.asarray(rng.standard_normal((d, d)), dtype=dtype, order=order)
    expected = np.concatenate([G[i, i:] for i in range(d)])
    packed = pack_upper(G)
    assert packed.dtype == dtype
    np.testing.assert_array_equal(packed, expected)


def test_packed_upper_triangle_round_trips(rng):
    G = np.triu(rng.standard_normal((7, 7)))
    packed = pack_upper(G)
    assert packed.shape == (28,)
    np.testing.assert_array_equal(unpack_upper(packed), G)
    np.testing.assert_array_equal(unpack_upper(packed, 7), G)
    with pytest.raises(ValueError, match="upper triangle of a 6 x 6 matrix has 21 values, got 28"):
        unpack_upper(packed, 6)


def test_a_client_never_reveals_both_secrets_of_a_neighbour(rng):
    cids = list(range(5))
    states, server = _setup(cids)
    code = FixedPoint(36, 5)
    _masked_sum(states, server, (1, 0), {c: rng.standard_normal(3) for c in cids}, cids, [], code)
    first = states[0].reveal((1, 0), dropped=set(), survivors={1, 2, 3, 4})
    assert all(what == "self" for what, _ in first.values())
    with pytest.raises(SecureAggregationError, match="asked for both secrets of client 1 in sum \\(1, 0\\)"):
        states[0].reveal((1, 0), dropped={1}, survivors={2, 3, 4})


def test_a_tampered_share_is_refused_and_its_sender_reported():
    # The receiver keeps nothing of it and reports the sender instead of raising (raising dropped the receiver).
    states, server = _setup([0, 1, 2])
    blob = bytearray(states[0].new_self_mask((0, 0))[1])
    blob[-1] ^= 1
    reports = states[1].receive_shares({0: bytes(blob)}, (0, 0))
    assert list(reports) == [0] and "the share from client 0 does not authenticate" in reports[0]
    assert states[1]._held == {}


@pytest.mark.parametrize("plain", [b"[0, 1, 'self']", b"[0, 1, \"both\", [1, 0], 1, 2]",
                                   b"[0, 1, \"self\", [1.5], 1, 2]", b"not json"])
def test_an_authentic_share_of_the_wrong_form_is_refused(plain):
    states, server = _setup([0, 1, 2])
    nonce = os.urandom(12)
    blob = nonce + states[0]._aead(1).encrypt(nonce, plain, None)
    reports = states[1].receive_shares({0: blob}, (0, 0))
    assert list(reports) == [0] and "the share from client 0 is not (owner, to, what" in reports[0]
    assert states[1]._held == {}


def test_too_many_dropouts_name_the_threshold(rng):
    cids = list(range(4))
    states, server = _setup(cids)
    server.min_group_size = 1  # the threshold, not the survivors' count, is what fails here
    code = FixedPoint(36, 4)
    data = {c: rng.standard_normal(3) for c in cids}
    _, total = _masked_sum(states, server, (0, 0), data, [0], [1, 2, 3], code)
    revealed = {0: states[0].reveal((0, 0), {1, 2, 3}, {0})}
    with pytest.raises(SecureAggregationError, match=r"of its neighbours revealed a share .* are needed .* too many of "
                                                     r"them dropped out"):
        server.unmask((0, 0), {"G": total}, [0], [1, 2, 3], revealed)


def test_a_sum_of_too_few_survivors_is_neither_revealed_nor_unmasked(rng):
    cids = list(range(6))
    states, server = _setup(cids, min_survivors=3)
    code = FixedPoint(36, 6)
    data = {c: rng.standard_normal(3) for c in cids}
    survivors, dropped = [0, 1], [2, 3, 4, 5]
    _, total = _masked_sum(states, server, (0, 0), data, survivors, dropped, code)
    for c in survivors:
        with pytest.raises(SecureAggregationError, match=r"2 survivor\(s\), fewer than the 3 it reveals shares for"):
            states[c].reveal((0, 0), set(dropped), set(survivors))
    with pytest.raises(SecureAggregationError, match=r"2 survivor\(s\), fewer than min_group_size=3; not unmasked"):
        server.unmask((0, 0), {"G": total}, survivors, dropped, {})


def test_a_later_dropout_reveals_nothing_that_unmasks_an_earlier_sum(rng):
    """Client 3 survives sum A (its self mask is revealed) and drops out of sum B after masking.

    Before, the survivors of B revealed shares of client 3's mask key, the run's: with it and the self
    mask of A, the server rebuilt client 3's upload of A exactly (an audit's reproducer). Now they reveal
    only the keys of B's pairwise masks, which B's sum needs and A's upload does not contain.
    """
    from fedlayer.secure import _mask_key, _public_parts, keystream_words

    cids = list(range(8))
    states, server = _setup(cids)
    code = FixedPoint(36, len(cids))
    data = {c: rng.standard_normal(4) for c in cids}
    uploads_a, total = _masked_sum(states, server, (0, 0), data, cids, [], code)
    revealed_a = {c: states[c].reveal((0, 0), set(), set(cids)) for c in cids}
    plain = server.unmask((0, 0), {"G": total}, cids, [], revealed_a)
    assert np.abs(code.decode(plain["G"]) - sum(data.values())).max() <= code.error_bound()
    survivors = [c for c in cids if c != 3]
    _, total = _masked_sum(states, server, (1, 0), data, survivors, [3], code)
    revealed_b = {c: states[c].reveal((1, 0), {3}, set(survivors)) for c in survivors}
    plain = server.unmask((1, 0), {"G": total}, survivors, [3], revealed_b)
    assert np.abs(code.decode(plain["G"]) - sum(data[c] for c in survivors)).max() <= code.error_bound()
    # What sum B revealed about client 3: one 16-byte key per neighbour, that of B's mask only.
    about_3 = [answer for shares in revealed_b.values() for owner, answer in shares.items() if owner == 3]
    assert len(about_3) == len(server.graph[3]) and all(what == "pair" and len(key) == 16 for what, key in about_3)
    for neighbour in server.graph[3]:
        shared = states[neighbour]._shared(3)
        assert revealed_b[neighbour][3][1] == _mask_key(shared, b"mask", (1, 0)) != _mask_key(shared, b"mask", (0, 0))
    # The server's best attempt on A: client 3's revealed self mask of A and B's pairwise keys leave A's
    # pairwise masks in, so what it gets does not correlate with client 3's data.
    self_a = server._rebuild([revealed_a[c][3][1] for c in server.graph[3]], 3)
    attempt = uploads_a[3]["G"] - keystream_words(_mask_key(self_a, b"self mask", (0, 0)), 4)
    for neighbour in server.graph[3]:
        key, sign = revealed_b[neighbour][3][1], (1 if neighbour > 3 else -1)
        attempt = attempt - sign * keystream_words(key, 4) if sign > 0 else attempt + keystream_words(key, 4)
    assert np.abs(code.decode(attempt) - data[3]).min() > 1.0  # 64-bit noise, not client 3's values
    assert all(len(_public_parts(server.public[c])) == 2 for c in cids)  # the server holds public keys only


def test_a_survivor_that_does_not_reveal_its_pairwise_key_stops_the_unmasking(rng):
    cids = list(range(6))
    states, server = _setup(cids)
    code = FixedPoint(36, len(cids))
    data = {c: rng.standard_normal(3) for c in cids}
    survivors = [c for c in cids if c != 2]
    _, total = _masked_sum(states, server, (0, 0), data, survivors, [2], code)
    revealed = {c: states[c].reveal((0, 0), {2}, set(survivors)) for c in survivors}
    silent = server.graph[2][0]
    del revealed[silent]
    with pytest.raises(SecureAggregationError, match=f"client {silent} did not reveal the key of its mask with "
                                                     "client 2, which dropped out after masking"):
        server.unmask((0, 0), {"G": total}, survivors, [2], revealed)
    # A neighbour that never masked with the dropped client (it was not in the sum) has nothing to reveal.
    assert states[silent].reveal((5, 0), {2}, set(survivors)) == {}


# ---------------------------------------------------------------------------
# The protocol in the federated loop
# ---------------------------------------------------------------------------

def _clients(rng, n_clients, **options):
    x, y = make_data(rng, n=300)
    parts = np.array_split(rng.permutation(300), n_clients)
    # Wrapped for secure sums: the same clients in the plain runs they are compared with (the wrapper adds steps).
    return [SecureClient(Client(i, client_data(x, y, p), dnn_config(x.shape[1]), seed=3, n_classes=N_CLASSES,
                                options=ClientOptions(**options))) for i, p in enumerate(parts)]


@pytest.mark.parametrize("name,options,protocol", [
    ("fedacnnl", {}, {}), ("pfedacnnl", {}, {}), ("fedacnnl", {"drop_probability": 0.3}, {}),
    # GCV's extra sums (tr(Z^T Z), rows) through the masks too; pooled and per-group gammas
    ("pfedacnnl", {}, {"gamma": "auto"}), ("pfedacnnl", {}, {"gamma": "auto", "gamma_scope": "group"}),
])
def test_secure_weights_equal_the_plain_ones_to_the_rounding(rng, name, options, protocol):
    seed = int(rng.integers(2**31))
    server_options = ServerOptions(groups=2, batch=BatchPolicy(7), **protocol)
    plain = run_protocol(InProcessTransport(_clients(np.random.default_rng(seed), 9, **options)), 3, VARIANTS[name],
                         server_options)
    secure = run_protocol(InProcessTransport(_clients(np.random.default_rng(seed), 9, **options)), 3, VARIANTS[name],
                          server_options, secure=SecureServer(seed=5, min_group_size=2))
    # The same partition; secure mode numbers its groups by their first member (merge_small_groups).
    members = {}
    for result in (plain, secure):
        for cid, k in result["groups"].items():
            members.setdefault(id(result), {}).setdefault(k, set()).add(cid)
    as_secure = {k: next(j for j, group in members[id(secure)].items() if group == group_k)
                 for k, group_k in members[id(plain)].items()}
    # With gamma chosen by GCV, any rounding of the sums (the fixed point's 1e-13, or eq. 7's timed batch
    # sizes changing the order of the float64 sums between two runs) moves the minimizer of a flat
    # criterion far more than itself (1e-6 relative measured, on a group whose GCV picks gamma ~ 2e-7),
    # and the weights with it: the fixed-gamma bound does not apply there. A wrong tr(Z^T Z) or row
    # count would move gamma by orders of magnitude.
    auto = protocol.get("gamma") == "auto"
    rtol = 1e-5 if auto else 1e-9
    for k in plain["group_weights"]:
        for W, V in zip(plain["group_weights"][k], secure["group_weights"][as_secure[k]], strict=True):
            assert_close(V, W, np.float64, rtol=rtol)
    if protocol:  # the gammas GCV chose from the decoded sums are the plain run's
        for a, b in zip(plain["rounds"], secure["rounds"]):
            for key, choice in a.get("selection", {}).items():
                other = b["selection"][key if key == "all" else str(as_secure[int(key)])]
                assert abs(other["gamma"] / choice["gamma"] - 1) < 1e-4, key
    for a, b in zip(plain["rounds"], secure["rounds"]):
        assert a.get("dropped") == b.get("dropped")
    if options:
        assert any(r.get("dropped") for r in secure["rounds"])


class _FailingClient(SecureClient):
    """A client that raises in the named protocol steps: ``fail`` holds (method, layer position) pairs."""

    def __init__(self, client, fail=()):
        super().__init__(client)
        self.fail, self.calls = set(fail), []

    def _step(self, method, position):
        self.calls.append((method, position))
        if (method, position) in self.fail:
            raise RuntimeError(f"client {self.client_id}: injected failure in {method}, layer {position + 1}")

    def local_stats(self, position, *args, **kwargs):
        self._step("local_stats", position)
        return self.client.local_stats(position, *args, **kwargs)

    def secure_self_mask(self, context, members=None):
        self._step("secure_self_mask", context[0])
        return super().secure_self_mask(context, members)

    def secure_upload(self, position, *args, **kwargs):
        self._step("secure_upload", position)
        return super().secure_upload(position, *args, **kwargs)

    def secure_reveal(self, context, *args, **kwargs):
        self._step("secure_reveal", context[0])
        return super().secure_reveal(context, *args, **kwargs)



def _failing_clients(seed, n_clients, fail):
    rng = np.random.default_rng(seed)
    x, y = make_data(rng, n=300)
    parts = np.array_split(rng.permutation(300), n_clients)
    return [_FailingClient(Client(i, client_data(x, y, p), dnn_config(x.shape[1]), seed=3, n_classes=N_CLASSES),
                           fail=fail.get(i, ())) for i, p in enumerate(parts)]


def _assert_same_weights(plain, secure):
    for k in plain["group_weights"]:
        for W, V in zip(plain["group_weights"][k], secure["group_weights"][k], strict=True):
            assert_close(V, W, np.float64, rtol=1e-9)


def test_a_client_that_drops_out_after_masking_is_removed_and_kept_out_of_its_group_s_later_sums(rng):
    # Client 4 fails in its masked upload of layer 1: its neighbours reveal the keys of that sum's masks
    # with it. Back in layers 2 and 3, a sum over all nine would differ from layer 1's by client 4 alone
    # (their difference: its statistics' bias parts, its class counts): it is excluded as if it had dropped,
    # and every layer equals the plain run in which it misses all three. Before, it was back in.
    seed = int(rng.integers(2**31))
    plain = run_protocol(InProcessTransport(_failing_clients(seed, 9, {4: {("local_stats", p) for p in range(3)}})), 3,
                         VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)))
    clients = _failing_clients(seed, 9, {4: {("secure_upload", 0)}})
    server = SecureServer(seed=5)
    secure = run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)),
                          secure=server)
    _assert_same_weights(plain, secure)
    assert "secure_upload" in secure["rounds"][0]["dropped"]["4"]
    assert [r["dropped"] for r in secure["rounds"][1:]] == [{"4": EXCLUDED.format(m=3)}] * 2
    assert [r["contributors"] for r in secure["rounds"]] == [{"0": [[0, 1, 2, 3, 5, 6, 7, 8]]}] * 3
    assert "rekeyed" not in secure["secure"]
    for other in server.graph[4]:
        assert clients[other].state._public[4] == server.public[4] == clients[4].state.public_key()


def test_self_masks_are_shared_among_the_neighbours_still_in_the_sum(rng):
    # 9 clients, each the neighbour of all 8 others (threshold 5 of 8). In layer 2, four fail before
    # masking: the five left hold each other's self-mask shares (threshold 3 of 4) and the sum unmasks.
    # Shared among all 8 neighbours, only 4 would hold a survivor's shares, below its threshold of 5
    # (found on MNIST: pFedACnnL, --secure --drop-clients 0.1 stopped in layer 3).
    seed = int(rng.integers(2**31))
    lost = {cid: {("local_stats", 1)} for cid in (1, 3, 5, 7)}
    plain = run_protocol(InProcessTransport(_failing_clients(seed, 9, lost)), 3, VARIANTS["fedacnnl"],
                         ServerOptions(batch=BatchPolicy(7)))
    server = SecureServer(seed=5)
    secure = run_protocol(InProcessTransport(_failing_clients(seed, 9, lost)), 3, VARIANTS["fedacnnl"],
                          ServerOptions(batch=BatchPolicy(7)), secure=server)
    assert all(len(neighbours) == 8 for neighbours in server.graph.values())
    assert sorted(secure["rounds"][1]["dropped"]) == ["1", "3", "5", "7"]
    _assert_same_weights(plain, secure)


def test_failures_in_every_step_of_a_secure_sum_are_dropouts(rng):
    # Layer 1: client 2 fails sharing its self mask (left out before anyone masks with it; then out of the
    # group's later sums too, which would otherwise differ from layer 1's by client 2 alone).
    # Layer 2: client 5 fails revealing its shares (its upload is in the sum; the others' shares suffice).
    seed = int(rng.integers(2**31))
    plain = run_protocol(InProcessTransport(_failing_clients(seed, 9, {2: {("local_stats", p) for p in range(3)}})), 3,
                         VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)))
    secure = run_protocol(InProcessTransport(_failing_clients(seed, 9, {2: {("secure_self_mask", 0)},
                                                                        5: {("secure_reveal", 1)}})),
                          3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)), secure=SecureServer(seed=5))
    _assert_same_weights(plain, secure)
    assert secure["rounds"][0]["dropped"]["2"].startswith("secure_self_mask: RuntimeError")
    assert secure["rounds"][1]["dropped"]["5"].startswith("secure_reveal (its upload is in the sum): RuntimeError")
    assert secure["rounds"][1]["dropped"]["2"] == secure["rounds"][2]["dropped"]["2"] == EXCLUDED.format(m=3)
    assert "5" in secure["rounds"][1]["clients"]


def test_a_group_with_too_few_survivors_is_solved_on_the_other_groups_sums():
    seed = 1  # a draw whose clients K-means splits 5 / 7 (others may leave one group after merging)
    groups = run_protocol(InProcessTransport(_failing_clients(seed, 12, {})), 1, VARIANTS["pfedacnnl-wp"],
                          ServerOptions(groups=2, batch=BatchPolicy(7)), secure=SecureServer(seed=5))["groups"]
    members = sorted(int(c) for c, k in groups.items() if k == 0)
    assert set(groups.values()) == {0, 1} and len(members) >= 3
    lost = {cid: {("local_stats", 0)} for cid in members[2:]}  # two of group 0 survive layer 1
    result = run_protocol(InProcessTransport(_failing_clients(seed, 12, lost)), 2, VARIANTS["pfedacnnl-wp"],
                          ServerOptions(groups=2, batch=BatchPolicy(7)), secure=SecureServer(seed=5))
    assert result["groups"] == groups
    first = result["rounds"][1]
    assert first["withheld"] == {"0": {"why": "2 survivor(s) of the secure sum, fewer than min_group_size=3: "
                                              "not unmasked", "solved_on": [1]}}
    np.testing.assert_array_equal(result["group_weights"][0][0], result["group_weights"][1][0])
    assert "withheld" not in result["rounds"][2]
    assert not np.array_equal(result["group_weights"][0][1], result["group_weights"][1][1])
    # No survivor at all in group 0 is solved the same way.
    gone = {cid: {("local_stats", 0)} for cid in members}
    result = run_protocol(InProcessTransport(_failing_clients(seed, 12, gone)), 1, VARIANTS["pfedacnnl-wp"],
                          ServerOptions(groups=2, batch=BatchPolicy(7)), secure=SecureServer(seed=5))
    assert result["rounds"][1]["withheld"]["0"]["why"].startswith("every client of the group dropped out (")
    np.testing.assert_array_equal(result["group_weights"][0][0], result["group_weights"][1][0])
    # With one group there is no other sum: the run stops and says why.
    with pytest.raises(SecureAggregationError, match=r"layer 1: 2 survivor\(s\) .* no other group's sum"):
        run_protocol(InProcessTransport(_failing_clients(seed, 5, {c: {("local_stats", 0)} for c in (0, 1, 2)})), 1,
                     VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)), secure=SecureServer(seed=5))


def test_small_groups_merge_into_the_nearest():
    summaries = {0: np.array([0.0]), 1: np.array([0.1]), 2: np.array([0.2]), 3: np.array([5.0]),
                 4: np.array([5.1]), 5: np.array([5.2]), 6: np.array([0.3])}
    group_of = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 2}
    merged = merge_small_groups(group_of, summaries, 3)
    assert merged == {0: 0, 1: 0, 2: 0, 6: 0, 3: 1, 4: 1, 5: 1}
    assert merge_small_groups(group_of, summaries, 1) == group_of


def test_h_noise_blurs_the_label_summary(rng):
    x, y = make_data(rng, n=60)
    data = client_data(x, y, np.arange(60))
    clean = Client(0, data, dnn_config(12), seed=0, n_classes=N_CLASSES).label_summary()["h"]
    noisy = Client(0, data, dnn_config(12), seed=0, n_classes=N_CLASSES, options=ClientOptions(h_noise=0.5))
    first, second = noisy.label_summary()["h"], noisy.label_summary()["h"]
    assert not np.allclose(first, clean) and not np.allclose(first, second)  # fresh noise, not the run's seed
    assert 0.2 < np.std(first - clean) < 1.0


def test_the_server_sees_class_means_in_a_plain_upload_and_noise_in_a_masked_one(rng):
    """The threat and the fix: first-layer C gives each class's mean input; the masked words give nothing."""
    from fedlayer.secure import class_means_from_upload

    clients = _clients(rng, 4)
    target = clients[0]
    Q = target.encoders[0]
    truth = np.stack([target.data.x_train[target.data.y_train == c].mean(axis=0) for c in range(N_CLASSES)])
    plain = target.local_stats(0, 64)
    means, counts = class_means_from_upload(plain["C"], Q)
    np.testing.assert_allclose(counts, np.bincount(target.data.y_train, minlength=N_CLASSES), atol=1e-6)
    np.testing.assert_allclose(means, truth, atol=1e-6)
    # The same client under the secure protocol: what reaches the server from it.
    server = SecureServer(seed=1, min_group_size=2)
    server.public = {c.client_id: c.secure_keys()["public"] for c in clients}
    graph = server.plan({0: [c.client_id for c in clients]})
    for c in clients:
        c.secure_neighbours({n: server.public[n] for n in graph[c.client_id]})
    bound = target.secure_bound(0, 64, ["G", "C"])
    bits = fraction_bits([bound["exponent"]], len(clients))
    outgoing = {c.client_id: c.secure_self_mask((0, 0))["shares"] for c in clients}
    incoming, _ = server.route(outgoing)
    for c in clients:
        c.secure_receive(incoming.get(c.client_id, {}), (0, 0))
    upload = target.secure_upload(0, (0, 0), bits, len(clients), [c.client_id for c in clients])
    seen = FixedPoint(bits, len(clients)).decode(upload["C"])
    guessed, _ = class_means_from_upload(seen, Q)
    # Uniform words in Z_2^64: over all 48 values a correlation of 0.6 has odds below 1e-5 (the masks are fresh
    # OS randomness each run); a plain upload gives 1.
    valid = np.isfinite(guessed)
    assert abs(np.corrcoef(guessed[valid], truth[valid])[0, 1]) < 0.6


def test_a_group_lost_to_failures_and_then_to_the_secure_protocol_names_both_reasons():
    """Seed 0, 3 clients, P = 0.5: clients 0 and 1 fail in layer 1, so client 2 has no neighbour left."""
    from fedlayer.server import AllClientsDropped
    from fedlayer.run import RunConfig, run

    with pytest.raises(AllClientsDropped) as err:
        run(RunConfig(algorithm="fedacnnl", clients=3, drop_clients=0.5, secure=True))
    message = str(err.value)
    assert "client 0: ClientDropout: client 0: simulated failure in layer 1" in message
    assert "client 2: secure_self_mask: SecureAggregationError: client 2: none of its neighbours" in message



@pytest.mark.parametrize("values,exponent", [([1.0], 1), ([3.0], 2), ([0.5], 0), ([0.75], 0), ([4.0], 3),
                                             ([-4.0, 0.1], 3), ([0.0], 0), ([2.0 ** -30], -29)])
def test_magnitude_exponent_is_the_smallest_e_above_every_value(values, exponent):
    assert magnitude_exponent([np.array(values)]) == exponent
    peak = max(abs(v) for v in values)
    assert peak < 2.0 ** exponent and (peak == 0 or peak >= 2.0 ** (exponent - 1))


def test_every_secure_sum_is_encoded_for_the_clients_in_it(rng, monkeypatch):
    """The fixed point's range is split among the terms actually summed: one share per surviving client."""
    import fedlayer.secure
    import fedlayer.server.secure_sums

    terms = []
    real = fedlayer.secure.FixedPoint

    class Spy(real):
        def __init__(self, frac_bits, n_terms):
            terms.append(n_terms)
            super().__init__(frac_bits, n_terms)

    monkeypatch.setattr(fedlayer.secure, "FixedPoint", Spy)
    monkeypatch.setattr(fedlayer.server.secure_sums, "FixedPoint", Spy)
    run_protocol(InProcessTransport(_clients(rng, 5)), 2, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)),
                 secure=SecureServer(seed=5))
    assert terms and set(terms) == {5}


def test_secure_pfedacnnl_merges_groups_below_the_minimum_size(rng):
    """Five K-means groups of nine clients must leave one below three; merged, none is."""
    result = run_protocol(InProcessTransport(_clients(rng, 9)), 1, VARIANTS["pfedacnnl-wp"],
                          ServerOptions(groups=5, batch=BatchPolicy(7)), secure=SecureServer(seed=5, min_group_size=3))
    sizes = np.bincount(list(result["groups"].values()))
    assert sizes.min() >= 3 and sizes.sum() == 9


# ---------------------------------------------------------------------------
# The attacks of issue 42: each test failed on the code before the fix
# ---------------------------------------------------------------------------

def _spy_sums(monkeypatch):
    """Record, for every secure sum the server unmasks, its contributors and the class counts it decodes."""
    from fedlayer.server import SecureSums

    seen = []
    real = SecureSums.group_sum

    def spy(self, *args, **kwargs):
        outcome, withheld = real(self, *args, **kwargs)
        if outcome.totals:
            seen.append((frozenset(outcome.receipts), outcome.totals["C"][-1].copy()))
        return outcome, withheld

    monkeypatch.setattr(SecureSums, "group_sum", spy)
    return seen


def test_differencing_two_unmasked_sums_reveals_no_client(rng, monkeypatch):
    """Client 4 fails in layer 2 only. Before, layer 1 summed all nine and layer 2 the eight others: the
    difference of their C's bias rows (with X^T Y's coordinates, the class counts) was client 4's exact
    class histogram, and of G's bias entries its sample count."""
    seed = int(rng.integers(2**31))
    clients = _failing_clients(seed, 9, {4: {("local_stats", 1)}})
    seen = _spy_sums(monkeypatch)
    result = run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)),
                          layers=ModelLayers(clients[0].bases), secure=SecureServer(seed=5))
    assert len(seen) == 3
    histograms = {c.client_id: np.bincount(c.data.y_train, minlength=N_CLASSES) for c in clients}
    for i, (members_a, counts_a) in enumerate(seen):
        np.testing.assert_allclose(counts_a, sum(histograms[c] for c in members_a), atol=1e-6)
        for _members_b, counts_b in seen[i + 1:]:
            difference = np.abs(counts_a - counts_b)
            for cid, histogram in histograms.items():
                assert not np.allclose(difference, histogram, atol=1e-6), f"client {cid}'s class counts"
    sets = [members for members, _ in seen]
    assert close_pairs(sets, 3) == []
    # The record says who contributed to each unmasked sum, so the rule can be checked from it alone.
    recorded = [frozenset(c for part in r["contributors"]["0"] for c in part) for r in result["rounds"]]
    assert recorded == sets


def _split_survivors(graph, n_survivors, sizes):
    """The first survivors (in lexicographic order) whose graph splits into components of ``sizes``."""
    import itertools

    for survivors in itertools.combinations(sorted(graph), n_survivors):
        if sorted(len(part) for part in components(graph, survivors)) == sizes:
            return list(survivors)
    raise AssertionError(f"no {n_survivors} survivors split into {sizes}")


def test_survivors_whose_graph_splits_are_not_unmasked(rng):
    """13 clients of degree 8, 8 drop before masking: 5 survivors pass a count of 3, but split 2 + 3, and
    the server could decode the 2-client part alone (its pairwise masks cancel inside it). Before, unmasked."""
    cids = list(range(13))
    states, _ = _setup(cids)
    server = SecureServer(seed=0, degree=8)
    server.plan({0: cids})
    server.public = {c: states[c].public_key() for c in cids}
    for c in cids:
        states[c].set_neighbours({n: server.public[n] for n in server.graph[c]})
    survivors = _split_survivors(server.graph, 5, [2, 3])
    pair = next(part for part in components(server.graph, survivors) if len(part) == 2)
    code = FixedPoint(36, len(survivors))
    data = {c: rng.standard_normal(4) for c in survivors}
    outgoing = {c: states[c].new_self_mask((0, 0), survivors) for c in survivors}
    incoming, offenders = server.route(outgoing, survivors)
    assert not offenders
    for c in survivors:
        states[c].receive_shares(incoming.get(c, {}), (0, 0))
    uploads = {c: states[c].mask((0, 0), {"G": code.encode(data[c])}, survivors) for c in survivors}
    total = sum(uploads[c]["G"] for c in survivors)
    revealed = {c: states[c].reveal((0, 0), set(), set(survivors)) for c in survivors}
    # The attack, had the server asked for the shares: the pair's uploads less their self masks.
    from fedlayer.secure import _mask_key

    attempt = sum(uploads[c]["G"] for c in pair)
    for c in pair:
        shares = [revealed[other][c][1] for other in survivors if c in revealed[other]]
        attempt = attempt - keystream_words(_mask_key(server._rebuild(shares, c, [n for n in server.graph[c]
                                                                                  if n in survivors]),
                                                      b"self mask", (0, 0)), 4)
    np.testing.assert_allclose(code.decode(attempt), data[pair[0]] + data[pair[1]], atol=code.error_bound())
    with pytest.raises(SecureAggregationError, match=rf"splits into a component of 2 client\(s\) \[{pair[0]}, "
                                                     rf"{pair[1]}\], fewer than min_group_size=3"):
        server.unmask((0, 0), {"G": total}, survivors, [], revealed, survivors)


def test_a_split_group_sums_its_large_part_only(rng):
    """In the protocol, the survivors' small component is excluded before masking: nothing of it is revealed."""
    seed = int(rng.integers(2**31))
    server = SecureServer(seed=5, degree=8)
    graph = server.plan({0: list(range(13))})
    survivors = _split_survivors(graph, 5, [2, 3])
    pair, large = sorted(components(graph, survivors), key=len)
    lost = {c: {("local_stats", 0)} for c in range(13) if c not in survivors}
    result = run_protocol(InProcessTransport(_failing_clients(seed, 13, lost)), 1, VARIANTS["fedacnnl"],
                          ServerOptions(batch=BatchPolicy(7)), secure=server)
    assert result["rounds"][0]["contributors"] == {"0": [large]}
    assert {int(c): why for c, why in result["rounds"][0]["dropped"].items() if c in map(str, pair)} \
        == dict.fromkeys(pair, EXCLUDED.format(m=3))
    plain = run_protocol(InProcessTransport(_failing_clients(seed, 13, {c: {("local_stats", 0)} for c in range(13)
                                                                         if c not in large})),
                         1, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)))
    _assert_same_weights(plain, result)


@pytest.mark.parametrize("n", [13, 20, 50])
def test_the_default_degree_keeps_the_survivors_connected_at_the_supported_dropout_rate(n):
    from fedlayer.secure import SUPPORTED_DROPOUT, secagg_degree, split_bound

    degree = secagg_degree(n)
    assert degree >= min(n - 1, 2 * int(np.ceil(np.log2(n))))
    assert split_bound(n, degree, SUPPORTED_DROPOUT) <= 1e-6
    # The bound holds where it can be seen: at degree 4 and twice the rate, splits are common, and fewer
    # than the bound says.
    trials, splits = 20000, 0
    graph = neighbour_graph(range(n), seed=3, degree=4)
    draws = np.random.default_rng(n).random((trials, n)) >= 2 * SUPPORTED_DROPOUT
    for alive in draws:
        splits += len(components(graph, np.flatnonzero(alive))) > 1
    assert 0 < splits / trials <= split_bound(n, 4, 2 * SUPPORTED_DROPOUT)


class _BogusSharer(_FailingClient):
    """A client that sends ``victim`` a share that does not open, in layer ``position`` + 1."""

    def __init__(self, client, victim, position=0):
        super().__init__(client)
        self.victim, self.position = victim, position

    def secure_self_mask(self, context, members=None):
        result = super().secure_self_mask(context, members)
        if context[0] == self.position:
            blob = bytearray(result["shares"][self.victim])
            blob[-1] ^= 1
            result["shares"][self.victim] = bytes(blob)
        return result


def test_a_bogus_share_drops_its_sender_not_its_receiver(rng):
    """Client 3 sends client 6 a share that does not open. Before, client 6 raised and dropped out of the sum
    (any client could so remove a chosen one from a chosen sum); now client 6 reports client 3, which is out."""
    seed = int(rng.integers(2**31))
    clients = _failing_clients(seed, 9, {})
    clients[3] = _BogusSharer(Client(3, clients[3].data, dnn_config(clients[3].data.x_train.shape[1]), seed=3,
                                     n_classes=N_CLASSES), victim=6)
    result = run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)),
                          secure=SecureServer(seed=5))
    first = result["rounds"][0]
    assert list(first["dropped"]) == ["3"]
    assert first["dropped"]["3"].startswith("secure_self_mask: reported by client 6: client 6: the share from "
                                            "client 3 does not authenticate")
    assert first["contributors"] == {"0": [[0, 1, 2, 4, 5, 6, 7, 8]]}
    plain = run_protocol(InProcessTransport(_failing_clients(seed, 9, {3: {("local_stats", p) for p in range(3)}})), 3,
                         VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)))
    _assert_same_weights(plain, result)


def test_shares_travel_only_along_the_neighbour_graph():
    """A share addressed to a client that is not the sender's neighbour is not forwarded; its sender is named."""
    states, _ = _setup(list(range(9)))
    server = SecureServer(seed=0, degree=4)
    graph = server.plan({0: list(range(9))})
    stranger = next(c for c in range(1, 9) if c not in graph[0])
    incoming, offenders = server.route({0: {graph[0][0]: b"x", stranger: b"y"}, 1: {graph[1][0]: b"z"}})
    assert incoming == {graph[0][0]: {0: b"x"}, graph[1][0]: {1: b"z"}}
    assert offenders == {0: f"sent a share to client {stranger}, which is not its neighbour in the sum; not forwarded"}
    # Nor to a neighbour outside the sum.
    _, offenders = server.route({0: {graph[0][0]: b"x"}}, members=[0])
    assert list(offenders) == [0]


def test_personalized_weights_never_cross_the_transport(tmp_path):
    """pFedACnnL --secure --output: each client writes its own model; before, its weights went to the server
    (``final_weights``), and under mpiexec over the network to rank 0. The server's record keeps, per client of a
    personalization round, its busy time only."""
    from fedlayer.models import Model
    from fedlayer.run import RunConfig, build, load_dataset, make_clients, run

    crossed = []

    class Spy(InProcessTransport):
        def call(self, method, args):
            for cid, result in super().call(method, args):
                crossed.append((method, result))
                yield cid, result

        def sum(self, method, args, keys, **kwargs):
            outcome = super().sum(method, args, keys, **kwargs)
            crossed.append((method, outcome.totals))
            crossed.extend((method, receipt) for receipt in outcome.receipts.values())
            summed.setdefault(method, set()).update(outcome.totals)
            return outcome

    summed = {}

    config = RunConfig(algorithm="pfedacnnl", clients=9, groups=2, model="dnn", secure=True, output=str(tmp_path))
    dataset = load_dataset(config)
    clients = make_clients(config, dataset, build(config, dataset).config())
    results = run(config, transport=Spy(clients), dataset=dataset)

    def arrays(value):
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from arrays(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from arrays(v)

    seen = [a for _, result in crossed for a in arrays(result)]
    for client in clients:
        model, metadata = Model.load(tmp_path / "personalized" / f"client{client.client_id}.npz")
        assert metadata["clients"] == [client.client_id]
        for i in client.model.trainable:
            W = client.model.layers[i].weights
            np.testing.assert_array_equal(model.layers[i].weights, W)
            assert not any(a.shape == W.shape and np.array_equal(a, W) for a in seen), (client.client_id, i)
    assert "final_weights" not in {method for method, _ in crossed}
    # Everything the server receives, method by method: per client (the receipts) and summed over a group
    # (docs/design.md, "Secure sums", lists it).
    received = {}
    for method, result in crossed:
        received.setdefault(method, set()).update(set(result) - summed.get(method, set()))
    assert received == {"label_summary": {"h"}, "secure_keys": {"public"}, "secure_neighbours": set(),
                        "set_weights": set(),
                        "secure_bound": {"n", "compute_s", "parts", "exponent"},
                        "secure_self_mask": {"shares", "compute_s"}, "secure_receive": {"compute_s", "reports"},
                        "secure_upload": {"compute_s"}, "secure_reveal": {"shares", "compute_s"},
                        "evaluate": {"correct", "total"}, "personalize": {"compute_s"},
                        "save_personalized": {"bytes"}}
    assert {method: keys for method, keys in summed.items() if keys} == {"secure_upload": {"G", "C"}}
    personal = [r for r in results["rounds"].values() if r["stage"] == "personalization"]
    assert personal and all(set(entry) == {"compute_s", "comm_s", "idle_s", "arrival_s"}
                            for r in personal for entry in r["clients"].values())


def test_a_resumed_secure_run_keeps_the_contributor_rule(rng, tmp_path):
    """The sums unmasked before a checkpoint bind the layers after it: their contributors come back from the
    checkpoint's round records, and client 4, out of layer 1, stays out of layers 2 and 3."""
    from fedlayer.checkpoint import load_checkpoint

    seed = int(rng.integers(2**31))
    path = tmp_path / "checkpoint.npz"
    run_protocol(InProcessTransport(_failing_clients(seed, 9, {4: {("secure_upload", 0)}})), 1, VARIANTS["fedacnnl"],
                 ServerOptions(batch=BatchPolicy(7)), secure=SecureServer(seed=5),
                 checkpoint=Checkpointing(path, {"test": 1}))
    state = load_checkpoint(path, {"test": 1})
    assert state["layers_done"] == 1
    resumed = run_protocol(InProcessTransport(_failing_clients(seed, 9, {})), 3, VARIANTS["fedacnnl"],
                           ServerOptions(batch=BatchPolicy(7)), secure=SecureServer(seed=5),
                           resume=ServerState.from_checkpoint(state))
    assert [r["contributors"] for r in resumed["rounds"]] == [{"0": [[0, 1, 2, 3, 5, 6, 7, 8]]}] * 3
    assert [r["dropped"] for r in resumed["rounds"][1:]] == [{"4": EXCLUDED.format(m=3)}] * 2


def test_sums_pairwise_apart_that_combine_to_one_client_are_not_all_unmasked():
    """Four sums of nine clients, pairwise three or more apart: (S1 + S2 - S3 - S4) / 2 is client 3's counts."""
    from fedlayer.secure import combination_leak

    sets = [range(9), [3, 4, 5, 6, 7], [2, 4, 5, 6, 7, 8], [0, 1, 4, 5, 6, 7]]
    assert close_pairs(sets, 3) == []
    assert combination_leak(sets, 3) == (3,)
    assert combination_leak(sets[:3], 3) is None
    assert combination_leak([range(9), [0, 1, 2, 3, 4, 5, 6]], 3) == (7, 8)  # two apart: 7 and 8 together
    graph = neighbour_graph(range(9), seed=0)  # complete
    chosen = choose_contributors(sets[3], graph, [frozenset(s) for s in sets[:3]], 3)
    assert chosen is None or combination_leak([*sets[:3], chosen], 3) is None


def test_a_failure_after_the_contributors_were_chosen_is_masked_again_over_an_admissible_set(rng):
    """Layer 2 first sums all nine, as layer 1 did; client 4 then fails in its upload. Unmasking the other eight
    would show client 4's counts against layer 1: nothing is revealed, and the survivors mask again (fresh self
    masks, a new context) without two more of them, which layer 2 then sums."""
    seed = int(rng.integers(2**31))
    clients = _failing_clients(seed, 9, {4: {("secure_upload", 1)}})
    result = run_protocol(InProcessTransport(clients), 3, VARIANTS["fedacnnl"], ServerOptions(batch=BatchPolicy(7)),
                          secure=SecureServer(seed=5))
    second = result["rounds"][1]
    (contributors,) = second["contributors"]["0"]
    assert len(contributors) == 6 and 4 not in contributors
    assert second["dropped"]["4"].startswith("secure_upload: RuntimeError")
    excluded = sorted(int(c) for c, why in second["dropped"].items() if why == EXCLUDED.format(m=3))
    assert len(excluded) == 2 and sorted([4, *excluded, *contributors]) == list(range(9))
    assert [r["contributors"] for r in result["rounds"][::2]] == [{"0": [list(range(9))]}] * 2
    # Masked twice, revealed once: the second masking's context.
    assert sum(call == ("secure_upload", 1) for call in clients[0].calls) == (2 if 0 in contributors else 1)
    fail = {c: {("local_stats", 1)} for c in [4, *excluded]}
    plain = run_protocol(InProcessTransport(_failing_clients(seed, 9, fail)), 3, VARIANTS["fedacnnl"],
                         ServerOptions(batch=BatchPolicy(7)))
    _assert_same_weights(plain, result)


def test_a_client_refuses_to_reveal_for_a_sum_too_close_to_one_it_revealed_for(rng):
    cids = list(range(6))
    states, server = _setup(cids, min_survivors=3)
    code = FixedPoint(36, 6)
    data = {c: rng.standard_normal(3) for c in cids}
    _masked_sum(states, server, (0, 0), data, cids, [], code)
    states[0].reveal((0, 0), set(), set(cids))
    _masked_sum(states, server, (1, 0), data, cids[:5], [5], code)
    with pytest.raises(SecureAggregationError, match=r"client 0: the survivors of sum \(1, 0\) differ by 1 client\(s\) "
                                                     r"\(\[5\]\) from those of an earlier sum of the group"):
        states[0].reveal((1, 0), {5}, set(cids[:5]))
    # Another group's sums, and sums at least three apart, are no concern.
    _masked_sum(states, server, (1, 1), data, cids[:5], [5], code)
    assert states[0].reveal((1, 1), {5}, set(cids[:5]))
    _masked_sum(states, server, (2, 0), data, cids[:3], [3, 4, 5], code)
    assert states[0].reveal((2, 0), {3, 4, 5}, set(cids[:3]))
