"""The clients' groups: K-means on their label summaries (eq. 9), small groups merged for secure sums."""

from __future__ import annotations

import numpy as np

__all__ = ["cluster", "merge_small_groups"]


def cluster(summaries: dict[int, np.ndarray], n_groups: int, seed: int) -> dict[int, int]:
    """cid -> group of K-means with ``n_groups`` clusters on the clients' label summaries h_i.

    Raises
    ------
    ValueError
        If there are fewer clients than groups.
    """
    from sklearn.cluster import KMeans

    cids = sorted(summaries)
    if n_groups > len(cids):
        raise ValueError(f"groups (K={n_groups}) cannot exceed the number of clients ({len(cids)})")
    H = np.stack([summaries[cid] for cid in cids])
    labels = KMeans(n_clusters=n_groups, random_state=seed, n_init=10).fit_predict(H)
    return {cid: int(label) for cid, label in zip(cids, labels)}


def merge_small_groups(group_of: dict[int, int], summaries: dict[int, np.ndarray], min_size: int) -> dict[int, int]:
    """Merge every group of fewer than ``min_size`` clients into the group with the nearest centroid.

    A secure sum over one client would be that client's statistics: groups
    below the minimum size join the group whose mean h is closest to theirs
    (smallest group first, until none is below the size or one group is
    left). Groups are renumbered 0..K'-1 in order of their first member.
    """
    groups = {}
    for cid, k in group_of.items():
        groups.setdefault(k, []).append(cid)
    while len(groups) > 1:
        small = min(groups, key=lambda k: (len(groups[k]), k))
        if len(groups[small]) >= min_size:
            break
        centroid = {k: np.mean([summaries[c] for c in members], axis=0) for k, members in groups.items()}
        nearest = min((k for k in groups if k != small),
                      key=lambda k: (float(np.sum((centroid[k] - centroid[small]) ** 2)), k))
        groups[nearest] += groups.pop(small)
    order = sorted(groups, key=lambda k: min(groups[k]))
    return {cid: new for new, k in enumerate(order) for cid in groups[k]}
