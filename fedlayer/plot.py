"""PNG plots of a results.json: accuracy per round, per-client time breakdown, GCV curves of ``--gamma auto``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_results"]


def plot_results(results_path, out_dir=None):
    """Write ``accuracy.png``, ``time_breakdown.png`` (and ``gcv.png`` for ``--gamma auto``); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    results_path = Path(results_path)
    results = _read_results(results_path)
    out = Path(out_dir) if out_dir else results_path.parent
    out.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    title = f"{cfg['algorithm']}: {cfg['dataset']}, {cfg['model']} model, {results['n_clients']} clients"

    keys = [k for k, r in results["rounds"].items() if r["accuracy"] is not None]
    rounds = [int(k) for k in keys]
    accuracy = [100 * results["rounds"][k]["accuracy"] for k in keys]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(rounds, accuracy, marker="o")
    # Analytic rounds train one layer each: mark which stage; the baselines' rounds are all alike.
    layered = any(results["rounds"][k]["layer"] is not None for k in keys)
    if layered:
        for k, x, y in zip(keys, rounds, accuracy):
            ax.annotate(results["rounds"][k]["stage"][0].upper(), (x, y), textcoords="offset points",
                        xytext=(0, 7), ha="center", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round (F = federated layer, P = personalized layer)" if layered else "round")
    ax.set_ylabel("overall test accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    accuracy_png = out / "accuracy.png"
    fig.tight_layout()
    fig.savefig(accuracy_png, dpi=120)
    plt.close(fig)

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


def _read_results(path):
    """The parsed results.json, or ValueError naming the file and what it lacks."""
    with open(path) as f:
        try:
            results = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a fedlayer results.json: not JSON ({err})") from None
    needed = ("config", "n_clients", "rounds")
    missing = [key for key in needed if key not in results] if isinstance(results, dict) else list(needed)
    if missing:
        raise ValueError(f"{path} is not a fedlayer results.json: it lacks {missing} "
                         f"(expected the file `fedlayer run --output DIR` writes as DIR/results.json)")
    return results


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
