"""FedACnnL wall time in process vs under mpiexec, bytes per round vs the paper's O(.).

    python experiments/mpi_scaling.py [--dataset mnist] [--clients 100] [--out docs/results/mpi_scaling.md]

All runs happen in this script, one after the other, on the same data and
seed. Under MPI rank 0 is the server and ranks 1..R-1 host the clients.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


import fastls
from fedlayer.models import build_model
from fedlayer.run import RunConfig, load_dataset

from dev_layout import use_shared_data


def launch(cmd):
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--model", default="dnn")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", default="docs/results/mpi_scaling.md")
    args = parser.parse_args()
    use_shared_data()  # the checkout's ../shared/data unless FEDLAYER_DATA_DIR says otherwise
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("mpiexec not found: pip install '.[mpi]'", file=sys.stderr)
        return 1
    try:
        dataset = load_dataset(RunConfig(dataset=args.dataset, clients=args.clients))
    except FileNotFoundError as err:
        print(f"{args.dataset} not found: {err}", file=sys.stderr)
        return 1
    flags = ["run", "--algorithm", "fedacnnl", "--dataset", args.dataset, "--model", args.model,
             "--clients", str(args.clients), "--quiet"]
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in [1, *args.ranks]:
            out = Path(tmp) / f"r{ranks}"
            base = [sys.executable, "-m", "fedlayer", *flags, "--output", str(out)]
            cmd = base if ranks == 1 else [mpiexec, "-n", str(ranks), *base]
            wall = launch(cmd)
            results[ranks] = json.loads((out / "results.json").read_text())
            rows.append((ranks, wall))
            print(f"{'in-process' if ranks == 1 else f'mpiexec -n {ranks}'}: {wall:.1f} s", flush=True)

    model = build_model(args.model, dataset.feature_shape, dataset.n_classes)
    lines = [
        f"# FedACnnL over MPI: {args.dataset}-{args.model}, {args.clients} clients",
        "",
        f"Command: `python experiments/mpi_scaling.py --dataset {args.dataset} --model {args.model} --clients "
        f"{args.clients}` on {platform.machine()}, {fastls.available_cores()} cores (MPICH from the `mpich` wheel, "
        "shared memory). Wall time includes start-up and data loading on every rank.",
        "",
        "| run | wall (s) | sum of client compute (s) | measured MPI receive time on rank 0 (s) | final accuracy |",
        "|---|---|---|---|---|",
    ]
    for ranks, wall in rows:
        r = results[ranks]
        compute = sum(c["compute_s"] for rec in r["rounds"].values() for c in rec["clients"].values())
        recv = sum(part.get("receive_s", 0.0) for rec in r["rounds"].values()
                   for part in rec.get("transport", {}).values())
        name = "in-process" if ranks == 1 else f"mpiexec -n {ranks}"
        lines.append(f"| {name} | {wall:.1f} | {compute:.2f} | {recv:.3f} | {r['accuracy']:.4f} |")
    lines += [
        "",
        "Bytes per round (all clients) against the paper's O(d_{l-1}^2 + d_{l-1} d_l + theta_l) per client "
        "(counted in float64 values, times the number of clients):",
        "",
        "| layer | d_{l-1} (with bias) | d_l | bytes up | bytes down | paper's count x 8 B x clients | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    r = results[rows[0][0]]
    n_clients = r["n_clients"]
    for (key, record), index in zip(r["rounds"].items(), model.trainable):
        d_in, d_out = model.layers[index].ls_shape(model.input_shape_of(index))
        paper = (d_in * d_in + d_in * d_out + d_in * d_out) * 8 * n_clients
        moved = record["bytes_up"] + record["bytes_down"]
        lines.append(f"| {key} | {d_in} | {d_out} | {record['bytes_up']:,} | {record['bytes_down']:,} | {paper:,} | "
                     f"{moved / paper:.3f} |")
    t = r["time_per_client"]
    lines += ["", f"Simulated time per client in process: compute {t['compute_s']:.3f} s, communication "
                  f"{t['comm_s']:.4f} s (100 Gbit/s), idle {t['idle_s']:.3f} s."]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
