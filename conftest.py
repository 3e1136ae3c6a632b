"""Test configuration shared by tests/, bench/ and experiments/.

* ``numeric_checks`` (tests/numeric_checks.py), the one dtype-aware closeness
  helper, is importable from all three roots;
* ``FEDLAYER_DATA_DIR`` points at the checkout's data (``../shared/data``)
  unless already set, so tests on real MNIST / CIFAR-10 run where the files
  are and skip, naming the directories searched, where they are not.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "experiments"))

from dev_layout import use_shared_data  # noqa: E402

use_shared_data()
