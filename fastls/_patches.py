"""Convolution geometry and patch matrices (im2col), images in NHWC."""

from __future__ import annotations

import numbers
from typing import Literal

import numpy as np

from . import _kernels
from ._validation import _COUNT_MAX, _check_array

__all__ = ["conv_output_shape", "im2col", "IntPair", "Padding"]

#: A size for both image dimensions, or (height, width).
IntPair = int | tuple[int, int]
#: Zero padding on both sides: an :data:`IntPair`, 'valid' (none) or 'same' (k // 2; stride 1, odd k).
Padding = IntPair | Literal["valid", "same"]


def _pair(name, value):
    if isinstance(value, numbers.Integral):
        value = (value, value)
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (a, b)):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    if max(abs(a), abs(b)) > _COUNT_MAX:
        raise ValueError(f"{name} must be below 2^63, got {value!r}")
    return int(a), int(b)


def _image_shape(image_shape):
    """(H, W, channels) as positive ints, or ValueError (floats and strings are not truncated)."""
    try:
        H, W, channels = image_shape
    except (TypeError, ValueError):
        raise ValueError(f"image_shape must be (H, W, channels), got {image_shape!r}") from None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and 1 <= v <= _COUNT_MAX
               for v in (H, W, channels)):
        raise ValueError(f"image_shape must be three positive ints (H, W, channels), got {image_shape!r}")
    return int(H), int(W), int(channels)


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
    H, W = _pair("image_hw", image_hw)
    if H < 1 or W < 1:
        raise ValueError(f"image_hw must be positive (H, W), got {(H, W)}")
    out_h = (H + 2 * ph - kh) // sh + 1
    out_w = (W + 2 * pw - kw) // sw + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(
            f"a {kh}x{kw} kernel with padding {(ph, pw)} does not fit a {H}x{W} image"
        )
    return kh, kw, sh, sw, ph, pw, out_h, out_w


def conv_output_shape(image_hw: IntPair, kernel_size: IntPair, stride: IntPair = 1,
                      padding: Padding = 0) -> tuple[int, int]:
    """(out_h, out_w) = ((H + 2 ph - kh) // sh + 1, (W + 2 pw - kw) // sw + 1).

    ``padding`` is an int, a pair, ``'valid'`` (0) or ``'same'`` (k // 2).

    Raises
    ------
    ValueError
        If a size is not a positive int (or pair), the padding is unknown, or the
        kernel does not fit the padded image.
    """
    return _conv_geometry(image_hw, kernel_size, stride, padding)[-2:]


def _check_images(images):
    _check_array("images", images, 4)
    return np.ascontiguousarray(images)


def im2col(images: np.ndarray, kernel_size: IntPair, *, stride: IntPair = 1, padding: Padding = 0,
           append_ones: bool = False) -> np.ndarray:
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

    Raises
    ------
    TypeError
        If images is not a float32/float64 array.
    ValueError
        If images is not 4-dimensional or the geometry is invalid (as in
        :func:`conv_output_shape`).
    """
    images = _check_images(images)
    kh, kw, sh, sw, ph, pw, out_h, out_w = _conv_geometry(images.shape[1:3], kernel_size, stride, padding)
    d = kh * kw * images.shape[3] + int(bool(append_ones))
    out = np.empty((images.shape[0] * out_h * out_w, d), dtype=images.dtype)
    if out.size:
        _kernels.im2col_into(images, out, kh, kw, sh, sw, ph, pw, out_h, out_w, bool(append_ones))
    return out
