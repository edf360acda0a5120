"""USPS handwritten digits for the SHF-LSMR autoencoder experiments.

The paper uses Sam Roweis' ``usps_all.mat``: 11,000 images (1,100 per digit), 16×16, uint8,
variable ``data`` of shape 256 × 1100 × 10 (slice ``j`` = digit ``j+1`` for ``j = 0..8``, slice 9 =
digit 0). Each 256-vector is a **column-major** 16×16 image, so ``reshape(16, 16).T`` (NumPy) makes
it upright; rows of the returned matrices are the upright images flattened row-major, pixels
scaled to [0, 1] (``/255``), nothing else.

Split (Table 1, "train - test - val" = 8000 - 2000 - 1000; the paper does not say how;
docs/decisions.md, SHF-11): one seeded permutation of the 11,000 images, cut into 8,000
train, then 1,000 validation, then 2,000 test. The split is always a permutation: the ``.mat`` is
sorted by digit, so cutting it in file order would give whole digits to one split
(``split_seed=None`` is therefore read as ``split_seed=0``, with a warning).

Fallback ``usps.h5`` (ESL / Hastie et al., 7,291 + 2,007 deslanted images in [-1, 1] stored as
``(x+1)/2``): a *different* preprocessing of fewer images, used only when the ``.mat`` is absent
(or ``source='esl'``); its 9,298 images are pooled and split the same way, with the training split
shrunk when the requested sizes do not fit. ``meta['source_kind']`` records which file was used.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from curvopt.api import DataBundle
from curvopt.data.common import missing_data_message, split_indices
from curvopt.errors import CorruptDataError, DataNotFoundError

log = logging.getLogger(__name__)

ROWEIS_FILE = "usps_all.mat"
ESL_FILE = "usps.h5"
SOURCES = ("auto", "roweis", "esl")
HOW_TO_GET = (
    "usps_all.mat is Sam Roweis' file (https://cs.nyu.edu/~roweis/data.html, 'usps_all.mat'); "
    "usps.h5 is the ESL zip.train/zip.test repackaged as HDF5 (e.g. the Kaggle 'USPS dataset' "
    "by bistaumanga). Put either into <data_dir>/usps/."
)


def _search_dirs(data_dir: Path) -> list[Path]:
    return [data_dir / "usps", data_dir / "USPS", data_dir]


def _find(data_dir: Path, name: str) -> Path | None:
    for folder in _search_dirs(data_dir):
        if (folder / name).is_file():
            return folder / name
    return None


def read_usps_roweis(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read Sam Roweis' ``usps_all.mat``.

    Args:
        path: The ``.mat`` file.

    Returns:
        ``(images, labels)``: ``(11000, 256)`` uint8 upright images flattened row-major, and the
        ``(11000,)`` digits.

    Raises:
        CorruptDataError: If the file cannot be read or ``data`` is not uint8 256×1100×10.
    """
    import scipy.io

    try:
        mat = scipy.io.loadmat(str(path), variable_names=["data"])
    except (ValueError, OSError, TypeError, NotImplementedError) as err:
        raise CorruptDataError(f"{path}: not a readable MATLAB v5 file ({err}); the file is corrupt") from err
    data = mat.get("data")
    if data is None:
        raise CorruptDataError(f"{path}: no variable 'data' (expected uint8 256×1100×10)")
    if data.shape != (256, 1100, 10):
        raise CorruptDataError(f"{path}: 'data' has shape {data.shape}, expected (256, 1100, 10)")
    # (256, 1100, 10) → (10, 1100, 256); each 256-vector is column-major → transpose each image
    per_digit = np.transpose(data, (2, 1, 0)).reshape(10, 1100, 16, 16)
    upright = np.swapaxes(per_digit, -1, -2).reshape(11000, 256)
    labels = np.repeat((np.arange(10) + 1) % 10, 1100)
    return np.ascontiguousarray(upright), labels


def read_usps_esl(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read the ESL ``usps.h5`` (train rows first, then test rows).

    Args:
        path: The HDF5 file (groups ``train``/``test`` with ``data`` and ``target``).

    Returns:
        ``(images, labels)``: ``(9298, 256)`` float32 upright images in [0, 1] and int64 labels.

    Raises:
        DataNotFoundError: If ``h5py`` is not installed.
        CorruptDataError: If the file does not have the expected layout.
    """
    try:
        import h5py
    except ImportError as err:
        raise DataNotFoundError(f"{path} needs the h5py package (pip install h5py)") from err
    try:
        with h5py.File(path, "r") as f:
            parts = [(np.asarray(f[s]["data"]), np.asarray(f[s]["target"])) for s in ("train", "test")]
    except (OSError, KeyError) as err:
        raise CorruptDataError(
            f"{path}: not the expected HDF5 layout train|test/data|target ({err})"
        ) from err
    x = np.concatenate([p[0] for p in parts]).astype(np.float32)
    y = np.concatenate([p[1] for p in parts]).astype(np.int64)
    if x.ndim != 2 or x.shape[1] != 256:
        raise CorruptDataError(f"{path}: data has shape {x.shape}, expected (N, 256)")
    return x, y


def load_usps(
    data_dir: str,
    num_train: int = 8000,
    num_val: int = 1000,
    num_test: int = 2000,
    split_seed: int | None = 0,
    source: str = "auto",
    target: str = "image",
    dtype: torch.dtype = torch.float32,
) -> DataBundle:
    """USPS as a :class:`DataBundle` with pixels in [0, 1]; see the module docstring.

    Args:
        data_dir: Data directory (searched in ``usps/``, ``USPS/`` and itself).
        num_train: Training images (shrunk with a warning if the ESL file has too few).
        num_val: Validation images (0: no validation split).
        num_test: Test images (0: no test split).
        split_seed: Seed of the split permutation. ``None`` (file order in other loaders) means
            ``0`` here, with a warning: the file is sorted by digit, so file order would hand
            whole digits to one split.
        source: ``"auto"`` (Roweis' ``.mat``, else the ESL ``.h5``), ``"roweis"`` or ``"esl"``.
        target: ``"image"`` (y = x, the autoencoder) or ``"label"`` (digit classes).
        dtype: Dtype of the pixel tensors.

    Returns:
        The bundle; ``meta`` records the file used (``source``, ``source_kind``).

    Raises:
        ValueError: On an unknown ``source``/``target`` or splits that cannot fit.
        DataNotFoundError: If no usable file is found.
        CorruptDataError: If the file is unreadable.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    directory = Path(data_dir)
    mat_path = _find(directory, ROWEIS_FILE) if source in ("auto", "roweis") else None
    h5_path = _find(directory, ESL_FILE) if source in ("auto", "esl") or mat_path is None else None
    if mat_path is not None:
        raw, labels = read_usps_roweis(mat_path)
        x_all = raw.astype(np.float32) / 255.0
        meta = {
            "name": "usps",
            "synthetic": False,
            "source": str(mat_path.resolve()),
            "source_kind": "roweis",
        }
    elif h5_path is not None and source != "roweis":
        if source == "auto":
            log.warning(
                "USPS: %s not found; falling back to the ESL usps.h5 (different preprocessing)", ROWEIS_FILE
            )
        x_all, labels = read_usps_esl(h5_path)
        meta = {"name": "usps", "synthetic": False, "source": str(h5_path.resolve()), "source_kind": "esl"}
    else:
        files = {
            "auto": [f"usps/{ROWEIS_FILE}", f"usps/{ESL_FILE} (fallback)"],
            "roweis": [f"usps/{ROWEIS_FILE}"],
            "esl": [f"usps/{ESL_FILE}"],
        }[source]
        raise DataNotFoundError(missing_data_message("USPS", directory, files, HOW_TO_GET))
    total = x_all.shape[0]
    if num_train + num_val + num_test > total:
        shrunk = total - num_val - num_test
        if shrunk <= 0:
            raise ValueError(
                f"USPS ({meta['source_kind']}) has {total} images; cannot split {num_val}+{num_test}"
            )
        log.warning(
            "USPS: only %d images in %s; training split shrunk %d → %d",
            total,
            meta["source"],
            num_train,
            shrunk,
        )
        num_train = shrunk
    if split_seed is None:
        log.warning(
            "USPS: split_seed=null would cut the splits in file order, which is sorted by digit (whole "
            "digits in one split); using the seeded permutation split_seed=0 instead"
        )
        split_seed = 0
    tr, va, te = split_indices(total, [num_train, num_val, num_test], split_seed)
    x = torch.from_numpy(x_all).to(dtype)
    y = torch.from_numpy(labels)

    def pair(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if target == "image":
            return x[idx], x[idx]
        if target == "label":
            return x[idx], y[idx]
        raise ValueError(f"target must be 'image' or 'label', got {target!r}")

    meta.update(split_seed=split_seed, target=target, num_classes=10)
    return DataBundle(
        train=pair(tr),
        val=pair(va) if num_val > 0 else None,
        test=pair(te) if num_test > 0 else None,
        meta=meta,
    )
