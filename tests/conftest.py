import numpy as np
import pytest


@pytest.fixture
def rng(request):
    # A fresh seed per test id, so no two tests share inputs but runs repeat.
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
