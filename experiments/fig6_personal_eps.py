"""Fig. 6's personalized classifier against eps, from one finished full-width pFedACnnL-WC run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/fig6_personal_eps.py \
        --run results/fig6-same/pfedacnnl-wc [--clients 0 1 ...] [--out FILE] [--json FILE]

A personalizing run keeps every client's model (``personalized/clientN.npz``).
The classifier's personalization, eq. (13) with the global classifier M as
its center, can be solved again for any eps from the client's own rows: each
client's training and test images pass its personalized convolutions once,
and one thin SVD of its classifier rows (fastls.RidgePath.from_rows) gives the
solution and the exact leave-one-out error for every eps. Accuracies are over
the union of the clients' test splits, each image scored by its own client's
model, as the figure's. Two checks tie the table to the run: at the run's eps
each client's solution must be its saved classifier, and the limit eps -> inf
(the global classifier over the personalized convolutions) must give the run's
accuracy before the classifier was personalized. The convolutions keep the
run's personalized weights: this varies the classifier's eps only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import fastls
from dev_layout import emit_report, use_shared_data
from fig6_classifier_gamma import classifier_rows
from fedlayer.models import Model
from fedlayer.run import RunConfig, load_dataset

EPSES = [10.0, 100.0, 1e3, 2500.0, 1e4, 4e4, 1e5, 3e5, 1e6, 1e7, 1e8]  # 2500: the paper's


def client_eps_scores(model, data, n_classes, M, epses, run_eps):
    """One client's test predictions' correct counts for each eps, its leave-one-out eps, and checks.

    Parameters
    ----------
    model : Model
        The client's personalized model (its classifier solved at the run's eps).
    data : ClientData
    n_classes : int
    M : ndarray of shape (d, n_classes)
        The global classifier, the personalization's center.
    epses : sequence of float
    run_eps : float
        The eps the run personalized the classifier with.

    Returns
    -------
    dict with ``correct`` (one count per eps, then eps = inf, then the two leave-one-out choices),
    ``total``, ``loo_eps`` and ``loo_class_eps`` (leave-one-out's choices by squared error and by class
    errors), ``saved_difference`` (the relative Frobenius difference between the solution at the run's
    eps and the saved classifier) and the seconds of the forward passes and the path.
    """
    start = time.perf_counter()
    A = classifier_rows(model, data.x_train)
    T = classifier_rows(model, data.x_test)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    Y = np.eye(n_classes)[data.y_train]
    path = fastls.RidgePath.from_rows(A, Y, center=M)
    loo_eps = float(path.select("loo")[0])
    loo_class_eps = float(path.select("loo_class", labels=data.y_train)[0])
    path_s = time.perf_counter() - start
    T64 = T.astype(np.float64)

    def correct(W):
        return int(np.count_nonzero((T64 @ W).argmax(axis=1) == data.y_test))

    solutions = {eps: path.solve(eps) for eps in {*epses, run_eps, loo_eps, loo_class_eps}}
    counts = [correct(solutions[eps]) for eps in epses] + [correct(M), correct(solutions[loo_eps]),
                                                         correct(solutions[loo_class_eps])]
    saved = model.layers[model.trainable[-1]].weights.astype(np.float64)
    at_run = solutions[run_eps]
    difference = float(np.linalg.norm(at_run - saved) / np.linalg.norm(saved))
    return {"correct": counts, "total": len(data.y_test), "loo_eps": loo_eps, "loo_class_eps": loo_class_eps,
            "saved_difference": difference, "forward_s": forward_s, "path_s": path_s, "rows": list(A.shape)}


def personal_eps_table(run_folder, epses=EPSES, *, global_model=None, clients=None, json_path=None,
                       progress=print):
    """Accuracy of a finished pFedACnnL-WC run's clients over their test splits, the classifier re-personalized per eps.

    Parameters
    ----------
    run_folder : path
        The run's output folder: its ``results.json`` (the run's settings) and ``personalized/clientN.npz``.
    epses : sequence of float
    global_model : path, optional
        The personalization's center; default: the run's own ``model.npz``.
    clients : sequence of int, optional
        Only these clients (default: all).
    json_path : path, optional
        Per-client figures, written after every client and read back first (an interrupted table resumes).

    Returns
    -------
    dict: ``accuracy`` (%, one per eps, then eps = inf, then the two leave-one-out choices), ``clients``
    (the per-client records of :func:`client_eps_scores`), ``total`` (test images) and ``run_eps``.
    """
    run_folder = Path(run_folder)
    settings = json.loads((run_folder / "results.json").read_text())["config"]
    if settings["algorithm"] != "pfedacnnl-wc":
        raise ValueError(f"{run_folder} holds a {settings['algorithm']} run; the table needs pfedacnnl-wc's, "
                         f"whose clients all personalized around one global model")
    run_eps = settings.get("eps_output") or settings["eps"]  # the classifier's, as the run chose it
    if isinstance(run_eps, str):
        raise ValueError(f"{run_folder}'s run personalized its classifier with eps={run_eps!r}; the table checks "
                         f"each client's saved classifier against a fixed eps (a number)")
    config = RunConfig(**{key: settings[key] for key in RunConfig.__dataclass_fields__ if key in settings})
    dataset = load_dataset(config)
    model, _ = Model.load(run_folder / "model.npz" if global_model is None else global_model)
    M = model.layers[model.trainable[-1]].weights.astype(np.float64)
    del model
    done = {}
    if json_path and Path(json_path).exists():
        done = {int(k): v for k, v in json.loads(Path(json_path).read_text())["clients"].items()}
    for client in range(len(dataset.clients)) if clients is None else clients:
        if client in done:
            continue
        model, _ = Model.load(run_folder / "personalized" / f"client{client}.npz")
        record = client_eps_scores(model, dataset.clients[client], dataset.n_classes, M, epses, run_eps)
        done[client] = record
        progress(f"client {client}: {record['rows'][0]} rows, {record['total']} test images, loo eps "
                 f"{record['loo_eps']:.4g} (by class errors {record['loo_class_eps']:.4g}), saved classifier "
                 f"within {record['saved_difference']:.2e}, forward {record['forward_s']:.1f} s, "
                 f"path {record['path_s']:.1f} s")
        if json_path:
            Path(json_path).write_text(json.dumps({"epses": list(epses), "clients": done}, indent=1))
    total = sum(r["total"] for r in done.values())
    counts = np.sum([r["correct"] for r in done.values()], axis=0)
    return {"accuracy": 100.0 * counts / total, "clients": done, "total": total, "run_eps": run_eps}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="output folder of a finished pFedACnnL-WC run")
    parser.add_argument("--global-model", default=None,
                        help="model.npz of the federated model it personalized (default: the run's own)")
    parser.add_argument("--clients", type=int, nargs="*", default=None, help="only these clients (a quick check)")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--json", default=None, help="per-client figures, written after every client")
    args = parser.parse_args(argv)
    use_shared_data()
    table = personal_eps_table(args.run, EPSES, global_model=args.global_model, clients=args.clients,
                               json_path=args.json, progress=lambda line: print(line, flush=True))
    done, accuracy = table["clients"], table["accuracy"]
    loo = np.array([r["loo_eps"] for r in done.values()])
    loo_class = np.array([r["loo_class_eps"] for r in done.values()])
    differences = np.array([r["saved_difference"] for r in done.values()])
    forward_s = sum(r["forward_s"] for r in done.values())
    path_s = sum(r["path_s"] for r in done.values())
    d = next(iter(done.values()))["rows"][1]
    command = " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Fig. 6: a personalized run's classifier against eps", "",
             f"Command: `python experiments/fig6_personal_eps.py {command}` ({len(done)} clients, {table['total']} "
             f"test images, classifier d = {d}; forward passes {forward_s:.0f} s, paths {path_s:.0f} s). The "
             f"solution at the run's eps matches each client's saved classifier within {differences.max():.1e} "
             f"(relative, largest over the clients). Each test image is scored by its own client's model, "
             f"convolutions as the run personalized them, classifier re-personalized at each eps around the "
             f"run's global classifier. Discussion: [fig6_notes.md](fig6_notes.md).", "",
             "| eps | test accuracy (%) |", "|---|---|"]
    for eps, value in zip(EPSES, accuracy):
        mark = " (the run's)" if eps == table["run_eps"] else ""
        lines.append(f"| {eps:.4g}{mark} | {value:.2f} |")
    lines.append(f"| inf (the global classifier) | {accuracy[len(EPSES)]:.2f} |")
    lines.append(f"| each client's leave-one-out eps (median {np.median(loo):.4g}, range {loo.min():.3g} - "
                 f"{loo.max():.3g}) | {accuracy[len(EPSES) + 1]:.2f} |")
    lines.append(f"| each client's leave-one-out eps by class errors (median {np.median(loo_class):.4g}, range "
                 f"{loo_class.min():.3g} - {loo_class.max():.3g}) | {accuracy[len(EPSES) + 2]:.2f} |")
    emit_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
