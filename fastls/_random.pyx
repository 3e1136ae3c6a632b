# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Counter-based standard normal draws: SplitMix64 words through a 256-layer ziggurat.

Draw ``i`` of stream ``key`` is a function of ``(key, i)`` alone, so any
slice of a stream can be filled on its own, on any thread, in any order:
word ``i`` is SplitMix64's output function of ``key + (i + 1) gamma``, with
an odd increment ``gamma`` of the stream's own, derived from the key as
SplitMix64's ``split`` derives one (so two streams are not shifted copies
of one sequence). The ziggurat is Marsaglia and Tsang's (2000), with
NumPy's layout of a 64-bit word (8 bits of layer, 1 of sign, 52 of
abscissa) and 256 layers; its rare second tries (about 1.2 % of draws)
take their words from a second stream, keyed apart, at counters
``64 i + k`` (so a stream holds 2**58 draws).
"""

from libc.math cimport exp, log, log1p, sqrt
from libc.stdint cimport int64_t, uint64_t

cdef uint64_t _SECOND = 0xD1B54A32D192ED03ULL   # keys a draw's second tries apart from the first words
cdef double _R = 3.6541528853610088             # start of the tail (256 layers)
cdef double _V = 0.00492867323399               # area of each layer
cdef double _TWO52 = 4503599627370496.0
cdef uint64_t _ki[256]
cdef double _wi[256]
cdef double _fi[256]


cdef void _tables() noexcept nogil:
    cdef double dn = _R, tn = _R
    cdef double q = _V / exp(-0.5 * dn * dn)
    cdef int i
    _ki[0] = <uint64_t>((dn / q) * _TWO52)
    _ki[1] = 0
    _wi[0] = q / _TWO52
    _wi[255] = dn / _TWO52
    _fi[0] = 1.0
    _fi[255] = exp(-0.5 * dn * dn)
    for i in range(254, 0, -1):
        dn = sqrt(-2.0 * log(_V / dn + exp(-0.5 * dn * dn)))
        _ki[i + 1] = <uint64_t>((dn / tn) * _TWO52)
        tn = dn
        _fi[i] = exp(-0.5 * dn * dn)
        _wi[i] = dn / _TWO52


_tables()


cdef inline uint64_t _mix(uint64_t z) noexcept nogil:
    """SplitMix64's output function (Steele, Lea and Flood 2014)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline uint64_t _gamma(uint64_t key) noexcept nogil:
    """The odd increment of stream ``key`` (SplitMix64's mixGamma, after Steele, Lea and Flood)."""
    cdef uint64_t z = key ^ 0x5851F42D4C957F2DULL
    z = (z ^ (z >> 33)) * 0xFF51AFD7ED558CCDULL
    z = (z ^ (z >> 33)) * 0xC4CEB9FE1A85EC53ULL
    z = (z ^ (z >> 33)) | 1
    # Increments with few bit changes make poor sequences; SplitMix64 flips them.
    if _popcount(z ^ (z >> 1)) < 24:
        z ^= 0xAAAAAAAAAAAAAAAAULL
    return z


cdef inline int _popcount(uint64_t z) noexcept nogil:
    cdef int n = 0
    while z:
        z &= z - 1
        n += 1
    return n


cdef double _SIGNS[2]
_SIGNS[0] = 1.0
_SIGNS[1] = -1.0


cdef inline double _abscissa(uint64_t r, uint64_t *idx, uint64_t *rabs) noexcept nogil:
    """A word's layer, its 52-bit position in the layer, and the signed point there (NumPy's layout)."""
    idx[0] = r & 0xff
    r >>= 8
    rabs[0] = (r >> 1) & 0x000fffffffffffffULL
    # Branch-free: the sign is a coin flip, which a branch would mispredict half the time. The signed
    # conversion is exact (rabs < 2**52) and a single instruction, unlike an unsigned one on x86-64.
    return <double>(<int64_t>rabs[0]) * _wi[idx[0]] * _SIGNS[r & 0x1]


cdef inline double _unit(uint64_t word) noexcept nogil:
    return (word >> 11) * (1.0 / 9007199254740992.0)


cdef double _retry(uint64_t key, uint64_t index, uint64_t idx, uint64_t rabs, double x) noexcept nogil:
    """Draw ``index`` from its word's wedge or tail test on; new words come from the second stream."""
    cdef uint64_t second = key ^ _SECOND
    cdef uint64_t step = _gamma(second)
    cdef uint64_t base = second + (index << 6) * step
    cdef uint64_t k = 0
    cdef double xx, yy
    while True:
        # (idx, rabs, x): a word outside its layer's rectangle
        if idx == 0:
            while True:  # the tail beyond _R, by Marsaglia's exponential method
                xx = -log1p(-_unit(_mix(base + (k + 1) * step))) / _R
                yy = -log1p(-_unit(_mix(base + (k + 2) * step)))
                k += 2
                if yy + yy > xx * xx:
                    return -(_R + xx) if (rabs >> 8) & 0x1 else _R + xx
        k += 1
        if (_fi[idx - 1] - _fi[idx]) * _unit(_mix(base + k * step)) + _fi[idx] < exp(-0.5 * x * x):
            return x
        k += 1
        x = _abscissa(_mix(base + k * step), &idx, &rabs)
        if rabs < _ki[idx]:
            return x


cdef inline double _normal(uint64_t key, uint64_t state, uint64_t index) noexcept nogil:
    """Draw ``index`` of stream ``key``, whose word is SplitMix64's output at ``state`` = key + (index + 1) gamma."""
    cdef uint64_t idx, rabs
    cdef double x = _abscissa(_mix(state), &idx, &rabs)
    if rabs < _ki[idx]:
        return x
    return _retry(key, index, idx, rabs, x)


def normal_rows(double[:, ::1] out, double[::1] sumsq, uint64_t key, uint64_t start):
    """out[r, j] = draw ``start + r d + j`` of the standard normal stream ``key``; sumsq[r] = sum_j out[r, j]^2."""
    cdef Py_ssize_t r, j, d = out.shape[1]
    cdef uint64_t index = start
    cdef uint64_t step = _gamma(key)
    cdef uint64_t state = key + (start + 1) * step
    cdef double x, total
    with nogil:
        for r in range(out.shape[0]):
            total = 0.0
            for j in range(d):
                x = _normal(key, state, index)
                out[r, j] = x
                total = total + x * x
                index += 1
                state += step
            sumsq[r] = total
