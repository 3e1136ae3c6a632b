"""fastls.conv2d (im2col + gemm, Winograd F(2x2, 3x3)) against a float64 loop reference."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import fastls
from tests.numeric_checks import assert_close

DTYPES = [np.float32, np.float64]


def reference(x, W, padding, bias):
    """out[b, i, j] = sum over (ky, kx) of the padded map's pixel (i + ky, j + kx) @ K[ky, kx] (+ bias), float64."""
    ph, pw = padding
    xp = np.pad(np.asarray(x, dtype=np.float64), ((0, 0), (ph, ph), (pw, pw), (0, 0)))
    C, F = x.shape[3], W.shape[1]
    K = np.asarray(W[:9 * C], dtype=np.float64).reshape(3, 3, C, F)
    oh, ow = xp.shape[1] - 2, xp.shape[2] - 2
    out = np.zeros((x.shape[0], oh, ow, F))
    for ky in range(3):
        for kx in range(3):
            out += xp[:, ky:ky + oh, kx:kx + ow] @ K[ky, kx]
    if bias:
        out += np.asarray(W[-1], dtype=np.float64)
    return out


def random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["winograd", "im2col"])
@pytest.mark.parametrize("hw,padding", [((6, 6), (0, 0)), ((7, 5), (0, 0)), ((5, 8), (1, 1)), ((4, 4), (2, 1)),
                                        ((3, 3), (0, 0)), ((9, 2), (0, 1))])
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_matches_the_loop_reference(rng, dtype, method, hw, padding, bias):
    C, F = 5, 4
    x = random(rng, (3, *hw, C), dtype)
    W = random(rng, (9 * C + bias, F), dtype)
    ref = reference(x, W, padding, bias)
    out = fastls.conv2d(x, W, 3, padding=padding, bias=bias, method=method)
    assert out.shape == ref.shape and out.dtype == dtype
    # Winograd sums 16 transformed products of 4-term input and 9-term filter combinations.
    assert_close(out, ref, dtype, 9 * C * (16 if method == "winograd" else 1))
    # One image per chunk, and a caller-provided output.
    given_out = np.empty_like(out)
    chunked = fastls.conv2d(x, W, 3, padding=padding, bias=bias, method=method, out=given_out, scratch_bytes=1)
    assert chunked is given_out
    assert_close(chunked, ref, dtype, 9 * C * (16 if method == "winograd" else 1))
    # Two images per chunk (conv2d's own per-image scratch): the last of the three chunks is short.
    oh, ow = ref.shape[1:3]
    th, tw = -(-oh // 2), -(-ow // 2)
    per_image = ((2 * th + 2) * (2 * tw + 2) * C + 16 * th * tw * (C + F) if method == "winograd"
                 else oh * ow * W.shape[0]) * x.itemsize
    assert_close(fastls.conv2d(x, W, 3, padding=padding, bias=bias, method=method, scratch_bytes=2 * per_image),
                 ref, dtype, 9 * C * (16 if method == "winograd" else 1))


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), channels=st.integers(1, 6), filters=st.integers(1, 5),
       ph=st.integers(0, 2), pw=st.integers(0, 2), bias=st.booleans(), images=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_winograd_equals_im2col_for_any_map(h, w, channels, filters, ph, pw, bias, images, seed):
    assume(h + 2 * ph >= 3 and w + 2 * pw >= 3)  # else the kernel does not fit: refused (tested below)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((images, h, w, channels))
    W = rng.standard_normal((9 * channels + bias, filters))
    winograd = fastls.conv2d(x, W, 3, padding=(ph, pw), bias=bias, method="winograd")
    direct = fastls.conv2d(x, W, 3, padding=(ph, pw), bias=bias, method="im2col")
    assert_close(winograd, direct, np.float64, 16 * 9 * channels)
    assert_close(winograd, reference(x, W, (ph, pw), bias), np.float64, 16 * 9 * channels)


def test_precomputed_filters_give_the_same_result(rng):
    x = random(rng, (2, 6, 7, 40), np.float32)
    W = random(rng, (9 * 40 + 1, 33), np.float32)
    U = fastls.winograd_filters(W, 40)
    assert U.shape == (16, 40, 33) and U.dtype == np.float32
    np.testing.assert_array_equal(fastls.conv2d(x, W, 3, bias=True, filters=U),
                                  fastls.conv2d(x, W, 3, bias=True))


def test_auto_takes_winograd_for_wide_3x3_stride_1():
    m = fastls.tuning.WINOGRAD_MIN_CHANNELS
    assert fastls.tuning.conv2d_method(3, 1, m, m) == "winograd"
    assert fastls.tuning.conv2d_method((3, 3), (1, 1), m - 1, m) == "im2col"
    assert fastls.tuning.conv2d_method(3, 1, m, m - 1) == "im2col"
    assert fastls.tuning.conv2d_method(5, 1, 512, 512) == "im2col"
    assert fastls.tuning.conv2d_method(3, 2, 512, 512) == "im2col"
    assert fastls.tuning.conv2d_method(3, 1, 512, 512, "im2col") == "im2col"


def test_conv2d_of_no_channels_or_no_filters(rng):
    np.testing.assert_array_equal(fastls.conv2d(np.zeros((2, 5, 5, 0)), np.zeros((0, 4)), 3), np.zeros((2, 3, 3, 4)))
    bias = random(rng, (1, 4), np.float64)
    np.testing.assert_array_equal(fastls.conv2d(np.zeros((2, 5, 5, 0)), bias, 3, bias=True),
                                  np.broadcast_to(bias[0], (2, 3, 3, 4)))
    assert fastls.conv2d(random(rng, (2, 5, 5, 3), np.float64), np.zeros((27, 0)), 3).shape == (2, 3, 3, 0)


def test_conv2d_refuses_bad_input(rng):
    x = random(rng, (2, 5, 5, 3), np.float64)
    W = random(rng, (27, 4), np.float64)
    with pytest.raises(ValueError, match="3x3 kernel and stride 1"):
        fastls.conv2d(x, random(rng, (12, 4), np.float64), 2, method="winograd")
    with pytest.raises(ValueError, match="3x3 kernel and stride 1"):
        fastls.conv2d(x, W, 3, stride=2, method="winograd")
    with pytest.raises(ValueError, match="method must be one of"):
        fastls.conv2d(x, W, 3, method="fft")
    with pytest.raises(ValueError, match=r"C \+ 1 = 28 rows for 3x3 kernels over 3 channels"):
        fastls.conv2d(x, W, 3, bias=True)
    with pytest.raises(TypeError, match="share a dtype"):
        fastls.conv2d(x, W.astype(np.float32), 3)
    with pytest.raises(ValueError, match="does not fit"):
        fastls.conv2d(x[:, :2], W, 3)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous array of shape \(2, 3, 3, 4\)"):
        fastls.conv2d(x, W, 3, out=np.empty((2, 3, 3, 5)))
    with pytest.raises(ValueError, match=r"out must be a C-contiguous array of shape \(2, 3, 3, 4\)"):
        fastls.conv2d(x, W, 3, out=np.empty((2, 3, 3, 4), order="F"))  # its reshape would be a copy
    with pytest.raises(ValueError, match=r"filters must be winograd_filters\(W, 3\)"):
        fastls.conv2d(x, W, 3, method="winograd", filters=np.zeros((16, 3, 5)))
    with pytest.raises(ValueError, match="9 \\* channels"):
        fastls.winograd_filters(W, 4)
