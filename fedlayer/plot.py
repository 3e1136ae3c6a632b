"""PNG plots of a results.json: accuracy per round, per-client time breakdown, GCV curves of ``--gamma auto``."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["plot_results"]


def plot_results(results_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write ``accuracy.png``, ``time_breakdown.png`` (and ``gcv.png`` for ``--gamma auto``); returns their paths.

    Parameters
    ----------
    results_path : str or os.PathLike
        A results.json as ``fedlayer run --output DIR`` writes it.
    out_dir : str or os.PathLike, optional
        Where the PNGs go (created if missing); default: beside the results.

    Returns
    -------
    list of Path

    Raises
    ------
    ValueError
        The results cannot be read or are not a fedlayer results.json (checked
        before any file is written), or ``out_dir`` is a file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    results_path = Path(results_path)
    results = _read_results(results_path)
    out = Path(out_dir) if out_dir else results_path.parent
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    title = f"{cfg['algorithm']}: {cfg['dataset']}, {cfg['model']} model, {results['n_clients']} clients"
    accuracy_png = _plot_accuracy(results, out / "accuracy.png", title, plt)

    totals = {}
    for record in results["rounds"].values():
        for cid, t in record["clients"].items():
            acc = totals.setdefault(int(cid), np.zeros(3))
            acc += (t["compute_s"], t["idle_s"], t["comm_s"])
    cids = sorted(totals)
    parts = np.array([totals[c] for c in cids]).reshape(-1, 3)
    shares = parts.sum(axis=0) / max(parts.sum(), 1e-300)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bottom = np.zeros(len(cids))
    for column, label in enumerate(("compute", "idle", "communication")):
        # The share in the legend keeps a part visible even when its bars are thinner than a pixel.
        ax.bar(range(len(cids)), parts[:, column], bottom=bottom, width=0.9,
               label=f"{label} ({100 * shares[column]:.3g} % of the total)")
        bottom += parts[:, column]
    ax.set_xlabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("total training time (s)")
    ax.set_title(title, fontsize=11)
    # Above the axes, so it hides no bar.
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.08), ncol=3, fontsize=8, frameon=False)
    time_png = out / "time_breakdown.png"
    fig.tight_layout()
    fig.savefig(time_png, dpi=120)
    plt.close(fig)
    gcv_png = _plot_gcv(results, out / "gcv.png", title, plt)
    return [accuracy_png, time_png] + ([gcv_png] if gcv_png else [])


def _plot_accuracy(results, path, title, plt):
    """Overall test accuracy per evaluated round, analytic rounds marked by their stage; returns ``path``."""
    from matplotlib.ticker import MaxNLocator

    keys = [k for k, r in results["rounds"].items() if r["accuracy"] is not None]
    rounds = [int(k) for k in keys]
    accuracy = [100 * results["rounds"][k]["accuracy"] for k in keys]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(rounds, accuracy, marker="o")
    # Analytic rounds train one layer each: mark which stage; the baselines' rounds are all alike.
    layered = any(results["rounds"][k]["layer"] is not None for k in keys)
    codes = [k for k in keys if results["rounds"][k].get("accuracy_of") == "codes"]
    if layered:
        for k, x, y in zip(keys, rounds, accuracy):
            # A round scored by its layer's label codes (--round-accuracy codes) is not the network's accuracy.
            mark = results["rounds"][k]["stage"][0].upper() + ("c" if k in codes else "")
            ax.annotate(mark, (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(("round (F = federated layer, P = personalized layer"
                   + (", c = scored by its label codes" if codes else "") + ")") if layered else "round")
    ax.set_ylabel("overall test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _read_results(path):
    """The parsed results.json, or ValueError naming the file and the first thing it lacks or holds wrongly."""
    try:
        with open(path) as f:
            results = json.load(f)
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a fedlayer results.json: not JSON ({err})") from None
    needed = ("config", "n_clients", "rounds")
    missing = [key for key in needed if key not in results] if isinstance(results, dict) else list(needed)
    if missing:
        raise ValueError(f"{path} is not a fedlayer results.json: it lacks {missing} "
                         f"(expected the file `fedlayer run --output DIR` writes as DIR/results.json)")
    problem = _results_problem(results)
    if problem:
        raise ValueError(f"{path} is not a fedlayer results.json as `fedlayer run` writes it: {problem}")
    return results


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _results_problem(results):
    """What in a results.json the plots cannot read (None when nothing): checked before any file is written."""
    config = results["config"]
    if not isinstance(config, dict) or not all(isinstance(config.get(k), str) for k in ("algorithm", "dataset",
                                                                                          "model")):
        return "config must hold the strings algorithm, dataset and model"
    if not isinstance(results["n_clients"], int) or isinstance(results["n_clients"], bool):
        return f"n_clients must be an integer, got {results['n_clients']!r}"
    rounds = results["rounds"]
    if not isinstance(rounds, dict):
        return f"rounds must map round numbers to records, got {type(rounds).__name__}"
    for key, record in rounds.items():
        where = f"round {key!r}"
        if not key.isdigit() or not isinstance(record, dict):
            return f"{where}: expected a round number mapping to a record"
        accuracy, layer = record.get("accuracy"), record.get("layer")
        if accuracy is not None and not (_is_number(accuracy) and 0 <= accuracy <= 1):
            return f"{where}: accuracy must be a fraction in [0, 1] or null, got {accuracy!r}"
        if layer is not None and not (isinstance(layer, int) and not isinstance(layer, bool)):
            return f"{where}: layer must be an integer or null, got {layer!r}"
        if not isinstance(record.get("stage"), str):
            return f"{where}: stage must be a string"
        clients = record.get("clients")
        if not isinstance(clients, dict):
            return f"{where}: clients must map client ids to their times"
        for cid, times in clients.items():
            if not cid.isdigit() or not isinstance(times, dict) or not all(
                    _is_number(times.get(part)) for part in ("compute_s", "idle_s", "comm_s")):
                return f"{where}, client {cid!r}: expected compute_s, idle_s and comm_s in seconds"
    return None


def _plot_gcv(results, path, title, plt):
    """One panel per layer: GCV(gamma) of each group (normalized to its minimum), the chosen gamma marked."""
    selections = [(r["layer"], r["selection"]) for r in results["rounds"].values() if "selection" in r]
    if not selections:
        return None
    fig, axes = plt.subplots(1, len(selections), figsize=(3.2 * len(selections), 3.4), squeeze=False)
    for ax, (layer, groups) in zip(axes[0], selections):
        # Keys: "all" (one gamma for every group) or the group numbers.
        for k, choice in sorted(groups.items(), key=lambda item: (len(item[0]), item[0])):
            grid = [g for g, s in zip(choice["grid"], choice["scores"]) if s is not None and s < float("inf")]
            scores = [s for s in choice["scores"] if s is not None and s < float("inf")]
            low = min(scores)
            line, = ax.loglog(grid, [s / low for s in scores], lw=1, label=None if len(groups) == 1 else f"group {k}")
            ax.axvline(choice["gamma"], color=line.get_color(), lw=0.6, ls="--")
        ax.set_title(f"layer {layer + 1}", fontsize=10)
        ax.set_xlabel("gamma")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GCV / its minimum")
    fig.suptitle(title + " (dashed: chosen gamma)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
