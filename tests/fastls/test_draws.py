"""fastls.normal_rows: the counter-based N(0, 1) stream against a pure-Python reference, its law, its refusals."""

import math

import numpy as np
import pytest
from scipy import stats

import fastls

MASK = (1 << 64) - 1
SECOND = 0xD1B54A32D192ED03
R, V = 3.6541528853610088, 0.00492867323399


def mix(z):
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def gamma(key):
    """SplitMix64's mixGamma: an odd increment of the stream's own."""
    z = key ^ 0x5851F42D4C957F2D
    z = ((z ^ (z >> 33)) * 0xFF51AFD7ED558CCD) & MASK
    z = ((z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53) & MASK
    z = (z ^ (z >> 33)) | 1
    return z ^ 0xAAAAAAAAAAAAAAAA if bin(z ^ (z >> 1)).count("1") < 24 else z


def tables():
    """Marsaglia and Tsang's 256-layer ziggurat tables, in doubles."""
    ki, wi, fi = [0] * 256, [0.0] * 256, [0.0] * 256
    dn = tn = R
    q = V / math.exp(-0.5 * dn * dn)
    ki[0], ki[1] = int((dn / q) * 2.0**52), 0
    wi[0], wi[255] = q / 2.0**52, dn / 2.0**52
    fi[0], fi[255] = 1.0, math.exp(-0.5 * dn * dn)
    for i in range(254, 0, -1):
        dn = math.sqrt(-2.0 * math.log(V / dn + math.exp(-0.5 * dn * dn)))
        ki[i + 1] = int((dn / tn) * 2.0**52)
        tn = dn
        fi[i] = math.exp(-0.5 * dn * dn)
        wi[i] = dn / 2.0**52
    return ki, wi, fi


KI, WI, FI = tables()


def abscissa(r):
    idx, r = r & 0xFF, r >> 8
    rabs = (r >> 1) & 0x000FFFFFFFFFFFFF
    x = rabs * WI[idx]
    return idx, rabs, (-x if r & 1 else x)


def unit(word):
    return (word >> 11) * (1.0 / 9007199254740992.0)


def reference_normal(key, index):
    """Draw ``index`` of stream ``key``, as the kernel's docstring describes it, one Python int at a time."""
    idx, rabs, x = abscissa(mix(key + (index + 1) * gamma(key)))
    if rabs < KI[idx]:
        return x, False
    second = key ^ SECOND
    step = gamma(second)
    base, k = second + (index << 6) * step, 0
    word = lambda k: mix(base + k * step)  # noqa: E731
    while True:
        if idx == 0:
            while True:
                xx = -math.log1p(-unit(word(k + 1))) / R
                yy = -math.log1p(-unit(word(k + 2)))
                k += 2
                if yy + yy > xx * xx:
                    return (-(R + xx) if (rabs >> 8) & 1 else R + xx), True
        k += 1
        if (FI[idx - 1] - FI[idx]) * unit(word(k)) + FI[idx] < math.exp(-0.5 * x * x):
            return x, True
        k += 1
        idx, rabs, x = abscissa(word(k))
        if rabs < KI[idx]:
            return x, True


@pytest.mark.parametrize("key", [0, 12345, (1 << 64) - 1])
def test_draws_equal_the_python_reference_bit_for_bit(key, rng):
    start = int(rng.integers(0, 1 << 57))
    out = np.empty((3, 1500))
    sumsq = fastls.normal_rows(out, key, start)
    expected = [reference_normal(key, start + i) for i in range(out.size)]
    assert sum(retried for _, retried in expected) > 5  # the second tries are exercised too
    assert np.array_equal(out.ravel(), [x for x, _ in expected])
    assert np.allclose(sumsq, (out * out).sum(axis=1), rtol=1e-13, atol=0)


def test_draws_follow_the_standard_normal_law():
    out = np.empty((4, 500_000))
    fastls.normal_rows(out, 2026, 0)
    x = out.ravel()
    assert stats.kstest(x, "norm").pvalue > 1e-3
    assert abs(x.mean()) < 4 / math.sqrt(x.size) and abs(x.var() - 1) < 6 * math.sqrt(2 / x.size)
    # The tail beyond the ziggurat's base, drawn by the exponential method: its frequency and its shape.
    tail = np.abs(x[np.abs(x) > R])
    expected = 2 * stats.norm.sf(R) * x.size
    assert abs(len(tail) - expected) < 5 * math.sqrt(expected)
    assert stats.kstest(tail, lambda t: 1 - stats.norm.sf(t) / stats.norm.sf(R)).pvalue > 1e-3


def test_a_stream_filled_in_pieces_is_the_same_stream():
    whole = np.empty((2, 999))
    fastls.normal_rows(whole, 9, 17)
    pieces = [np.empty((1, 500)), np.empty((1, 1498))]
    fastls.normal_rows(pieces[0], 9, 17)
    fastls.normal_rows(pieces[1], 9, 517)
    assert np.array_equal(np.concatenate([p.ravel() for p in pieces]), whole.ravel())


@pytest.mark.parametrize("out,key,start,match", [
    (np.empty((2, 3), dtype=np.float32), 1, 0, "C-contiguous float64 array of shape \\(rows, d\\), got float32"),
    (np.empty((3, 2)).T, 1, 0, "C-contiguous float64"),
    (np.empty(5), 1, 0, "shape \\(rows, d\\), got float64 array of shape \\(5,\\)"),
    ([[0.0]], 1, 0, "got list"),
    (np.empty((1, 2)), -1, 0, "key must be an integer in \\[0, 2\\*\\*64\\), got -1"),
    (np.empty((1, 2)), 1 << 64, 0, "key must be an integer"),
    (np.empty((1, 2)), 1.5, 0, "key must be an integer"),
    (np.empty((1, 2)), 1, True, "start must be an integer"),
    (np.empty((1, 4)), 1, (1 << 58) - 2, "run past the stream's 2\\*\\*58 draws"),
])
def test_bad_arguments_are_refused_and_out_is_untouched(out, key, start, match):
    before = np.array(out, copy=True)
    with pytest.raises(ValueError, match=match):
        fastls.normal_rows(out, key, start)
    assert np.array_equal(np.asarray(out), before, equal_nan=True)


def test_a_read_only_out_is_refused():
    out = np.zeros((1, 3))
    out.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        fastls.normal_rows(out, 1, 0)


def test_a_key_one_increment_further_is_not_the_same_stream_shifted():
    # With one increment for all keys, key + gamma would replay key's stream one draw later.
    key = 424242
    base, shifted = np.empty((1, 1000)), np.empty((1, 1000))
    fastls.normal_rows(base, key, 1)
    fastls.normal_rows(shifted, (key + gamma(key)) & MASK, 0)
    assert not np.array_equal(base, shifted)
    assert abs(np.corrcoef(base[0], shifted[0])[0, 1]) < 0.15
