import zlib
from pathlib import PurePosixPath

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    # A fresh seed per test id, so no two tests share inputs but runs repeat. The id is taken as
    # "tests/<file>::<test>", whatever subfolder the file sits in, so moving a test keeps its inputs.
    path, _, test = request.node.nodeid.partition("::")
    return np.random.default_rng(zlib.crc32(f"tests/{PurePosixPath(path).name}::{test}".encode()))
