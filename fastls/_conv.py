"""Forward passes of convolutional layers: convolution, average pooling and the leaky ReLU.

Convolutions run as im2col + gemm, or by Winograd's F(2x2, 3x3) for 3 x 3 stride-1 kernels.

F(2x2, 3x3) (Lavin and Gray, "Fast algorithms for convolutional neural
networks", 2016) computes each 2 x 2 block of outputs from a 4 x 4 tile of
the input as Y = A^T [(G g G^T) . (B^T d B)] A: the sum over channels becomes
16 products (tiles x C) @ (C x F), one per entry of the 4 x 4 transformed tile,
2.25x fewer multiply-adds than the 9 C F per output of im2col. The transforms'
coefficients are 0, +-1 and +-1/2, so the rounding stays that of a sum of
products (tested against float64 references with the usual tolerances).
"""

from __future__ import annotations

import numbers
from typing import Literal

import numpy as np

from . import _kernels
from ._patches import IntPair, Padding, _check_images, _conv_geometry, _pair, im2col
from ._products import matmul
from ._validation import _check_array, _check_count, _check_disjoint, _check_output
from ._workspace import DEFAULT_SCRATCH_BYTES

__all__ = ["conv2d", "winograd_filters", "conv2d_method", "WINOGRAD_MIN_CHANNELS", "avg_pool2d", "scale_negatives"]

#: 'auto' takes Winograd for 3 x 3 stride-1 kernels from this many input
#: channels and filters: below it the 16 products are too thin for BLAS to
#: beat im2col (docs/results/kernels_notes.md).
WINOGRAD_MIN_CHANNELS = 64
_CONV2D_METHODS = ("auto", "im2col", "winograd")


def conv2d_method(kernel_size: IntPair, stride: IntPair, channels: int, filters: int,
                  method: Literal["auto", "im2col", "winograd"] = "auto") -> Literal["im2col", "winograd"]:
    """The forward method :func:`conv2d` runs: 'winograd' or 'im2col'.

    Winograd applies to 3 x 3 kernels with stride 1; 'auto' takes it there
    when ``channels`` and ``filters`` are both at least ``WINOGRAD_MIN_CHANNELS``.

    Raises
    ------
    ValueError
        If ``method`` is unknown, or 'winograd' is asked for another kernel or stride.
    """
    if method not in _CONV2D_METHODS:
        raise ValueError(f"method must be one of {_CONV2D_METHODS}, got {method!r}")
    applies = _pair("kernel_size", kernel_size) == (3, 3) and _pair("stride", stride) == (1, 1)
    if method == "winograd" and not applies:
        raise ValueError(f"method='winograd' needs a 3x3 kernel and stride 1, got kernel_size={kernel_size!r}, "
                         f"stride={stride!r}")
    if method == "auto":
        return "winograd" if applies and min(channels, filters) >= WINOGRAD_MIN_CHANNELS else "im2col"
    return method


def winograd_filters(W: np.ndarray, channels: int) -> np.ndarray:
    """U[4 i + j] = (G g G^T)[i, j] for every (channel, filter): 3 x 3 kernels in F(2x2, 3x3) form.

    Parameters
    ----------
    W : ndarray of shape (9 * channels [+ 1], F), float32 or float64
        Flattened kernels, rows ordered (ky, kx, channel) as :func:`im2col`'s
        columns; a last bias row, if any, is ignored.
    channels : int

    Returns
    -------
    U : ndarray of shape (16, channels, F), dtype of W, C-contiguous

    Raises
    ------
    ValueError
        If W does not have 9 * channels (+ 1) rows.
    """
    _check_array("W", W, 2)
    if W.shape[0] not in (9 * channels, 9 * channels + 1):
        raise ValueError(f"W must have 9 * channels (+ 1 bias) = {9 * channels} (+ 1) rows for 3x3 kernels of "
                         f"{channels} channels, got shape {W.shape}")
    F = W.shape[1]
    g = W[:9 * channels].reshape(3, 3, channels, F)
    half = W.dtype.type(0.5)
    # G g along ky, then (G g) G^T along kx; G = [[1, 0, 0], [1/2, 1/2, 1/2], [1/2, -1/2, 1/2], [0, 0, 1]].
    rows = (g[0], (g[0] + g[1] + g[2]) * half, (g[0] - g[1] + g[2]) * half, g[2])
    U = np.empty((4, 4, channels, F), dtype=W.dtype)
    for i, r in enumerate(rows):
        U[i, 0] = r[0]
        np.add(r[0], r[1], out=U[i, 1])
        U[i, 1] += r[2]
        U[i, 1] *= half
        np.subtract(r[0], r[1], out=U[i, 2])
        U[i, 2] += r[2]
        U[i, 2] *= half
        U[i, 3] = r[2]
    return U.reshape(16, channels, F)


def conv2d(images: np.ndarray, W: np.ndarray, kernel_size: IntPair, *, padding: Padding = 0, stride: IntPair = 1,
           bias: bool = False, method: Literal["auto", "im2col", "winograd"] = "auto",
           filters: np.ndarray | None = None, out: np.ndarray | None = None,
           scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> np.ndarray:
    """out = im2col(images) @ W as NHWC maps: the (cross-)correlation of each image with the kernels.

    Parameters
    ----------
    images : ndarray of shape (B, H, W_in, C), float32 or float64 (NHWC)
    W : ndarray of shape (kh * kw * C + bias, F), dtype of images
        Kernels flattened as :func:`im2col`'s columns, (ky, kx, channel),
        channel fastest; with ``bias`` the last row is added to every output.
    kernel_size, stride, padding : as in :func:`im2col`
    bias : bool, default=False
    method : {'auto', 'im2col', 'winograd'}, default='auto'
        'winograd' (F(2x2, 3x3): 3 x 3 kernels, stride 1) computes 2.25x
        fewer multiply-adds; 'auto' takes it where it applies and both the
        channels and the filters number at least ``WINOGRAD_MIN_CHANNELS``
        (:func:`conv2d_method`).
    filters : ndarray of shape (16, C, F), optional
        ``winograd_filters(W, C)``, when the caller keeps it across calls
        with the same W (the transform reads all of W once per call otherwise).
    out : ndarray of shape (B, out_h, out_w, F), dtype of images, C-contiguous, optional
    scratch_bytes : int, default=64 MiB
        Bound on the patches or transformed tiles of one chunk of images (at
        least one image per chunk).

    Returns
    -------
    out : ndarray of shape (B, out_h, out_w, F)

    Raises
    ------
    TypeError
        If images or W is not a float32/float64 array, or their dtypes differ.
    ValueError
        If W's rows do not match the kernels, ``out`` or ``filters`` do not match
        the output, ``method`` does not apply, or the geometry is invalid.

    Notes
    -----
    NaN and Inf are not looked for (forward passes of trained weights).
    """
    _check_array("images", images, 4)
    _check_array("W", W, 2)
    if W.dtype != images.dtype:
        raise TypeError(f"images and W must share a dtype, got {images.dtype} and {W.dtype}")
    B, H, W_in, C = images.shape
    geometry = _conv_geometry((H, W_in), kernel_size, stride, padding)
    kh, kw, sh, sw, ph, pw, out_h, out_w = geometry
    if W.shape[0] != kh * kw * C + bool(bias):
        raise ValueError(f"W must have kh * kw * C{' + 1' if bias else ''} = {kh * kw * C + bool(bias)} rows "
                         f"for {kh}x{kw} kernels over {C} channels, got shape {W.shape}")
    F = W.shape[1]
    out = _conv2d_output(out, (B, out_h, out_w, F), images, W, filters)
    scratch_bytes = _check_count("scratch_bytes", scratch_bytes)
    if B == 0:
        return out
    if F == 0:
        return out
    if C == 0:  # no input channels: every output is the bias row, if any
        out[...] = W[-1] if bias else 0
        return out
    images = np.ascontiguousarray(images)
    if conv2d_method((kh, kw), (sh, sw), C, F, method) == "im2col":
        return _conv2d_im2col(images, W, geometry, bias, out, scratch_bytes)
    if filters is None:
        filters = winograd_filters(W, C)
    elif filters.shape != (16, C, F) or filters.dtype != W.dtype:
        raise ValueError(f"filters must be winograd_filters(W, {C}): shape {(16, C, F)}, dtype {W.dtype}; "
                         f"got {filters.shape} {filters.dtype}")
    bias_row = np.ascontiguousarray(W[-1]) if bias else np.zeros(F, dtype=W.dtype)
    return _conv2d_winograd(images, filters, bias_row, (ph, pw, out_h, out_w), out, scratch_bytes)


def _conv2d_output(out, shape, images, W, filters):
    """A new output of ``shape``, or the caller's ``out`` once checked against it and the inputs."""
    if out is None:
        return np.empty(shape, dtype=images.dtype)
    _check_output("out", out, 4)
    if out.shape != shape or out.dtype != images.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous array of shape {shape} and dtype "
                         f"{images.dtype}, got {out.shape} {out.dtype}"
                         + ("" if out.flags.c_contiguous else " (Fortran-ordered)"))
    _check_disjoint("out", out, images=images, W=W, filters=filters)
    return out


def _conv2d_im2col(images, W, geometry, bias, out, scratch_bytes):
    """:func:`conv2d` as patches times W, over chunks of images whose patches fit ``scratch_bytes``."""
    kh, kw, sh, sw, ph, pw, out_h, out_w = geometry
    B, F = images.shape[0], W.shape[1]
    per_image = out_h * out_w * W.shape[0] * W.dtype.itemsize
    step = max(1, scratch_bytes // per_image)
    for first in range(0, B, step):
        last = min(B, first + step)
        P = im2col(images[first:last], (kh, kw), stride=(sh, sw), padding=(ph, pw), append_ones=bias)
        matmul(P, W, out=out[first:last].reshape(-1, F), check_finite=False)
    return out


def _conv2d_winograd(images, filters, bias_row, geometry, out, scratch_bytes):
    """:func:`conv2d` by F(2x2, 3x3): tiles transformed, 16 products with ``filters``, outputs transformed back."""
    ph, pw, out_h, out_w = geometry
    B, H, W_in, C = images.shape
    F = filters.shape[2]
    th, tw = -(-out_h // 2), -(-out_w // 2)
    hp, wp = 2 * th + 2, 2 * tw + 2
    itemsize = images.dtype.itemsize
    # Per image: the padded image, and V and M (16 transformed tiles of C and F values).
    per_image = (hp * wp * C + 16 * th * tw * (C + F)) * itemsize
    step = max(1, min(B, scratch_bytes // per_image))
    # The tiles read rows and columns [0, hp) x [0, wp) of the padded map; unless the map is exactly that,
    # it is copied into a zeroed buffer (the padding, and the tile grid's overhang of an odd output).
    copy = (ph, pw, H, W_in) != (0, 0, hp, wp)
    padded = np.zeros((step, hp, wp, C), dtype=images.dtype) if copy else None
    # Flat, so that a short last chunk still gets contiguous (16, tiles, .) views.
    V_buffer = np.empty(16 * step * th * tw * C, dtype=images.dtype)
    M_buffer = np.empty(16 * step * th * tw * F, dtype=images.dtype)
    scratch = np.empty(16 * max(C, F), dtype=images.dtype)  # one tile's row transforms
    for first in range(0, B, step):
        n = min(step, B - first)
        if copy:
            padded[:n, ph:ph + H, pw:pw + W_in] = images[first:first + n]
            tiles_of = padded[:n]
        else:
            tiles_of = images[first:first + n]
        tiles = n * th * tw
        V = V_buffer[:16 * tiles * C].reshape(16, tiles, C)
        M = M_buffer[:16 * tiles * F].reshape(16, tiles, F)
        _kernels.winograd_input(tiles_of, V, scratch[:16 * C], th, tw)
        for k in range(16):
            matmul(V[k], filters[k], out=M[k], check_finite=False)
        _kernels.winograd_output(M, out[first:first + n], bias_row, scratch[:8 * F], th, tw)
    return out


def avg_pool2d(images: np.ndarray, pool_size: IntPair, stride: IntPair | None = None) -> np.ndarray:
    """out[b, y, x] = mean of the pool window of images[b] at output (y, x), NHWC.

    One pass over the input, bit-identical to summing the window's strided
    slices in row order and dividing by its area.

    Parameters
    ----------
    images : ndarray of shape (B, H, W, C), float32 or float64
    pool_size : int or pair
    stride : int or pair, optional
        The pool size when None.

    Returns
    -------
    out : ndarray of shape (B, (H - ph) // sh + 1, (W - pw) // sw + 1, C), dtype of images

    Raises
    ------
    ValueError
        If images is not 4-dimensional, a size is below 1, or the window does not fit.
    """
    images = _check_images(images)
    ph, pw = _pair("pool_size", pool_size)
    sh, sw = (ph, pw) if stride is None else _pair("stride", stride)
    if min(ph, pw, sh, sw) < 1:
        raise ValueError(f"pool_size and stride must be >= 1, got {(ph, pw)} and {(sh, sw)}")
    B, H, W, C = images.shape
    if H < ph or W < pw:
        raise ValueError(f"a {ph}x{pw} pooling window does not fit a {H}x{W} image")
    out = np.empty((B, (H - ph) // sh + 1, (W - pw) // sw + 1, C), dtype=images.dtype)
    if out.size:
        _kernels.avg_pool_into(images, out, ph, pw, sh, sw)
    return out


def scale_negatives(x: np.ndarray, factor: float) -> np.ndarray:
    """x[x < 0] *= factor, in place (a leaky ReLU with slope ``factor``).

    One vectorized pass, no mask or temporary: NumPy's ``where=`` form of
    the same update runs several times slower on large activations.

    Parameters
    ----------
    x : ndarray, float32 or float64, C- or Fortran-contiguous, writable
    factor : float, finite

    Returns
    -------
    x : the same array

    Raises
    ------
    ValueError
        If x is read-only or non-contiguous, ``factor`` is not finite, or
        ``x * factor`` would overflow (checked before x is written).
    """
    _check_output("x", x, np.ndim(x))
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not np.isfinite(factor):
        raise ValueError(f"factor must be a finite number (the slope of the negative part), got {factor!r}")
    if x.size and abs(factor) > 1:  # only a steeper slope can overflow: checked before x is touched
        lowest = float(x.min())
        if lowest < 0 and abs(lowest * float(factor)) > float(np.finfo(x.dtype).max):
            raise ValueError(f"x * factor overflows {x.dtype} (most negative x {lowest:.3g}, factor {factor:.3g}); "
                             f"scale in float64")
    if x.size:
        _kernels.scale_negatives(x.reshape(-1, order="A"), float(factor))
    return x
