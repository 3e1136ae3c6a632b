"""fedlayer.models against NumPy float64 references on fresh random inputs."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastls
from tests.numeric_checks import assert_close
from fedlayer.models import (
    ACTIVATIONS,
    AvgPool2d,
    Conv2d,
    Dense,
    Flatten,
    Identity,
    LeakyReLU,
    Model,
    ReLU,
    TrainableLayer,
    build_model,
    get_activation,
    model_from_layers,
)
from fedlayer.options import ClientOptions

DTYPES = [np.float32, np.float64]


def random(rng, shape, dtype=np.float64):
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def upper(A):
    return np.triu(np.asarray(A, dtype=np.float64))


def with_ones(A):
    A = np.asarray(A, dtype=np.float64)
    return np.hstack([A, np.ones((A.shape[0], 1))])


def pad_nhwc(x, ph, pw):
    return np.pad(np.asarray(x, dtype=np.float64), ((0, 0), (ph, ph), (pw, pw), (0, 0)))


def naive_patches(x, kernel, stride, padding):
    """Patch rows (image, y, x) with columns (ky, kx, channel), by loops."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    xp = pad_nhwc(x, ph, pw)
    B, H, W, _ = xp.shape
    oh, ow = (H - kh) // sh + 1, (W - kw) // sw + 1
    rows = []
    for b in range(B):
        for i in range(oh):
            for j in range(ow):
                rows.append(xp[b, i * sh:i * sh + kh, j * sw:j * sw + kw, :].reshape(-1))
    return np.array(rows), (oh, ow)


def naive_conv(x, W, kernel, stride, padding, bias):
    """Direct convolution: out[b, i, j, f] = sum_{ky,kx,c} xp[b, i s + ky, j s + kx, c] K[ky, kx, c, f] + bias."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    xp = pad_nhwc(x, ph, pw)
    B, H, Wd, Cin = xp.shape
    F = W.shape[1]
    K = np.asarray(W[:kh * kw * Cin], dtype=np.float64).reshape(kh, kw, Cin, F)
    oh, ow = (H - kh) // sh + 1, (Wd - kw) // sw + 1
    out = np.zeros((B, oh, ow, F))
    for b in range(B):
        for i in range(oh):
            for j in range(ow):
                for ky in range(kh):
                    for kx in range(kw):
                        out[b, i, j] += xp[b, i * sh + ky, j * sw + kx] @ K[ky, kx]
    if bias:
        out += W[-1]
    return out


def naive_avgpool(x, pool, stride):
    (ph, pw), (sh, sw) = pool, stride
    B, H, W, C = x.shape
    oh, ow = (H - ph) // sh + 1, (W - pw) // sw + 1
    out = np.zeros((B, oh, ow, C))
    for i in range(oh):
        for j in range(ow):
            out[:, i, j] = x[:, i * sh:i * sh + ph, j * sw:j * sw + pw].astype(np.float64).mean(axis=(1, 2))
    return out


# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------

def test_activations_match_numpy(rng):
    x = random(rng, (7, 5))
    np.testing.assert_array_equal(get_activation("identity")(x), x)
    np.testing.assert_array_equal(get_activation(None)(x), x)
    np.testing.assert_array_equal(get_activation("relu")(x), np.where(x > 0, x, 0))
    np.testing.assert_allclose(get_activation("leaky_relu")(x), np.where(x > 0, x, 0.01 * x), rtol=1e-15)
    np.testing.assert_allclose(LeakyReLU(0.2)(x), np.where(x > 0, x, 0.2 * x), rtol=1e-15)
    # A slope above 1 is still x on the positive side.
    np.testing.assert_allclose(LeakyReLU(3.0)(x), np.where(x > 0, x, 3.0 * x), rtol=1e-15)
    assert get_activation("leaky_relu").negative_slope == 0.01
    assert set(ACTIVATIONS) == {"identity", "relu", "leaky_relu"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_leaky_relu_in_place_on_any_layout(rng, dtype):
    """The compiled pass (contiguous) and NumPy's masked one (a strided view) agree bit for bit."""
    x = random(rng, (6, 10)).astype(dtype)
    expected = np.where(x < 0, x * dtype(0.2), x)
    contiguous, strided = x.copy(), x.copy()
    assert LeakyReLU(0.2).apply_inplace(contiguous) is contiguous
    LeakyReLU(0.2).apply_inplace(strided[:, ::2])
    np.testing.assert_array_equal(contiguous, expected)
    np.testing.assert_array_equal(strided[:, ::2], expected[:, ::2])
    np.testing.assert_array_equal(strided[:, 1::2], x[:, 1::2])


@pytest.mark.parametrize("act", [ReLU(), LeakyReLU(0.1), Identity()])
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_call_keeps_input_and_inplace_agrees(rng, act, dtype):
    x = random(rng, (4, 3, 2), dtype)
    x0 = x.copy()
    y = act(x)
    np.testing.assert_array_equal(x, x0)
    assert y.dtype == dtype
    z = act.apply_inplace(x.copy())
    np.testing.assert_array_equal(z, y)


def test_get_activation_specs_and_errors():
    act = LeakyReLU(0.3)
    assert get_activation(act) is act
    assert get_activation(act.config()) == act
    assert get_activation("ReLU").name == "relu"
    with pytest.raises(ValueError, match="known activations: 'identity', 'relu', 'leaky_relu'"):
        get_activation("tanh")
    with pytest.raises(ValueError, match="negative_slope"):
        LeakyReLU(float("nan"))
    with pytest.raises(ValueError, match="invalid parameters"):
        get_activation({"name": "relu", "slope": 1})


# ---------------------------------------------------------------------------
# Flatten and AvgPool2d
# ---------------------------------------------------------------------------

def test_flatten(rng):
    x = random(rng, (3, 4, 5, 2))
    layer = Flatten()
    assert layer.output_shape((4, 5, 2)) == (40,)
    np.testing.assert_array_equal(layer.forward(x), x.reshape(3, 40))
    assert layer.config() == {"type": "flatten"}


@pytest.mark.parametrize(
    "shape,pool,stride",
    [((2, 8, 8, 3), 2, None), ((2, 7, 9, 2), 2, None), ((1, 11, 6, 4), 3, 2), ((3, 5, 5, 1), (2, 3), (1, 2)),
     ((2, 4, 4, 2), 4, None)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_avgpool_matches_loop(rng, shape, pool, stride, dtype):
    x = random(rng, shape, dtype)
    layer = AvgPool2d(pool, stride)
    out = layer.forward(x)
    ref = naive_avgpool(x, layer.pool_size, layer.stride)
    assert out.shape == ref.shape == (shape[0], *layer.output_shape(shape[1:]))
    assert out.dtype == dtype
    assert_close(out, ref, dtype, 16)


def test_avgpool_floor_sizes_and_errors():
    assert AvgPool2d(2).output_shape((7, 9, 3)) == (3, 4, 3)
    assert AvgPool2d(3, 2).output_shape((11, 6, 1)) == (5, 2, 1)
    assert AvgPool2d().stride == (2, 2)
    with pytest.raises(ValueError, match="does not fit"):
        AvgPool2d(4).output_shape((3, 8, 1))
    with pytest.raises(ValueError, match=r"\(H, W, C\)"):
        AvgPool2d().output_shape((10,))
    with pytest.raises(ValueError, match="pool_size"):
        AvgPool2d(0)


# ---------------------------------------------------------------------------
# Dense
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g_order", ["C", "F"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scratch_bytes", [64 * 2**20, 1000])
def test_dense_accumulate_matches_numpy(rng, dtype, g_order, bias, scratch_bytes):
    B, d, m = 300, 13, 4
    x, z = random(rng, (B, d), dtype), random(rng, (B, m), dtype)
    layer = Dense(m, bias=bias)
    n_in, n_out = layer.ls_shape((d,))
    assert (n_in, n_out) == (d + bias, m)
    G0 = random(rng, (n_in, n_in))
    C0 = random(rng, (n_in, m))
    G, C = np.array(G0, order=g_order), np.array(C0, order=g_order)
    layer.accumulate(G, C, x, z, scratch_bytes=scratch_bytes)
    A = with_ones(x) if bias else x.astype(np.float64)
    assert_close(upper(G), upper(G0 + A.T @ A), dtype, B)
    assert_close(C, C0 + A.T @ z.astype(np.float64), dtype, B)
    # The lower triangle is never written.
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))


def test_dense_accumulate_non_contiguous_input_and_integer_pixels(rng):
    x = random(rng, (50, 20))[:, ::2]  # strided view
    z = random(rng, (50, 3))
    G, C = np.zeros((11, 11)), np.zeros((11, 3))
    Dense(3).accumulate(G, C, x, z)
    A = with_ones(x)
    assert_close(upper(G), upper(A.T @ A), np.float64, 50)
    assert_close(C, A.T @ z, np.float64, 50)

    pixels = rng.integers(0, 256, size=(30, 6), dtype=np.uint8)
    G, C = np.zeros((7, 7)), np.zeros((7, 2))
    Dense(2).accumulate(G, C, pixels, np.ones((30, 2)))
    A = with_ones(pixels)
    np.testing.assert_allclose(upper(G), upper(A.T @ A))


def test_dense_ridge_solution_regularizes_bias_like_weights(rng):
    # The accumulated statistics solve ridge on [x, 1], bias included.
    x, z = random(rng, (200, 6)), random(rng, (200, 2))
    layer = Dense(2)
    G, C = np.zeros((7, 7)), np.zeros((7, 2))
    layer.accumulate(G, C, x, z)
    layer.set_weights(fastls.ridge_solve(G, C, 0.5))
    A = with_ones(x)
    W_ref = np.linalg.solve(A.T @ A + 0.5 * np.eye(7), A.T @ z)
    np.testing.assert_allclose(layer.weights, W_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.forward(x), A @ W_ref, rtol=1e-10, atol=1e-12)
    assert layer.weights.flags.c_contiguous


def test_dense_forward_and_validation(rng):
    layer = Dense(3, activation="relu")
    W = random(rng, (5, 3))
    layer.set_weights(W)
    x = random(rng, (6, 4))
    np.testing.assert_allclose(layer.forward(x), np.maximum(x @ W[:4] + W[4], 0), rtol=1e-13)
    np.testing.assert_allclose(layer.pre_activation(x), x @ W[:4] + W[4], rtol=1e-13)
    with pytest.raises(ValueError, match=r"expects input of shape \(B, 4\), got \(6, 5\)"):
        layer.forward(random(rng, (6, 5)))
    with pytest.raises(ValueError, match=r"\(n_inputs, 3\)"):
        layer.set_weights(np.zeros((5, 2)))
    with pytest.raises(ValueError, match="Flatten"):
        layer.output_shape((4, 4, 1))
    with pytest.raises(ValueError, match=r"G of shape \(5, 5\)"):
        layer.accumulate(np.zeros((4, 4)), np.zeros((5, 3)), x, np.zeros((6, 3)))
    with pytest.raises(ValueError, match=r"targets z must have shape \(6, 3\)"):
        layer.accumulate(np.zeros((5, 5)), np.zeros((5, 3)), x, np.zeros((6, 2)))
    with pytest.raises(RuntimeError, match="no weights"):
        Dense(2).forward(x)
    with pytest.raises(ValueError, match="units"):
        Dense(0)


# ---------------------------------------------------------------------------
# Conv2d
# ---------------------------------------------------------------------------

CONV_CASES = [
    # (image shape (B, H, W, C), kernel, stride, padding)
    ((3, 6, 6, 2), 3, 1, "valid"),
    ((2, 7, 5, 3), 3, 1, "same"),
    ((2, 9, 8, 1), (2, 3), 2, 1),
    ((2, 8, 7, 2), 5, (2, 1), (2, 0)),
]


def _padding_pair(padding, kernel):
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        return (kernel[0] // 2, kernel[1] // 2)
    return (padding, padding) if isinstance(padding, int) else padding


def small_scratch(n_in):
    """A scratch budget of a few patch rows (plus the float32 tile of the
    mixed-precision path), so the streamed kernels take several chunks."""
    return 4 * n_in * n_in + 8 * n_in * 6


@pytest.mark.parametrize("shape,kernel,stride,padding", CONV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_accumulate_matches_per_position_reference(rng, shape, kernel, stride, padding, dtype, bias):
    filters = 4
    layer = Conv2d(filters, kernel, stride=stride, padding=padding, bias=bias)
    x, z = random(rng, shape, dtype), random(rng, (shape[0], filters), dtype)
    n_in, n_out = layer.ls_shape(shape[1:])
    G0, C0 = random(rng, (n_in, n_in)), random(rng, (n_in, n_out))
    G, C = G0.copy(order="F"), C0.copy()
    layer.accumulate(G, C, x, z, scratch_bytes=small_scratch(n_in))
    P, (oh, ow) = naive_patches(x, layer.kernel_size, layer.stride, _padding_pair(padding, layer.kernel_size))
    assert (oh, ow, filters) == layer.output_shape(shape[1:])
    if bias:
        P = with_ones(P)
    assert P.shape[1] == n_in
    # Each image's target applies at every one of its output positions.
    T = np.repeat(z.astype(np.float64), oh * ow, axis=0)
    n_terms = P.shape[0]
    assert_close(upper(G), upper(G0 + P.T @ P), dtype, n_terms)
    assert_close(C, C0 + P.T @ T, dtype, n_terms)
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))


def test_conv_accumulate_per_position_targets(rng):
    layer = Conv2d(3, 3, padding=1)
    x = random(rng, (2, 5, 4, 2))
    oh, ow, _ = layer.output_shape(x.shape[1:])
    z = random(rng, (2, oh, ow, 3))
    G, C = np.zeros((19, 19)), np.zeros((19, 3))
    layer.accumulate(G, C, x, z)
    P = with_ones(fastls.im2col(x, 3, padding=1))
    assert_close(upper(G), upper(P.T @ P), np.float64, P.shape[0])
    assert_close(C, P.T @ z.reshape(-1, 3), np.float64, P.shape[0])


@pytest.mark.parametrize("shape,kernel,stride,padding", CONV_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_pre_activation_matches_loop(rng, shape, kernel, stride, padding, bias):
    filters = 3
    layer = Conv2d(filters, kernel, stride=stride, padding=padding, bias=bias, activation="leaky_relu")
    W = random(rng, layer.ls_shape(shape[1:]))
    layer.set_weights(W)
    x = random(rng, shape)
    ref = naive_conv(x, W, layer.kernel_size, layer.stride, _padding_pair(padding, layer.kernel_size), bias)
    # A tiny scratch forces one image per im2col chunk.
    out = layer.pre_activation(x, scratch_bytes=1)
    assert out.shape == (shape[0], *layer.output_shape(shape[1:]))
    assert_close(out, ref, np.float64, W.shape[0])
    assert_close(layer.pre_activation(x), ref, np.float64, W.shape[0])
    assert_close(layer.forward(x), np.where(ref > 0, ref, 0.01 * ref), np.float64, W.shape[0])


def test_wide_3x3_convolutions_run_winograd_with_one_transform_per_shared_weights(rng):
    from fedlayer import models

    channels, filters = fastls.tuning.WINOGRAD_MIN_CHANNELS, fastls.tuning.WINOGRAD_MIN_CHANNELS + 1
    layer = Conv2d(filters, 3, padding=1, activation="leaky_relu")
    x = random(rng, (2, 5, 6, channels))
    W = random(rng, layer.ls_shape(x.shape[1:]))
    W.flags.writeable = False  # shared weights are read-only: installed as they are, transformed once
    layer.set_weights(W)
    assert fastls.tuning.conv2d_method(layer.kernel_size, layer.stride, channels, filters) == "winograd"
    ref = naive_conv(x, W, layer.kernel_size, layer.stride, (1, 1), True)
    assert_close(layer.pre_activation(x), ref, np.float64, 16 * W.shape[0])
    held = models._WINOGRAD_FILTERS[id(W)][1]
    layer.pre_activation(x[:1])
    assert models._WINOGRAD_FILTERS[id(W)][1] is held
    # The transform goes with the weights.
    key = id(W)
    del layer, W
    assert key not in models._WINOGRAD_FILTERS


def test_conv_validation(rng):
    with pytest.raises(ValueError, match="same"):
        Conv2d(2, 4, padding="same")
    with pytest.raises(ValueError, match="same"):
        Conv2d(2, 3, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding"):
        Conv2d(2, 3, padding="full")
    with pytest.raises(ValueError, match="kernel_size"):
        Conv2d(2, 0)
    layer = Conv2d(2, 3)
    with pytest.raises(ValueError, match="does not fit"):
        layer.output_shape((2, 5, 1))
    layer.set_weights(random(rng, (3 * 3 * 2 + 1, 2)))
    with pytest.raises(ValueError, match=r"2 channels .*got \(1, 5, 5, 3\)"):
        layer.forward(random(rng, (1, 5, 5, 3)))
    with pytest.raises(ValueError, match="weight rows"):
        Conv2d(2, 3).set_weights(np.zeros((11, 2)))


# ---------------------------------------------------------------------------
# Streaming: several batches equal one batch
# ---------------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cuts=st.lists(st.integers(0, 12), min_size=0, max_size=3),
    conv=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
def test_streaming_accumulate_equals_single_batch(seed, cuts, conv, dtype):
    rng = np.random.default_rng(seed)
    B = 12
    if conv:
        layer, x = Conv2d(3, 2, stride=(1, 2)), random(rng, (B, 5, 6, 2), dtype)
        n_in = 2 * 2 * 2 + 1
    else:
        layer, x = Dense(3), random(rng, (B, 7), dtype)
        n_in = 8
    z = random(rng, (B, 3), dtype)
    G1, C1 = np.zeros((n_in, n_in)), np.zeros((n_in, 3))
    layer.accumulate(G1, C1, x, z)
    G2, C2 = np.zeros_like(G1), np.zeros_like(C1)
    bounds = [0, *sorted(cuts), B]
    for a, b in zip(bounds[:-1], bounds[1:]):
        layer.accumulate(G2, C2, x[a:b], z[a:b], scratch_bytes=small_scratch(n_in))
    n_terms = B * (20 if conv else 1)
    assert_close(upper(G2), upper(G1), dtype, n_terms)
    assert_close(C2, C1, dtype, n_terms)


# ---------------------------------------------------------------------------
# Model and builders
# ---------------------------------------------------------------------------

def fill_weights(model, rng, scale=0.3):
    for i in model.trainable:
        model.layers[i].set_weights(scale * random(rng, model.layers[i].ls_shape(model.input_shape_of(i))))
    return model


@pytest.mark.parametrize("input_shape,flat", [((60,), 60), ((28, 28, 1), 784)])
def test_build_lr_and_dnn_shapes(rng, input_shape, flat):
    lr = build_model("lr", input_shape, 10)
    assert len(lr.trainable) == 1
    i = lr.trainable[0]
    assert lr.layers[i].ls_shape(lr.input_shape_of(i)) == (flat + 1, 10)
    assert isinstance(lr.layers[i].activation, Identity)
    assert lr.output_shape == (10,)
    assert (len(lr.layers) == 2) == (len(input_shape) > 1)

    dnn = build_model("dnn", input_shape, 10)
    shapes = [dnn.layers[i].ls_shape(dnn.input_shape_of(i)) for i in dnn.trainable]
    assert shapes == [(flat + 1, 128), (129, 64), (65, 10)]
    assert [dnn.layers[i].activation.name for i in dnn.trainable] == ["relu", "relu", "identity"]
    assert dnn.n_parameters() == sum(a * b for a, b in shapes)

    fill_weights(dnn, rng)
    x = random(rng, (5, *input_shape))
    assert dnn.forward(x).shape == (5, 10)
    assert dnn.forward(x, stop=dnn.trainable[1]).shape == (5, 128)
    labels = dnn.predict(x)
    assert labels.dtype == np.int64 and labels.shape == (5,)


def test_build_dcnn_narrow_shapes_and_forward(rng):
    model = build_model("dcnn", (32, 32, 3), 10, width=1 / 64)
    c = round(2048 / 64)
    assert [model.input_shape_of(i) for i in range(len(model.layers) + 1)] == [
        (32, 32, 3), (28, 28, 8), (14, 14, 8), (12, 12, 16), (6, 6, 16), (4, 4, c), (2, 2, c), (2 * 2 * c,), (10,)]
    last = model.trainable[-1]
    assert model.layers[last].ls_shape(model.input_shape_of(last)) == (2 * 2 * c + 1, 10)
    assert [model.layers[i].activation.name for i in model.trainable] == ["leaky_relu"] * 4 + ["identity"]
    fill_weights(model, rng, 0.1)
    x = random(rng, (5, 32, 32, 3))
    full = model.forward(x)
    assert full.shape == (5, 10)
    # Chunked forward and resuming from a cached activation give the same result.
    np.testing.assert_allclose(model.forward(x, batch_size=2), full, rtol=1e-12, atol=1e-12)
    mid = model.forward(x, stop=4)
    np.testing.assert_allclose(model.forward(mid, start=4), full, rtol=1e-12, atol=1e-12)


def test_build_dcnn_full_width_gram_size():
    model = build_model("dcnn", (32, 32, 3), 10)
    last = model.trainable[-1]
    assert model.input_shape_of(last) == (8192,)
    assert model.layers[last].ls_shape(model.input_shape_of(last)) == (8193, 10)
    assert [model.layers[i].filters for i in model.trainable[:-1]] == [512, 1024, 2048, 2048]
    assert model.layers[model.trainable[-1]].weights is None


def test_build_dcnn_same_padding_keeps_the_maps(rng):
    """'same' padding: 32 -> 32 -> pool 16 -> 16 -> pool 8 -> 8 -> 8, so the classifier sees 8 x 8 x filters."""
    model = build_model("dcnn", (32, 32, 3), 10, width=1 / 64, padding="same")
    c = round(2048 / 64)
    assert [model.input_shape_of(i) for i in range(len(model.layers) + 1)] == [
        (32, 32, 3), (32, 32, 8), (16, 16, 8), (16, 16, 16), (8, 8, 16), (8, 8, c), (8, 8, c), (8 * 8 * c,), (10,)]
    fill_weights(model, rng, 0.1)
    x = random(rng, (3, 32, 32, 3))
    np.testing.assert_allclose(model.forward(x, batch_size=2), model.forward(x), rtol=1e-12, atol=1e-12)
    # At full width the classifier's Gram is 131073 square (about 137 GB in float64).
    full = build_model("dcnn", (32, 32, 3), 10, padding="same")
    last = full.trainable[-1]
    assert full.layers[last].ls_shape(full.input_shape_of(last)) == (131073, 10)


def test_build_model_errors():
    with pytest.raises(ValueError, match="'lr', 'dnn', 'dcnn'"):
        build_model("cnn", (60,), 10)
    with pytest.raises(ValueError, match=r"\(H, W, C\)"):
        build_model("dcnn", (60,), 10)
    with pytest.raises(ValueError, match="width"):
        build_model("dcnn", (32, 32, 3), 10, width=0)
    with pytest.raises(ValueError, match="padding must be one of 'valid', 'same', got 'full'"):
        build_model("dcnn", (32, 32, 3), 10, padding="full")
    with pytest.raises(ValueError, match="dcnn model only"):
        build_model("dnn", (60,), 10, padding="same")
    assert build_model("DNN", (60,), 3, width=0.5).layers[0].units == 64


def test_model_forward_validation_and_dtype(rng):
    model = fill_weights(build_model("dnn", (6,), 3, dtype=np.float32), rng)
    assert all(model.layers[i].weights.dtype == np.float32 for i in model.trainable)
    assert model.forward(random(rng, (4, 6))).dtype == np.float32
    with pytest.raises(ValueError, match=r"must have shape \(B, 6\), got \(4, 7\)"):
        model.forward(np.zeros((4, 7)))
    with pytest.raises(ValueError, match=r"must have shape \(B, 6\), got \(6,\)"):
        model.forward(np.zeros(6))
    with pytest.raises(RuntimeError, match="layer 0"):
        build_model("lr", (6,), 3).forward(np.zeros((2, 6)))
    with pytest.raises(ValueError, match="layer 0"):
        Model([Dense(3)], (4, 4, 1))
    assert model.input_shape_of(-1) == (64,)
    with pytest.raises(IndexError):
        model.input_shape_of(5)


def test_model_accuracy_and_predict(rng):
    model = Model([Dense(3, bias=False)], (3,))
    model.layers[0].set_weights(np.eye(3))
    x = random(rng, (40, 3))
    y = x.argmax(axis=1)
    y_wrong = y.copy()
    y_wrong[:7] = (y_wrong[:7] + 1) % 3
    np.testing.assert_array_equal(model.predict(x, batch_size=7), y)
    assert model.accuracy(x, y) == (40, 40)
    assert model.accuracy(x, y_wrong) == (33, 40)
    assert model.accuracy(x, np.eye(3)[y]) == (40, 40)


def test_copy_is_deep(rng):
    model = fill_weights(build_model("dnn", (5,), 2), rng)
    clone = model.copy()
    x = random(rng, (6, 5))
    np.testing.assert_array_equal(clone.forward(x), model.forward(x))
    clone.layers[0].weights[:] = 0
    assert np.abs(model.layers[0].weights).sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_load_round_trip(rng, tmp_path, dtype):
    model = model_from_layers(
        [{"type": "conv2d", "filters": 4, "kernel_size": 3, "activation": "relu"},
         {"type": "avgpool2d"},
         {"type": "conv2d", "filters": 3, "kernel_size": (1, 2), "stride": (1, 2), "padding": 1, "bias": False,
          "activation": {"name": "leaky_relu", "negative_slope": 0.2}},
         {"type": "flatten"},
         {"type": "dense", "units": 5}],
        (9, 8, 2),
        dtype,
    )
    fill_weights(model, rng)
    x = random(rng, (7, 9, 8, 2))
    path = tmp_path / "model.npz"
    metadata = {"algorithm": "fedacnnl", "gamma": 0.5, "round": np.int64(3), "acc": [0.1, 0.2]}
    model.save(path, metadata)
    loaded, meta = Model.load(path)
    assert meta == {"algorithm": "fedacnnl", "gamma": 0.5, "round": 3, "acc": [0.1, 0.2]}
    assert loaded.config() == model.config()
    assert loaded.dtype == dtype
    np.testing.assert_array_equal(loaded.forward(x), model.forward(x))
    np.testing.assert_array_equal(loaded.predict(x), model.predict(x))
    assert json.loads(json.dumps(model.config())) == model.config()
    assert loaded.layers[2].activation.negative_slope == 0.2


def test_save_load_untrained_layers(tmp_path):
    model = build_model("dnn", (4,), 2)
    model.layers[0].set_weights(np.ones((5, 128)))
    model.save(tmp_path / "partial.npz")
    loaded, meta = Model.load(tmp_path / "partial.npz")
    assert meta == {}
    np.testing.assert_array_equal(loaded.layers[0].weights, 1)
    assert loaded.layers[1].weights is None and loaded.layers[2].weights is None


def test_model_from_layers_errors_name_the_key():
    expected = r"layer 1 \(dense\): unknown key 'unit'; accepted keys: type, units, activation, bias"
    with pytest.raises(ValueError, match=expected):
        model_from_layers([{"type": "flatten"}, {"type": "dense", "unit": 10}], (4, 4, 1))
    with pytest.raises(ValueError, match=r"layer 1 \(dense\): missing key 'units'"):
        model_from_layers([{"type": "flatten"}, {"type": "dense"}], (4, 4, 1))
    with pytest.raises(ValueError, match=r"layer 0: unknown type 'maxpool2d'; accepted types: 'dense', 'conv2d'"):
        model_from_layers([{"type": "maxpool2d"}], (4, 4, 1))
    with pytest.raises(ValueError, match=r"layer 0 \(conv2d\): invalid value: filters must be an int >= 1.*"
                                         r"accepted keys: type, filters, kernel_size"):
        model_from_layers([{"type": "conv2d", "filters": -1, "kernel_size": 3}], (4, 4, 1))
    with pytest.raises(ValueError, match=r"layer 0 \(dense\): invalid value: activation: unknown activation 'gelu'"):
        model_from_layers([{"type": "dense", "units": 2, "activation": "gelu"}], (4,))
    with pytest.raises(ValueError, match="layer 0: missing key 'type'"):
        model_from_layers([{"units": 2}], (4,))
    with pytest.raises(ValueError, match=r"layer 1 .*Flatten"):
        model_from_layers(
            [{"type": "conv2d", "filters": 2, "kernel_size": 3}, {"type": "dense", "units": 2}], (5, 5, 1)
        )


def test_model_from_layers_builds_what_it_is_told():
    model = model_from_layers(
        [{"type": "conv2d", "filters": 8, "kernel_size": 3, "activation": "relu"}, {"type": "avgpool2d"},
         {"type": "flatten"}, {"type": "dense", "units": 10}],
        (28, 28, 1),
        np.float64,
    )
    assert [type(layer) for layer in model.layers] == [Conv2d, AvgPool2d, Flatten, Dense]
    assert model.trainable == [0, 3]
    assert all(isinstance(model.layers[i], TrainableLayer) for i in model.trainable)
    assert model.input_shape_of(3) == (13 * 13 * 8,)
    assert model.n_parameters() == (9 + 1) * 8 + (13 * 13 * 8 + 1) * 10
    assert Model.from_config(model.config()).config() == model.config()


# ---------------------------------------------------------------------------
# The client's activation cache: one forward pass per layer and stage
# ---------------------------------------------------------------------------

def _small_cnn_client(rng, cache_ram_bytes, tmp_path, dtype=np.float64):
    from fedlayer.client import Client
    from fedlayer.data import ClientData

    model = build_model("dcnn", (32, 32, 3), 4, width=1 / 64, dtype=dtype)
    data = ClientData(rng.random((23, 32, 32, 3)), rng.integers(0, 4, 23), rng.random((9, 32, 32, 3)),
                      rng.integers(0, 4, 9))
    return Client(3, data, model.config(), 0, 4, options=ClientOptions(cache_dir=tmp_path,
                                                                       cache_ram_bytes=cache_ram_bytes))


@pytest.mark.parametrize("cache_ram_bytes", [0, 2**30])
def test_client_cache_equals_recompute(rng, tmp_path, cache_ram_bytes):
    """Statistics, personalization and accuracy through the cache equal a fresh forward pass."""
    client = _small_cnn_client(rng, cache_ram_bytes, tmp_path)
    reference = client.model.copy()
    n_layers = len(client.model.trainable)
    for position in range(n_layers):
        result = client.local_stats(position, batch_size=5)
        index = client.model.trainable[position]
        layer = reference.layers[index]
        x = reference.forward(client.data.x_train, stop=index)
        G, C = np.zeros_like(result["G"]), np.zeros_like(result["C"])
        layer.accumulate(G, C, x, client._targets(position, client.data.y_train))
        assert_close(np.triu(result["G"]), np.triu(G), np.float64, x.shape[0])
        assert_close(result["C"], C, np.float64, x.shape[0])
        W = fastls.ridge_solve(G, C, 10.0)
        client.set_weights(position, W)
        reference.layers[index].set_weights(W)
        evaluated = client.evaluate()
        assert evaluated["correct"] == reference.accuracy(client.data.x_test, client.data.y_test)[0]
    if cache_ram_bytes == 0:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["client3_test_layer8.npy", "client3_train_layer7.npy"]
    for position in range(n_layers):
        result = client.personalize(position, 2500.0, batch_size=7)
        assert result["form"] in ("primal", "dual")
        index = client.model.trainable[position]
        x = reference.forward(client.data.x_train, stop=index)
        layer = reference.layers[index]
        G, C = np.zeros(2 * (layer.ls_shape(x.shape[1:])[0],)), np.zeros(layer.ls_shape(x.shape[1:]))
        layer.accumulate(G, C, x, client._targets(position, client.data.y_train))
        W = fastls.proximal_solve(G, C, 2500.0, client.meta_weights[position])
        personal = client.final_weights()["weights"][position]   # parked on disk between calls when RAM is 0
        assert_close(personal, W, np.float64, G.shape[0])
        reference.layers[index].set_weights(personal)
        assert client.evaluate()["correct"] == reference.accuracy(client.data.x_test, client.data.y_test)[0]
    # the last personalization was the training split's last pass: its cache is gone (only the test split's stays)
    assert "train" not in client._activations
    if cache_ram_bytes == 0:
        assert not [p.name for p in tmp_path.iterdir() if "_train_" in p.name]


@pytest.mark.parametrize("cache_ram_bytes", [0, 2**30])
def test_kept_personalized_layers_are_read_back_by_a_new_client(rng, tmp_path, cache_ram_bytes):
    """A checkpointed personalization: the kept files give a fresh client the same model (parked on them)."""
    client = _small_cnn_client(np.random.default_rng(5), cache_ram_bytes, tmp_path / "cache")
    n_layers = len(client.model.trainable)
    for position in range(n_layers):
        result = client.local_stats(position, batch_size=5)
        client.set_weights(position, fastls.ridge_solve(result["G"], result["C"], 10.0,
                                                        rhs_basis=client.bases[position]))
    meta = [client.meta_weights[p] for p in range(n_layers)]
    kept = tmp_path / "checkpoint.personal"
    for position in range(n_layers - 1):  # the last layer stays the group's, as for a client that dropped out
        client.personalize(position, 2500.0, batch_size=7, private=True, keep_in=str(kept), tag="run-a")
    if cache_ram_bytes == 0:  # parked on the kept files, not on copies in the cache
        assert sorted(client._parked.values()) == [kept / f"client3_layer{p}.npz" for p in range(n_layers - 1)]
    fresh = _small_cnn_client(np.random.default_rng(5), cache_ram_bytes, tmp_path / "cache2")
    for position in range(n_layers):
        fresh.set_weights(position, meta[position])
    fresh.restore_personalized(list(range(n_layers - 1)), str(kept), "run-a")
    for ours, theirs in zip(fresh.final_weights()["weights"], client.final_weights()["weights"]):
        np.testing.assert_array_equal(ours, theirs)
    assert fresh.personal_choices == client.personal_choices and len(fresh.personal_choices) == n_layers - 1
    assert fresh.evaluate() == client.evaluate()
    with pytest.raises(ValueError, match="client3_layer0.npz holds client 3's layer 1 of the run run-a, not client "
                                         "3's layer 1 of this run \\(run-b\\)"):
        fresh.restore_personalized([0], str(kept), "run-b")


@pytest.mark.parametrize("cache_ram_bytes", [0, 2**30])
def test_each_round_starts_from_the_previous_layers_cache(rng, tmp_path, cache_ram_bytes):
    """Every training image passes each trained layer once per stage: layer l's round runs only layer l-1."""
    client = _small_cnn_client(rng, cache_ram_bytes, tmp_path, dtype=np.float32)
    calls = []
    forward = client.model.forward

    def recorded(x, *, start=0, stop=None, **options):
        calls.append((start, stop, len(x)))
        return forward(x, start=start, stop=stop, **options)

    client.model.forward = recorded
    trainable = client.model.trainable
    for position in range(len(trainable)):
        calls.clear()
        result = client.local_stats(position, batch_size=5)
        client.set_weights(position, fastls.ridge_solve(result["G"], result["C"], 10.0,
                                                        rhs_basis=client.bases[position]))
        previous = trainable[position - 1] if position else 0
        # The training split only, from the cached input of the previous trainable layer up to this one.
        assert {(start, stop) for start, stop, _ in calls} <= ({(previous, trainable[position])} if position else set())
        assert sum(n for *_, n in calls) == (client.data.n_train if position else 0)


def test_a_new_client_removes_the_files_a_killed_process_left_it(rng, tmp_path):
    stale = [tmp_path / "client3_test_layer4.npy", tmp_path / "client3_train_layer7.npy"]
    others = [tmp_path / "client30_test_layer4.npy", tmp_path / "notes.txt"]
    for path in stale + others:
        path.write_bytes(b"left by a killed run")
    _small_cnn_client(rng, 0, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in others)


def test_a_full_disk_stops_the_cache_with_a_clear_error_and_no_file(rng, tmp_path, monkeypatch):
    """The cache's blocks are reserved up front: no room is an OSError naming the folder, not a SIGBUS later."""
    import errno
    import os

    client = _small_cnn_client(rng, 0, tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve [\d.]+ MiB for cached activations in .*No space left"):
        client.local_stats(len(client.model.trainable) - 1, batch_size=5)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    result = client.local_stats(len(client.model.trainable) - 1, batch_size=5)  # room again: it goes on
    assert np.isfinite(result["G"]).all()


@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_batch_forward_equals_the_cached_one(rng, tmp_path, batch_size):
    """forward="batch" (Algorithm 1, line 8: each batch from the input layer) sums the same statistics."""
    cached = _small_cnn_client(rng, 0, tmp_path / "cached")
    per_batch = _small_cnn_client(np.random.default_rng(rng.integers(2**32)), 0, tmp_path / "batch")
    per_batch.data, per_batch.forward = cached.data, "batch"
    for position in range(len(cached.model.trainable)):
        expected, got = cached.local_stats(position, batch_size), per_batch.local_stats(position, batch_size)
        assert_close(np.triu(got["G"]), np.triu(expected["G"]), np.float64, cached.data.n_train)
        assert_close(got["C"], expected["C"], np.float64, cached.data.n_train)
        assert got["parts"]["forward_s"] > 0
        W = fastls.ridge_solve(expected["G"], expected["C"], 10.0)
        cached.set_weights(position, W)
        per_batch.set_weights(position, W)
    assert not list((tmp_path / "batch").glob("*.npy"))  # nothing cached for the rounds


def test_forward_mode_is_checked(rng, tmp_path):
    from fedlayer.client import Client
    from fedlayer.run import RunConfig

    client = _small_cnn_client(rng, 0, tmp_path)
    with pytest.raises(ValueError, match=r"forward must be one of \('cached', 'batch'\), got 'lazy'"):
        Client(0, client.data, client.model.config(), 0, 4, options=ClientOptions(forward="lazy"))
    with pytest.raises(ValueError, match="forward"):
        RunConfig(forward="lazy").validate()
    with pytest.raises(ValueError, match="forward apply to the analytic methods"):
        RunConfig(algorithm="fedavg", forward="batch").validate()


def test_personalization_takes_the_dual_where_rows_are_few(rng, tmp_path):
    client = _small_cnn_client(rng, 2**30, tmp_path)
    for position in range(len(client.model.trainable)):
        stats = client.local_stats(position, batch_size=8)
        client.set_weights(position, fastls.ridge_solve(stats["G"], stats["C"], 100.0,
                                                        rhs_basis=client.bases[position]))
    # The classifier: 23 samples against 2 * 2 * 32 + 1 inputs; the first convolution: 23 * 784 patches of 76.
    assert client.personalize(4, 2500.0, batch_size=8)["form"] == "dual"
    assert client.personalize(0, 2500.0, batch_size=8)["form"] == "primal"
    # The cost rule the client applies, as reports reuse it for runs that did not record the form.
    from fedlayer.client import personalization_costs

    for position, form in ((4, "dual"), (0, "primal")):
        index = client.model.trainable[position]
        costs = personalization_costs(client.model.layers[index], client.model.input_shape_of(index),
                                      client.data.n_train, client.bases[position])
        assert ("dual" if costs["dual"] < costs["primal"] else "primal") == form


def test_clients_share_weights_and_park_their_own(rng, tmp_path):
    """One copy of the initial and of the server's weights per process; personalized ones live on disk."""
    first = _small_cnn_client(rng, 0, tmp_path / "a")
    second = _small_cnn_client(rng, 0, tmp_path / "b")
    index = first.model.trainable[-1]
    assert first.model.layers[index].weights is second.model.layers[index].weights
    for position in range(len(first.model.trainable)):
        stats = first.local_stats(position, batch_size=8)
        W = fastls.ridge_solve(stats["G"], stats["C"], 100.0, rhs_basis=first.bases[position])
        W = np.ascontiguousarray(W)
        W.flags.writeable = False   # as the server sends it
        first.set_weights(position, W)
        second.set_weights(position, W)
        assert first.model.layers[first.model.trainable[position]].weights is \
            second.model.layers[first.model.trainable[position]].weights
    before = first.evaluate()
    first.personalize(len(first.model.trainable) - 1, 2500.0, batch_size=8)
    assert first.model.layers[index].weights is None   # parked between calls
    assert (tmp_path / "a" / f"client3_weights_layer{index}.npy").exists()
    weights = first.final_weights()["weights"][-1]
    assert weights.shape == W.shape and not np.array_equal(weights, W)
    assert first.evaluate()["total"] == before["total"]


# --------------------------------------------------------------------------- #
# Found by an audit with adversarial inputs (2026-11-28)
# --------------------------------------------------------------------------- #


def _trained(name, input_shape, rng):
    from fedlayer.client import init_weights

    model = build_model(name, input_shape, 3, width=1 / 64)
    init_weights(model, 0)
    return model


@pytest.mark.parametrize("name,input_shape", [("lr", (28, 28, 1)), ("dnn", (60,)), ("dcnn", (32, 32, 3))])
def test_an_empty_batch_passes_every_model(rng, name, input_shape):
    model = _trained(name, input_shape, rng)
    assert model.forward(np.zeros((0, *input_shape))).shape == (0, 3)
    assert model.predict(np.zeros((0, *input_shape))).shape == (0,)
    assert model.accuracy(np.zeros((0, *input_shape)), np.zeros(0, dtype=np.int64)) == (0, 0)


def test_accuracy_refuses_labels_it_would_miscount(rng):
    model = _trained("dnn", (12,), rng)
    x = rng.standard_normal((50, 12))
    y = model.predict(x)
    assert model.accuracy(x, y) == model.accuracy(x, np.eye(3)[y]) == model.accuracy(x, y.astype(float)) == (50, 50)
    with pytest.raises(ValueError, match=r"y must have shape \(50,\) or \(50, 3\)"):
        model.accuracy(x, y[:, None])  # a column was read as one-class scores: 15 of 50 correct
    with pytest.raises(ValueError, match="y must hold integer class labels"):
        model.accuracy(x, y + 0.5)


def test_a_file_that_is_not_a_model_archive_is_named(rng, tmp_path):
    path = tmp_path / "model.npz"
    with open(path, "wb") as f:
        np.save(f, np.ones(3))  # one array (.npy content) under an .npz name
    with pytest.raises(ValueError, match="it holds one array, not a .npz archive"):
        Model.load(path)
    path.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(ValueError, match="is not a readable fedlayer model file \\(BadZipFile"):
        Model.load(path)


def test_threads_saving_one_model_path_never_publish_a_partial_file(rng, tmp_path):
    import threading

    model = _trained("dnn", (60,), rng)
    path, errors = tmp_path / "model.npz", []

    def save():
        try:
            for _ in range(20):
                model.save(path)
        except Exception as err:  # noqa: BLE001 - any error is the defect
            errors.append(err)

    writers = [threading.Thread(target=save) for _ in range(3)]
    for w in writers:
        w.start()
    while any(w.is_alive() for w in writers):
        if path.exists():
            Model.load(path)  # never half a file
    for w in writers:
        w.join()
    assert not errors and not list(tmp_path.glob("*.tmp"))
