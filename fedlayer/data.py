"""Datasets and federated partitions for the experiments of FedACnnL / pFedACnnL.

The paper (section 5.1) uses three classification tasks:

* **MNIST** (and, as a drop-in variant, Fashion-MNIST): the 60,000 training
  and 10,000 test images are pooled (70,000 instances), spread over the
  clients with a label-skewed Dirichlet partition (``beta = 0.1``), and each
  client's share is split 75/25 into local train and test sets.
* **CIFAR-10**: the same recipe on the pooled 60,000 images.
* **Synthetic(alpha, beta)** of FedProx / pFedMe: every user of the generator
  is one client, with power-law sample counts.

Everything here is NumPy (plus scikit-learn for the optional download path).
The image files are read in their official distribution formats (IDX for
MNIST, the pickled "python version" for CIFAR-10), gzipped or not, so the
loaders work on exactly the files a user downloads; nothing touches the
network unless :func:`fetch_openml_dataset` is called.

Images are returned channels-last (NHWC), the project's image layout.

Examples
--------
>>> from fedlayer.data import load_federated
>>> dataset = load_federated("synthetic", n_clients=10, seed=0)
>>> dataset.feature_shape
(60,)
>>> len(dataset.clients)
10
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import io
import math
import os
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from ._validation import Interval, check_param

__all__ = [
    "ClientData",
    "FederatedDataset",
    "KNOWN_DATASETS",
    "default_data_dirs",
    "dirichlet_partition",
    "fetch_openml_dataset",
    "load_cifar10",
    "load_federated",
    "load_mnist",
    "make_synthetic",
    "one_hot",
    "read_idx",
    "train_test_split_per_client",
]

#: Names accepted by :func:`load_federated` (case-insensitive).
KNOWN_DATASETS = ("synthetic", "mnist", "fashion-mnist", "cifar10")

#: Environment variable naming the first directory searched for data files.
DATA_DIR_ENV_VAR = "FEDLAYER_DATA_DIR"

_MNIST_VARIANTS = ("mnist", "fashion-mnist")
_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_MNIST_SOURCES = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/ "
    "(mirror of http://yann.lecun.com/exdb/mnist/)",
    "fashion-mnist": "https://github.com/zalandoresearch/fashion-mnist",
}

_CIFAR10_DIR_NAME = "cifar-10-batches-py"
_CIFAR10_ARCHIVE_NAME = "cifar-10-python.tar.gz"
_CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR10_TEST_BATCH = "test_batch"
_CIFAR10_SOURCE = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

_OPENML_NAMES = {
    # OpenML name -> (feature shape in the file's own order, n_train)
    "mnist_784": ((28, 28, 1), 60000),
    "Fashion-MNIST": ((28, 28, 1), 60000),
    "CIFAR_10": ((3, 32, 32), 50000),
}

# IDX type codes (http://yann.lecun.com/exdb/mnist/): multi-byte types are
# stored big-endian.
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"

_POSITIVE_INT = [Interval(int, 1, None)]
_NON_NEGATIVE_INT = [Interval(int, 0, None)]
_POSITIVE = [Interval(float, 0, None, closed="neither")]
_NON_NEGATIVE = [Interval(float, 0, None)]
_FRACTION = [Interval(float, 0, 1, closed="neither")]


# --------------------------------------------------------------------------- #
# Containers
# --------------------------------------------------------------------------- #


# eq=False: the generated __eq__/__hash__ would compare NumPy arrays
# element-wise and fail with "truth value of an array is ambiguous".
@dataclass(frozen=True, eq=False)
class ClientData:
    """Local train and test data of one client.

    Attributes
    ----------
    x_train : ndarray of shape (n_train, *feature_shape), floating dtype
        Training inputs. Images are NHWC with pixels in [0, 1].
    y_train : ndarray of shape (n_train,), int64
        Training labels in ``[0, n_classes)``.
    x_test : ndarray of shape (n_test, *feature_shape), floating dtype
        Local test inputs (``n_test`` may be 0 for a one-sample client).
    y_test : ndarray of shape (n_test,), int64
        Local test labels in ``[0, n_classes)``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x = getattr(self, f"x_{split}")
            y = getattr(self, f"y_{split}")
            if y.ndim != 1:
                raise ValueError(f"y_{split} must be 1-D, got shape {y.shape}")
            if x.shape[:1] != y.shape:
                raise ValueError(
                    f"x_{split} has {x.shape[0]} samples but y_{split} has {y.shape[0]}"
                )
            if y.size and (y.dtype.kind not in "iu" or y.min() < 0):
                raise ValueError(f"y_{split} must hold class indices (integers >= 0), got dtype {y.dtype} "
                                 f"and values from {y.min()} to {y.max()}")
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                raise ValueError(f"x_{split} contains NaN or Inf; expected finite inputs")

    def check_classes(self, n_classes: int) -> None:
        """Raise ValueError when a label is not below ``n_classes`` (a model has that many outputs)."""
        for split in ("train", "test"):
            y = getattr(self, f"y_{split}")
            if y.size and y.max() >= n_classes:
                raise ValueError(f"y_{split} holds class {y.max()}, but the model has {n_classes} classes "
                                 f"(0 to {n_classes - 1})")

    @property
    def n_train(self) -> int:
        """Number of local training samples."""
        return int(self.y_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of local test samples."""
        return int(self.y_test.shape[0])


@dataclass(frozen=True, eq=False)
class FederatedDataset:
    """A classification task split over clients.

    Attributes
    ----------
    name : str
        Canonical dataset name, one of :data:`KNOWN_DATASETS`.
    n_classes : int
        Number of classes; labels lie in ``[0, n_classes)``.
    feature_shape : tuple of int
        Shape of one sample: ``(60,)`` for synthetic, ``(28, 28, 1)`` for
        (Fashion-)MNIST, ``(32, 32, 3)`` for CIFAR-10.
    clients : list of ClientData
        One entry per client, in client order.
    """

    name: str
    n_classes: int
    feature_shape: tuple[int, ...]
    clients: list[ClientData]

    @property
    def n_clients(self) -> int:
        """Number of clients."""
        return len(self.clients)


# --------------------------------------------------------------------------- #
# Locating files
# --------------------------------------------------------------------------- #


def default_data_dirs() -> list[Path]:
    """Directories searched for dataset files when a loader gets ``data_dir=None``.

    Returns
    -------
    dirs : list of pathlib.Path
        In search order, without duplicates:

        1. ``$FEDLAYER_DATA_DIR`` if the variable is set and not empty;
        2. ``./data`` relative to the current working directory.

        The directories need not exist. Where a development checkout keeps
        its data is for its tests and scripts to say (through the variable),
        not for the library to guess.
    """
    candidates = []
    from_env = os.environ.get(DATA_DIR_ENV_VAR, "")
    if from_env:
        candidates.append(Path(from_env).expanduser())
    candidates.append(Path.cwd() / "data")

    unique: list[Path] = []
    seen = set()
    for path in candidates:
        key = os.path.normcase(os.path.abspath(path))
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def _find_first_file(directory: Path, base_name: str) -> Path | None:
    # An already decompressed copy is preferred: it is faster to read.
    for name in (base_name, base_name + ".gz"):
        path = directory / name
        if path.is_file():
            return path
    return None


# --------------------------------------------------------------------------- #
# Readers for the canonical formats
# --------------------------------------------------------------------------- #


def _open_maybe_gzipped(path: Path):
    # Decide on content, not on the file name: browsers sometimes decompress
    # a download but keep its ".gz" suffix, or the other way round.
    with open(path, "rb") as raw:
        head = raw.read(2)
    if head == _GZIP_MAGIC:
        return gzip.open(path, "rb")
    return open(path, "rb")


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an array stored in the IDX format used by (Fashion-)MNIST.

    The file may be gzip-compressed or plain; compression is detected from the
    content, not from the file name.

    Parameters
    ----------
    path : str or os.PathLike
        Path of the IDX file, e.g. ``train-images-idx3-ubyte.gz``.

    Returns
    -------
    array : ndarray of shape given by the file's header
        Native byte order, writable. The dtype follows the header's type code:
        0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
        0x0E float64. MNIST images come out as ``(n, 28, 28)`` uint8 and
        labels as ``(n,)`` uint8.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the magic number is wrong, the type code is unknown, or the payload
        size does not match the dimensions in the header.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    try:
        with _open_maybe_gzipped(path) as stream:
            content = stream.read()
    except (OSError, EOFError, zlib.error) as error:
        # gzip raises OSError/EOFError for a truncated stream and zlib.error for corrupt compressed data.
        raise ValueError(f"{path}: cannot decompress the IDX file ({type(error).__name__}: {error}); "
                         f"download it again") from None

    if len(content) < 4:
        raise ValueError(
            f"{path}: not an IDX file: {len(content)} bytes, shorter than the 4-byte magic number"
        )
    if content[0] != 0 or content[1] != 0:
        raise ValueError(
            f"{path}: not an IDX file: the magic number must start with two zero bytes, "
            f"got 0x{content[0]:02x} 0x{content[1]:02x}"
        )
    type_code, n_dims = content[2], content[3]
    if type_code not in _IDX_DTYPES:
        known = ", ".join(f"0x{code:02x}" for code in _IDX_DTYPES)
        raise ValueError(f"{path}: unknown IDX type code 0x{type_code:02x}; expected one of {known}")
    dtype = _IDX_DTYPES[type_code]

    header_size = 4 + 4 * n_dims
    if len(content) < header_size:
        raise ValueError(
            f"{path}: truncated IDX header: {n_dims} dimensions need {header_size} bytes, "
            f"file has {len(content)}"
        )
    shape = tuple(int(d) for d in np.frombuffer(content, dtype=">i4", count=n_dims, offset=4))
    expected_payload = math.prod(shape) * dtype.itemsize
    actual_payload = len(content) - header_size
    if actual_payload != expected_payload:
        raise ValueError(
            f"{path}: IDX payload size mismatch: dimensions {shape} of {dtype.name} need "
            f"{expected_payload} bytes, the file holds {actual_payload}"
            + (" (truncated file?)" if actual_payload < expected_payload else "")
        )
    array = np.frombuffer(content, dtype=dtype, offset=header_size).reshape(shape)
    # frombuffer over bytes is read-only; astype gives a writable native-order copy.
    return array.astype(dtype.newbyteorder("="), copy=True)


def load_mnist(
    data_dir: str | os.PathLike | None = None, variant: str = "mnist"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load MNIST or Fashion-MNIST from the official IDX files.

    Looks for ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (each optionally
    with ``.gz``); all four must be in the same directory.

    Parameters
    ----------
    data_dir : str, os.PathLike or None, default=None
        Directory to search. The files are looked for in
        ``data_dir/<variant>/`` and then in ``data_dir/`` itself, unless
        ``data_dir`` is named after the other variant (``.../mnist`` for
        Fashion-MNIST, and the reverse). With
        ``None``, ``<dir>/<variant>/`` is searched for every ``dir`` of
        :func:`default_data_dirs`; the bare directories are not, because
        MNIST and Fashion-MNIST files share their names and a stray set in
        ``./data`` would otherwise be loaded as the wrong dataset.
    variant : {"mnist", "fashion-mnist"}, default="mnist"
        Which dataset; also the name of the sub-folder searched.

    Returns
    -------
    x_train : ndarray of shape (60000, 28, 28, 1), uint8
    y_train : ndarray of shape (60000,), int64
    x_test : ndarray of shape (10000, 28, 28, 1), uint8
    y_test : ndarray of shape (10000,), int64
        Images are NHWC with raw pixel values 0..255; labels are in 0..9.

    Raises
    ------
    FileNotFoundError
        If no searched directory holds all four files; the message lists every
        directory looked at and how to obtain the files.
    ValueError
        If ``variant`` is unknown or the files do not hold 28x28 uint8 images
        with matching uint8 labels in 0..9.
    """
    if variant not in _MNIST_VARIANTS:
        raise ValueError(f"unknown MNIST variant {variant!r}; expected one of {_MNIST_VARIANTS}")
    if data_dir is None:
        directories = [root / variant for root in default_data_dirs()]
    else:
        directories = [Path(data_dir) / variant]
        # The bare directory, unless its name says it holds the other variant (the same four file names).
        if Path(data_dir).name.lower() not in set(_MNIST_VARIANTS) - {variant}:
            directories.append(Path(data_dir))

    searched = []
    for directory in directories:
        found = {key: _find_first_file(directory, name) for key, name in _MNIST_FILES.items()}
        if all(found.values()):
            return _read_mnist_files(found)
        missing = [_MNIST_FILES[key] for key, path in found.items() if path is None]
        if len(missing) == len(_MNIST_FILES):
            searched.append(f"  {directory}  (no files)")
        else:
            searched.append(f"  {directory}  (missing {', '.join(missing)})")

    file_names = ", ".join(f"{name}.gz" for name in _MNIST_FILES.values())
    raise FileNotFoundError(
        f"{variant} not found. Looked for its IDX files in:\n"
        + "\n".join(searched)
        + f"\nDownload the official files ({file_names}) from {_MNIST_SOURCES[variant]} "
        f"into a '{variant}' folder of one of these directories (or set "
        f"{DATA_DIR_ENV_VAR} to a directory containing '{variant}/'), or, with network access, "
        f"use fedlayer.data.fetch_openml_dataset("
        f"{'mnist_784' if variant == 'mnist' else 'Fashion-MNIST'!r})."
    )


def _read_mnist_files(paths: dict[str, Path]) -> tuple[np.ndarray, ...]:
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"x_{split}"], arrays[f"y_{split}"]
        images_path, labels_path = paths[f"x_{split}"], paths[f"y_{split}"]
        if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(
                f"{images_path}: expected uint8 images of shape (n, 28, 28), "
                f"got {images.dtype.name} {images.shape}"
            )
        if labels.dtype != np.uint8 or labels.ndim != 1:
            raise ValueError(
                f"{labels_path}: expected a 1-D uint8 label array, got {labels.dtype.name} {labels.shape}"
            )
        if labels.shape[0] != images.shape[0]:
            raise ValueError(
                f"{labels_path} has {labels.shape[0]} labels but {images_path} "
                f"has {images.shape[0]} images"
            )
        if labels.size and labels.max() > 9:
            raise ValueError(f"{labels_path}: labels must be in 0..9, found {int(labels.max())}")
    return (
        arrays["x_train"][..., np.newaxis],
        arrays["y_train"].astype(np.int64),
        arrays["x_test"][..., np.newaxis],
        arrays["y_test"].astype(np.int64),
    )


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that only builds what a CIFAR-10 batch contains.

    Unpickling can run arbitrary code; a batch only needs dicts, lists,
    strings, ints and a NumPy array, so every other global is refused.
    """

    # Resolved from live objects so both NumPy 1 ("numpy.core") and NumPy 2
    # ("numpy._core") pickles map to whatever this NumPy provides.
    _reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    _scalar = np.float64(0).__reduce__()[0]
    _ALLOWED = {
        ("_codecs", "encode"): codecs.encode,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.multiarray", "scalar"): _scalar,
        ("numpy._core.multiarray", "scalar"): _scalar,
    }

    def find_class(self, module: str, name: str):
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name} from a CIFAR-10 batch: "
                "only plain data and NumPy arrays are expected"
            ) from None


def _parse_cifar_batch(content: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Return the batch's raw (n, 3072) uint8 rows and (n,) int64 labels."""
    try:
        batch = _CifarUnpickler(io.BytesIO(content), encoding="bytes").load()
    except Exception as error:  # pickle reports damage through many exception types
        raise ValueError(f"{source}: not a readable CIFAR-10 batch ({error})") from error
    if not isinstance(batch, dict):
        raise ValueError(f"{source}: expected a pickled dict, got {type(batch).__name__}")
    # Python 2 pickles decoded with encoding="bytes" have bytes keys; batches
    # re-pickled under Python 3 may have str keys.
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise ValueError(f"{source}: the batch has no b'data' and b'labels' entries")
    data = np.asarray(data)
    labels = np.asarray(labels)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(
            f"{source}: expected b'data' as uint8 of shape (n, 3072), got {data.dtype.name} {data.shape}"
        )
    if labels.ndim != 1 or labels.shape[0] != data.shape[0]:
        raise ValueError(
            f"{source}: expected {data.shape[0]} labels matching b'data', got shape {labels.shape}"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{source}: labels must be in 0..9")
    return data, labels.astype(np.int64)


def _cifar_rows_to_nhwc(rows: np.ndarray) -> np.ndarray:
    # Each row is the R plane, then G, then B (row-major 32x32 each).
    return np.ascontiguousarray(rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))


def _read_cifar_directory(directory: Path) -> dict[str, bytes]:
    return {
        name: (directory / name).read_bytes()
        for name in _CIFAR10_TRAIN_BATCHES + (_CIFAR10_TEST_BATCH,)
    }


def _read_cifar_archive(archive: Path) -> dict[str, bytes]:
    wanted = set(_CIFAR10_TRAIN_BATCHES + (_CIFAR10_TEST_BATCH,))
    contents: dict[str, bytes] = {}
    try:
        # Stream mode ("r|gz") decompresses once, front to back; random access
        # would re-decompress the archive for every member.
        with tarfile.open(archive, mode="r|gz") as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if member.isfile() and name in wanted and name not in contents:
                    contents[name] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise ValueError(f"{archive}: cannot read the CIFAR-10 archive ({type(error).__name__}: {error}); "
                         f"download it again") from None
    missing = sorted(wanted - contents.keys())
    if missing:
        raise ValueError(
            f"{archive}: the archive lacks {', '.join(missing)} "
            f"(expected {_CIFAR10_DIR_NAME}/data_batch_1..5 and test_batch)"
        )
    return contents


def load_cifar10(
    data_dir: str | os.PathLike | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load CIFAR-10 from its official "python version" files.

    Accepts either the extracted directory ``cifar-10-batches-py/`` (with
    ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``) or the archive
    ``cifar-10-python.tar.gz``, which is read in memory without extraction.
    The extracted directory is preferred when both are present.

    The batches are pickles; they are loaded with a restricted unpickler that
    only builds plain containers and NumPy arrays.

    Parameters
    ----------
    data_dir : str, os.PathLike or None, default=None
        Directory containing ``cifar-10-batches-py/`` or
        ``cifar-10-python.tar.gz``. With ``None``, every directory of
        :func:`default_data_dirs` is searched in order.

    Returns
    -------
    x_train : ndarray of shape (50000, 32, 32, 3), uint8
    y_train : ndarray of shape (50000,), int64
    x_test : ndarray of shape (10000, 32, 32, 3), uint8
    y_test : ndarray of shape (10000,), int64
        Images are NHWC (channel 0 is red) with raw pixel values 0..255;
        labels are in 0..9. Training batches are concatenated in order 1..5.

    Raises
    ------
    FileNotFoundError
        If neither form is found; the message lists every path looked at and
        how to obtain the archive.
    ValueError
        If a batch is missing from a found directory or archive, or does not
        hold uint8 ``(n, 3072)`` data with labels in 0..9.
    """
    roots = default_data_dirs() if data_dir is None else [Path(data_dir)]
    searched = []
    for root in roots:
        directory = root / _CIFAR10_DIR_NAME
        archive = root / _CIFAR10_ARCHIVE_NAME
        if directory.is_dir():
            missing = [
                name
                for name in _CIFAR10_TRAIN_BATCHES + (_CIFAR10_TEST_BATCH,)
                if not (directory / name).is_file()
            ]
            if not missing:
                return _assemble_cifar(_read_cifar_directory(directory), directory)
            searched.append(f"  {directory}  (missing {', '.join(missing)})")
        else:
            searched.append(f"  {directory}  (no such directory)")
        if archive.is_file():
            return _assemble_cifar(_read_cifar_archive(archive), archive)
        searched.append(f"  {archive}  (no such file)")

    raise FileNotFoundError(
        "CIFAR-10 not found. Looked at:\n"
        + "\n".join(searched)
        + f"\nDownload the official '{_CIFAR10_ARCHIVE_NAME}' (python version) from "
        f"{_CIFAR10_SOURCE} into one of these directories (or set {DATA_DIR_ENV_VAR} to the "
        "directory holding it), or, with network access, use "
        "fedlayer.data.fetch_openml_dataset('CIFAR_10')."
    )


def _assemble_cifar(contents: dict[str, bytes], source: Path) -> tuple[np.ndarray, ...]:
    train_parts = [
        _parse_cifar_batch(contents[name], f"{source}/{name}") for name in _CIFAR10_TRAIN_BATCHES
    ]
    x_test, y_test = _parse_cifar_batch(
        contents[_CIFAR10_TEST_BATCH], f"{source}/{_CIFAR10_TEST_BATCH}"
    )
    # Transposing once after concatenating avoids a second full-size copy.
    x_train = _cifar_rows_to_nhwc(np.concatenate([rows for rows, _ in train_parts]))
    y_train = np.concatenate([labels for _, labels in train_parts])
    return x_train, y_train, _cifar_rows_to_nhwc(x_test), y_test


def fetch_openml_dataset(
    name: str, data_home: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Download MNIST, Fashion-MNIST or CIFAR-10 from OpenML (needs network).

    A fallback for users without the official files, through
    :func:`sklearn.datasets.fetch_openml` (which caches the download in
    ``data_home``). The OpenML copies list the official training samples first,
    so the first 60,000 (MNIST, Fashion-MNIST) or 50,000 (CIFAR-10) rows are
    returned as the training set and the remaining 10,000 as the test set.

    Parameters
    ----------
    name : {"mnist_784", "Fashion-MNIST", "CIFAR_10"}
        OpenML dataset name (version 1 is fetched).
    data_home : str, os.PathLike or None, default=None
        Cache directory passed to scikit-learn (default ``~/scikit_learn_data``).

    Returns
    -------
    x_train, y_train, x_test, y_test : ndarray
        Same layout as :func:`load_mnist` / :func:`load_cifar10`: uint8 NHWC
        images of shape (n, 28, 28, 1) or (n, 32, 32, 3) and int64 labels.

    Raises
    ------
    ValueError
        If ``name`` is not one of the three supported names, or the download
        does not have the expected size and value range.
    """
    if name not in _OPENML_NAMES:
        raise ValueError(f"unknown OpenML dataset {name!r}; expected one of {tuple(_OPENML_NAMES)}")
    from sklearn.datasets import fetch_openml  # deferred: only this path needs it

    # scikit-learn's default parser for dense data needs pandas, an optional
    # dependency; the pure-Python ARFF parser always works.
    parser = "pandas" if importlib.util.find_spec("pandas") is not None else "liac-arff"
    features, targets = fetch_openml(
        name, version=1, data_home=data_home, as_frame=False, return_X_y=True, parser=parser
    )
    file_shape, n_train = _OPENML_NAMES[name]
    features = np.asarray(features)
    labels = np.asarray(targets).astype(np.int64)  # OpenML labels are strings "0".."9"
    n_expected = n_train + 10000
    if features.shape != (n_expected, math.prod(file_shape)):
        raise ValueError(
            f"OpenML {name!r}: expected features of shape {(n_expected, math.prod(file_shape))}, "
            f"got {features.shape}"
        )
    if not np.all(np.isfinite(features)) or features.min() < 0 or features.max() > 255:
        raise ValueError(f"OpenML {name!r}: pixel values outside 0..255 or not finite")
    images = np.rint(features).astype(np.uint8).reshape((-1,) + file_shape)
    if file_shape[0] == 3:
        # CIFAR rows are R plane, G plane, B plane: move channels last.
        images = np.ascontiguousarray(images.transpose(0, 2, 3, 1))
    return images[:n_train], labels[:n_train], images[n_train:], labels[n_train:]


# --------------------------------------------------------------------------- #
# Synthetic(alpha, beta)
# --------------------------------------------------------------------------- #


def make_synthetic(
    alpha: float = 0.5,
    beta: float = 0.5,
    n_users: int = 100,
    dim: int = 60,
    n_classes: int = 10,
    seed: int | np.random.Generator | None = 0,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Generate the Synthetic(alpha, beta) federated dataset of FedProx / pFedMe.

    For user ``i``:

    * ``u_i ~ N(0, alpha)`` and ``B_i ~ N(0, beta)``;
    * the model ``W_i`` (dim x n_classes) and bias ``b_i`` (n_classes) have
      entries ``~ N(u_i, 1)``;
    * the input mean ``v_i`` has entries ``~ N(B_i, 1)``;
    * inputs ``x ~ N(v_i, Sigma)`` with ``Sigma = diag(j ** -1.2)``,
      ``j = 1..dim``;
    * labels ``y = argmax(x @ W_i + b_i)`` (FedProx takes the softmax first,
      which does not change the argmax);
    * ``n_i = (int(lognormal(4, 2)) + 50) * 5`` samples (power law, pFedMe's
      setting).

    As in the reference code (``np.random.normal(0, alpha)``), ``alpha`` and
    ``beta`` are passed to NumPy as the *scale*, i.e. the standard deviation,
    although the FedProx paper writes ``N(0, alpha)``; this keeps the data
    statistically identical to the published benchmarks.

    Also as in the reference code, ``alpha`` does not change the labels: the
    shift ``u_i`` is added to every entry of ``W_i`` and ``b_i``, so it moves
    every class's logit by the same ``u_i (sum(x) + 1)`` and leaves the argmax
    as it was. With one seed, Synthetic(0, beta) and Synthetic(alpha, beta)
    are the same data (checked in the tests); only ``beta`` shapes it. The
    project keeps the reference's generator so that its Synthetic is the
    paper's.

    Parameters
    ----------
    alpha : float, default=0.5
        Spread of the users' models around each other (>= 0); without effect
        on the labels, as in the reference code (above).
    beta : float, default=0.5
        Spread of the users' input distributions (>= 0).
    n_users : int, default=100
        Number of users (clients).
    dim : int, default=60
        Input dimension.
    n_classes : int, default=10
        Number of classes.
    seed : int, numpy.random.Generator or None, default=0
        Seed of the single ``np.random.default_rng`` stream all draws come from.

    Returns
    -------
    users : list of (x, y) tuples, one per user
        ``x`` : ndarray of shape (n_i, dim), float64;
        ``y`` : ndarray of shape (n_i,), int64 in ``[0, n_classes)``.

    Notes
    -----
    The log-normal counts are heavy-tailed: with the defaults the total is
    typically 1e5 to 3.5e5 samples (tens to hundreds of MB), and a single user
    can hold tens of thousands of samples.
    """
    check_param("alpha", alpha, _NON_NEGATIVE)
    check_param("beta", beta, _NON_NEGATIVE)
    check_param("n_users", n_users, _POSITIVE_INT)
    check_param("dim", dim, _POSITIVE_INT)
    check_param("n_classes", n_classes, [Interval(int, 2, None)])
    return _draw_synthetic(np.random.default_rng(seed), alpha, beta, n_users, dim, n_classes)


def _draw_synthetic(rng, alpha, beta, n_users, dim, n_classes):
    """The users of :func:`make_synthetic`, every draw from ``rng`` in the reference code's order."""
    samples_per_user = (rng.lognormal(4, 2, n_users).astype(np.int64) + 50) * 5
    model_means = rng.normal(0, alpha, n_users)  # u_i, shared by W_i and b_i as in FedProx
    input_mean_centres = rng.normal(0, beta, n_users)  # B_i
    input_means = np.stack([rng.normal(centre, 1, dim) for centre in input_mean_centres])
    # Sigma is diagonal, so scaling standard normals by sqrt(diag) samples
    # N(v_i, Sigma) exactly, without multivariate_normal's O(dim^3) SVD.
    input_std = np.arange(1, dim + 1, dtype=np.float64) ** -0.6

    users = []
    for i in range(n_users):
        weights = rng.normal(model_means[i], 1, (dim, n_classes))
        bias = rng.normal(model_means[i], 1, n_classes)
        x = input_means[i] + rng.standard_normal((int(samples_per_user[i]), dim)) * input_std
        y = np.argmax(x @ weights + bias, axis=1).astype(np.int64)
        users.append((x, y))
    return users


# --------------------------------------------------------------------------- #
# Partitioning
# --------------------------------------------------------------------------- #


def dirichlet_partition(
    labels: np.ndarray,
    n_clients: int,
    beta: float = 0.1,
    min_samples: int = 10,
    seed: int | np.random.Generator | None = 0,
    max_retries: int = 1000,
) -> list[np.ndarray]:
    """Label-skewed partition of samples over clients (NIID-Bench / FedLab).

    For every class ``k`` the class's shuffled indices are split among the
    clients at proportions ``p ~ Dir(beta * ones(n_clients))``; clients that
    already hold at least ``N / n_clients`` samples get proportion 0 (the rest
    is renormalised), which keeps client sizes from exploding. The whole draw
    is repeated until every client holds at least ``min_samples`` samples.

    Parameters
    ----------
    labels : array-like of shape (n_samples,), integer
        Class label of every sample; any integer values (the classes are the
        distinct values).
    n_clients : int
        Number of clients (>= 1).
    beta : float, default=0.1
        Dirichlet concentration (> 0); smaller means more label skew.
    min_samples : int, default=10
        Minimum number of samples every client must receive (>= 0).
    seed : int, numpy.random.Generator or None, default=0
        Seed of the ``np.random.default_rng`` stream used for all draws.
    max_retries : int, default=1000
        Maximum number of full draws before giving up.

    Returns
    -------
    client_indices : list of ndarray of shape (n_samples_j,), int64
        One array per client, in shuffled order; the arrays are disjoint and
        together cover ``range(n_samples)``.

    Raises
    ------
    ValueError
        For invalid arguments, if ``n_clients * min_samples > n_samples``, or if
        ``max_retries`` draws all left some client below ``min_samples``.
    """
    labels = _as_label_array(labels, "labels")
    check_param("n_clients", n_clients, _POSITIVE_INT)
    check_param("beta (Dirichlet concentration)", beta, _POSITIVE)
    check_param("min_samples", min_samples, _NON_NEGATIVE_INT)
    check_param("max_retries", max_retries, _POSITIVE_INT)
    n_samples = labels.shape[0]
    if n_clients * min_samples > n_samples:
        raise ValueError(
            f"cannot give each of {n_clients} clients at least {min_samples} samples: "
            f"only {n_samples} samples in total"
        )

    rng = np.random.default_rng(seed)
    class_indices = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    smallest = 0
    for _ in range(max_retries):
        parts, sizes = _dirichlet_draw(rng, class_indices, n_clients, beta, n_samples / n_clients)
        smallest = int(sizes.min())
        if smallest >= min_samples:
            return [
                rng.permutation(np.concatenate(chunks)).astype(np.int64, copy=False)
                for chunks in parts
            ]
    raise ValueError(
        f"dirichlet_partition: after {max_retries} retries some client still had fewer than "
        f"min_samples={min_samples} samples (smallest in the last draw: {smallest}); use a larger "
        f"beta (got {beta}), fewer clients (got {n_clients}), a smaller min_samples, or more retries"
    )


def _dirichlet_draw(rng, class_indices, n_clients, beta, size_cap):
    """One draw of :func:`dirichlet_partition`: (per client, its chunks of each class; its sample count)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    sizes = np.zeros(n_clients, dtype=np.int64)
    for indices in class_indices:
        indices = rng.permutation(indices)
        proportions = rng.dirichlet(np.full(n_clients, beta))
        proportions = proportions * (sizes < size_cap)
        total = proportions.sum()
        if total <= 0:
            # Every proportion of a non-full client underflowed to 0 (beta
            # of 1e-5 and below): the whole class goes to one of them, the
            # small-beta limit of the draw (an equal share among them made
            # tiny betas the least skewed partitions of all).
            proportions = np.zeros(n_clients)
            proportions[rng.choice(np.flatnonzero(sizes < size_cap))] = 1.0
            total = 1.0
        proportions /= total
        cut_points = (np.cumsum(proportions) * len(indices)).astype(np.int64)[:-1]
        for client, chunk in enumerate(np.split(indices, cut_points)):
            parts[client].append(chunk)
            sizes[client] += len(chunk)
    return parts, sizes


def train_test_split_per_client(
    client_indices: Sequence[np.ndarray],
    train_fraction: float = 0.75,
    seed: int | np.random.Generator | None = 0,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split every client's samples into a local training and test set.

    Each client's indices are shuffled and the first
    ``max(1, floor(train_fraction * n))`` go to training, the rest to testing.
    Hence a client always keeps at least one training sample and, whenever it
    has two or more samples, at least one test sample; a client with a single
    sample gets an empty test set.

    Parameters
    ----------
    client_indices : sequence of array-like of int, each of shape (n_j,)
        Sample indices owned by each client, e.g. from
        :func:`dirichlet_partition`, or ``[np.arange(n_j)]`` for per-client
        arrays.
    train_fraction : float, default=0.75
        Fraction of each client's samples used for training, in (0, 1).
    seed : int, numpy.random.Generator or None, default=0
        Seed of the ``np.random.default_rng`` stream used for the shuffles.

    Returns
    -------
    splits : list of (train_indices, test_indices) tuples
        Per client, two int64 arrays of shapes (n_train_j,) and
        (n_j - n_train_j,), disjoint, whose union is that client's indices.

    Raises
    ------
    ValueError
        If ``train_fraction`` is not in (0, 1) or a client has no samples.
    """
    check_param("train_fraction", train_fraction, _FRACTION)
    rng = np.random.default_rng(seed)
    splits = []
    for client, indices in enumerate(client_indices):
        indices = np.asarray(indices)
        if indices.ndim != 1 or (indices.size and not np.issubdtype(indices.dtype, np.integer)):
            raise ValueError(
                f"client {client}: expected a 1-D integer index array, "
                f"got {indices.dtype} {indices.shape}"
            )
        if indices.size == 0:
            raise ValueError(f"client {client} has no samples; every client needs at least one")
        # The tiny epsilon keeps e.g. 0.29 * 100 = 28.999999999999996 from rounding down; the test set
        # keeps a sample even when it would round a train_fraction of 0.999999999999 up to all of them.
        n_train = max(1, min(indices.size - 1, math.floor(train_fraction * indices.size + 1e-9)))
        shuffled = rng.permutation(indices).astype(np.int64, copy=False)
        splits.append((shuffled[:n_train], shuffled[n_train:]))
    return splits


# --------------------------------------------------------------------------- #
# Main entry point
# --------------------------------------------------------------------------- #


def load_federated(
    name: str,
    n_clients: int = 100,
    beta: float = 0.1,
    seed: int | None = 0,
    data_dir: str | os.PathLike | None = None,
    train_fraction: float = 0.75,
    min_samples: int = 10,
    dtype: np.dtype | type = np.float64,
    synthetic_alpha: float = 0.5,
    synthetic_beta: float = 0.5,
) -> FederatedDataset:
    """Build a federated classification task as in the paper's experiments.

    * ``"synthetic"``: :func:`make_synthetic` with ``n_users = n_clients``;
      every user is one client. ``beta`` is not used; ``min_samples`` is
      checked (the generator gives every user at least 250 samples), not
      enforced by redrawing.
    * ``"mnist"``, ``"fashion-mnist"``, ``"cifar10"``: the official training
      and test sets are pooled (70,000 or 60,000 images), partitioned with
      :func:`dirichlet_partition`, and pixels are scaled to [0, 1].

    In both cases every client's samples are then split with
    :func:`train_test_split_per_client`.

    Parameters
    ----------
    name : {"synthetic", "mnist", "fashion-mnist", "cifar10"}
        Dataset name (case-insensitive).
    n_clients : int, default=100
        Number of clients (>= 1).
    beta : float, default=0.1
        Dirichlet concentration for the image datasets (> 0).
    seed : int or None, default=0
        Master seed. The synthetic data come from ``make_synthetic(seed=seed)``
        itself; partition and train/test split use independent streams derived
        from it, so changing ``train_fraction`` does not change the partition.
    data_dir : str, os.PathLike or None, default=None
        Where the image files are; ``None`` searches :func:`default_data_dirs`.
    train_fraction : float, default=0.75
        Fraction of each client's samples used for local training, in (0, 1).
    min_samples : int, default=10
        Minimum samples per client: the Dirichlet partition is redrawn until
        every client has that many; for Synthetic, fewer is an error.
    dtype : floating dtype, default=numpy.float64
        dtype of the inputs ``x_train`` / ``x_test``.
    synthetic_alpha, synthetic_beta : float, default=0.5
        The alpha and beta of Synthetic(alpha, beta).

    Returns
    -------
    dataset : FederatedDataset
        ``n_clients`` clients; inputs have shape ``(n, *feature_shape)`` in
        ``dtype`` and labels are int64 in ``[0, n_classes)``.

    Raises
    ------
    ValueError
        For an unknown name (the message lists :data:`KNOWN_DATASETS`),
        invalid arguments, or NaN/Inf or out-of-range labels in the data.
    FileNotFoundError
        If the image files cannot be found (see :func:`load_mnist` and
        :func:`load_cifar10`).
    """
    canonical = str(name).strip().lower()
    if canonical not in KNOWN_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")
    check_param("n_clients", n_clients, _POSITIVE_INT)
    check_param("beta (Dirichlet concentration)", beta, _POSITIVE)
    check_param("train_fraction", train_fraction, _FRACTION)
    check_param("min_samples", min_samples, _NON_NEGATIVE_INT)
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    partition_seed, split_seed = np.random.SeedSequence(seed).spawn(2)
    if canonical == "synthetic":
        users = make_synthetic(alpha=synthetic_alpha, beta=synthetic_beta, n_users=n_clients, seed=seed)
        return _synthetic_federated(users, min_samples, train_fraction, split_seed, dtype)
    return _image_federated(canonical, data_dir, n_clients, beta, min_samples, train_fraction,
                            partition_seed, split_seed, dtype)


def _synthetic_federated(users, min_samples, train_fraction, split_seed, dtype):
    """:func:`load_federated` of Synthetic: each user of :func:`make_synthetic` one client, split per client."""
    canonical = "synthetic"
    n_classes, feature_shape = 10, (60,)
    for x, y in users:
        _validate_samples(x, y, n_classes, canonical)
    sizes = [len(y) for _, y in users]
    if min(sizes) < min_samples:
        # The generator fixes every user's sample count; there is no partition to redraw.
        raise ValueError(
            f"synthetic: client {int(np.argmin(sizes))} holds {min(sizes)} samples, fewer than "
            f"min_samples={min_samples}; Synthetic's sample counts come from the generator (at least 250 "
            f"per client) and are not redrawn: lower --min-samples"
        )
    splits = train_test_split_per_client(
        [np.arange(len(y)) for _, y in users], train_fraction, seed=split_seed
    )
    clients = [
        ClientData(
            x_train=x[train].astype(dtype),
            y_train=y[train],
            x_test=x[test].astype(dtype),
            y_test=y[test],
        )
        for (x, y), (train, test) in zip(users, splits)
    ]
    return FederatedDataset(canonical, n_classes, feature_shape, clients)


def _image_federated(canonical, data_dir, n_clients, beta, min_samples, train_fraction, partition_seed, split_seed,
                     dtype):
    """:func:`load_federated` of an image dataset: official splits pooled, partitioned, split per client."""
    if canonical == "cifar10":
        x_train, y_train, x_test, y_test = load_cifar10(data_dir)
    else:
        x_train, y_train, x_test, y_test = load_mnist(data_dir, variant=canonical)
    # The paper pools the official splits before partitioning (MNIST: 70,000).
    images = np.concatenate([x_train, x_test])
    labels = np.concatenate([y_train, y_test])
    del x_train, x_test
    n_classes, feature_shape = 10, tuple(images.shape[1:])
    _validate_samples(images, labels, n_classes, canonical)

    client_indices = dirichlet_partition(
        labels, n_clients, beta=beta, min_samples=min_samples, seed=partition_seed
    )
    splits = train_test_split_per_client(client_indices, train_fraction, seed=split_seed)
    scale = dtype.type(1.0 / 255.0)
    clients = [
        ClientData(
            # Converting per client keeps the peak memory at one float copy.
            x_train=_scaled(images[train], dtype, scale),
            y_train=labels[train],
            x_test=_scaled(images[test], dtype, scale),
            y_test=labels[test],
        )
        for train, test in splits
    ]
    return FederatedDataset(canonical, n_classes, feature_shape, clients)


def one_hot(labels: np.ndarray, n_classes: int, dtype: np.dtype | type = np.float64) -> np.ndarray:
    """One-hot encode integer labels.

    Parameters
    ----------
    labels : array-like of shape (n,), integer
        Labels in ``[0, n_classes)``.
    n_classes : int
        Number of classes (>= 1).
    dtype : dtype, default=numpy.float64
        dtype of the result.

    Returns
    -------
    encoded : ndarray of shape (n, n_classes), ``dtype``
        ``encoded[i, labels[i]] = 1`` and 0 elsewhere.

    Raises
    ------
    ValueError
        If ``labels`` is not a 1-D integer array or a label is out of range.
    """
    labels = _as_label_array(labels, "labels")
    check_param("n_classes", n_classes, _POSITIVE_INT)
    if labels.size and (labels.min() < 0 or labels.max() >= n_classes):
        raise ValueError(
            f"labels must lie in [0, {n_classes}), found range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    encoded = np.zeros((labels.shape[0], n_classes), dtype=dtype)
    encoded[np.arange(labels.shape[0]), labels] = 1
    return encoded


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #


def _scaled(pixels: np.ndarray, dtype: np.dtype, scale) -> np.ndarray:
    converted = pixels.astype(dtype)
    converted *= scale
    return converted


def _validate_samples(x: np.ndarray, y: np.ndarray, n_classes: int, name: str) -> None:
    if x.shape[:1] != y.shape:
        raise ValueError(f"{name}: {x.shape[0]} inputs but {y.shape[0]} labels")
    if np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: the inputs contain NaN or Inf values")
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise ValueError(
            f"{name}: labels must lie in [0, {n_classes}), found range [{int(y.min())}, {int(y.max())}]"
        )


def _as_label_array(labels, what: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array, got shape {labels.shape}")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {labels.dtype}")
    return labels.astype(np.int64, copy=False)
