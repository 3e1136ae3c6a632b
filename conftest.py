"""Test configuration shared by tests/, bench/ and experiments/.

* ``tests.numeric_checks``, the one dtype-aware closeness helper, is
  importable from all three roots (pytest puts this folder on the path);
* ``FEDLAYER_DATA_DIR`` points at the checkout's data (``../shared/data``)
  unless already set, so tests on real MNIST / CIFAR-10 run where the files
  are and skip, naming the directories searched, where they are not.
"""

from experiments.dev_layout import use_shared_data

use_shared_data()
