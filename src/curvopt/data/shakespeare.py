"""Tiny Shakespeare as a character-level language-modelling task (FOSI's LM task).

The authors' pipeline (haiku's RNN example, TFDS ``tiny_shakespeare``) is reproduced:

* splits: TFDS 90/5/5 — ``i = int(0.9·len)``, train ``[0, i)``; the rest halved into validation
  and test (train 1,003,854 / 55,770 / 55,770 characters);
* each split is one long byte string ``x`` (pure ASCII, vocabulary of 128 byte values);
  ``input = x[:-1]``, ``target = x[1:]``, cut into non-overlapping sequences of ``sequence_length``
  (128) pairs, remainder dropped: 7,842 training sequences;
* the authors' "validation" curve is the **test** split (``val_split='test'``, default).

Deviations, kept deliberately simple for an in-memory loop: the training batches come from the
loop's epoch sampler (a full reshuffle per pass) instead of a 100-element shuffle buffer over the
sequences in file order, and evaluation scores every sequence of the validation split once (435
sequences) instead of one batch of 1,000 drawn from the repeated split.

Targets are class indices (``int64``, shape ``(N, T)``), batch-major; the model is batch-first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from curvopt.api import DataBundle
from curvopt.data.common import (
    hub_reachable,
    missing_data_message,
    offline_note,
)
from curvopt.errors import CorruptDataError, DataNotFoundError

SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
NUM_CHARS = 128
HOW_TO_GET = (
    "download karpathy's char-rnn data/tinyshakespeare/input.txt (1,115,394 bytes) into "
    "<data_dir>/tiny_shakespeare/input.txt, or run once with network access (HF `datasets` id "
    "'karpathy/tiny_shakespeare')."
)


def tfds_splits(text: bytes) -> dict[str, bytes]:
    """The TFDS / HF ``tiny_shakespeare`` 90/5/5 split of the raw text.

    Args:
        text: The whole file as bytes.

    Returns:
        ``{"train", "validation", "test"}`` → bytes.
    """
    i = int(len(text) * 0.9)
    rest = text[i:]
    j = int(len(rest) * 0.5)
    return {"train": text[:i], "validation": rest[:j], "test": rest[j:]}


def to_sequences(text: bytes, sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-byte pairs cut into non-overlapping windows (remainder dropped).

    Args:
        text: One split as ASCII bytes.
        sequence_length: Window length T.

    Returns:
        ``(inputs, targets)``, both int64 ``(N, T)``.

    Raises:
        CorruptDataError: If the text holds non-ASCII bytes.
    """
    codes = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    if codes.size and codes.max() >= NUM_CHARS:
        raise CorruptDataError("text has non-ASCII bytes; the model's vocabulary is 128 byte values")
    x, y = codes[:-1], codes[1:]
    n = len(x) // sequence_length
    shape = (n, sequence_length)
    return (
        torch.from_numpy(x[: n * sequence_length].reshape(shape).copy()),
        torch.from_numpy(y[: n * sequence_length].reshape(shape).copy()),
    )


def read_text(data_dir: str | Path, allow_download: bool = True, verify: bool = True) -> tuple[bytes, str]:
    """The raw Tiny Shakespeare text, from ``<data_dir>/tiny_shakespeare/input.txt`` or HF ``datasets``.

    Args:
        data_dir: Data directory.
        allow_download: Fall back to HF ``datasets`` when the file is missing and the hub is
            reachable.
        verify: Check the file's sha256 against :data:`SHA256`.

    Returns:
        ``(text, source)``: the bytes and the file path or HF dataset id.

    Raises:
        CorruptDataError: If the checksum differs.
        DataNotFoundError: If the file is missing and cannot be downloaded.
    """
    directory = Path(data_dir)
    for path in (directory / "tiny_shakespeare" / "input.txt", directory / "tinyshakespeare" / "input.txt"):
        if path.is_file():
            text = path.read_bytes()
            if verify and hashlib.sha256(text).hexdigest() != SHA256:
                raise CorruptDataError(
                    f"{path}: sha256 differs from the TFDS/char-rnn file ({SHA256[:12]}…); re-download it"
                )
            return text, str(path.resolve())
    message = missing_data_message("Tiny Shakespeare", directory, ["tiny_shakespeare/input.txt"], HOW_TO_GET)
    if not allow_download:
        raise DataNotFoundError(message)
    if not hub_reachable():
        raise DataNotFoundError(f"{message}\n{offline_note()}")
    try:
        from datasets import load_dataset

        ds = load_dataset("karpathy/tiny_shakespeare")
        text = "".join(ds[s][0]["text"] for s in ("train", "validation", "test")).encode()
        return text, "huggingface:karpathy/tiny_shakespeare"
    except Exception as err:  # offline, hub blocked
        raise DataNotFoundError(f"{message}\n(Download through HF datasets also failed: {err})") from err


def load_tiny_shakespeare(
    data_dir: str,
    sequence_length: int = 128,
    val_split: str = "test",
    num_train: int | None = None,
    num_val: int | None = None,
    allow_download: bool = True,
    name: str = "tiny_shakespeare",
) -> DataBundle:
    """Tiny Shakespeare as training sequences and one evaluation split (as ``val``).

    Args:
        data_dir: Data directory.
        sequence_length: Sequence length T (the authors: 128).
        val_split: Split served as ``val``: ``"test"`` (the authors' choice) or
            ``"validation"`` (the split TFDS calls so).
        num_train: Keep the first training sequences only (``None``: all).
        num_val: Keep the first evaluation sequences only (``None``: all).
        allow_download: As in :func:`read_text`.
        name: ``meta["name"]`` of the bundle.

    Returns:
        The bundle (no ``test`` split); targets are int64 ``(N, T)``.

    Raises:
        ValueError: On an unknown ``val_split``.
    """
    if val_split not in ("test", "validation"):
        raise ValueError(f"val_split must be 'test' or 'validation', got {val_split!r}")
    text, source = read_text(data_dir, allow_download)
    splits = tfds_splits(text)
    x_tr, y_tr = to_sequences(splits["train"], sequence_length)
    x_va, y_va = to_sequences(splits[val_split], sequence_length)
    if num_train is not None:
        x_tr, y_tr = x_tr[:num_train], y_tr[:num_train]
    if num_val is not None:
        x_va, y_va = x_va[:num_val], y_va[:num_val]
    return DataBundle(
        train=(x_tr, y_tr),
        val=(x_va, y_va),
        test=None,
        meta={"name": name, "synthetic": False, "source": source, "val_split": val_split},
    )
