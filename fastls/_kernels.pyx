# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Typed kernels over SciPy's BLAS/LAPACK.

These functions trust their arguments: shapes, dtypes, layouts and finiteness
are checked by the Python wrappers that call them (``fastls._products``,
``_solve``, ``_conv_stats`` and the rest). Every matrix is passed as a
memoryview together with its layout (``rowmajor``) and leading dimension
(``ld``), because a C-ordered NumPy matrix is the transpose of the Fortran
matrix BLAS sees at the same address.
"""

from cython cimport floating
from libc.string cimport memcpy, memset
from libc.stdlib cimport malloc, calloc, free

from scipy.linalg.cython_blas cimport ssyrk, dsyrk, sgemm, dgemm, strsm, dtrsm, dtrmm, dsymm
from scipy.linalg.cython_lapack cimport spotrf, dpotrf, spotrs, dpotrs, dgeqrf, dlarft


# ---------------------------------------------------------------------------
# Thin typed BLAS/LAPACK wrappers (fused over float32/float64)
# ---------------------------------------------------------------------------

# Widest triangle (and triangular system) handed to BLAS in one call. OpenBLAS
# 0.3.30 (SciPy 1.17's) writes past its buffers in a two-thread dsyrk from
# n of about 15,000 with k >= 1,024, and so in potrf, which calls it
# (SIGSEGV at d = 18,433 in a full-width DCNN solve); at n <= 14,337 and in
# gemm it did not. Wider ones go in column panels of _PANEL.
cdef int _ONE_CALL_MAX = 12288
cdef int _PANEL = 4096


def set_blas_panels(int one_call_max, int panel):
    """Set (_ONE_CALL_MAX, _PANEL); returns the previous pair. For tests: small panels on small matrices."""
    global _ONE_CALL_MAX, _PANEL
    if one_call_max < 1 or panel < 1:
        raise ValueError(f"one_call_max and panel must be >= 1, got {one_call_max} and {panel}")
    previous = (_ONE_CALL_MAX, _PANEL)
    _ONE_CALL_MAX, _PANEL = one_call_max, panel
    return previous


cdef inline void _gemm(char ta, char tb, int m, int n, int k, floating alpha,
                       floating *a, int lda, floating *b, int ldb,
                       floating beta, floating *c, int ldc) noexcept nogil:
    """C := alpha op(A) op(B) + beta C."""
    if floating is float:
        sgemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc)
    else:
        dgemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc)


cdef inline void _syrk_call(char uplo, char trans, int n, int k, floating alpha,
                            floating *a, int lda, floating beta,
                            floating *c, int ldc) noexcept nogil:
    if floating is float:
        ssyrk(&uplo, &trans, &n, &k, &alpha, a, &lda, &beta, c, &ldc)
    else:
        dsyrk(&uplo, &trans, &n, &k, &alpha, a, &lda, &beta, c, &ldc)


cdef void _syrk(char uplo, char trans, int n, int k, floating alpha,
                floating *a, int lda, floating beta,
                floating *c, int ldc) noexcept nogil:
    """C := alpha op(A) op(A)^T + beta C (one triangle); above _ONE_CALL_MAX columns, a syrk and a gemm per panel."""
    cdef int c0 = 0, width
    cdef Py_ssize_t lc = ldc, la = lda
    # gemm's op(A) and op(A)^T for A as syrk reads it; op(A)'s row i starts at a + i (trans N) or a + i * lda.
    cdef char ta = c'N' if trans == c'N' else c'T'
    cdef char tb = c'T' if trans == c'N' else c'N'
    cdef Py_ssize_t row_step = 1 if trans == c'N' else la
    if n <= _ONE_CALL_MAX:
        _syrk_call(uplo, trans, n, k, alpha, a, lda, beta, c, ldc)
        return
    while c0 < n:
        width = min(_PANEL, n - c0)
        _syrk_call(uplo, trans, width, k, alpha, a + c0 * row_step, lda, beta, c + c0 + c0 * lc, ldc)
        if uplo == c'U' and c0 > 0:
            # C[0:c0, c0:c0+width] (above the diagonal block)
            _gemm(ta, tb, c0, width, k, alpha, a, lda, a + c0 * row_step, lda, beta, c + c0 * lc, ldc)
        elif uplo == c'L' and c0 + width < n:
            # C[c0+width:n, c0:c0+width] (below the diagonal block)
            _gemm(ta, tb, n - c0 - width, width, k, alpha, a + (c0 + width) * row_step, lda, a + c0 * row_step,
                  lda, beta, c + c0 + width + c0 * lc, ldc)
        c0 += width


cdef inline int _potrf(char uplo, int n, floating *a, int lda) noexcept nogil:
    """A = U^T U (Cholesky, one triangle); returns LAPACK's info."""
    cdef int info = 0
    if floating is float:
        spotrf(&uplo, &n, a, &lda, &info)
    else:
        dpotrf(&uplo, &n, a, &lda, &info)
    return info


cdef void _trsm(char side, char uplo, char transa, int m, int n,
                floating *a, int lda, floating *b, int ldb) noexcept nogil:
    """B := op(A)^-1 B (side L) or B op(A)^-1 (side R), A triangular with a non-unit diagonal."""
    cdef char diag = c'N'
    cdef floating one = 1.0
    cdef int start = 0, count, rows, cols
    # B's columns (side L) or rows (side R) are independent systems: in panels above _ONE_CALL_MAX.
    cdef int total = n if side == c'L' else m
    cdef int most = total if total <= _ONE_CALL_MAX else _PANEL
    cdef Py_ssize_t step = ldb if side == c'L' else 1
    while start < total:
        count = min(most, total - start)
        rows, cols = (m, count) if side == c'L' else (count, n)
        if floating is float:
            strsm(&side, &uplo, &transa, &diag, &rows, &cols, &one, a, &lda, b + start * step, &ldb)
        else:
            dtrsm(&side, &uplo, &transa, &diag, &rows, &cols, &one, a, &lda, b + start * step, &ldb)
        start += count


cdef int _blocked_potrf(char uplo, int n, floating *a, int lda) noexcept nogil:
    """Cholesky by panels of _PANEL columns: potrf on each diagonal block, trsm and syrk on the rest.

    The same factor as one potrf call, whose own trailing updates are syrk
    calls as wide as the matrix (see _PANEL); here they are ours, in panels.
    """
    cdef int j = 0, jb, rest, info
    cdef Py_ssize_t ld = lda
    cdef floating *diag_block
    while j < n:
        jb = min(_PANEL, n - j)
        rest = n - j - jb
        diag_block = a + j + j * ld
        info = _potrf(uplo, jb, diag_block, lda)
        if info != 0:
            return info + j
        if rest == 0:
            break
        if uplo == c'U':
            # U12 := U11^-T A12, then A22 -= U12^T U12
            _trsm(c'L', c'U', c'T', jb, rest, diag_block, lda, diag_block + jb * ld, lda)
            _syrk(c'U', c'T', rest, jb, <floating>-1.0, diag_block + jb * ld, lda, <floating>1.0,
                  diag_block + jb + jb * ld, lda)
        else:
            # L21 := A21 L11^-T, then A22 -= L21 L21^T
            _trsm(c'R', c'L', c'T', rest, jb, diag_block, lda, diag_block + jb, lda)
            _syrk(c'L', c'N', rest, jb, <floating>-1.0, diag_block + jb, lda, <floating>1.0,
                  diag_block + jb + jb * ld, lda)
        j += jb
    return 0


cdef inline int _potrs(char uplo, int n, int nrhs, floating *a, int lda,
                       floating *b, int ldb) noexcept nogil:
    """B := A^-1 B given the Cholesky factor of A; returns LAPACK's info."""
    cdef int info = 0
    if floating is float:
        spotrs(&uplo, &n, &nrhs, a, &lda, b, &ldb, &info)
    else:
        dpotrs(&uplo, &n, &nrhs, a, &lda, b, &ldb, &info)
    return info


# ---------------------------------------------------------------------------
# Products on (pointer, layout, leading dimension) descriptions
# ---------------------------------------------------------------------------

cdef inline floating *_at(floating *base, bint rowmajor, Py_ssize_t ld,
                          Py_ssize_t row, Py_ssize_t col) noexcept nogil:
    """Address of element (row, col) of a NumPy-indexed matrix."""
    if rowmajor:
        return base + row * ld + col
    return base + row + col * ld


cdef inline void _syrk_tn(floating *x, bint x_rowmajor, int ldx, int k, int n,
                          floating beta, floating *out, bint out_rowmajor,
                          int ldo) noexcept nogil:
    """out := beta out + X^T X on the upper triangle of out (NumPy indexing).

    X is k x n (NumPy indexing). A row-major X is the Fortran matrix X^T.
    A row-major out is Fortran out^T, whose lower triangle is our upper one.
    """
    cdef char uplo = b'L' if out_rowmajor else b'U'
    cdef char trans = b'N' if x_rowmajor else b'T'
    _syrk(uplo, trans, n, k, <floating>1.0, x, ldx, beta, out, ldo)


cdef inline void _gemm_tn(floating *lhs, bint l_rowmajor, int ldl,
                          floating *rhs, bint r_rowmajor, int ldr,
                          int k, int p, int q, floating beta,
                          floating *out, bint out_rowmajor, int ldo) noexcept nogil:
    """out := beta out + L^T R with L k x p and R k x q (NumPy indexing)."""
    cdef char ta, tb
    if out_rowmajor:
        # Fortran sees out^T = R^T L: swap the operands.
        _gemm_tn(rhs, r_rowmajor, ldr, lhs, l_rowmajor, ldl, k, q, p, beta,
                 out, False, ldo)
        return
    ta = b'N' if l_rowmajor else b'T'
    tb = b'T' if r_rowmajor else b'N'
    _gemm(ta, tb, p, q, k, <floating>1.0, lhs, ldl, rhs, ldr, beta, out, ldo)


cdef inline void _gemm_nn(floating *lhs, bint l_rowmajor, int ldl,
                          floating *rhs, bint r_rowmajor, int ldr,
                          int n, int d, int m, floating beta,
                          floating *out, bint out_rowmajor, int ldo) noexcept nogil:
    """out := beta out + L R with L n x d and R d x m (NumPy indexing)."""
    cdef char ta, tb
    if out_rowmajor:
        # Fortran sees out^T = R^T L^T; a row-major operand is already transposed for Fortran.
        ta = b'N' if r_rowmajor else b'T'
        tb = b'N' if l_rowmajor else b'T'
        _gemm(ta, tb, m, n, d, <floating>1.0, rhs, ldr, lhs, ldl, beta, out, ldo)
        return
    ta = b'T' if l_rowmajor else b'N'
    tb = b'T' if r_rowmajor else b'N'
    _gemm(ta, tb, n, m, d, <floating>1.0, lhs, ldl, rhs, ldr, beta, out, ldo)


cdef inline void _add_tile(double *out, bint out_rowmajor, Py_ssize_t ldo,
                           Py_ssize_t i0, Py_ssize_t j0, float *tile,
                           Py_ssize_t ti, Py_ssize_t tj, bint upper_only) noexcept nogil:
    """out[i0:i0+ti, j0:j0+tj] += tile (ti x tj in out's layout), widening to float64."""
    cdef Py_ssize_t a, b, a_end
    # The tile shares out's layout so both are read along their rows (or
    # columns): a transposed add strides through one of them and cost a
    # quarter of the mixed Gram's time at d = 4609.
    if out_rowmajor:
        for a in range(ti):
            for b in range(a if upper_only else 0, tj):
                out[(i0 + a) * ldo + j0 + b] += tile[a * tj + b]
    else:
        for b in range(tj):
            a_end = b + 1 if upper_only else ti
            for a in range(a_end):
                out[i0 + a + (j0 + b) * ldo] += tile[a + b * ti]


cdef enum:
    _TRANSPOSE_BLOCK = 64  # 64 x 64 floats of the tile (16 KB) stay in L1 while they are added
    _LOWER_SYRK_MIN_WIDTH = 512  # narrower diagonal tiles gained nothing from the lower triangle


cdef void _add_rowmajor_upper_to_colmajor(double *out, Py_ssize_t ldo, Py_ssize_t i0,
                                          float *tile, Py_ssize_t t) noexcept nogil:
    """out[i0 + a, i0 + b] += tile[a, b] for a <= b: a row-major t x t tile into column-major out.

    In square blocks, so that the strided side of the transposed read stays in cache.
    """
    cdef Py_ssize_t a0, b0 = 0, a, b, a_end, b_end
    cdef double *column
    while b0 < t:
        b_end = min(b0 + _TRANSPOSE_BLOCK, t)
        a0 = 0
        while a0 < b_end:
            a_end = min(a0 + _TRANSPOSE_BLOCK, b_end)
            for b in range(b0, b_end):
                column = out + i0 + (i0 + b) * ldo
                for a in range(a0, min(a_end, b + 1)):
                    column[a] += tile[a * t + b]
            a0 += _TRANSPOSE_BLOCK
        b0 += _TRANSPOSE_BLOCK


cdef inline Py_ssize_t _even_tile(Py_ssize_t n, Py_ssize_t tile) noexcept nogil:
    """Width of ceil(n / tile) equal tiles over n (at most ``tile``)."""
    cdef Py_ssize_t parts = (n + tile - 1) // tile if n > 0 else 1
    return (n + parts - 1) // parts


cdef void _mixed_tn(float *lhs, bint l_rowmajor, int ldl,
                    float *rhs, bint r_rowmajor, int ldr,
                    Py_ssize_t k, Py_ssize_t p, Py_ssize_t q, bint symmetric,
                    double *out, bint out_rowmajor, int ldo,
                    Py_ssize_t block_rows, Py_ssize_t tile, float *scratch) noexcept nogil:
    """out += L^T R in float64 from float32 L, R through float32 tiles.

    Products run in float32 BLAS over at most ``block_rows`` rows at a time,
    so the float32 rounding error grows with block_rows, not with k; each
    tile is then widened and added to out. With ``symmetric`` (L is R) only
    the upper triangle of out is computed, diagonal tiles through syrk.
    Tiles are at most ``tile`` wide and split each dimension evenly: a thin
    last tile ran its products at a lower rate.
    """
    cdef Py_ssize_t r0 = 0, kb, i0, j0, ti, tj
    cdef Py_ssize_t tile_i = _even_tile(p, tile)
    cdef Py_ssize_t tile_j = tile_i if symmetric else _even_tile(q, tile)
    cdef float *l_blk
    cdef float *r_blk
    # while loops: Cython compiles range() with a runtime step to Python.
    while r0 < k:
        kb = min(block_rows, k - r0)
        i0 = 0
        while i0 < p:
            ti = min(tile_i, p - i0)
            l_blk = _at(lhs, l_rowmajor, ldl, r0, i0)
            j0 = i0 if symmetric else 0
            while j0 < q:
                tj = min(tile_j, q - j0)
                r_blk = _at(rhs, r_rowmajor, ldr, r0, j0)
                if symmetric and i0 == j0 and not out_rowmajor and ti >= _LOWER_SYRK_MIN_WIDTH:
                    # OpenBLAS's ssyrk on Fortran's lower triangle ran 1.12-1.16x
                    # faster than on its upper one at d = 513-1025 (0.97-1.04x
                    # elsewhere, 4096 rows): compute that one, as a row-major
                    # upper tile, and add it transposed.
                    _syrk_tn(l_blk, l_rowmajor, ldl, <int>kb, <int>ti,
                             <float>0.0, scratch, True, <int>ti)
                    _add_rowmajor_upper_to_colmajor(out, ldo, i0, scratch, ti)
                    j0 += tile_j
                    continue
                if symmetric and i0 == j0:
                    _syrk_tn(l_blk, l_rowmajor, ldl, <int>kb, <int>ti,
                             <float>0.0, scratch, out_rowmajor, <int>ti)
                else:
                    _gemm_tn(l_blk, l_rowmajor, ldl, r_blk, r_rowmajor, ldr,
                             <int>kb, <int>ti, <int>tj, <float>0.0,
                             scratch, out_rowmajor,
                             <int>(tj if out_rowmajor else ti))
                _add_tile(out, out_rowmajor, ldo, i0, j0, scratch, ti, tj,
                          symmetric and i0 == j0)
                j0 += tile_j
            i0 += tile_i
        r0 += block_rows


# ---------------------------------------------------------------------------
# BLAS thread counts, set without Python in the way
# ---------------------------------------------------------------------------

ctypedef int (*_threads_getter)() noexcept nogil
ctypedef void (*_threads_setter)(int) noexcept nogil

cdef enum:
    _MAX_LIBRARIES = 8

cdef _threads_getter _getters[_MAX_LIBRARIES]
cdef _threads_setter _setters[_MAX_LIBRARIES]
cdef int _n_bound = 0


def bind_blas_threads(addresses):
    """Remember each BLAS library's (get_num_threads, set_num_threads) C functions, given as addresses."""
    global _n_bound
    _n_bound = 0
    for get_address, set_address in list(addresses)[:_MAX_LIBRARIES]:
        _getters[_n_bound] = <_threads_getter><size_t>get_address
        _setters[_n_bound] = <_threads_setter><size_t>set_address
        _n_bound += 1
    return _n_bound


def blas_threads():
    """Fewest threads any bound library may use (0 when none is bound)."""
    cdef int i, fewest = 0, current
    for i in range(_n_bound):
        current = _getters[i]()
        if i == 0 or current < fewest:
            fewest = current
    return fewest


def lower_blas_threads(int n):
    """Every bound library running more than n threads runs n; the previous counts, or None if none changed."""
    cdef int i
    cdef int previous[_MAX_LIBRARIES]
    cdef bint changed = False
    for i in range(_n_bound):
        previous[i] = _getters[i]()
        if previous[i] > n:
            _setters[i](n)
            changed = True
    if not changed:
        return None
    return tuple([previous[i] for i in range(_n_bound)])


def restore_blas_threads(tuple previous):
    """Undo lower_blas_threads."""
    cdef int i
    for i in range(min(_n_bound, len(previous))):
        _setters[i](previous[i])


# The size rule's state, kept here so that entering sized_threads costs no Python call.
cdef double _flops_per_thread = 0.0
cdef bint _rule_bound = False
_bind_hook = None   # set by fastls._threads: binds the libraries on first use


def set_rule(double flops_per_thread, bind_hook):
    """Flops of work per BLAS thread (0: no rule), and what binds the libraries on first use."""
    global _flops_per_thread, _bind_hook, _rule_bound
    _flops_per_thread = flops_per_thread
    _bind_hook = bind_hook
    _rule_bound = False


cdef class sized_threads:
    """Context manager: the enclosed BLAS work of ``flops`` runs max(1, flops // flops_per_thread) threads at most.

    Lowers the thread count of every bound OpenBLAS library only when the rule
    wants fewer threads than the library runs now (the caller's limit), and
    restores it on exit, also on error.
    """

    cdef int _wanted
    cdef object _previous

    def __cinit__(self, double flops):
        cdef double wanted
        self._wanted = 0
        self._previous = None
        if _flops_per_thread > 0:
            wanted = flops / _flops_per_thread
            self._wanted = 1 if wanted < 1 else (<int>wanted if wanted < 1048576 else 0)

    def __enter__(self):
        global _rule_bound
        if self._wanted:
            if not _rule_bound:
                _bind_hook()
                _rule_bound = True
            self._previous = lower_blas_threads(self._wanted)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._previous is not None:
            restore_blas_threads(self._previous)
            self._previous = None
        return False


# ---------------------------------------------------------------------------
# Forward products, Gram and cross-product updates
# ---------------------------------------------------------------------------

def matmul_same(floating[:, :] out, bint o_rowmajor, int ldo,
                const floating[:, :] X, bint x_rowmajor, int ldx,
                const floating[:, :] W, bint w_rowmajor, int ldw):
    """out := X W, all of one dtype."""
    cdef int n = X.shape[0], d = X.shape[1], m = W.shape[1]
    with nogil:
        _gemm_nn(<floating *>&X[0, 0], x_rowmajor, ldx,
                 <floating *>&W[0, 0], w_rowmajor, ldw, n, d, m,
                 <floating>0.0, &out[0, 0], o_rowmajor, ldo)


def gram_same(floating[:, :] G, bint g_rowmajor, int ldg,
              const floating[:, :] X, bint x_rowmajor, int ldx):
    """G += X^T X (upper triangle), G and X of one dtype."""
    cdef int k = X.shape[0], n = X.shape[1]
    with nogil:
        _syrk_tn(<floating *>&X[0, 0], x_rowmajor, ldx, k, n, <floating>1.0,
                 &G[0, 0], g_rowmajor, ldg)


def cross_same(floating[:, :] C, bint c_rowmajor, int ldc,
               const floating[:, :] X, bint x_rowmajor, int ldx,
               const floating[:, :] Z, bint z_rowmajor, int ldz):
    """C += X^T Z, all of one dtype."""
    cdef int k = X.shape[0], p = X.shape[1], q = Z.shape[1]
    with nogil:
        _gemm_tn(<floating *>&X[0, 0], x_rowmajor, ldx,
                 <floating *>&Z[0, 0], z_rowmajor, ldz, k, p, q,
                 <floating>1.0, &C[0, 0], c_rowmajor, ldc)


def gram_mixed(double[:, :] G, bint g_rowmajor, int ldg,
               const float[:, :] X, bint x_rowmajor, int ldx,
               Py_ssize_t block_rows, Py_ssize_t tile):
    """G += X^T X (upper triangle), float32 X into float64 G."""
    _mixed(G, g_rowmajor, ldg, X, x_rowmajor, ldx, X, x_rowmajor, ldx, True,
           block_rows, tile)


def cross_mixed(double[:, :] C, bint c_rowmajor, int ldc,
                const float[:, :] X, bint x_rowmajor, int ldx,
                const float[:, :] Z, bint z_rowmajor, int ldz,
                Py_ssize_t block_rows, Py_ssize_t tile):
    """C += X^T Z, float32 X and Z into float64 C."""
    _mixed(C, c_rowmajor, ldc, X, x_rowmajor, ldx, Z, z_rowmajor, ldz, False,
           block_rows, tile)


cdef _mixed(double[:, :] out, bint out_rowmajor, int ldo,
            const float[:, :] L, bint l_rowmajor, int ldl,
            const float[:, :] R, bint r_rowmajor, int ldr, bint symmetric,
            Py_ssize_t block_rows, Py_ssize_t tile):
    cdef Py_ssize_t p = L.shape[1], q = R.shape[1]
    cdef Py_ssize_t ti = min(tile, p), tj = min(tile, q)
    cdef float *scratch = <float *>malloc(ti * tj * sizeof(float))
    if scratch == NULL:
        raise MemoryError(f"cannot allocate a {ti} x {tj} float32 tile")
    try:
        with nogil:
            _mixed_tn(<float *>&L[0, 0], l_rowmajor, ldl,
                      <float *>&R[0, 0], r_rowmajor, ldr,
                      L.shape[0], p, q, symmetric, &out[0, 0], out_rowmajor,
                      ldo, block_rows, tile, scratch)
    finally:
        free(scratch)


# ---------------------------------------------------------------------------
# Patches of NHWC images
# ---------------------------------------------------------------------------

cdef void _patch_rows(const floating[:, :, :, ::1] images, Py_ssize_t row0,
                      Py_ssize_t n_rows, Py_ssize_t kh, Py_ssize_t kw,
                      Py_ssize_t sh, Py_ssize_t sw, Py_ssize_t ph,
                      Py_ssize_t pw, Py_ssize_t out_h, Py_ssize_t out_w,
                      bint append_ones, floating *dst, Py_ssize_t ld) noexcept nogil:
    """Write patch rows row0 .. row0+n_rows-1 (ordered image, y, x) into dst.

    A patch row lists (ky, kx, channel) with channel fastest, so a kernel
    row that lies inside the image is one contiguous run of kw * channels
    values in NHWC memory: one memcpy.
    """
    cdef Py_ssize_t H = images.shape[1], W = images.shape[2], Cin = images.shape[3]
    cdef Py_ssize_t per_image = out_h * out_w, run = kw * Cin
    cdef Py_ssize_t r, img, pos, oy, ox, ky, kx, iy, ix, x_lo, x_hi
    cdef floating *row
    cdef floating *seg
    for r in range(n_rows):
        img = (row0 + r) // per_image
        pos = (row0 + r) % per_image
        oy = pos // out_w
        ox = pos % out_w
        row = dst + r * ld
        for ky in range(kh):
            iy = oy * sh - ph + ky
            seg = row + ky * run
            if iy < 0 or iy >= H:
                memset(seg, 0, run * sizeof(floating))
                continue
            ix = ox * sw - pw
            if ix >= 0 and ix + kw <= W:
                memcpy(seg, &images[img, iy, ix, 0], run * sizeof(floating))
                continue
            # Kernel row crosses the left or right border: zero the outside.
            x_lo = max(0, -ix)
            x_hi = min(kw, W - ix)
            memset(seg, 0, run * sizeof(floating))
            if x_hi > x_lo:
                memcpy(seg + x_lo * Cin, &images[img, iy, ix + x_lo, 0],
                       (x_hi - x_lo) * Cin * sizeof(floating))
        if append_ones:
            row[kh * run] = 1


def im2col_into(const floating[:, :, :, ::1] images, floating[:, ::1] out,
                Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t out_h,
                Py_ssize_t out_w, bint append_ones):
    """out[r] = patch r of the batch (rows ordered image, y, x)."""
    with nogil:
        _patch_rows(images, 0, out.shape[0], kh, kw, sh, sw, ph, pw, out_h,
                    out_w, append_ones, &out[0, 0], out.shape[1])


def conv_stats_same(floating[:, :] G, bint g_rowmajor, int ldg,
                    floating[:, :] C, bint c_rowmajor, int ldc,
                    const floating[:, :, :, ::1] images,
                    const floating[:, ::1] targets, bint per_image_targets,
                    floating[:, ::1] scratch, floating[:, ::1] sums,
                    Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                    Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t out_h,
                    Py_ssize_t out_w, bint append_ones):
    """G += P^T P and C += P^T T over the patch matrix P, chunk by chunk."""
    _conv_stats(&G[0, 0], g_rowmajor, ldg, &C[0, 0], c_rowmajor, ldc, images,
                targets, per_image_targets, scratch, sums, kh, kw, sh, sw, ph,
                pw, out_h, out_w, append_ones, NULL, NULL, 0, 0)


def conv_stats_mixed(double[:, :] G, bint g_rowmajor, int ldg,
                     double[:, :] C, bint c_rowmajor, int ldc,
                     const float[:, :, :, ::1] images,
                     const float[:, ::1] targets, bint per_image_targets,
                     float[:, ::1] scratch, float[:, ::1] sums,
                     Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                     Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t out_h,
                     Py_ssize_t out_w, bint append_ones,
                     Py_ssize_t block_rows, Py_ssize_t tile):
    """As conv_stats_same, float32 patches accumulated into float64 G and C."""
    _conv_stats(<float *>NULL, g_rowmajor, ldg, <float *>NULL, c_rowmajor,
                ldc, images, targets, per_image_targets, scratch, sums, kh, kw,
                sh, sw, ph, pw, out_h, out_w, append_ones, &G[0, 0], &C[0, 0],
                block_rows, tile)


cdef _conv_stats(floating *G, bint g_rowmajor, int ldg,
                 floating *C, bint c_rowmajor, int ldc,
                 const floating[:, :, :, ::1] images,
                 const floating[:, ::1] targets, bint per_image_targets,
                 floating[:, ::1] scratch, floating[:, ::1] sums,
                 Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t sh, Py_ssize_t sw,
                 Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t out_h,
                 Py_ssize_t out_w, bint append_ones,
                 double *G64, double *C64,
                 Py_ssize_t block_rows, Py_ssize_t tile):
    """Shared chunk loop; non-NULL G64/C64 means the float32-into-float64 path.

    With per-image targets t_b (the encoded label, equal at every output
    position), sum_p P_bp^T t_b = (sum_p P_bp)^T t_b, so the cross term
    needs the per-image patch sums, not a target row per patch.
    """
    cdef Py_ssize_t n_images = images.shape[0]
    cdef Py_ssize_t per_image = out_h * out_w
    cdef Py_ssize_t total = n_images * per_image
    cdef Py_ssize_t d = scratch.shape[1], m = targets.shape[1]
    cdef Py_ssize_t cap = scratch.shape[0], cap_sums = sums.shape[0]
    cdef Py_ssize_t row0 = 0, n_rows, r, j, img, first_img, n_sum_rows
    cdef bint mixed = G64 != NULL
    cdef float *tile_buf = NULL
    cdef floating *src
    cdef floating *acc
    if mixed:
        # Big enough for a Gram tile and for a cross-term tile (m may exceed d).
        tile_buf = <float *>malloc(min(tile, d) * max(min(tile, d), min(tile, m)) * sizeof(float))
        if tile_buf == NULL:
            raise MemoryError("cannot allocate the float32 tile")
    try:
        with nogil:
            first_img = 0      # image held in sums row 0
            n_sum_rows = 0     # sums rows in use
            while row0 < total:
                n_rows = min(cap, total - row0)
                if per_image_targets:
                    # Flush the patch sums when this chunk could run past them.
                    img = (row0 + n_rows - 1) // per_image
                    if img - first_img >= cap_sums:
                        _flush_sums(C, c_rowmajor, ldc, C64, targets, sums,
                                    first_img, n_sum_rows, block_rows, tile,
                                    tile_buf)
                        first_img = row0 // per_image
                        n_sum_rows = 0
                        memset(&sums[0, 0], 0, cap_sums * d * sizeof(floating))
                        img = (row0 + n_rows - 1) // per_image
                        if img - first_img >= cap_sums:
                            n_rows = (first_img + cap_sums) * per_image - row0
                _patch_rows(images, row0, n_rows, kh, kw, sh, sw, ph, pw,
                            out_h, out_w, append_ones, &scratch[0, 0], d)
                if mixed:
                    _mixed_tn(<float *>&scratch[0, 0], True, <int>d,
                              <float *>&scratch[0, 0], True, <int>d, n_rows, d,
                              d, True, G64, g_rowmajor, ldg,
                              block_rows, tile, tile_buf)
                else:
                    _syrk_tn(&scratch[0, 0], True, <int>d, <int>n_rows, <int>d,
                             <floating>1.0, G, g_rowmajor, ldg)
                if per_image_targets:
                    for r in range(n_rows):
                        img = (row0 + r) // per_image - first_img
                        src = &scratch[r, 0]
                        acc = &sums[img, 0]
                        for j in range(d):
                            acc[j] += src[j]
                    n_sum_rows = (row0 + n_rows - 1) // per_image - first_img + 1
                elif mixed:
                    _mixed_tn(<float *>&scratch[0, 0], True, <int>d,
                              <float *>&targets[row0, 0], True, <int>m, n_rows,
                              d, m, False, C64, c_rowmajor, ldc,
                              block_rows, tile, tile_buf)
                else:
                    _gemm_tn(&scratch[0, 0], True, <int>d,
                             <floating *>&targets[row0, 0], True, <int>m,
                             <int>n_rows, <int>d, <int>m, <floating>1.0,
                             C, c_rowmajor, ldc)
                row0 += n_rows
            if per_image_targets and n_sum_rows > 0:
                _flush_sums(C, c_rowmajor, ldc, C64, targets, sums, first_img,
                            n_sum_rows, block_rows, tile, tile_buf)
    finally:
        free(tile_buf)


cdef void _flush_sums(floating *C, bint c_rowmajor, int ldc,
                      double *C64, const floating[:, ::1] targets,
                      floating[:, ::1] sums, Py_ssize_t first_img,
                      Py_ssize_t n_rows, Py_ssize_t block_rows,
                      Py_ssize_t tile, float *tile_buf) noexcept nogil:
    """C += sums[:n_rows]^T targets[first_img:first_img+n_rows]."""
    cdef Py_ssize_t d = sums.shape[1], m = targets.shape[1]
    if n_rows <= 0:
        return
    if floating is float:
        if tile_buf != NULL:
            _mixed_tn(&sums[0, 0], True, <int>d,
                      <float *>&targets[first_img, 0], True, <int>m, n_rows,
                      d, m, False, C64, c_rowmajor, ldc, block_rows,
                      tile, tile_buf)
            return
    _gemm_tn(&sums[0, 0], True, <int>d,
             <floating *>&targets[first_img, 0], True, <int>m, <int>n_rows,
             <int>d, <int>m, <floating>1.0, C, c_rowmajor, ldc)


# ---------------------------------------------------------------------------
# Symmetric positive definite solves
# ---------------------------------------------------------------------------

def add_diagonal(floating[:, :] A, double shift):
    """A[i, i] += shift."""
    cdef Py_ssize_t i
    with nogil:
        for i in range(A.shape[0]):
            A[i, i] += <floating>shift


def cholesky_solve(floating[:, :] A, bint a_rowmajor, int lda,
                   floating[::1, :] B, bint factored=False):
    """B := A^-1 B for symmetric positive definite A (upper triangle read).

    A is overwritten by its Cholesky factor: one potrf call, or panels of
    _PANEL columns above _ONE_CALL_MAX (``factored``: A already holds it).
    Returns LAPACK's info: 0 on success, j > 0 when the leading minor of
    order j is not positive.
    """
    cdef char uplo = b'L' if a_rowmajor else b'U'
    cdef int n = A.shape[0], nrhs = B.shape[1], info = 0
    with nogil:
        if factored:
            pass
        elif n > _ONE_CALL_MAX:
            info = _blocked_potrf(uplo, n, &A[0, 0], lda)
        else:
            info = _potrf(uplo, n, &A[0, 0], lda)
        if info == 0 and nrhs > 0:
            info = _potrs(uplo, n, nrhs, &A[0, 0], lda, &B[0, 0], n)
    return info


def add_upper(floating[:, :] G, const floating[:, :] T):
    """G[i, j] += T[i, j] for i <= j (the strict lower triangle of G is not touched)."""
    cdef Py_ssize_t i, j, d = G.shape[0]
    cdef bint rowmajor = G.strides[1] == sizeof(floating)
    with nogil:
        if rowmajor:
            for i in range(d):
                for j in range(i, d):
                    G[i, j] += T[i, j]
        else:
            for j in range(d):
                for i in range(j + 1):
                    G[i, j] += T[i, j]


# ---------------------------------------------------------------------------
# Reduction of a symmetric matrix to a band (for ridge paths at large d)
# ---------------------------------------------------------------------------

cdef inline void _trmm(char side, char transa, int m, int n, double *t, int ldt,
                       double *b, int ldb) noexcept nogil:
    """B := op(T) B (side L) or B op(T) (side R), T upper triangular with a non-unit diagonal."""
    cdef char uplo = c'U', diag = c'N'
    cdef double one = 1.0
    dtrmm(&side, &uplo, &transa, &diag, &m, &n, &one, t, &ldt, b, &ldb)


cdef void _reflect_rows(double *v, int ldv, double *t, int ldt, int rows, int width,
                        double *b, int ldb, int cols, double *scratch, bint transposed) noexcept nogil:
    """B := (I - V T V^T) B, or its transpose (I - V T^T V^T) B; B is rows x cols, scratch width x cols."""
    if cols == 0 or rows == 0:
        return
    # scratch = V^T B; scratch = op(T) scratch; B -= V scratch
    _gemm(c'T', c'N', width, cols, rows, <double>1.0, v, ldv, b, ldb, <double>0.0, scratch, width)
    _trmm(c'L', c'T' if transposed else c'N', width, cols, t, ldt, scratch, width)
    _gemm(c'N', c'N', rows, cols, width, <double>-1.0, v, ldv, scratch, width, <double>1.0, b, ldb)


cdef void _explicit_v(const double *a, Py_ssize_t lda, int m, int kk, double *v, Py_ssize_t ldv) noexcept nogil:
    """V (m x kk) of a QR's reflectors, stored below R's diagonal at a, with its unit diagonal and zeros above."""
    cdef Py_ssize_t i, j
    for j in range(kk):
        for i in range(j):
            v[i + j * ldv] = 0.0
        v[j + j * ldv] = 1.0
        for i in range(j + 1, m):
            v[i + j * ldv] = a[i + j * lda]


# Rows or columns of the lower triangle per product in band_reduce.
cdef int _BAND_PANEL = 1024


cdef void _lower_symm(double *a, int lda, int m, double *v, int ldv, int k, double *out, int ldo) noexcept nogil:
    """out := A V for symmetric m x m A stored in its lower triangle, by row panels (each entry read once)."""
    cdef int r0 = 0, h
    cdef char left = c'L', lower = c'L'
    cdef double one = 1.0, zero = 0.0
    cdef Py_ssize_t la = lda
    while r0 < m:
        h = min(_BAND_PANEL, m - r0)
        # Diagonal block, then the stored rows left of it, then the stored columns below it (transposed).
        dsymm(&left, &lower, &h, &k, &one, a + r0 + r0 * la, &lda, v + r0, &ldv, &zero, out + r0, &ldo)
        if r0 > 0:
            _gemm(c'N', c'N', h, k, r0, <double>1.0, a + r0, lda, v, ldv, <double>1.0, out + r0, ldo)
        if r0 + h < m:
            _gemm(c'T', c'N', h, k, m - r0 - h, <double>1.0, a + (r0 + h) + r0 * la, lda, v + r0 + h, ldv,
                  <double>1.0, out + r0, ldo)
        r0 += h


def band_reduce(double[::1, :] A, int band, double[:, :, ::1] T, double[::1, :] W):
    """A := Q^T A Q banded (bandwidth ``band``), W := Q^T W; Q's reflectors kept below the band.

    A is symmetric, read and written in its lower triangle only (Fortran
    order; the strict upper triangle is scratch). Panel p of ``band``
    columns k = p band ... is reduced by a QR of its rows below the band,
    A[k+band:, k:k+band] = (I - V T V^T) R, and the trailing matrix A22
    takes the two-sided update H^T A22 H = A22 - V Y^T - Y V^T with
    X = A22 V T and Y = X - V (T^T V^T X) / 2. On return the lower band of
    A (offsets 0..band) holds the band matrix, V sits below it (unit
    diagonal implied, LAPACK's QR storage) and T[p] (Fortran band x band)
    holds panel p's triangular factor. The products run by panels of
    _BAND_PANEL rows or columns of the lower triangle, as gemm (symm on
    diagonal blocks): 4/3 d^3 flops in all, each panel reading A22's
    triangle twice, against a tridiagonalization whose symv half (d^3 / 3
    flops) reads the whole trailing matrix once per column.
    """
    cdef int n = A.shape[0], lda = A.shape[0], ncols = W.shape[1], ldw = W.shape[0]
    cdef int k, i0, m, pb, kk, info = 0, lwork = max(1, band * 64)
    cdef int j, c0, w
    cdef Py_ssize_t ld = lda, ldp = n
    cdef double *tau
    cdef double *work
    cdef double *pair     # n x 2 band: [V | Y]
    cdef double *swap     # n x 2 band: [Y | V]
    cdef double *small    # band x max(band, ncols)
    cdef double *t
    cdef double *v
    cdef double *y
    cdef int p = 0, ldt = band
    cdef char forward = c'F', columnwise = c'C'
    if n < 2 or band < 1 or band >= n - 1:
        return 0
    tau = <double *>malloc(band * sizeof(double))
    work = <double *>malloc(lwork * sizeof(double))
    pair = <double *>malloc(n * 2 * band * sizeof(double))
    swap = <double *>malloc(n * 2 * band * sizeof(double))
    small = <double *>malloc(band * max(band, ncols) * sizeof(double))
    if tau == NULL or work == NULL or pair == NULL or swap == NULL or small == NULL:
        free(tau); free(work); free(pair); free(swap); free(small)
        raise MemoryError("band_reduce: no memory for its panel buffers")
    with nogil:
        k = 0
        while k + band < n - 1:
            i0 = k + band
            m = n - i0
            pb = band
            kk = min(m, pb)
            dgeqrf(&m, &pb, &A[i0, k], &lda, tau, work, &lwork, &info)
            t = &T[p, 0, 0]
            dlarft(&forward, &columnwise, &m, &kk, &A[i0, k], &lda, tau, t, &ldt)
            # V explicit (unit diagonal, zeros above) in pair[:, :kk] and swap[:, kk:2kk].
            v = pair
            _explicit_v(&A[i0, k], ld, m, kk, v, ldp)
            # X = A22 V (into pair[:, kk:2kk]), then X T.
            y = pair + kk * ldp
            _lower_symm(&A[i0, i0], lda, m, v, n, kk, y, n)
            _trmm(c'R', c'N', m, kk, t, ldt, y, n)
            # small = T^T (V^T X); Y = X - V small / 2.
            _gemm(c'T', c'N', kk, kk, m, <double>1.0, v, n, y, n, <double>0.0, small, kk)
            _trmm(c'L', c'T', kk, kk, t, ldt, small, kk)
            _gemm(c'N', c'N', m, kk, kk, <double>-0.5, v, n, small, kk, <double>1.0, y, n)
            for j in range(kk):
                memcpy(swap + j * ldp, y + j * ldp, m * sizeof(double))
                memcpy(swap + (kk + j) * ldp, v + j * ldp, m * sizeof(double))
            # A22 -= [V Y] [Y V]^T = V Y^T + Y V^T, on the lower triangle by column panels.
            c0 = 0
            while c0 < m:
                w = min(_BAND_PANEL, m - c0)
                _gemm(c'N', c'T', m - c0, w, 2 * kk, <double>-1.0, pair + c0, n, swap + c0, n, <double>1.0,
                      &A[i0 + c0, i0 + c0], lda)
                c0 += w
            if ncols > 0:
                _reflect_rows(v, n, t, ldt, m, kk, &W[i0, 0], ldw, ncols, small, True)
            k += band
            p += 1
    free(tau); free(work); free(pair); free(swap); free(small)
    return p


def band_apply_q(const double[::1, :] A, int band, const double[:, :, ::1] T, int panels, double[::1, :] S):
    """S := Q S for the Q of :func:`band_reduce` (its reflectors in A, factors in T)."""
    cdef int n = A.shape[0], ncols = S.shape[1], lds = S.shape[0], ldt = band
    cdef int p, k, i0, m, kk
    cdef Py_ssize_t ldp = n
    cdef double *v
    cdef double *small
    if panels == 0 or ncols == 0:
        return
    v = <double *>malloc(n * band * sizeof(double))
    small = <double *>malloc(band * ncols * sizeof(double))
    if v == NULL or small == NULL:
        free(v); free(small)
        raise MemoryError("band_apply_q: no memory for its panel buffers")
    with nogil:
        for p in range(panels - 1, -1, -1):
            k = p * band
            i0 = k + band
            m = n - i0
            kk = min(m, band)
            _explicit_v(&A[i0, k], n, m, kk, v, ldp)
            _reflect_rows(v, n, <double *>&T[p, 0, 0], ldt, m, kk, &S[i0, 0], lds, ncols, small, False)
    free(v); free(small)


def banded_inverse_trace(const double[:, :] factor):
    """trace((L L^T)^-1) for a lower band Cholesky factor, LAPACK band storage (factor[t, i] = L[i + t, i]).

    Takahashi's recurrence gives the entries of the inverse inside the band,
    Sigma_ij = (delta_ij / L_ii - sum_{k > i} L_ki Sigma_kj) / L_ii for j >= i,
    from the last row up: O(d band^2), without forming the dense inverse.
    """
    cdef Py_ssize_t b = factor.shape[0] - 1, n = factor.shape[1]
    cdef Py_ssize_t i, j, k, hi
    cdef double acc, lii, trace = 0.0
    # sigma[i * (b + 1) + t] = Sigma[i + t, i]
    cdef double *sigma = <double *>calloc(n * (b + 1), sizeof(double))
    if sigma == NULL:
        raise MemoryError("banded_inverse_trace: no memory for the band of the inverse")
    with nogil:
        for i in range(n - 1, -1, -1):
            lii = factor[0, i]
            hi = min(i + b, n - 1)
            for j in range(hi, i - 1, -1):
                acc = 1.0 / lii if j == i else 0.0
                for k in range(i + 1, hi + 1):
                    # Sigma[k, j], both above i and within b of each other.
                    if k >= j:
                        acc -= factor[k - i, i] * sigma[j * (b + 1) + k - j]
                    else:
                        acc -= factor[k - i, i] * sigma[k * (b + 1) + j - k]
                sigma[i * (b + 1) + j - i] = acc / lii
            trace += sigma[i * (b + 1)]
    free(sigma)
    return trace


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------

cdef bint _finite_run(const floating *a, Py_ssize_t n) noexcept nogil:
    """True when none of a[0:n] is NaN or +-Inf.

    x - x is 0 for a finite x and NaN otherwise; the eight independent
    partial sums keep the loop free of branches, so the compiler can
    vectorize it (a reduction through one accumulator cannot be reordered).
    """
    cdef floating acc[8]
    cdef Py_ssize_t i, j, n8 = n - n % 8
    for j in range(8):
        acc[j] = 0
    for i in range(0, n8, 8):
        for j in range(8):
            acc[j] += a[i + j] - a[i + j]
    for i in range(n8, n):
        acc[0] += a[i] - a[i]
    for j in range(1, 8):
        acc[0] += acc[j]
    return acc[0] == 0



cdef bint _squares_run(const floating *a, Py_ssize_t n, floating scale) noexcept nogil:
    """True when every a[i] * a[i] * scale is finite (and so every a[i]); the partial sums as in _finite_run."""
    cdef floating acc[8]
    cdef floating s
    cdef Py_ssize_t i, j, n8 = n - n % 8
    for j in range(8):
        acc[j] = 0
    for i in range(0, n8, 8):
        for j in range(8):
            s = a[i + j] * a[i + j] * scale
            acc[j] += s - s
    for i in range(n8, n):
        s = a[i] * a[i] * scale
        acc[0] += s - s
    for j in range(1, 8):
        acc[0] += acc[j]
    return acc[0] == 0


def squares_finite(const floating[:, ::1] A, double scale):
    """True when every A[i, j]^2 * scale is finite in A's dtype (no temporary array)."""
    cdef Py_ssize_t n = A.shape[0] * A.shape[1], start = 0, step = 1 << 16
    cdef floating factor = <floating>scale
    cdef bint ok = True
    with nogil:
        while ok and start < n:
            ok = _squares_run(&A[0, 0] + start, min(step, n - start), factor)
            start += step
    return ok


def upper_finite(const floating[:, :] G):
    """True when no entry of the upper triangle of a contiguous square G is NaN or +-Inf."""
    cdef Py_ssize_t i, d = G.shape[0]
    cdef bint ok = True
    cdef bint rowmajor = G.strides[1] == sizeof(floating)
    with nogil:
        for i in range(d):
            # Row i from the diagonal on (row-major), or column i down to it (Fortran).
            ok = _finite_run(&G[i, i], d - i) if rowmajor else _finite_run(&G[0, i], i + 1)
            if not ok:
                break
    return ok

def all_finite(const floating[:, ::1] A):
    """True when no entry of A is NaN or +-Inf (no temporary array)."""
    cdef Py_ssize_t n = A.shape[0] * A.shape[1], start = 0, step = 1 << 16
    cdef bint ok = True
    if n == 0:
        return True
    with nogil:
        # Blocks of 64 Ki values: a non-finite value stops the scan early.
        while ok and start < n:
            ok = _finite_run(&A[0, 0] + start, min(step, n - start))
            start += step
    return ok


# ---------------------------------------------------------------------------
# Elementwise parts of a forward pass
# ---------------------------------------------------------------------------

def scale_negatives(floating[::1] x, floating factor):
    """x[i] := factor * x[i] where x[i] < 0, in place (a leaky ReLU)."""
    cdef Py_ssize_t i, n = x.shape[0]
    cdef floating *p = &x[0]
    cdef floating one = 1, zero = 0
    with nogil:
        # A multiplier chosen per value, not a branch: the loop vectorizes
        # (compare, blend, multiply) whatever the signs, and NaN stays NaN.
        for i in range(n):
            p[i] = p[i] * (factor if p[i] < zero else one)


def avg_pool_into(const floating[:, :, :, ::1] images, floating[:, :, :, ::1] out,
                  Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t sh, Py_ssize_t sw):
    """out[b, y, x] = mean of images[b, y*sh : y*sh+ph, x*sw : x*sw+pw] (NHWC)."""
    cdef Py_ssize_t B = out.shape[0], oh = out.shape[1], ow = out.shape[2], C = out.shape[3]
    cdef Py_ssize_t b, y, x, i, j, c
    cdef floating area = ph * pw
    cdef floating *dst
    cdef const floating *src
    with nogil:
        for b in range(B):
            for y in range(oh):
                for x in range(ow):
                    dst = &out[b, y, x, 0]
                    # Window offsets summed row by row, as NumPy's strided
                    # slices would: the result is bit-identical.
                    memcpy(dst, &images[b, y * sh, x * sw, 0], C * sizeof(floating))
                    for i in range(ph):
                        for j in range(pw):
                            if i == 0 and j == 0:
                                continue
                            src = &images[b, y * sh + i, x * sw + j, 0]
                            for c in range(C):
                                dst[c] += src[c]
                    for c in range(C):
                        dst[c] /= area


# ---------------------------------------------------------------------------
# Convolution statistics from the overlap of patches (stride 1)
# ---------------------------------------------------------------------------
#
# For a stride-1 k x k convolution, block (a, b) of P^T P (kernel offsets a, b)
# is sum over q in window(a) of x[q]^T x[q + b - a]: a channel correlation at
# the displacement b - a. The planner in _overlap.py splits the padded map into
# bands so that every window is a union of cells, groups the cells of each
# displacement that belong to the same set of windows, and lists the blocks
# each group adds into. Here every group is one gather of its rows from the
# images, one BLAS product and one fold into each of its blocks.

cdef void _pixel_run(const floating[:, :, :, ::1] images, Py_ssize_t img,
                     Py_ssize_t py, Py_ssize_t px, Py_ssize_t n_px,
                     Py_ssize_t ph, Py_ssize_t pw, floating *dst) noexcept nogil:
    """dst = pixels (py, px .. px + n_px) of the zero-padded image, C values each."""
    cdef Py_ssize_t H = images.shape[1], W = images.shape[2], c = images.shape[3]
    cdef Py_ssize_t iy = py - ph, ix = px - pw, lo, hi
    if iy < 0 or iy >= H:
        memset(dst, 0, n_px * c * sizeof(floating))
        return
    lo = max(0, -ix)
    hi = min(n_px, W - ix)
    if lo > 0 or hi < n_px:
        memset(dst, 0, n_px * c * sizeof(floating))
    if hi > lo:
        memcpy(dst + lo * c, &images[img, iy, ix + lo, 0], (hi - lo) * c * sizeof(floating))


cdef Py_ssize_t _gather(const floating[:, :, :, ::1] images, Py_ssize_t img0,
                        Py_ssize_t n_img, const int[:, ::1] cells,
                        Py_ssize_t cell0, Py_ssize_t cell1, Py_ssize_t dy,
                        Py_ssize_t dx, Py_ssize_t ph, Py_ssize_t pw,
                        floating *dst) noexcept nogil:
    """Rows (image, cell, y, x) of the cells shifted by (dy, dx); returns the row count."""
    cdef Py_ssize_t c = images.shape[3], rows = 0, b, cell, y, n_px
    for b in range(img0, img0 + n_img):
        for cell in range(cell0, cell1):
            n_px = cells[cell, 3] - cells[cell, 2]
            for y in range(cells[cell, 0], cells[cell, 1]):
                _pixel_run(images, b, y + dy, cells[cell, 2] + dx, n_px, ph, pw,
                           dst + rows * c)
                rows += n_px
    return rows


cdef inline void _add_block_row(const floating *src, bint rowmajor, Py_ssize_t c,
                                floating *G, double *G64, Py_ssize_t ldg, Py_ssize_t r0,
                                Py_ssize_t c0, Py_ssize_t i, bint upper_only) noexcept nogil:
    """Line i of G[r0:r0+c, c0:c0+c] += src[:c] (G64 when not NULL; upper part only on request).

    In G's layout a line is a row (row-major) or a column (Fortran): the
    contiguous direction of both src (stored in G's layout) and G.
    """
    cdef Py_ssize_t j, j0, j1, offset
    cdef floating *dst
    cdef double *dst64
    if rowmajor:
        j0, j1 = (i if upper_only else 0), c
        offset = (r0 + i) * ldg + c0
    else:
        j0, j1 = 0, (i + 1 if upper_only else c)
        offset = r0 + (c0 + i) * ldg
    if G64 != NULL:
        dst64 = G64 + offset
        for j in range(j0, j1):
            dst64[j] += src[j]
    else:
        dst = G + offset
        for j in range(j0, j1):
            dst[j] += src[j]


cdef void _window_sums(const floating[:, :, :, ::1] images, Py_ssize_t img,
                       Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t ph,
                       Py_ssize_t pw, Py_ssize_t out_h, Py_ssize_t out_w,
                       bint append_ones, floating *dst) noexcept nogil:
    """dst = sum of the patch rows of one image (stride 1): window sums per kernel offset."""
    cdef Py_ssize_t H = images.shape[1], W = images.shape[2], c = images.shape[3]
    cdef Py_ssize_t ay, ax, y, x, ch, iy, x_lo, x_hi
    cdef floating *out
    cdef const floating *px
    memset(dst, 0, kh * kw * c * sizeof(floating))
    for ay in range(kh):
        for ax in range(kw):
            out = dst + (ay * kw + ax) * c
            # Window rows [ay, ay + out_h) in padded coordinates, clipped to the image.
            x_lo = max(0, ax - pw)
            x_hi = min(W, ax - pw + out_w)
            for y in range(ay, ay + out_h):
                iy = y - ph
                if iy < 0 or iy >= H:
                    continue
                for x in range(x_lo, x_hi):
                    px = &images[img, iy, x, 0]
                    for ch in range(c):
                        out[ch] += px[ch]
    if append_ones:
        dst[kh * kw * c] = out_h * out_w


cdef void _fold_group(floating *acc, Py_ssize_t c, const int[:, ::1] groups,
                      const int[:, ::1] blocks, Py_ssize_t g, bint rowmajor,
                      floating *G, double *G64, Py_ssize_t ldg) noexcept nogil:
    """Add group g's product into each of its blocks of G and zero it (the caller marks it clean).

    Line by line: line i of the product is zeroed while it is still in cache
    from its last addition, so the next product need not be zeroed by BLAS.
    """
    cdef Py_ssize_t blk, i
    cdef bint diagonal = groups[g, 0] == 0 and groups[g, 1] == 0
    for i in range(c):
        for blk in range(groups[g, 4], groups[g, 5]):
            _add_block_row(acc + i * c, rowmajor, c, G, G64, ldg, blocks[blk, 0] * c,
                           blocks[blk, 1] * c, i, diagonal)
        memset(acc + i * c, 0, c * sizeof(floating))


cdef inline void _pointers(object G_out, bint mixed, floating **G, double **G64):
    """Raw pointer to G_out: *G64 on the float32-into-float64 path, else *G."""
    cdef floating[:, :] view
    cdef double[:, :] view64
    if mixed:
        view64 = G_out
        G64[0] = &view64[0, 0]
    else:
        view = G_out
        G[0] = &view[0, 0]


def overlap_accumulate(floating[:, :, ::1] acc, Py_ssize_t[::1] pending,
                       unsigned char[::1] clean, bint g_rowmajor, int ldg,
                       const floating[:, :, :, ::1] images,
                       const floating[:, ::1] targets,
                       const int[:, ::1] groups, const int[:, ::1] cells,
                       const int[:, ::1] blocks,
                       floating[::1] buf_a, floating[::1] buf_b,
                       floating[:, ::1] sums, object G_out, object C_out,
                       bint c_rowmajor, int ldc,
                       Py_ssize_t kh, Py_ssize_t kw, Py_ssize_t ph,
                       Py_ssize_t pw, Py_ssize_t out_h, Py_ssize_t out_w,
                       bint append_ones, Py_ssize_t chunk,
                       bint mixed, Py_ssize_t block_rows, Py_ssize_t tile):
    """acc[g] += displacement product of group g; G's bias column and C directly.

    ``groups`` rows are (dy, dx, first cell, end cell, first block, end
    block); ``cells`` rows (y0, y1, x0, x1) in padded coordinates; ``blocks``
    rows (a, b) kernel-offset indices with b after a. ``acc[g]`` (c x c, in
    G's layout) collects group g's product across calls, so the blocks of G
    are touched once per :func:`overlap_assemble`, not once per call. On the
    float32-into-float64 path (G_out, C_out float64) a group is folded into
    G whenever it has summed ``block_rows`` rows in float32 (``pending``).
    A group with no pending rows holds no product: its first one overwrites
    acc[g] (beta 0), so acc needs no zeroing, unless ``clean[g]`` says
    acc[g] is zero already (the fold or the assembly zeroed it in cache):
    then it accumulates (beta 1), which spares BLAS its pass that zeroes
    the product first.
    """
    cdef Py_ssize_t c = images.shape[3], n = images.shape[0], d = sums.shape[1]
    cdef Py_ssize_t m = targets.shape[1], n_groups = groups.shape[0]
    cdef Py_ssize_t img0, n_img, g, rows, r0, kb, j, b
    cdef Py_ssize_t dy, dx
    cdef bint diagonal
    cdef floating beta
    cdef floating *G = NULL
    cdef floating *C = NULL
    cdef double *G64 = NULL
    cdef double *C64 = NULL
    cdef double *bias_sums = NULL
    cdef floating *sa = &buf_a[0]
    cdef floating *sb = &buf_b[0]
    cdef floating *a_g
    cdef float *tile_buf = NULL
    _pointers(G_out, mixed, &G, &G64)
    _pointers(C_out, mixed, &C, &C64)
    if mixed:
        tile_buf = <float *>malloc(max(1, min(d, tile) * min(m, tile)) * sizeof(float))
        if tile_buf == NULL:
            raise MemoryError("cannot allocate the float32 tile")
    if append_ones:
        bias_sums = <double *>malloc(d * sizeof(double))
        if bias_sums == NULL:
            free(tile_buf)
            raise MemoryError("cannot allocate the bias-column sums")
    try:
        with nogil:
            img0 = 0
            while img0 < n:
                n_img = min(chunk, n - img0)
                for g in range(n_groups):
                    dy = groups[g, 0]
                    dx = groups[g, 1]
                    diagonal = dy == 0 and dx == 0
                    a_g = &acc[g, 0, 0]
                    rows = _gather(images, img0, n_img, cells, groups[g, 2], groups[g, 3],
                                   0, 0, ph, pw, sa)
                    if not diagonal:
                        _gather(images, img0, n_img, cells, groups[g, 2], groups[g, 3],
                                dy, dx, ph, pw, sb)
                    r0 = 0
                    while r0 < rows:
                        kb = rows - r0
                        if mixed:
                            kb = min(kb, block_rows - pending[g])
                        beta = 1.0 if pending[g] > 0 or clean[g] else 0.0
                        # acc[g] in G's layout: a row-major product is the Fortran transpose.
                        if diagonal:
                            _syrk_tn(sa + r0 * c, True, <int>c, <int>kb, <int>c,
                                     beta, a_g, g_rowmajor, <int>c)
                        else:
                            _gemm_tn(sa + r0 * c, True, <int>c, sb + r0 * c, True, <int>c,
                                     <int>kb, <int>c, <int>c, beta, a_g, g_rowmajor, <int>c)
                        pending[g] += kb
                        clean[g] = 0
                        if mixed and pending[g] >= block_rows:
                            _fold_group(a_g, c, groups, blocks, g, g_rowmajor, G, G64, ldg)
                            pending[g] = 0
                            clean[g] = 1
                        r0 += kb
                # Per-image patch sums: the bias column of G and the cross term.
                for b in range(n_img):
                    _window_sums(images, img0 + b, kh, kw, ph, pw, out_h, out_w,
                                 append_ones, &sums[b, 0])
                if append_ones:
                    # Summed over the chunk first: in a row-major G the bias column
                    # is strided, one page per row, so it is walked once per chunk.
                    memset(bias_sums, 0, d * sizeof(double))
                    for b in range(n_img):
                        for j in range(d):
                            bias_sums[j] += sums[b, j]
                    for j in range(d):
                        if mixed:
                            G64[(d - 1) * ldg + j if not g_rowmajor else j * ldg + d - 1] += bias_sums[j]
                        else:
                            G[(d - 1) * ldg + j if not g_rowmajor else j * ldg + d - 1] += <floating>bias_sums[j]
                _flush_sums(C, c_rowmajor, ldc, C64, targets, sums, img0, n_img,
                            block_rows, tile, tile_buf)
                img0 += n_img
    finally:
        free(tile_buf)
        free(bias_sums)


def overlap_assemble(floating[:, :, ::1] acc, const Py_ssize_t[::1] pending,
                     const int[:, ::1] block_keys, const int[::1] block_start,
                     const int[::1] block_groups, object G_out, bint g_rowmajor,
                     int ldg, bint mixed, Py_ssize_t first_line, Py_ssize_t stop_line):
    """Lines first_line..stop_line-1 of every block of G += the products of their groups that hold pending rows.

    ``block_keys`` rows (a, b) name each block of G once; its groups are
    ``block_groups[block_start[k]:block_start[k + 1]]``, in increasing order,
    so every element of G receives the same additions in the same order as
    group-by-group folding. Line by line across all the blocks: line i of
    every product is read from memory once, however many blocks it feeds, and
    line i of every block (a few hundred KiB) stays in cache while all its
    groups are added. Disjoint line ranges may run in parallel threads. Line
    i of each pending product is zeroed after its last addition, while it is
    in cache; the caller then marks those groups clean and restarts them
    (pending 0).
    """
    cdef Py_ssize_t c = acc.shape[1], n_blocks = block_keys.shape[0], k, i, p, g
    cdef floating *G = NULL
    cdef double *G64 = NULL
    _pointers(G_out, mixed, &G, &G64)
    with nogil:
        for i in range(first_line, stop_line):
            for k in range(n_blocks):
                for p in range(block_start[k], block_start[k + 1]):
                    g = block_groups[p]
                    if pending[g] > 0:
                        _add_block_row(&acc[g, i, 0], g_rowmajor, c, G, G64, ldg, block_keys[k, 0] * c,
                                       block_keys[k, 1] * c, i, block_keys[k, 0] == block_keys[k, 1])
            for g in range(acc.shape[0]):
                if pending[g] > 0:
                    memset(&acc[g, i, 0], 0, c * sizeof(floating))


# ---------------------------------------------------------------------------
# Winograd F(2x2, 3x3) transforms (the products run through gemm in between)
# ---------------------------------------------------------------------------

cdef inline void _diff(floating *out, const floating *a, const floating *b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = a[i] - b[i]


cdef inline void _sum(floating *out, const floating *a, const floating *b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = a[i] + b[i]


def winograd_input(const floating[:, :, :, ::1] x, floating[:, :, ::1] V, floating[::1] scratch,
                   Py_ssize_t th, Py_ssize_t tw):
    """V[4 i + j, tile] = (B^T d B)[i, j], d the 4 x 4 tile at (2 ty, 2 tx) of the padded maps x; tiles (b, ty, tx).

    B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]: rows
    first (t = B^T d, four channel vectors per column in ``scratch``, 16 C
    values), then columns, each step one vectorizable loop over the channels.
    """
    cdef Py_ssize_t n = x.shape[0], c = x.shape[3], tile, b, y0, x0, v, i
    cdef const floating *d[4]
    cdef floating *t
    cdef floating *rows = &scratch[0]
    with nogil:
        for tile in range(n * th * tw):
            b, y0, x0 = tile // (th * tw), 2 * (tile // tw % th), 2 * (tile % tw)
            for v in range(4):
                for i in range(4):
                    d[i] = &x[b, y0 + i, x0 + v, 0]
                # rows[4 i + v] = (B^T d)[i, v]
                _diff(rows + (0 + v) * c, d[0], d[2], c)
                _sum(rows + (4 + v) * c, d[1], d[2], c)
                _diff(rows + (8 + v) * c, d[2], d[1], c)
                _diff(rows + (12 + v) * c, d[1], d[3], c)
            for i in range(4):
                t = rows + 4 * i * c
                _diff(&V[4 * i + 0, tile, 0], t, t + 2 * c, c)
                _sum(&V[4 * i + 1, tile, 0], t + c, t + 2 * c, c)
                _diff(&V[4 * i + 2, tile, 0], t + 2 * c, t + c, c)
                _diff(&V[4 * i + 3, tile, 0], t + c, t + 3 * c, c)


def winograd_output(const floating[:, :, ::1] M, floating[:, :, :, ::1] out, const floating[::1] bias,
                    floating[::1] scratch, Py_ssize_t th, Py_ssize_t tw):
    """out[b, 2 ty + r, 2 tx + s] = (A^T m A)[r, s] + bias for each tile's 4 x 4 m = M[:, tile]; clipped to out.

    A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]: s = A^T m row pairs (eight filter
    vectors in ``scratch``, 8 F values), then the two columns of each, one
    loop over the filters each.
    """
    cdef Py_ssize_t oh = out.shape[1], ow = out.shape[2], f = out.shape[3]
    cdef Py_ssize_t b, ty, tx, j, r, k, tile, y, x
    cdef const floating *m[16]
    cdef floating *s0
    cdef floating *dst
    cdef floating *rows = &scratch[0]
    with nogil:
        for b in range(out.shape[0]):
            for ty in range(th):
                for tx in range(tw):
                    tile = (b * th + ty) * tw + tx
                    for k in range(16):
                        m[k] = &M[k, tile, 0]
                    for j in range(4):
                        # rows[j] = m[0, j] + m[1, j] + m[2, j]; rows[4 + j] = m[1, j] - m[2, j] - m[3, j]
                        s0 = rows + j * f
                        for k in range(f):
                            s0[k] = m[j][k] + m[4 + j][k] + m[8 + j][k]
                        s0 = rows + (4 + j) * f
                        for k in range(f):
                            s0[k] = m[4 + j][k] - m[8 + j][k] - m[12 + j][k]
                    for r in range(2):
                        y = 2 * ty + r
                        if y >= oh:
                            break
                        s0 = rows + 4 * r * f
                        x = 2 * tx
                        dst = &out[b, y, x, 0]
                        for k in range(f):
                            dst[k] = s0[k] + s0[f + k] + s0[2 * f + k] + bias[k]
                        if x + 1 < ow:
                            dst = &out[b, y, x + 1, 0]
                            for k in range(f):
                                dst[k] = s0[f + k] - s0[2 * f + k] - s0[3 * f + k] + bias[k]
