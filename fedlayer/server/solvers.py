"""How a layer's weights come from its groups' summed statistics: one solver object, chosen once per layer.

:func:`choose_solver` picks the way the layer is solved from its gamma, the
gamma's scope and the number of groups (as scikit-learn's ``_RidgeGCV``
picks its decomposition once), and the round never asks again:

* :class:`FixedGamma`: each group's sums solved with the given gamma
  (eqs. 5, 11);
* :class:`GroupGCV`: each group's gamma minimizes GCV on its own sums;
* :class:`PooledGCV`: one gamma minimizes GCV on the sums over all groups,
  each group then solved with it (the groups' sums are held until then).

Secure sums with several groups keep the total over the groups as well: a
group whose sum could not be unmasked is solved on the other groups' total
(:meth:`LayerSolver.finish`). A further way of solving a layer (a dual
solve) is one more subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fastls

__all__ = ["FixedGamma", "GroupGCV", "LayerSolver", "PooledGCV", "SummedStatistics", "choose_solver", "gcv_choice"]


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


def choose_solver(gamma: float | str, gamma_scope: str, n_groups: int, basis: np.ndarray | None,
                  keep_total: bool = False) -> LayerSolver:
    """The solver of a layer of ``gamma`` (a number or ``"auto"``) with ``n_groups`` groups.

    ``keep_total``: the round may withhold groups (secure sums with several
    groups), which are then solved on the total of the others.
    """
    if gamma != "auto":
        return FixedGamma(gamma, basis, n_groups, keep_total)
    if gamma_scope == "all" and n_groups > 1:
        return PooledGCV(basis, n_groups, keep_total)
    return GroupGCV(basis, n_groups, keep_total)
