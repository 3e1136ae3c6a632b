"""PNG plots of a results.json: accuracy per round, per-client time breakdown."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_results"]


def plot_results(results_path, out_dir=None):
    """Write ``accuracy.png`` and ``time_breakdown.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results_path = Path(results_path)
    with open(results_path) as f:
        results = json.load(f)
    out = Path(out_dir) if out_dir else results_path.parent
    out.mkdir(parents=True, exist_ok=True)
    cfg = results["config"]
    title = f"{cfg['algorithm']} on {cfg['dataset']}-{cfg['model']} ({results['n_clients']} clients)"

    keys = [k for k, r in results["rounds"].items() if r["accuracy"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    stages = [results["rounds"][k]["stage"] for k in keys]
    ax.plot([int(k) for k in keys], [results["rounds"][k]["accuracy"] for k in keys], marker="o")
    for k, stage in zip(keys, stages):
        ax.annotate(stage[0].upper(), (int(k), results["rounds"][k]["accuracy"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xlabel("round (F = federated layer, P = personalized layer)")
    ax.set_ylabel("overall test accuracy")
    ax.set_title(title, fontsize=9)
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
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = np.zeros(len(cids))
    for column, label in enumerate(("compute", "idle", "communication")):
        ax.bar(range(len(cids)), parts[:, column], bottom=bottom, label=label, width=0.9)
        bottom += parts[:, column]
    ax.set_xlabel("client")
    ax.set_ylabel("total training time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    time_png = out / "time_breakdown.png"
    fig.tight_layout()
    fig.savefig(time_png, dpi=120)
    plt.close(fig)
    return [accuracy_png, time_png]
