"""Fig. 6: CIFAR-10 with the paper's DCNN for FedACnnL, -WA, pFedACnnL, -WC and -WP.

    python experiments/fig6_cifar.py [--width 1.0] [--algorithms ...] [--runs docs/results/fig6_runs]
        [--out docs/results]
        [--conv-targets position|image] [--name fig6] [--padding valid|same] [--server-memory GIB]

The paper's model ('same' padding) at full width, its classifier solved in
the dual (a 137 GB Gram otherwise; docs/design.md, "Wide layers")::

    python experiments/fig6_cifar.py --padding same --server-memory 18 --runs docs/results/fig6_same_runs \
        --work results/fig6-same --name fig6_same

Each algorithm runs in a process of its own (its peak memory is its own),
100 clients, Dirichlet beta = 0.1, gamma = 100, eps = 2500, K = 10, every
client with 2 cores, float32 data with float64 statistics. A finished run is
kept as ``RUNS/ALGORITHM.json`` and is not run again (``--redo`` forces it),
so the five can be spread over several sessions; ``--report`` only rebuilds
fig6.md and fig6_accuracy.png from the runs at hand.

Variants whose stages coincide share them (each stage's time is measured
once, on the run that computes it):

- -WP is pFedACnnL before its personalization stage: its accuracy and times
  are those of pFedACnnL's initialization and federated rounds.
- -WC trains FedACnnL's federated stage (one group, eq. 7) and personalizes
  it: it resumes from FedACnnL's checkpoint (``WORK/fedacnnl/checkpoint.npz``,
  whose round records hold that stage's measured times) and runs only its
  personalization; without that checkpoint it runs whole.
- A run that ended after its federated stage without writing its JSON
  (killed while personalizing or saving) resumes from its own checkpoint
  (``WORK/ALGORITHM/checkpoint.npz``) and only personalizes; that stage's
  wall time is then the sum of the parts its rounds measured.
- Personalization checkpoints after every layer (each client keeps its
  layers beside the checkpoint, ``checkpoint.personal/``): a run killed
  while personalizing goes on from its last personalized layer (for -WC,
  in FedACnnL's checkpoint, which it writes on), and the layers
  personalized before count the parts their rounds measured. A finished
  run's kept layers are deleted once its JSON is written (25 GB at full
  width; its models are in WORK/ALGORITHM/personalized).
- -WA runs by itself, because its batch sizes differ, so its time must be
  measured; its weights equal FedACnnL's, so it is evaluated after its last
  round only (``--eval-every 5``), and its accuracy per round is FedACnnL's
  once the final accuracies are found equal.

Per layer, the report sets the clients' forward and statistics time against
a floor: the layer's multiply-adds (forward pass of the training data
through the layer before, and the statistics by the method fastls picks) at
the float32 gemm rate measured at the start of the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import fastls
from dev_layout import REPOSITORY, use_shared_data
from fedlayer.checkpoint import Checkpointing, load_checkpoint
from fedlayer.client import personalization_costs, target_bases
from fedlayer.models import DCNN_PADDINGS, Conv2d, build_model
from fedlayer.options import ROUND_ACCURACIES, SERVER_SOLVES
from fedlayer.cli import flag_type
from fedlayer.run import CONFIG_CONSTRAINTS, RunConfig, load_dataset, run
from fedlayer.server import ServerState
from fedlayer.timing import time_summary

RUN_ALGORITHMS = ["fedacnnl", "fedacnnl-wa", "pfedacnnl", "pfedacnnl-wc"]
REPORTED = ["fedacnnl", "fedacnnl-wa", "pfedacnnl-wp", "pfedacnnl-wc", "pfedacnnl"]
PAPER = {"fedacnnl": 70.06, "pfedacnnl-wp": 74.03, "pfedacnnl-wc": 72.88, "pfedacnnl": 74.40}
PAPER_FEDAVG = 73.0


def gemm_rate(n=4096, repeats=3, dtype=np.float32):
    """``dtype`` gemm flops per second on this machine now (2 n^3 flops per product, best of ``repeats``)."""
    rng = np.random.default_rng(0)
    A, B = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        A @ B
        best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


N_LAYERS = 5  # trainable layers of the DCNN
SHARED_STAGE = {"pfedacnnl-wc": "fedacnnl"}  # run -> the run whose federated stage it resumes from
SAME_WEIGHTS = {"fedacnnl-wa": "fedacnnl"}   # run -> the run whose weights (and accuracy per round) it has


def config_for(algorithm, args, output=None, shared=None):
    """The run's configuration; ``shared`` (from :func:`shared_checkpoint`) makes it resume from that stage."""
    extra = {}
    if algorithm in SAME_WEIGHTS:
        extra["eval_every"] = N_LAYERS
    if shared is not None:
        extra.update(checkpoint=shared["checkpoint"], resume=True)
    # How the server solves each layer changes no weight beyond rounding: not part of the fingerprint below.
    return RunConfig(algorithm=algorithm, dataset="cifar10", model="dcnn", width=args.width, padding=args.padding,
                     dtype="float32", seed=args.seed, cores=[2], output=output, conv_targets=args.conv_targets,
                     server_solve=args.server_solve, server_memory=args.server_memory,
                     round_accuracy=args.round_accuracy, eps_output=args.eps_output, **extra)


def _readout_note(runs):
    """What rounds 1-4 scored, read from the runs themselves (a kept run or a shared stage may predate a flag)."""
    codes = [a for a, r in runs.items() if any(x.get("accuracy_of") == "codes" for x in r["rounds"].values())]
    if not codes:
        return ""
    everyone = len(codes) == len(runs)
    return (f"; rounds 1-4{'' if everyone else ' of ' + ', '.join(codes)} score the layer just trained by its label "
            f"codes (`--round-accuracy codes`: each test image gets the class whose code is nearest the layer's "
            f"output), {'not' if everyone else 'those of the others'} the network with its later layers untrained")


def shared_checkpoint(algorithm, args):
    """The checkpoint of a finished federated stage ``algorithm`` can resume from, with that stage's cost.

    Its own run's checkpoint first (a run that ended after its federated
    stage, before writing its JSON), then that of the run whose stage it
    shares (``SHARED_STAGE``). Only a checkpoint written by this
    configuration (its fingerprint) with every layer trained counts; else
    ``algorithm`` runs whole. Returns None or a dict: checkpoint, from,
    wall_s, peak_rss_bytes (None when not recorded), how the wall was taken.
    """
    config = config_for(algorithm, args)
    fingerprint = config.fingerprint()
    for source in filter(None, (algorithm, SHARED_STAGE.get(algorithm))):
        checkpoint = Path(args.work) / source / "checkpoint.npz"
        source_json = Path(args.runs) / f"{source}.json"
        if not checkpoint.exists() or (source != algorithm and not source_json.exists()):
            continue
        try:
            state = load_checkpoint(checkpoint, fingerprint)
        except ValueError as err:
            print(f"{algorithm}: not resuming from {checkpoint} ({err})", flush=True)
            continue
        # Another run's stage counts when finished; this run's own checkpoint also after any finished layer
        # (a full-width 'same' round takes most of an hour: a killed run continues, it does not start over).
        if state["layers_done"] != N_LAYERS and (source != algorithm or state["layers_done"] == 0):
            continue
        rounds = state["rounds"].values() if isinstance(state["rounds"], dict) else state["rounds"]
        if source != algorithm:
            measured = json.loads(source_json.read_text())["fig6"]
            shared = {"checkpoint": str(checkpoint), "from": source, "wall_s": measured["wall_s"],
                      "peak_rss_bytes": measured["peak_rss_bytes"], "wall": f"{source}'s run"}
            tag = Checkpointing(checkpoint, fingerprint, config.personalization_fingerprint()).tag
            if state["personalized"] and state["personal_tag"] == tag:
                # An interrupted run of this algorithm personalized some layers there, and this one goes on from
                # them: their time is the sum of the parts those rounds measured (its clock was lost with it).
                earlier = [r for r in rounds if r["stage"] == "personalization"]
                shared["wall_s"] += sum(_measured_s(r) for r in earlier)
                shared["wall"] += (f" + the {len(earlier)} layer(s) an interrupted run of {algorithm} personalized "
                                   f"(the sum of the parts their rounds measured)")
            return shared
        # the interrupted process's own clock was lost with it: its wall is the sum of the parts its rounds
        # measured (clients' compute, server solves, evaluations), 98 % of the wall on FedACnnL's full run
        wall = sum(_measured_s(r) for r in rounds)
        return {"checkpoint": str(checkpoint), "from": source, "wall_s": wall, "peak_rss_bytes": None,
                "layers_done": state["layers_done"],
                "wall": "the sum of the parts measured by its interrupted run (clients' compute, server solves, "
                        "evaluations; its own clock and peak memory were lost with it)"}
    return None


def _measured_s(record):
    """The seconds a round's record measured: its clients' compute, the server's solve, the evaluation."""
    return (sum(c["compute_s"] for c in record["clients"].values()) + record["server_s"]
            + (record.get("eval_s") or 0.0))


def allocated_bytes(folder):
    """Bytes the filesystem has allocated to the files under ``folder`` (what ``du`` counts)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # removed while walking: a cache moving forward
    return total


#: Seconds between two samples of a run's disk use (:class:`PeakDisk`).
DISK_SAMPLE_S = 10.0


class PeakDisk:
    """The most disk a folder took while the ``with`` block ran, sampled every ``period_s`` seconds in a thread.

    At full width the cached activations and the server's stacked rows take
    tens of GB (the issue asks for the disk a run uses to be stated).
    """

    def __init__(self, folder, period_s=DISK_SAMPLE_S):
        self.folder, self.period_s, self.peak = Path(folder), float(period_s), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while True:
            self.peak = max(self.peak, allocated_bytes(self.folder))
            if self._stop.wait(self.period_s):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, allocated_bytes(self.folder))


def run_one(algorithm, args):
    """Run one algorithm in this process; write RUNS/ALGORITHM.json."""
    runs = Path(args.runs)
    rate, rate64 = gemm_rate(), gemm_rate(dtype=np.float64)
    shared = shared_checkpoint(algorithm, args)
    config = config_for(algorithm, args, output=str(Path(args.work) / algorithm), shared=shared)
    dataset = load_dataset(config)
    start = time.perf_counter()
    with PeakDisk(config.output) as disk:
        results = run(config, dataset=dataset, progress=lambda msg: print(f"  {algorithm}: {msg}", flush=True))
    results.pop("group_weights", None)
    if shared is not None:
        results["fig6_shared_stage"] = shared
    results["fig6"] = {
        "wall_s": time.perf_counter() - start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_disk_bytes": disk.peak,
        "gemm_float32_flops_per_s": rate,
        "gemm_float64_flops_per_s": rate64,  # a dual solve that multiplies K in float64 (unrefined) runs at it
        "forward_methods": forward_methods(build_model("dcnn", dataset.feature_shape, dataset.n_classes,
                                                      width=args.width, padding=args.padding)),
        "width": args.width,
        "machine": f"{platform.machine()}, {fastls.available_cores()} cores",
        "command": " ".join(["python", "experiments/fig6_cifar.py", *sys.argv[1:]]),
    }
    (runs / f"{algorithm}.json").write_text(json.dumps(results, indent=1))
    release_personal_layers(config)
    print(f"{algorithm}: accuracy {results['accuracy']:.4f}, wall {results['fig6']['wall_s']:.0f} s", flush=True)


def release_personal_layers(config):
    """Delete the personalized layers a finished run's clients kept beside its checkpoint (25 GB at full width).

    The checkpoint is first rewritten without its personalization rounds, so
    that it never counts layers that are gone: it holds the federated stage
    again, as before the run personalized.
    """
    path = config.checkpoint_path()
    checkpoint = Checkpointing(path, config.fingerprint(), config.personalization_fingerprint())
    if not checkpoint.personal_folder.exists():
        return
    checkpoint.save(ServerState.from_checkpoint(load_checkpoint(path, config.fingerprint())).without_personalization())
    shutil.rmtree(checkpoint.personal_folder)


def forward_methods(model):
    """Per trainable layer, the forward method fastls picks now: 'winograd' or 'im2col' ('matmul' for Dense)."""
    methods = []
    for index in model.trainable:
        layer, shape = model.layers[index], model.input_shape_of(index)
        if not isinstance(layer, Conv2d):
            methods.append("matmul")
            continue
        methods.append(fastls.tuning.conv2d_method(layer.kernel_size, layer.stride, shape[-1], layer.filters))
    return methods


def layer_work(model, n_train, methods=None):
    """Per trainable position: (forward flops of the training data into it, statistics flops).

    The forward pass counts the multiply-adds of ``methods`` (per trainable
    layer, as :func:`forward_methods`; im2col's when None, as runs before
    Winograd recorded none): Winograd F(2x2, 3x3) computes 16 C F per 2 x 2
    block of outputs instead of 36 C F.
    """
    work = []
    for position, index in enumerate(model.trainable):
        previous = model.trainable[position - 1] if position else None
        forward = 0.0
        if previous is not None:
            layer = model.layers[previous]
            shape = model.input_shape_of(previous)
            d, m = layer.ls_shape(shape)
            forward = 2.0 * n_train * layer.rows_per_sample(shape) * d * m
            if methods is not None and methods[position - 1] == "winograd":
                out_h, out_w, _ = layer.output_shape(shape)
                forward = 2.0 * n_train * (-(-out_h // 2)) * (-(-out_w // 2)) * 16 * shape[-1] * m
        shape = model.input_shape_of(index)
        work.append((forward, model.layers[index].gram_flops(shape, n_train)))
    return work


def factored_upload_flops(model, position, samples):
    """Flops of the clients' factored uploads of layer ``position`` (a round the server solved in the dual).

    Each client multiplies its n x n rotation into its n x d rows (2 n^2 d)
    instead of forming its Gram, and draws the rotation by a QR of an
    n x n Gaussian matrix (4/3 n^3); ``samples``: the clients' training samples.
    """
    index = model.trainable[position]
    layer, shape = model.layers[index], model.input_shape_of(index)
    d = layer.ls_shape(shape)[0]
    rows = [float(n * layer.rows_per_sample(shape)) for n in samples]
    return sum(2.0 * n * n * d + 4.0 / 3.0 * n ** 3 for n in rows)


def dual_server_note(record, position, rate, rate64=None):
    """What the server's solve of a dual round cost against its flops (``proximal_cost``'s dual count:
    K = F F^T, the N x N Cholesky, F^T alpha) at the gemm rate of K's products: float32 (``rate``) where
    the server summed K from float32 products and refined the solve in float64 passes over F, or for the
    runs recorded before the server multiplied in float64 (no ``rate64``); float64 (``rate64``) otherwise."""
    solve = record["solve"]
    refinement = solve.get("refinement", {})
    precision, server_rate = ("float32", rate) if refinement or rate64 is None else ("float64", rate64)
    flops, seconds = solve["flops"]["dual"], record["server_s"]
    mapped = "memory-mapped" if any(solve.get("mapped", {}).values()) else "in RAM"
    note = (f"layer {position + 1} was solved by the server in the dual over a group's N = {solve['rows']:,} rows "
            f"(stacked {mapped}; its N x N system {solve['dual_bytes'] / 2**30:.1f} GiB, the primal's Grams "
            f"{solve['primal_bytes'] / 2**30:.0f} GiB): {flops / 1e12:.0f} TFLOP in {seconds:.0f} s, "
            f"{flops / seconds / 1e9:.0f} GFLOP/s, {flops / server_rate:.0f} s at the {precision} gemm rate.")
    if refinement:
        passes = sum(report["iterations"] for report in refinement.values())
        worst = max((r["correction"] for r in refinement.values() if r["correction"] is not None), default=float("nan"))
        fallbacks = sum(report["fallback"] for report in refinement.values())
        note += (f" K from float32 products, the solve refined against float64 products with F in {passes} "
                 f"pass(es) over it (last correction {worst:.1e} of alpha"
                 + (f"; {fallbacks} group(s) solved again with a float64 K" if fallbacks else "") + ").")
    return note


def dual_ids(record, model, position, dataset, basis):
    """Ids (keys of ``record["clients"]``) of the clients that solved this personalization round in the dual.

    The form each client recorded, or for runs that did not record it the
    cost rule the client applies (:func:`fedlayer.client.personalization_costs`).
    """
    index = model.trainable[position]
    layer, shape = model.layers[index], model.input_shape_of(index)
    ids = []
    for cid, client in record["clients"].items():
        form = client.get("form")
        if form is None:
            costs = personalization_costs(layer, shape, dataset.clients[int(cid)].n_train, basis)
            form = "dual" if costs["dual"] < costs["primal"] else "primal"
        if form == "dual":
            ids.append(cid)
    return ids


def without_personalization(results):
    """-WP: pFedACnnL's rounds up to the end of its federated stage."""
    rounds = {k: r for k, r in results["rounds"].items() if r["stage"] != "personalization"}
    federated = [r for r in rounds.values() if r["accuracy"] is not None]
    return {**results, "rounds": rounds, "accuracy": federated[-1]["accuracy"],
            "time_per_client": time_summary(rounds.values()),
            "fig6": {**results["fig6"], "derived": "pfedacnnl before personalization",
                     "wall_s": results.get("fig6_shared_stage", {}).get("wall_s")}}


def padding_sentence(padding_rows, dual_rows=None):
    """What the padding study (experiments/fig6_padding.py, its rows in ``padding_rows``) says of the gap.

    ``dual_rows`` (fig6_dual_classifier.py's rows), when it holds a full-width
    row, adds the paper's own 'same' model, its classifier solved in the dual.
    """
    rows = json.loads(padding_rows.read_text()) if padding_rows.exists() else []
    full = [r for r in rows if r["width"] == 1 and r["padding"] == "same" and r.get("classifier_pool", 1) == 2]
    if not full:
        return ("Most of the gap to the paper's accuracy is most likely the DCNN's padding, which the paper does not "
                "give: 'same' padding is about 10 points more accurate at every width that fits this machine, but "
                "needs a 137 GB classifier Gram at full width ([fig6_padding.md](fig6_padding.md)).")
    sentence = ("The gap to the paper's accuracy is the DCNN's padding, which the paper does not give: 'same' padding "
                "is about 10 points more accurate at every width that fits this machine. With it the paper's model "
                "needs a 137 GB classifier Gram at full width; the same network with a 2x2 pool before the classifier "
                f"(a {full[0]['classifier_d']:,}^2 Gram) reaches **{100 * full[0]['test_accuracy']:.2f} %** at full "
                f"width, against the paper's {PAPER['fedacnnl']:.2f} % ([fig6_padding.md](fig6_padding.md), "
                "[fig6_notes.md](fig6_notes.md), \"Padding\").")
    dual = json.loads(dual_rows.read_text()) if dual_rows is not None and dual_rows.exists() else []
    dual = [r for r in dual if r["width"] == 1]
    if dual:
        r = dual[0]
        sentence += (" The paper's own model with 'same' padding, that run's convolutions (their training never sees "
                     f"the pool) with the unpooled {r['classifier_inputs']:,}-input classifier solved in the dual (a "
                     f"{r['train_rows']:,}^2 system, [fig6_dual_classifier.md](fig6_dual_classifier.md)), reaches "
                     f"**{100 * r['test_accuracy']:.2f} %**, "
                     f"{PAPER['fedacnnl'] - 100 * r['test_accuracy']:.2f} points below the paper: "
                     "about what the JPEG-rebuilt CIFAR copy was expected to cost. Its classifier fits "
                     f"{100 * r['train_accuracy']:.2f} % of the training rows; the pool regularizes it.")
    return sentence


def report(args):
    runs_dir, out = Path(args.runs), Path(args.out)
    runs = {a: json.loads((runs_dir / f"{a}.json").read_text()) for a in RUN_ALGORITHMS
            if (runs_dir / f"{a}.json").exists()}
    if "pfedacnnl" in runs:
        runs["pfedacnnl-wp"] = without_personalization(runs["pfedacnnl"])
    runs = {a: runs[a] for a in REPORTED if a in runs}
    if not runs:
        print(f"no runs in {runs_dir}: nothing to report", file=sys.stderr)
        return 1
    dataset = load_dataset(config_for("fedacnnl", args))
    n_train = sum(c.n_train for c in dataset.clients)
    model = build_model("dcnn", dataset.feature_shape, dataset.n_classes, width=args.width, padding=args.padding)
    shapes = [model.layers[i].ls_shape(model.input_shape_of(i)) for i in model.trainable]
    any_run = next(iter(runs.values()))["fig6"]

    lines = [
        "# Fig. 6: CIFAR-10, DCNN",
        "",
        f"Command: `python experiments/fig6_cifar.py --width {args.width} --seed {args.seed} --conv-targets "
        f"{args.conv_targets}{'' if args.padding == 'valid' else ' --padding ' + args.padding}"
        f"{'' if args.server_memory is None else f' --server-memory {args.server_memory:g}'}"
        f"{'' if args.server_solve == 'auto' else ' --server-solve ' + args.server_solve}"
        f"{'' if args.round_accuracy == 'network' else ' --round-accuracy ' + args.round_accuracy}"
        f"{'' if args.eps_output is None else ' --eps-output ' + str(args.eps_output)}` on "
        f"{any_run['machine']}; 100 clients, Dirichlet beta = 0.1, gamma = 100, eps = 2500"
        f"{'' if args.eps_output is None else ' (the output layer: ' + str(args.eps_output) + ')'}, "
        f"K = 10, every client 2 cores, float32 data with float64 statistics, convolutions' label codes "
        f"{'per output position' if args.conv_targets == 'position' else 'per image'}. "
        f"DCNN width x{args.width}, '{args.padding}' padding: least-squares shapes "
        f"{', '.join(str(s) for s in shapes)}; {n_train} training images. Algorithms missing below have not "
        f"been run yet (each run is kept in `{runs_dir}/ALGORITHM.json`).",
        "",
        "| algorithm | final accuracy (%) | paper (%) | avg total time per client (s) | compute | idle | comm | "
        "wall (s) | of which evaluation (s) | peak RSS (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for algorithm, results in runs.items():
        t, f = results["time_per_client"], results["fig6"]
        wall = f"{f['wall_s']:.0f}" if f.get("wall_s") else "(in pfedacnnl)"
        rss = f["peak_rss_bytes"]
        shared = results.get("fig6_shared_stage")
        if shared and f.get("derived"):
            rss = shared["peak_rss_bytes"]  # the process that trained the stage, when recorded
            notes.append(f"{algorithm}: wall time = {shared['from']}'s federated stage ({shared['wall']}).")
        elif f.get("derived"):
            notes.append(f"{algorithm}: {f['derived']}; its peak memory is that whole process's, "
                         f"personalization included.")
        if shared and not f.get("derived"):
            wall = f"{shared['wall_s']:.0f} + {f['wall_s']:.0f}"
            rss = max(rss, shared["peak_rss_bytes"] or 0)
            memory = ("the larger of the two processes'" if shared["peak_rss_bytes"]
                      else "the resumed process's only")
            if shared["from"] == algorithm:
                done = shared.get("layers_done", N_LAYERS)
                notes.append(f"{algorithm}: an interrupted run of it trained its first {done} layer(s), and this run "
                             f"resumed from its checkpoint; wall time = those layers' ({shared['wall']}) + this run's; "
                             f"peak memory {memory}.")
            else:
                notes.append(f"{algorithm}: its federated stage was trained by {shared['from']}'s run and resumed "
                             f"from its checkpoint; wall time = that stage's ({shared['wall']}) + its own "
                             f"personalization's; times per client over both stages; peak memory {memory}.")
        if f.get("peak_disk_bytes") is not None:
            notes.append(f"{algorithm}: peak disk under its output folder {f['peak_disk_bytes'] / 1e9:.1f} GB "
                         f"(sampled every {DISK_SAMPLE_S:g} s during the run): cached activations, "
                         f"checkpoint, model, and the server's stacked rows of a layer solved in the dual.")
        evaluation = sum(r.get("eval_s") or 0.0 for r in results["rounds"].values())
        lines.append(
            f"| {algorithm} | {100 * results['accuracy']:.2f} | {PAPER.get(algorithm, '-')} | {t['total_s']:.1f} | "
            f"{t['compute_s']:.1f} | {t['idle_s']:.1f} | {t['comm_s']:.3f} | {wall} | {evaluation:.0f} | "
            f"{'-' if rss is None else f'{rss / 2**30:.2f}'} |")
    lines += [""] + [f"- {note}" for note in notes] + ([""] if notes else [])
    lines += [f"FedAvg in the paper: {PAPER_FEDAVG} %. The evaluation column is the time spent scoring the test "
              f"splits after each round (the accuracy curve below); the wall minus it is the training time.", ""]

    curves = {}
    for algorithm, results in runs.items():
        accs = [r["accuracy"] for r in results["rounds"].values() if r["stage"] != "initialization"]
        source = SAME_WEIGHTS.get(algorithm)
        if None in accs and source in curves:
            if runs[source]["accuracy"] == results["accuracy"]:
                lines += [f"{algorithm} is evaluated after its last round only (its wall time has no evaluations of "
                          f"the earlier rounds); its final accuracy equals {source}'s (the same weights), so its "
                          f"curve below is {source}'s.", ""]
                accs = curves[source][:len(accs)]
            else:
                lines += [f"{algorithm} is evaluated after its last round only, and its final accuracy differs from "
                          f"{source}'s: its earlier rounds are left blank.", ""]
        curves[algorithm] = accs + [accs[-1]] * (10 - len(accs))
    width = max(len(c) for c in curves.values())
    lines += [
        "Accuracy per round (%); algorithms without personalization carry their final accuracy over the rounds "
        "the others spend personalizing, as in the paper" + _readout_note(runs) + ":",
        "",
        "| algorithm | " + " | ".join(str(i + 1) for i in range(width)) + " |",
        "|---" * (1 + width) + "|",
    ]
    lines += [f"| {a} | " + " | ".join("-" if v is None else f"{100 * v:.1f}" for v in c) + " |"
              for a, c in curves.items()]

    bases = target_bases(model, args.seed, args.conv_targets)
    for algorithm, results in runs.items():
        if results["fig6"].get("derived"):
            continue
        rate = results["fig6"]["gemm_float32_flops_per_s"]
        shared = results.get("fig6_shared_stage")
        # Rounds resumed from another run's checkpoint were measured in that run, against its gemm rate.
        shared_rate = runs[shared["from"]]["fig6"]["gemm_float32_flops_per_s"] \
            if shared and shared.get("from") in runs else rate
        methods = results["fig6"].get("forward_methods")
        work = layer_work(model, n_train, methods)
        rates = f"{rate / 1e9:.0f} GFLOP/s at the start of the run" if shared_rate == rate else \
            (f"{shared_rate / 1e9:.0f} GFLOP/s at the start of {shared['from']}'s run for its federated stage, "
             f"{rate / 1e9:.0f} for this run's personalization")
        lines += [
            "",
            f"### {algorithm}: time per layer, summed over the clients (float32 gemm measured at {rates}; forward "
            f"convolutions by {'im2col' if methods is None else ' / '.join(methods)})",
            "",
            "| stage | layer | forward s | statistics s | client solve s | floor s | clients / floor | "
            "server solve s | evaluation s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        rate64 = results["fig6"].get("gemm_float64_flops_per_s")
        dual_notes = []
        for record in results["rounds"].values():
            if record["stage"] == "initialization":
                continue
            position = record["layer"]
            parts = [c.get("parts", {}) for c in record["clients"].values()]
            forward, stats, solve = (sum(p.get(k, 0.0) for p in parts) for k in ("forward_s", "stats_s", "solve_s"))
            floor_flops, timed = sum(work[position]), forward + stats
            if record.get("solve", {}).get("form") == "dual":
                # The server solved this layer over the clients' rows: their floor is the factored upload's.
                samples = [dataset.clients[int(cid)].n_train for cid in record["clients"]]
                floor_flops = work[position][0] + factored_upload_flops(model, position, samples)
            if record["stage"] == "personalization":
                ids = dual_ids(record, model, position, dataset, bases[position])
                if ids:
                    # A dual client forms X X^T inside its solve: its floor is that product, its time the solve.
                    index = model.trainable[position]
                    layer, shape = model.layers[index], model.input_shape_of(index)
                    samples = [dataset.clients[int(cid)].n_train for cid in ids]
                    floor_flops -= work[position][1] * sum(samples) / n_train
                    floor_flops += sum(float(n * layer.rows_per_sample(shape)) ** 2 * layer.ls_shape(shape)[0]
                                       for n in samples)
                    timed += sum(record["clients"][cid].get("parts", {}).get("solve_s", 0.0) for cid in ids)
            floor = floor_flops / (rate if record["stage"] == "personalization" else shared_rate)
            ratio = timed / floor if floor else float("nan")
            lines.append(
                f"| {record['stage']} | {position + 1} | {forward:.1f} | {stats:.1f} | {solve:.1f} | {floor:.1f} | "
                f"{ratio:.2f} | {record['server_s']:.1f} | {record.get('eval_s', 0.0):.1f} |")
            if record.get("solve", {}).get("form") == "dual":
                dual_notes.append(dual_server_note(record, position, rate, rate64))
        if dual_notes:
            lines += [""] + [f"- {note}" for note in dual_notes]
    lines += [
        "",
        "The floor counts the forward pass into the layer by the method the run used (im2col: 2 N P d m; "
        "Winograd F(2x2, 3x3): 2 N (tiles) 16 C F) and the statistics by the method fastls "
        "picks (the overlap's displacement products on stride-1 maps, else N P d^2) at the float32 gemm rate "
        "measured in the run that timed the round; solves run in float64 and are not in it, except in the "
        "personalization rounds a client solves in the dual form (fewer rows n than inputs d, as a client's "
        "`proximal_cost` picks: clients with few images from layer 3 on, every client in layers 4 and 5 here): "
        "it forms no statistics, so its floor counts X X^T "
        "(n^2 d) instead of N P d^2, and its time is the forward pass plus its whole solve (X X^T, the n x n "
        "Cholesky and the products with M). Personalization rounds also redo the statistics (primal) or "
        "build the patch rows (dual) through the client's own earlier layers.",
        "",
        "Discussion of these figures, and what is still open: [fig6_notes.md](fig6_notes.md).",
    ]
    if args.padding == "valid":
        lines += ["", padding_sentence(Path(args.padding_json), Path(args.dual_json))]
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(curves, out / f"{args.name}_accuracy.png", args.width)
    return 0


def plot(curves, path, width):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for algorithm, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), [np.nan if v is None else 100 * v for v in curve], marker="o",
                label=algorithm)
    for algorithm, value in PAPER.items():
        if algorithm in curves:
            ax.axhline(value, ls=":", lw=0.8, color=ax.lines[list(curves).index(algorithm)].get_color())
    ax.set_xticks(range(1, max(len(c) for c in curves.values()) + 1))
    ax.set_xlabel("round")
    ax.set_ylabel("overall test accuracy (%)")
    ax.set_title(f"CIFAR-10, DCNN width x{width} (dotted: the paper's final accuracy)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--algorithms", nargs="+", default=RUN_ALGORITHMS, choices=RUN_ALGORITHMS)
    parser.add_argument("--runs", default="docs/results/fig6_runs", help="folder of the per-algorithm results")
    parser.add_argument("--work", default="results/fig6",
                        help="the runs' output folders: models, checkpoints, cached activations (tens of GB)")
    parser.add_argument("--out", default="docs/results", help="folder of fig6.md and fig6_accuracy.png")
    parser.add_argument("--conv-targets", choices=["position", "image"], default="position",
                        help="label codes of the convolutions (fedlayer run --conv-targets)")
    parser.add_argument("--padding", choices=DCNN_PADDINGS, default="valid",
                        help="the DCNN's convolutions ('same' at full width: a 137 GB classifier Gram, so the server "
                             "solves that layer in the dual; FedACnnL's 45,000 x 45,000 system, 15.1 GiB, needs a "
                             "--server-memory of at least that: the default, 3/4 of the RAM, is 17 GiB on 23 GiB)")
    parser.add_argument("--server-memory", type=float, default=None,
                        help="GiB the server's solve of a layer may hold (fedlayer run --server-memory)")
    parser.add_argument("--server-solve", choices=SERVER_SOLVES, default="auto",
                        help="how the server solves each layer (fedlayer run --server-solve)")
    parser.add_argument("--round-accuracy", choices=ROUND_ACCURACIES, default="network",
                        help="what rounds 1-4 score (fedlayer run --round-accuracy): the network, or the layer's "
                             "label-code readout, which needs that layer's forward pass of the test split alone")
    parser.add_argument("--eps-output", type=flag_type(CONFIG_CONSTRAINTS["eps_output"], "eps_output"), default=None,
                        help="the classifier's personalization eps where it differs from the paper's 2500: a number, "
                             "auto, or inf (each client keeps its group's classifier)")
    parser.add_argument("--name", default="fig6", help="the report's file names: NAME.md, NAME_accuracy.png")
    parser.add_argument("--padding-json", default=str(REPOSITORY / "docs" / "results" / "fig6_padding.json"),
                        help="experiments/fig6_padding.py's rows, quoted by the report")
    parser.add_argument("--dual-json", default=str(REPOSITORY / "docs" / "results" / "fig6_dual_classifier.json"),
                        help="experiments/fig6_dual_classifier.py's rows, quoted by the report")
    parser.add_argument("--redo", action="store_true", help="run again algorithms already in --runs")
    parser.add_argument("--report", action="store_true", help="only rebuild the report from --runs")
    parser.add_argument("--one", choices=RUN_ALGORITHMS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    use_shared_data()
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.one:
        run_one(args.one, args)
        return 0
    if not args.report:
        try:
            load_dataset(config_for("fedacnnl", args))
        except FileNotFoundError as err:
            print(f"CIFAR-10 not found, nothing to run: {err}", file=sys.stderr)
            return 1
        for algorithm in args.algorithms:
            if (Path(args.runs) / f"{algorithm}.json").exists() and not args.redo:
                print(f"{algorithm}: kept from {args.runs} (--redo runs it again)", flush=True)
                continue
            child = [sys.executable, __file__, "--one", algorithm, "--width", str(args.width), "--seed",
                     str(args.seed), "--runs", args.runs, "--work", args.work, "--out", args.out,
                     "--conv-targets", args.conv_targets, "--padding", args.padding, "--server-solve",
                     args.server_solve, "--round-accuracy", args.round_accuracy,
                     *(["--server-memory", str(args.server_memory)] if args.server_memory else []),
                     *(["--eps-output", str(args.eps_output)] if args.eps_output is not None else [])]
            subprocess.run(child, check=True)
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
