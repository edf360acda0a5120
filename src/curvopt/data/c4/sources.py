"""Where C4 documents come from: local JSON-lines files under ``<data_dir>/c4/``, else the hub.

Both are read through HF ``datasets`` in streaming mode, so the same shuffling and rank sharding
serve both (package docstring, "Sources"). Every failure to find or read them becomes a
:class:`~curvopt.errors.DataNotFoundError` or :class:`~curvopt.errors.CorruptDataError` that says
which files to put where, instead of a traceback from deep inside ``datasets``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from curvopt.data.common import hub_reachable
from curvopt.errors import CorruptDataError, DataNotFoundError

HUB_DATASET = ("allenai/c4", "en")
SPLIT_NAMES = {"train": "train", "val": "validation", "validation": "validation"}


def is_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set to a true value.

    Returns:
        ``True`` unless both are unset, empty, ``0`` or ``false``.
    """
    return any(
        os.environ.get(k, "0") not in ("", "0", "false", "False")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def local_files(data_dir: str | Path, split: str) -> list[Path]:
    """Local C4 files of a split under ``<data_dir>/c4/`` (module docstring, "Sources").

    Args:
        data_dir: Data directory.
        split: ``"train"``, ``"val"`` or ``"validation"``.

    Returns:
        The files of the first matching name pattern, sorted; empty if none.
    """
    root = Path(data_dir) / "c4"
    split = SPLIT_NAMES.get(split, split)
    for pattern in (
        f"{split}.jsonl.gz",
        f"{split}.jsonl",
        f"{split}.json.gz",
        f"{split}.json",
        f"en/c4-{split}.*.json.gz",
        f"c4-{split}.*.json.gz",
    ):
        found = sorted(root.glob(pattern))
        if found:
            return found
    return []


def missing_message(data_dir: str | Path, what: str) -> str:
    """The error text when data or tokenizer are missing: what was searched and which files to put where."""
    root = Path(data_dir).resolve()
    return (
        f"C4: {what}.\n"
        f"Searched: {root / 'c4'} (data) and {root / 'tokenizers'} (tokenizer).\n"
        "Put there either\n"
        f"  - {root}/c4/train.jsonl.gz and {root}/c4/validation.jsonl.gz (JSON lines with a 'text' field,\n"
        "    e.g. shards of allenai/c4 en: c4-train.00000-of-01024.json.gz, c4-validation.00000-of-00008.json.gz\n"
        f"    in {root}/c4/en/), and\n"
        f"  - the t5-base tokenizer files (tokenizer.json, tokenizer_config.json, spiece.model,\n"
        f"    special_tokens_map.json) in {root}/tokenizers/t5-base/,\n"
        "or run online (unset HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) to stream allenai/c4 and fetch t5-base.\n"
        "Point the project at another data directory with `paths.data_dir=...` or CURVOPT_DATA_DIR."
    )


def corrupt_c4(files: list[str] | list[Path], err: BaseException) -> CorruptDataError:
    """The error for unreadable local C4 files, naming them and what to do.

    Args:
        files: The local files.
        err: The underlying exception.

    Returns:
        The :class:`CorruptDataError` (to be raised by the caller).
    """
    listed = ", ".join(str(Path(f).resolve()) for f in files)
    return CorruptDataError(
        f"C4: cannot read {listed} ({type(err).__name__}: {err}); the file is truncated, not gzip, or not "
        "JSON lines with a 'text' field. Copy it again, or remove it to stream allenai/c4 from the hub"
    )


def document_dataset(
    data_dir: str | Path,
    split: str,
    source: str = "auto",
    shuffle_seed: int | None = 42,
    shuffle_buffer: int = 10_000,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Any, dict[str, Any]]:
    """A streaming HF ``IterableDataset`` of C4 documents (``{"text": ...}``) and its provenance.

    Shuffled with ``shuffle_seed + epoch`` (GaLore: seed 42, one pass) and then split across
    ranks, as GaLore does (shuffle, then ``split_dataset_by_node``).

    Args:
        data_dir: Data directory.
        split: ``"train"``, ``"val"`` or ``"validation"``.
        source: ``"auto"`` (local files, else the hub), ``"local"`` or ``"hub"``.
        shuffle_seed: Base shuffle seed (``None``: no shuffle).
        shuffle_buffer: Size of the streaming shuffle buffer.
        epoch: Pass number (added to the seed).
        rank: This process's rank.
        world_size: Number of processes.

    Returns:
        ``(dataset, info)`` with ``info = {"source": "local"|"hub", "files": [...]}``.

    Raises:
        ValueError: On an unknown ``source``.
        CorruptDataError: If local files cannot be opened.
        DataNotFoundError: If there are no local files and the hub is unavailable.
    """
    import datasets
    from datasets.distributed import split_dataset_by_node

    split = SPLIT_NAMES.get(split, split)
    if source not in ("auto", "local", "hub"):
        raise ValueError(f"source must be auto | local | hub, got {source!r}")
    files = local_files(data_dir, split) if source in ("auto", "local") else []
    if files:
        try:
            ds = datasets.load_dataset(
                "json", data_files=[str(f) for f in files], split="train", streaming=True
            ).select_columns(["text"])
        except Exception as err:  # a truncated .gz (EOFError), broken JSON, no 'text' column
            raise corrupt_c4(files, err) from None
        info = {"source": "local", "files": [str(f) for f in files]}
    elif source == "local" or not hub_reachable():
        raise DataNotFoundError(
            missing_message(data_dir, f"no local '{split}' files and the hub is offline or unreachable")
        )
    else:
        try:
            ds = datasets.load_dataset(*HUB_DATASET, split=split, streaming=True).select_columns(["text"])
        except Exception as err:  # no network, hub down, auth
            raise DataNotFoundError(
                missing_message(data_dir, f"streaming {HUB_DATASET[0]} failed ({err!r})")
            ) from None
        info = {"source": "hub", "files": [f"{HUB_DATASET[0]}:{HUB_DATASET[1]}:{split}"]}
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed + epoch, buffer_size=shuffle_buffer)
    if world_size > 1:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
    return ds, info


def iter_texts(
    ds: Iterable[dict[str, Any]], data_dir: str | Path, local_files: list[str] | None = None
) -> Iterator[str]:
    """Texts of a document stream, with read errors turned into clear data errors.

    Args:
        ds: The document stream (``{"text": ...}`` items).
        data_dir: Data directory, for messages.
        local_files: The local files behind the stream, if any.

    Yields:
        Document texts.

    Raises:
        CorruptDataError: If reading ``local_files`` fails (truncated gzip, broken JSON).
        DataNotFoundError: On a hub/network failure.
    """
    try:
        for doc in ds:
            yield doc["text"]
    except (DataNotFoundError, CorruptDataError):
        raise
    except Exception as err:
        if local_files:
            raise corrupt_c4(local_files, err) from None
        if isinstance(err, (OSError, ConnectionError)):
            raise DataNotFoundError(missing_message(data_dir, f"reading C4 failed ({err!r})")) from None
        raise
