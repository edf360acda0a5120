"""CIFAR-10 for the FOSI tasks (AE: convolutional autoencoder; TL: frozen ResNet-18 + linear head).

Where the images come from, first hit wins:

1. the official python layout ``<data_dir>/cifar-10-batches-py/`` (or ``<data_dir>/cifar10/…``), as
   unpacked from ``cifar-10-python.tar.gz`` or written by torchvision; its pickles are read by an
   unpickler that builds only what the format holds (dicts, lists, strings, numbers, numeric numpy
   arrays: :func:`read_python_batch`), so a data folder handed over cannot run code;
2. the project's lossless packed form ``<data_dir>/cifar10/{data_batch_1..5,test_batch}.webp`` +
   ``{train,test}_labels.npy`` (one 3200×3200 mosaic per official batch; decoding is byte-exact, see
   its PROVENANCE.md), decoded directly (≈0.5 s per batch);
3. with ``allow_download``: HF ``datasets`` (``uoft-cs/cifar10``, same image order as the official
   batches) when the hub is reachable.

Decoded arrays can be cached as ``.npy`` in ``cache_dir`` (e.g. ``~/.cache/curvopt``; never the
repository), which makes later loads ≈10× faster. Nothing is ever written into the data directory.

Two task layouts, because the two papers' pipelines differ:

* ``task='autoencoder'`` (Lippe's UvA tutorial 9, FOSI's AE): pixels scaled to [−1, 1], ``y = x``,
  the 50k training images split 45k/5k by ``torch.utils.data.random_split`` with a
  ``Generator().manual_seed(42)`` — we draw the same ``randperm`` so the validation images are the
  authors' — and the official test set as ``test``.
* ``task='classification'`` (TL): images kept as **uint8** NCHW (a quarter of the memory; the
  model converts, resizes to 128 px and keeps the authors' [0, 255] scale), class-index labels,
  the full 50k as ``train`` and the official 10k test set as ``val`` (the authors validate on the
  test split), ``test=None``. The ResNet-18 weights are the model's business
  (:mod:`curvopt.models.resnet_head`), not this loader's.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvopt.api import DataBundle
from curvopt.data.common import (
    hub_reachable,
    missing_data_message,
    offline_note,
)
from curvopt.errors import CorruptDataError, DataNotFoundError

log = logging.getLogger(__name__)

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCHES = ["test_batch"]
# md5 of the raw uint8 arrays (C order, NHWC) of the official order — from the packed set's PROVENANCE.
ARRAY_MD5 = {
    "train": ("17e2cb5a4119d89a4a13e02b91701bff", "69c5f3349be54915edfca558b72ad888"),
    "test": ("6d2714505047e13831cd876923568712", "251f18ce75337ae9ca5d0dbd7ea62cf4"),
}
HOW_TO_GET = (
    "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and unpack it into <data_dir> "
    "(giving <data_dir>/cifar-10-batches-py/), or put the project's packed copy (data_batch_*.webp, "
    "test_batch.webp, train_labels.npy, test_labels.npy) into <data_dir>/cifar10/, or run once with "
    "network access (HF `datasets` id 'uoft-cs/cifar10')."
)


def _find_python_batches(data_dir: Path) -> Path | None:
    for folder in (data_dir / "cifar-10-batches-py", data_dir / "cifar10" / "cifar-10-batches-py"):
        if all((folder / name).is_file() for name in TRAIN_BATCHES + TEST_BATCHES):
            return folder
    return None


def _find_packed(data_dir: Path) -> Path | None:
    for folder in (data_dir / "cifar10", data_dir):
        names = [f"{b}.webp" for b in TRAIN_BATCHES + TEST_BATCHES] + ["train_labels.npy", "test_labels.npy"]
        if all((folder / n).is_file() for n in names):
            return folder
    return None


class _NdarrayName:
    """Stands for ``numpy.ndarray`` in a batch: only :func:`_reconstruct` accepts it (nothing calls it)."""


def _reconstruct(cls: Any, shape: Any, dtype_char: Any) -> np.ndarray:
    """The ``_reconstruct`` of numpy for a plain ``ndarray`` only (what a pickled array starts from)."""
    if cls is not _NdarrayName:
        raise pickle.UnpicklingError(f"it holds an array of class {cls!r}, not numpy.ndarray")
    return np.ndarray.__new__(np.ndarray, shape, dtype_char)


def _dtype(spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
    """``numpy.dtype`` for numbers only (an object dtype would let an array hold anything)."""
    dtype = np.dtype(spec, bool(align), bool(copy))
    if dtype.hasobject or dtype.kind not in "biuf":
        raise pickle.UnpicklingError(f"it holds an array of dtype {dtype}, not a numeric one")
    return dtype


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: str) -> np.ndarray:
    """The ``_frombuffer`` of numpy (arrays at pickle protocol 5), for numeric dtypes only."""
    if not isinstance(buf, (bytes, bytearray)) or not isinstance(dtype, np.dtype):
        raise pickle.UnpicklingError("it builds an array from something other than bytes and a dtype")
    dtype = _dtype(dtype)
    array = np.frombuffer(buf, dtype=dtype)
    return array.reshape(tuple(shape)[::-1]).T if order == "F" else array.reshape(tuple(shape))


def _latin1_encode(text: Any, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes at protocol 2 (latin-1 text only)."""
    if not isinstance(text, str) or encoding.lower().replace("-", "") not in ("latin1", "iso88591"):
        raise pickle.UnpicklingError(f"it holds bytes encoded as {encoding!r}")
    return text.encode("latin1")


# The globals a CIFAR-10 python batch needs: numpy's array reconstruction (the official files pickle
# `data` as an ndarray; numpy's module was renamed numpy._core in 2.0; _frombuffer at protocol 5)
# and the protocol-2 bytes helper of Python 3 writers. Each is a guarded stand-in, so a batch
# builds arrays and nothing else.
_BATCH_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): _NdarrayName,
    ("numpy", "dtype"): _dtype,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("_codecs", "encode"): _latin1_encode,
}


class _BatchUnpickler(pickle.Unpickler):
    """An unpickler for CIFAR-10 python batches: dicts, lists, str, bytes, numbers and numeric arrays.

    Any other class or function the file names is refused before it is looked up, so a batch file
    cannot run code (as ``pickle.load`` would run whatever the file names).
    """

    def find_class(self, module: str, name: str) -> Any:
        """Return the guarded stand-in for an allowed global; refuse every other one.

        Args:
            module: The module the pickle names.
            name: The name in it.

        Returns:
            The stand-in of :data:`_BATCH_GLOBALS`.

        Raises:
            pickle.UnpicklingError: ``module.name`` is not part of the format.
        """
        found = _BATCH_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which the format never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids (the format has none).

        Args:
            pid: The id in the file.

        Raises:
            pickle.UnpicklingError: Always.
        """
        raise pickle.UnpicklingError("it holds a persistent id, which the format never holds")


def read_python_batch(path: Path) -> dict[str, Any]:
    """One batch of the official python layout (``data_batch_1`` ... ``test_batch``), unpickled safely.

    Only what the format holds is built: a dict of str (or bytes) keys, lists, strings, numbers and
    numeric numpy arrays (:class:`_BatchUnpickler`); anything else is refused without running it.

    Args:
        path: The batch file.

    Returns:
        Its dict, keys as ``str`` (Python 2 strings are read as latin-1): ``data`` (uint8
        ``[N, 3072]``), ``labels`` (``N`` ints), and ``batch_label`` / ``filenames`` when present.

    Raises:
        CorruptDataError: The file names a class or function the format does not hold, cannot be
            unpickled, or is not a CIFAR-10 batch (``data`` / ``labels`` missing or mis-shaped);
            the message names the file.
    """
    try:
        with open(path, "rb") as fh:
            entry = _BatchUnpickler(fh, encoding="latin1").load()
    except pickle.UnpicklingError as err:
        raise CorruptDataError(
            f"{path} is not a CIFAR-10 python batch: {err}; it was not loaded (a batch holds "
            f"a dict of lists, strings and one uint8 array). Replace the folder with a fresh copy: {HOW_TO_GET}"
        ) from err
    except Exception as err:  # truncated, not a pickle
        raise CorruptDataError(
            f"{path} cannot be read as a CIFAR-10 python batch ({type(err).__name__}: {err})"
        ) from err
    if isinstance(entry, dict):
        entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}
    data = entry.get("data") if isinstance(entry, dict) else None
    labels = entry.get("labels") if isinstance(entry, dict) else None
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
        or not isinstance(labels, list)
        or len(labels) != data.shape[0]
        or not all(isinstance(v, int) and 0 <= v < 10 for v in labels)
    ):
        raise CorruptDataError(
            f"{path} is not a CIFAR-10 python batch (expected a dict with 'data': uint8 [N, 3072] and "
            f"'labels': N ints in 0..9). Replace the folder with a fresh copy: {HOW_TO_GET}"
        )
    return entry


def _read_python_batches(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for name in TRAIN_BATCHES if split == "train" else TEST_BATCHES:
        entry = read_python_batch(folder / name)
        xs.append(entry["data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.append(np.asarray(entry["labels"], dtype=np.uint8))
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


def decode_mosaic(path: Path) -> np.ndarray:
    """Decode one packed batch: a 100×100 grid of 32×32 tiles, in row-major order.

    Args:
        path: The batch's lossless ``.webp`` mosaic (3200×3200 RGB).

    Returns:
        uint8 ``[10000, 32, 32, 3]`` (HWC RGB), images in the official batch order.

    Raises:
        CorruptDataError: The mosaic is not 3200×3200×3.
    """
    from PIL import Image

    with Image.open(path) as img:
        mosaic = np.asarray(img.convert("RGB"))
    if mosaic.shape != (3200, 3200, 3):
        raise CorruptDataError(f"{path}: mosaic shape {mosaic.shape}, expected (3200, 3200, 3)")
    return mosaic.reshape(100, 32, 100, 32, 3).transpose(0, 2, 1, 3, 4).reshape(10000, 32, 32, 3)


def _read_packed(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    names = TRAIN_BATCHES if split == "train" else TEST_BATCHES
    x = np.concatenate([decode_mosaic(folder / f"{n}.webp") for n in names])
    y = np.load(folder / f"{split}_labels.npy").astype(np.uint8)
    if len(y) != len(x):
        raise CorruptDataError(f"{folder}: {len(x)} {split} images but {len(y)} labels")
    return np.ascontiguousarray(x), y


def _download_hf(split: str) -> tuple[np.ndarray, np.ndarray]:
    from datasets import load_dataset

    ds = load_dataset("uoft-cs/cifar10", split=split)
    x = np.stack([np.asarray(img.convert("RGB"), dtype=np.uint8) for img in ds["img"]])
    return x, np.asarray(ds["label"], dtype=np.uint8)


def _md5(a: np.ndarray) -> str:
    import hashlib

    return hashlib.md5(np.ascontiguousarray(a).tobytes()).hexdigest()


def read_cifar10(
    data_dir: str | Path,
    split: str,
    cache_dir: str | Path | None = None,
    allow_download: bool = True,
    verify: bool = False,
) -> tuple[np.ndarray, np.ndarray, str]:
    """One official CIFAR-10 split as arrays, in the official order.

    Sources are tried in the module docstring's order, after the cache.

    Args:
        data_dir: The data directory searched for the python batches or the packed form.
        split: ``train`` (the 50,000 images of ``data_batch_1..5``) or ``test`` (10,000).
        cache_dir: Folder of the ``.npy`` cache (``~`` expanded): read first when it holds this
            split, written after a load from any other source; ``None``: no cache.
        allow_download: Fall back to HF ``datasets`` when there is no local copy and the hub is
            reachable.
        verify: Check the arrays' md5 against the official ones (≈0.3 s).

    Returns:
        ``(images, labels, source)``: uint8 ``[N, 32, 32, 3]`` HWC RGB, uint8 ``[N]`` class
        indices, and where they came from (``cache:<dir>``, the folder read, or
        ``huggingface:uoft-cs/cifar10``).

    Raises:
        ValueError: ``split`` is neither ``train`` nor ``test``.
        DataNotFoundError: No local copy, and the download is not allowed, the hub is not
            reachable, or the download failed; the message says what to get and where to put it.
        CorruptDataError: The arrays have the wrong shapes, a packed batch is broken, or (with
            ``verify``) the md5 differs from the official arrays.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    directory = Path(data_dir)
    cache = Path(os.path.expanduser(str(cache_dir))) if cache_dir else None
    if cache is not None and (cache / f"cifar10_{split}_x.npy").is_file():
        x, y = np.load(cache / f"cifar10_{split}_x.npy"), np.load(cache / f"cifar10_{split}_y.npy")
        source = f"cache:{cache}"
    elif (folder := _find_python_batches(directory)) is not None:
        x, y = _read_python_batches(folder, split)
        source = str(folder.resolve())
    elif (folder := _find_packed(directory)) is not None:
        x, y = _read_packed(folder, split)
        source = f"{folder.resolve()} (lossless webp)"
    else:
        message = missing_data_message(
            "CIFAR-10",
            directory,
            [
                "cifar-10-batches-py/{data_batch_1..5,test_batch}",
                "or cifar10/{data_batch_1..5,test_batch}.webp",
            ],
            HOW_TO_GET,
        )
        if not allow_download:
            raise DataNotFoundError(message)
        if not hub_reachable():
            raise DataNotFoundError(f"{message}\n{offline_note()}")
        try:
            x, y = _download_hf(split)
            source = "huggingface:uoft-cs/cifar10"
        except Exception as err:  # offline, hub blocked, datasets missing
            raise DataNotFoundError(f"{message}\n(Download through HF datasets also failed: {err})") from err
    expected = 50000 if split == "train" else 10000
    if x.shape != (expected, 32, 32, 3) or y.shape != (expected,):
        raise CorruptDataError(f"CIFAR-10 {split} from {source}: shapes {x.shape}, {y.shape}")
    if verify and (_md5(x), _md5(y)) != ARRAY_MD5[split]:
        raise CorruptDataError(f"CIFAR-10 {split} from {source}: md5 differs from the official arrays")
    if cache is not None and not source.startswith("cache:"):
        cache.mkdir(parents=True, exist_ok=True)
        np.save(cache / f"cifar10_{split}_x.npy", x)
        np.save(cache / f"cifar10_{split}_y.npy", y)
    return x, y, source


def lippe_split(num_total: int = 50000, sizes: tuple[int, int] = (45000, 5000), seed: int = 42):
    """The indices ``torch.utils.data.random_split`` gives, without building a dataset.

    Same as ``random_split(range(num_total), sizes, generator=Generator().manual_seed(seed))``
    for two parts: the AE task's 45k/5k split of Lippe's tutorial (seed 42).

    Args:
        num_total: Number of examples split.
        sizes: Sizes of the two parts.
        seed: Seed of the permutation.

    Returns:
        ``(first, second)``: int64 index tensors of the two parts.

    Raises:
        ValueError: The sizes do not add up to ``num_total``.
    """
    if sum(sizes) != num_total:
        raise ValueError(f"split sizes {sizes} must add up to {num_total}")
    perm = torch.randperm(num_total, generator=torch.Generator().manual_seed(seed))
    return perm[: sizes[0]], perm[sizes[0] :]


def load_cifar10(
    data_dir: str,
    task: str = "autoencoder",
    num_train: int | None = None,
    num_val: int | None = None,
    num_test: int | None = None,
    split_seed: int = 42,
    cache_dir: str | None = None,
    allow_download: bool = True,
    verify: bool = False,
    name: str = "cifar10",
) -> DataBundle:
    """CIFAR-10 as a :class:`DataBundle` for the FOSI AE / TL tasks (see the module docstring).

    Args:
        data_dir: The data directory (see :func:`read_cifar10`).
        task: ``autoencoder`` (float images in [−1, 1] as input and target; train/val from the
            45k/5k split of the training set, the official test set as ``test``) or
            ``classification`` (uint8 NCHW images, int64 labels; the full training set as
            ``train``, the official test set as ``val``, no ``test``).
        num_train: Keep the first ``num_train`` training examples (after the AE's split);
            ``None``: all. The quick profiles use these caps to stay within a CPU minute.
        num_val: Keep the first ``num_val`` validation examples; ``None``: all.
        num_test: Keep the first ``num_test`` test images (AE only; 0: no test split);
            ``None``: all.
        split_seed: Seed of the AE's 45k/5k split (42: the authors').
        cache_dir: The ``.npy`` cache folder (see :func:`read_cifar10`).
        allow_download: Allow the HF ``datasets`` fallback.
        verify: Check the md5 of the arrays (see :func:`read_cifar10`).
        name: The dataset name recorded in ``meta``.

    Returns:
        The splits, with ``meta`` = name, ``synthetic: False``, the source and the task.

    Raises:
        ValueError: ``task`` is unknown.
        DataNotFoundError: The images cannot be found.
        CorruptDataError: The images found are damaged (see :func:`read_cifar10`).
    """
    x_tr, y_tr, source = read_cifar10(data_dir, "train", cache_dir, allow_download, verify)
    x_te, y_te, _ = read_cifar10(data_dir, "test", cache_dir, allow_download, verify)
    meta = {"name": name, "synthetic": False, "source": source, "task": task}

    def first(
        pair: tuple[torch.Tensor, torch.Tensor], count: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pair if count is None else (pair[0][:count], pair[1][:count])

    if task == "autoencoder":
        # NHWC uint8 -> NCHW float in [-1, 1] (img / 255 * 2 - 1, as the tutorial's image_to_numpy)
        def images(x: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(x).permute(0, 3, 1, 2).float()
            return (t / 255.0 * 2.0 - 1.0).contiguous()

        train_idx, val_idx = lippe_split(50000, (45000, 5000), split_seed)
        train_idx = train_idx[:num_train] if num_train is not None else train_idx
        val_idx = val_idx[:num_val] if num_val is not None else val_idx
        x_all = torch.from_numpy(x_tr)
        x_train, x_val = images(x_all[train_idx].numpy()), images(x_all[val_idx].numpy())
        x_test = images(x_te[:num_test] if num_test is not None else x_te)
        test = (x_test, x_test) if len(x_test) else None  # num_test=0: no test split
        return DataBundle(train=(x_train, x_train), val=(x_val, x_val), test=test, meta=meta)
    if task == "classification":

        def pair(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(y.astype(np.int64))

        return DataBundle(
            train=first(pair(x_tr, y_tr), num_train),
            val=first(pair(x_te, y_te), num_val),
            test=None,
            meta=meta,
        )
    raise ValueError(f"task must be 'autoencoder' or 'classification', got {task!r}")
