"""Secure sums: the server learns the sum of the clients' statistics and nothing else of them.

Pairwise additive masking (Bonawitz et al., CCS 2017) on SecAgg+'s sparse
graph (Bell et al., CCS 2020): each client shares keys with k = O(log n)
neighbours of its group instead of all of them, so the work grows as n log n.

* **Encoding.** Statistics are float64; the clients encode them in fixed point
  in Z_2^64 (NumPy's wrapping uint64 arithmetic, two's complement for
  negatives) with ``frac_bits`` fractional bits. The server picks
  ``frac_bits`` per sum from the clients' declared magnitude exponents and the
  number of clients so that the sum cannot wrap (:func:`fraction_bits`); a
  client whose values do not fit its share of the range raises, it never wraps.
  Rounding costs at most 2^-(frac_bits+1) per client and entry
  (:meth:`FixedPoint.error_bound`).
* **Keys.** Two X25519 key pairs per client: a mask key (the pairwise mask
  secrets) and a channel key (the AEAD keys of the shares exchanged through
  the server). Neither ever leaves the client, whole or in shares. HKDF-SHA256 per purpose
  and sum, masks from an AES-128-CTR keystream, shares encrypted with
  ChaCha20-Poly1305 (all from the ``cryptography`` package; NumPy's
  generators are not cryptographic and are never used for secrets). A
  client's public key on the wire is its two public keys, mask key first.
* **Masks.** Client i uploads x_i + PRG(b_i) + sum_{j in N(i), j > i} PRG(s_ij)
  - sum_{j in N(i), j < i} PRG(s_ij): the pairwise masks cancel in the sum,
  the self mask b_i (fresh per sum, shared among i's neighbours still in the
  sum) is removed by the server with shares of b_i from those neighbours once
  i's upload has arrived.
* **Dropouts.** When client j drops out of a sum after the masks were
  agreed (in its upload), each surviving neighbour i gives the server the
  key of that sum's mask between them, HKDF(s_ij, "mask", sum), and the
  server removes it. A client answers for a neighbour either with that
  pairwise key (it dropped) or with its share of the neighbour's self mask
  (it survived), never both, so the server never holds both for one client
  and sum. Bonawitz et al. have the survivors reveal shares of j's mask key
  instead, which suits keys made afresh for every sum; here the mask key is
  the run's, and once rebuilt it would unmask every earlier sum in which j's
  self mask had been revealed (an audit rebuilt a client's first-layer
  statistics that way). A per-sum pairwise key opens that sum only, and
  costs one HKDF. The price: a survivor that masked with a dropped client
  must answer, or the sum cannot be unmasked.
* **Few survivors.** A sum over fewer than ``min_survivors`` clients would
  show the server too much of each of them (over one, all of it): a client
  reveals nothing for such a sum, and the server does not ask
  (:func:`fedlayer.server.run_protocol` solves that group's layer on
  the other groups' sums instead).
* **Who contributes.** Every layer's C holds the contributors' class counts in
  its bias row, so two unmasked sums of a group whose contributors differ by
  one client give that client's class histogram. The server chooses each
  sum's contributors (:func:`choose_contributors`) so that any two unmasked
  sums of a group have the same contributors or contributors at least
  ``min_group_size`` apart, no linear combination of them isolates one or two
  clients (:func:`combination_leak`), and no component of their neighbour
  graph is smaller than that (the pairwise masks cancel inside a component:
  its sum could be decoded alone); the others are left out before masking,
  as if they had dropped. :meth:`SecureServer.unmask` refuses a split graph
  and each client refuses to reveal for a sum too close to one it revealed
  for. The graph's degree (:func:`secagg_degree`) keeps the survivors
  connected at dropout rates up to :data:`SUPPORTED_DROPOUT`.
* **Misbehaving clients.** The server forwards a share only along an edge of
  the graph; a client that cannot open a share reports its sender, which is
  dropped from the sum, and stays in it.

What the server still learns: the sum per group and connected component
(the protocol's output) with its contributors, each client's sample count and
busy time (eq. 7 needs them), and each client's magnitude exponent per sum
(an integer: the power of two above its largest statistic). The label
summaries h_i used for clustering are not protected by this module (see
``docs/design.md``).

The client side is :class:`SecureClientState` (held by each client, never by
the server); the server side is :class:`SecureServer`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import os
import secrets
from types import SimpleNamespace
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["class_means_from_upload", "FixedPoint", "fraction_bits", "neighbour_graph", "threshold", "shamir_split",
           "shamir_combine", "SecureClientState", "SecureServer", "PRIME", "SecureAggregationError",
           "choose_contributors", "close_pairs", "components", "admissible", "combination_leak", "secagg_degree",
           "split_bound"]

#: Shamir shares live in GF(p) for the Mersenne prime 2^521 - 1 (any 32-byte secret fits).
PRIME = 2**521 - 1
_KEY_BYTES = 32
# Mask keys are AES-128 keys: X25519 gives about 128-bit security, which a
# 256-bit mask key cannot raise, and AES-128's 10 rounds make the keystream,
# most of a secure sum's cost, faster than AES-256's 14
# (docs/results/protocol_notes.md).
_MASK_KEY_BYTES = 16
_PUBLIC_BYTES = 32  # one X25519 public key


def _public_parts(bundle):
    """(mask public key, channel public key) of a client's public key bundle."""
    bundle = bytes(bundle)
    if len(bundle) != 2 * _PUBLIC_BYTES:
        raise SecureAggregationError(f"a public key bundle has {2 * _PUBLIC_BYTES} bytes (mask and channel "
                                     f"X25519 keys), got {len(bundle)}")
    return bundle[:_PUBLIC_BYTES], bundle[_PUBLIC_BYTES:]


class SecureAggregationError(RuntimeError):
    """The secure sum cannot be completed (too few shares, a value out of range, a tampered share)."""


@functools.cache
def _crypto():
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as err:  # pragma: no cover - a dependency of the project
        raise ImportError("secure aggregation needs the 'cryptography' package: pip install cryptography") from err
    return SimpleNamespace(hashes=hashes, X25519PrivateKey=X25519PrivateKey, X25519PublicKey=X25519PublicKey,
                           Cipher=Cipher, algorithms=algorithms, modes=modes, ChaCha20Poly1305=ChaCha20Poly1305,
                           HKDF=HKDF)


def class_means_from_upload(C: np.ndarray, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What a server computes from one client's plain first-layer upload: its mean input per class.

    C = X^T Z with X = [x, 1] and Z = Y Q (Q: n_classes x d_1, full row rank),
    so X^T Y = C Q^+: column c holds the sum of the client's inputs of class
    c, and its last (bias) row their count. Returns (means, counts), means of
    shape (n_classes, d_0) (NaN rows for absent classes).
    """
    per_class = np.asarray(C, dtype=np.float64) @ np.linalg.pinv(np.asarray(Q, dtype=np.float64))
    counts = per_class[-1]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = (per_class[:-1] / np.where(np.abs(counts) > 0.5, counts, np.nan)).T
    return means, counts


# ---------------------------------------------------------------------------
# Fixed point in Z_2^64
# ---------------------------------------------------------------------------

class FixedPoint:
    """x -> round(x 2^frac_bits) mod 2^64, for sums of at most ``n_terms`` encoded arrays.

    Parameters
    ----------
    frac_bits : int
        Fractional bits of the encoding.
    n_terms : int
        Arrays that will be summed; each must stay below 2^63 / n_terms in
        magnitude so that their sum cannot wrap.
    """

    def __init__(self, frac_bits: int, n_terms: int) -> None:
        self.frac_bits = int(frac_bits)
        self.n_terms = max(1, int(n_terms))
        self.scale = float(2.0 ** self.frac_bits)
        self.limit = float(2.0 ** 63 / self.n_terms) / self.scale  # largest |x| a term may hold

    def encode(self, x: np.ndarray, name: str = "statistics") -> np.ndarray:
        """float array -> uint64 words; raises when a value does not fit this term's share of the range."""
        x = np.asarray(x, dtype=np.float64)
        words = np.empty(x.shape, dtype=np.uint64)
        self.encode_into(x.reshape(-1), words.reshape(-1), name=name)
        return words

    def fits(self, exponent: int) -> bool:
        """Whether every value below 2^exponent in magnitude encodes without wrapping (with rounding's room)."""
        return 2.0 ** (exponent + 1) <= self.limit

    def encode_into(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None, name: str = "statistics",
                    checked: bool = False) -> np.ndarray:
        """out[:] = the words of float64 ``x`` (1-D, same length); ``scratch``: a float64 buffer at least as long.

        The range is checked on the scaled values (the scale is a power of two,
        so scaling is exact): a NaN, an Inf or a value at or beyond the limit
        raises before ``out`` is written. ``checked``: the caller has shown
        that ``x`` fits (:meth:`fits` of its scanned exponent); no scan.
        """
        with np.errstate(over="ignore"):  # a value that overflows when scaled is refused just below
            scaled = np.multiply(x, self.scale, out=None if scratch is None else scratch[:x.size])
        np.rint(scaled, out=scaled)
        peak = 0.0 if checked else _peak(scaled)
        if not np.isfinite(peak) or peak >= self.limit * self.scale:
            peak = _peak(x)
            raise SecureAggregationError(
                f"{name}: largest magnitude {peak:.6g} does not fit the fixed-point range of this sum "
                f"(|x| < {self.limit:.6g} with {self.frac_bits} fractional bits and {self.n_terms} clients); "
                f"the value would wrap around 2^64")
        np.copyto(out.view(np.int64), scaled, casting="unsafe")
        return out

    def decode(self, words: np.ndarray) -> np.ndarray:
        """uint64 words (a sum of encodings) -> float64."""
        return np.asarray(words, dtype=np.uint64).view(np.int64).astype(np.float64) / self.scale

    def error_bound(self) -> float:
        """Largest |integer sum / scale - true sum| per entry: half a unit in the last place per term.

        The decoded float64 adds its own rounding, half an ulp of the sum
        (larger than this bound only for sums near 2^52 / scale and few terms).
        """
        return self.n_terms * 0.5 / self.scale


def _peak(a):
    """Largest |value| of ``a`` (0 when empty), NaN when it holds one.

    max and -min rather than |a|.max(): no temporary; a NaN propagates through both.
    """
    return max(float(a.max(initial=0.0)), -float(a.min(initial=0.0)))


def fraction_bits(exponents: Sequence[int], n_terms: int, spare_bits: int = 1) -> int:
    """Fractional bits for a sum of ``n_terms`` arrays whose magnitudes stay below 2^exponents[i].

    The sum's magnitude is below n_terms * 2^max(exponents); it must stay below
    2^(63 - spare_bits). Raises when fewer than 8 fractional bits would remain.
    """
    top = max(exponents) if exponents else 0
    bits = 63 - spare_bits - top - math.ceil(math.log2(max(1, n_terms)))
    if bits < 8:
        raise SecureAggregationError(
            f"statistics up to 2^{top} summed over {n_terms} clients leave {bits} fractional bits in 64-bit "
            f"fixed point (need at least 8)")
    return min(bits, 52 + 8)


def magnitude_exponent(arrays: Iterable[np.ndarray]) -> int:
    """Smallest e with every |value| < 2^e over ``arrays`` (what a client declares for the scale)."""
    peak = max((_peak(np.asarray(a)) for a in arrays), default=0.0)
    if not np.isfinite(peak):
        raise SecureAggregationError("statistics hold NaN or Inf; they cannot be encoded")
    return int(math.floor(math.log2(peak))) + 1 if peak > 0 else 0


# ---------------------------------------------------------------------------
# SecAgg+ neighbour graph and Shamir sharing
# ---------------------------------------------------------------------------

#: The dropout rate per client and sum the default graph degree is made for (``--drop-clients`` up to it).
SUPPORTED_DROPOUT = 0.2
#: The chance per sum, at that rate, that the survivors' graph splits, which the default degree stays below.
SPLIT_FAILURE = 1e-6


def split_bound(n: int, degree: int, dropout: float) -> float:
    """Upper bound on the chance that the survivors' part of the Harary graph is disconnected.

    Each of ``n`` clients drops independently with probability ``dropout``.
    On the ring of :func:`neighbour_graph` each client is joined to the
    h = degree // 2 nearest on either side, so consecutive survivors are
    joined unless at least h clients between them all dropped; a survivor
    beyond such a gap is farther still. The survivors' graph therefore splits
    only where two disjoint runs of h dropped clients cut the ring: at most
    n^2 / 2 pairs of starting positions, each all dropped with probability
    dropout^(2h). A complete graph (degree n - 1) never splits.
    """
    if degree >= n - 1:
        return 0.0
    return min(1.0, n * n / 2 * float(dropout) ** (2 * (degree // 2)))


def secagg_degree(n: int, dropout: float = SUPPORTED_DROPOUT, failure: float = SPLIT_FAILURE) -> int:
    """The SecAgg+ degree of a group of ``n``: at least 2 ceil(log2 n), and :func:`split_bound` <= ``failure``.

    For 100 clients at a dropout rate of 0.2 both give 14; for the 10-13
    clients of a pFedACnnL group the bound asks for 12 or more, so those
    groups get the complete graph (degree n - 1).
    """
    if n <= 1:
        return 0
    degree = 2 * math.ceil(math.log2(n))
    while degree < n - 1 and split_bound(n, degree, dropout) > failure:
        degree += 2
    return min(n - 1, max(2, degree))


def components(graph: Mapping[int, Sequence[int]], members: Iterable[int]) -> list[list[int]]:
    """The connected components of ``graph`` (cid -> neighbours) restricted to ``members``, each a sorted list.

    Components are listed by their smallest member. The server can decode
    the sum of each one separately (the pairwise masks cancel inside it), so
    each is a sum it learns.
    """
    members = set(int(c) for c in members)
    seen, parts = set(), []
    for start in sorted(members):
        if start in seen:
            continue
        seen.add(start)
        part, frontier = [start], [start]
        while frontier:
            cid = frontier.pop()
            for other in graph.get(cid, ()):
                if other in members and other not in seen:
                    seen.add(other)
                    part.append(other)
                    frontier.append(other)
        parts.append(sorted(part))
    return parts


def close_pairs(sets: Sequence[frozenset], min_size: int) -> list[tuple[int, int]]:
    """Pairs (i, j), i < j, of ``sets`` that differ by 1 to ``min_size`` - 1 clients (symmetric difference).

    The difference of two such sums is the statistics of those few clients
    (of one, when a set is the other less one client): the server must
    never unmask both.
    """
    sets = [frozenset(s) for s in sets]
    return [(i, j) for i in range(len(sets)) for j in range(i + 1, len(sets))
            if 0 < len(sets[i] ^ sets[j]) < min_size]


def combination_leak(sets: Sequence[frozenset], min_size: int) -> tuple[int, ...] | None:
    """Clients (one, or two when ``min_size`` > 2) whose statistics a linear combination of the sums over
    ``sets`` isolates, or None.

    The layer-independent parts of the sums (the class counts in C's bias row,
    the sample count in G's) add up the same way in every layer, so the
    server holds sum_S a_S 1_S . counts for any coefficients a_S: a client's
    counts are exposed when its indicator e_i lies in the span of the sets'
    indicators, and the counts of two clients (their sum, or difference) when
    a nonzero vector supported on them does. With Q the projection on the
    span's orthogonal complement, e_i is in the span iff Q_ii = 0, and some
    vector on {i, j} iff Q_ii Q_jj - Q_ij^2 = 0. Sets pairwise at least
    ``min_size`` apart can still combine so: all of 0..8, {3..7}, {2, 4..8}
    and {0, 1, 4..7} are pairwise three or more apart, and half the first two
    sums less the last two is client 3's counts. Supports of three or more
    clients are not searched.
    """
    sets = list({frozenset(s) for s in sets})
    if not sets:
        return None
    cids = sorted(set().union(*sets))
    M = np.array([[c in s for c in cids] for s in sets], dtype=np.float64)
    _, singular, vt = np.linalg.svd(M, full_matrices=False)
    basis = vt[singular > 1e-9 * singular[0]]
    Q = np.eye(len(cids)) - basis.T @ basis
    diagonal = np.diag(Q)
    alone = np.flatnonzero(diagonal < 1e-9)
    if alone.size:
        return (cids[alone[0]],)
    if min_size > 2:
        minors = np.outer(diagonal, diagonal) - Q * Q
        np.fill_diagonal(minors, np.inf)
        i, j = np.unravel_index(np.argmin(minors), minors.shape)
        if minors[i, j] < 1e-9:
            return (cids[min(i, j)], cids[max(i, j)])
    return None


def admissible(candidate: Iterable[int], graph: Mapping[int, Sequence[int]], history: Sequence[frozenset],
               min_size: int) -> bool:
    """Whether unmasking a sum over ``candidate`` keeps every rule: components of at least ``min_size``, each
    (and the whole) equal to or at least ``min_size`` clients away from every set in ``history``, and no
    linear combination of them and ``history`` that isolates one or two clients (:func:`combination_leak`)."""
    return _broken(candidate, graph, history, min_size) == 0


def _broken(candidate, graph, history, min_size):
    """How many of the rules of :func:`admissible` a sum over ``candidate`` breaks (0: none), counted so that
    removing clients one at a time can be steered towards 0: clients in too small components, pairs of sets too
    close, and one for a linear combination that isolates clients."""
    if not candidate:
        return 1
    parts = components(graph, candidate)
    learned = {frozenset(candidate), *map(frozenset, parts)}
    broken = sum(len(part) for part in parts if len(part) < min_size)
    broken += sum(1 for s in learned for p in history if s != p and len(s ^ p) < min_size)
    if broken == 0 and not learned <= set(history):
        broken += combination_leak([*history, *learned], min_size) is not None
    return broken


def choose_contributors(alive: Sequence[int], graph: Mapping[int, Sequence[int]], history: Sequence[frozenset],
                        min_size: int) -> list[int] | None:
    """The clients whose sum the server may unmask, out of those able to take part (``alive``); None if none.

    The rules (docs/design.md, "Secure sums"): every connected component of
    the contributors' neighbour graph has at least ``min_size`` clients, and
    the contributors (and each component) are equal to, or differ by at
    least ``min_size`` clients from, every set of the group's earlier
    unmasked sums (``history``), and no linear combination of all of them
    isolates one or two clients (:func:`combination_leak`). The others are
    excluded as if they had dropped before masking: they mask nothing, so
    nothing of theirs is revealed. Largest admissible set wins: the greedy removal below (the
    client whose removal leaves the fewest broken rules, ties by id) or an
    earlier contributor set still alive (preferred at equal size: it tells
    the server nothing new).
    """
    history = [frozenset(p) for p in history]
    alive = frozenset(int(c) for c in alive)
    candidates = [p for p in set(history) if p <= alive and admissible(p, graph, history, min_size)]
    current = set(alive)
    while len(current) >= min_size:
        if admissible(current, graph, history, min_size):
            candidates.append(frozenset(current))
            break
        current.remove(min(current, key=lambda c: (_broken(current - {c}, graph, history, min_size), c)))
    if not candidates:
        return None
    return sorted(max(candidates, key=lambda s: (len(s), s in history, sorted(-c for c in s))))


def neighbour_graph(cids: Iterable[int], seed: int | bytes, degree: int | None = None) -> dict[int, list[int]]:
    """Each client's neighbours: a Harary graph (ring with k/2 nearest on each side) over a seeded permutation.

    ``degree`` defaults to :func:`secagg_degree` (2 ceil(log2 n), more where
    the dropouts the docs support could split the survivors' graph), so the
    masks and shares of a sum cost O(n log n).
    """
    cids = sorted(int(c) for c in cids)
    n = len(cids)
    if n <= 1:
        return {cid: [] for cid in cids}
    if degree is None:
        degree = secagg_degree(n)
    degree = min(n - 1, max(2, int(degree)))
    # The graph is public (the server draws it), so a seeded NumPy permutation is fine here.
    seeds = [int(v) for v in np.atleast_1d(seed)]
    order = [cids[i] for i in np.random.default_rng([*seeds, 0x5EC]).permutation(n)]
    position = {cid: i for i, cid in enumerate(order)}
    graph = {}
    half = degree // 2
    for cid in cids:
        i = position[cid]
        near = {order[(i + step) % n] for step in range(1, half + 1)} | {order[(i - step) % n]
                                                                       for step in range(1, half + 1)}
        if degree % 2 and n % 2 == 0:
            near.add(order[(i + n // 2) % n])
        near.discard(cid)
        graph[cid] = sorted(near)
    return graph


def threshold(degree: int) -> int:
    """Shares needed to rebuild a secret of a client with ``degree`` neighbours: a strict majority."""
    return degree // 2 + 1


def shamir_split(secret: bytes, n_shares: int, t: int) -> list[tuple[int, int]]:
    """``n_shares`` points (x, y) of a random degree t-1 polynomial over GF(PRIME) with f(0) = secret (bytes)."""
    value = int.from_bytes(secret, "big")
    coefficients = [value] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    shares = []
    for x in range(1, n_shares + 1):
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        shares.append((x, y))
    return shares


def _polynomial(points):
    """x -> the polynomial through ``points`` ((x_i, y_i), distinct x_i) at x, over GF(PRIME).

    Lagrange's form with its denominators inverted once: each evaluation is
    then t^2 multiplications and no inverse (the inverses dominate).
    """
    weights = []
    for i, (xi, yi) in enumerate(points):
        den = 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                den = den * (xi - xj) % PRIME
        weights.append(yi * pow(den, -1, PRIME) % PRIME)

    def at(x):
        value = 0
        for i, weight in enumerate(weights):
            for j, (xj, _) in enumerate(points):
                if i != j:
                    weight = weight * (x - xj) % PRIME
            value += weight
        return value % PRIME

    return at


def shamir_combine(shares: Sequence[tuple[int, int]], length: int = _KEY_BYTES, t: int | None = None) -> bytes:
    """The secret (``length`` bytes) from at least t shares, by Lagrange interpolation at 0.

    With ``t`` and more than t shares, the first t rebuild the polynomial and
    every other share must lie on it: a tampered or mixed share then raises
    SecureAggregationError instead of rebuilding a wrong secret. Repeated
    share indices raise too.
    """
    xs = [x for x, _ in shares]
    if len(set(xs)) != len(xs):
        raise SecureAggregationError(f"shares with repeated indices {sorted(xs)} (tampered or mixed)")
    used = shares if t is None else shares[:t]
    polynomial = _polynomial(used)
    for x, y in shares[len(used):]:
        if polynomial(x) != y % PRIME:
            raise SecureAggregationError(f"share {x} does not lie on the polynomial of the others (tampered or mixed)")
    secret = polynomial(0)
    if secret >= 2 ** (8 * length):
        raise SecureAggregationError("shares do not rebuild a secret of the expected size (tampered or mixed)")
    return secret.to_bytes(length, "big")


# ---------------------------------------------------------------------------
# Key derivation and keystreams
# ---------------------------------------------------------------------------

def _context_bytes(context):
    return repr(context).encode()


def _derive(shared, purpose, context=None, length=_KEY_BYTES):
    crypto = _crypto()
    info = b"fedlayer " + purpose + (b" " + _context_bytes(context) if context is not None else b"")
    return crypto.HKDF(algorithm=crypto.hashes.SHA256(), length=length, salt=None, info=info).derive(shared)


def _mask_key(secret, purpose, context):
    """The AES-128 key of one mask: HKDF of a pairwise or self-mask secret, per purpose and sum."""
    return _derive(secret, purpose, context, length=_MASK_KEY_BYTES)


def keystream_words(key: bytes, n_words: int) -> np.ndarray:
    """``n_words`` uint64 words of the AES-CTR keystream under ``key``, counter from 0.

    AES-128 for a 16-byte key (the masks' keys), AES-256 for a 32-byte one.
    AES-CTR rather than ChaCha20: with AES-NI it runs faster
    (docs/results/protocol_notes.md), and the keystream is most of a
    secure sum's cost. Every key is used for one keystream only (HKDF per
    pair and sum).
    """
    return np.frombuffer(_keystream(key).update(bytes(8 * n_words)), dtype=np.uint64)  # zeros in: the keystream out


def _keystream(key, first_block=0):
    """An AES-CTR encryptor under ``key`` (16 or 32 bytes), its counter at block ``first_block``.

    Encrypting zeros yields the keystream.
    """
    crypto = _crypto()
    return crypto.Cipher(crypto.algorithms.AES(key), crypto.modes.CTR(first_block.to_bytes(16, "big"))).encryptor()


_CHUNK_WORDS = 1 << 15  # 256 KiB: a chunk of the sum and of one keystream stay in L2 together
_ZEROS = bytes(8 * _CHUNK_WORDS)
# Below this many words one thread masks the whole vector: starting a second costs more than its share.
_PARALLEL_WORDS = 4 * _CHUNK_WORDS


def _add_masks(flat, key_sign_pairs, sources=(), code=None, checked=False):
    """flat += sum of sign * PRG(key) over the pairs, in Z_2^64 (in place); returns ``flat``.

    With ``sources``, (offset, 1-D float64 array) pieces that tile ``flat``, and
    ``code`` (:class:`FixedPoint`), flat is first set to ``code``'s encoding of
    the pieces in the same pass (``checked``: their range is known to fit, skip
    the scan).

    The same words as adding each :func:`keystream_words` in turn, chunk by
    chunk: every keystream is written into one reused buffer and added while
    the chunk of ``flat`` is still in cache, instead of streaming ``flat`` and
    a fresh keystream through memory once per pair. Large vectors are split
    into spans of whole chunks, one per thread the caller's core limit allows
    (``fastls.tuning.threads_for``); each span's encryptors start at the span's
    counter block, and AES-CTR and NumPy's additions release the GIL.
    """
    from fastls.tuning import threads_for

    n_words = flat.size
    n_chunks = -(-n_words // _CHUNK_WORDS)
    threads = 1 if n_words < _PARALLEL_WORDS else min(threads_for(8.0 * n_words * len(key_sign_pairs)), n_chunks)
    cuts = [_CHUNK_WORDS * (n_chunks * i // threads) for i in range(threads)] + [n_words]
    zeros = memoryview(_ZEROS)

    def mask_span(span):
        lo, hi = span
        # A chunk is a whole number of 16-byte blocks, so a span starts on a block.
        streams = [(_keystream(key, lo // 2), sign > 0) for key, sign in key_sign_pairs]
        buffer = bytearray(8 * _CHUNK_WORDS + 15)  # update_into wants room for a block beyond the data
        scratch = np.empty(_CHUNK_WORDS) if sources else None
        for start in range(lo, hi, _CHUNK_WORDS):
            stop = min(start + _CHUNK_WORDS, hi)
            part = flat[start:stop]
            for offset, piece in sources:  # the pieces under this chunk, encoded in place
                a, b = max(offset, start), min(offset + piece.size, stop)
                if a < b:
                    code.encode_into(piece[a - offset:b - offset], flat[a:b], scratch, checked=checked)
            for encryptor, add in streams:
                encryptor.update_into(zeros[:8 * part.size], buffer)
                words = np.frombuffer(buffer, dtype=np.uint64, count=part.size)
                if add:
                    part += words
                else:
                    part -= words

    spans = list(zip(cuts[:-1], cuts[1:]))
    if threads == 1:
        mask_span(spans[0])
    else:
        list(_mask_pool().map(mask_span, spans))  # list(): re-raises a span's error here
    return flat


@functools.cache
def _mask_pool():
    """Threads for the masks' spans, started once per process (a start costs about as much as a chunk)."""
    from fastls import available_cores

    return concurrent.futures.ThreadPoolExecutor(max(2, available_cores()), thread_name_prefix="fedlayer-masks")


def _layout(shapes):
    """Offsets of each entry in the flat word vector (entries in sorted key order)."""
    offsets, start = {}, 0
    for key in sorted(shapes):
        size = int(np.prod(shapes[key]))  # 1 for a 0-d entry (a scalar statistic)
        offsets[key] = (start, start + size)
        start += size
    return offsets, start


def _share_plaintext(owner, to, what, context, x, y):
    """A share and what it is for, as JSON (context: a tuple of ints)."""
    return json.dumps([int(owner), int(to), what, [int(v) for v in context], int(x), int(y)]).encode()


def _parse_share(plain, sender):
    """(owner, to, what, context, x, y) from :func:`_share_plaintext`; raises on anything else."""
    try:
        owner, to, what, context, x, y = json.loads(plain)
        fields_ok = (all(type(v) is int for v in (owner, to, x, y)) and what == "self"
                     and isinstance(context, list) and all(type(v) is int for v in context))
    except (ValueError, TypeError):
        fields_ok = False
    if not fields_ok:
        raise SecureAggregationError(f"the share from client {sender} is not (owner, to, what, context, x, y)")
    return owner, to, what, None if context is None else tuple(context), x, y


# ---------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------

class SecureClientState:
    """A client's secrets and the shares it holds for its neighbours; lives with the client only."""

    def __init__(self, cid: int, min_survivors: int = 1) -> None:
        self.cid = int(cid)
        self.min_survivors = int(min_survivors)
        self._private = _crypto().X25519PrivateKey.generate()   # the mask key (never leaves this client)
        self._channel = _crypto().X25519PrivateKey.generate()   # the channel key (never leaves this client)
        self.neighbours = []
        self._public = {}        # neighbour -> its public key bundle (mask key, channel key)
        self._held = {}          # (owner, what, context) -> (x, y) share it holds for the owner
        self._self_masks = {}    # context -> b_i
        self._answered = {}      # (owner, context) -> "pair" or "self": what it revealed for the owner
        self._agreed = {}        # neighbour -> mask-key shared secret (one exchange per pair of mask keys)
        self._ciphers = {}       # neighbour -> the AEAD of the shares exchanged with it (channel keys)
        self._masked_with = {}   # context -> the neighbours this client's upload of that sum is masked with
        self._unmasked = {}      # group -> the contributor sets of the sums it revealed for (differencing rule)

    def public_key(self) -> bytes:
        """The public key bundle: the mask key's public key, then the channel key's (64 bytes)."""
        return (self._private.public_key().public_bytes_raw()
                + self._channel.public_key().public_bytes_raw())

    def _shared(self, other):
        if other not in self._agreed:
            mask_public, _ = _public_parts(self._public[other])
            self._agreed[other] = self._private.exchange(_crypto().X25519PublicKey.from_public_bytes(mask_public))
        return self._agreed[other]

    def _aead(self, other):
        # Derived once per pair: every round's shares are sealed under it with a fresh random nonce.
        if other not in self._ciphers:
            _, channel_public = _public_parts(self._public[other])
            shared = self._channel.exchange(_crypto().X25519PublicKey.from_public_bytes(channel_public))
            self._ciphers[other] = _crypto().ChaCha20Poly1305(_derive(shared, b"shares"))
        return self._ciphers[other]

    def set_neighbours(self, public_keys: Mapping[int, bytes]) -> None:
        """Neighbour -> public key bundle. No key is shared: a dropout's masks are removed per sum (:meth:`reveal`)."""
        self.neighbours = sorted(int(c) for c in public_keys)
        self._public = {int(c): bytes(k) for c, k in public_keys.items()}
        self._agreed, self._ciphers = {}, {}

    def _encrypted_shares(self, secret, what, context, holders):
        """Shamir shares of ``secret`` for ``holders``, threshold over their number."""
        t = threshold(len(holders))
        shares = shamir_split(secret, len(holders), t)
        out = {}
        for other, (x, y) in zip(holders, shares):
            nonce = os.urandom(12)
            plain = _share_plaintext(self.cid, other, what, context, x, y)
            out[other] = nonce + self._aead(other).encrypt(nonce, plain, None)
        return out

    def receive_shares(self, ciphertexts: Mapping[int, bytes], context: tuple | None = None) -> dict[int, str]:
        """Sender -> ciphertext addressed to this client (shares of self masks): decrypted and kept.

        Returns sender -> why its share could not be opened (not a neighbour,
        does not authenticate, not a share, a share of something else): the
        server drops those senders from the sum, and this client stays in it.
        Raising instead would let any client remove a chosen neighbour from a
        chosen sum by sending it garbage. ``context``: the sum the shares are
        for (None: any).
        """
        reports = {}
        for sender, blob in ciphertexts.items():
            sender = int(sender)
            if sender not in self._public:
                reports[sender] = f"client {self.cid}: a share from {sender}, which is not a neighbour"
                continue
            try:
                plain = self._aead(sender).decrypt(bytes(blob[:12]), bytes(blob[12:]), None)
            except Exception as err:
                reports[sender] = (f"client {self.cid}: the share from client {sender} does not authenticate "
                                   f"({type(err).__name__})")
                continue
            try:
                owner, to, what, got, x, y = _parse_share(plain, sender)
            except SecureAggregationError as err:
                reports[sender] = f"client {self.cid}: {err}"
                continue
            if owner != sender or to != self.cid or (context is not None and got != tuple(context)):
                expected = None if context is None else tuple(context)
                reports[sender] = (f"client {self.cid}: a share from {sender} names {owner} -> {to} for sum {got}, "
                                   f"expected {sender} -> {self.cid} for sum {expected}")
                continue
            self._held[(owner, what, got)] = (x, y)
        return reports

    def new_self_mask(self, context: tuple, members: Iterable[int] | None = None) -> dict[int, bytes]:
        """A fresh self mask for sum ``context``; returns its shares, encrypted per neighbour.

        ``members``: the clients taking part in the sum; the shares go to the
        neighbours among them (threshold over their number), since only they
        can reveal for it. Neighbours already out of the sum would otherwise
        hold shares nobody can use, and the self mask of a client with many
        of those could not be rebuilt.
        """
        holders = self.neighbours if members is None else [c for c in self.neighbours if c in set(members)]
        if not holders:
            raise SecureAggregationError(f"client {self.cid}: none of its neighbours takes part in sum {context}: "
                                         "its self mask could not be removed")
        self._self_masks[context] = secrets.token_bytes(_KEY_BYTES)
        return self._encrypted_shares(self._self_masks[context], "self", context, holders)

    def mask(self, context: tuple, entries: Mapping[str, np.ndarray], members: Iterable[int],
             code: FixedPoint | None = None, exponent: int | None = None) -> dict[str, np.ndarray]:
        """The encoded entries plus the self mask and the pairwise masks with the neighbours in ``members``.

        ``entries``: key -> uint64 words, or, with ``code`` (a :class:`FixedPoint`),
        key -> float arrays that are encoded in the masking pass (raises
        :class:`SecureAggregationError` naming the entry that does not fit).
        ``exponent``: the one this client scanned and declared for these
        entries (:func:`magnitude_exponent`); when ``code`` fits it, the
        encoding skips its own range scan.
        """
        shapes = {key: np.shape(w) for key, w in entries.items()}
        offsets, n_words = _layout(shapes)
        flat = np.empty(n_words, dtype=np.uint64)
        sources = []
        for key, (a, b) in offsets.items():
            if code is None:
                flat[a:b] = np.asarray(entries[key], dtype=np.uint64).reshape(-1)
            else:
                sources.append((a, np.asarray(entries[key], dtype=np.float64).reshape(-1)))
        checked = code is not None and exponent is not None and code.fits(exponent)
        pairs = [(_mask_key(self._self_masks.pop(context), b"self mask", context), +1)]
        members = set(members)
        self._masked_with[context] = {other for other in self.neighbours if other in members}
        for other in sorted(self._masked_with[context]):
            pairs.append((_mask_key(self._shared(other), b"mask", context), +1 if other > self.cid else -1))
        try:
            _add_masks(flat, pairs, sources, code, checked)
        except SecureAggregationError:
            for key, (a, b) in offsets.items():  # name the entry that does not fit
                try:
                    code.encode_into(np.asarray(entries[key], dtype=np.float64).reshape(-1), flat[a:b],
                                     name=f"client {self.cid} {key}")
                except SecureAggregationError:
                    # This message reaches the server as the dropout's reason: the entry, not its values.
                    raise SecureAggregationError(
                        f"client {self.cid} {key}: a value is not finite or does not fit the sum's fixed point "
                        f"({code.frac_bits} fractional bits, {code.n_terms} clients); it would wrap") from None
            raise
        return {key: flat[a:b].reshape(shapes[key]) for key, (a, b) in offsets.items()}

    def reveal(self, context: tuple, dropped: set[int], survivors: set[int]) -> dict:
        """What the server needs for sum ``context``, per neighbour: for a dropped one, the key of this sum's mask
        between the two; for a surviving one, this client's share of its self mask.

        A pairwise key is derived per sum (HKDF), so it opens that sum's mask
        only; it is revealed only for a neighbour this client's upload of the
        sum was masked with. Refuses (:class:`SecureAggregationError`, nothing
        revealed) a sum of fewer than ``min_survivors`` clients, a sum whose
        survivors differ by 1 to ``min_survivors`` - 1 clients from those of
        an earlier sum of the same group (``context[1]``) it revealed for
        (their difference would be those clients' statistics), and both
        answers for one neighbour in one sum.
        """
        if len(survivors) < self.min_survivors:
            raise SecureAggregationError(
                f"client {self.cid}: sum {context} has {len(survivors)} survivor(s), fewer than the "
                f"{self.min_survivors} it reveals shares for (the sum would show each of them); refused")
        contributors = frozenset(int(c) for c in survivors)
        earlier = self._unmasked.setdefault(context[1] if len(context) > 1 else None, [])
        for other in earlier:
            if contributors != other and len(contributors ^ other) < self.min_survivors:
                raise SecureAggregationError(
                    f"client {self.cid}: the survivors of sum {context} differ by {len(contributors ^ other)} "
                    f"client(s) ({sorted(contributors ^ other)}) from those of an earlier sum of the group it "
                    f"revealed for; expected none or at least {self.min_survivors}; refused")
        masked_with = self._masked_with.get(context, set())
        asked = []
        for owner in self.neighbours:
            if owner in dropped:
                if owner not in masked_with:
                    continue  # no mask of this sum between the two: nothing to remove
                what = "pair"
            elif owner in survivors:
                what = "self"
            else:
                continue
            if self._answered.get((owner, context), what) != what:
                raise SecureAggregationError(f"client {self.cid}: the server asked for both secrets of client "
                                             f"{owner} in sum {context}; refused")
            asked.append((owner, what))
        if contributors not in earlier:
            earlier.append(contributors)
        out = {}
        for owner, what in asked:  # checked whole first: a refusal reveals nothing
            self._answered[(owner, context)] = what
            if what == "pair":
                out[owner] = ("pair", _mask_key(self._shared(owner), b"mask", context))
            else:
                share = self._held.get((owner, "self", context))
                if share is not None:
                    out[owner] = ("self", share)
        return out


# ---------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------

class SecureServer:
    """What the server does for a secure sum: graph, routing of encrypted shares, unmasking.

    It only ever holds public keys, ciphertexts it cannot read, the masked
    sums, and (after a sum) the self-mask shares and per-sum pairwise keys
    the survivors reveal.
    """

    def __init__(self, seed: int, degree: int | None = None, min_group_size: int = 3) -> None:
        self.seed = int(seed)
        self.degree = degree
        self.min_group_size = int(min_group_size)
        self.graph = {}
        self.public = {}

    def plan(self, groups: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """groups: group -> member cids. Neighbours are chosen within each group (sums are per group)."""
        self.graph = {}
        for k, members in groups.items():
            self.graph.update(neighbour_graph(members, [self.seed, k], self.degree))
        return self.graph

    def route(self, outgoing: Mapping[int, Mapping[int, bytes]], members: Iterable[int] | None = None
              ) -> tuple[dict[int, dict[int, bytes]], dict[int, str]]:
        """sender -> {receiver: ciphertext} into (receiver -> {sender: ciphertext}, offenders).

        A share is forwarded only along an edge of the neighbour graph, to a
        client of ``members`` (default: any): an honest client sends nothing
        else, and a blob forwarded anywhere else would let one client reach
        (and, before this check, knock out) any other. ``offenders``:
        sender -> why some of its shares were not forwarded.
        """
        members = None if members is None else {int(c) for c in members}
        incoming, offenders = {}, {}
        for sender, per_receiver in outgoing.items():
            sender = int(sender)
            allowed = set(self.graph.get(sender, ()))
            for receiver, blob in per_receiver.items():
                receiver = int(receiver)
                if receiver not in allowed or (members is not None and receiver not in members):
                    offenders[sender] = (f"sent a share to client {receiver}, which is not its neighbour in the sum; "
                                         "not forwarded")
                    continue
                incoming.setdefault(receiver, {})[sender] = blob
        return incoming, offenders

    def unmask(self, context: tuple, masked: Mapping[str, np.ndarray], survivors: Sequence[int], dropped: Sequence[int],
               revealed: Mapping[int, dict], members: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """The plain sum of the survivors' encoded entries, from the masked sum and what the survivors revealed.

        Parameters
        ----------
        masked : dict key -> uint64 array (the sum of the survivors' uploads)
        survivors, dropped : lists of cids (dropped: after the masks were agreed)
        revealed : dict revealer -> {owner: ("self", share) or ("pair", key of this sum's mask between them)}
        members : list of cids, optional
            The clients the self masks were shared among (their threshold is
            over a client's neighbours among them); default: all neighbours.
        """
        if len(survivors) < self.min_group_size:
            raise SecureAggregationError(f"sum {context}: {len(survivors)} survivor(s), fewer than min_group_size="
                                         f"{self.min_group_size}; not unmasked")
        small = [part for part in components(self.graph, survivors) if len(part) < self.min_group_size]
        if small:
            # The pairwise masks cancel inside each component: the server could decode each one's sum.
            raise SecureAggregationError(
                f"sum {context}: the survivors' neighbour graph splits into a component of {len(small[0])} "
                f"client(s) {small[0]}, fewer than min_group_size={self.min_group_size} (its sum could be decoded "
                f"alone); not unmasked")
        shapes = {key: np.shape(w) for key, w in masked.items()}
        offsets, n_words = _layout(shapes)
        flat = np.empty(n_words, dtype=np.uint64)
        for key, (a, b) in offsets.items():
            flat[a:b] = np.asarray(masked[key], dtype=np.uint64).reshape(-1)
        self_shares = {}  # owner -> the shares of its self mask the survivors revealed
        for _revealer, shares in revealed.items():
            for owner, (what, share) in shares.items():
                if what == "self":
                    self_shares.setdefault(int(owner), []).append(share)
        survivors_set = set(survivors)
        pairs = []
        members = None if members is None else set(members)
        for cid in survivors:
            holders = None if members is None else [c for c in self.graph.get(cid, []) if c in members]
            secret = self._rebuild(self_shares.get(cid, []), cid, holders)
            pairs.append((_mask_key(secret, b"self mask", context), -1))
        for cid in dropped:
            for other in self.graph.get(cid, []):
                if other in survivors_set:
                    answer = revealed.get(other, {}).get(cid)
                    if answer is None or answer[0] != "pair":
                        raise SecureAggregationError(
                            f"sum {context}: client {other} did not reveal the key of its mask with client {cid}, "
                            f"which dropped out after masking: that mask cannot be removed")
                    # Survivor `other` added sign(cid - other) PRG(key); take it back out.
                    pairs.append((bytes(answer[1]), -1 if cid > other else +1))
        _add_masks(flat, pairs)
        return {key: flat[a:b].reshape(shapes[key]) for key, (a, b) in offsets.items()}

    def _rebuild(self, shares, cid, holders=None):
        """Client ``cid``'s self-mask seed from the revealed ``shares`` of it."""
        k = len(self.graph.get(cid, []) if holders is None else holders)
        t = threshold(k)
        if len(shares) < t:
            raise SecureAggregationError(
                f"client {cid}: {len(shares)} of its neighbours revealed a share of its self mask, {t} are needed "
                f"(threshold t = k // 2 + 1 of k = {k} neighbours{'' if holders is None else ' in the sum'}); "
                f"too many of them dropped out")
        try:
            # Every revealed share is checked against the first t (a share of another secret, or a changed
            # one, would rebuild a wrong mask and decode garbage).
            return shamir_combine(shares, t=t)
        except SecureAggregationError as err:
            raise SecureAggregationError(f"client {cid}: the revealed shares of its self mask: {err}") from None
