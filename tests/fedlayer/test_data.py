"""Tests for fedlayer.data: file readers, synthetic data, partitions, load_federated.

Small fake files are written to tmp_path for the format tests; the tests on
the real MNIST / CIFAR-10 files find them through default_data_dirs() (so
FEDLAYER_DATA_DIR is honoured) and skip when they are absent.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlayer.data as data_module
from fedlayer.data import (
    KNOWN_DATASETS,
    ClientData,
    FederatedDataset,
    default_data_dirs,
    dirichlet_partition,
    load_cifar10,
    load_federated,
    load_mnist,
    make_synthetic,
    one_hot,
    read_idx,
    train_test_split_per_client,
)

MNIST_FILE_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
IDX_TYPE_CODES = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}


# --------------------------------------------------------------------------- #
# Helpers writing small files in the official formats
# --------------------------------------------------------------------------- #


def idx_bytes(array: np.ndarray) -> bytes:
    array = np.asarray(array)
    header = bytes([0, 0, IDX_TYPE_CODES[array.dtype], array.ndim])
    header += np.asarray(array.shape, dtype=">i4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool) -> Path:
    content = idx_bytes(array)
    path.write_bytes(gzip.compress(content) if compress else content)
    return path


def write_fake_mnist(directory: Path, n_train: int = 12, n_test: int = 6, seed: int = 0,
                     compress: bool = True) -> tuple[np.ndarray, ...]:
    """Write the four IDX files; return (x_train, y_train, x_test, y_test) as written."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train).astype(np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test).astype(np.uint8),
    )
    for name, array in zip(MNIST_FILE_NAMES, arrays):
        write_idx(directory / (name + (".gz" if compress else "")), array, compress)
    return arrays


def cifar_batch_pickle(rows: np.ndarray, labels: np.ndarray, bytes_keys: bool = True) -> bytes:
    key = (lambda k: k.encode()) if bytes_keys else (lambda k: k)
    batch = {
        key("batch_label"): b"fake batch",
        key("labels"): [int(v) for v in labels],
        key("data"): rows,
        key("filenames"): [b"img%d.png" % i for i in range(len(labels))],
    }
    return pickle.dumps(batch, protocol=2)


def fake_cifar_batches(n_per_batch: int = 3, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return {
        name: (
            rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
            rng.integers(0, 10, n_per_batch),
        )
        for name in names
    }


def write_fake_cifar_dir(root: Path, batches) -> Path:
    directory = root / "cifar-10-batches-py"
    directory.mkdir(parents=True, exist_ok=True)
    for name, (rows, labels) in batches.items():
        (directory / name).write_bytes(cifar_batch_pickle(rows, labels))
    return directory


def write_fake_cifar_tar(root: Path, batches, skip: tuple[str, ...] = ()) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    archive = root / "cifar-10-python.tar.gz"
    members = {"batches.meta": pickle.dumps({b"label_names": [b"airplane"]}, protocol=2),
               "readme.html": b"<html></html>"}
    members.update({name: cifar_batch_pickle(*batch) for name, batch in batches.items()
                    if name not in skip})
    with tarfile.open(archive, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return archive


def rows_to_nhwc(rows: np.ndarray) -> np.ndarray:
    return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def assert_is_partition(parts: list[np.ndarray], n_samples: int) -> None:
    for part in parts:
        assert part.ndim == 1
        assert part.dtype == np.int64
    merged = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    # Disjoint and covering at once: the sorted union is exactly 0..n-1.
    np.testing.assert_array_equal(np.sort(merged), np.arange(n_samples))


# --------------------------------------------------------------------------- #
# IDX
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(5 * 28 * 28, dtype=np.int64).reshape(5, 28, 28).astype(np.uint8),
        np.array([-128, -1, 0, 1, 127], dtype=np.int8),
        np.array([[-30000, 5], [7, 30000]], dtype=np.int16),
        np.array([-(2**31), 2**31 - 1, 0, 123456789], dtype=np.int32),
        np.array([[1.5, -2.25, np.pi]], dtype=np.float32),
        np.array([[1e-300, -1e300], [0.0, np.e]], dtype=np.float64),
    ],
    ids=["uint8", "int8", "int16", "int32", "float32", "float64"],
)
def test_read_idx_round_trip(tmp_path, array, compress):
    path = write_idx(tmp_path / ("a.idx.gz" if compress else "a.idx"), array, compress)
    result = read_idx(path)
    assert result.dtype == array.dtype.newbyteorder("=")
    assert result.dtype.isnative
    assert result.shape == array.shape
    np.testing.assert_array_equal(result, array)
    result.flat[0] = 0  # the caller owns a writable array


def test_read_idx_detects_gzip_from_content_not_name(tmp_path):
    array = np.arange(10, dtype=np.uint8)
    gz_named_plain = write_idx(tmp_path / "labels.gz", array, compress=False)
    plain_named_gz = write_idx(tmp_path / "labels", array, compress=True)
    np.testing.assert_array_equal(read_idx(gz_named_plain), array)
    np.testing.assert_array_equal(read_idx(plain_named_gz), array)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_read_idx_rejects_corrupted_magic(tmp_path, compress):
    content = bytearray(idx_bytes(np.zeros((2, 3), dtype=np.uint8)))
    content[0] = 0x01
    path = tmp_path / "bad.idx"
    path.write_bytes(gzip.compress(bytes(content)) if compress else bytes(content))
    with pytest.raises(ValueError, match="magic number"):
        read_idx(path)


def test_read_idx_rejects_unknown_type_code(tmp_path):
    content = bytearray(idx_bytes(np.zeros(4, dtype=np.uint8)))
    content[2] = 0x07
    path = tmp_path / "bad.idx"
    path.write_bytes(bytes(content))
    with pytest.raises(ValueError, match="type code 0x07"):
        read_idx(path)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_read_idx_rejects_truncated_payload(tmp_path, compress):
    content = idx_bytes(np.ones((4, 28, 28), dtype=np.uint8))[:-10]
    path = tmp_path / "truncated.idx"
    path.write_bytes(gzip.compress(content) if compress else content)
    with pytest.raises(ValueError, match="payload size mismatch.*truncated"):
        read_idx(path)


def test_read_idx_rejects_trailing_bytes_and_short_header(tmp_path):
    too_long = tmp_path / "long.idx"
    too_long.write_bytes(idx_bytes(np.ones(3, dtype=np.int32)) + b"\x00")
    with pytest.raises(ValueError, match="payload size mismatch"):
        read_idx(too_long)
    short_header = tmp_path / "short.idx"
    short_header.write_bytes(bytes([0, 0, 0x08, 3, 0, 0, 0, 1]))
    with pytest.raises(ValueError, match="truncated IDX header"):
        read_idx(short_header)


def test_read_idx_rejects_truncated_gzip_stream(tmp_path):
    path = tmp_path / "cut.idx.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.ones((50, 28, 28), dtype=np.uint8)))[:-20])
    with pytest.raises(ValueError, match="cannot decompress"):
        read_idx(path)


def test_read_idx_rejects_corrupt_gzip_stream(tmp_path):
    """Corrupt compressed data (zlib.error inside gzip) is a ValueError naming the file, like a truncated one."""
    compressed = bytearray(gzip.compress(idx_bytes(np.zeros((50, 28, 28), dtype=np.uint8))))
    compressed[10] = 0xFF  # the first deflate block header: an invalid block type
    path = tmp_path / "corrupt.idx.gz"
    path.write_bytes(bytes(compressed))
    with pytest.raises(ValueError, match=r"corrupt.idx.gz: cannot decompress the IDX file \(error: .*invalid block"):
        read_idx(path)


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        read_idx(tmp_path / "nope.idx")


# --------------------------------------------------------------------------- #
# MNIST loader and data directories
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_load_mnist_from_variant_subfolder(tmp_path, compress):
    written = write_fake_mnist(tmp_path / "mnist", compress=compress)
    x_train, y_train, x_test, y_test = load_mnist(tmp_path)
    assert x_train.shape == (12, 28, 28, 1) and x_test.shape == (6, 28, 28, 1)
    assert x_train.dtype == np.uint8 and x_test.dtype == np.uint8
    assert y_train.dtype == np.int64 and y_test.dtype == np.int64
    np.testing.assert_array_equal(x_train[..., 0], written[0])
    np.testing.assert_array_equal(y_train, written[1])
    np.testing.assert_array_equal(x_test[..., 0], written[2])
    np.testing.assert_array_equal(y_test, written[3])


def test_load_mnist_files_directly_in_data_dir_and_fashion_variant(tmp_path):
    direct = write_fake_mnist(tmp_path / "plain", seed=1)
    np.testing.assert_array_equal(load_mnist(tmp_path / "plain")[1], direct[1])

    fashion = write_fake_mnist(tmp_path / "both" / "fashion-mnist", seed=2)
    write_fake_mnist(tmp_path / "both" / "mnist", seed=3)
    x_train, y_train, _, _ = load_mnist(tmp_path / "both", variant="fashion-mnist")
    np.testing.assert_array_equal(x_train[..., 0], fashion[0])
    np.testing.assert_array_equal(y_train, fashion[1])


def test_default_data_dirs_order(tmp_path, monkeypatch):
    """The library searches the variable and ./data only, never the layout of a development checkout."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDLAYER_DATA_DIR", raising=False)
    assert default_data_dirs() == [tmp_path / "data"]

    monkeypatch.setenv("FEDLAYER_DATA_DIR", "")
    assert default_data_dirs() == [tmp_path / "data"]

    monkeypatch.setenv("FEDLAYER_DATA_DIR", str(tmp_path / "custom"))
    assert default_data_dirs() == [tmp_path / "custom", tmp_path / "data"]


def test_load_mnist_uses_environment_variable_first(tmp_path, monkeypatch):
    written = write_fake_mnist(tmp_path / "env" / "mnist", n_train=4, n_test=2)
    monkeypatch.setenv("FEDLAYER_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    x_train, y_train, x_test, _ = load_mnist()
    assert x_train.shape == (4, 28, 28, 1) and x_test.shape == (2, 28, 28, 1)
    np.testing.assert_array_equal(y_train, written[1])


def test_load_mnist_missing_files_message_names_searched_paths(tmp_path):
    (tmp_path / "mnist").mkdir()
    # Only the images: the directory must be reported as incomplete.
    write_idx(tmp_path / "mnist" / "train-images-idx3-ubyte.gz",
              np.zeros((1, 28, 28), dtype=np.uint8), compress=True)
    with pytest.raises(FileNotFoundError) as caught:
        load_mnist(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "mnist") in message
    assert str(tmp_path) + "  (no files)" in message
    assert "missing train-labels-idx1-ubyte" in message
    for name in MNIST_FILE_NAMES:
        assert name + ".gz" in message
    assert "fetch_openml_dataset('mnist_784')" in message
    assert "FEDLAYER_DATA_DIR" in message


def test_missing_dataset_message_lists_every_default_dir(tmp_path, monkeypatch):
    searched = [tmp_path / "first", tmp_path / "second"]
    monkeypatch.setattr(data_module, "default_data_dirs", lambda: list(searched))
    with pytest.raises(FileNotFoundError) as caught:
        load_mnist(variant="fashion-mnist")
    message = str(caught.value)
    for root in searched:
        assert str(root / "fashion-mnist") in message
    assert "fetch_openml_dataset('Fashion-MNIST')" in message

    with pytest.raises(FileNotFoundError) as caught:
        load_cifar10()
    message = str(caught.value)
    for root in searched:
        assert str(root / "cifar-10-batches-py") in message
        assert str(root / "cifar-10-python.tar.gz") in message
    assert "fetch_openml_dataset('CIFAR_10')" in message


def test_load_mnist_rejects_wrong_image_shape_and_variant(tmp_path):
    write_fake_mnist(tmp_path / "mnist", n_train=3, n_test=2)
    write_idx(tmp_path / "mnist" / "train-images-idx3-ubyte.gz",
              np.zeros((3, 27, 28), dtype=np.uint8), compress=True)
    with pytest.raises(ValueError, match=r"\(n, 28, 28\)"):
        load_mnist(tmp_path)
    with pytest.raises(ValueError, match="unknown MNIST variant"):
        load_mnist(tmp_path, variant="kmnist")


def test_load_mnist_rejects_label_count_mismatch(tmp_path):
    write_fake_mnist(tmp_path / "mnist", n_train=3, n_test=2)
    write_idx(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz",
              np.zeros(5, dtype=np.uint8), compress=True)
    with pytest.raises(ValueError, match="5 labels but .* 2 images"):
        load_mnist(tmp_path)


# --------------------------------------------------------------------------- #
# CIFAR-10 loader
# --------------------------------------------------------------------------- #


def test_cifar_red_plane_becomes_channel_zero(tmp_path):
    batches = fake_cifar_batches(n_per_batch=2)
    # One recognisable image: R plane = 10, G plane = 20, B plane = 30, with a
    # marker at pixel (row 1, column 2) of the red plane only.
    rows = np.concatenate([np.full(1024, 10), np.full(1024, 20), np.full(1024, 30)]).astype(np.uint8)
    rows[1 * 32 + 2] = 200
    batches["data_batch_1"][0][0] = rows
    write_fake_cifar_dir(tmp_path, batches)

    x_train, _, _, _ = load_cifar10(tmp_path)
    image = x_train[0]
    assert image.shape == (32, 32, 3)
    assert image[1, 2, 0] == 200
    assert np.all(np.delete(image[..., 0].ravel(), 1 * 32 + 2) == 10)
    assert np.all(image[..., 1] == 20) and np.all(image[..., 2] == 30)


def test_load_cifar10_from_directory(tmp_path):
    batches = fake_cifar_batches(n_per_batch=3)
    write_fake_cifar_dir(tmp_path, batches)
    x_train, y_train, x_test, y_test = load_cifar10(tmp_path)
    train_names = [f"data_batch_{i}" for i in range(1, 6)]

    assert x_train.shape == (15, 32, 32, 3) and x_test.shape == (3, 32, 32, 3)
    assert x_train.dtype == np.uint8 and x_train.flags["C_CONTIGUOUS"]
    assert y_train.dtype == np.int64 and y_test.dtype == np.int64
    expected_rows = np.concatenate([batches[name][0] for name in train_names])
    np.testing.assert_array_equal(x_train, rows_to_nhwc(expected_rows))
    np.testing.assert_array_equal(y_train, np.concatenate([batches[n][1] for n in train_names]))
    np.testing.assert_array_equal(x_test, rows_to_nhwc(batches["test_batch"][0]))
    np.testing.assert_array_equal(y_test, batches["test_batch"][1])
    # Channel c of pixel (r, col) is byte c * 1024 + r * 32 + col of the row.
    assert x_test[2, 5, 7, 1] == batches["test_batch"][0][2, 1024 + 5 * 32 + 7]


def test_load_cifar10_from_tar_gz_without_extracting(tmp_path):
    batches = fake_cifar_batches(n_per_batch=2, seed=5)
    write_fake_cifar_tar(tmp_path, batches)
    x_train, y_train, x_test, y_test = load_cifar10(tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-python.tar.gz"]
    assert x_train.shape == (10, 32, 32, 3) and y_train.shape == (10,)
    np.testing.assert_array_equal(x_test, rows_to_nhwc(batches["test_batch"][0]))
    np.testing.assert_array_equal(y_test, batches["test_batch"][1])
    np.testing.assert_array_equal(x_train[:2], rows_to_nhwc(batches["data_batch_1"][0]))
    np.testing.assert_array_equal(x_train[-2:], rows_to_nhwc(batches["data_batch_5"][0]))


def test_load_cifar10_prefers_extracted_directory_over_archive(tmp_path):
    from_dir = fake_cifar_batches(n_per_batch=1, seed=1)
    write_fake_cifar_dir(tmp_path, from_dir)
    write_fake_cifar_tar(tmp_path, fake_cifar_batches(n_per_batch=4, seed=2))
    x_train, _, _, _ = load_cifar10(tmp_path)
    assert x_train.shape[0] == 5


def test_load_cifar10_archive_missing_batch(tmp_path):
    write_fake_cifar_tar(tmp_path, fake_cifar_batches(n_per_batch=1), skip=("data_batch_3",))
    with pytest.raises(ValueError, match="lacks data_batch_3"):
        load_cifar10(tmp_path)


def test_load_cifar10_accepts_python3_str_keys(tmp_path):
    batches = fake_cifar_batches(n_per_batch=2)
    directory = write_fake_cifar_dir(tmp_path, batches)
    rows, labels = batches["test_batch"]
    (directory / "test_batch").write_bytes(cifar_batch_pickle(rows, labels, bytes_keys=False))
    _, _, _, y_test = load_cifar10(tmp_path)
    np.testing.assert_array_equal(y_test, labels)


class NotCifarData:
    """Stands for any object a hostile pickle might try to build."""


def test_load_cifar10_refuses_unexpected_pickled_objects(tmp_path):
    directory = write_fake_cifar_dir(tmp_path, fake_cifar_batches(n_per_batch=1))
    (directory / "data_batch_2").write_bytes(
        pickle.dumps({b"data": NotCifarData(), b"labels": [0]}, protocol=2)
    )
    with pytest.raises(ValueError, match="data_batch_2.*refusing to load"):
        load_cifar10(tmp_path)


def test_load_cifar10_rejects_wrong_row_length(tmp_path):
    batches = fake_cifar_batches(n_per_batch=2)
    batches["test_batch"] = (np.zeros((2, 3000), dtype=np.uint8), np.zeros(2, dtype=np.int64))
    write_fake_cifar_dir(tmp_path, batches)
    with pytest.raises(ValueError, match=r"test_batch.*\(n, 3072\)"):
        load_cifar10(tmp_path)


# --------------------------------------------------------------------------- #
# Synthetic(alpha, beta)
# --------------------------------------------------------------------------- #


def test_synthetic_is_deterministic_for_a_seed():
    first = make_synthetic(n_users=4, seed=7)
    second = make_synthetic(n_users=4, seed=7)
    other = make_synthetic(n_users=4, seed=8)
    for (x1, y1), (x2, y2) in zip(first, second):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(first[0][0][:10], other[0][0][:10])


def test_synthetic_shapes_dtypes_and_label_range():
    users = make_synthetic(alpha=1.0, beta=1.0, n_users=5, dim=8, n_classes=4, seed=1)
    assert len(users) == 5
    for x, y in users:
        assert x.dtype == np.float64 and x.ndim == 2 and x.shape[1] == 8
        assert y.dtype == np.int64 and y.shape == (x.shape[0],)
        assert y.min() >= 0 and y.max() < 4
        assert np.all(np.isfinite(x))


def test_synthetic_sample_counts_follow_the_power_law_formula():
    seed, n_users = 11, 6
    expected = (np.random.default_rng(seed).lognormal(4, 2, n_users).astype(int) + 50) * 5
    users = make_synthetic(n_users=n_users, seed=seed)
    counts = np.array([len(y) for _, y in users])
    np.testing.assert_array_equal(counts, expected)
    assert np.all(counts % 5 == 0) and np.all(counts >= 250)


def test_synthetic_input_covariance_is_diag_j_pow_minus_1_2():
    users = make_synthetic(n_users=3, seed=2)
    x = max((x for x, _ in users), key=len)
    assert len(x) >= 500
    ratio = x.var(axis=0, ddof=1) / np.arange(1, 61) ** -1.2
    assert 0.85 < ratio.mean() < 1.15
    assert np.all((ratio > 0.5) & (ratio < 2.0))


def test_synthetic_users_differ_in_label_distribution():
    # Each user has its own model W_i, b_i: label histograms should not all match.
    users = make_synthetic(n_users=6, seed=3)
    histograms = np.array([np.bincount(y, minlength=10) / len(y) for _, y in users])
    assert np.abs(histograms - histograms.mean(axis=0)).max() > 0.1


def test_synthetic_alpha_leaves_the_labels_as_the_reference_code_does():
    """u_i shifts every logit of user i alike: the argmax, and so the data, do not depend on alpha."""
    for alpha in (0.0, 50.0):
        for (x, y), (x0, y0) in zip(make_synthetic(alpha=alpha, beta=0.5, n_users=5, seed=2),
                                     make_synthetic(alpha=0.5, beta=0.5, n_users=5, seed=2)):
            np.testing.assert_array_equal(x, x0)
            np.testing.assert_array_equal(y, y0)
    moved = make_synthetic(alpha=0.5, beta=5.0, n_users=5, seed=2)
    assert any(not np.array_equal(x, x0) for (x, _), (x0, _) in
               zip(moved, make_synthetic(alpha=0.5, beta=0.5, n_users=5, seed=2)))  # beta does shape it


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alpha": -0.1}, "alpha"),
        ({"beta": float("nan")}, "beta"),
        ({"n_users": 0}, "n_users"),
        ({"n_classes": 1}, "n_classes"),
    ],
)
def test_synthetic_rejects_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_synthetic(**kwargs)


# --------------------------------------------------------------------------- #
# Dirichlet partition
# --------------------------------------------------------------------------- #


def test_dirichlet_partition_basic_invariants_and_determinism():
    labels = np.repeat(np.arange(10), 300)
    parts = dirichlet_partition(labels, n_clients=20, beta=0.1, min_samples=10, seed=4)
    assert len(parts) == 20
    assert_is_partition(parts, labels.size)
    assert min(len(p) for p in parts) >= 10

    again = dirichlet_partition(labels, n_clients=20, beta=0.1, min_samples=10, seed=4)
    for a, b in zip(parts, again):
        np.testing.assert_array_equal(a, b)
    other = dirichlet_partition(labels, n_clients=20, beta=0.1, min_samples=10, seed=5)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


def test_dirichlet_partition_small_beta_skews_labels():
    labels = np.repeat(np.arange(10), 200)

    def mean_dominant_share(beta):
        parts = dirichlet_partition(labels, n_clients=10, beta=beta, min_samples=1, seed=0)
        return np.mean([np.bincount(labels[p]).max() / len(p) for p in parts])

    assert mean_dominant_share(0.1) > 0.5
    assert mean_dominant_share(1000.0) < 0.2
    # Betas so small that a class's draw lands wholly on a full client: the class goes to one other client
    # (before, it was shared equally among all of them, the least skewed partition of all).
    assert mean_dominant_share(1e-6) >= mean_dominant_share(0.1)
    parts = dirichlet_partition(labels, n_clients=10, beta=1e-6, min_samples=1, seed=0)
    assert_is_partition(parts, labels.size)
    assert all(np.count_nonzero(np.bincount(labels[p], minlength=10)) <= 2 for p in parts)


def test_dirichlet_partition_accepts_arbitrary_label_values():
    labels = np.array([7, 7, 7, -3, -3, 42, 42, 42, 42, 7])
    parts = dirichlet_partition(labels, n_clients=3, beta=1.0, min_samples=1, seed=0)
    assert_is_partition(parts, labels.size)


def test_dirichlet_partition_impossible_minimum_fails_fast():
    with pytest.raises(ValueError, match="5 clients at least 10 samples: only 40"):
        dirichlet_partition(np.zeros(40, dtype=int), n_clients=5, min_samples=10)


def test_dirichlet_partition_gives_up_after_max_retries():
    # One class, two clients, 10 each required: a 0.01-concentration
    # Dirichlet almost never splits exactly in half.
    with pytest.raises(ValueError, match="after 5 retries.*min_samples=10"):
        dirichlet_partition(np.zeros(20, dtype=int), n_clients=2, beta=0.01,
                            min_samples=10, seed=0, max_retries=5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_clients": 0}, "n_clients"),
        ({"beta": 0.0}, "beta"),
        ({"beta": -1.0}, "beta"),
        ({"beta": float("inf")}, "beta"),
        ({"min_samples": -1}, "min_samples"),
    ],
)
def test_dirichlet_partition_rejects_invalid_arguments(kwargs, message):
    arguments = {"labels": np.arange(20) % 2, "n_clients": 2, "min_samples": 1}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        dirichlet_partition(**arguments)


def test_dirichlet_partition_rejects_bad_labels():
    with pytest.raises(ValueError, match="1-D"):
        dirichlet_partition(np.zeros((4, 2), dtype=int), n_clients=2, min_samples=0)
    with pytest.raises(ValueError, match="integers"):
        dirichlet_partition(np.zeros(4), n_clients=2, min_samples=0)


label_arrays = st.lists(st.integers(0, 4), min_size=1, max_size=150).map(np.array)


@settings(max_examples=60, deadline=None)
@given(
    labels=label_arrays,
    n_clients=st.integers(1, 10),
    beta=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_partition_property(labels, n_clients, beta, seed):
    parts = dirichlet_partition(labels, n_clients, beta=beta, min_samples=0, seed=seed)
    assert len(parts) == n_clients
    assert_is_partition(parts, labels.size)
    # Each class is distributed in one piece per client: class counts add up.
    counts = sum(np.bincount(labels[p], minlength=5) for p in parts)
    np.testing.assert_array_equal(counts, np.bincount(labels, minlength=5))
    again = dirichlet_partition(labels, n_clients, beta=beta, min_samples=0, seed=seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@settings(max_examples=40, deadline=None)
@given(
    labels=label_arrays,
    n_clients=st.integers(1, 10),
    beta=st.floats(0.05, 100.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_partition_property_with_minimum(labels, n_clients, beta, seed):
    min_samples = min(2, labels.size // n_clients)
    try:
        parts = dirichlet_partition(labels, n_clients, beta=beta, min_samples=min_samples,
                                    seed=seed, max_retries=20)
    except ValueError as error:
        # Allowed only as the documented "ran out of retries" outcome.
        assert "after 20 retries" in str(error)
        return
    assert_is_partition(parts, labels.size)
    assert min(len(p) for p in parts) >= min_samples


# --------------------------------------------------------------------------- #
# Per-client train/test split
# --------------------------------------------------------------------------- #


def test_train_test_split_fractions_and_coverage():
    sizes = [1, 2, 3, 4, 5, 10, 101]
    offsets = np.cumsum([0] + sizes)
    clients = [np.arange(start, stop) for start, stop in zip(offsets[:-1], offsets[1:])]
    splits = train_test_split_per_client(clients, train_fraction=0.75, seed=0)
    assert len(splits) == len(sizes)
    for indices, (train, test), n in zip(clients, splits, sizes):
        assert len(train) == max(1, math.floor(0.75 * n))
        assert train.dtype == np.int64 and test.dtype == np.int64
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)
        assert (len(test) == 0) == (n == 1)


def test_train_test_split_other_fraction_is_exact_and_seeded():
    clients = [np.arange(100), np.arange(100, 129)]
    splits = train_test_split_per_client(clients, train_fraction=0.29, seed=3)
    assert [len(train) for train, _ in splits] == [29, 8]
    again = train_test_split_per_client(clients, train_fraction=0.29, seed=3)
    np.testing.assert_array_equal(splits[0][0], again[0][0])
    other = train_test_split_per_client(clients, train_fraction=0.29, seed=4)
    assert not np.array_equal(splits[0][0], other[0][0])
    # A fraction just below 1 still leaves every client of two or more samples a test sample.
    nearly_all = train_test_split_per_client([np.arange(10), np.arange(2)], train_fraction=1 - 1e-10)
    assert [(len(train), len(test)) for train, test in nearly_all] == [(9, 1), (1, 1)]


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 1.5])
def test_train_test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="train_fraction"):
        train_test_split_per_client([np.arange(4)], train_fraction=fraction)


def test_train_test_split_rejects_empty_client():
    with pytest.raises(ValueError, match="client 1 has no samples"):
        train_test_split_per_client([np.arange(3), np.array([], dtype=np.int64)])


# --------------------------------------------------------------------------- #
# load_federated and one_hot
# --------------------------------------------------------------------------- #


def test_a_folder_named_after_the_other_mnist_variant_is_not_searched(tmp_path):
    """Both variants' files have the same names: --data-dir .../mnist with fashion-mnist loaded MNIST."""
    from fedlayer.data import load_mnist

    folder = tmp_path / "mnist"
    folder.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (folder / name).write_bytes(b"")  # present: the search stops here only if it looks here
    with pytest.raises(FileNotFoundError, match="fashion-mnist not found"):
        load_mnist(folder, variant="fashion-mnist")
    with pytest.raises(ValueError):  # its own variant does look there (and finds the empty files)
        load_mnist(folder, variant="mnist")


def test_load_federated_synthetic():
    dataset = load_federated("synthetic", n_clients=4, seed=3)
    users = make_synthetic(n_users=4, seed=3)
    assert isinstance(dataset, FederatedDataset)
    assert dataset.name == "synthetic" and dataset.n_classes == 10
    assert dataset.feature_shape == (60,) and dataset.n_clients == 4
    for client, (x, y) in zip(dataset.clients, users):
        assert isinstance(client, ClientData)
        assert client.x_train.dtype == np.float64 and client.y_train.dtype == np.int64
        assert client.x_train.shape == (client.n_train, 60)
        assert client.x_test.shape == (client.n_test, 60)
        assert client.n_train == math.floor(0.75 * len(y))
        assert client.n_train + client.n_test == len(y)
        # The clients are exactly the generator's users, reshuffled.
        pooled_x = np.concatenate([client.x_train, client.x_test])
        pooled_y = np.concatenate([client.y_train, client.y_test])
        order, expected_order = np.argsort(pooled_x[:, 0]), np.argsort(x[:, 0])
        np.testing.assert_array_equal(pooled_x[order], x[expected_order])
        np.testing.assert_array_equal(pooled_y[order], y[expected_order])


def test_load_federated_synthetic_dtype_and_determinism():
    first = load_federated("Synthetic", n_clients=3, seed=1, dtype=np.float32,
                           synthetic_alpha=1.0, synthetic_beta=1.0)
    second = load_federated("synthetic", n_clients=3, seed=1, dtype=np.float32,
                            synthetic_alpha=1.0, synthetic_beta=1.0)
    assert first.clients[0].x_train.dtype == np.float32
    for a, b in zip(first.clients, second.clients):
        np.testing.assert_array_equal(a.x_train, b.x_train)
        np.testing.assert_array_equal(a.y_test, b.y_test)


def test_load_federated_on_fake_mnist(tmp_path):
    written = write_fake_mnist(tmp_path / "mnist", n_train=40, n_test=20, seed=9)
    dataset = load_federated("mnist", n_clients=3, beta=0.5, min_samples=3, seed=0,
                             data_dir=tmp_path, dtype=np.float32)
    assert dataset.feature_shape == (28, 28, 1) and dataset.n_clients == 3
    xs = np.concatenate([c.x_train for c in dataset.clients] + [c.x_test for c in dataset.clients])
    ys = np.concatenate([c.y_train for c in dataset.clients] + [c.y_test for c in dataset.clients])
    # The official train and test sets are pooled before partitioning.
    assert xs.shape == (60, 28, 28, 1) and xs.dtype == np.float32
    assert xs.min() >= 0.0 and xs.max() <= 1.0
    pooled_pixels = np.concatenate([written[0], written[2]]).astype(np.int64)
    assert np.rint(xs * 255).astype(np.int64).sum() == pooled_pixels.sum()
    np.testing.assert_array_equal(np.bincount(ys, minlength=10),
                                  np.bincount(np.concatenate([written[1], written[3]]), minlength=10))
    for client in dataset.clients:
        assert client.n_train + client.n_test >= 3
        assert client.n_train == max(1, math.floor(0.75 * (client.n_train + client.n_test)))


def test_load_federated_on_fake_cifar_archive(tmp_path):
    write_fake_cifar_tar(tmp_path, fake_cifar_batches(n_per_batch=4, seed=3))
    dataset = load_federated("cifar10", n_clients=2, beta=1.0, min_samples=2,
                             data_dir=tmp_path)
    assert dataset.feature_shape == (32, 32, 3) and dataset.n_classes == 10
    assert sum(c.n_train + c.n_test for c in dataset.clients) == 24
    assert dataset.clients[0].x_train.dtype == np.float64


def test_load_federated_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as caught:
        load_federated("imagenet")
    message = str(caught.value)
    assert "imagenet" in message
    for known in KNOWN_DATASETS:
        assert known in message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_clients": 0}, "n_clients"),
        ({"beta": 0.0}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"train_fraction": 1.0}, "train_fraction"),
        ({"train_fraction": 0.0}, "train_fraction"),
        ({"dtype": np.int32}, "floating dtype"),
    ],
)
def test_load_federated_rejects_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_federated("synthetic", **{"n_clients": 2, **kwargs})


def test_synthetic_checks_min_samples_instead_of_ignoring_it():
    """Synthetic's counts are fixed by the generator (>= 250 per user): too high a minimum is refused, not ignored."""
    assert load_federated("synthetic", n_clients=3, min_samples=250).n_clients == 3
    with pytest.raises(ValueError, match=r"synthetic: client \d+ holds \d+ samples, fewer than min_samples=100000"):
        load_federated("synthetic", n_clients=3, min_samples=100000)


def test_load_federated_rejects_nan_in_loaded_data(monkeypatch):
    x = np.zeros((8, 60))
    x[3, 5] = np.nan

    def fake_make_synthetic(**_):
        return [(x, np.zeros(8, dtype=np.int64))]

    monkeypatch.setattr(data_module, "make_synthetic", fake_make_synthetic)
    with pytest.raises(ValueError, match="NaN or Inf"):
        load_federated("synthetic", n_clients=1)


def test_one_hot():
    encoded = one_hot(np.array([2, 0, 1, 2]), 3, dtype=np.float32)
    assert encoded.dtype == np.float32 and encoded.shape == (4, 3)
    np.testing.assert_array_equal(encoded, np.eye(3, dtype=np.float32)[[2, 0, 1, 2]])
    assert one_hot(np.array([], dtype=np.int64), 4).shape == (0, 4)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        one_hot(np.array([0, 3]), 3)


# --------------------------------------------------------------------------- #
# Real MNIST / CIFAR-10 files (skipped when absent)
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def real_mnist():
    try:
        return load_mnist()
    except FileNotFoundError as error:
        pytest.skip(f"real MNIST files not found (set FEDLAYER_DATA_DIR to enable). {error}")


@pytest.fixture(scope="module")
def real_cifar10():
    try:
        return load_cifar10()
    except FileNotFoundError as error:
        pytest.skip(f"real CIFAR-10 files not found (set FEDLAYER_DATA_DIR to enable). {error}")


def test_real_mnist(real_mnist):
    x_train, y_train, x_test, y_test = real_mnist
    assert x_train.shape == (60000, 28, 28, 1) and x_test.shape == (10000, 28, 28, 1)
    np.testing.assert_array_equal(
        np.bincount(y_train), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    np.testing.assert_array_equal(
        np.bincount(y_test), [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    )
    assert x_train.mean() == pytest.approx(33.318, abs=1e-3)


def test_real_mnist_federated_as_in_the_paper(real_mnist):
    dataset = load_federated("mnist", n_clients=100, beta=0.1, seed=0, dtype=np.float32)
    sizes = [c.n_train + c.n_test for c in dataset.clients]
    assert dataset.n_clients == 100 and sum(sizes) == 70000 and min(sizes) >= 10
    first = dataset.clients[0]
    assert first.x_train.dtype == np.float32 and 0.0 <= first.x_train.min() <= first.x_train.max() <= 1.0


def test_real_cifar10(real_cifar10):
    x_train, y_train, x_test, y_test = real_cifar10
    assert x_train.shape == (50000, 32, 32, 3) and x_test.shape == (10000, 32, 32, 3)
    np.testing.assert_array_equal(np.bincount(y_train), np.full(10, 5000))
    np.testing.assert_array_equal(np.bincount(y_test), np.full(10, 1000))
    # Red is brightest and blue darkest in CIFAR-10: this pins the channel order.
    channel_means = x_train.reshape(-1, 3).mean(axis=0)
    np.testing.assert_allclose(channel_means, [125.3, 122.9, 113.9], atol=0.3)


def test_load_federated_partitions_with_the_given_beta(tmp_path):
    """--beta reaches the Dirichlet draw: each client holds dirichlet_partition's labels for that beta."""
    written = write_fake_mnist(tmp_path / "mnist", n_train=200, n_test=100, seed=4)
    labels = np.concatenate([written[1], written[3]]).astype(np.int64)
    partition_seed, _ = np.random.SeedSequence(0).spawn(2)
    held = {}
    for beta in (0.2, 50.0):
        dataset = load_federated("mnist", n_clients=4, beta=beta, min_samples=3, seed=0, data_dir=tmp_path)
        expected = dirichlet_partition(labels, 4, beta=beta, min_samples=3, seed=partition_seed)
        held[beta] = [np.bincount(np.concatenate([c.y_train, c.y_test]), minlength=10) for c in dataset.clients]
        for counts, indices in zip(held[beta], expected):
            np.testing.assert_array_equal(counts, np.bincount(labels[indices], minlength=10))
    assert any((a != b).any() for a, b in zip(held[0.2], held[50.0]))


def test_load_federated_synthetic_passes_alpha_and_beta_to_the_generator():
    for alpha, beta in ((1.0, 0.0), (0.0, 1.0)):
        dataset = load_federated("synthetic", n_clients=3, seed=1, synthetic_alpha=alpha, synthetic_beta=beta)
        for client, (x, _y) in zip(dataset.clients, make_synthetic(alpha=alpha, beta=beta, n_users=3, seed=1)):
            pooled = np.concatenate([client.x_train, client.x_test])
            np.testing.assert_array_equal(np.sort(pooled, axis=0), np.sort(x, axis=0))


@pytest.mark.parametrize("seed", range(6))
def test_dirichlet_partition_stops_filling_a_client_past_its_share(seed):
    """NIID-Bench's rule: a client at n / n_clients gets no further class, so it ends below share + one class."""
    labels = np.repeat(np.arange(10), 200)
    parts = dirichlet_partition(labels, 5, beta=0.1, min_samples=0, seed=seed)
    assert max(len(p) for p in parts) <= len(labels) / 5 + 200
