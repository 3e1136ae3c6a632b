"""What the kernels refuse, and the paths only some inputs take (found by a mutation audit of fastls's tests)."""

import numpy as np
import pytest

import fastls
from numeric_checks import assert_close

F32_MAX = float(np.finfo(np.float32).max)


def test_same_dtype_gram_bounds_the_squares_over_all_rows_not_a_block(rng):
    """float32 into float32 sums all N rows in float32: block_rows does not split it."""
    X = np.full((20, 8), np.sqrt(F32_MAX / 10.0), dtype=np.float32)  # x^2 * 20 overflows, x^2 * 4 does not
    G = rng.standard_normal((8, 8)).astype(np.float32)
    before = G.copy()
    with pytest.raises(ValueError, match="overflow"):
        fastls.gram_update(G, X, block_rows=4)
    np.testing.assert_array_equal(G, before)


def test_cross_update_bounds_each_operand(rng):
    """X small and Z huge still overflow X^T Z: both operands must pass the bound."""
    X = np.full((10, 3), 10.0, dtype=np.float32)
    Z = np.full((10, 2), 1e37, dtype=np.float32)
    C = rng.standard_normal((3, 2)).astype(np.float32)
    before = C.copy()
    with pytest.raises(ValueError, match="overflow"):
        fastls.cross_update(C, X, Z)
    np.testing.assert_array_equal(C, before)


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


def _conv_problem(rng, dtype=np.float64, n=3, side=5, channels=2, filters=4):
    images = rng.standard_normal((n, side, side, channels)).astype(dtype)
    d = 9 * channels + 1
    return images, np.zeros((d, d)), np.zeros((d, filters))


def test_conv_stats_refuses_a_position_basis_of_the_wrong_width_or_with_nan(rng):
    images, G, C = _conv_problem(rng)
    basis = rng.standard_normal((3, 3, 10, C.shape[1] + 1))
    with pytest.raises(ValueError, match="position_basis"):
        fastls.ConvStats(G, C, images.shape[1:], 3, append_ones=True, position_basis=basis)
    basis = rng.standard_normal((3, 3, 10, C.shape[1]))
    basis[1, 2, 3, 0] = np.nan
    with pytest.raises(ValueError, match="position_basis"):
        fastls.ConvStats(G, C, images.shape[1:], 3, append_ones=True, position_basis=basis)


def test_conv_stats_refuses_nan_targets_and_g_c_of_two_dtypes(rng):
    images, G, C = _conv_problem(rng)
    targets = rng.standard_normal((3, 3, 3, C.shape[1]))
    targets[2, 1, 0, 3] = np.nan
    stats = fastls.ConvStats(G, C, images.shape[1:], 3, append_ones=True, per_image_targets=False)
    with pytest.raises(ValueError, match="targets"):
        stats.update(images, targets)
    np.testing.assert_array_equal(G, 0.0)  # refused before any product
    np.testing.assert_array_equal(C, 0.0)
    with pytest.raises(TypeError, match="share a dtype"):
        fastls.ConvStats(G, C.astype(np.float32), images.shape[1:], 3, append_ones=True)


def test_conv_stats_bounds_products_over_every_patch_row_of_the_batch(rng):
    """2 images of 6 x 6 with a 3x3 kernel: 32 patch rows. x^2 * 2 fits float32, x^2 * 32 does not."""
    images = np.full((2, 6, 6, 1), np.sqrt(F32_MAX / 8.0), dtype=np.float32)
    G, C = np.zeros((10, 10)), np.zeros((10, 2))
    targets = np.ones((2, 2), dtype=np.float32)
    with pytest.raises(ValueError, match="overflow"):
        fastls.ConvStats(G, C, (6, 6, 1), 3, append_ones=True).update(images, targets)
    np.testing.assert_array_equal(G, 0.0)


def _factored_reference(images, targets, basis):
    P = fastls.im2col(images, 3, append_ones=True)
    T = np.einsum("nk,yxkm->nyxm", targets, basis).reshape(-1, basis.shape[3])
    return P.T @ P, P.T @ T


def test_conv_stats_factored_targets_over_small_blocks_and_two_finishes(rng):
    """Per-position targets in factored form: blocks of 3 images over 7, then a second finish on new images."""
    images = rng.standard_normal((7, 5, 5, 2))
    more = rng.standard_normal((4, 5, 5, 2))
    targets, more_targets = rng.standard_normal((7, 6)), rng.standard_normal((4, 6))
    basis = rng.standard_normal((3, 3, 6, 4))
    G, C = np.zeros((19, 19)), np.zeros((19, 4))
    stats = fastls.ConvStats(G, C, (5, 5, 2), 3, append_ones=True, block_rows=3, position_basis=basis)
    stats.update(images, targets)
    stats.finish()
    G_ref, C_ref = _factored_reference(images, targets, basis)
    assert_close(np.triu(G), np.triu(G_ref), np.float64, 63)
    assert_close(C, C_ref, np.float64, 63)
    stats.update(more, more_targets)
    stats.finish()
    G_more, C_more = _factored_reference(more, more_targets, basis)
    assert_close(C, C_ref + C_more, np.float64, 99)
    assert_close(np.triu(G), np.triu(G_ref + G_more), np.float64, 99)


def test_proximal_solves_refuse_nan_in_every_operand(rng):
    X, Z, M = rng.standard_normal((5, 8)), rng.standard_normal((5, 3)), rng.standard_normal((8, 3))
    G, C = X.T @ X, X.T @ Z
    bad_M = M.copy()
    bad_M[4, 1] = np.nan
    with pytest.raises(ValueError, match="M"):
        fastls.proximal_solve(G, C, 2.0, bad_M)
    for name, (X_, Z_, M_) in (("X", (np.where(X > 1, np.nan, X), Z, M)), ("Z", (X, np.where(Z > 1, np.inf, Z), M)),
                               ("M", (X, Z, bad_M))):
        with pytest.raises(ValueError, match=name):
            fastls.proximal_solve_dual(X_, Z_, 2.0, M_)


def test_proximal_solve_adds_eps_m_on_the_eigh_fallback(rng):
    """G + eps I indefinite: on_failure='eigh' solves C + eps M on G + eps I's positive eigenvalues."""
    d = 6
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    G = V @ np.diag([5.0, 3.0, 2.0, 1.0, 0.5, -4.0]) @ V.T  # not a Gram matrix: one negative eigenvalue
    C, M = rng.standard_normal((d, 2)), rng.standard_normal((d, 2))
    with pytest.warns(RuntimeWarning, match="eigh"):
        W = fastls.proximal_solve(G, C, 1.0, M, on_failure="eigh")
    shifted = np.array([5.0, 3.0, 2.0, 1.0, 0.5, -4.0]) + 1.0
    inverse = np.where(shifted > 0, 1.0 / shifted, 0.0)
    assert_close(W, V @ np.diag(inverse) @ V.T @ (C + 1.0 * M), np.float64, rtol=1e-10)


def test_solves_leave_read_only_inputs_alone_when_told_they_may_overwrite(rng):
    X = rng.standard_normal((30, 5))
    G, C = X.T @ X, np.asfortranarray(X.T @ rng.standard_normal((30, 2)))
    G.flags.writeable = False
    C.flags.writeable = False
    expected = np.linalg.solve(G + 3.0 * np.eye(5), C)
    W = fastls.ridge_solve(G, C, 3.0, overwrite_g=True, overwrite_c=True)
    assert_close(W, expected, np.float64, rtol=1e-12)
    assert_close(G, X.T @ X, np.float64, rtol=0)


def test_dual_solve_over_many_row_slices_equals_the_primal(rng, monkeypatch):
    """The dual's products run over row slices of DEFAULT_SCRATCH_BYTES; slices of 3 rows over 10."""
    import fastls._core

    monkeypatch.setattr(fastls._core, "DEFAULT_SCRATCH_BYTES", 3 * 12 * 8)
    X, Z, M = rng.standard_normal((10, 12)), rng.standard_normal((10, 3)), rng.standard_normal((12, 3))
    W = fastls.proximal_solve_dual(X, Z, 2.0, M)
    assert_close(W, np.linalg.solve(X.T @ X + 2.0 * np.eye(12), X.T @ Z + 2.0 * M), np.float64, rtol=1e-10)


def test_upper_triangle_check_reads_a_fortran_gs_diagonal(rng):
    X = rng.standard_normal((20, 4))
    G = np.asfortranarray(X.T @ X)
    G[2, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        fastls.ridge_solve(G, np.ones((4, 1), order="F"), 1.0)


def test_conv2d_refuses_an_out_that_is_not_c_contiguous(rng):
    images, W = rng.standard_normal((2, 5, 5, 3)), rng.standard_normal((27, 4))
    out = np.zeros((2, 3, 3, 4), order="F")
    with pytest.raises(ValueError, match="C-contiguous"):
        fastls.conv2d(images, W, 3, out=out)


def test_ridge_path_refuses_nan_in_rows_statistics_and_center(rng):
    X = rng.standard_normal((10, 3))
    X[4, 1] = np.nan
    with pytest.raises(ValueError, match="X contains NaN"):
        fastls.RidgePath.from_rows(X, np.ones((10, 1)))
    with pytest.raises(ValueError, match="Z contains NaN"):
        fastls.RidgePath.from_rows(np.ones((10, 3)), np.full((10, 1), np.nan))
    with pytest.raises(ValueError, match="C contains NaN"):
        fastls.RidgePath.from_statistics(np.eye(3), np.full((3, 1), np.nan), 1.0, 5)
    with pytest.raises(ValueError, match="center contains NaN"):
        fastls.RidgePath.from_statistics(np.eye(3), np.ones((3, 1)), 1.0, 5, center=np.full((3, 1), np.nan))
    G = np.asfortranarray(np.eye(4) * 3.0)
    G[2, 2] = np.nan
    with pytest.raises(ValueError, match="G contains NaN"):
        fastls.RidgePath.from_statistics(G, np.ones((4, 1)), 1.0, 20)


def test_ridge_path_centered_reads_only_the_upper_triangle(rng):
    X, Z, M = rng.standard_normal((30, 5)), rng.standard_normal((30, 2)), rng.standard_normal((5, 2))
    zz = float((Z ** 2).sum())
    full = fastls.RidgePath.from_statistics(X.T @ X, X.T @ Z, zz, 30, center=M, method="eigh")
    upper = fastls.RidgePath.from_statistics(np.triu(X.T @ X), X.T @ Z, zz, 30, center=M, method="eigh")
    assert_close(upper.solve(1.0), full.solve(1.0), np.float64, rtol=1e-10)
    assert_close(upper.gcv([1.0]), full.gcv([1.0]), np.float64, rtol=1e-10)


def test_loo_class_refuses_a_label_equal_to_the_number_of_classes(rng):
    X, labels = rng.standard_normal((20, 5)), rng.integers(0, 3, 20)
    path = fastls.RidgePath.from_rows(X, np.eye(3)[labels])
    with pytest.raises(ValueError, match="labels must be classes"):
        path.loo_errors([1.0], np.where(labels == 0, 3, labels))


def test_zeroing_recycled_memory_stays_within_the_core_limit(monkeypatch):
    from fastls import _workspace

    monkeypatch.setattr(_workspace, "PARALLEL_ZERO_BYTES", 1024)
    spans = []
    real = _workspace.run_spans
    monkeypatch.setattr(_workspace, "run_spans", lambda fn, parts: (spans.append(len(parts)), real(fn, parts))[1])
    fastls.recycled_array("refusals-test", (97, 53))
    with fastls.limit_cores(1):
        fastls.recycled_array("refusals-test", (97, 53))
    _workspace.release()
    assert spans == []  # one core: zeroed in place, never split over threads


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
