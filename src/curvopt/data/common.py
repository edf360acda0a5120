"""Shared pieces of the dataset loaders: clear errors, checksums, split helpers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from curvopt.errors import BadInputError


class DataNotFoundError(BadInputError, FileNotFoundError):
    """Raised before training when a dataset's files are missing; the message says what to do."""


class CorruptDataError(BadInputError, ValueError):
    """Raised when a data file exists but cannot be read, or its checksum or shape is wrong."""


def missing_data_message(name: str, directory: Path, files: list[str], how: str) -> str:
    listed = "\n".join(f"  - {f}" for f in files)
    return (
        f"{name}: data files not found.\n"
        f"Searched directory: {directory.resolve()}\n"
        f"Expected files:\n{listed}\n"
        f"How to get them: {how}\n"
        "Point the project at another data directory with `paths.data_dir=...` or the "
        "CURVOPT_DATA_DIR environment variable."
    )


def md5_bytes(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def split_indices(total: int, sizes: list[int], seed: int | None) -> list[Tensor]:
    """Disjoint index sets of the given sizes from ``range(total)`` (a seeded permutation, or
    file order when ``seed`` is None)."""
    if sum(sizes) > total:
        raise ValueError(f"requested {sum(sizes)} examples ({sizes}) but only {total} exist")
    order = torch.arange(total)
    if seed is not None:
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    out, start = [], 0
    for size in sizes:
        out.append(order[start : start + size])
        start += size
    return out
