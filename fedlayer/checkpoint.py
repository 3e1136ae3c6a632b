"""Atomic checkpoints of the server's state after every trained layer.

A checkpoint holds what the server needs to go on where it stopped: the
groups, every finished layer's weights per group, the next batch sizes, the
first round's durations (eq. 7) and the round records so far. Weights are
stored bit for bit, so a resumed run ends with the weights an uninterrupted
one would have.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["save_checkpoint", "load_checkpoint"]

_FORMAT = "fedlayer-checkpoint-1"


def save_checkpoint(path, *, fingerprint, layers_done, group_of, group_weights, batch, first_durations, rounds):
    """Write the state to ``path`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": _FORMAT,
        "fingerprint": fingerprint,
        "layers_done": layers_done,
        "group_of": {str(k): v for k, v in group_of.items()},
        "batch": {str(k): v for k, v in batch.items()},
        "first_durations": None if first_durations is None else {str(k): v for k, v in first_durations.items()},
        "rounds": rounds,
        "groups": sorted(group_weights),
    }
    arrays = {f"w_{k}_{i}": W for k, weights in group_weights.items() for i, W in enumerate(weights)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, state=np.array(json.dumps(state)), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path, fingerprint):
    """The state saved by :func:`save_checkpoint`, checked against this run's fingerprint."""
    with np.load(path, allow_pickle=False) as data:
        state = json.loads(str(data["state"]))
        if state.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a fedlayer checkpoint (format {state.get('format')!r})")
        if state["fingerprint"] != fingerprint:
            diff = {k: (state["fingerprint"].get(k), v) for k, v in fingerprint.items()
                    if state["fingerprint"].get(k) != v}
            raise ValueError(f"checkpoint {path} was written by another configuration: (saved, now) = {diff}; "
                             f"remove it or run without --resume")
        group_weights = {int(k): [data[f"w_{k}_{i}"] for i in range(state["layers_done"])] for k in state["groups"]}
    return {
        "layers_done": state["layers_done"],
        "group_of": {int(k): v for k, v in state["group_of"].items()},
        "batch": {int(k): v for k, v in state["batch"].items()},
        "first_durations": None if state["first_durations"] is None
        else {int(k): v for k, v in state["first_durations"].items()},
        "rounds": state["rounds"],
        "group_weights": group_weights,
    }
