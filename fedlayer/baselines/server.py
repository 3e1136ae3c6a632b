"""The baselines' server loop: broadcast, local training, sample-weighted averaging."""

from __future__ import annotations

import time

import numpy as np

from ..timing import Clock, RoundLog, payload_bytes
from ..transport import overall_accuracy
from .hyper import BASELINES

__all__ = ["PERSONALIZED", "Diverged", "run_baseline"]


class Diverged(RuntimeError):
    """The global parameters of a baseline became NaN or infinite: its step sizes are too large."""

#: Baselines whose accuracy is that of each client's personalized model theta.
PERSONALIZED = ("pfedme", "pfedzo")


def run_baseline(transport, algorithm, rounds, *, clock=Clock(), eval_every=1, progress=None,
                 init_params=None, **hyper):
    """Run a baseline for ``rounds`` rounds over ``transport``'s clients (all participate every round).

    Parameters
    ----------
    transport : Transport of :class:`BaselineClient`
    algorithm : one of "fedavg", "fedzo", "baffle", "pfedme", "pfedzo"
    rounds : int
    clock : Clock
        Communication time of the parameter vector, down and up, per client and round.
    eval_every : int
        Overall test accuracy after every ``eval_every``-th round and the last
        one (``accuracy`` is None in the other records).
    progress : callable(str) or None
    init_params : flat ndarray or None
        Initial global parameters; None asks the first client for the seeded ones.
    **hyper
        Local hyperparameters (see :data:`BASELINES`); ``beta`` is the
        server's pFedMe/pFedZO mixing weight (default 1).

    Returns
    -------
    dict with "rounds" (:class:`fedlayer.timing.RoundLog` records), "accuracy"
    (of the last round), "best_accuracy" (best evaluated round) and "params"
    (final global parameters).

    Accuracy is the overall test accuracy: correct / total summed over all
    clients' local test splits, of the global model (FedAvg, FedZO, BAFFLE)
    or of each client's personalized model theta (pFedMe, pFedZO).
    """
    algorithm = str(algorithm).lower()
    if algorithm not in BASELINES:
        raise ValueError(f"unknown baseline {algorithm!r}; choose one of {sorted(BASELINES)}")
    if int(rounds) < 1 or int(eval_every) < 1:
        raise ValueError("rounds and eval_every must be >= 1")
    hyper = dict(hyper)
    hyper.pop("rounds", None)
    beta = float(hyper.pop("beta", 1.0))
    personalized = algorithm in PERSONALIZED
    cids = transport.client_ids
    if init_params is None:
        (_, first), = transport.call("initial_params", {cids[0]: {}})
        init_params = first["params"]
    w = np.array(init_params, dtype=np.float64)

    records, best = [], None
    for r in range(int(rounds)):
        log = RoundLog("federated", None, clock)
        args = {cid: {"algorithm": algorithm, "params": w, "round_index": r, **hyper} for cid in cids}
        total_n = 0
        acc_sum = np.zeros_like(w)
        for cid, result in transport.call("local_train", args):
            log.arrived(cid, result["compute_s"], payload_bytes({"params": result["params"], "n": result["n"]}))
            log.sent(cid, w.nbytes)
            acc_sum += result["n"] * result["params"]
            total_n += result["n"]
            del result
        start = time.perf_counter()
        mean = acc_sum / total_n
        w = (1.0 - beta) * w + beta * mean if personalized else mean
        log.server_s = time.perf_counter() - start
        if not np.isfinite(w).all():
            # Scored, a NaN model predicts one class everywhere: a number that looks like a result.
            steps = {k: v for k, v in hyper.items() if k in ("lr", "personal_lr", "mu", "sigma")}
            raise Diverged(f"{algorithm} diverged in round {r + 1}: its global parameters hold NaN or Inf "
                           f"({steps}); lower the step sizes (--hyper)")
        accuracy = None
        if (r + 1) % int(eval_every) == 0 or r + 1 == int(rounds):
            # Personalized baselines score each client's own theta; the others the global w.
            args = {cid: ({} if personalized else {"params": w}) for cid in cids}
            accuracy = overall_accuracy(transport, args)
            best = accuracy if best is None or accuracy > best else best
        records.append(log.record(accuracy))
        if progress:
            progress(f"{algorithm} round {r + 1}/{rounds}"
                     + (f", accuracy {accuracy:.4f}" if accuracy is not None else ""))
    return {"rounds": records, "accuracy": records[-1]["accuracy"], "best_accuracy": best, "params": w}
