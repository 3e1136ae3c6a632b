"""Factored uploads (F = U X, U Z behind a secret rotation) and the server's dual solve of wide layers."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastls
from fedlayer.algorithms import ALGORITHMS
from fedlayer.client import Client, target_bases
from fedlayer.models import build_model
from fedlayer.options import BatchPolicy, ClientOptions, ServerOptions
from fedlayer.rotation import haar_orthogonal, secret_normals
from fedlayer.run import RunConfig, run
from fedlayer.secure import SecureServer
from fedlayer.secure_client import SecureClient
from fedlayer.server import ModelLayers, Variant, run_protocol
from fedlayer.server.solvers import (DualSolve, FactoredRows, RowStack, _column_blocks,
                                     choose_solver, dual_bytes, dual_gram, primal_bytes, solve_form)
from fedlayer.transport import InProcessTransport
from tests.fedlayer.cases import N_CLASSES, client_data
from tests.numeric_checks import assert_close

FEDACNNL, PFEDACNNL = Variant(), Variant(cluster=True, personalize=True)


def relative(actual, reference):
    return np.linalg.norm(np.asarray(actual, np.float64) - reference) / np.linalg.norm(reference)


# -- the client's secret rotation ---------------------------------------------------------------------------
def test_haar_orthogonal_is_orthogonal_and_fresh_whatever_numpy_s_seed():
    np.random.seed(0)
    U = haar_orthogonal(40)
    np.random.seed(0)
    V = haar_orthogonal(40)
    assert_close(U.T @ U, np.eye(40), np.float64, n_terms=40)
    assert_close(U @ U.T, np.eye(40), np.float64, n_terms=40)
    assert np.abs(U - V).max() > 0.1
    assert haar_orthogonal(0).shape == (0, 0)
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        haar_orthogonal(-1)


def test_secret_normals_are_standard_normal():
    draws = secret_normals((200, 100))
    assert draws.shape == (200, 100) and np.isfinite(draws).all()
    assert abs(draws.mean()) < 0.03 and abs(draws.std() - 1) < 0.03
    # The sign-fixed QR is Haar: the first entry of a uniform column of the sphere has mean 0, variance 1/n.
    firsts = np.array([haar_orthogonal(8)[0, 0] for _ in range(400)])
    assert abs(firsts.mean()) < 0.06 and abs(firsts.var() - 1 / 8) < 0.04


def _client(rng, model, n, **options):
    x = rng.standard_normal((n, *model.input_shape)).astype(model.dtype)
    y = rng.integers(0, N_CLASSES, n)
    return Client(0, client_data(x, y, np.arange(n)), model.config(), seed=4, n_classes=N_CLASSES,
                  options=ClientOptions(**options))


@pytest.mark.parametrize("coordinates", [False, True])
def test_factored_rows_carry_exactly_the_statistics(rng, coordinates):
    """F^T F = X^T X and F^T UZ = X^T Z (or X^T Y's coordinates) per layer, to rounding; two uploads differ."""
    model = build_model("dnn", (12,), N_CLASSES, width=0.25)
    client = _client(rng, model, 9)
    for position, basis in enumerate(client.bases):
        G, C, _, _ = client._statistics(position, 4, None, coordinates=coordinates and basis is not None)
        G, C = G.copy(), C.copy()
        reply = client.factored_rows(position, 4, coordinates=coordinates and basis is not None)
        F, UZ = reply["F"], reply["UZ"]
        assert F.shape == (9, G.shape[0]) and reply["rows"] == 9 and UZ.shape == (9, C.shape[1])
        assert_close(np.triu(F.T @ F), np.triu(G), np.float64, n_terms=9)
        assert_close(F.T @ UZ, C, np.float64, n_terms=9)
        again = client.factored_rows(position, 4, coordinates=coordinates and basis is not None)
        assert np.abs(again["F"] - F).max() > 1e-3
        client.set_weights(position, rng.standard_normal((G.shape[0], client.model.layers[
            client.model.trainable[position]].ls_shape(client.model.input_shape_of(
                client.model.trainable[position]))[1])))


def test_a_client_that_fails_the_round_reports_its_dropout():
    model = build_model("dnn", (12,), N_CLASSES, width=0.25)
    client = _client(np.random.default_rng(1), model, 6, drop_probability=0.999)
    reply = client.factored_rows(0, 4)
    assert "simulated failure in layer 1" in reply["dropout"] and "F" not in reply
    assert client.train_rows() == {"rows": [6, 6, 6]}


# -- the server's pieces -----------------------------------------------------------------------------------
def _rotated_blocks(rng, X, Z, sizes):
    """Each client's block of rows behind its own rotation, stacked."""
    Fs, UZs, first = [], [], 0
    for size in sizes:
        U = haar_orthogonal(size)
        Fs.append(U @ X[first:first + size])
        UZs.append(U @ Z[first:first + size])
        first += size
    return np.vstack(Fs), np.vstack(UZs)


@settings(max_examples=15, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=5), gamma=st.floats(0.01, 100.0))
def test_the_dual_solve_is_the_ridge_solve_over_any_partition(sizes, gamma):
    rng = np.random.default_rng(sum(sizes))
    n, d = sum(sizes), 70
    X, Z = rng.standard_normal((n, d)), rng.standard_normal((n, 3))
    F, UZ = _rotated_blocks(rng, X, Z, sizes)
    W = DualSolve(gamma, None, 1).add(0, FactoredRows.from_rows(F, UZ, panel_features=16), {})
    reference = fastls.ridge_solve(X.T @ X, X.T @ Z, gamma)
    assert relative(W, reference) <= 1e-10


def test_the_dual_gram_of_float32_rows_multiplies_in_float64(rng):
    # Nonnegative rows (a ReLU's outputs) of many features: float32 sums of their products are about
    # 6e-8 off here, float64 ones exact to float64 rounding.
    F = rng.uniform(0.0, 1.0, (6, 20000)).astype(np.float32)
    rows = FactoredRows.from_rows(F, rng.standard_normal((6, 2)), panel_features=4096)
    K = dual_gram(rows, block_bytes=6 * 8 * 3000)  # blocks of 3,000 columns within panels of 4,096
    F64 = F.astype(np.float64)
    assert K.dtype == np.float64
    assert relative(np.triu(K), np.triu(F64 @ F64.T)) <= 1e-13


def float32_rows(rng, n=40, d=3000):
    # Nonnegative rows of uneven scales (a ReLU's outputs) and a small gamma: K from float32 products is
    # visibly off (about 1e-6 in the solution here), as the 'same' DCNN's classifier is at full size.
    F = (rng.uniform(0.0, 1.0, (n, d)) * rng.uniform(0.1, 10.0, d)).astype(np.float32)
    return F, rng.standard_normal((n, 3))


def test_the_rows_products_are_float64_products_in_one_pass(rng):
    F, UZ = float32_rows(rng, d=100)
    rows = FactoredRows.from_rows(F, UZ, panel_features=32)
    alpha = rng.standard_normal((40, 3))
    FtA, FFtA = rows.products(alpha, block_bytes=40 * 8 * 10)
    F64 = F.astype(np.float64)
    assert relative(FtA, F64.T @ alpha) <= 1e-14 and relative(FFtA, F64 @ (F64.T @ alpha)) <= 1e-14


@pytest.mark.parametrize("refine", [True, False])
def test_the_dual_solve_of_float32_rows_is_their_float64_ridge_solution(rng, refine):
    F, UZ = float32_rows(rng)
    F64, gamma = F.astype(np.float64), 1e-3
    exact = F64.T @ np.linalg.solve(F64 @ F64.T + gamma * np.eye(len(F)), UZ)
    rows = FactoredRows.from_rows(F, UZ, panel_features=1024)
    from_float32_products = F64.T @ fastls.ridge_solve(dual_gram(rows, exact=False), UZ, gamma)
    solver = DualSolve(gamma, None, 1, refine=refine)
    W = solver.add(0, rows, {})
    assert relative(from_float32_products, exact) > 1e-7  # what refining corrects
    assert relative(W, exact) <= 1e-10
    if refine:
        report = solver.refinements[0]
        assert report["converged"] and not report["fallback"] and report["iterations"] <= 5
    else:
        assert solver.refinements == {}


def test_a_refinement_that_does_not_converge_is_solved_again_in_float64(rng, monkeypatch):
    F, UZ = float32_rows(rng)
    F64, gamma = F.astype(np.float64), 1e-3
    exact = F64.T @ np.linalg.solve(F64 @ F64.T + gamma * np.eye(len(F)), UZ)
    refined_ridge_solve = fastls.refined_ridge_solve
    # One pass over F cannot reach 1e-300: the refinement reports no convergence.
    monkeypatch.setattr(fastls, "refined_ridge_solve",
                        lambda *args, **kwargs: refined_ridge_solve(*args, **{**kwargs, "max_iter": 1}, tol=1e-300))
    solver = DualSolve(gamma, None, 1)
    with pytest.warns(RuntimeWarning, match="did not converge.*float64"):
        W = solver.add(0, FactoredRows.from_rows(F, UZ), {})
    assert solver.refinements[0]["fallback"] and not solver.refinements[0]["converged"]
    assert relative(W, exact) <= 1e-10


def test_a_float32_k_that_does_not_factor_is_solved_again_in_float64(rng):
    # More rows than features and a small gamma: K = F F^T is singular, and its float32 products' rounding
    # leaves K + gamma I indefinite, where the float64 K's is positive definite.
    F, UZ = float32_rows(rng, n=300, d=200)
    F64, gamma = F.astype(np.float64), 1e-4
    exact = np.linalg.solve(F64.T @ F64 + gamma * np.eye(200), F64.T @ UZ)
    with pytest.raises(np.linalg.LinAlgError):
        fastls.ridge_solve(dual_gram(FactoredRows.from_rows(F, UZ), exact=False), UZ, gamma)
    solver = DualSolve(gamma, None, 1)
    with pytest.warns(RuntimeWarning, match="not positive definite; solving again with K multiplied in float64"):
        W = solver.add(0, FactoredRows.from_rows(F, UZ), {})
    assert solver.refinements[0]["fallback"] and solver.refinements[0]["iterations"] == 0
    assert relative(W, exact) <= 1e-6  # a system this near singular loses digits in float64 as well


@pytest.mark.parametrize("refine", [True, False])
def test_the_dual_solve_leaves_the_uploaded_uz_as_it_was(rng, refine, monkeypatch):
    F, UZ = float32_rows(rng)
    UZ = np.asfortranarray(UZ[:, :1])  # float64 and Fortran-ordered: what a solve could write into
    before = UZ.copy()
    if refine:  # the float64 K's solve after a refinement that did not converge
        refined_ridge_solve = fastls.refined_ridge_solve
        monkeypatch.setattr(fastls, "refined_ridge_solve",
                            lambda *args, **kwargs: refined_ridge_solve(*args, **{**kwargs, "max_iter": 1}, tol=1e-300))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        DualSolve(1e-3, None, 1, refine=refine).add(0, FactoredRows.from_rows(F, UZ), {})
    np.testing.assert_array_equal(UZ, before)


def test_the_rows_products_refuse_coefficients_of_another_shape(rng):
    rows = FactoredRows.from_rows(*float32_rows(rng, d=50))
    with pytest.raises(ValueError, match=r"alpha must have shape \(rows, k\) with rows = 40, got \(40,\)"):
        rows.products(np.ones(40), block_bytes=2**20)


def test_the_dual_expands_coordinates_in_the_label_code(rng):
    X, Y = rng.standard_normal((8, 20)), rng.standard_normal((8, 3))
    Q = rng.standard_normal((3, 11))
    U = haar_orthogonal(8)
    W = DualSolve(5.0, Q, 1).add(0, FactoredRows.from_rows(U @ X, U @ Y), {})
    reference = fastls.ridge_solve(X.T @ X, X.T @ (Y @ Q), 5.0)
    assert W.shape == (20, 11) and relative(W, reference) <= 1e-10


def test_a_row_stack_over_its_budget_is_a_file_removed_when_closed(tmp_path, rng):
    stack = RowStack(10, memory_bytes=100, folder=tmp_path, name="rows")
    F, UZ = rng.standard_normal((6, 5)), rng.standard_normal((6, 2))
    stack.append(F[:4], UZ[:4])
    stack.append(F[4:], UZ[4:])
    assert stack.mapped and (tmp_path / "rows.rows").stat().st_size == 10 * 5 * 8 and stack.rows == 6
    assert_close(np.hstack(stack.stacked().panels), F, np.float64, rtol=0)
    with pytest.raises(ValueError, match="rows: 12 rows arrived, more than the 10"):
        stack.append(F, UZ)
    stack.close()
    assert not (tmp_path / "rows.rows").exists()
    in_ram = RowStack(10, memory_bytes=10**6, folder=tmp_path, name="ram")
    in_ram.append(F, UZ)
    assert not in_ram.mapped and not list(tmp_path.iterdir())
    assert_close(np.hstack(in_ram.stacked().panels), F, np.float64, rtol=0)
    temporary = RowStack(10, memory_bytes=100, folder=None, name="rows")
    temporary.append(F, UZ)
    folder = temporary.path.parent
    assert temporary.mapped and folder.exists()
    temporary.close()
    assert not folder.exists()


def test_a_mapped_stack_holds_each_panel_of_columns_contiguously_in_its_file(tmp_path, rng):
    """A pass over F's columns then reads the file sequentially, panel after panel, whatever the clients' sizes."""
    capacity, d, width = 11, 10, 4
    F, UZ = rng.standard_normal((9, d)).astype(np.float32), rng.standard_normal((9, 2))
    stack = RowStack(capacity, memory_bytes=100, folder=tmp_path, name="rows", panel_features=width)
    for first, stop in [(0, 2), (2, 7), (7, 9)]:
        stack.append(F[first:stop], UZ[first:stop])
    stack._map.flush()
    on_disk = np.fromfile(stack.path, dtype=np.float32)
    assert on_disk.size == capacity * d
    first = 0
    for columns in [slice(0, 4), slice(4, 8), slice(8, 10)]:
        panel_size = capacity * (columns.stop - columns.start)
        assert_close(on_disk[first:first + 9 * (columns.stop - columns.start)], F[:, columns].ravel(), np.float32,
                     rtol=0)
        first += panel_size
    blocks = list(stack.stacked().column_blocks(4, block_bytes=9 * 4 * 3))
    assert [columns for columns, _ in blocks] == [slice(0, 3), slice(3, 4), slice(4, 7), slice(7, 8), slice(8, 10)]
    for columns, block in blocks:
        assert block.flags.c_contiguous or block.shape[1] < width
        assert_close(block, F[:, columns], np.float32, rtol=0)
    stack.close()


def test_the_dual_gram_and_solve_read_the_stack_in_blocks_of_columns(rng):
    F, UZ = rng.standard_normal((12, 40)).astype(np.float32), rng.standard_normal((12, 3))
    stack = RowStack(15, memory_bytes=10**6, folder=None, name="rows", panel_features=16)
    stack.append(F[:5], UZ[:5])
    stack.append(F[5:], UZ[5:])
    rows = stack.stacked()
    assert [panel.shape for panel in rows.panels] == [(12, 16), (12, 16), (12, 8)]
    F64 = F.astype(np.float64)
    # float32 rows are multiplied in float64 BLAS: K and the solution are exact over them, to float64 rounding.
    assert_close(np.triu(dual_gram(rows, block_bytes=12 * 4 * 9)), np.triu(F64 @ F64.T), np.float64, n_terms=40)
    W = DualSolve(2.0, None, 1, block_bytes=12 * 8 * 9).add(0, rows, {})
    assert relative(W, fastls.ridge_solve(F64.T @ F64, F64.T @ UZ, 2.0)) <= 1e-10


def test_the_cost_rule_takes_the_primal_wherever_its_grams_fit():
    # The primal holds a group's summed Gram and one arriving client's: 2 d^2 values.
    assert solve_form("auto", 0, 100, 50, 4, memory_bytes=2 * 100 * 100 * 8)[0] == "primal"
    form, record = solve_form("auto", 0, 100, 50, 4, memory_bytes=2 * 100 * 100 * 8 - 1)
    assert form == "dual" and record["dual_bytes"] == 50 * 50 * 8 and set(record["flops"]) == {"primal", "dual"}
    assert record["primal_bytes"] == primal_bytes(100) == 2 * 100 * 100 * 8 and record["gram_bytes"] == 100 * 100 * 8
    assert solve_form("auto", 0, 100, None, 4, memory_bytes=1)[0] == "primal"  # rows unknown: as before
    assert solve_form("dual", 0, 10, 50, 4, memory_bytes=10**9)[0] == "dual"
    assert solve_form("primal", 0, 100, 50, 4, memory_bytes=1)[0] == "primal"
    with pytest.raises(ValueError, match=r"layer 3: neither its primal solve \(d = 100: .* nor its dual system over "
                                         r"a group's 200 rows"):
        solve_form("auto", 2, 100, 200, 4, memory_bytes=2 * 100 * 100 * 8 - 1)


def test_gcv_counts_its_eigendecomposition_in_both_forms():
    assert primal_bytes(100, 8, gcv=True) == 4 * 100 * 100 * 8 and dual_bytes(50, gcv=True) == 3 * 50 * 50 * 8
    assert solve_form("auto", 0, 100, 50, 4, memory_bytes=2 * 100 * 100 * 8, gcv=True)[0] == "dual"
    with pytest.raises(ValueError, match=r"\(with GCV\)"):
        solve_form("auto", 0, 100, 50, 4, memory_bytes=3 * 50 * 50 * 8 - 1, gcv=True)


def test_a_forced_dual_over_the_budget_is_refused():
    with pytest.raises(ValueError, match=r"layer 2: --server-solve dual would solve an N x N system over a group's "
                                         r"50 rows .* use --server-solve auto"):
        solve_form("dual", 1, 10, 50, 4, memory_bytes=50 * 50 * 8 - 1)


def test_gcv_pooled_over_groups_with_the_dual_is_refused_naming_the_alternatives():
    with pytest.raises(ValueError, match=r"layer 2 is solved in the dual .* gamma_scope='all' chooses one gamma by GCV "
                                         r"over all 3 groups' rows together: use gamma_scope='group' .* --gamma-output "
                                         r".* --server-memory .* --server-solve primal"):
        choose_solver("auto", "all", 3, None, form="dual", position=1)
    assert isinstance(choose_solver("auto", "all", 1, None, form="dual"), DualSolve)
    assert isinstance(choose_solver("auto", "group", 3, None, form="dual"), DualSolve)


@pytest.mark.parametrize("n, expand", [(30, False), (8, False), (8, True)], ids=["tall", "wide", "wide-coordinates"])
def test_gcv_from_the_kernel_chooses_the_gamma_of_gcv_from_the_gram(rng, n, expand):
    d = 20
    X, Y = rng.standard_normal((n, d)), rng.standard_normal((n, 3))
    Q = rng.standard_normal((3, 11)) if expand else None
    Z = Y @ Q if expand else Y
    U = haar_orthogonal(n)
    selection = {}
    W = DualSolve("auto", Q, 1).add(0, FactoredRows.from_rows(U @ X, U @ Y), selection)
    path = fastls.RidgePath.from_statistics(X.T @ X, X.T @ Z, float(np.sum(Z * Z)), n, rhs_basis=Q)
    gamma, grid, scores = path.select("gcv")
    chosen = selection["all"]
    assert_close(chosen["grid"], grid, np.float64, rtol=1e-12)
    # From statistics the RSS is tr(Z^T Z) minus the fit, accurate to about d eps tr(Z^T Z): compare where that
    # is far below the RSS (the kernel's, from the rows' projections, is accurate everywhere).
    accurate = path.residual_ss(grid) > 1e-6 * np.sum(Z * Z)
    assert accurate.sum() >= 5
    assert_close(np.array(chosen["scores"])[accurate], scores[accurate], np.float64, rtol=1e-8)
    gamma_chosen = chosen["gamma"]
    if n > d:
        assert gamma_chosen == pytest.approx(gamma, rel=1e-6)
        reference = fastls.ridge_solve(X.T @ X, X.T @ Z, gamma_chosen)
    else:  # GCV may pick a shift near interpolation, where only the n x n form is accurate
        reference = X.T @ np.linalg.solve(X @ X.T + gamma_chosen * np.eye(n), Z)
    assert relative(W, reference) <= 1e-10


def test_a_kernel_path_gives_dual_coefficients_not_w(rng):
    X, Z = rng.standard_normal((6, 9)), rng.standard_normal((6, 2))
    path = fastls.RidgePath.from_kernel(X @ X.T, Z, 9)
    assert relative(X.T @ path.dual_coefficients(0.5), fastls.ridge_solve(X.T @ X, X.T @ Z, 0.5)) <= 1e-10
    with pytest.raises(ValueError, match="holds no X to form W: W = X\\^T dual_coefficients"):
        path.solve(0.5)
    with pytest.raises(ValueError, match="dual coefficients belong to a path from a kernel"):
        fastls.RidgePath.from_rows(X, Z).dual_coefficients(0.5)


# -- whole runs --------------------------------------------------------------------------------------------
def _run(model, x, y, parts, variant, shapes=True, secure=False, **options):
    clients = [Client(i, client_data(x, y, p), model.config(), seed=6, n_classes=N_CLASSES)
               for i, p in enumerate(parts)]
    layer_shapes = [model.layers[i].ls_shape(model.input_shape_of(i)) for i in model.trainable] if shapes else None
    return run_protocol(InProcessTransport([SecureClient(c) for c in clients] if secure else clients),
                        len(model.trainable), variant, ServerOptions(seed=6, groups=2, batch=BatchPolicy(5), **options),
                        layers=ModelLayers(target_bases(model, 6), layer_shapes),
                        secure=SecureServer(6, min_group_size=2) if secure else None)


def _dnn_case(rng, dtype, n=36, n_clients=4):
    model = build_model("dnn", (12,), N_CLASSES, width=0.25, dtype=dtype)
    y = rng.integers(0, N_CLASSES, n)
    x = (rng.standard_normal((N_CLASSES, 12))[y] * 2 + rng.standard_normal((n, 12))).astype(dtype)
    parts = np.array_split(rng.permutation(n), n_clients)
    return model, x, y, parts


@pytest.mark.parametrize("variant", [FEDACNNL, PFEDACNNL], ids=["fedacnnl", "pfedacnnl"])
def test_gcv_per_group_in_the_dual_chooses_the_primal_s_gammas(rng, variant):
    # Rows well above the widest layer's 33 inputs: GCV from the Gram is accurate only away from interpolation.
    model, x, y, parts = _dnn_case(rng, np.float64, n=160)
    options = dict(gamma="auto", gamma_scope="group")
    primal = _run(model, x, y, parts, variant, server_solve="primal", **options)
    dual = _run(model, x, y, parts, variant, server_solve="dual", **options)
    for r_dual, r_primal in zip(dual["rounds"], primal["rounds"]):
        for key, chosen in r_primal.get("selection", {}).items():
            assert r_dual["selection"][key]["gamma"] == pytest.approx(chosen["gamma"], rel=1e-6)
    for k, layers in primal["group_weights"].items():
        for W_dual, W_primal in zip(dual["group_weights"][k], layers):
            assert relative(W_dual, W_primal) <= 1e-6


@pytest.mark.parametrize("variant", [FEDACNNL, PFEDACNNL], ids=["fedacnnl", "pfedacnnl"])
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-10), (np.float32, 1e-5)], ids=["float64", "float32"])
@pytest.mark.parametrize("upload", ["coordinates", "targets"])
def test_primal_and_dual_runs_give_the_same_weights(rng, variant, dtype, tolerance, upload):
    model, x, y, parts = _dnn_case(rng, dtype)
    primal = _run(model, x, y, parts, variant, upload=upload, server_solve="primal")
    dual = _run(model, x, y, parts, variant, upload=upload, server_solve="dual")
    assert dual["groups"] == primal["groups"]
    for k, layers in primal["group_weights"].items():
        for W_dual, W_primal in zip(dual["group_weights"][k], layers):
            assert relative(W_dual, W_primal) <= tolerance
    for r_dual, r_primal in zip(dual["rounds"], primal["rounds"]):
        if r_primal["stage"] == "federated":
            assert r_dual["solve"]["form"] == "dual" and "solve" not in r_primal
            # Each client's F (n_i x d) and UZ (n_i x k) travel up instead of its G and C.
            assert r_dual["bytes_up"] > 0 and r_dual["bytes_up"] != r_primal["bytes_up"]
            # float32 rows: K from float32 products, refined against float64 ones (recorded per group).
            refined = r_dual["solve"].get("refinement", {})
            assert (dtype == np.float32) == bool(refined)
            assert all(report["converged"] and not report["fallback"] for report in refined.values())
    assert abs(dual["accuracy"] - primal["accuracy"]) <= 0.05


def test_the_bytes_up_of_a_dual_round_are_the_clients_rows(rng):
    model, x, y, parts = _dnn_case(rng, np.float64, n=20, n_clients=2)
    outcome = _run(model, x, y, parts, FEDACNNL, server_solve="dual", upload="targets")
    d, m = model.layers[model.trainable[0]].ls_shape(model.input_shape_of(model.trainable[0]))
    assert outcome["rounds"][0]["bytes_up"] == 20 * (d + m) * 8


def test_the_auto_rule_solves_only_the_layers_whose_gram_exceeds_the_budget_in_the_dual(rng, tmp_path):
    """A 1/16-width DCNN: with 2 MB for the server, layers 3-5 go dual (layer 3's rows memory-mapped), 1-2 primal."""
    model = build_model("dcnn", (32, 32, 3), N_CLASSES, width=1 / 16)
    n = 30
    y = rng.integers(0, N_CLASSES, n)
    x = rng.random((n, 32, 32, 3))
    parts = np.array_split(rng.permutation(n), 3)
    budget = 2e6 / 2**30
    for stale in ("rows_layer3_group0.rows", "rows_layer9_group4.rows"):  # left by a killed run
        (tmp_path / stale).write_bytes(b"stale")
    auto = _run(model, x, y, parts, FEDACNNL, server_memory=budget, scratch_dir=tmp_path)
    primal = _run(model, x, y, parts, FEDACNNL)
    forms = [r.get("solve", {"form": "primal"})["form"] for r in auto["rounds"]]
    assert forms == ["primal", "primal", "dual", "dual", "dual"]
    assert auto["rounds"][2]["solve"]["mapped"] == {"0": True} and not list(tmp_path.iterdir())
    for W_auto, W_primal in zip(auto["group_weights"][0], primal["group_weights"][0]):
        assert relative(W_auto, W_primal) <= 1e-10
    assert all("solve" not in r for r in primal["rounds"])


def test_without_layer_shapes_auto_stays_primal(rng):
    model, x, y, parts = _dnn_case(rng, np.float64)
    outcome = _run(model, x, y, parts, FEDACNNL, shapes=False, server_memory=1e-9)
    assert all("solve" not in r for r in outcome["rounds"])


def test_a_dropout_leaves_its_rows_out_of_the_dual_solve(rng):
    model, x, y, parts = _dnn_case(rng, np.float64)
    clients = [Client(i, client_data(x, y, p), model.config(), seed=6, n_classes=N_CLASSES,
                      options=ClientOptions(drop_probability=0.999 if i == 1 else 0.0)) for i, p in enumerate(parts)]
    outcome = run_protocol(InProcessTransport(clients), 3, FEDACNNL,
                           ServerOptions(server_solve="dual", batch=BatchPolicy(5)),
                           layers=ModelLayers(target_bases(model, 6)))
    kept = np.concatenate([p for i, p in enumerate(parts) if i != 1])
    reference = _run(model, x[kept], y[kept], np.array_split(np.arange(len(kept)), 3), FEDACNNL)
    for record in outcome["rounds"]:
        assert set(record["dropped"]) == {"1"}
        assert "ClientDropout: client 1: simulated failure" in record["dropped"]["1"]
    for W, W_reference in zip(outcome["group_weights"][0], reference["group_weights"][0], strict=True):
        assert relative(W, W_reference) <= 1e-10


def _record_client_work(monkeypatch):
    """A list that every Client's statistics or factored rows append their name to (the work runs as before):
    empty after a run that was refused before training. ``train_rows`` is not work: the refusal is decided from it."""
    called = []
    for method in ("local_stats", "factored_rows"):
        real = getattr(Client, method)
        monkeypatch.setattr(Client, method, lambda self, *a, _real=real, _m=method, **k: called.append(_m)
                            or _real(self, *a, **k))
    return called


def test_a_secure_run_that_needs_the_dual_is_refused_before_training(rng, monkeypatch):
    """9 rows of 13 features: the dual's 9 x 9 system fits 1,000 bytes where the 13 x 13 Gram does not."""
    model, x, y, parts = _dnn_case(rng, np.float64, n=9, n_clients=3)
    budget = 1000 / 2**30
    computed = _record_client_work(monkeypatch)
    rounds = _run(model, x, y, parts, FEDACNNL, server_memory=budget)["rounds"]
    assert [r.get("solve", {}).get("form") for r in rounds] == ["dual"] * 3
    assert computed.count("factored_rows") == 3 * 3  # the recorder sees the plain run's work: 3 layers, 3 clients
    computed.clear()
    with pytest.raises(ValueError, match=r"layer 1 \(d = 13\) must be solved in the dual: its Gram takes 1,352 bytes "
                                         r".* secure sums cannot carry .* without --secure, raise --server-memory"):
        _run(model, x, y, parts, FEDACNNL, server_memory=budget, secure=True)
    with pytest.raises(ValueError, match=r"layer 1 \(d = 13, a Gram of 1,352 bytes\): --server-solve dual uploads .* "
                                         r"Run without --secure, or with --server-solve auto or primal"):
        _run(model, x, y, parts, FEDACNNL, server_solve="dual", secure=True)
    assert computed == []


def test_a_run_s_options_reach_the_server_and_its_layer_shapes(tmp_path):
    """fedlayer.run: --server-solve dual gives the primal run's weights; the record says how each layer was solved."""
    base = dict(algorithm="pfedacnnl-wp", dataset="synthetic", model="dnn", clients=6, groups=2, seed=1,
                train_fraction=0.1)
    primal = run(RunConfig(**base, server_solve="primal"))
    dual = run(RunConfig(**base, server_solve="dual", output=str(tmp_path / "dual")))
    recorded = json.loads((tmp_path / "dual" / "results.json").read_text())
    assert recorded["config"]["server_solve"] == "dual"
    federated = [r for r in recorded["rounds"].values() if r["stage"] == "federated"]
    assert [r["solve"]["form"] for r in federated] == ["dual"] * 3
    assert federated[0]["solve"]["gram_bytes"] == 61 * 61 * 8  # the synthetic task's 60 features and a bias
    for k, layers in primal["group_weights"].items():
        for W_dual, W_primal in zip(dual["group_weights"][k], layers):
            assert relative(W_dual, W_primal) <= 1e-10
    assert not (tmp_path / "dual" / "server").exists() or not list((tmp_path / "dual" / "server").iterdir())


def test_column_blocks_hold_at_most_the_block_bytes_and_one_column():
    assert _column_blocks(10, 25, 8, 10 * 8 * 7) == [slice(0, 7), slice(7, 14), slice(14, 21), slice(21, 28)]
    assert _column_blocks(10, 3, 8, 1) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_the_centralized_reference_sends_its_rows_unrotated(rng):
    model = build_model("dnn", (12,), N_CLASSES, width=0.25)
    pooled = ALGORITHMS["acnnl"].make_client(0, _client(rng, model, 3).data, RunConfig(algorithm="acnnl"),
                                             N_CLASSES, model.config(), 1)
    assert not pooled.options.rotate_rows and ClientOptions.from_config(RunConfig()).rotate_rows
    client = _client(rng, model, 7, rotate_rows=False)
    reply = client.factored_rows(2, 4)
    x = client._layer_inputs("train", client.model.trainable[2])
    assert_close(reply["F"], client.model.layers[client.model.trainable[2]].ls_rows(np.asarray(x)), np.float64, rtol=0)
    assert_close(reply["UZ"], np.eye(N_CLASSES)[client.data.y_train], np.float64, rtol=0)
    outcome = run(RunConfig(algorithm="acnnl", dataset="synthetic", model="dnn", clients=4, seed=2,
                            train_fraction=0.1, server_solve="dual"))
    reference = run(RunConfig(algorithm="acnnl", dataset="synthetic", model="dnn", clients=4, seed=2,
                              train_fraction=0.1))
    for W_dual, W_primal in zip(outcome["group_weights"][0], reference["group_weights"][0]):
        assert relative(W_dual, W_primal) <= 1e-10


def _resident_kib(path):
    """Resident KiB of this process's mapping of ``path`` (/proc/self/smaps), 0 when unmapped."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0] and ":" not in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_a_mapped_stack_s_pages_leave_the_process_and_its_rows_stay(tmp_path, rng):
    """release() unmaps the stack's pages after each write and each block: resident memory does not count them."""
    n, d = 64, 4096  # 1 MiB of float32 rows
    F, UZ = rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((n, 2))
    stack = RowStack(n, memory_bytes=1000, folder=tmp_path, name="rows")
    for first in range(0, n, 16):
        stack.append(F[first:first + 16], UZ[first:first + 16])
    assert _resident_kib(stack.path) == 0
    rows = stack.stacked()
    assert_close(np.hstack(rows.panels), F, np.float32, rtol=0)  # read back from the file
    assert _resident_kib(stack.path) == 1024
    rows.release()
    assert _resident_kib(stack.path) == 0
    W = DualSolve(3.0, None, 1, block_bytes=n * 8 * 1000).add(0, rows, {})
    assert _resident_kib(stack.path) == 0
    F64 = F.astype(np.float64)
    assert relative(W, fastls.ridge_solve(F64.T @ F64, F64.T @ UZ, 3.0)) <= 1e-10
    del rows
    stack.close()
    assert not list(tmp_path.iterdir())


def test_gcv_pooled_over_groups_in_a_dual_layer_is_refused_before_any_layer_trains(rng, monkeypatch):
    """The refusal comes from planning the layers' forms, not from the dual layer's own round."""
    model, x, y, parts = _dnn_case(rng, np.float64, n=40, n_clients=4)
    called = _record_client_work(monkeypatch)
    # With GCV, layer 1 (d = 13) and layer 3 (d = 17) fit 30,000 bytes in the primal, layer 2 (d = 33: 34,848
    # bytes) only in the dual, over a group's at most 30 rows (21,600 bytes).
    with pytest.raises(ValueError, match=r"layer 2 is solved in the dual .* gamma_scope='all'"):
        _run(model, x, y, parts, PFEDACNNL, gamma="auto", gamma_scope="all", server_memory=30000 / 2**30)
    assert called == []


def test_a_client_without_training_samples_is_refused_by_name(rng):
    """So no group can be made of clients without rows (K-means, the statistics and the dual all need one)."""
    model, x, y, _ = _dnn_case(rng, np.float64)
    with pytest.raises(ValueError, match="client 7 has no training samples; a client needs at least one"):
        Client(7, client_data(x, y, np.arange(0)), model.config(), seed=6, n_classes=N_CLASSES)
