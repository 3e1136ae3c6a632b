"""Convolution statistics from the overlap of patches against im2col in float64."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastls
from fastls._overlap import _overlap_plan
from tests.numeric_checks import assert_close


def reference(images, targets, kernel_size, padding, append_ones):
    """(P^T P, P^T T) in float64 through fastls.im2col (itself checked against a loop reference)."""
    P = fastls.im2col(images.astype(np.float64), kernel_size, padding=padding, append_ones=append_ones)
    per_image = P.shape[0] // images.shape[0]
    T = np.repeat(targets.astype(np.float64), per_image, axis=0)
    return P.T @ P, P.T @ T


def per_position_reference(images, coordinates, basis, kernel_size, padding, append_ones):
    """(P^T P, P^T T) with T's row at (n, y, x) = coordinates[n] @ basis[y, x], written out per position."""
    P = fastls.im2col(images, kernel_size, padding=padding, append_ones=append_ones)
    T = np.einsum("nk,yxkm->nyxm", coordinates, basis).reshape(-1, basis.shape[3])
    return P.T @ P, P.T @ T


def assert_exact(G, C, G_ref, C_ref):
    """The issue's bound: relative error <= 1e-12 against im2col in float64 (G's upper triangle)."""
    assert_close(np.triu(G), np.triu(G_ref), np.float64, rtol=1e-12)
    assert_close(C, C_ref, np.float64, rtol=1e-12)


geometry = st.tuples(
    st.integers(1, 6),                       # batch
    st.integers(1, 9), st.integers(1, 9),    # kernel height, width
    st.integers(0, 6), st.integers(0, 6),    # extra rows, columns beyond the kernel
    st.integers(0, 2), st.integers(0, 2),    # padding
    st.integers(1, 7),                       # channels
    st.booleans(),                           # bias column
    st.sampled_from(["C", "F"]),             # G layout
)


def draw_images(shape, seed):
    """(rng, images, (kh, kw, ph, pw, bias, G order)) for a drawn geometry, or None when the kernel does not fit."""
    B, kh, kw, extra_h, extra_w, ph, pw, channels, bias, order = shape
    H, W = max(1, kh + extra_h - 2 * ph), max(1, kw + extra_w - 2 * pw)
    if H + 2 * ph < kh or W + 2 * pw < kw:
        return None
    rng = np.random.default_rng(seed)
    return rng, rng.standard_normal((B, H, W, channels)), (kh, kw, ph, pw, bias, order)


def draw_problem(shape, seed, m, dtype=np.float64):
    """(rng, images, targets (B, m), geometry, G_ref, C_ref) in ``dtype`` for a drawn geometry, or None."""
    drawn = draw_images(shape, seed)
    if drawn is None:
        return None
    rng, images, (kh, kw, ph, pw, bias, order) = drawn
    images = images.astype(dtype)
    targets = rng.standard_normal((len(images), m)).astype(dtype)
    return (rng, images, targets, (kh, kw, ph, pw, bias, order),
            *reference(images, targets, (kh, kw), (ph, pw), bias))


@settings(max_examples=60, deadline=None)
@given(geometry, st.integers(0, 2**31 - 1))
def test_overlap_equals_im2col_float64(shape, seed):
    drawn = draw_problem(shape, seed, 3)
    if drawn is None:
        return
    rng, images, targets, (kh, kw, ph, pw, bias, order), G_ref, C_ref = drawn
    d = G_ref.shape[0]
    G0 = np.asarray(rng.standard_normal((d, d)), order=order)
    C0 = rng.standard_normal((d, 3))
    G, C = G0.copy(order=order), C0.copy()
    fastls.conv_gram_update(G, C, images, targets, (kh, kw), padding=(ph, pw), append_ones=bias, method="overlap")
    assert_exact(G - G0, C - C0, G_ref, C_ref)
    # The strict lower triangle is never written.
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))


@settings(max_examples=40, deadline=None)
@given(geometry, st.integers(0, 2**31 - 1), st.sampled_from(["overlap", "auto"]), st.data())
def test_batches_in_any_split_equal_im2col_float64(shape, seed, method, data):
    """Statistics accumulated over several update calls (products kept per group between them), exactly."""
    drawn = draw_problem(shape, seed, 2)
    if drawn is None:
        return
    _, images, targets, (kh, kw, ph, pw, bias, order), G_ref, C_ref = drawn
    B = len(images)
    cuts = sorted(data.draw(st.sets(st.integers(1, B - 1), max_size=B - 1)) if B > 1 else set())
    d = G_ref.shape[0]
    G, C = np.zeros((d, d), order=order), np.zeros((d, 2))
    with fastls.ConvStats(G, C, images.shape[1:], (kh, kw), padding=(ph, pw), append_ones=bias,
                          method=method) as stats:
        for start, stop in zip([0, *cuts], [*cuts, B]):
            stats.update(images[start:stop], targets[start:stop])
    assert_exact(G, C, G_ref, C_ref)


@settings(max_examples=60, deadline=None)
@given(geometry, st.integers(0, 2**31 - 1), st.sampled_from([np.float32, np.float64]),
       st.sampled_from(["overlap", "im2col", "auto"]), st.sampled_from([1, 3, 4096]), st.integers(1, 5))
def test_float32_images_equal_im2col_in_float64(shape, seed, g_dtype, method, block_rows, m):
    """float32 data, into float32 or float64 G: the float32 tolerance over the rows of each sum."""
    drawn = draw_problem(shape, seed, m, np.float32)
    if drawn is None:
        return
    _, images, targets, (kh, kw, ph, pw, bias, order), G_ref, C_ref = drawn
    d = G_ref.shape[0]
    G, C = np.zeros((d, d), g_dtype, order=order), np.zeros((d, m), g_dtype)
    fastls.conv_gram_update(G, C, images, targets, (kh, kw), padding=(ph, pw), append_ones=bias, method=method,
                            block_rows=block_rows)
    rows = fastls.im2col(images, (kh, kw), padding=(ph, pw)).shape[0]  # terms of each sum
    assert_close(np.triu(G), np.triu(G_ref), np.float32, rows)
    assert_close(C, C_ref, np.float32, rows)


@pytest.mark.parametrize("g_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block_rows", [3, 4096])
def test_overlap_float32_images(rng, g_dtype, block_rows):
    images = rng.standard_normal((7, 8, 6, 5)).astype(np.float32)
    targets = rng.standard_normal((7, 4)).astype(np.float32)
    G_ref, C_ref = reference(images, targets, 3, 1, True)
    d = G_ref.shape[0]
    G, C = np.zeros((d, d), g_dtype), np.zeros((d, 4), g_dtype)
    fastls.conv_gram_update(G, C, images, targets, 3, padding=1, append_ones=True, method="overlap",
                            block_rows=block_rows)
    # float32 products: the float32 tolerance over at most one image's worth of rows per term.
    n_terms = 7 * 8 * 6 if g_dtype == np.float32 else min(block_rows, 7 * 8 * 6)
    assert_close(np.triu(G), np.triu(G_ref), np.float32, n_terms)
    assert_close(C, C_ref, np.float32, n_terms)


@pytest.mark.parametrize("method", ["im2col", "overlap"])
@pytest.mark.parametrize("g_dtype", [np.float32, np.float64])
def test_strict_lower_triangle_is_never_written(rng, method, g_dtype):
    # the secure sums and the MPI transport send G's upper triangle only: the lower one must stay as it was
    images = rng.standard_normal((5, 7, 6, 3)).astype(np.float32)
    d = 3 * 3 * 3 + 1
    G0 = np.tril(rng.standard_normal((d, d)), -1).astype(g_dtype)
    G, C = G0.copy(), np.zeros((d, 2), g_dtype)
    with fastls.ConvStats(G, C, (7, 6, 3), 3, padding=1, append_ones=True, method=method, block_rows=16) as stats:
        stats.update(images[:2], rng.standard_normal((2, 2)).astype(np.float32))
        stats.update(images[2:], rng.standard_normal((3, 2)).astype(np.float32))
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(G0, -1))
    assert np.abs(np.triu(G)).max() > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batches_through_conv_stats_equal_one_call(rng, dtype):
    images = rng.standard_normal((11, 7, 7, 4)).astype(dtype)
    targets = rng.standard_normal((11, 2)).astype(dtype)
    d = 9 * 4 + 1
    G1, C1 = np.zeros((d, d)), np.zeros((d, 2))
    fastls.conv_gram_update(G1, C1, images, targets, 3, append_ones=True, method="overlap")
    G2, C2 = np.zeros((d, d)), np.zeros((d, 2))
    with fastls.ConvStats(G2, C2, (7, 7, 4), 3, append_ones=True, method="overlap", block_rows=10) as stats:
        for start, stop in [(0, 1), (1, 5), (5, 11)]:
            stats.update(images[start:stop], targets[start:stop])
    assert_close(np.triu(G2), np.triu(G1), dtype, 11 * 25)
    assert_close(C2, C1, dtype, 11 * 25)


def test_small_scratch_takes_one_image_at_a_time(rng):
    images, targets = rng.standard_normal((5, 6, 6, 3)), rng.standard_normal((5, 2))
    G_ref, C_ref = reference(images, targets, 3, 0, True)
    d = G_ref.shape[0]
    with pytest.raises(ValueError, match="need at least") as err:
        fastls.conv_gram_update(np.zeros((d, d)), np.zeros((d, 2)), images, targets, 3, append_ones=True,
                                method="overlap", scratch_bytes=64)
    need = int(str(err.value).rsplit(" ", 1)[-1])
    G, C = np.zeros((d, d)), np.zeros((d, 2))
    fastls.conv_gram_update(G, C, images, targets, 3, append_ones=True, method="overlap", scratch_bytes=need)
    assert_exact(G, C, G_ref, C_ref)
    with pytest.raises(ValueError, match="need at least"):
        fastls.conv_gram_update(G, C, images, targets, 3, append_ones=True, method="overlap",
                                scratch_bytes=need - 1)


@pytest.mark.parametrize("side,channels,kernel", [(14, 512, 3), (6, 1024, 3), (4, 2048, 3), (32, 3, 5)])
def test_cost_model_of_the_paper_layers(side, channels, kernel):
    im2col, overlap = fastls.tuning.conv_stats_cost((side, side, channels), kernel)
    out = side - kernel + 1
    assert im2col == out * out * (kernel * kernel * channels) ** 2 / 2
    # Sum over the displacements of the area their products cover (the diagonal at half cost).
    areas = sum((side - dy) * (side - abs(dx)) for dy in range(kernel) for dx in range(-kernel + 1, kernel)
                if dy > 0 or dx > 0) + side * side / 2
    assert overlap == pytest.approx(areas * channels ** 2)


def test_auto_picks_overlap_where_it_pays():
    for shape, expected in [((14, 14, 512), "overlap"), ((6, 6, 1024), "overlap"), ((4, 4, 2048), "overlap"),
                            ((32, 32, 3), "im2col"), ((14, 14, 8), "im2col")]:
        assert fastls._overlap._pick_conv_method("auto", shape, (3, 3), (1, 1), (0, 0), True) == expected
    assert fastls._overlap._pick_conv_method("auto", (14, 14, 512), (3, 3), (2, 2), (0, 0), True) == "im2col"
    # Knowing the images per finish, the one pass over G decides on the small maps (measured on
    # 2026-11-28 with the finish that reads each product once: 32 images of 4x4x2048 take 0.41 s by
    # overlap against 0.35 s by im2col, 64 0.52 against 0.53, 100 0.65 against 0.74; on 6x6x1024, 16
    # images 0.156 against 0.128, 32 0.195 against 0.216, 48 0.24 against 0.30).
    assert fastls.tuning.conv_stats_method((4, 4, 2048), 3, images=4) == "im2col"
    assert fastls.tuning.conv_stats_method((4, 4, 2048), 3, images=32) == "im2col"
    assert fastls.tuning.conv_stats_method((4, 4, 2048), 3, images=100) == "overlap"
    assert fastls.tuning.conv_stats_method((4, 4, 2048), 3, images=450) == "overlap"
    assert fastls.tuning.conv_stats_method((6, 6, 1024), 3, images=16) == "im2col"
    assert fastls.tuning.conv_stats_method((6, 6, 1024), 3, images=32) == "overlap"
    assert fastls.tuning.conv_stats_method((6, 6, 1024), 3, images=64) == "overlap"
    assert fastls.tuning.conv_stats_method((14, 14, 512), 3, images=16) == "overlap"
    assert fastls._overlap._pick_conv_method("auto", (14, 14, 512), (3, 3), (1, 1), (0, 0), False) == "im2col"


def test_no_target_columns_still_give_the_gram(rng):
    """m = 0 per-position targets: the Gram alone (before, a reshape of the empty targets failed)."""
    x = rng.standard_normal((2, 5, 5, 1))
    G, C = np.zeros((10, 10)), np.zeros((10, 0))
    stats = fastls.ConvStats(G, C, (5, 5, 1), 3, append_ones=True, per_image_targets=False, method="im2col")
    stats.update(x, np.zeros((2, 3, 3, 0)))
    stats.finish()
    P = fastls.im2col(x, 3, append_ones=True).reshape(-1, 10)
    np.testing.assert_allclose(np.triu(G), np.triu(P.T @ P), rtol=1e-12)


def test_overlap_refuses_what_it_cannot_do(rng):
    G, C = np.zeros((37, 37)), np.zeros((37, 2))
    images = rng.standard_normal((2, 7, 7, 4))
    with pytest.raises(ValueError, match="stride 1 and per-image targets"):
        fastls.conv_gram_update(G, C, images, rng.standard_normal((2, 2)), 3, stride=2, append_ones=True,
                                method="overlap")
    with pytest.raises(ValueError, match="stride 1 and per-image targets"):
        fastls.conv_gram_update(G, C, images, rng.standard_normal((2, 5, 5, 2)), 3, append_ones=True,
                                method="overlap")
    with pytest.raises(ValueError, match="method must be one of"):
        fastls.conv_gram_update(G, C, images, rng.standard_normal((2, 2)), 3, append_ones=True, method="fft")
    with pytest.raises(TypeError, match="G and C must share a dtype"):
        fastls.ConvStats(G, C.astype(np.float32), (7, 7, 4), 3, append_ones=True)
    np.testing.assert_array_equal(G, 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_refused_batch_leaves_running_statistics_untouched(rng, bad):
    images, targets = rng.standard_normal((3, 6, 6, 4)), rng.standard_normal((3, 2))
    d = 37
    G, C = np.zeros((d, d)), np.zeros((d, 2))
    stats = fastls.ConvStats(G, C, (6, 6, 4), 3, append_ones=True, method="overlap")
    stats.update(images[:2], targets[:2])
    broken = images[2:].copy()
    broken[0, 3, 1, 2] = bad
    with pytest.raises(ValueError, match="images contains NaN or Inf"):
        stats.update(broken, targets[2:])
    broken_targets = targets[2:].copy()
    broken_targets[0, 1] = bad
    with pytest.raises(ValueError, match="targets contains NaN or Inf"):
        stats.update(images[2:], broken_targets)
    with pytest.raises(ValueError, match=r"images must have shape \(B, 6, 6, 4\)"):
        stats.update(images[:, :5], targets)
    with pytest.raises(TypeError, match="keep the dtype of the first batch"):
        stats.update(images.astype(np.float32), targets.astype(np.float32))
    stats.finish()
    G_ref, C_ref = reference(images[:2], targets[:2], 3, 0, True)
    assert_exact(G, C, G_ref, C_ref)


def test_plan_covers_every_block_once_per_cell():
    # Each block (a, b) of the patch Gram must receive exactly the cells of window(a).
    for kh, kw, out_h, out_w in [(3, 3, 12, 12), (3, 3, 2, 2), (5, 5, 28, 28), (2, 4, 1, 3)]:
        groups, cells, blocks, _, _ = _overlap_plan(kh, kw, out_h, out_w)
        covered = {}
        for dy, dx, c0, c1, b0, b1 in groups:
            area = sum((y1 - y0) * (x1 - x0) for y0, y1, x0, x1 in cells[c0:c1])
            for a, b in blocks[b0:b1]:
                assert b - a == dy * kw + dx
                covered[(a, b)] = covered.get((a, b), 0) + area
        for a in range(kh * kw):
            for b in range(a, kh * kw):
                dy, dx = b // kw - a // kw, b % kw - a % kw
                assert covered.get((a, b)) == out_h * out_w, (kh, kw, a, b, dy, dx)


@settings(max_examples=40, deadline=None)
@given(geometry, st.integers(1, 4), st.sampled_from(["overlap", "im2col"]), st.integers(0, 2**31 - 1))
def test_position_basis_equals_explicit_per_position_targets(shape, k, method, seed):
    """Targets u_n @ B_(y,x), given as coordinates and a basis, equal those targets written out per position."""
    drawn = draw_images(shape, seed)
    if drawn is None:
        return
    rng, images, (kh, kw, ph, pw, bias, order) = drawn
    B, H, W, channels = images.shape
    coordinates = rng.standard_normal((B, k))
    out_h, out_w = fastls.conv_output_shape((H, W), (kh, kw), padding=(ph, pw))
    basis = rng.standard_normal((out_h, out_w, k, 3))
    G_ref, C_ref = per_position_reference(images, coordinates, basis, (kh, kw), (ph, pw), bias)
    d = G_ref.shape[0]
    G, C = np.zeros((d, d), order=order), np.zeros((d, 3))
    halves = [slice(0, B // 2), slice(B // 2, B)]
    with fastls.ConvStats(G, C, (H, W, channels), (kh, kw), padding=(ph, pw), append_ones=bias, method=method,
                          position_basis=basis) as stats:
        for half in halves:
            stats.update(images[half], coordinates[half])
    assert_exact(G, C, G_ref, C_ref)


def test_position_basis_over_small_blocks_and_two_finishes(rng):
    """Factored targets in blocks of 3 images over 7, then a second finish on new images (sums restarted)."""
    images, more = rng.standard_normal((7, 5, 5, 2)), rng.standard_normal((4, 5, 5, 2))
    coordinates, more_coordinates = rng.standard_normal((7, 6)), rng.standard_normal((4, 6))
    basis = rng.standard_normal((3, 3, 6, 4))
    G, C = np.zeros((19, 19)), np.zeros((19, 4))
    stats = fastls.ConvStats(G, C, (5, 5, 2), 3, append_ones=True, block_rows=3, position_basis=basis)
    stats.update(images, coordinates)
    stats.finish()
    G_ref, C_ref = per_position_reference(images, coordinates, basis, 3, 0, True)
    assert_exact(G, C, G_ref, C_ref)
    stats.update(more, more_coordinates)
    stats.finish()
    G_more, C_more = per_position_reference(more, more_coordinates, basis, 3, 0, True)
    assert_exact(G, C, G_ref + G_more, C_ref + C_more)


def test_position_basis_keeps_the_overlap_and_checks_its_shape(rng):
    images = rng.standard_normal((3, 14, 14, 32))
    basis = rng.standard_normal((12, 12, 10, 8))
    d = 9 * 32 + 1
    G, C = np.zeros((d, d)), np.zeros((d, 8))
    stats = fastls.ConvStats(G, C, (14, 14, 32), 3, append_ones=True, position_basis=basis)
    assert stats.method == "overlap"
    with pytest.raises(ValueError, match=r"targets must have shape \(3, 10\)"):
        stats.update(images, rng.standard_normal((3, 8)))
    with pytest.raises(ValueError, match=r"position_basis must have shape \(12, 12, k, 8\)"):
        fastls.ConvStats(G, C, (14, 14, 32), 3, append_ones=True, position_basis=basis[:-1])
    with pytest.raises(ValueError, match=r"position_basis must have shape \(12, 12, k, 8\)"):
        fastls.ConvStats(G, C, (14, 14, 32), 3, append_ones=True, position_basis=basis[..., :-1])
    broken = basis.copy()
    broken[1, 2, 3, 0] = np.nan
    with pytest.raises(ValueError, match="position_basis contains NaN or Inf"):
        fastls.ConvStats(G, C, (14, 14, 32), 3, append_ones=True, position_basis=broken)
    with pytest.raises(ValueError, match="per_image_targets must be True"):
        fastls.ConvStats(G, C, (14, 14, 32), 3, per_image_targets=False, append_ones=True, position_basis=basis)


@pytest.mark.parametrize("images_dtype,g_dtype,block_rows", [(np.float64, np.float64, 4096),
                                                             (np.float32, np.float64, 3),
                                                             (np.float32, np.float32, 4096)])
def test_recycled_products_never_leak_into_the_next_statistics(rng, images_dtype, g_dtype, block_rows):
    # The per-group products reuse the memory of the previous ConvStats and are never zeroed:
    # a group's first product (after a fold, with block_rows=3) must overwrite its slot.
    first, second = (rng.standard_normal((4, 7, 6, 3)).astype(images_dtype) for _ in range(2))
    targets = [rng.standard_normal((4, 2)).astype(images_dtype) for _ in range(2)]
    d = 9 * 3 + 1

    def stats_of(images, z):
        G, C = np.zeros((d, d), g_dtype), np.zeros((d, 2), g_dtype)
        with fastls.ConvStats(G, C, (7, 6, 3), 3, padding=1, append_ones=True, method="overlap",
                              block_rows=block_rows) as stats:
            stats.update(images[:1], z[:1])
            stats.update(images[1:], z[1:])
        return G, C

    stats_of(first, targets[0])
    # Left unfinished: its groups hold rows, so the next statistics must not take them as zero.
    abandoned = fastls.ConvStats(np.zeros((d, d), g_dtype), np.zeros((d, 2), g_dtype), (7, 6, 3), 3, padding=1,
                                 append_ones=True, method="overlap", block_rows=block_rows)
    abandoned.update(first[:1], targets[0][:1])
    del abandoned
    for _ in range(2):  # after the unfinished one, then after a finished one (products zeroed in cache)
        G, C = stats_of(second, targets[1])
        G_ref, C_ref = reference(second, targets[1], 3, 1, True)
        n_terms = 4 * 7 * 6
        # The products are formed in the images' dtype.
        assert_close(np.triu(G), np.triu(G_ref), images_dtype, n_terms)
        assert_close(C, C_ref, images_dtype, n_terms)


@pytest.mark.parametrize("block_rows", [3, 4096])
def test_finished_statistics_leave_their_products_zeroed_and_marked(rng, block_rows):
    # The fold (block_rows=3) and the finish zero each product as they read it, so the next
    # statistics of the same shape may accumulate into it without BLAS zeroing it first.
    from fastls._overlap import _group_products, _overlap_plan
    images = rng.standard_normal((4, 7, 6, 3)).astype(np.float32)
    d = 9 * 3 + 1
    G, C = np.zeros((d, d)), np.zeros((d, 2))
    fastls.conv_gram_update(G, C, images, rng.standard_normal((4, 2)).astype(np.float32), 3, padding=1,
                            append_ones=True, method="overlap", block_rows=block_rows)
    n_groups = len(_overlap_plan(3, 3, 7, 6)[0])
    products, clean = _group_products((n_groups, 3, 3), np.float32)
    assert clean.all()
    np.testing.assert_array_equal(products, 0)


def test_statistics_in_flight_together_keep_their_own_products(rng):
    images = [rng.standard_normal((3, 6, 6, 4)) for _ in range(2)]
    targets = [rng.standard_normal((3, 2)) for _ in range(2)]
    d = 9 * 4 + 1
    out = [(np.zeros((d, d)), np.zeros((d, 2))) for _ in range(2)]
    running = [fastls.ConvStats(G, C, (6, 6, 4), 3, append_ones=True, method="overlap") for G, C in out]
    for part in (slice(0, 1), slice(1, 3)):
        for stats, x, z in zip(running, images, targets):
            stats.update(x[part], z[part])
    for stats in running:
        stats.finish()
    for (G, C), x, z in zip(out, images, targets):
        assert_exact(G, C, *reference(x, z, 3, 0, True))


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("images_dtype", [np.float32, np.float64])
def test_blocks_assembled_by_two_threads_equal_one_thread_bit_for_bit(rng, order, images_dtype):
    images = rng.standard_normal((5, 9, 8, 6)).astype(images_dtype)
    targets = rng.standard_normal((5, 3)).astype(images_dtype)
    d = 9 * 6 + 1
    if fastls.available_cores() < 2:
        pytest.skip("one core: the blocks cannot be split over two threads here")
    results = []
    previous = fastls.tuning.set_flops_per_thread(0)  # every kernel at the caller's limit, however small
    try:
        for cores in (1, 2):
            G, C = np.zeros((d, d), order=order), np.zeros((d, 3))
            with fastls.limit_cores(cores):
                assert fastls.tuning.threads_for(1.0) == cores
                fastls.conv_gram_update(G, C, images, targets, 3, append_ones=True, method="overlap")
            results.append(G)
    finally:
        fastls.tuning.set_flops_per_thread(previous)
    np.testing.assert_array_equal(results[0], results[1])
    G_ref, _ = reference(images, targets, 3, 0, True)
    assert_close(np.triu(results[0]), np.triu(G_ref), images_dtype, 5 * 6 * 7)


def test_overlap_float32_sums_never_span_more_than_block_rows():
    """2895^2 is odd and near 2^23: float32 sums of two such squares are exact, of three are not."""
    images = np.full((2, 1, 3, 1), 2895.0, np.float32)
    G, C = np.zeros((1, 1)), np.zeros((1, 1))
    with fastls.ConvStats(G, C, (1, 3, 1), 1, method="overlap", block_rows=2) as stats:
        stats.update(images[:1], np.ones((1, 1), np.float32))
        stats.update(images[1:], np.ones((1, 1), np.float32))
    assert G[0, 0] == 6 * 2895.0 ** 2


def test_overlap_folds_never_write_below_the_diagonal_of_a_fortran_g(rng):
    """Recycled products of an abandoned C-ordered statistic must not leak into a Fortran G's lower triangle."""
    images = rng.standard_normal((4, 7, 6, 3)).astype(np.float32)
    targets = rng.standard_normal((4, 2)).astype(np.float32)
    abandoned = fastls.ConvStats(np.zeros((28, 28)), np.zeros((28, 2)), (7, 6, 3), 3, padding=1, append_ones=True,
                                 method="overlap")
    abandoned.update(images[:1], targets[:1])
    del abandoned
    lower = np.asfortranarray(np.tril(rng.standard_normal((28, 28)), -1))
    G = lower.copy(order="F")
    with fastls.ConvStats(G, np.zeros((28, 2)), (7, 6, 3), 3, padding=1, append_ones=True, method="overlap",
                          block_rows=3) as stats:
        stats.update(images, targets)
    np.testing.assert_array_equal(np.tril(G, -1), np.tril(lower, -1))
