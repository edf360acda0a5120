"""``checkpoint.pt`` on disk: atomic writes, the SHA-256 beside it, reading it back, the RNG states.

The training loop (:class:`curvopt.training.loop.Trainer`) decides what goes into a checkpoint and
when; this module writes and reads the file. A checkpoint is written to a temporary file, synced
and renamed, so a crash or a full disk leaves the previous one intact; ``checkpoint.pt.sha256``
(``sha256sum`` format, hashed while the file is written) lets a resume refuse a damaged file before
anything is loaded (docs/resume.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvopt.errors import CorruptCheckpointError
from curvopt.training.records import atomic_write_text

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
# SHA-256 of checkpoint.pt, in `sha256sum` format (`sha256sum -c checkpoint.pt.sha256` checks it)
CHECKSUM_NAME = CHECKPOINT_NAME + ".sha256"


class CheckpointWriteError(RuntimeError):
    """``checkpoint.pt`` could not be written (full disk, permissions); the previous one is intact."""


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (the checkpoint's SHA-256)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.sha256 = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def write_checkpoint(path: Path, state: dict[str, Any], step: int) -> str:
    """Write ``state`` to ``path`` atomically (a temporary file, fsync, rename).

    The checksum file beside it is removed before the rename (it would describe another file);
    :func:`write_checksum` writes the new one.

    Args:
        path: The checkpoint (``<run_dir>/checkpoint.pt``).
        state: What ``torch.save`` writes.
        step: The step it belongs to, for the message.

    Returns:
        The SHA-256 of the written file (hex).

    Raises:
        CheckpointWriteError: If the write fails; the message names the file. No partial file
            is left behind.
    """
    side = path.with_name(path.name + ".sha256")
    tmp = path.with_suffix(".tmp")
    try:
        with tmp.open("wb") as fh:
            writer = _HashingWriter(fh)
            torch.save(state, writer)
            fh.flush()
            os.fsync(fh.fileno())
        side.unlink(missing_ok=True)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, (OSError, RuntimeError)):  # torch reports a full disk as RuntimeError
            raise CheckpointWriteError(
                f"could not write the checkpoint {path} at step {step}: {err}; "
                "free disk space (or point paths.results_dir elsewhere)"
            ) from err
        raise
    return writer.sha256.hexdigest()


def write_checksum(path: Path, digest: str) -> None:
    """Write ``<path>.sha256`` atomically; a failure only warns (the checkpoint stays resumable).

    Args:
        path: The checkpoint.
        digest: Its SHA-256 (:func:`write_checkpoint`).
    """
    side = path.with_name(path.name + ".sha256")
    try:
        atomic_write_text(side, f"{digest}  {path.name}\n")
    except OSError as err:  # the checkpoint itself is written: resumable, without a check
        log.warning("could not write %s (%s); the checkpoint is kept without a checksum", side, err)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks.

    Args:
        path: The file.

    Returns:
        The hex digest.
    """
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(path: Path) -> bool:
    """Check ``checkpoint.pt`` against the SHA-256 in ``checkpoint.pt.sha256`` beside it.

    A checkpoint without that file (written before checksums were recorded, or by a process
    that died between the two writes) is accepted with a logged warning.

    Args:
        path: The checkpoint.

    Returns:
        ``True`` when the checksum was verified, ``False`` when there is none.

    Raises:
        CorruptCheckpointError: The checksum file is unreadable or does not match; the message
            names the checkpoint and says how to go on.
    """
    path = Path(path)
    side = path.with_name(path.name + ".sha256")
    if not side.exists():
        log.warning("%s has no %s (an older checkpoint): resuming without a checksum check", path, side.name)
        return False
    try:
        expected = side.read_text().split()[0].lower()
    except (OSError, UnicodeDecodeError, IndexError):
        expected = ""
    if len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected):
        raise CorruptCheckpointError(
            f"{side} does not hold a SHA-256 checksum, so {path} cannot be verified; restore both "
            "files, or start the run again with trainer.restart=true (the old records are moved aside)"
        )
    actual = file_sha256(path)
    if actual != expected:
        raise CorruptCheckpointError(
            f"{path} does not match its checksum in {side.name} (sha256 {actual[:12]}..., recorded "
            f"{expected[:12]}...): the file was changed or damaged after it was written. Restore it from "
            "a copy, or start the run again with trainer.restart=true (the old records are moved aside)"
        )
    return True


def _unreadable(path: Path, err: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} cannot be read ({type(err).__name__}: {err}); it is truncated or corrupt. "
        "Restore it, or start the run again with trainer.restart=true"
    )


def read_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """Load a checkpoint's state onto ``device``.

    Args:
        path: The checkpoint.
        device: Where its tensors go.

    Returns:
        The state the loop saved.

    Raises:
        CorruptCheckpointError: The file cannot be read.
    """
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # truncated / not a torch file
        raise _unreadable(path, err) from err


def checkpoint_config(path: Path) -> str | None:
    """The config text a checkpoint records (``config_yaml``), read without loading its tensors.

    Args:
        path: The checkpoint.

    Returns:
        The text; ``None`` for a checkpoint written before configs were recorded.

    Raises:
        CorruptCheckpointError: The file cannot be read.
    """
    try:
        try:  # tensors mapped, not read: cheap for any size
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except Exception:  # a format mmap cannot read (torch's legacy one): read it
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated / not a torch file
        raise _unreadable(path, err) from err
    text = state.get("config_yaml") if isinstance(state, dict) else None
    return text if isinstance(text, str) else None


def rng_state() -> dict[str, Any]:
    """The global random states (torch, numpy, Python, and CUDA when available), for checkpoints.

    Returns:
        A dict accepted by :func:`set_rng_state`.
    """
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the global random states saved by :func:`rng_state`.

    Args:
        state: A dict returned by :func:`rng_state`.
    """
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
