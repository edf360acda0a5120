"""``checkpoint.pt`` on disk: atomic writes, the SHA-256 beside it, reading it back, the RNG states.

The training loop (:class:`curvopt.training.loop.Trainer`) decides what goes into a checkpoint and
when; this module writes and reads the file. A checkpoint is written to a temporary file, synced
and renamed, so a crash or a full disk leaves the previous one intact; ``checkpoint.pt.sha256``
(``sha256sum`` format, hashed while the file is written) lets a resume refuse a damaged file before
anything is loaded (docs/resume.md).

Checkpoints are data, not code. A checkpoint holds tensors and plain containers, numbers and
strings only (the RNG states as tensors and lists, the config as YAML text), and every read uses
``torch.load(..., weights_only=True)``, which builds nothing else, so a file handed over with a run
folder cannot run code on resume (the checksum beside it does not help there: whoever hands over
the folder writes both). The one exception is allowed by name: the projector objects the official
GaLore / Fira / APOLLO optimizers keep in their state
(:func:`curvopt.optim.lowrank.state_globals`). A write that would hold anything else fails at
once. Checkpoints of earlier versions (the numpy RNG state as a pickled array) are refused with
the command that converts a trusted one, which is the only full unpickle here, run on request::

    python -m curvopt.training.checkpoint convert <run_dir or checkpoint.pt> --trust
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import pickle
import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvopt.errors import EXIT_BAD_INPUT, BadInputError, CorruptCheckpointError
from curvopt.training.records import atomic_write_text

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
# SHA-256 of checkpoint.pt, in `sha256sum` format (`sha256sum -c checkpoint.pt.sha256` checks it)
CHECKSUM_NAME = CHECKPOINT_NAME + ".sha256"
# The objects besides tensors and plain values a checkpoint may hold: the projectors the official
# GaLore / Fira / APOLLO optimizers keep in their state (upstream code, pickled by their
# state_dict), by "module.name" as torch.serialization names a global -> the method whose
# curvopt.optim.lowrank.state_globals lists the class. Nothing else is ever allowed.
PROJECTOR_GLOBALS = {
    "galore_torch.galore_projector.GaLoreProjector": "galore",
    "fira.gradient_projection.GradientProjector": "fira",
    "apollo_torch.random_projector.GradientProjector": "apollo",
    "apollo_torch.svd_projector.GradientProjector": "apollo",
}
# What checkpoints written before weights-only loading hold (the numpy RNG state as an array)
_OLD_FORMAT_GLOBALS = {
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
}
CONVERT_COMMAND = "python -m curvopt.training.checkpoint convert {path} --trust"


class CheckpointWriteError(RuntimeError):
    """``checkpoint.pt`` could not be written (full disk, permissions); the previous one is intact."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint holds pickled objects that a weights-only load refuses; it was not loaded."""


def _unsafe_message(path: Path, names: list[str]) -> str:
    """The one-line refusal: what the file holds, and how to convert a trusted old checkpoint."""
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    if set(names) <= _OLD_FORMAT_GLOBALS:
        what = f"{path} was written by an earlier curvopt (it pickles numpy objects: {shown})"
    else:
        what = (
            f"{path} holds pickled objects no curvopt checkpoint holds ({shown}): it may have been "
            "tampered with"
        )
    return (
        f"{what}; it was not loaded, because unpickling it could run code (checkpoints are data: "
        "docs/resume.md). Only if you trust where this file came from, convert it once with "
        f"`{CONVERT_COMMAND.format(path=path)}` and resume again"
    )


def _allowed_globals(names: list[str]) -> list[type]:
    """The projector classes among ``names`` (:data:`PROJECTOR_GLOBALS`), imported from their packages."""
    methods = sorted({PROJECTOR_GLOBALS[n] for n in names if n in PROJECTOR_GLOBALS})
    if not methods:
        return []
    from curvopt.optim.lowrank import state_globals

    out = []
    for method in methods:
        try:
            out.extend(c for c in state_globals(method) if f"{c.__module__}.{c.__qualname__}" in names)
        except ImportError:  # the package is missing: the load fails on the name, as for any other
            continue
    return out


def _pickled_globals(source: Any) -> list[str]:
    """The globals in a ``torch.save`` file that a weights-only load refuses by default.

    Read statically (the pickle is disassembled, not run). The projector classes are among them.

    Args:
        source: A path or a seekable binary file.

    Returns:
        The ``module.name`` strings, sorted; ``[]`` when the file cannot be read that way (the
        load then reports it).
    """
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # not a zip, truncated, an opcode the scan does not know: torch.load decides
        return []
    finally:
        if hasattr(source, "seek"):
            source.seek(0)


def load_weights_only(path: Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values, plus the projector objects.

    The file's pickle is scanned first (statically: nothing runs) and refused when it names any
    other class or function; the load itself is weights-only as well, so what the scan cannot see
    is refused by torch.

    Args:
        path: A file written by ``torch.save``.
        **kwargs: ``map_location``, ``mmap``, ... for ``torch.load``.

    Returns:
        The loaded object.

    Raises:
        UnsafeCheckpointError: The file holds other pickled objects (an earlier checkpoint format,
            or a tampered file); the message names the file and the convert command.
        CorruptCheckpointError: The file cannot be read (truncated, not a torch file).
    """
    path = Path(path)
    names = _pickled_globals(path)
    refused = [n for n in names if n not in PROJECTOR_GLOBALS]
    if refused:
        raise UnsafeCheckpointError(_unsafe_message(path, refused))
    allowed = _allowed_globals(names)
    try:
        with torch.serialization.safe_globals(allowed) if allowed else contextlib.nullcontext():
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:  # weights-only refusal of what the scan did not list
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(err))
        reason = (found.group(1).strip() if found else "an object torch's weights-only load refuses")[:120]
        raise UnsafeCheckpointError(_unsafe_message(path, [reason])) from err
    except Exception as err:  # truncated / not a torch file
        raise _unreadable(path, err) from err


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
        TypeError: ``state`` holds an object a weights-only load refuses (a programming error:
            a state_dict with a Python object in it); nothing is written.
    """
    side = path.with_name(path.name + ".sha256")
    tmp = path.with_suffix(".tmp")
    try:
        with tmp.open("wb") as fh:
            writer = _HashingWriter(fh)
            torch.save(state, writer)
            fh.flush()
            os.fsync(fh.fileno())
        refused = [n for n in _pickled_globals(tmp) if n not in PROJECTOR_GLOBALS]  # no resume reads it
        if refused:
            raise TypeError(
                f"the checkpoint state at step {step} holds {', '.join(refused)}, which "
                "torch.load(weights_only=True) refuses; checkpoints hold tensors and plain "
                "containers, numbers and strings only (docs/resume.md)"
            )
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
    """Load a checkpoint's state onto ``device``, weights-only (:func:`load_weights_only`).

    Args:
        path: The checkpoint.
        device: Where its tensors go.

    Returns:
        The state the loop saved.

    Raises:
        UnsafeCheckpointError: The file holds pickled objects (an earlier format, or tampered
            with); nothing of it was run.
        CorruptCheckpointError: The file cannot be read.
    """
    state = load_weights_only(Path(path), map_location=device)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"{path} holds a {type(state).__name__}, not a checkpoint's state; "
            "restore it, or start the run again with trainer.restart=true"
        )
    return state


def checkpoint_config(path: Path) -> str | None:
    """The config text a checkpoint records (``config_yaml``), read without loading its tensors.

    Args:
        path: The checkpoint.

    Returns:
        The text; ``None`` for a checkpoint written before configs were recorded.

    Raises:
        UnsafeCheckpointError: The file holds pickled objects (an earlier format, or tampered
            with); nothing of it was run.
        CorruptCheckpointError: The file cannot be read.
    """
    path = Path(path)
    try:  # tensors mapped, not read: cheap for any size
        state = load_weights_only(path, map_location="cpu", mmap=True)
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError:  # a format mmap cannot read (torch's legacy one): read it
        state = load_weights_only(path, map_location="cpu")
    text = state.get("config_yaml") if isinstance(state, dict) else None
    return text if isinstance(text, str) else None


def rng_state() -> dict[str, Any]:
    """The global random states (torch, numpy, Python, and CUDA when available), for checkpoints.

    Returns:
        A dict accepted by :func:`set_rng_state`: tensors (torch, CUDA), plain tuples of ints
        (Python) and :func:`numpy_rng_state`'s dict, so it loads weights-only.
    """
    state = {"torch": torch.get_rng_state(), "numpy": numpy_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def numpy_rng_state(legacy: tuple | None = None) -> dict[str, Any]:
    """The global numpy RNG state as plain values (``np.random.get_state()`` holds a numpy array).

    Args:
        legacy: A tuple from ``np.random.get_state()`` to convert; ``None``: the current state.

    Returns:
        ``{"bit_generator": "MT19937", "keys": [624 ints], "pos", "has_gauss", "cached_gaussian"}``.
    """
    name, keys, pos, has_gauss, cached = np.random.get_state() if legacy is None else legacy
    return {
        "bit_generator": str(name),
        "keys": [int(k) for k in np.asarray(keys, dtype=np.uint32)],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the global random states saved by :func:`rng_state`.

    Args:
        state: A dict returned by :func:`rng_state`.
    """
    torch.set_rng_state(state["torch"].cpu())
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (
            numpy_state["bit_generator"],
            np.asarray(numpy_state["keys"], dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# -- converting a trusted checkpoint of an earlier version (run on request only) --------------------


def _plain(obj: Any, where: str, changes: list[str]) -> Any:
    """``obj`` with numpy arrays as tensors, numpy scalars as Python numbers, configs as plain values.

    Args:
        obj: A value of a loaded checkpoint.
        where: Its key path, for ``changes``.
        changes: Receives one line per converted value.

    Returns:
        The converted value; anything else is returned unchanged (the write then refuses it).
    """
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, np.ndarray):
        changes.append(f"{where}: numpy array -> tensor")
        return torch.from_numpy(np.array(obj))
    if isinstance(obj, np.generic):
        changes.append(f"{where}: numpy scalar -> Python number")
        return obj.item()
    if isinstance(obj, dict):
        return type(obj)((k, _plain(v, f"{where}.{k}", changes)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_plain(v, f"{where}[{i}]", changes) for i, v in enumerate(obj))
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # pragma: no cover - a dependency of the package
        return obj
    if isinstance(obj, Container):
        changes.append(f"{where}: omegaconf config -> plain values")
        return OmegaConf.to_container(obj, resolve=False)
    return obj


def convert_checkpoint(path: Path, *, trust: bool) -> list[str]:
    """Rewrite a trusted checkpoint of an earlier version so that it loads weights-only.

    This is the one place that unpickles a checkpoint in full, which runs whatever code the file
    carries: it is called by the ``convert`` command only, never by a resume. The file is checked
    against its ``.sha256`` first (when there is one); the numpy RNG state becomes
    :func:`numpy_rng_state`'s plain form, other numpy arrays become tensors, numpy scalars Python
    numbers, and a config object its plain values; then the checkpoint and its checksum are
    rewritten atomically. A file that already loads weights-only is left as it is.

    Args:
        path: The checkpoint, or a run directory holding ``checkpoint.pt``.
        trust: Must be ``True``: the caller vouches for where the file came from.

    Returns:
        What was converted, one line each (``[]``: the file was already in the current format).

    Raises:
        ValueError: ``trust`` is not ``True``.
        CorruptCheckpointError: The file does not match its checksum or cannot be read.
        TypeError: After conversion it still holds objects a weights-only load refuses (named).
    """
    if trust is not True:
        raise ValueError(
            "convert_checkpoint unpickles the file in full: pass trust=True for a trusted file only"
        )
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise CorruptCheckpointError(f"there is no checkpoint at {path}")
    verify_checkpoint(path)
    if not [n for n in _pickled_globals(path) if n not in PROJECTOR_GLOBALS]:
        load_weights_only(path, map_location="cpu")  # readable as it is: nothing to do
        return []
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # trusted, on request
    except Exception as err:
        raise _unreadable(path, err) from err
    changes: list[str] = []
    if isinstance(state, dict) and isinstance(state.get("rng"), dict):
        legacy = state["rng"].get("numpy")
        if isinstance(legacy, tuple):
            state["rng"] = {**state["rng"], "numpy": numpy_rng_state(legacy)}
            changes.append("rng.numpy: numpy RNG state -> plain lists and numbers")
    if isinstance(state, dict) and not isinstance(state.get("config_yaml", ""), (str, type(None))):
        from omegaconf import OmegaConf

        state["config_yaml"] = OmegaConf.to_yaml(state["config_yaml"])
        changes.append("config_yaml: config object -> YAML text")
    state = _plain(state, "state", changes)
    step = state.get("step", -1) if isinstance(state, dict) else -1
    digest = write_checkpoint(path, state, step)  # TypeError: still holds something else
    write_checksum(path, digest)
    load_weights_only(path, map_location="cpu")  # reads back under the rule it was converted for
    return changes


def main(argv: list[str] | None = None) -> int:
    """``python -m curvopt.training.checkpoint convert <path>... --trust`` (docs/resume.md).

    Args:
        argv: The arguments (``None``: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 when every file was converted or already current, 2 otherwise.
    """
    parser = argparse.ArgumentParser(
        prog="python -m curvopt.training.checkpoint",
        description="Convert trusted checkpoints of earlier curvopt versions so that they load with "
        "torch.load(weights_only=True). Converting unpickles each file in full, which runs any code "
        "it carries: convert only files you or someone you trust wrote.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="rewrite checkpoints (and their .sha256) in the current format")
    conv.add_argument("paths", nargs="+", type=Path, help="checkpoint.pt files or run directories")
    conv.add_argument("--trust", action="store_true", help="I trust where these files came from")
    args = parser.parse_args(argv)
    if not args.trust:
        print(
            "refusing to convert without --trust: converting unpickles the checkpoint in full, which runs "
            "any code it carries; pass --trust only for checkpoints you (or someone you trust) wrote",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    code = 0
    for path in args.paths:
        try:
            changes = convert_checkpoint(path, trust=True)
        except (BadInputError, TypeError) as err:
            print(f"{path}: not converted: {err}", file=sys.stderr)
            code = EXIT_BAD_INPUT
            continue
        target = path / CHECKPOINT_NAME if path.is_dir() else path
        if changes:
            print(f"{target}: converted ({'; '.join(changes)}); {CHECKSUM_NAME} rewritten")
        else:
            print(f"{target}: already loads weights-only; unchanged")
    return code


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    sys.exit(main())
