"""MNIST from the original IDX files, with checksums and configurable splits.

Search order: ``<data_dir>/mnist/*.gz`` (or uncompressed, or ``<data_dir>/MNIST/raw``), then a
download through HF ``datasets`` when ``allow_download`` and the hub is reachable. Missing files
stop the run before training with a message that names the files and the directory.
"""

from __future__ import annotations

import gzip
import logging
import zlib
from pathlib import Path

import numpy as np
import torch

from curvopt.api import DataBundle
from curvopt.data.common import (
    hub_reachable,
    md5_bytes,
    missing_data_message,
    offline_note,
    split_indices,
)
from curvopt.errors import CorruptDataError, DataNotFoundError

log = logging.getLogger(__name__)

# Canonical md5 of the *decompressed* IDX files (gzip bytes differ between mirrors).
MNIST_FILES: dict[str, tuple[str, tuple[int, ...]]] = {
    "train-images-idx3-ubyte": ("6bbc9ace898e44ae57da46a324031adb", (60000, 28, 28)),
    "train-labels-idx1-ubyte": ("a25bea736e30d166cdddb491f175f624", (60000,)),
    "t10k-images-idx3-ubyte": ("2646ac647ad5339dbf082846283269ea", (10000, 28, 28)),
    "t10k-labels-idx1-ubyte": ("27ae3e4e09519cfbb04c329615203637", (10000,)),
}
HOW_TO_GET = (
    "download the four files from http://yann.lecun.com/exdb/mnist/ (or any mirror) into "
    "<data_dir>/mnist/, or run once with network access (HF `datasets` id 'ylecun/mnist')."
)


def parse_idx(raw: bytes, name: str) -> np.ndarray:
    """Decode an IDX byte string (big-endian header: magic, dims) into a uint8 array.

    Args:
        raw: The decompressed file content.
        name: File name, for messages.

    Returns:
        The array, shaped as the header says.

    Raises:
        CorruptDataError: On a bad magic number or a size that does not match the header.
    """
    if len(raw) < 8 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise CorruptDataError(f"{name}: not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = 4 + 4 * ndim + int(np.prod(dims))
    if len(raw) != expected:
        raise CorruptDataError(
            f"{name}: header says shape {dims} ({expected} bytes) but file has {len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(directory: Path, stem: str) -> Path | None:
    for folder in (directory / "mnist", directory / "MNIST" / "raw", directory):
        for candidate in (folder / f"{stem}.gz", folder / stem):
            if candidate.is_file():
                return candidate
    return None


def read_mnist_idx(data_dir: str | Path, verify: bool = True) -> dict[str, np.ndarray]:
    """Read and check the four IDX files (``.gz`` or uncompressed).

    Args:
        data_dir: Data directory (searched in ``mnist/``, ``MNIST/raw/`` and itself).
        verify: Check the md5 of the decompressed bytes against :data:`MNIST_FILES`.

    Returns:
        File stem → uint8 array.

    Raises:
        DataNotFoundError: If any file is missing (the message lists them).
        CorruptDataError: If a file cannot be decompressed, fails the checksum or has the wrong
            shape.
    """
    directory = Path(data_dir)
    arrays, missing = {}, []
    for stem, (md5, shape) in MNIST_FILES.items():
        path = _find(directory, stem)
        if path is None:
            missing.append(f"mnist/{stem}.gz")
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError; a flipped byte: zlib
            raise CorruptDataError(
                f"{path}: cannot decompress ({type(err).__name__}: {err}); the file is truncated or "
                "corrupt — re-download it"
            ) from err
        if verify and md5_bytes(raw) != md5:
            raise CorruptDataError(
                f"{path}: md5 of the decompressed bytes is {md5_bytes(raw)}, expected {md5}; "
                "the file is corrupt or not the official MNIST — re-download it"
            )
        array = parse_idx(raw, str(path))
        if array.shape != shape:
            raise CorruptDataError(f"{path}: shape {array.shape}, expected {shape}")
        arrays[stem] = array
    if missing:
        raise DataNotFoundError(missing_data_message("MNIST", directory, missing, HOW_TO_GET))
    return arrays


def _download_hf() -> dict[str, np.ndarray]:
    """Fetch MNIST through HF `datasets` (needs network); same array layout as the IDX files."""
    from datasets import load_dataset

    ds = load_dataset("ylecun/mnist")
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = np.stack([np.asarray(img, dtype=np.uint8) for img in ds[split]["image"]])
        out[f"{prefix}-images-idx3-ubyte"] = images
        out[f"{prefix}-labels-idx1-ubyte"] = np.asarray(ds[split]["label"], dtype=np.uint8)
    return out


def load_mnist(
    data_dir: str,
    num_train: int = 50000,
    num_val: int = 10000,
    num_test: int | None = None,
    target: str = "image",
    flatten: bool = True,
    split_seed: int | None = 0,
    allow_download: bool = True,
    dtype: torch.dtype = torch.float32,
    name: str = "mnist",
) -> DataBundle:
    """MNIST as a :class:`DataBundle` with pixels in [0, 1].

    Train and validation are disjoint subsets of the official 60k training set (seeded
    permutation); test is the official 10k (first ``num_test`` of them).

    Args:
        data_dir: Data directory.
        num_train: Training images from the official training set.
        num_val: Validation images from the official training set (0: none).
        num_test: First images of the official test set (``None``: all 10k).
        target: ``"image"`` (autoencoder targets, y = x) or ``"label"`` (class indices).
        flatten: Return ``(N, 784)`` vectors; otherwise ``(N, 1, 28, 28)`` images.
        split_seed: Seed of the train/validation permutation (``None``: file order).
        allow_download: Fall back to HF ``datasets`` when the files are missing and the hub is
            reachable.
        dtype: Dtype of the pixel tensors.
        name: ``meta["name"]`` of the bundle.

    Returns:
        The bundle; ``meta["source"]`` is the directory or the HF dataset id.

    Raises:
        DataNotFoundError: If the files are missing and cannot be downloaded.
        CorruptDataError: If a file is corrupt.
        ValueError: On an unknown ``target``.
    """
    try:
        arrays = read_mnist_idx(data_dir)
        source = str(Path(data_dir).resolve())
    except DataNotFoundError as err:
        if not allow_download:
            raise
        if not hub_reachable():
            raise DataNotFoundError(f"{err}\n{offline_note()}") from None
        try:
            arrays = _download_hf()
            source = "huggingface:ylecun/mnist"
        except Exception as download_err:  # network down, hub blocked, datasets missing
            raise DataNotFoundError(
                f"{err}\n(Download through HF datasets also failed: {download_err})"
            ) from err

    def images(key: str) -> torch.Tensor:
        x = torch.from_numpy(arrays[key].astype(np.float32) / 255.0).to(dtype)
        return x.reshape(x.shape[0], -1) if flatten else x.unsqueeze(1)

    x_all, y_all = (
        images("train-images-idx3-ubyte"),
        torch.from_numpy(arrays["train-labels-idx1-ubyte"].astype(np.int64)),
    )
    x_test, y_test = (
        images("t10k-images-idx3-ubyte"),
        torch.from_numpy(arrays["t10k-labels-idx1-ubyte"].astype(np.int64)),
    )
    train_idx, val_idx = split_indices(x_all.shape[0], [num_train, num_val], split_seed)
    if num_test is not None:
        x_test, y_test = x_test[:num_test], y_test[:num_test]

    def pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if target == "image":
            return x, x
        if target == "label":
            return x, y
        raise ValueError(f"target must be 'image' or 'label', got {target!r}")

    return DataBundle(
        train=pair(x_all[train_idx], y_all[train_idx]),
        val=pair(x_all[val_idx], y_all[val_idx]) if num_val > 0 else None,
        test=pair(x_test, y_test),
        meta={"name": name, "synthetic": False, "source": source, "target": target},
    )
