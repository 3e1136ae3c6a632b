"""Secure sums measured: the threat, the fix, its cost, dropouts, and per-rank sums under MPI.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/secure_sums.py [--out docs/results] [--skip-mpi]

1. **Threat**: the server rebuilds client 0's mean image per class from its
   plain first-layer upload on MNIST (C Q_1^+), and from what it receives
   from the same client under ``--secure`` (masked fixed-point words).
   Figure ``secure_threat.png``.
2. **Cost on MNIST-DNN, 100 clients** (FedACnnL): client compute, bytes up per
   round and total time per client, plain against secure; the largest
   relative difference of the weights.
3. **Growth with clients** (Synthetic-DNN, FedACnnL, 100 / 300 / 1,000
   clients): the secure protocol's extra compute and bytes per client, against
   log2(N) (the SecAgg+ graph has O(log N) neighbours per client).
4. **Dropouts** (MNIST-DNN, ``--drop-clients 0.1``): accuracy plain and secure
   next to the run without dropouts; pFedACnnL's accuracy with ``--h-noise``.
5. **Per-rank sums** (``mpiexec -n 3``, MNIST-DNN): bytes rank 0 received per
   layer against the bytes the clients' uploads would have been.
6. **Contributor rules** (MNIST-DNN, pFedACnnL; ``--parts rules``): secure
   against plain without dropouts; with ``--drop-clients 0.2`` on seeds 0
   and 1, the accuracy, the pairs of unmasked sums of a group whose
   contributors differ by 1 to min_group_size - 1 clients (counted from the
   record; for the plain run, as today's protocol would have unmasked them),
   and the weights against a plain run on the same contributors.
Writes secure_sums.md / .json and the figure.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import fastls
from fedlayer.client import Client
from fedlayer.server import survivors_solution
from fedlayer.run import RunConfig, build, load_dataset, make_clients, run
from fedlayer.secure import FixedPoint, SecureServer, class_means_from_upload, fraction_bits
from fedlayer.secure_client import SecureClient

from dev_layout import use_shared_data


def weight_difference(a, b):
    """Largest |W_a - W_b| / max |W_b| over the layers (and groups) of two runs.

    Groups are matched by their members when both runs record them (secure
    mode numbers its groups by their first member).
    """
    match = {k: k for k in b["group_weights"]}
    if "groups" in a and "groups" in b:
        members = [{} for _ in range(2)]
        for side, run_ in zip(members, (a, b)):
            for cid, k in run_["groups"].items():
                side.setdefault(k, set()).add(cid)
        match = {k: next(j for j, group in members[0].items() if group == members[1][k]) for k in members[1]}
    worst = 0.0
    for k in b["group_weights"]:
        for W, V in zip(a["group_weights"][match[k]], b["group_weights"][k]):
            worst = max(worst, float(np.abs(W - V).max() / max(np.abs(V).max(), 1e-300)))
    return worst


def per_round(results, key):
    federated = [r for r in results["rounds"].values() if r["stage"] == "federated"]
    if key == "bytes_up":
        return float(np.mean([r["bytes_up"] for r in federated]))
    return float(np.mean([np.mean([c[key] for c in r["clients"].values()]) for r in federated]))


def threat(dataset, config, out):
    """Client 0's class means from its plain upload and from its masked one; the figure; correlations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model_config = build(config, dataset).config()
    clients = [SecureClient(Client(cid, dataset.clients[cid], model_config, config.seed, dataset.n_classes))
               for cid in range(10)]
    target = clients[0]
    Q = target.encoders[0]
    x, y = target.data.x_train.reshape(target.data.n_train, -1).astype(np.float64), target.data.y_train
    present = [c for c in range(dataset.n_classes) if np.any(y == c)]
    truth = {c: x[y == c].mean(axis=0) for c in present}
    plain, _ = class_means_from_upload(target.local_stats(0, 64)["C"], Q)
    server = SecureServer(config.seed)
    server.public = {c.client_id: c.secure_keys()["public"] for c in clients}
    graph = server.plan({0: [c.client_id for c in clients]})
    for c in clients:
        c.secure_neighbours({n: server.public[n] for n in graph[c.client_id]})
    bits = fraction_bits([target.secure_bound(0, 64, ["G", "C"])["exponent"]], len(clients))
    relay, _ = server.route({c.client_id: c.secure_self_mask((0, 0))["shares"] for c in clients})
    for c in clients:
        c.secure_receive(relay.get(c.client_id, {}), (0, 0))
    upload = target.secure_upload(0, (0, 0), bits, len(clients), [c.client_id for c in clients])
    masked, _ = class_means_from_upload(FixedPoint(bits, len(clients)).decode(upload["C"]), Q)
    corr = {name: [float(np.corrcoef(guess[c], truth[c])[0, 1]) for c in present]
            for name, guess in (("plain", plain), ("secure", masked))}
    shown = present[:5]
    side = int(round(math.sqrt(x.shape[1])))
    fig, axes = plt.subplots(3, len(shown), figsize=(1.6 * len(shown), 5))
    for j, c in enumerate(shown):
        for i, (title, image) in enumerate((("truth", truth[c]), ("from plain upload", plain[c]),
                                            ("from secure upload", masked[c]))):
            ax = axes[i, j]
            ax.imshow(image.reshape(side, side), cmap="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(title, fontsize=8)
        axes[0, j].set_title(f"class {c}", fontsize=9)
    fig.suptitle("Client 0's mean image per class, as the server sees it (MNIST, layer 1)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "secure_threat.png", dpi=110)
    plt.close(fig)
    return {"classes": present, "correlation": corr, "frac_bits": bits}


def timed_pair(base, dataset):
    plain = run(RunConfig(**base), dataset=dataset)
    secure = run(RunConfig(**base, secure=True), dataset=dataset)
    return plain, secure


def timed_pairs(base, dataset, reps):
    """``reps`` plain/secure pairs, interleaved so that a slow spell of the machine hits both."""
    return [timed_pair(base, dataset) for _ in range(reps)]


def median_cost(pairs):
    """Per measure, each pair's plain and secure value and their medians (a run's idle time hangs on one timing)."""
    measures = {"compute_per_round_s": lambda r: per_round(r, "compute_s"),
                "bytes_up_per_round": lambda r: per_round(r, "bytes_up"),
                "total_per_client_s": lambda r: r["time_per_client"]["total_s"]}
    cost = {}
    for key, measure in measures.items():
        values = {side: [measure(pair[i]) for pair in pairs] for i, side in enumerate(("plain", "secure"))}
        cost[key] = {side: float(np.median(v)) for side, v in values.items()}
        cost[key]["each"] = values
        cost[key]["extra_each"] = [b / a - 1 for a, b in zip(values["plain"], values["secure"])]
    return cost


def learned_sets(results):
    """Group -> the contributor sets of its unmasked sums, from a run's record.

    A secure run records them ("contributors": the components of each
    unmasked sum and, when it split, their union too). For a plain run, the
    sets today's protocol would have unmasked: the group's clients less the
    round's dropouts.
    """
    members = {}
    for cid, k in results["groups"].items():
        members.setdefault(str(k), set()).add(int(cid))
    sets = {k: [] for k in members}
    for record in results["rounds"].values():
        if record["stage"] != "federated":
            continue
        if "contributors" in record:
            for k, parts in record["contributors"].items():
                whole = frozenset(c for part in parts for c in part)
                sets[k] += [whole] + ([frozenset(part) for part in parts] if len(parts) > 1 else [])
        else:
            dropped = {int(c) for c in record.get("dropped", {})}
            withheld = record.get("withheld", {})
            sets.update({k: sets[k] + [frozenset(m - dropped)] for k, m in members.items() if k not in withheld})
    return sets


def excluded_per_layer(results):
    """Per federated round, the clients the contributor rule left out of their group's secure sum."""
    return [sum(why.startswith("secure: excluded") for why in r.get("dropped", {}).values())
            for r in results["rounds"].values() if r["stage"] == "federated"]


def close_pair_count(results, min_size):
    """Pairs of unmasked sums of a group whose contributors differ by 1 to ``min_size`` - 1 clients."""
    from fedlayer.secure import close_pairs

    return sum(len(close_pairs(sets, min_size)) for sets in learned_sets(results).values())


def plain_on_contributors(config, dataset, secure_results):
    """The plain run in which every client misses exactly the federated rounds the secure run left it out of."""
    from fedlayer.client import ClientDropout
    from fedlayer.transport import InProcessTransport

    config = RunConfig(**{**config, "secure": False, "drop_clients": 0.0})
    out = {}
    for position, record in enumerate(r for r in secure_results["rounds"].values() if r["stage"] == "federated"):
        for cid in record.get("dropped", {}):
            out.setdefault(int(cid), set()).add(position)
    clients = make_clients(config, dataset, build(config, dataset).config())
    for client in clients:
        # Defaults bind this client's method and layers at definition, not the loop's last client.
        def local_stats(position, *args, _real=client.local_stats, _out=out.get(client.client_id, ()),  # noqa: B008
                        **kwargs):
            if position in _out:
                raise ClientDropout(f"out of the secure run's sum of layer {position + 1}")
            return _real(position, *args, **kwargs)

        client.local_stats = local_stats
    return run(config, transport=InProcessTransport(clients), dataset=dataset)


def contributor_rules(seeds, out):
    """Part 6: pFedACnnL --secure on MNIST-DNN against plain, without and with --drop-clients 0.2."""
    report = {}
    for seed in seeds:
        base = {"algorithm": "pfedacnnl", "dataset": "mnist", "model": "dnn", "seed": seed}
        dataset = load_dataset(RunConfig(**base))
        m = RunConfig(**base).min_group_size
        entry = report.setdefault(str(seed), {"min_group_size": m})
        if seed == seeds[0]:
            plain = run(RunConfig(**base), dataset=dataset)
            secure = run(RunConfig(**base, secure=True), dataset=dataset)
            entry["no_dropouts"] = {"accuracy": {"plain": plain["accuracy"], "secure": secure["accuracy"]},
                                    "weights_rel_diff": weight_difference(plain, secure),
                                    "close_pairs": close_pair_count(secure, m)}
        plain = run(RunConfig(**base, drop_clients=0.2), dataset=dataset)
        secure = run(RunConfig(**base, drop_clients=0.2, secure=True), dataset=dataset)
        reference = plain_on_contributors(base, dataset, secure)
        federated = [r for r in secure["rounds"].values() if r["stage"] == "federated"]
        entry["drop_0.2"] = {
            "accuracy": {"plain": plain["accuracy"], "secure": secure["accuracy"],
                         "plain_on_secure_contributors": reference["accuracy"]},
            "close_pairs": {"secure": close_pair_count(secure, m), "plain_as_today": close_pair_count(plain, m)},
            "excluded_per_layer": excluded_per_layer(secure),
            "dropped_per_layer": [len(r.get("dropped", {})) for r in federated],
            "withheld": sum(len(r.get("withheld", {})) for r in federated),
            "weights_rel_diff_vs_plain_on_contributors": weight_difference(reference, secure),
        }
        print("rules", seed, entry, flush=True)
    return report


PARTS = ("threat", "cost", "scaling", "dropouts", "h_noise", "mpi", "rules")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scaling", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--skip-mpi", action="store_true")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="what to measure; the others are kept from OUT/secure_sums.json")
    parser.add_argument("--reps", type=int, default=5, help="plain/secure pairs timed on MNIST-DNN (medians reported)")
    parser.add_argument("--scaling-reps", type=int, default=3,
                        help="plain/secure pairs per client count on Synthetic (median reported)")
    parser.add_argument("--rules-seeds", type=int, nargs="+", default=[0, 1],
                        help="seeds of the contributor-rule runs (part 'rules'); the first also runs without dropouts")
    args = parser.parse_args()
    use_shared_data()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # A subset of the parts reruns those and keeps the others from the last full run's JSON.
    parts = set(args.parts)
    previous = out / "secure_sums.json"
    report = json.loads(previous.read_text()) if parts != set(PARTS) and previous.exists() else {}

    mnist_base = {"algorithm": "fedacnnl", "dataset": "mnist", "model": "dnn", "seed": args.seed}
    mnist = load_dataset(RunConfig(**mnist_base))
    if "threat" in parts:
        report["threat"] = threat(mnist, RunConfig(**mnist_base), out)
        print("threat:", report["threat"]["correlation"], flush=True)

    if "cost" in parts:
        pairs = timed_pairs(mnist_base, mnist, args.reps)
        plain, secure = pairs[0]
        report["mnist"] = {
            "weights_rel_diff": max(weight_difference(b, a) for a, b in pairs),
            "accuracy": {"plain": plain["accuracy"], "secure": secure["accuracy"]},
            **median_cost(pairs),
            "reps": args.reps,
            "setup_bytes": secure["secure"]["setup_bytes"],
        }
        print("mnist:", report["mnist"], flush=True)

    if "scaling" in parts:
        report["scaling"] = {}
        for n in args.scaling:
            base = {"algorithm": "fedacnnl", "dataset": "synthetic", "model": "dnn", "clients": n, "seed": args.seed,
                    "min_samples": 10}
            dataset = load_dataset(RunConfig(**base))
            pairs = timed_pairs(base, dataset, args.scaling_reps)
            extras = [per_round(secure, "compute_s") - per_round(plain, "compute_s") for plain, secure in pairs]
            plain, secure = pairs[0]
            report["scaling"][n] = {"extra_compute_per_client_round_s": float(np.median(extras)),
                                    "extra_each": extras,
                                    "bytes_up_per_client_round": {"plain": per_round(plain, "bytes_up") / n,
                                                                  "secure": per_round(secure, "bytes_up") / n},
                                    "weights_rel_diff": weight_difference(secure, plain),
                                    "log2_n": math.log2(n)}
            print("scaling", n, report["scaling"][n], flush=True)

    if "dropouts" in parts:
        report["dropouts"] = {}
        # Fresh clients of the same data for the survivors' reference (it sets their earlier layers itself).
        reference_config = RunConfig(**mnist_base)
        reference_clients = make_clients(reference_config, mnist, build(reference_config, mnist).config())
        for name, extra in (("none", {}), ("plain 0.1", {"drop_clients": 0.1}),
                            ("secure 0.1", {"drop_clients": 0.1, "secure": True})):
            results = run(RunConfig(**mnist_base, **extra), dataset=mnist)
            dropped = [len(r.get("dropped", {})) for r in results["rounds"].values() if r["stage"] == "federated"]
            report["dropouts"][name] = {"accuracy": results["accuracy"], "dropped_per_round": dropped}
            if extra:
                # Centralized ACnnL on each layer's survivors.
                reference = survivors_solution(reference_clients, list(results["rounds"].values()),
                                               results["group_weights"][0], gamma=reference_config.gamma)
                report["dropouts"][name]["vs_survivors_rel_diff"] = weight_difference(
                    results, {"group_weights": {0: reference}})
            if extra.get("secure"):
                # Secure sums keep clients out where the contributor rule needs it: compare with the plain run
                # on the same contributors.
                report["dropouts"][name]["excluded_per_round"] = excluded_per_layer(results)
                report["dropouts"]["secure_vs_plain_rel_diff"] = weight_difference(
                    plain_on_contributors({**mnist_base, **extra}, mnist, results), results)
        # pFedACnnL: K-means groups of 7-13 clients, so a client has fewer neighbours and the dropouts of a
        # layer weigh more on each self mask's threshold.
        personalized = {}
        for name, extra in (("plain", {}), ("secure", {"secure": True})):
            config = RunConfig(**{**mnist_base, "algorithm": "pfedacnnl", "drop_clients": 0.1, **extra})
            personalized[name] = run(config, dataset=mnist)
        report["dropouts"]["pfedacnnl"] = {
            name: {"accuracy": r["accuracy"],
                   "dropped_per_round": [len(x.get("dropped", {})) for x in r["rounds"].values()
                                         if x["stage"] == "federated"],
                   "withheld": sum(len(x.get("withheld", {})) for x in r["rounds"].values())}
            for name, r in personalized.items()}
        report["dropouts"]["pfedacnnl"]["secure"]["excluded_per_round"] = excluded_per_layer(personalized["secure"])
        report["dropouts"]["pfedacnnl"]["secure_vs_plain_rel_diff"] = weight_difference(
            plain_on_contributors({**mnist_base, "algorithm": "pfedacnnl", "drop_clients": 0.1, "secure": True}, mnist,
                                  personalized["secure"]), personalized["secure"])
        print("dropouts:", report["dropouts"], flush=True)

    if "h_noise" in parts:
        from sklearn.metrics import adjusted_rand_score

        report["h_noise"] = {}
        clean = None
        for sigma in (0.0, 0.1, 0.3, 1.0):
            config = RunConfig(**{**mnist_base, "algorithm": "pfedacnnl"}, secure=True, h_noise=sigma)
            results = run(config, dataset=mnist)
            groups = [results["groups"][cid] for cid in sorted(results["groups"], key=int)]
            clean = groups if clean is None else clean
            # How far the noise moved the clustering: 1 = the same partition as without noise (up to names).
            report["h_noise"][sigma] = {"accuracy": results["accuracy"], "groups": len(set(groups)),
                                        "rand_vs_clean": float(adjusted_rand_score(clean, groups))}
        print("h_noise:", report["h_noise"], flush=True)

    if "mpi" in parts:
        mpiexec = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
        if mpiexec and not args.skip_mpi:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [mpiexec, "-n", "3", sys.executable, "-m", "fedlayer", "run", "--algorithm", "fedacnnl",
                       "--dataset", "mnist", "--seed", str(args.seed), "--quiet", "--output", tmp]
                subprocess.run(cmd, check=True)
                results = json.loads((Path(tmp) / "results.json").read_text())
            report["mpi"] = [{"layer": r["layer"] + 1, "client_upload_bytes": r["bytes_up"],
                              "rank0_received_bytes": sum(v["bytes"] for v in r["transport"].values()),
                              "messages": len(r["transport"])}
                             for r in results["rounds"].values() if r["stage"] == "federated"]
            print("mpi:", report["mpi"], flush=True)

    if "rules" in parts:
        report["rules"] = contributor_rules(args.rules_seeds, out)

    (out / "secure_sums.json").write_text(json.dumps(report, indent=1))
    (out / "secure_sums.md").write_text(render(report, args))
    print(render(report, args))


def render(report, args):
    m = report["mnist"]
    overhead = {key: 100 * (m[key]["secure"] / m[key]["plain"] - 1)
                for key in ("compute_per_round_s", "bytes_up_per_round", "total_per_client_s")}
    t = report["threat"]

    def each(key):
        return " / ".join(f"{100 * e:+.0f} %" for e in m[key].get("extra_each", []))

    lines = [
        "# Secure sums: threat, cost, dropouts",
        "",
        f"Command: `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python experiments/secure_sums.py --seed {args.seed}"
        + (f" --parts {' '.join(args.parts)}" if set(args.parts) != set(PARTS) else "")
        + f"` on {platform.machine()}, {fastls.available_cores()} cores (FedACnnL, clients in one process unless "
        "stated)."
        + (f" Only {', '.join(args.parts)} measured by this command; the other sections come from the script's "
           "previous run (secure_sums.json), whose code may predate later changes (see git log)."
           if set(args.parts) != set(PARTS) else ""),
        "",
        "## The threat and the fix",
        "",
        "![class means](secure_threat.png)",
        "",
        f"Correlation of client 0's true mean image per class with what the server rebuilds from its first-layer "
        f"upload (classes {t['classes']}): plain "
        f"{', '.join(f'{c:.4f}' for c in t['correlation']['plain'])}; secure "
        f"{', '.join(f'{c:+.3f}' for c in t['correlation']['secure'])}.",
        "",
        "## Cost on MNIST-DNN, 100 clients",
        "",
        f"Medians over {m.get('reps', 1)} plain/secure pairs run one after the other; the last column lists each "
        "pair's extra.",
        "",
        "| | plain | secure | extra (medians) | extra, each pair |",
        "|---|---|---|---|---|",
        f"| client compute per round (mean, s) | {m['compute_per_round_s']['plain']:.4f} | "
        f"{m['compute_per_round_s']['secure']:.4f} | {overhead['compute_per_round_s']:+.0f} % | "
        f"{each('compute_per_round_s')} |",
        f"| bytes up per round (all clients) | {m['bytes_up_per_round']['plain']:,.0f} | "
        f"{m['bytes_up_per_round']['secure']:,.0f} | {overhead['bytes_up_per_round']:+.0f} % | "
        f"{each('bytes_up_per_round')} |",
        f"| total time per client (s) | {m['total_per_client_s']['plain']:.3f} | "
        f"{m['total_per_client_s']['secure']:.3f} | {overhead['total_per_client_s']:+.0f} % | "
        f"{each('total_per_client_s')} |",
        f"| final accuracy | {m['accuracy']['plain']:.4f} | {m['accuracy']['secure']:.4f} | | |",
        "",
        f"Largest relative difference of the weights, secure against plain: {m['weights_rel_diff']:.2e} "
        "(target <= 1e-9).",
        f"Key setup, once per run: {m['setup_bytes']:,} bytes (the public keys; no key shares since 2026-11-29).",
        "",
        "Discussion of these figures, and what is still open: [secure_sums_notes.md](secure_sums_notes.md).",
        "",
        "## Growth with clients (Synthetic-DNN)",
        "",
        "| clients | extra compute per client and round (s, median) | / log2 N | each pair (ms) "
        "| bytes up per client and round, plain -> secure | weights rel. diff |",
        "|---|---|---|---|---|---|",
    ]
    for n, s in report["scaling"].items():
        each = " / ".join(f"{1e3 * e:.2f}" for e in s.get("extra_each", [s["extra_compute_per_client_round_s"]]))
        lines.append(f"| {n} | {s['extra_compute_per_client_round_s']:.4f} | "
                     f"{s['extra_compute_per_client_round_s'] / s['log2_n']:.5f} | {each} | "
                     f"{s['bytes_up_per_client_round']['plain']:,.0f} -> "
                     f"{s['bytes_up_per_client_round']['secure']:,.0f} | {s['weights_rel_diff']:.1e} |")
    d = report["dropouts"]
    lines += [
        "",
        "## Dropouts (MNIST-DNN, `--drop-clients 0.1`)",
        "",
        "| run | accuracy | clients dropped per layer |",
        "|---|---|---|",
    ]
    for name in ("none", "plain 0.1", "secure 0.1"):
        lines.append(f"| {name} | {d[name]['accuracy']:.4f} | {d[name]['dropped_per_round']} |")
    excluded = d["secure 0.1"].get("excluded_per_round")
    lines += ["", f"Secure against plain on the secure run's contributors (the clients the contributor rule left out "
                  f"of a sum fail there too{'' if excluded is None else f'; excluded per layer: {excluded}'}): weights "
                  f"differ by {d['secure_vs_plain_rel_diff']:.1e} (relative)."]
    if "vs_survivors_rel_diff" in d["plain 0.1"]:
        lines += ["", "Against centralized ACnnL on each layer's survivors (fresh clients of the same data, one batch "
                      "each, summed outside any transport, `fedlayer.server.survivors_solution`): plain "
                      f"{d['plain 0.1']['vs_survivors_rel_diff']:.1e}, "
                      f"secure {d['secure 0.1']['vs_survivors_rel_diff']:.1e} "
                      "(largest relative difference of the weights)."]
    if "pfedacnnl" in d:
        p = d["pfedacnnl"]
        lines += ["",
                  "pFedACnnL, `--drop-clients 0.1` (K-means groups, each client's neighbours within its group):", "",
                  "| run | accuracy | clients dropped per layer | groups withheld (too few survivors) |",
                  "|---|---|---|---|"]
        for name in ("plain", "secure"):
            lines.append(f"| {name} | {p[name]['accuracy']:.4f} | {p[name]['dropped_per_round']} | "
                         f"{p[name]['withheld']} |")
        excluded = p["secure"].get("excluded_per_round")
        lines += ["", f"Secure against plain on the secure run's contributors"
                      f"{'' if excluded is None else f' (excluded per layer: {excluded})'}: weights differ by "
                      f"{p['secure_vs_plain_rel_diff']:.1e} (relative)."]
    lines += ["", "## Noise on the label summaries (MNIST-DNN, pFedACnnL, `--secure --h-noise SIGMA`)", "",
              "| SIGMA | accuracy | groups after merging | adjusted Rand index against SIGMA = 0 |",
              "|---|---|---|---|"]
    for sigma, r in report["h_noise"].items():
        rand = f"{r['rand_vs_clean']:.3f}" if "rand_vs_clean" in r else "-"
        lines.append(f"| {sigma} | {r['accuracy']:.4f} | {r['groups']} | {rand} |")
    lines += ["", "The adjusted Rand index compares each run's K-means groups with the noiseless run's: 1 is the "
                  "same partition, about 0 a random one."]
    if "mpi" in report:
        lines += ["", "## Per-rank sums under `mpiexec -n 3` (MNIST-DNN)", "",
                  "| layer | bytes the clients upload (simulated links) | bytes rank 0 received | messages |",
                  "|---|---|---|---|"]
        for r in report["mpi"]:
            lines.append(f"| {r['layer']} | {r['client_upload_bytes']:,} | {r['rank0_received_bytes']:,} | "
                         f"{r['messages']} |")
    if "rules" in report:
        lines += ["", "## Contributor rules (MNIST-DNN, pFedACnnL; `--parts rules`)", "",
                  "Close pairs: pairs of unmasked sums of a group whose contributors differ by 1 to "
                  "min_group_size - 1 clients (their difference is those clients' statistics; with one client, its "
                  "class counts). For the plain run, counted as today's protocol would have unmasked its sums "
                  "(the group less the round's dropouts).", "",
                  "| seed | run | accuracy | close pairs | excluded per layer | weights rel. diff |",
                  "|---|---|---|---|---|---|"]
        for seed, entry in report["rules"].items():
            if "no_dropouts" in entry:
                e = entry["no_dropouts"]
                lines.append(f"| {seed} | no dropouts, plain | {e['accuracy']['plain']:.4f} | | | |")
                lines.append(f"| {seed} | no dropouts, secure | {e['accuracy']['secure']:.4f} | {e['close_pairs']} | | "
                             f"{e['weights_rel_diff']:.1e} (against plain) |")
            e = entry["drop_0.2"]
            lines.append(f"| {seed} | `--drop-clients 0.2`, plain | {e['accuracy']['plain']:.4f} | "
                         f"{e['close_pairs']['plain_as_today']} | | |")
            lines.append(f"| {seed} | `--drop-clients 0.2`, secure | {e['accuracy']['secure']:.4f} | "
                         f"{e['close_pairs']['secure']} | {e['excluded_per_layer']} | "
                         f"{e['weights_rel_diff_vs_plain_on_contributors']:.1e} (against plain on its contributors, "
                         f"accuracy {e['accuracy']['plain_on_secure_contributors']:.4f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
