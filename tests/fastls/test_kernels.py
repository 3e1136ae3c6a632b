"""fastls kernels against NumPy float64 references on fresh random inputs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastls
from tests.numeric_checks import assert_close

DTYPES = [np.float32, np.float64]
ORDERS = ["C", "F"]
SHAPES = [(1, 1), (0, 5), (3, 8), (50, 1), (200, 17), (1000, 64)]


def random(rng, shape, dtype, order="C"):
    return np.asarray(rng.standard_normal(shape), dtype=dtype, order=order)


def upper(A):
    return np.triu(np.asarray(A, dtype=np.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_order", ORDERS)
@pytest.mark.parametrize("g_order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_update_matches_numpy(rng, dtype, x_order, g_order, shape):
    X = random(rng, shape, dtype, x_order)
    G0 = random(rng, (shape[1], shape[1]), dtype, g_order)
    G = G0.copy(order=g_order)
    out = fastls.gram_update(G, X)
    assert out is G
    X64 = X.astype(np.float64)
    assert_close(upper(G), upper(G0.astype(np.float64) + X64.T @ X64), dtype, shape[0])
    # The strict lower triangle is never touched.
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))


@pytest.mark.parametrize("x_order", ORDERS)
@pytest.mark.parametrize("g_order", ORDERS)
@pytest.mark.parametrize("shape,block_rows", [((1, 1), 1), ((300, 40), 7), ((2500, 130), 1000), ((64, 2100), 50)])
def test_gram_update_float32_into_float64(rng, x_order, g_order, shape, block_rows):
    X = random(rng, shape, np.float32, x_order)
    G = np.zeros((shape[1], shape[1]), np.float64, order=g_order)
    fastls.gram_update(G, X, block_rows=block_rows)
    X64 = X.astype(np.float64)
    # float32 rounding only within a block of block_rows rows.
    assert_close(upper(G), upper(X64.T @ X64), np.float32, min(block_rows, shape[0]))
    assert G.dtype == np.float64
    np.testing.assert_array_equal(np.tril(G, -1), 0)


def test_gram_update_mixed_beats_float32_accumulation(rng):
    # Rows with a large common offset make float32 accumulation over many rows lose digits.
    X = (rng.standard_normal((20000, 8)) + 30).astype(np.float32)
    X64 = X.astype(np.float64)
    ref = upper(X64.T @ X64)
    G32 = fastls.gram_update(np.zeros((8, 8), np.float32), X)
    G64 = fastls.gram_update(np.zeros((8, 8)), X, block_rows=256)
    err32 = np.abs(upper(G32) - ref).max()
    err64 = np.abs(upper(G64) - ref).max()
    assert err64 < err32


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 120),
    d=st.integers(1, 12),
    cuts=st.lists(st.integers(0, 120), max_size=6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_gram_streaming_over_row_blocks_equals_one_call(n, d, cuts, dtype, seed):
    rng = np.random.default_rng(seed)
    X = random(rng, (n, d), dtype)
    Z = random(rng, (n, 3), dtype)
    whole_G = fastls.gram_update(np.zeros((d, d), dtype), X)
    whole_C = fastls.cross_update(np.zeros((d, 3), dtype), X, Z)
    G, C = np.zeros((d, d), dtype), np.zeros((d, 3), dtype)
    bounds = [0, *sorted(min(c, n) for c in cuts), n]
    for a, b in zip(bounds[:-1], bounds[1:]):
        fastls.gram_update(G, X[a:b])
        fastls.cross_update(C, X[a:b], Z[a:b])
    assert_close(upper(G), upper(whole_G), dtype, max(n, 1))
    assert_close(C, whole_C, dtype, max(n, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("orders", [("C", "C", "C"), ("F", "F", "F"), ("C", "F", "C"), ("F", "C", "F")])
@pytest.mark.parametrize("n,d,m", [(1, 1, 1), (0, 3, 2), (5, 9, 4), (400, 33, 10), (2, 70, 1)])
def test_cross_update_matches_numpy(rng, dtype, orders, n, d, m):
    c_order, x_order, z_order = orders
    X = random(rng, (n, d), dtype, x_order)
    Z = random(rng, (n, m), dtype, z_order)
    C0 = random(rng, (d, m), dtype, c_order)
    C = C0.copy(order=c_order)
    assert fastls.cross_update(C, X, Z) is C
    assert_close(C, C0.astype(np.float64) + X.astype(np.float64).T @ Z.astype(np.float64), dtype, n)


@pytest.mark.parametrize("c_order", ORDERS)
def test_cross_update_float32_into_float64(rng, c_order):
    X = random(rng, (3000, 2100), np.float32)[:, :2050]  # non-contiguous input is copied
    Z = random(rng, (3000, 7), np.float32, "F")
    C = np.zeros((2050, 7), order=c_order)
    fastls.cross_update(C, X, Z, block_rows=900)
    assert_close(C, X.astype(np.float64).T @ Z.astype(np.float64), np.float32, 900)


@pytest.mark.parametrize("out_order", ORDERS)
def test_mixed_products_over_uneven_tiles(rng, monkeypatch, out_order):
    """float32 tiles of at most 7 columns over 20 x 20 and 20 x 9 outputs: 7 + 7 + 6 and 5 + 4 (even splits)."""
    monkeypatch.setattr("fastls._products.DEFAULT_TILE", 7)
    X = random(rng, (150, 20), np.float32)
    Z = random(rng, (150, 9), np.float32, "F")
    G = np.zeros((20, 20), order=out_order)
    C = np.zeros((20, 9), order=out_order)
    fastls.gram_update(G, X, block_rows=40)
    fastls.cross_update(C, X, Z, block_rows=40)
    X64, Z64 = X.astype(np.float64), Z.astype(np.float64)
    assert_close(upper(G), upper(X64.T @ X64), np.float32, 40)
    np.testing.assert_array_equal(np.tril(G, -1), 0)
    assert_close(C, X64.T @ Z64, np.float32, 40)


@pytest.mark.parametrize("out_order", ORDERS)
@pytest.mark.parametrize("d, tile", [(511, 2560), (512, 2560), (600, 2560), (1030, 520)])
def test_mixed_gram_across_transpose_blocks(rng, monkeypatch, out_order, d, tile):
    """A Fortran G takes diagonal float32 tiles of 512 or more transposed, in 64 x 64 blocks.

    600 ends on a partial block; 1030 in tiles of at most 520 is two diagonal tiles of 515.
    """
    monkeypatch.setattr("fastls._products.DEFAULT_TILE", tile)
    X = random(rng, (300, d), np.float32)
    G = np.zeros((d, d), order=out_order)
    fastls.gram_update(G, X, block_rows=128)
    X64 = X.astype(np.float64)
    assert_close(upper(G), upper(X64.T @ X64), np.float32, 128)
    np.testing.assert_array_equal(np.tril(G, -1), 0)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("d", [6, 512, 1100])  # one block, exactly one, three (blocks of 512 columns)
def test_symmetrize(rng, order, d):
    A = np.array(rng.standard_normal((d, d)), order=order)
    full = fastls.symmetrize(A)
    np.testing.assert_array_equal(full, np.triu(A) + np.triu(A, 1).T)
    fastls.symmetrize(A, inplace=True)
    np.testing.assert_array_equal(A, full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g_order", ORDERS)
@pytest.mark.parametrize("t_order", ORDERS)
@pytest.mark.parametrize("d", [1, 7, 300])
def test_add_upper_matches_numpy(rng, dtype, g_order, t_order, d):
    G0 = random(rng, (d, d), dtype, g_order)
    T = random(rng, (d, d), dtype, t_order)
    G = G0.copy(order=g_order)
    assert fastls.add_upper(G, T) is G
    # One addition per entry, as in NumPy: bit-identical on the upper triangle.
    np.testing.assert_array_equal(np.triu(G), np.triu(G0 + T))
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))


def test_add_upper_refuses_mismatches(rng):
    G = rng.standard_normal((4, 4))
    with pytest.raises(ValueError, match="one shape"):
        fastls.add_upper(G, rng.standard_normal((4, 5)))
    with pytest.raises(ValueError, match="one shape"):
        fastls.add_upper(rng.standard_normal((4, 5)), rng.standard_normal((4, 5)))
    with pytest.raises(TypeError, match="G's dtype float64"):
        fastls.add_upper(G, G.astype(np.float32))
    G.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastls.add_upper(G, G.copy())


# ---------------------------------------------------------------------------
# im2col and the streaming convolution Gram
# ---------------------------------------------------------------------------

def reference_im2col(images, k, s, p, append_ones):
    B, H, W, C = images.shape
    padded = np.zeros((B, H + 2 * p[0], W + 2 * p[1], C))
    padded[:, p[0]:p[0] + H, p[1]:p[1] + W] = images
    out_h = (H + 2 * p[0] - k[0]) // s[0] + 1
    out_w = (W + 2 * p[1] - k[1]) // s[1] + 1
    rows = []
    for b in range(B):
        for y in range(out_h):
            for x in range(out_w):
                patch = padded[b, y * s[0]:y * s[0] + k[0], x * s[1]:x * s[1] + k[1], :].reshape(-1)
                rows.append(np.append(patch, 1.0) if append_ones else patch)
    return np.array(rows).reshape(B * out_h * out_w, -1)


CONV_CASES = [
    # (B, H, W, C), kernel, stride, padding
    ((2, 5, 5, 1), (3, 3), (1, 1), (0, 0)),
    ((3, 6, 7, 2), (3, 3), (1, 1), (1, 1)),
    ((2, 8, 8, 3), (5, 5), (2, 2), (2, 2)),
    ((1, 4, 9, 4), (2, 3), (1, 2), (0, 1)),
    ((4, 3, 3, 2), (3, 3), (1, 1), (2, 2)),  # padding wider than half the kernel
    ((2, 1, 1, 3), (1, 1), (1, 1), (0, 0)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k,s,p", CONV_CASES)
@pytest.mark.parametrize("append_ones", [False, True])
def test_im2col_matches_reference(rng, dtype, shape, k, s, p, append_ones):
    images = random(rng, shape, dtype)
    P = fastls.im2col(images, k, stride=s, padding=p, append_ones=append_ones)
    assert P.dtype == dtype and P.flags.c_contiguous
    np.testing.assert_array_equal(P, reference_im2col(images.astype(np.float64), k, s, p, append_ones).astype(dtype))
    assert P.shape[0] == shape[0] * np.prod(fastls.conv_output_shape(shape[1:3], k, s, p))


def test_im2col_same_padding_keeps_size(rng):
    images = random(rng, (2, 7, 6, 3), np.float64)
    P = fastls.im2col(images, 3, padding="same")
    assert P.shape == (2 * 7 * 6, 27)
    np.testing.assert_array_equal(P, reference_im2col(images, (3, 3), (1, 1), (1, 1), False))


def reference_avg_pool(images, pool, stride):
    """Window means by explicit loops, in float64."""
    (ph, pw), (sh, sw) = pool, stride
    B, H, W, C = images.shape
    out = np.empty((B, (H - ph) // sh + 1, (W - pw) // sw + 1, C))
    for y in range(out.shape[1]):
        for x in range(out.shape[2]):
            out[:, y, x] = images[:, y * sh:y * sh + ph, x * sw:x * sw + pw].mean(axis=(1, 2))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,pool,stride", [
    ((2, 8, 8, 3), (2, 2), None),
    ((3, 7, 9, 5), (2, 2), (2, 2)),  # odd sizes: the last row/column is dropped
    ((1, 6, 5, 1), (3, 2), (1, 2)),  # overlapping windows
    ((2, 4, 4, 17), (4, 4), None),
    ((1, 1, 1, 2), (1, 1), None),
])
def test_avg_pool2d_matches_reference(rng, dtype, shape, pool, stride):
    images = random(rng, shape, dtype)
    out = fastls.avg_pool2d(images, pool, stride)
    assert out.dtype == dtype and out.flags.c_contiguous
    assert_close(out, reference_avg_pool(images.astype(np.float64), pool, stride or pool), dtype, pool[0] * pool[1])


@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9), st.integers(1, 6),
       st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.sampled_from(DTYPES))
@settings(max_examples=60, deadline=None)
def test_avg_pool2d_any_window(B, H, W, C, ph, pw, sh, sw, dtype):
    rng = np.random.default_rng([B, H, W, C, ph, pw, sh, sw])
    images = random(rng, (B, H, W, C), dtype)
    if ph > H or pw > W:
        with pytest.raises(ValueError, match="does not fit"):
            fastls.avg_pool2d(images, (ph, pw), (sh, sw))
        return
    out = fastls.avg_pool2d(images, (ph, pw), (sh, sw))
    assert_close(out, reference_avg_pool(images.astype(np.float64), (ph, pw), (sh, sw)), dtype, ph * pw)


def test_avg_pool2d_rejects_bad_input(rng):
    with pytest.raises(ValueError, match="4-dimensional"):
        fastls.avg_pool2d(random(rng, (4, 4, 3), np.float64), 2)
    with pytest.raises(TypeError, match="float32 or float64"):
        fastls.avg_pool2d(np.ones((1, 4, 4, 1), dtype=np.int64), 2)
    with pytest.raises(ValueError, match=">= 1"):
        fastls.avg_pool2d(random(rng, (1, 4, 4, 1), np.float64), 2, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("factor", [0.01, 0.0, 1.0, 3.5, -2.0])
def test_scale_negatives_matches_numpy(rng, dtype, order, factor):
    x = random(rng, (37, 53), dtype, order)
    expected = np.where(x < 0, x.astype(np.float64) * factor, x.astype(np.float64))
    out = fastls.scale_negatives(x, factor)
    assert out is x
    # One rounding of one product: exact up to the dtype's rounding.
    assert_close(x, expected, dtype, 1)


def test_scale_negatives_keeps_nan_and_infinities():
    x = np.array([np.nan, -np.inf, np.inf, -1.0, 0.0, 2.0])
    fastls.scale_negatives(x, 0.5)
    np.testing.assert_array_equal(x, [np.nan, -np.inf, np.inf, -0.5, 0.0, 2.0])


def test_scale_negatives_rejects_what_it_cannot_update(rng):
    x = random(rng, (4, 6), np.float64)
    with pytest.raises(ValueError, match="contiguous"):
        fastls.scale_negatives(x[:, ::2], 0.1)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastls.scale_negatives(x, 0.1)
    with pytest.raises(TypeError, match="float32 or float64"):
        fastls.scale_negatives(np.arange(3), 0.1)


@pytest.mark.parametrize("images_dtype,g_dtype",
                         [(np.float32, np.float32), (np.float64, np.float64), (np.float32, np.float64)])
@pytest.mark.parametrize("shape,k,s,p", CONV_CASES)
@pytest.mark.parametrize("per_image", [True, False])
@pytest.mark.parametrize("scratch_rows", [1, 3, 1000])
@pytest.mark.parametrize("m", [4, 90])  # more targets than patch values too (a wide first convolution)
def test_conv_gram_update_matches_im2col(rng, images_dtype, g_dtype, shape, k, s, p, per_image, scratch_rows, m):
    images = random(rng, shape, images_dtype)
    out_h, out_w = fastls.conv_output_shape(shape[1:3], k, s, p)
    targets = random(rng, (shape[0], m) if per_image else (shape[0], out_h, out_w, m), images_dtype)
    P = reference_im2col(images.astype(np.float64), k, s, p, True)
    T = (np.repeat(targets.astype(np.float64), out_h * out_w, axis=0) if per_image
         else targets.reshape(-1, m).astype(np.float64))
    d = P.shape[1]
    G0, C0 = random(rng, (d, d), g_dtype, "F"), random(rng, (d, m), g_dtype)
    G, C = G0.copy(order="F"), C0.copy()
    itemsize = np.dtype(images_dtype).itemsize
    tile = min(2048, d) * max(d, m) * 4 if images_dtype != g_dtype else 0
    # A budget of about scratch_rows patch rows (plus the patch-sum rows).
    budget = tile + (scratch_rows + (scratch_rows // (out_h * out_w) + 3)) * d * itemsize
    fastls.conv_gram_update(G, C, images, targets, k, stride=s, padding=p, append_ones=True,
                            scratch_bytes=budget, block_rows=5)
    n_terms = P.shape[0]
    assert_close(upper(G), upper(G0.astype(np.float64) + P.T @ P), images_dtype, n_terms)
    assert_close(C, C0.astype(np.float64) + P.T @ T, images_dtype, n_terms)


def test_conv_gram_update_rejects_tiny_scratch(rng):
    images = random(rng, (2, 6, 6, 4), np.float64)
    G, C = np.zeros((36, 36)), np.zeros((36, 2))
    with pytest.raises(ValueError, match="scratch_bytes"):
        fastls.conv_gram_update(G, C, images, np.ones((2, 2)), 3, scratch_bytes=100)
    np.testing.assert_array_equal(G, 0)


@pytest.mark.parametrize("per_image", [True, False])
def test_conv_gram_update_needs_exactly_what_it_says(rng, per_image):
    """The 'need at least N' of the im2col path is the smallest budget it accepts."""
    images = random(rng, (2, 6, 6, 4), np.float64)
    targets = random(rng, (2, 2) if per_image else (2, 4, 4, 2), np.float64)
    G, C = np.zeros((36, 36)), np.zeros((36, 2))
    with pytest.raises(ValueError, match="need at least") as err:
        fastls.conv_gram_update(G, C, images, targets, 3, method="im2col", scratch_bytes=8)
    need = int(str(err.value).rsplit(" ", 1)[-1])
    with pytest.raises(ValueError, match="need at least"):
        fastls.conv_gram_update(G, C, images, targets, 3, method="im2col", scratch_bytes=need - 1)
    fastls.conv_gram_update(G, C, images, targets, 3, method="im2col", scratch_bytes=need)
    P = reference_im2col(images, (3, 3), (1, 1), (0, 0), False)
    assert_close(np.triu(G), np.triu(P.T @ P), np.float64, P.shape[0])


# ---------------------------------------------------------------------------
# Solves
# ---------------------------------------------------------------------------

def spd_system(rng, n, d, m, dtype, order="C"):
    X = rng.standard_normal((n, d))
    G = np.asarray(X.T @ X, dtype=dtype, order=order)
    C = np.asarray(X.T @ rng.standard_normal((n, m)), dtype=dtype, order=order)
    return G, C


def solve_tolerance(dtype, G, shift):
    # Backward-stable Cholesky: relative error ~ eps * condition number.
    evals = np.linalg.eigvalsh(G.astype(np.float64)) + shift
    return 100 * np.finfo(dtype).eps * evals.max() / evals.min()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n,d,m", [(5, 1, 1), (3, 8, 2), (200, 30, 5), (50, 120, 10), (0, 4, 3)])
def test_ridge_solve_matches_numpy(rng, dtype, order, n, d, m):
    G, C = spd_system(rng, n, d, m, dtype, order)
    gamma = 0.7
    G_before, C_before = G.copy(), C.copy()
    W = fastls.ridge_solve(np.triu(G).astype(dtype, order=order), C, gamma)
    ref = np.linalg.solve(G.astype(np.float64) + gamma * np.eye(d), C.astype(np.float64))
    err = np.abs(W - ref).max() / max(np.abs(ref).max(), 1e-300)
    assert W.dtype == dtype and W.shape == (d, m)
    assert err <= solve_tolerance(dtype, G, gamma)
    np.testing.assert_array_equal(G, G_before)
    np.testing.assert_array_equal(C, C_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ORDERS)
def test_ridge_solve_overwrite_reuses_memory(rng, dtype, order):
    G, _ = spd_system(rng, 100, 20, 3, dtype, order)
    C = np.asfortranarray(rng.standard_normal((20, 3)).astype(dtype))
    G_before = G.copy()
    ref = np.linalg.solve(G.astype(np.float64) + 2 * np.eye(20), C.astype(np.float64))
    tol = solve_tolerance(dtype, G, 2.0)
    W = fastls.ridge_solve(G, C, 2.0, overwrite_g=True, overwrite_c=True)
    assert np.shares_memory(W, C)
    assert np.abs(W - ref).max() <= tol * np.abs(ref).max()
    assert not np.array_equal(G, G_before)  # G now holds the Cholesky factor


def relative_error(actual, reference):
    return np.linalg.norm(actual - reference) / np.linalg.norm(reference)


def float32_gram_system(rng, n=400, d=60, m=4):
    """A = X^T X in float64, G the same Gram from float32 products, C, and A V as a function (exact products)."""
    # Nonnegative features of uneven scales (a ReLU's outputs): float32 sums of their products are visibly off.
    X = rng.uniform(0.0, 1.0, (n, d)) * rng.uniform(0.1, 10.0, d)
    X32 = X.astype(np.float32)
    G = (X32.T @ X32).astype(np.float64)
    return X.T @ X, G, rng.standard_normal((d, m)), lambda V: X.T @ (X @ V)


@pytest.mark.parametrize("order", ORDERS)
def test_refined_ridge_solve_reaches_the_float64_solve_from_a_float32_gram(rng, order):
    A, G, C, gram_product = float32_gram_system(rng)
    G = np.triu(G).copy(order=order)
    G_before = G.copy()
    gamma = 1e-3
    exact = np.linalg.solve(A + gamma * np.eye(len(A)), C)
    unrefined = fastls.ridge_solve(G, C, gamma)
    W, report = fastls.refined_ridge_solve(G, C, gamma, gram_product)
    assert relative_error(unrefined, exact) > 1e-6  # the float32 Gram alone is far off
    assert relative_error(W, exact) <= 1e-11
    assert report["converged"] and 1 <= report["iterations"] <= 5 and report["correction"] <= 1e-9
    np.testing.assert_array_equal(G, G_before)


def test_refined_ridge_solve_overwrites_g_only_when_asked_and_never_c(rng):
    A, G, C, gram_product = float32_gram_system(rng, d=20)
    G_before, C_before = G.copy(), C.copy()
    W, _ = fastls.refined_ridge_solve(G, C, 0.5, gram_product, overwrite_g=True)
    assert relative_error(W, np.linalg.solve(A + 0.5 * np.eye(20), C)) <= 1e-11
    assert not np.array_equal(G, G_before)  # G now holds the Cholesky factor
    np.testing.assert_array_equal(C, C_before)


def test_refined_ridge_solve_of_no_unknowns_is_empty():
    W, report = fastls.refined_ridge_solve(np.zeros((0, 0)), np.zeros((0, 3)), 1.0, lambda V: V)
    assert W.shape == (0, 3) and report == {"iterations": 0, "correction": 0.0, "converged": True}


def test_refined_ridge_solve_stops_where_corrections_stop_halving(rng):
    A, G, C, gram_product = float32_gram_system(rng)
    # No correction reaches 1e-300: the steps go on until the float64 residuals' rounding, then stop.
    _, floor = fastls.refined_ridge_solve(G, C, 1e-3, gram_product, tol=1e-300)
    assert not floor["converged"] and floor["iterations"] < fastls._solve.REFINE_MAX_ITER
    assert 0 < floor["correction"] <= 1e-11
    # Where that rounding is within REFINE_FLOOR x tol of W, the solve has converged there.
    tol = floor["correction"] / (fastls._solve.REFINE_FLOOR / 2)
    W, report = fastls.refined_ridge_solve(G, C, 1e-3, gram_product, tol=tol)
    assert report["converged"] and report["correction"] > tol
    assert relative_error(W, np.linalg.solve(A + 1e-3 * np.eye(len(A)), C)) <= 1e-11


def test_refined_ridge_solve_reports_a_g_too_far_from_a(rng):
    A, _, C, gram_product = float32_gram_system(rng, d=20)
    # G = A / 100: each step multiplies the error by about (A - G) (G + gamma I)^-1, near 99.
    W, report = fastls.refined_ridge_solve(A / 100, C, 1e-3, gram_product)
    assert not report["converged"] and report["iterations"] <= 2 and W.shape == C.shape


def test_refined_ridge_solve_refuses_bad_input_by_name(rng):
    A, G, C, gram_product = float32_gram_system(rng, d=10)
    with pytest.raises(TypeError, match="float64"):
        fastls.refined_ridge_solve(G.astype(np.float32), C.astype(np.float32), 1.0, gram_product)
    expected = r"gram_product must return a float64 array of the shape of its argument \(10, 4\)"
    with pytest.raises(ValueError, match=expected + r", got float64 array of shape \(5, 4\)"):
        fastls.refined_ridge_solve(G, C, 1.0, lambda V: V[:5])
    with pytest.raises(ValueError, match=expected + ", got float32 array"):
        fastls.refined_ridge_solve(G, C, 1.0, lambda V: V.astype(np.float32))
    with pytest.raises(ValueError, match=expected + ", got NoneType"):
        fastls.refined_ridge_solve(G, C, 1.0, lambda V: None)
    with pytest.raises(ValueError, match=r"gram_product\(W\).*NaN"):
        fastls.refined_ridge_solve(G, C, 1.0, lambda V: np.full_like(V, np.nan))
    with pytest.raises(ValueError, match="tol"):
        fastls.refined_ridge_solve(G, C, 1.0, gram_product, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        fastls.refined_ridge_solve(G, C, 1.0, gram_product, max_iter=0)
    with pytest.raises(np.linalg.LinAlgError, match="not positive definite"):
        fastls.refined_ridge_solve(-10 * np.eye(10), C, 1.0, gram_product)


@pytest.mark.parametrize("dtype", DTYPES)
def test_proximal_solve_matches_numpy(rng, dtype):
    G, C = spd_system(rng, 40, 25, 6, dtype)
    M = rng.standard_normal((25, 6)).astype(dtype)
    eps = 3.0
    W = fastls.proximal_solve(G, C, eps, M)
    ref = np.linalg.solve(G.astype(np.float64) + eps * np.eye(25), C.astype(np.float64) + eps * M.astype(np.float64))
    assert np.abs(W - ref).max() / np.abs(ref).max() <= solve_tolerance(dtype, G, eps)


def test_proximal_solve_is_the_minimizer(rng):
    X, Z = rng.standard_normal((30, 6)), rng.standard_normal((30, 2))
    M, eps = rng.standard_normal((6, 2)), 5.0
    W = fastls.proximal_solve(X.T @ X, X.T @ Z, eps, M)
    # Gradient of ||Z - XW||^2 + eps ||W - M||^2 vanishes at the solution.
    grad = -2 * X.T @ (Z - X @ W) + 2 * eps * (W - M)
    assert np.abs(grad).max() < 1e-10


def test_ridge_solve_indefinite_raises_with_hint(rng):
    G = -np.eye(4) * 10
    C = rng.standard_normal((4, 2))
    with pytest.raises(np.linalg.LinAlgError, match="gamma") as info:
        fastls.ridge_solve(G, C, 1.0)
    assert "on_failure='eigh'" in str(info.value)


def test_ridge_solve_eigh_fallback(rng):
    # Indefinite after the shift: Cholesky fails; eigh keeps the positive eigenvalues (pseudo-inverse).
    V = np.linalg.qr(rng.standard_normal((5, 5)))[0]
    G = V @ np.diag([3.0, 2.0, 1.0, -0.5, -1.5]) @ V.T
    C = rng.standard_normal((5, 2))
    with pytest.warns(RuntimeWarning, match="eigh"):
        W = fastls.ridge_solve(G, C, 1.0, on_failure="eigh")
    shifted = np.diag([4.0, 3.0, 2.0, 0.5, 0.0])
    ref = V @ np.linalg.pinv(shifted) @ V.T @ C
    np.testing.assert_allclose(W, ref, atol=1e-10)
    # The proximal solve's fallback solves C + eps M on the same eigenvalues.
    M = rng.standard_normal((5, 2))
    with pytest.warns(RuntimeWarning, match="eigh"):
        W = fastls.proximal_solve(G, C, 1.0, M, on_failure="eigh")
    np.testing.assert_allclose(W, V @ np.linalg.pinv(shifted) @ V.T @ (C + M), atol=1e-10)


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------

def test_bad_dtype():
    with pytest.raises(TypeError, match="float32 or float64"):
        fastls.gram_update(np.zeros((2, 2)), np.ones((3, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="lose precision"):
        fastls.gram_update(np.zeros((2, 2), np.float32), np.ones((3, 2)))
    with pytest.raises(TypeError, match="share a dtype"):
        fastls.cross_update(np.zeros((2, 1)), np.ones((3, 2)), np.ones((3, 1), np.float32))


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"\(3, 3\)"):
        fastls.gram_update(np.zeros((2, 2)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="same number of rows"):
        fastls.cross_update(np.zeros((3, 1)), np.ones((4, 3)), np.ones((5, 1)))
    with pytest.raises(ValueError, match="2-dimensional"):
        fastls.gram_update(np.zeros((3, 3)), np.ones(3))
    with pytest.raises(ValueError, match="square"):
        fastls.ridge_solve(np.ones((3, 2)), np.ones((3, 1)), 1.0)
    with pytest.raises(ValueError, match="targets must have shape"):
        fastls.conv_gram_update(np.zeros((10, 10)), np.zeros((10, 2)), np.ones((2, 4, 4, 1)), np.ones((3, 2)), 3,
                                append_ones=True)
    with pytest.raises(ValueError, match="does not fit"):
        fastls.im2col(np.ones((1, 2, 2, 1)), 3)


@pytest.mark.parametrize("shape,kernel_size,padding,message", [
    ((5, 5), (3, 3), (0, -1), "padding"),  # a negative padding in x alone would still leave 1 output column
    ((5, 3), (3, 5), 0, "does not fit"),   # wider than the map in x only
    ((3, 5), (5, 3), 0, "does not fit"),   # taller in y only
    ((5, 5), (3, 4), "same", "odd kernel"),
    ((5, 5), (4, 3), "same", "odd kernel"),
])
def test_im2col_geometry_refuses_each_dimension(rng, shape, kernel_size, padding, message):
    with pytest.raises(ValueError, match=message):
        fastls.im2col(rng.standard_normal((1, *shape, 2)), kernel_size, padding=padding)


@pytest.mark.parametrize("call,message", [
    (lambda: fastls.conv_output_shape((5.5, 5), 3), "image_hw must be an int or a pair of ints"),
    (lambda: fastls.conv_output_shape((-5, 5), 3, padding=5), "image_hw must be positive"),
    (lambda: fastls.tuning.conv_stats_cost((5, 5, -3), 3), "image_shape must be three positive ints"),
    (lambda: fastls.ConvStats(np.zeros((46, 46)), np.zeros((46, 1)), (5.7, 5, 5), 3, append_ones=True),
     "image_shape must be three positive ints"),
    (lambda: fastls.proximal_cost(-5, 3, 4), "n must be a finite number >= 0"),
    (lambda: fastls.proximal_cost(5, "3", 4), "d must be a finite number >= 0"),
    (lambda: fastls.gram_update(np.zeros((2, 2)), np.ones((3, 2)), block_rows=2**70),
     "block_rows must be an integer >= 1 and below 2\\^63"),
    (lambda: fastls.im2col(np.ones((1, 4, 4, 1)), 2, stride=2**70), "stride must be below 2\\^63"),
])
def test_sizes_and_counts_are_refused_by_name_not_truncated(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_leave_outputs_untouched(rng, bad):
    X = rng.standard_normal((50, 4))
    X[17, 2] = bad
    G = rng.standard_normal((4, 4))
    G_before = G.copy()
    with pytest.raises(ValueError, match="NaN or Inf"):
        fastls.gram_update(G, X)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fastls.gram_update(G, np.asfortranarray(X))
    np.testing.assert_array_equal(G, G_before)
    with pytest.raises(ValueError, match="NaN or Inf"):
        fastls.ridge_solve(np.eye(4), X[15:19], 1.0)
    # The upper-triangle check of a Fortran G reads its diagonal too.
    G = np.asfortranarray(X[:15].T @ X[:15])
    G[2, 2] = bad
    with pytest.raises(ValueError, match="G contains NaN or Inf"):
        fastls.ridge_solve(G, np.ones((4, 1), order="F"), 1.0)
    with pytest.raises(ValueError, match="G contains NaN or Inf"):
        fastls.RidgePath.from_statistics(G, np.ones((4, 1)), 1.0, 20)
    images = rng.standard_normal((2, 3, 3, 1))
    images[1, 2, 2, 0] = bad
    with pytest.raises(ValueError, match="images contains NaN"):
        fastls.conv_gram_update(np.zeros((4, 4)), np.zeros((4, 1)), images, np.ones((2, 1)), 2)


@pytest.mark.parametrize("value", [0, -1.0, np.nan, np.inf, "1"])
def test_bad_regularization(value):
    G, C = np.eye(3), np.ones((3, 1))
    with pytest.raises(ValueError, match="gamma must be a finite number > 0"):
        fastls.ridge_solve(G, C, value)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        fastls.proximal_solve(G, C, value, C)


def test_bad_outputs():
    X = np.ones((4, 3))
    ro = np.zeros((3, 3))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fastls.gram_update(ro, X)
    strided = np.zeros((6, 6))[::2, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        fastls.gram_update(strided, X)
    with pytest.raises(ValueError, match="contiguous"):
        fastls.cross_update(np.zeros((3, 4))[:, ::2], X, np.ones((4, 2)))


def test_read_only_and_strided_inputs_are_accepted(rng):
    X = rng.standard_normal((40, 10))
    X.flags.writeable = False
    G = fastls.gram_update(np.zeros((5, 5)), X[:, ::2])
    assert_close(upper(G), upper(X[:, ::2].T @ X[:, ::2]), np.float64, 40)
    # Told they may be overwritten, read-only G and C are copied instead.
    G, C = X.T @ X, np.asfortranarray(X.T @ rng.standard_normal((40, 2)))
    G.flags.writeable = C.flags.writeable = False
    W = fastls.ridge_solve(G, C, 3.0, overwrite_g=True, overwrite_c=True)
    assert_close(W, np.linalg.solve(G + 3.0 * np.eye(10), C), np.float64, rtol=1e-12)
    np.testing.assert_array_equal(G, X.T @ X)


# ---------------------------------------------------------------------------
# Core limits
# ---------------------------------------------------------------------------

def test_limit_cores_sets_and_restores_blas_threads():
    before = [lib["num_threads"] for lib in fastls.blas_info()]
    assert before, "threadpoolctl found no BLAS library"
    with fastls.limit_cores(1):
        assert all(lib["num_threads"] == 1 for lib in fastls.blas_info())
        # Kernels still run (and give the same answer) under the limit.
        X = np.arange(12.0).reshape(4, 3)
        G = fastls.gram_update(np.zeros((3, 3)), X)
        np.testing.assert_allclose(upper(G), upper(X.T @ X))
    assert [lib["num_threads"] for lib in fastls.blas_info()] == before


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_limit_cores_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="n_cores"):
        with fastls.limit_cores(bad):
            pass


def test_kernels_release_the_gil(rng):
    # Two threads each running a long syrk: with the GIL held inside, a
    # Python-level counter thread could not advance while BLAS runs.
    import threading
    import time

    X = rng.standard_normal((6000, 600))
    ticks = []
    done = threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    start = time.perf_counter()
    with fastls.limit_cores(1):
        for _ in range(3):
            fastls.gram_update(np.zeros((600, 600)), X, check_finite=False)
    elapsed = time.perf_counter() - start
    done.set()
    counter.join()
    during = [t for t in ticks if start <= t <= start + elapsed]
    # The counter kept ticking throughout the kernel calls.
    assert len(during) >= max(3, int(elapsed / 0.001) // 10)


# ---------------------------------------------------------------------------
# The proximal solve in its dual form, and what every solve checks first
# ---------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 60), st.integers(1, 5), st.floats(1e-3, 1e4), st.integers(0, 2**31 - 1))
def test_dual_proximal_solve_equals_the_primal(n, d, m, eps, seed):
    rng = np.random.default_rng(seed)
    X, Z, M = rng.standard_normal((n, d)), rng.standard_normal((n, m)), rng.standard_normal((d, m))
    G, C = X.T @ X, X.T @ Z
    primal = fastls.proximal_solve(G, C, eps, M)
    dual = fastls.proximal_solve_dual(X, Z, eps, M)
    assert np.abs(dual - primal).max() <= 1e-8 * np.abs(primal).max()


@pytest.mark.parametrize("m_dtype", DTYPES)
def test_dual_proximal_solve_float32_rows(rng, m_dtype):
    X = random(rng, (30, 200), np.float32)
    Z = random(rng, (30, 4), np.float32)
    M = random(rng, (200, 4), m_dtype)
    X64, Z64, M64 = (A.astype(np.float64) for A in (X, Z, M))
    reference = M64 + X64.T @ np.linalg.solve(X64 @ X64.T + 50.0 * np.eye(30), Z64 - X64 @ M64)
    W = fastls.proximal_solve_dual(X, Z, 50.0, M)
    assert W.dtype == m_dtype and W.shape == (200, 4)
    assert_close(W, reference, np.float32, 200)


def test_dual_proximal_solve_checks_its_inputs(rng):
    X, Z, M = rng.standard_normal((5, 8)), rng.standard_normal((5, 2)), rng.standard_normal((8, 2))
    with pytest.raises(ValueError, match=r"M must have shape \(d, m\) = \(8, 2\)"):
        fastls.proximal_solve_dual(X, Z, 1.0, M[:7])
    with pytest.raises(ValueError, match=r"Z must have shape \(5, m\)"):
        fastls.proximal_solve_dual(X, Z[:4], 1.0, M)
    with pytest.raises(TypeError, match="float64 data into float32"):
        fastls.proximal_solve_dual(X, Z, 1.0, M.astype(np.float32))
    bad = X.copy()
    bad[2, 3] = np.nan
    with pytest.raises(ValueError, match="X contains NaN or Inf"):
        fastls.proximal_solve_dual(bad, Z, 1.0, M)
    bad_Z, bad_M = Z.copy(), M.copy()
    bad_Z[1, 1], bad_M[1, 1] = np.inf, np.nan
    with pytest.raises(ValueError, match="Z contains NaN or Inf"):
        fastls.proximal_solve_dual(X, bad_Z, 1.0, M)
    with pytest.raises(ValueError, match="M contains NaN or Inf"):
        fastls.proximal_solve_dual(X, Z, 1.0, bad_M)


def test_dual_proximal_solve_over_many_row_slices_equals_the_primal(rng, monkeypatch):
    """The dual's products run over row slices of DEFAULT_SCRATCH_BYTES; slices of 3 rows over 10."""
    import fastls._solve

    monkeypatch.setattr(fastls._solve, "DEFAULT_SCRATCH_BYTES", 3 * 12 * 8)
    X, Z, M = rng.standard_normal((10, 12)), rng.standard_normal((10, 3)), rng.standard_normal((12, 3))
    W = fastls.proximal_solve_dual(X, Z, 2.0, M)
    assert_close(W, np.linalg.solve(X.T @ X + 2.0 * np.eye(12), X.T @ Z + 2.0 * M), np.float64, rtol=1e-10)
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        fastls.proximal_solve_dual(X, Z, 0.0, M)


def test_proximal_cost_prefers_the_smaller_system():
    # The DCNN's last convolution at full width: 1,800 patch rows of 18,433 features.
    assert fastls.proximal_cost(1800, 18433, 2048)["dual"] < fastls.proximal_cost(1800, 18433, 2048)["primal"] / 5
    assert fastls.proximal_cost(60000, 785, 10)["primal"] < fastls.proximal_cost(60000, 785, 10)["dual"]


def test_proximal_solve_refuses_before_writing_c(rng):
    G, C = spd_system(rng, 20, 6, 2, np.float64, "F")
    C = np.asfortranarray(C)
    C_before = C.copy()
    broken = G.copy()
    broken[0, 3] = np.nan   # upper triangle: read, so refused
    M = rng.standard_normal((6, 2))
    with pytest.raises(ValueError, match="G contains NaN or Inf"):
        fastls.proximal_solve(broken, C, 10.0, M, overwrite_c=True)
    bad_M = M.copy()
    bad_M[3, 1] = np.nan
    with pytest.raises(ValueError, match="M contains NaN or Inf"):
        fastls.proximal_solve(G, C, 10.0, bad_M, overwrite_c=True)
    with pytest.raises(ValueError, match="on_failure must be one of"):
        fastls.proximal_solve(G, C, 10.0, M, overwrite_c=True, on_failure="lstsq")
    with pytest.raises(ValueError, match="cannot be combined with overwrite_g"):
        fastls.proximal_solve(G, C, 10.0, M, overwrite_c=True, overwrite_g=True, on_failure="eigh")
    np.testing.assert_array_equal(C, C_before)


def test_lower_triangle_of_g_is_not_read(rng):
    G, C = spd_system(rng, 20, 6, 2, np.float64)
    expected = fastls.ridge_solve(G, C, 3.0)
    G[np.tril_indices(6, -1)] = np.nan
    np.testing.assert_array_equal(fastls.ridge_solve(G, C, 3.0), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_subnormal_regularization_is_refused(dtype):
    G, C = np.eye(3, dtype=dtype), np.ones((3, 1), dtype=dtype)
    subnormal = float(np.finfo(dtype).tiny) / 4
    with pytest.raises(ValueError, match="smallest normal"):
        fastls.ridge_solve(G, C, subnormal)
    with pytest.raises(ValueError, match="smallest normal"):
        fastls.proximal_solve(G, C, subnormal, C)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_update_diagonal_check_refuses_overflow_and_nan(rng, dtype):
    # N >= 4 d: the product's diagonal is checked instead of a scan of X.
    X = random(rng, (400, 6), dtype)
    G = random(rng, (6, 6), np.float64)
    G_before = G.copy()
    X[123, 4] = np.nan
    with pytest.raises(ValueError, match="X contains NaN or Inf"):
        fastls.gram_update(G, X)
    X[123, 4] = np.sqrt(np.finfo(dtype).max) * 2   # finite, but its square overflows the product's dtype
    with pytest.raises(ValueError, match="overflow"):
        fastls.gram_update(G, X)
    np.testing.assert_array_equal(G, G_before)


@pytest.mark.parametrize("x_dtype,g_dtype", [(np.float32, np.float32), (np.float32, np.float64),
                                             (np.float64, np.float64)])
@pytest.mark.parametrize("n", [3, 23, 400])   # the scan of X (N < 4 d) and the product's diagonal (N >= 4 d)
@pytest.mark.parametrize("order", ["C", "F"])
def test_gram_update_refuses_overflowing_squares_on_every_path(rng, x_dtype, g_dtype, n, order):
    X = np.asarray(random(rng, (n, 6), x_dtype), order=order)
    G = np.asarray(random(rng, (6, 6), g_dtype), order=order)
    G_before = G.copy()
    X[1, 2] = np.sqrt(np.finfo(x_dtype).max) * 2   # finite, but its square overflows the product's dtype
    with pytest.raises(ValueError, match="overflow"):
        fastls.gram_update(G, X)
    np.testing.assert_array_equal(G, G_before)
    # Large but summable: the one-pass bound (max x^2 * rows) trips, the exact sums accept it.
    X[1, 2] = np.sqrt(np.finfo(x_dtype).max / 2)
    fastls.gram_update(G, X)
    reference = G_before.astype(np.float64) + X.astype(np.float64).T @ X.astype(np.float64)
    assert np.isfinite(np.triu(G)).all()
    assert_close(np.triu(G), np.triu(reference), x_dtype, n_terms=n)


def test_same_dtype_gram_bounds_the_squares_over_all_rows_not_a_block(rng):
    """float32 into float32 sums all N rows in float32: block_rows does not split it."""
    X = np.full((20, 8), np.sqrt(np.finfo(np.float32).max / 10.0), dtype=np.float32)  # x^2 * 20 overflows, x^2 * 4 not
    G = random(rng, (8, 8), np.float32)
    G_before = G.copy()
    with pytest.raises(ValueError, match="overflow"):
        fastls.gram_update(G, X, block_rows=4)
    np.testing.assert_array_equal(G, G_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_solves_on_the_coordinates_of_an_rhs_basis(rng, dtype):
    """Targets encoded as Z = Y Q: solving on k columns gives the same weights as on m."""
    n, d, k, m = 300, 40, 3, 25
    X = random(rng, (n, d), dtype)
    Q = random(rng, (k, m), dtype)
    Y = random(rng, (n, k), dtype)
    Z = (Y @ Q).astype(dtype)
    G, C = (X.T @ X).astype(dtype), (X.T @ Z).astype(dtype)
    M = (random(rng, (d, k), dtype) @ Q).astype(dtype)
    pairs = [
        (fastls.ridge_solve(G, C, 5.0), fastls.ridge_solve(G, C, 5.0, rhs_basis=Q)),
        (fastls.proximal_solve(G, C, 5.0, M), fastls.proximal_solve(G, C, 5.0, M, rhs_basis=Q)),
        (fastls.proximal_solve_dual(X[:20], Z[:20], 5.0, M),
         fastls.proximal_solve_dual(X[:20], Z[:20], 5.0, M, rhs_basis=Q)),
    ]
    for plain, on_basis in pairs:
        assert on_basis.shape == plain.shape and on_basis.dtype == plain.dtype
        assert_close(on_basis, plain, dtype, rtol=solve_tolerance(dtype, G, 5.0))


def test_rhs_basis_must_span_the_right_hand_sides(rng):
    G, C = spd_system(rng, 50, 6, 5, np.float64)
    C_before = C.copy()
    with pytest.raises(ValueError, match="not in the row space of rhs_basis"):
        fastls.ridge_solve(G, C, 1.0, rhs_basis=rng.standard_normal((2, 5)))
    with pytest.raises(ValueError, match=r"rhs_basis must have shape \(k, m\) with k < m = 5"):
        fastls.ridge_solve(G, C, 1.0, rhs_basis=rng.standard_normal((5, 5)))
    np.testing.assert_array_equal(C, C_before)


def test_demo_says_which_side_was_faster():
    from fastls.__main__ import _speed_phrase

    assert _speed_phrase(2.0, 1.0) == "2.0x the time of fastls"
    assert _speed_phrase(1.0, 2.0) == "2.0x faster than fastls here"


# ---------------------------------------------------------------------------
# Wide triangles in panels (OpenBLAS 0.3.30's threaded dsyrk and potrf crash from n ~ 15,000)
# ---------------------------------------------------------------------------

@pytest.fixture
def small_panels():
    """Panels of 16 columns above 40: the tiled syrk, trsm and Cholesky on matrices a test can afford."""
    from fastls import _kernels

    previous = _kernels.set_blas_panels(40, 16)
    yield
    _kernels.set_blas_panels(*previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_order", ORDERS)
@pytest.mark.parametrize("g_order", ORDERS)
@pytest.mark.parametrize("d", [41, 57, 100])
def test_wide_grams_in_panels_match_numpy(rng, small_panels, dtype, x_order, g_order, d):
    X = random(rng, (300, d), dtype, x_order)
    G0 = random(rng, (d, d), dtype, g_order)
    G = G0.copy(order=g_order)
    fastls.gram_update(G, X, check_finite=False)  # the scan-free path: one syrk straight into G
    X64 = X.astype(np.float64)
    assert_close(upper(G), upper(G0.astype(np.float64) + X64.T @ X64), dtype, 300)
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g_order", ORDERS)
@pytest.mark.parametrize("d", [41, 64, 100])
def test_wide_solves_in_panels_match_numpy(rng, small_panels, dtype, g_order, d):
    X = rng.standard_normal((3 * d, d))
    C = rng.standard_normal((d, 50))  # more right-hand sides than one panel
    G = np.asarray(X.T @ X, dtype=dtype, order=g_order)
    W = fastls.ridge_solve(G, np.asarray(C, dtype=dtype), 2.0)
    W_ref = np.linalg.solve(X.T @ X + 2.0 * np.eye(d), C)
    assert_close(W, W_ref, dtype, rtol=1e-10 if dtype == np.float64 else 2e-4)


@pytest.mark.parametrize("uplo_order", ORDERS)
def test_the_panel_cholesky_reports_where_it_fails(rng, small_panels, uplo_order):
    from fastls import _kernels
    from fastls._validation import _layout

    d = 90
    X = rng.standard_normal((2 * d, d))
    G = X.T @ X + np.eye(d)
    G[70, 70] = -1.0  # the leading minor of order 71 is not positive
    A = np.array(G, order=uplo_order)
    assert _kernels.cholesky_solve(A, *_layout(A), np.asfortranarray(np.ones((d, 2)))) == 71


# --------------------------------------------------------------------------- #
# Inputs found wrong by an audit of the public API (2026-11-28)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_right_hand_sides_are_solved_like_contiguous_ones(rng, dtype):
    G, C = spd_system(rng, 40, 6, 8, dtype)
    M = random(rng, (6, 8), dtype)
    np.testing.assert_array_equal(fastls.ridge_solve(G, C[:, ::2], 2.0),
                                  fastls.ridge_solve(G, C[:, ::2].copy(), 2.0))
    np.testing.assert_array_equal(fastls.proximal_solve(G, C[:, ::2], 2.0, M[:, ::2]),
                                  fastls.proximal_solve(G, C[:, ::2].copy(), 2.0, M[:, ::2].copy()))
    X, Z = random(rng, (30, 12), dtype), random(rng, (30, 6), dtype)
    path = fastls.RidgePath.from_rows(X[:, ::2], Z[:, ::2])
    assert path.select()[0] == fastls.RidgePath.from_rows(X[:, ::2].copy(), Z[:, ::2].copy()).select()[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alias", ["X", "W"])
def test_matmul_into_one_of_its_inputs_gives_the_product(rng, dtype, alias):
    X, W = random(rng, (64, 64), dtype), random(rng, (64, 64), dtype)
    expected = X.astype(np.float64) @ W.astype(np.float64)
    out = fastls.matmul(X, W, out=X if alias == "X" else W)
    assert_close(out, expected, dtype, 64)


def test_outputs_that_share_memory_with_their_inputs_are_refused_untouched(rng):
    """Unlike matmul (which multiplies through a temporary), in-place updates and solves refuse an aliased output."""
    X = random(rng, (64, 64), np.float64)
    Z = random(rng, (64, 8), np.float64)
    cases = [
        ("G shares memory with X", lambda: fastls.gram_update(X, X)),
        ("G shares memory with X", lambda: fastls.gram_update(X.reshape(-1)[:256].reshape(16, 16), X[:, :16])),
        ("C shares memory with X", lambda: fastls.cross_update(X, X, X)),
        ("C shares memory with Z", lambda: fastls.cross_update(Z[:8], X[:, :8], Z)),
        ("C shares memory with G", lambda: fastls.conv_gram_update(X.reshape(-1)[:100].reshape(10, 10),
                                                                   X.reshape(-1)[90:110].reshape(10, 2),
                                                                   random(rng, (2, 4, 4, 1), np.float64),
                                                                   random(rng, (2, 2), np.float64), 3,
                                                                   append_ones=True)),
    ]
    G = np.asfortranarray(spd_system(rng, 30, 8, 8, np.float64)[0])
    cases += [
        (r"G \(overwrite_g=True\) shares memory with C", lambda: fastls.ridge_solve(G, G, 1.0, overwrite_g=True)),
        (r"C \(overwrite_c=True\) shares memory with G", lambda: fastls.ridge_solve(G, G, 1.0, overwrite_c=True)),
        (r"G \(overwrite_g=True\) shares memory with M",
         lambda: fastls.proximal_solve(G, np.ones((8, 8)), 1.0, G, overwrite_g=True)),
    ]
    images = random(rng, (2, 5, 5, 1), np.float64)
    out = np.zeros((2, 3, 3, 1))
    cases.append(("out shares memory with W", lambda: fastls.conv2d(images, out.reshape(-1, 1)[:9], 3, out=out)))
    for message, call in cases:
        before = (X.copy(), Z.copy(), G.copy(), out.copy())
        with pytest.raises(ValueError, match=message + ".*pass a copy"):
            call()
        for kept, was in zip((X, Z, G, out), before):
            np.testing.assert_array_equal(kept, was)
    # Disjoint views of one buffer are not an overlap.
    buffer = np.zeros(16 * 8 + 64 * 16)
    C, rows = buffer[:128].reshape(16, 8), buffer[128:].reshape(64, 16)
    rows[...] = X[:, :16]
    fastls.cross_update(C, rows, Z)
    assert_close(C, X[:, :16].T @ Z, np.float64, 64)
    # Without an overwrite flag the solves work on copies: an aliased C is fine.
    full = np.triu(G) + np.triu(G, 1).T
    assert_close(fastls.ridge_solve(G, G, 1.0), np.linalg.solve(full + np.eye(8), G), np.float64, 8)


@pytest.mark.parametrize("g_dtype", [np.float32, np.float64])
def test_float32_products_that_overflow_are_refused_and_leave_the_sums(rng, g_dtype):
    X = random(rng, (8, 2), np.float32)
    X[3, 1] = 1e20
    C = random(rng, (2, 2), g_dtype)
    C_before = C.copy()
    with pytest.raises(ValueError, match="overflow float32 in X\\^T Z"):
        fastls.cross_update(C, X, X)
    np.testing.assert_array_equal(C, C_before)
    X[3, 1] = 1e17  # large, but its products fit float32: accepted, as the float64 reference says
    fastls.cross_update(C, X, X)
    assert_close(C, C_before + X.astype(np.float64).T @ X.astype(np.float64), np.float32, 8)
    # Small X, huge Z: X^T Z still overflows, so both operands must pass the bound.
    C_before = C.copy()
    with pytest.raises(ValueError, match="overflow float32 in X\\^T Z"):
        fastls.cross_update(C, np.full((10, 2), 10.0, np.float32), np.full((10, 2), 1e37, np.float32))
    np.testing.assert_array_equal(C, C_before)
    images = random(rng, (2, 6, 6, 3), np.float32)
    images[1, 2, 2, 0] = 1e20
    G, C = random(rng, (28, 28), g_dtype), random(rng, (28, 2), g_dtype)
    G_before, C_before = G.copy(), C.copy()
    for method in ("im2col", "overlap"):
        with pytest.raises(ValueError, match="images holds values whose products overflow float32"):
            fastls.conv_gram_update(G, C, images, random(rng, (2, 2), np.float32), 3, append_ones=True,
                                    method=method)
    np.testing.assert_array_equal(G, G_before)
    np.testing.assert_array_equal(C, C_before)
    # 2 images of 6 x 6 with a 3x3 kernel: 32 patch rows. x^2 * 2 fits float32, x^2 * 32 does not.
    images = np.full((2, 6, 6, 3), np.sqrt(np.finfo(np.float32).max / 8.0), dtype=np.float32)
    for method in ("im2col", "overlap"):
        with pytest.raises(ValueError, match="images holds values whose products overflow float32"):
            fastls.conv_gram_update(G, C, images, random(rng, (2, 2), np.float32), 3, append_ones=True,
                                    method=method)
    np.testing.assert_array_equal(G, G_before)


def test_float32_results_that_overflow_are_refused(rng):
    """Finite float32 inputs whose product, accumulated sum or solve overflows float32 raise, never return Inf."""
    huge = np.full((2, 3), 1e20, np.float32)
    with pytest.raises(ValueError, match="X W overflows float32"):
        fastls.matmul(huge, huge.T)
    assert np.isinf(fastls.matmul(huge, huge.T, check_finite=False)).all()  # unchecked: the caller's choice
    # Sums that overflow only with what the accumulator already holds.
    X = np.full((3, 2), 1e19, np.float32)
    with pytest.raises(ValueError, match=r"G overflowed float32 while adding X\^T X.*float64 G"):
        fastls.gram_update(np.full((2, 2), 3e38, np.float32), X)
    with pytest.raises(ValueError, match=r"C overflowed float32 while adding X\^T Z.*float64 C"):
        fastls.cross_update(np.full((2, 2), 3e38, np.float32), X, X)
    G64 = np.full((2, 2), 3e38)  # a float64 accumulator holds the same sums
    fastls.gram_update(G64, X)
    np.testing.assert_allclose(np.triu(G64), np.triu(np.full((2, 2), 6e38)), rtol=1e-6)  # upper triangle
    # The solves: C + eps M, and the dual's X X^T.
    G, C = np.eye(3, dtype=np.float32), np.ones((3, 1), np.float32)
    M = np.full((3, 1), 0.5, np.float32)
    C_before = C.copy()
    with pytest.raises(ValueError, match=r"C \+ eps M overflows float32"):
        fastls.proximal_solve(G, C, 1e38, np.full((3, 1), 1e10, np.float32), overwrite_c=True)
    np.testing.assert_array_equal(C, C_before)
    with pytest.raises(ValueError, match=r"gamma must be at most 3.40282e\+38"):
        fastls.ridge_solve(G, C, 1e300)
    with pytest.raises(ValueError, match=r"eps must be at most 3.40282e\+38"):
        fastls.proximal_solve(G, C, 1e39, M)
    X = np.full((3, 5), 1e19, np.float32)
    X[1] *= -1
    with pytest.raises(ValueError, match="overflow float32"):
        fastls.proximal_solve_dual(X, np.ones((3, 2), np.float32), 1e38, np.zeros((5, 2), np.float32))


def test_proximal_solve_names_the_argument_that_is_wrong(rng):
    G, M = np.eye(3), np.ones((3, 2))
    with pytest.raises(TypeError, match="C must be a NumPy array, got list"):
        fastls.proximal_solve(G, [[1.0, 2.0]] * 3, 1.0, M)
    with pytest.raises(ValueError, match="C must be 2-dimensional"):
        fastls.proximal_solve(G, np.ones(3), 1.0, M)
    with pytest.raises(TypeError, match=r"M must be float32 or float64 and not wider than G \(float32\)"):
        fastls.proximal_solve(G.astype(np.float32), np.ones((3, 2), np.float32), 1.0, M)
    # float32 M with float64 G widens exactly: accepted.
    np.testing.assert_allclose(fastls.proximal_solve(G, np.zeros((3, 2)), 1.0, M.astype(np.float32)), 0.5 * M)


def test_a_failed_proximal_solve_leaves_the_right_hand_side_it_was_to_overwrite(rng):
    G = -np.eye(3)  # not a Gram matrix: G + eps I does not factor
    C, M = np.asfortranarray(random(rng, (3, 2), np.float64)), random(rng, (3, 2), np.float64)
    C_before = C.copy()
    with pytest.raises(np.linalg.LinAlgError, match="not positive definite"):
        fastls.proximal_solve(G, C, 1.0, M, overwrite_c=True)
    np.testing.assert_array_equal(C, C_before)
    # Solved in place it is the same W as without overwriting.
    G, C = spd_system(rng, 20, 3, 2, np.float64)
    C = np.asfortranarray(C)
    expected = fastls.proximal_solve(G, C, 1.0, M)
    np.testing.assert_array_equal(fastls.proximal_solve(G, C, 1.0, M, overwrite_c=True), expected)


def test_the_dual_names_its_own_system_when_it_does_not_factor(rng):
    X, Z = random(rng, (5, 3), np.float32), random(rng, (5, 2), np.float32)
    with pytest.raises(np.linalg.LinAlgError, match=r"X X\^T \+ eps I \(5 x 5, float32\).*Increase eps") as err:
        fastls.proximal_solve_dual(X, Z, 1e-10, random(rng, (3, 2), np.float32))
    assert "on_failure" not in str(err.value) and "G must" not in str(err.value)


def test_degenerate_ridge_paths_are_refused_or_solved(rng):
    with pytest.raises(ValueError, match="X has no rows"):
        fastls.RidgePath.from_rows(np.zeros((0, 4)), np.zeros((0, 2)))
    eigh = fastls.RidgePath.from_statistics(np.zeros((0, 0)), np.zeros((0, 2)), 1.0, 3, method="eigh").select()
    band = fastls.RidgePath.from_statistics(np.zeros((0, 0)), np.zeros((0, 2)), 1.0, 3, method="band").select()
    assert band[0] == eigh[0]
    X, labels = random(rng, (20, 5), np.float64), rng.integers(0, 3, 20)
    path = fastls.RidgePath.from_rows(X, np.eye(3)[labels])
    for outside in (7, 3):  # 3, the number of classes, is the first label outside
        with pytest.raises(ValueError, match=r"labels must be classes in \[0, 3\)"):
            path.select("loo_class", labels=np.where(labels == 0, outside, labels))


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), "0.5", None, True])
def test_scale_negatives_refuses_a_slope_that_is_not_a_finite_number(factor):
    x = np.array([-1.0, 2.0])
    with pytest.raises(ValueError, match="factor must be a finite number"):
        fastls.scale_negatives(x, factor)
    np.testing.assert_array_equal(x, [-1.0, 2.0])


def test_scale_negatives_refuses_a_slope_that_overflows_and_leaves_x(rng):
    x = np.array([-1e30, 2.0, -3.0], np.float32)
    with pytest.raises(ValueError, match="x \\* factor overflows float32"):
        fastls.scale_negatives(x, 1e10)
    with pytest.raises(ValueError, match="x \\* factor overflows float32"):
        fastls.scale_negatives(x, 1e300)  # a factor float32 cannot hold
    np.testing.assert_array_equal(x, np.array([-1e30, 2.0, -3.0], np.float32))
    fastls.scale_negatives(x, -1e5)  # steep but fits: applied
    np.testing.assert_allclose(x, [1e35, 2.0, 3e5], rtol=1e-6)
    y = np.array([-1e300, 1.0])
    fastls.scale_negatives(y, 0.01)  # a leaky ReLU's slope never overflows: no scan
    assert y[0] == pytest.approx(-1e298)


def test_small_argument_mistakes_get_errors_that_name_them(rng):
    images = random(rng, (2, 6, 6, 3), np.float32)
    W = random(rng, (27, 4), np.float32)
    with pytest.raises(ValueError, match="kernel_size must be an int or a pair of ints, got \\(3.7, 3\\)"):
        fastls.im2col(images, (3.7, 3))
    with pytest.raises(TypeError, match="out must be a NumPy array, got list"):
        fastls.conv2d(images, W, 3, out=[0.0])
    read_only = np.empty((2, 4, 4, 4), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        fastls.conv2d(images, W, 3, out=read_only)
    with pytest.raises(ValueError, match="scratch_bytes must be an integer >= 1, got None"):
        fastls.conv2d(images, W, 3, scratch_bytes=None)
    with pytest.raises(TypeError, match="G must be a NumPy array, got list"):
        fastls.symmetrize([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ValueError, match="rhs_basis contains NaN or Inf"):
        G, C = spd_system(rng, 20, 3, 4, np.float64)
        fastls.ridge_solve(G, C, 1.0, rhs_basis=np.full((2, 4), np.nan))
    with fastls.limit_cores(np.int64(1)):  # NumPy integers are integers
        pass


def test_a_read_only_g_is_copied_even_when_it_may_be_overwritten(rng):
    G, C = spd_system(rng, 300, 40, 3, np.float64)
    G.flags.writeable = False
    for method in ("eigh", "band"):
        path = fastls.RidgePath.from_statistics(G, C, 10.0, 300, overwrite_g=True, method=method)
        assert np.isfinite(path.select()[0])


def test_dimensions_beyond_blas_ints_are_refused_not_wrapped():
    # A zero-stride view: 2^31 rows of one value, no memory behind them.
    X = np.lib.stride_tricks.as_strided(np.ones(1, np.float32), shape=(2**31, 1), strides=(0, 0))
    G = np.zeros((1, 1), np.float64)
    with pytest.raises(ValueError, match=r"X has a dimension above 2\^31 - 1 \(shape \(2147483648, 1\)\)"):
        fastls.gram_update(G, X)
    assert G[0, 0] == 0.0
