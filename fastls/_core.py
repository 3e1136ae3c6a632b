"""Public kernels: validation and dispatch to the typed code in ``_kernels``.

Conventions shared by every kernel:

* Matrices are float32 or float64 NumPy arrays, C- or Fortran-ordered.
  Outputs updated in place must be writable and contiguous; inputs of any
  layout are accepted (non-contiguous ones are copied once).
* Gram matrices hold their data in the **upper triangle** (``G[i, j]`` with
  ``i <= j``); the strict lower triangle is never read or written by the
  kernels. :func:`symmetrize` gives the full matrix.
* A float64 output may accumulate float32 inputs: products run in float32
  BLAS over at most ``block_rows`` rows and are added to the float64 output,
  so the float32 rounding error is bounded by the block, not by N.
* Images are NHWC (batch, height, width, channels), channels last, so that a
  kernel row inside the image is one contiguous run of memory and a patch
  row is laid out (ky, kx, channel) with the channel fastest.
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np
import scipy.linalg

from . import _kernels

__all__ = [
    "gram_update",
    "cross_update",
    "symmetrize",
    "im2col",
    "conv_output_shape",
    "conv_gram_update",
    "ridge_solve",
    "proximal_solve",
]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
DEFAULT_BLOCK_ROWS = 4096
DEFAULT_TILE = 2048
DEFAULT_SCRATCH_BYTES = 64 * 2**20


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

def _check_array(name, A, ndim):
    if not isinstance(A, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(A).__name__}")
    if A.dtype not in _FLOATS:
        raise TypeError(f"{name} must have dtype float32 or float64, got {A.dtype}")
    if A.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {A.shape}")


def _check_output(name, A, ndim):
    _check_array(name, A, ndim)
    if not A.flags.writeable:
        raise ValueError(f"{name} is read-only; it is updated in place and must be writable")
    if not (A.flags.c_contiguous or A.flags.f_contiguous):
        raise ValueError(
            f"{name} must be C- or Fortran-contiguous (it is updated in place), "
            f"got strides {A.strides} for shape {A.shape}"
        )


def _as_input(A):
    """A itself when BLAS can read it, else a C-contiguous copy."""
    if A.flags.c_contiguous or A.flags.f_contiguous:
        return A
    return np.ascontiguousarray(A)


def _layout(A):
    """(rowmajor, leading dimension) of a contiguous matrix, as BLAS needs."""
    if A.flags.c_contiguous:
        return True, max(1, A.shape[1])
    return False, max(1, A.shape[0])


def _check_finite(name, A):
    if A.size == 0:
        return
    # The transpose of an F-ordered array is C-ordered: scan memory in order.
    flat = A if A.flags.c_contiguous else A.T
    if not _kernels.all_finite(flat.reshape(flat.shape[0], -1)):
        raise ValueError(f"{name} contains NaN or Inf; expected finite values")


def _check_pair_dtypes(out_name, out, in_name, inp):
    """Same dtype, or float32 input into a float64 output; returns mixed flag."""
    if out.dtype == inp.dtype:
        return False
    if out.dtype == np.float64 and inp.dtype == np.float32:
        return True
    raise TypeError(
        f"{in_name} is {inp.dtype} but {out_name} is {out.dtype}: accumulating "
        f"float64 data into float32 would lose precision; use a float64 {out_name}"
    )


def _check_positive(name, value, meaning):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 ({meaning}), got {value!r}")
    return float(value)


def _check_count(name, value, minimum=1):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------
# Gram and cross products
# ---------------------------------------------------------------------------

def gram_update(G, X, *, block_rows=DEFAULT_BLOCK_ROWS, check_finite=True):
    """G += X^T X in place, upper triangle, through BLAS syrk.

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64, C- or F-contiguous
        Accumulator; only its upper triangle is read and written.
    X : ndarray of shape (N, d), float32 or float64
        Rows are samples. float32 X into float64 G uses float32 BLAS on
        blocks of ``block_rows`` rows, accumulated in float64.
    block_rows : int, default=4096
        Rows per float32 block on the mixed-precision path.
    check_finite : bool, default=True
        Raise ValueError on NaN/Inf in X before G is touched.

    Returns
    -------
    G : ndarray of shape (d, d)
        The same array, updated.
    """
    _check_output("G", G, 2)
    _check_array("X", X, 2)
    d = X.shape[1]
    if G.shape != (d, d):
        raise ValueError(f"G must have shape (d, d) = ({d}, {d}) to match X of shape {X.shape}, got {G.shape}")
    mixed = _check_pair_dtypes("G", G, "X", X)
    block_rows = _check_count("block_rows", block_rows)
    if X.shape[0] == 0 or d == 0:
        return G
    X = _as_input(X)
    if check_finite:
        _check_finite("X", X)
    g_layout, x_layout = _layout(G), _layout(X)
    if mixed:
        _kernels.gram_mixed(G, *g_layout, X, *x_layout, block_rows, DEFAULT_TILE)
    else:
        _kernels.gram_same(G, *g_layout, X, *x_layout)
    return G


def cross_update(C, X, Z, *, block_rows=DEFAULT_BLOCK_ROWS, check_finite=True):
    """C += X^T Z in place through BLAS gemm.

    Parameters
    ----------
    C : ndarray of shape (d, m), float32 or float64, C- or F-contiguous
    X : ndarray of shape (N, d), float32 or float64
    Z : ndarray of shape (N, m), same dtype as X
        float32 X and Z into a float64 C take the blocked mixed path.
    block_rows : int, default=4096
    check_finite : bool, default=True

    Returns
    -------
    C : ndarray of shape (d, m)
    """
    _check_output("C", C, 2)
    _check_array("X", X, 2)
    _check_array("Z", Z, 2)
    if Z.shape[0] != X.shape[0]:
        raise ValueError(f"X and Z must have the same number of rows, got {X.shape} and {Z.shape}")
    if X.dtype != Z.dtype:
        raise TypeError(f"X and Z must share a dtype, got {X.dtype} and {Z.dtype}")
    if C.shape != (X.shape[1], Z.shape[1]):
        raise ValueError(
            f"C must have shape (d, m) = {(X.shape[1], Z.shape[1])} for X {X.shape} and Z {Z.shape}, got {C.shape}"
        )
    mixed = _check_pair_dtypes("C", C, "X", X)
    block_rows = _check_count("block_rows", block_rows)
    if X.shape[0] == 0 or C.size == 0:
        return C
    X, Z = _as_input(X), _as_input(Z)
    if check_finite:
        _check_finite("X", X)
        _check_finite("Z", Z)
    layouts = (*_layout(C), X, *_layout(X), Z, *_layout(Z))
    if mixed:
        _kernels.cross_mixed(C, *layouts, block_rows, DEFAULT_TILE)
    else:
        _kernels.cross_same(C, *layouts)
    return C


def symmetrize(G, *, inplace=False):
    """Full symmetric matrix from the upper triangle of G: triu(G) + triu(G, 1)^T.

    Parameters
    ----------
    G : ndarray of shape (d, d)
    inplace : bool, default=False
        Overwrite the lower triangle of G instead of returning a new array.

    Returns
    -------
    ndarray of shape (d, d)
    """
    if G.ndim != 2 or G.shape[0] != G.shape[1]:
        raise ValueError(f"G must be a square matrix, got shape {G.shape}")
    out = G if inplace else G.copy()
    lower = np.tril_indices(G.shape[0], -1)
    out[lower] = out.T[lower]
    return out


# ---------------------------------------------------------------------------
# Convolution patches
# ---------------------------------------------------------------------------

def _pair(name, value):
    if isinstance(value, numbers.Integral):
        value = (value, value)
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    return int(a), int(b)


def _conv_geometry(image_hw, kernel_size, stride, padding):
    kh, kw = _pair("kernel_size", kernel_size)
    sh, sw = _pair("stride", stride)
    if kh < 1 or kw < 1 or sh < 1 or sw < 1:
        raise ValueError(f"kernel_size and stride must be >= 1, got {(kh, kw)} and {(sh, sw)}")
    if isinstance(padding, str):
        if padding == "valid":
            ph = pw = 0
        elif padding == "same":
            if (sh, sw) != (1, 1) or kh % 2 == 0 or kw % 2 == 0:
                raise ValueError("padding='same' needs stride 1 and an odd kernel size")
            ph, pw = kh // 2, kw // 2
        else:
            raise ValueError(f"padding must be 'valid', 'same', an int or a pair of ints, got {padding!r}")
    else:
        ph, pw = _pair("padding", padding)
        if ph < 0 or pw < 0:
            raise ValueError(f"padding must be >= 0, got {(ph, pw)}")
    H, W = image_hw
    out_h = (H + 2 * ph - kh) // sh + 1
    out_w = (W + 2 * pw - kw) // sw + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(
            f"a {kh}x{kw} kernel with padding {(ph, pw)} does not fit a {H}x{W} image"
        )
    return kh, kw, sh, sw, ph, pw, out_h, out_w


def conv_output_shape(image_hw, kernel_size, stride=1, padding=0):
    """(out_h, out_w) = ((H + 2 ph - kh) // sh + 1, (W + 2 pw - kw) // sw + 1).

    ``padding`` is an int, a pair, ``'valid'`` (0) or ``'same'`` (k // 2).
    """
    return _conv_geometry(image_hw, kernel_size, stride, padding)[-2:]


def _check_images(images):
    _check_array("images", images, 4)
    return np.ascontiguousarray(images)


def im2col(images, kernel_size, *, stride=1, padding=0, append_ones=False):
    """Patch matrix P with P[(b, y, x)] = patch of image b at output (y, x).

    Parameters
    ----------
    images : ndarray of shape (B, H, W, C), float32 or float64 (NHWC)
    kernel_size, stride, padding : int or pair; padding also 'valid'/'same'
        Zero padding on both sides.
    append_ones : bool, default=False
        Append a constant-1 column (the bias input).

    Returns
    -------
    P : ndarray of shape (B * out_h * out_w, kh * kw * C + append_ones)
        C-ordered; columns ordered (ky, kx, channel), channel fastest; rows
        ordered (image, y, x), so ``P @ W`` reshapes to NHWC outputs.
    """
    images = _check_images(images)
    kh, kw, sh, sw, ph, pw, out_h, out_w = _conv_geometry(images.shape[1:3], kernel_size, stride, padding)
    d = kh * kw * images.shape[3] + int(bool(append_ones))
    out = np.empty((images.shape[0] * out_h * out_w, d), dtype=images.dtype)
    if out.size:
        _kernels.im2col_into(images, out, kh, kw, sh, sw, ph, pw, out_h, out_w, bool(append_ones))
    return out


def conv_gram_update(G, C, images, targets, kernel_size, *, stride=1, padding=0,
                     append_ones=False, scratch_bytes=DEFAULT_SCRATCH_BYTES,
                     block_rows=DEFAULT_BLOCK_ROWS, check_finite=True):
    """G += P^T P and C += P^T T for the patch matrix P of a batch, streamed.

    P is ``im2col(images, ...)`` but is never materialized whole: patches are
    built chunk by chunk in a scratch buffer of at most ``scratch_bytes``.

    Parameters
    ----------
    G : ndarray of shape (d, d), d = kh * kw * channels + append_ones
        Upper-triangle accumulator (float32, or float64 for either input dtype).
    C : ndarray of shape (d, m), dtype of G
    images : ndarray of shape (B, H, W, channels), float32 or float64 (NHWC)
    targets : ndarray of shape (B, m) or (B, out_h, out_w, m), dtype of images
        Per-image targets (e.g. an encoded label) apply at every output
        position; that case costs a patch sum per image instead of a
        d x m product per patch.
    kernel_size, stride, padding, append_ones : as in :func:`im2col`
    scratch_bytes : int, default=64 MiB
        Upper bound on the working memory, whatever B is.
    block_rows : int, default=4096
        Float32 block on the float32-into-float64 path.
    check_finite : bool, default=True

    Returns
    -------
    (G, C) : the same arrays, updated.
    """
    _check_output("G", G, 2)
    _check_output("C", C, 2)
    images = _check_images(images)
    if not isinstance(targets, np.ndarray):
        raise TypeError(f"targets must be a NumPy array, got {type(targets).__name__}")
    kh, kw, sh, sw, ph, pw, out_h, out_w = _conv_geometry(images.shape[1:3], kernel_size, stride, padding)
    B = images.shape[0]
    d = kh * kw * images.shape[3] + int(bool(append_ones))
    if targets.dtype != images.dtype:
        raise TypeError(f"targets must have the dtype of images ({images.dtype}), got {targets.dtype}")
    if targets.ndim == 2 and targets.shape[0] == B:
        per_image = True
    elif targets.ndim == 4 and targets.shape[:3] == (B, out_h, out_w):
        per_image = False
    else:
        raise ValueError(
            f"targets must have shape (B, m) = ({B}, m) or (B, out_h, out_w, m) = "
            f"({B}, {out_h}, {out_w}, m), got {targets.shape}"
        )
    m = targets.shape[-1]
    if G.shape != (d, d):
        raise ValueError(f"G must have shape ({d}, {d}) (kh*kw*channels + append_ones), got {G.shape}")
    if C.shape != (d, m):
        raise ValueError(f"C must have shape ({d}, {m}), got {C.shape}")
    if G.dtype != C.dtype:
        raise TypeError(f"G and C must share a dtype, got {G.dtype} and {C.dtype}")
    mixed = _check_pair_dtypes("G", G, "images", images)
    block_rows = _check_count("block_rows", block_rows)
    scratch_bytes = _check_count("scratch_bytes", scratch_bytes)
    if B == 0:
        return G, C
    targets = np.ascontiguousarray(targets.reshape(targets.shape[0], m) if per_image else targets.reshape(-1, m))
    if check_finite:
        _check_finite("images", images)
        _check_finite("targets", targets)

    itemsize = images.dtype.itemsize
    tile_bytes = min(DEFAULT_TILE, d) ** 2 * 4 if mixed else 0
    row_bytes = d * itemsize
    per_img_rows = out_h * out_w
    # Chunk rows r and patch-sum rows s = r / per_img_rows + 2 share the budget.
    budget_rows = (scratch_bytes - tile_bytes) // row_bytes
    rows = int((budget_rows - (2 if per_image else 0)) / (1 + (1 / per_img_rows if per_image else 0)))
    if rows < 1:
        need = tile_bytes + row_bytes * (3 if per_image else 1)
        raise ValueError(f"scratch_bytes={scratch_bytes} is too small for patches of {d} values; need at least {need}")
    rows = min(rows, B * per_img_rows)
    scratch = np.empty((rows, d), dtype=images.dtype)
    sums = np.zeros((rows // per_img_rows + 2 if per_image else 1, d), dtype=images.dtype)
    geometry = (kh, kw, sh, sw, ph, pw, out_h, out_w, bool(append_ones))
    if mixed:
        _kernels.conv_stats_mixed(G, *_layout(G), C, *_layout(C), images, targets, per_image, scratch, sums,
                                  *geometry, block_rows, DEFAULT_TILE)
    else:
        _kernels.conv_stats_same(G, *_layout(G), C, *_layout(C), images, targets, per_image, scratch, sums,
                                 *geometry)
    return G, C


# ---------------------------------------------------------------------------
# Solves
# ---------------------------------------------------------------------------

_ON_FAILURE = ("raise", "eigh")


def _spd_solve(G, rhs, shift, shift_name, overwrite_g, on_failure, check_finite, what):
    """(G + shift I)^-1 rhs, rhs already an F-ordered working array."""
    if on_failure not in _ON_FAILURE:
        raise ValueError(f"on_failure must be one of {_ON_FAILURE}, got {on_failure!r}")
    if on_failure == "eigh" and overwrite_g:
        raise ValueError("on_failure='eigh' needs the original G: it cannot be combined with overwrite_g=True")
    d = G.shape[0]
    if d == 0:
        return rhs
    if check_finite:
        _check_finite("G", G)
    in_place = overwrite_g and G.flags.writeable and (G.flags.c_contiguous or G.flags.f_contiguous)
    A = G if in_place else G.copy(order="F" if G.flags.f_contiguous else "C")
    _kernels.add_diagonal(A, shift)
    info = _kernels.cholesky_solve(A, *_layout(A), rhs)
    if info == 0:
        return rhs
    if info < 0:  # pragma: no cover - an argument error is a bug here
        raise RuntimeError(f"LAPACK potrf/potrs rejected argument {-info}")
    if on_failure == "raise":
        raise np.linalg.LinAlgError(
            f"{what}: G + {shift_name} I is not positive definite (Cholesky failed at column {info}, "
            f"{shift_name}={shift:g}). G must be a Gram matrix X^T X (upper triangle read); increase "
            f"{shift_name}, check how G was accumulated, or pass on_failure='eigh' to solve through a "
            f"symmetric eigendecomposition (pseudo-inverse)."
        )
    warnings.warn(
        f"{what}: G + {shift_name} I is not positive definite; solving through eigh (pseudo-inverse)",
        RuntimeWarning,
        stacklevel=3,
    )
    evals, evecs = scipy.linalg.eigh(symmetrize(np.asarray(G, dtype=rhs.dtype)), lower=False)
    evals = evals + shift
    tol = np.abs(evals).max() * d * np.finfo(rhs.dtype).eps
    inv = np.where(evals > tol, 1.0 / np.where(evals > tol, evals, 1.0), 0.0).astype(rhs.dtype)
    return np.asfortranarray(evecs @ (inv[:, None] * (evecs.T @ rhs)))


def _check_system(G, C):
    _check_array("G", G, 2)
    _check_array("C", C, 2)
    if G.shape[0] != G.shape[1]:
        raise ValueError(f"G must be square (d, d), got {G.shape}")
    if C.shape[0] != G.shape[0]:
        raise ValueError(f"C must have shape (d, m) with d = {G.shape[0]} rows to match G, got {C.shape}")
    if C.dtype != G.dtype:
        raise TypeError(f"G and C must share a dtype, got {G.dtype} and {C.dtype}")
    G = _as_input(G)
    return G


def _working_rhs(C, overwrite_c):
    if overwrite_c and C.flags.f_contiguous and C.flags.writeable:
        return C
    return np.array(C, order="F", copy=True)


def ridge_solve(G, C, gamma, *, overwrite_g=False, overwrite_c=False, on_failure="raise", check_finite=True):
    """W = (G + gamma I)^-1 C by Cholesky (potrf/potrs), never an explicit inverse.

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64
        Gram matrix; only its upper triangle is read.
    C : ndarray of shape (d, m), dtype of G
    gamma : float > 0
        Ridge regularization.
    overwrite_g : bool, default=False
        Factorize G in place (no d x d copy); G is destroyed.
    overwrite_c : bool, default=False
        Solve into C when it is Fortran-contiguous (else a d x m copy is made).
    on_failure : {'raise', 'eigh'}, default='raise'
        When G + gamma I is not positive definite: raise LinAlgError, or warn
        and solve by a symmetric eigendecomposition with a pseudo-inverse.
    check_finite : bool, default=True

    Returns
    -------
    W : ndarray of shape (d, m), Fortran-ordered, dtype of G
    """
    G = _check_system(G, C)
    gamma = _check_positive("gamma", gamma, "the ridge regularization")
    if check_finite:
        _check_finite("C", C)
    rhs = _working_rhs(C, overwrite_c)
    return _spd_solve(G, rhs, gamma, "gamma", overwrite_g, on_failure, check_finite, "ridge_solve")


def proximal_solve(G, C, eps, M, *, overwrite_g=False, overwrite_c=False, on_failure="raise", check_finite=True):
    """W = (G + eps I)^-1 (C + eps M): the least-squares step pulled towards M.

    Solves argmin_W ||Z - X W||^2 + eps ||W - M||^2 given G = X^T X and
    C = X^T Z (pFedACnnL's personalization, eq. 13).

    Parameters
    ----------
    G : ndarray of shape (d, d), float32 or float64 (upper triangle read)
    C : ndarray of shape (d, m), dtype of G
    eps : float > 0
        Proximal weight.
    M : ndarray of shape (d, m)
        The weights to stay near (the group's meta-model).
    overwrite_g, overwrite_c, on_failure, check_finite : as in :func:`ridge_solve`

    Returns
    -------
    W : ndarray of shape (d, m), Fortran-ordered, dtype of G
    """
    G = _check_system(G, C)
    _check_array("M", M, 2)
    if M.shape != C.shape:
        raise ValueError(f"M must have the shape of C {C.shape}, got {M.shape}")
    eps = _check_positive("eps", eps, "the proximal weight")
    if check_finite:
        _check_finite("C", C)
        _check_finite("M", _as_input(M))
    rhs = _working_rhs(C, overwrite_c)
    rhs += eps * M
    return _spd_solve(G, rhs, eps, "eps", overwrite_g, on_failure, check_finite, "proximal_solve")
