"""Where a development checkout keeps what its tests and experiment scripts need.

The library searches ``$FEDLAYER_DATA_DIR`` and ``./data`` only; the data of
this checkout live beside the repository, in ``../shared/data``, and are never
copied into it. The test configuration and the scripts call
:func:`use_shared_data` so that they find them.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPOSITORY", "SHARED_DATA", "use_shared_data", "emit_report"]

REPOSITORY = Path(__file__).resolve().parents[1]
SHARED_DATA = REPOSITORY.parent / "shared" / "data"


def use_shared_data():
    """Set ``FEDLAYER_DATA_DIR`` to ``../shared/data`` unless it is already set; returns the directory used.

    Subprocesses (``mpiexec`` ranks, ``python -m fedlayer``) inherit it.
    """
    if not os.environ.get("FEDLAYER_DATA_DIR"):
        os.environ["FEDLAYER_DATA_DIR"] = str(SHARED_DATA)
    return Path(os.environ["FEDLAYER_DATA_DIR"])


def emit_report(lines, out=None):
    """Print a markdown report made of ``lines`` and, when ``out`` is given, write it there too."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out:
        Path(out).write_text(report)
