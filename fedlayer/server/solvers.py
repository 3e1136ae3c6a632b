"""How a layer's weights come from its groups' summed statistics: one solver object, chosen once per layer.

:func:`choose_solver` picks the way the layer is solved from its gamma, the
gamma's scope and the number of groups (as scikit-learn's ``_RidgeGCV``
picks its decomposition once), and the round never asks again:

* :class:`FixedGamma`: each group's sums solved with the given gamma
  (eqs. 5, 11);
* :class:`GroupGCV`: each group's gamma minimizes GCV on its own sums;
* :class:`PooledGCV`: one gamma minimizes GCV on the sums over all groups,
  each group then solved with it (the groups' sums are held until then).

* :class:`DualSolve`: each group's weights from its clients' factored
  uploads (F_i = U_i X_i, U_i Z_i) stacked, through the N x N system
  (F F^T + gamma I) alpha = U Z and W = F^T alpha, for a layer whose d x d
  Gram does not fit the server (:func:`solve_form` decides).

Secure sums with several groups keep the total over the groups as well: a
group whose sum could not be unmasked is solved on the other groups' total
(:meth:`LayerSolver.finish`).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

import numpy as np

import fastls

from ..options import SERVER_SOLVES

__all__ = ["DualSolve", "FactoredRows", "FixedGamma", "GroupGCV", "LayerSolver", "PooledGCV", "RowStack",
           "SummedStatistics", "choose_solver", "dual_bytes", "dual_gram", "gcv_choice", "primal_bytes", "solve_form"]

#: Largest block of the stacked rows the dual solve copies at once: at 45,000 rows, 2,982 columns cast to
#: float64 (5,965 float32 ones for K's float32 products), so that K = F F^T, whose every update reads and
#: writes all of K in float64, takes few passes over it.
DUAL_BLOCK_BYTES = 2**30
#: Passes over the stacked rows the refinement of a dual solve from float32 products makes at most: at full
#: width a pass reads 23.6 GB, about 20 s, and 10 of them cost a fifth of what a float64 K adds.
DUAL_REFINE_PASSES = 10
#: Columns of each panel of the stacked rows (:class:`RowStack`): a client's rows are one write per panel.
DUAL_BLOCK_FEATURES = 4096


@dataclass
class SummedStatistics:
    """One group's sums of a layer: G = X^T X (upper triangle), C = X^T Z, tr(Z^T Z) and the row count."""

    G: np.ndarray
    C: np.ndarray
    zz: float = 0.0
    rows: int = 0


def gcv_choice(sums: SummedStatistics, basis: np.ndarray | None) -> tuple[float, fastls.RidgePath, dict]:
    """(gamma, its RidgePath, the round's record of the choice) by GCV on ``sums``; ``sums.G`` is destroyed."""
    path = fastls.RidgePath.from_statistics(sums.G, sums.C, sums.zz, sums.rows, rhs_basis=basis, overwrite_g=True)
    gamma, grid, scores = path.select("gcv")
    return gamma, path, {"gamma": gamma, "criterion": "gcv", "grid": grid.tolist(), "scores": scores.tolist()}


class LayerSolver:
    """Solves one layer, group by group as the groups' sums arrive.

    Parameters
    ----------
    basis : ndarray or None
        The layer's label code, the ``rhs_basis`` of the fastls solves.
    n_groups : int
    keep_total : bool
        Keep the total of the groups' sums, to solve the groups withheld
        from the round on it.
    """

    def __init__(self, basis: np.ndarray | None, n_groups: int, keep_total: bool = False) -> None:
        self.basis, self.n_groups, self.keep_total = basis, n_groups, keep_total
        self.total: SummedStatistics | None = None

    def add(self, k: int, sums: SummedStatistics, selection: dict) -> np.ndarray | None:
        """Take group ``k``'s sums (consumed); returns its weights, or None when they come at :meth:`finish`.

        ``selection`` receives the record of any gamma chosen.
        """
        if self.keep_total:
            self._accumulate(sums)
        return self._solve_group(k, sums, selection)

    def finish(self, withheld: dict, selection: dict) -> dict[int, np.ndarray]:
        """The weights of the groups not solved by :meth:`add`: held ones, and each of ``withheld`` (its sum was
        not unmasked) on the total of the others."""
        if not (self._held() or withheld):
            return {}
        gamma = self._final_gamma(withheld, selection)
        solved = self._solve_held(gamma)
        if withheld:
            W_others = fastls.ridge_solve(self.total.G, self.total.C, gamma, overwrite_g=True, rhs_basis=self.basis)
            solved.update(dict.fromkeys(sorted(withheld), W_others))
        self.total = None
        return solved

    def _accumulate(self, sums):
        if self.total is None:
            self.total = SummedStatistics(np.zeros_like(sums.G), np.zeros_like(sums.C), 0.0, 0)
        self.total.G += sums.G
        self.total.C += sums.C
        self.total.zz += sums.zz
        self.total.rows += sums.rows

    def _solve_group(self, k, sums, selection):
        raise NotImplementedError

    def _held(self):
        return False

    def _solve_held(self, gamma):
        return {}

    def _final_gamma(self, withheld, selection):
        raise NotImplementedError


class FixedGamma(LayerSolver):
    """Every group solved with the given ``gamma``."""

    def __init__(self, gamma: float, basis: np.ndarray | None, n_groups: int, keep_total: bool = False) -> None:
        super().__init__(basis, n_groups, keep_total)
        self.gamma = gamma

    def _solve_group(self, k, sums, selection):
        return fastls.ridge_solve(sums.G, sums.C, self.gamma, overwrite_g=True, overwrite_c=True,
                                  rhs_basis=self.basis)

    def _final_gamma(self, withheld, selection):
        return self.gamma


class GroupGCV(LayerSolver):
    """Each group's gamma by GCV on its own sums (one group: recorded as ``"all"``)."""

    def _solve_group(self, k, sums, selection):
        gamma, path, selection[str(k) if self.n_groups > 1 else "all"] = gcv_choice(sums, self.basis)
        return path.solve(gamma)

    def _final_gamma(self, withheld, selection):
        # Withheld groups: the gamma GCV chooses on the others' total (a copy: the total is solved on next).
        copy = SummedStatistics(self.total.G.copy(), self.total.C, self.total.zz, self.total.rows)
        gamma, _, selection["withheld"] = gcv_choice(copy, self.basis)
        return gamma


class PooledGCV(LayerSolver):
    """One gamma by GCV on the sums over all groups; each group solved with it once all have arrived."""

    def __init__(self, basis: np.ndarray | None, n_groups: int, keep_total: bool = False) -> None:
        super().__init__(basis, n_groups, keep_total=True)
        self._pending = {}

    def _solve_group(self, k, sums, selection):
        self._pending[k] = sums
        return None

    def _held(self):
        return bool(self._pending)

    def _final_gamma(self, withheld, selection):
        total = self.total
        if withheld:  # the total is solved on again for the withheld groups
            total = SummedStatistics(total.G.copy(), total.C, total.zz, total.rows)
        gamma, _, selection["all"] = gcv_choice(total, self.basis)
        return gamma

    def _solve_held(self, gamma):
        solved = {k: fastls.ridge_solve(sums.G, sums.C, gamma, overwrite_g=True, overwrite_c=True,
                                        rhs_basis=self.basis) for k, sums in sorted(self._pending.items())}
        self._pending.clear()
        return solved


def _rows_in_ram() -> None:
    """The ``release`` of rows held in RAM: nothing to unmap."""


@dataclass
class FactoredRows:
    """One group's factored uploads of a layer, stacked: F = [U_i X_i] (rows, d) and UZ = [U_i Z_i] (rows, k).

    F is held as column panels, ``panels[p]`` = F[:, columns of panel p],
    each C-ordered: a pass over F's columns then reads each panel in one
    sequential run, where a memory-mapped row-major F would fault in a few
    KiB of every row against the disk's readahead. F^T F and F^T UZ are the
    group's sums X^T X and X^T Z. ``release()``, called after each pass over
    a block of F, drops the block's pages from the process where F is a
    memory-mapped file (its file and the page cache keep them): the stack's
    pages then never count as the process's memory.
    """

    panels: list[np.ndarray]
    UZ: np.ndarray
    release: Callable[[], None] = _rows_in_ram

    @classmethod
    def from_rows(cls, F: np.ndarray, UZ: np.ndarray, panel_features: int = DUAL_BLOCK_FEATURES) -> FactoredRows:
        """Rows held as one (rows, d) array, as panels of ``panel_features`` columns (views of F)."""
        return cls([F[:, columns] for columns in _panel_columns(F.shape[1], panel_features)], UZ)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, d) of F."""
        return len(self.UZ), sum(panel.shape[1] for panel in self.panels)

    @property
    def dtype(self) -> np.dtype:
        return self.panels[0].dtype

    def column_blocks(self, itemsize: int, block_bytes: int) -> Iterator[tuple[slice, np.ndarray]]:
        """Yield ``(columns, F[:, columns])`` panel by panel, each block at most ``block_bytes`` of the rows at
        ``itemsize`` (at least one column), and ``release()`` once the caller is done with each."""
        rows, first = len(self.UZ), 0
        for panel in self.panels:
            width = panel.shape[1]
            for columns in _column_blocks(rows, width, itemsize, block_bytes):
                stop = min(columns.stop, width)
                yield slice(first + columns.start, first + stop), panel[:, columns.start:stop]
                self.release()
            first += width

    def products(self, alpha: np.ndarray, block_bytes: int, gram: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """(F^T alpha (d, k), F F^T alpha (rows, k) or None without ``gram``), float64, in one pass over F's columns.

        Each block of F is cast to float64 before its products, whatever F's dtype.
        """
        alpha = np.asarray(alpha, dtype=np.float64)
        if alpha.ndim != 2 or len(alpha) != self.shape[0]:
            raise ValueError(f"alpha must have shape (rows, k) with rows = {self.shape[0]}, got {alpha.shape}")
        FtA = np.empty((self.shape[1], alpha.shape[1]))
        FFtA = np.zeros((self.shape[0], alpha.shape[1])) if gram else None
        for columns, block in self.column_blocks(np.dtype(np.float64).itemsize, block_bytes):
            block = np.asarray(block, dtype=np.float64)
            FtA[columns] = fastls.matmul(block.T, alpha, check_finite=False)
            if gram:
                FFtA += fastls.matmul(block, FtA[columns], check_finite=False)
        return FtA, FFtA


class RowStack:
    """The rows of one group's factored uploads, appended client by client: in RAM, or memory-mapped.

    F is held as column panels of ``panel_features`` columns, each
    (capacity, width) and C-ordered, one after the other in one buffer: a
    client's n rows are one contiguous write of n x width values per panel,
    and the dual solve reads each panel as one sequential run (see
    :class:`FactoredRows`).

    Parameters
    ----------
    capacity : int
        Rows the group's clients hold together (an upper bound: a dropout's rows never arrive).
    memory_bytes : int
        What the stacked F may take in RAM; a larger one is a ``.rows`` file
        under ``folder``, removed by :meth:`close`.
    folder : path or None
        Where a memory-mapped stack goes (None: a temporary folder, removed with it).
    name : str
        The file's name, without extension.
    panel_features : int
        Columns per panel.
    """

    def __init__(self, capacity: int, memory_bytes: int, folder: str | os.PathLike | None, name: str,
                 panel_features: int = DUAL_BLOCK_FEATURES) -> None:
        self.capacity, self.memory_bytes, self.name = int(capacity), int(memory_bytes), name
        self.panel_features = int(panel_features)
        self.folder = None if folder is None else Path(folder)
        self.panels = self.UZ = None
        self.d, self.columns = 0, []
        self.path = self._temporary = self._map = None
        self.rows = 0

    @property
    def mapped(self) -> bool:
        """Whether the stacked F is a file (it did not fit ``memory_bytes``)."""
        return self.path is not None

    def append(self, F: np.ndarray, UZ: np.ndarray) -> None:
        """Add one client's F (n, d) and UZ (n, k) below the rows already stacked."""
        if self.panels is None:
            self._allocate(F.shape[1], F.dtype, UZ.shape[1], UZ.dtype)
        n = len(F)
        if F.ndim != 2 or F.shape[1] != self.d or UZ.shape != (n, self.UZ.shape[1]):
            raise ValueError(f"{self.name}: a client's factored upload has F {F.shape} and UZ {UZ.shape}; the "
                             f"group's have {self.d} and {self.UZ.shape[1]} columns and one row each per row")
        if self.rows + n > self.capacity:
            raise ValueError(f"{self.name}: {self.rows + n} rows arrived, more than the {self.capacity} the group's "
                             f"clients announced")
        for panel, columns in zip(self.panels, self.columns):
            panel[self.rows:self.rows + n] = F[:, columns]
        self.UZ[self.rows:self.rows + n] = UZ
        self.rows += n
        self.release()

    def stacked(self) -> FactoredRows:
        """The rows that arrived (views of the stack)."""
        return FactoredRows([panel[:self.rows] for panel in self.panels], self.UZ[:self.rows], self.release)

    def release(self) -> None:
        """Unmap the pages of a memory-mapped stack from this process; the file keeps what was written.

        A shared file mapping's dirty pages stay in the page cache, to be
        written back: the process's resident memory stops counting them.
        """
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Release the stack (and remove its file)."""
        self.panels = self.UZ = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # views still held (an exception's traceback): the mapping goes with the last of them
            self._map = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None

    def _allocate(self, d, dtype, k, rhs_dtype):
        self.d, dtype = int(d), np.dtype(dtype)
        self.UZ = np.empty((self.capacity, k), dtype=rhs_dtype)
        nbytes = self.capacity * self.d * dtype.itemsize
        if nbytes <= self.memory_bytes:
            buffer = np.empty(self.capacity * self.d, dtype=dtype)
        else:
            folder = self.folder
            if folder is None:
                folder = self._temporary = Path(tempfile.mkdtemp(prefix="fedlayer-rows-"))
            folder.mkdir(parents=True, exist_ok=True)
            self.path = folder / f"{self.name}.rows"
            with open(self.path, "w+b") as file:
                _reserve(file, nbytes, self.path)
                # A mapping of our own (not np.memmap's), so that release() can unmap its pages.
                self._map = mmap.mmap(file.fileno(), max(nbytes, 1))
            buffer = np.ndarray((self.capacity * self.d,), dtype=dtype, buffer=self._map)
        self.columns = _panel_columns(self.d, self.panel_features)
        self.panels = [buffer[self.capacity * c.start:self.capacity * c.stop].reshape(self.capacity, c.stop - c.start)
                       for c in self.columns]


def _panel_columns(d, panel_features):
    """The columns of F each panel holds: ``panel_features`` of them, the last panel what is left of d."""
    return [slice(first, min(first + panel_features, d)) for first in range(0, d, panel_features)]


def remove_stale_stacks(folder: str | os.PathLike | None) -> None:
    """Remove the stacked-row files a killed run left in ``folder``: a stack lives for one group's solve, so
    at the start of a run every such file is stale (tens of GB at full width), and nothing reads it again."""
    if folder is not None:
        for path in Path(folder).glob("rows_layer*_group*.rows"):
            path.unlink(missing_ok=True)


def _reserve(file, nbytes, path):
    """Give the file its ``nbytes`` now, its blocks allocated where the filesystem can: a full disk is then an
    error here, not a SIGBUS when a write through the mapping finds no block."""
    file.truncate(max(nbytes, 1))
    try:
        os.posix_fallocate(file.fileno(), 0, max(nbytes, 1))
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise OSError(err.errno, f"cannot reserve {nbytes / 2**30:.1f} GiB for a group's stacked rows in "
                                 f"{path.parent} ({os.strerror(err.errno)}); free space there, or raise "
                                 f"--server-memory so that they stay in RAM", str(path)) from None


def dual_gram(rows: FactoredRows, block_bytes: int = DUAL_BLOCK_BYTES, exact: bool = True) -> np.ndarray:
    """K = F F^T (upper triangle, float64) over blocks of F's columns, F in RAM or memory-mapped.

    Each block of columns (:meth:`FactoredRows.column_blocks`) is copied as
    a C-ordered (columns, n) array X, and :func:`fastls.gram_update` adds
    X^T X to K. With ``exact`` the blocks are cast to float64 first (float64
    BLAS, whatever F's dtype); without it float32 F's products run in float32
    BLAS over ``DUAL_BLOCK_FEATURES`` columns at a time, summed into float64
    K, about 1.4x faster at the price of a K that is no data's Gram: its
    errors fall along K's small eigenvalues, which (K + gamma I)^-1
    amplifies, putting the 1/4-width 'same' classifier 1.3e-4 from its exact
    solution (docs/results/fig6_dual_precision.md). :class:`DualSolve`
    refines such a solve against exact products with F. Rounding the rows
    themselves to float32 is harmless: a ridge problem over slightly other
    data, which moves that classifier by 2e-7.

    Parameters
    ----------
    rows : FactoredRows
        F of shape (n, d), float32 or float64, as column panels.
    block_bytes : int
        Largest block copied at once (at least one column).
    exact : bool, default=True
        Products in float64 (else in F's dtype, over blocks of ``DUAL_BLOCK_FEATURES`` columns).

    Returns
    -------
    K : ndarray of shape (n, n), float64, upper triangle filled
    """
    n = rows.shape[0]
    K = np.zeros((n, n))
    dtype = np.dtype(np.float64) if exact else rows.dtype
    for _, block in rows.column_blocks(dtype.itemsize, block_bytes):
        fastls.gram_update(K, np.ascontiguousarray(block.T, dtype=dtype), block_rows=DUAL_BLOCK_FEATURES)
    return K


def _column_blocks(n, d, itemsize, block_bytes):
    """Slices of d columns, each of at most ``block_bytes`` for n rows (at least one column)."""
    step = max(1, int(block_bytes) // max(1, n * itemsize))
    return [slice(first, first + step) for first in range(0, d, step)]


class DualSolve(LayerSolver):
    """Each group solved over its own rows: (F F^T + gamma I) alpha = UZ by Cholesky, W = F^T alpha.

    The same minimizer of ||Z - X W||^2 + gamma ||W||^2 as
    :class:`FixedGamma`, through an N x N system instead of a d x d one.
    With float32 rows and a fixed gamma, K = F F^T is summed from float32
    products and the solve refined against float64 products with F
    (:func:`fastls.refined_ridge_solve`, a pass over F per step), which
    gives the solution of the float64 K's system for a fraction of its
    cost; a refinement that does not converge within ``DUAL_REFINE_PASSES``
    passes, or whose float32 K + gamma I does not factor, is replaced by that
    float64 K's solve. With ``gamma="auto"`` each group's gamma minimizes GCV over
    the eigendecomposition of its K, multiplied in float64
    (:meth:`fastls.RidgePath.from_kernel`, on
    :meth:`~fastls.RidgePath.from_statistics`'s grid: the criterion of
    :class:`GroupGCV`), and alpha comes from the same eigenpairs.

    Parameters
    ----------
    gamma : float or "auto"
    expand : ndarray of shape (k, m) or None
        The label code the clients' UZ holds coordinates in (uploads of
        ``coordinates``): W = (F^T alpha) expand.
    n_groups : int
    block_bytes : int
        Largest block of F cast to float64 at once.
    refine : bool, default=True
        Refine float32 products as above (False: float64 products throughout).

    Attributes
    ----------
    refinements : dict
        Group -> the report of its refined solve (:func:`fastls.refined_ridge_solve`'s, with
        ``"fallback"``: True when the float64 K's solve replaced it).
    """

    def __init__(self, gamma: float | str, expand: np.ndarray | None, n_groups: int,
                 block_bytes: int = DUAL_BLOCK_BYTES, refine: bool = True) -> None:
        super().__init__(None, n_groups)
        self.gamma, self.expand, self.block_bytes, self.refine = gamma, expand, int(block_bytes), bool(refine)
        self.refinements = {}

    def _solve_group(self, k, rows, selection):
        UZ = np.asarray(rows.UZ, dtype=np.float64)
        d = rows.shape[1]
        if self.gamma == "auto":
            K = dual_gram(rows, self.block_bytes)
            grid = fastls.DEFAULT_GRID * (float(np.trace(K)) / d if np.trace(K) > 0 else 1.0)
            path = fastls.RidgePath.from_kernel(K, UZ, d, rhs_basis=self.expand, overwrite_k=True)
            gamma, grid, scores = path.select("gcv", shifts=grid)
            selection[str(k) if self.n_groups > 1 else "all"] = {
                "gamma": gamma, "criterion": "gcv", "grid": grid.tolist(), "scores": scores.tolist()}
            alpha = path.dual_coefficients(gamma)
            del K, path  # the N x N eigenvectors, before the pass that forms W
        else:
            alpha = self._refined(k, rows, UZ) if self.refine and rows.dtype != np.float64 else None
            if alpha is None:  # float64 rows, no refinement asked, or a refinement that failed
                alpha = fastls.ridge_solve(dual_gram(rows, self.block_bytes), UZ, self.gamma, overwrite_g=True,
                                           overwrite_c=UZ is not rows.UZ)  # the caller's UZ is not written
        W = rows.products(alpha, self.block_bytes, gram=False)[0]
        if self.expand is not None:
            W = fastls.matmul(W, self.expand.astype(np.float64, copy=False), check_finite=False)
        return W

    def _refined(self, k, rows, UZ):
        """alpha from float32 products' K, refined against float64 products with F; None (after a warning) if
        that fails, for the caller's solve with a float64 K."""
        try:
            alpha, report = fastls.refined_ridge_solve(
                dual_gram(rows, self.block_bytes, exact=False), UZ, self.gamma,
                lambda V: rows.products(V, self.block_bytes)[1], overwrite_g=True, max_iter=DUAL_REFINE_PASSES,
                check_finite=False)
            why = (None if report["converged"] else
                   f"it did not converge (last correction {report['correction']:.2g} of alpha after "
                   f"{report['iterations']} passes over F)")
        except np.linalg.LinAlgError:
            # float32 rounding can leave K + gamma I indefinite where the float64 K's is not (K near singular).
            report, why = {"iterations": 0, "correction": None, "converged": False}, (
                "K + gamma I from float32 products is not positive definite")
        report["fallback"] = why is not None
        self.refinements[k] = report
        if why is None:
            return alpha
        warnings.warn(f"group {k}'s dual solve from float32 products failed: {why}; solving again with K "
                      f"multiplied in float64", RuntimeWarning, stacklevel=2)
        return None

    def _final_gamma(self, withheld, selection):
        return self.gamma


def primal_bytes(d: int, itemsize: int = 8, gcv: bool = False) -> int:
    """What the server holds to solve a layer of ``d`` inputs from its Grams.

    A group's summed Gram and one arriving client's (2 d^2 values), and for
    GCV the eigendecomposition's eigenvectors and workspace (2 d^2 float64).
    """
    return 2 * d * d * itemsize + (2 * d * d * 8 if gcv else 0)


def dual_bytes(rows: int, gcv: bool = False) -> int:
    """What the server holds to solve a group of ``rows`` factored rows: K (N^2 float64), x 3 with GCV.

    GCV's eigendecomposition runs in place on K (its eigenvectors overwrite
    it) with a workspace of about 2 N^2 values.
    """
    return int(rows) * int(rows) * 8 * (3 if gcv else 1)


def solve_form(server_solve: str, position: int, d: int, rows: int | None, n_rhs: int, memory_bytes: int,
               itemsize: int = 8, gcv: bool = False) -> tuple[str, dict]:
    """How layer ``position`` is solved, and the record of why: the primal (the Gram) or the dual (the rows).

    The rule (``server_solve="auto"``): the primal wherever what it holds
    (:func:`primal_bytes`) fits ``memory_bytes``; else the dual wherever its
    N x N system does (:func:`dual_bytes`, N the largest group's rows:
    groups are solved one at a time); else neither, and ValueError names
    both sizes. The record holds both forms' bytes and flops
    (:func:`fastls.proximal_cost`'s counts: the ridge solve is the proximal
    one without the centre). ``"primal"`` and ``"dual"`` force a form; a
    forced dual whose system exceeds ``memory_bytes`` is refused too (its
    clients would each draw an n_i x n_i rotation of the same order).

    Parameters
    ----------
    server_solve : {"auto", "primal", "dual"}
    position : int
        The layer (0-based), named in errors.
    d : int
        The layer's inputs (bias included).
    rows : int or None
        The largest group's least-squares rows; None where not known (then
        the auto rule can only take the primal).
    n_rhs : int
        Right-hand sides of the solve (the label code's coordinates or the outputs).
    memory_bytes : int
        What the server's solve may hold in RAM.
    itemsize : int
        Bytes of one value of the server's sums.

    Returns
    -------
    (form, record) : ("primal" or "dual", dict)
    """
    if server_solve not in SERVER_SOLVES:
        raise ValueError(f"server_solve must be one of {SERVER_SOLVES}, got {server_solve!r}")
    gram_bytes = d * d * itemsize
    record = {"gram_bytes": gram_bytes, "primal_bytes": primal_bytes(d, itemsize, gcv),
              "memory_bytes": int(memory_bytes)}
    if rows is not None:
        record.update(rows=int(rows), dual_bytes=dual_bytes(rows, gcv), flops=fastls.proximal_cost(rows, d, n_rhs))
    if server_solve == "dual" and rows is not None and record["dual_bytes"] > memory_bytes:
        raise ValueError(f"layer {position + 1}: --server-solve dual would solve an N x N system over a group's "
                         f"{rows} rows ({record['dual_bytes'] / 2**30:.1f} GiB{' with GCV' if gcv else ''}), over "
                         f"the server's memory budget of {memory_bytes / 2**30:.1f} GiB: use --server-solve auto "
                         f"(the primal wherever the Gram fits), raise --server-memory, or use more groups")
    if server_solve != "auto":
        return server_solve, record
    if record["primal_bytes"] <= memory_bytes or rows is None:
        return "primal", record
    if record["dual_bytes"] <= memory_bytes:
        return "dual", record
    raise ValueError(f"layer {position + 1}: neither its primal solve (d = {d}: Grams of "
                     f"{record['primal_bytes'] / 2**30:.1f} GiB) nor its dual system over a group's {rows} rows "
                     f"({record['dual_bytes'] / 2**30:.1f} GiB) fits the server's memory budget of "
                     f"{memory_bytes / 2**30:.1f} GiB{' (with GCV)' if gcv else ''}: raise server_memory "
                     f"(--server-memory), use a fixed gamma, a narrower model, or fewer rows per group (more groups)")


def choose_solver(gamma: float | str, gamma_scope: str, n_groups: int, basis: np.ndarray | None,
                  keep_total: bool = False, form: str = "primal", expand: np.ndarray | None = None,
                  position: int = 0) -> LayerSolver:
    """The solver of a layer of ``gamma`` (a number or ``"auto"``) with ``n_groups`` groups.

    ``keep_total``: the round may withhold groups (secure sums with several
    groups), which are then solved on the total of the others. ``form``:
    ``"dual"`` solves from the factored uploads (:class:`DualSolve`, whose
    ``expand`` is the label code of coordinate uploads), group by group: a
    gamma by GCV pooled over several groups (``gamma_scope="all"``) is
    refused.
    """
    if form == "dual":
        if gamma == "auto" and gamma_scope == "all" and n_groups > 1:
            raise ValueError(f"layer {position + 1} is solved in the dual (its Gram does not fit the server, or "
                             f"server_solve='dual'), group by group over each group's rows, and gamma='auto' with "
                             f"gamma_scope='all' chooses one gamma by GCV over all {n_groups} groups' rows together: "
                             f"use gamma_scope='group' (--gamma-scope group), a fixed gamma (--gamma, or "
                             f"--gamma-output for the output layer), a larger --server-memory so that the Gram "
                             f"fits, or --server-solve primal")
        if keep_total:
            raise ValueError(f"layer {position + 1}: a dual solve cannot solve a withheld group on the others' sums")
        return DualSolve(gamma, expand, n_groups)
    if gamma != "auto":
        return FixedGamma(gamma, basis, n_groups, keep_total)
    if gamma_scope == "all" and n_groups > 1:
        return PooledGCV(basis, n_groups, keep_total)
    return GroupGCV(basis, n_groups, keep_total)
