"""The baselines' server loop: broadcast, local training, sample-weighted averaging."""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..checkpoint import check_fingerprint, read_state, write_state
from ..timing import Clock, RoundLog, payload_bytes
from ..transport import Transport, overall_accuracy
from .hyper import BASELINES

__all__ = ["DIVERGED_SIZE", "PERSONALIZED", "BaselineCheckpoints", "Diverged", "load_baseline_checkpoint",
           "run_baseline", "save_baseline_checkpoint"]

_FORMAT = "fedlayer-baseline-checkpoint-1"
#: Fingerprint keys newer than the format (a checkpoint without one was written before it was checked).
_ADDED_KEYS = ("eval_every",)


def save_baseline_checkpoint(path: str | os.PathLike, *, fingerprint: Mapping[str, Any] | None,
                             params: npt.ArrayLike, rounds: list[dict[str, Any]],
                             best_accuracy: float | None) -> None:
    """Write a baseline's state after ``len(rounds)`` rounds to ``path`` atomically.

    The state is all a baseline carries from round to round: the global
    parameters (bit for bit) and the records so far. Every random draw is
    seeded by (seed, client, round), so a resumed run repeats the rounds an
    uninterrupted one would have run.

    Parameters
    ----------
    path : str or os.PathLike
    fingerprint : dict or None
        The settings that determine the parameters; a resume must match them.
    params : array_like of shape (n_params,)
        The global parameters, stored as float64.
    rounds : list of dict
        The round records so far (:func:`run_baseline`'s).
    best_accuracy : float or None
    """
    write_state(path, {"format": _FORMAT, "fingerprint": fingerprint, "rounds": rounds,
                       "best_accuracy": best_accuracy}, {"params": np.asarray(params, dtype=np.float64)},
                compress=True)  # the per-client records of many rounds deflate well (docs/results/fedlayer_notes.md)


def load_baseline_checkpoint(path: str | os.PathLike, fingerprint: Mapping[str, Any] | None) -> dict[str, Any]:
    """The state :func:`save_baseline_checkpoint` wrote, refused if damaged or of another configuration.

    ``fingerprint`` is the resuming run's; keys added to the fingerprint after
    the file was written match any value. ``None`` reads the state of any
    configuration (a progress report, not a resume).

    Returns
    -------
    dict
        ``"params"`` (n_params,) float64, ``"rounds"`` (the records so far)
        and ``"best_accuracy"``.
    """
    state, arrays = read_state(path, _FORMAT)
    if fingerprint is not None:
        # Keys added to the fingerprint after checkpoints of this format were written match any value.
        saved = {**{key: fingerprint[key] for key in _ADDED_KEYS if key in fingerprint}, **state["fingerprint"]}
        check_fingerprint(path, saved, fingerprint)
    return {"params": arrays["params"], "rounds": state["rounds"], "best_accuracy": state["best_accuracy"]}


class Diverged(RuntimeError):
    """A baseline's global parameters ran away (NaN, Inf or past :data:`DIVERGED_SIZE`): its steps are too large."""


#: A parameter this large in absolute value means the run has diverged, finite or not (pFedMe with
#: personal_lr * lamda > 2 grows geometrically for hundreds of rounds before it overflows).
DIVERGED_SIZE = 1e30
#: The hyperparameters that set a step's size, named when a run diverges.
STEP_SIZES = ("lr", "personal_lr", "lamda", "beta", "mu", "sigma")

#: Baselines whose accuracy is that of each client's personalized model theta.
PERSONALIZED = ("pfedme", "pfedzo")


@dataclass(frozen=True)
class BaselineCheckpoints:
    """Where and how often :func:`run_baseline` writes its state (:func:`save_baseline_checkpoint`).

    Parameters
    ----------
    path : path
        The checkpoint file, written atomically after every ``every``-th round and the last.
    every : int >= 1, default=10
    fingerprint : dict or None
        The settings that determine the parameters, stored with the state.
    """

    path: str | os.PathLike
    every: int = 10
    fingerprint: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, numbers.Integral) or self.every < 1:
            raise ValueError(f"checkpoints are written every n >= 1 rounds, got every={self.every!r}")


def run_baseline(transport: Transport, algorithm: str, rounds: int, *, clock: Clock = Clock(), eval_every: int = 1,
                 progress: Callable[[str], object] | None = None, init_params: npt.ArrayLike | None = None,
                 checkpoints: BaselineCheckpoints | None = None, resume: Mapping[str, Any] | None = None,
                 **hyper: Any) -> dict[str, Any]:
    """Run a baseline for ``rounds`` rounds over ``transport``'s clients (all participate every round).

    Parameters
    ----------
    transport : Transport of :class:`BaselineClient`
    algorithm : {"fedavg", "fedzo", "baffle", "pfedme", "pfedzo"}
    rounds : int
    clock : Clock
        Communication time of the parameter vector, down and up, per client and round.
    eval_every : int
        Overall test accuracy after every ``eval_every``-th round and the last (``accuracy`` None in the others).
    progress : callable(str) or None
    init_params : flat ndarray or None
        Initial global parameters; None asks the first client for the seeded ones.
    checkpoints : BaselineCheckpoints or None
        Where and how often the state is written; None writes none.
    resume : dict or None
        A :func:`load_baseline_checkpoint` state: training goes on after its last round (none if it holds ``rounds``).
    **hyper
        Local hyperparameters (:data:`BASELINES`); ``beta``: the server's pFedMe/pFedZO mixing weight (default 1).

    Returns
    -------
    dict
        "rounds" (:class:`fedlayer.timing.RoundLog` records, each with "wall_s", the round's wall time, evaluation
        included), "accuracy" (of the last round), "best_accuracy" (best evaluated round), "params" (final global
        parameters). Accuracy is correct / total over all clients' local test splits, of the global model (FedAvg,
        FedZO, BAFFLE) or of each client's personalized model theta (pFedMe, pFedZO).

    Raises
    ------
    ValueError
        Unknown algorithm, ``rounds`` or ``eval_every`` < 1, or a ``resume`` holding more rounds than ``rounds``.
    Diverged
        The global parameters became non-finite or larger than :data:`DIVERGED_SIZE`.
    """
    algorithm = str(algorithm).lower()
    if algorithm not in BASELINES:
        raise ValueError(f"unknown baseline {algorithm!r}; choose one of {sorted(BASELINES)}")
    if int(rounds) < 1 or int(eval_every) < 1:
        raise ValueError(f"rounds and eval_every must be >= 1, got {rounds} and {eval_every}")
    hyper = {key: value for key, value in hyper.items() if key != "rounds"}
    beta = float(hyper.pop("beta", 1.0))
    personalized = algorithm in PERSONALIZED
    cids = transport.client_ids
    w, records, best = _start(transport, cids, algorithm, int(rounds), int(eval_every), init_params, checkpoints,
                              resume)
    saved = len(records)  # the round the checkpoint on disk holds (0: none)

    for r in range(len(records), int(rounds)):
        round_start = time.perf_counter()
        log = RoundLog("federated", None, clock)
        weighted_sum, total_n = _local_rounds(transport, log, {"algorithm": algorithm, "params": w, "round_index": r,
                                                               **hyper})
        start = time.perf_counter()
        mean = weighted_sum / total_n
        w = (1.0 - beta) * w + beta * mean if personalized else mean
        log.server_s = time.perf_counter() - start
        kept = f"; {checkpoints.path} holds the state after round {saved}" if saved and checkpoints else ""
        _raise_if_diverged(w, algorithm, r, {**hyper, "beta": beta}, kept)
        accuracy = None
        if (r + 1) % int(eval_every) == 0 or r + 1 == int(rounds):
            # Personalized baselines score each client's own theta; the others the global w.
            accuracy = overall_accuracy(transport, {cid: ({} if personalized else {"params": w}) for cid in cids})
            best = accuracy if best is None or accuracy > best else best
        records.append({**log.record(accuracy), "wall_s": time.perf_counter() - round_start})
        if checkpoints is not None and ((r + 1) % checkpoints.every == 0 or r + 1 == int(rounds)):
            save_baseline_checkpoint(checkpoints.path, fingerprint=checkpoints.fingerprint, params=w, rounds=records,
                                     best_accuracy=best)
            saved = r + 1
        if progress:
            progress(f"{algorithm} round {r + 1}/{rounds}"
                     + (f", accuracy {accuracy:.4f}" if accuracy is not None else ""))
    return {"rounds": records, "accuracy": records[-1]["accuracy"], "best_accuracy": best, "params": w}


def _start(transport, cids, algorithm, rounds, eval_every, init_params, checkpoints, resume):
    """(global parameters, records, best accuracy) before the first round to run: a checkpoint's, or fresh ones."""
    records, best = [], None
    if resume is not None:
        init_params, records, best = _resumed(resume, algorithm, rounds, eval_every, checkpoints)
    elif init_params is None:
        (_, first), = transport.call("initial_params", {cids[0]: {}})
        init_params = first["params"]
    return np.array(init_params, dtype=np.float64), records, best


def _resumed(resume, algorithm, rounds, eval_every, checkpoints):
    """(params, records, best accuracy) to go on from a checkpoint's ``resume`` state towards ``rounds``."""
    records, best = list(resume["rounds"]), resume["best_accuracy"]
    if len(records) > rounds:
        path = None if checkpoints is None else checkpoints.path
        raise ValueError(f"the checkpoint {path} holds {len(records)} rounds of {algorithm}, more than "
                         f"the {rounds} asked for: ask for at least {len(records)} rounds, or remove it to "
                         f"start over")
    if len(records) < rounds and len(records) % eval_every and records[-1]["accuracy"] is not None:
        # The earlier run's last round was scored because it was last; going on, it is off the schedule.
        records[-1] = {**records[-1], "accuracy": None}
        scored = [record["accuracy"] for record in records if record["accuracy"] is not None]
        best = max(scored) if scored else None
    return resume["params"], records, best


def _local_rounds(transport, log, args):
    """Every client's local training from the same ``args``: (sum of n_i params_i, sum of n_i), logged."""
    w = args["params"]
    cids = transport.client_ids
    total_n = 0
    acc_sum = np.zeros_like(w)
    # Summed in the clients' order, not as they arrive: the same weights in process and under MPI (the
    # zeroth-order estimates would amplify a different rounding of the sum).
    results = dict(transport.call("local_train", {cid: dict(args) for cid in cids}))
    for cid in cids:
        result = results.pop(cid)
        log.arrived(cid, result["compute_s"], payload_bytes({"params": result["params"], "n": result["n"]}))
        log.sent(cid, w.nbytes)
        acc_sum += result["n"] * result["params"]
        total_n += result["n"]
        del result
    return acc_sum, total_n


def _raise_if_diverged(w, algorithm, r, steps, kept):
    """Raise :class:`Diverged` when round ``r`` left ``w`` non-finite or past :data:`DIVERGED_SIZE`.

    ``kept`` ends the message: what the checkpoint on disk still holds, if anything.
    """
    largest = float(np.max(np.abs(w))) if w.size else 0.0
    if not largest <= DIVERGED_SIZE:  # NaN compares false too
        # Scored, a NaN model predicts one class everywhere: a number that looks like a result.
        steps = {k: v for k, v in steps.items() if k in STEP_SIZES}
        what = "hold NaN or Inf" if not np.isfinite(largest) else f"reach {largest:.3g} in absolute value"
        raise Diverged(f"{algorithm} diverged in round {r + 1}: its global parameters {what} ({steps}); "
                       f"lower the step sizes (--hyper){kept}")
