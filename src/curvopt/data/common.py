"""Shared pieces of the dataset loaders: clear errors, checksums, split helpers."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def missing_data_message(name: str, directory: Path, files: list[str], how: str) -> str:
    """The message of a :class:`DataNotFoundError`: what is missing, where, and how to get it.

    Args:
        name: Dataset name.
        directory: The directory searched.
        files: The files expected there.
        how: How to obtain them.

    Returns:
        The multi-line message (it also names ``paths.data_dir`` / ``CURVOPT_DATA_DIR``).
    """
    listed = "\n".join(f"  - {f}" for f in files)
    return (
        f"{name}: data files not found.\n"
        f"Searched directory: {directory.resolve()}\n"
        f"Expected files:\n{listed}\n"
        f"How to get them: {how}\n"
        "Point the project at another data directory with `paths.data_dir=...` or the "
        "CURVOPT_DATA_DIR environment variable."
    )


_HUB: dict[str, bool] = {}  # the one answer per process of hub_reachable()
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline_requested() -> bool:
    """Whether ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set to a true value.

    Returns:
        ``True`` unless both are unset, empty, ``0``, ``false`` or ``no``.
    """
    return any(os.environ.get(k, "0").strip().lower() not in ("", "0", "false", "no") for k in OFFLINE_VARS)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub can be reached, asked once per process.

    ``False`` at once when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set. Otherwise one HEAD request
    to ``$HF_ENDPOINT`` (default https://huggingface.co; proxies from the environment apply) with a
    ``timeout_s`` limit, instead of the hub libraries' own retries (40-60 s per loader without a
    network). An unreachable hub also sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE for this process,
    so that libraries imported later do not retry either.

    Args:
        timeout_s: Timeout of the HEAD request, in seconds.

    Returns:
        Whether the hub answered (any HTTP status counts).
    """
    if hub_offline_requested():
        return False
    if "reachable" not in _HUB:
        import urllib.error
        import urllib.request

        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
            reachable = True
        except urllib.error.HTTPError:  # an answer, even an error status: the hub is there
            reachable = True
        except (OSError, ValueError):  # no route, DNS, timeout, refused, bad endpoint
            reachable = False
        _HUB["reachable"] = reachable
        if not reachable:
            log.warning("the Hugging Face hub (%s) is not reachable: no downloads in this process", endpoint)
            for var in OFFLINE_VARS:
                os.environ.setdefault(var, "1")
    return _HUB["reachable"]


def offline_note() -> str:
    """A sentence for error messages saying that no download was tried (hub offline).

    Returns:
        The sentence.
    """
    return (
        "(No download was tried: the Hugging Face hub is offline (HF_HUB_OFFLINE) or not reachable "
        "from this machine.)"
    )


def md5_bytes(data: bytes) -> str:
    """MD5 checksum of a file's content.

    Args:
        data: The bytes.

    Returns:
        The hex digest.
    """
    return hashlib.md5(data).hexdigest()


def split_indices(total: int, sizes: list[int], seed: int | None) -> list[Tensor]:
    """Disjoint index sets of the given sizes from ``range(total)``.

    Args:
        total: Number of examples.
        sizes: Size of each split.
        seed: Seed of the permutation the splits are cut from; ``None`` keeps file order.

    Returns:
        One index tensor per size, consecutive slices of the (permuted) order.

    Raises:
        ValueError: If the sizes add up to more than ``total``.
    """
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
