"""Run records: ``results/<experiment>/<run-id>/{config.yaml, metrics.jsonl, summary.json, checkpoint.pt}``.

Every figure and table in the repository is drawn from these files only. The writer appends
one JSON object per logged step and flushes it, so a crash or Ctrl-C keeps everything logged so
far; ``summary.json`` is rewritten atomically.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

from curvopt.errors import ConfigError, CorruptDataError, RunInUseError

METRICS_NAME = "metrics.jsonl"
PARKED_METRICS_NAME = "metrics.jsonl.gz"  # a paused run's rows, gzipped for git (park_metrics)
PACKED_RUNS_NAME = "runs.jsonl"  # an experiment's packed runs, one JSON line each (curvopt.analysis.pack)
PACKED_RUNS_GZ_NAME = "runs.jsonl.gz"  # the same, gzipped: a pack whose runs.jsonl would be large


def plain_or_gz(path: str | Path) -> Path | None:
    """A records file as it lies on disk: ``path`` itself, else its gzipped twin ``path.gz``.

    Records written as text may be kept gzipped for git (a parked ``metrics.jsonl.gz``, a large
    pack's ``runs.jsonl.gz``); readers find either through this, and open it with
    :func:`open_text`.

    Args:
        path: The plain file's path.

    Returns:
        The file that exists (the plain one first), or ``None`` when neither does.
    """
    path = Path(path)
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.exists():
            return candidate
    return None


def open_text(path: str | Path) -> IO[str]:
    """Open a records file for reading text, gunzipping it when its name ends in ``.gz``.

    Args:
        path: The file.

    Returns:
        A text file object.
    """
    path = Path(path)
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def packed_runs_file(exp_dir: str | Path) -> Path | None:
    """An experiment's packed-runs file: ``runs.jsonl``, or ``runs.jsonl.gz`` for a large pack.

    Args:
        exp_dir: The experiment directory.

    Returns:
        The file's path, or ``None`` when the experiment is not packed.
    """
    return plain_or_gz(Path(exp_dir) / PACKED_RUNS_NAME)


def read_text_lines(path: str | Path) -> list[str]:
    """The non-empty lines of a text file, gunzipped when its name ends in ``.gz``.

    Args:
        path: The file.

    Returns:
        Its lines, without line ends.
    """
    with open_text(path) as fh:
        return [line.rstrip("\n") for line in fh if line.strip()]


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them readable ("nan", "inf")
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        try:
            return value.item()
        except (ValueError, AttributeError):
            pass
    return value


def finite_json(value: Any) -> Any:
    """Make a value standard-JSON serialisable, keeping non-finite floats readable.

    Every non-finite float (at any depth) is replaced by its string ("nan", "inf", "-inf"), so
    that ``json.dumps(..., allow_nan=False)`` gives standard JSON; tensors and numpy scalars
    become numbers or lists, dict keys strings.

    Args:
        value: A scalar, tensor, list, tuple or dict.

    Returns:
        The converted value.
    """
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    value = _jsonable(value)
    if isinstance(value, (list, dict)):
        return finite_json(value)
    return value


# The folder runs are launched from (the repository for `make` targets, the drivers and the tests):
# a record names what lies below it relatively. Not this file's location: an installed package does
# not sit in a checkout.
REPO_ROOT = Path.cwd()


def path_roots(data_dir: str | Path | None = None, machine: bool = True) -> list[tuple[str, str]]:
    """The machine's absolute folders a record may name, and what a record says instead.

    Args:
        data_dir: The run's data directory (``paths.data_dir``); ``None``: ``$CURVOPT_DATA_DIR``.
        machine: Also the Python prefix, temporary and home folders; ``False``: the data directory
            and the repository only (a message naming a file elsewhere keeps its full path).

    Returns:
        ``(absolute folder, replacement)`` pairs, longest folder first: the data directory ->
        ``$CURVOPT_DATA_DIR``, the repository -> a path relative to it, the Python prefix ->
        ``$PYTHON_PREFIX``, the temporary folder -> ``$TMPDIR``, the home folder -> ``~``.
    """
    roots: dict[str, str] = {}
    data = data_dir if data_dir is not None else os.environ.get("CURVOPT_DATA_DIR")
    candidates = [(REPO_ROOT, "")]
    if machine:
        candidates += [
            (Path(sys.prefix), "$PYTHON_PREFIX"),
            (Path(tempfile.gettempdir()), "$TMPDIR"),
            (Path.home(), "~"),
        ]
    if data:
        candidates.insert(0, (Path(data), "$CURVOPT_DATA_DIR"))
    for folder, name in candidates:
        for variant in {str(folder), str(Path(folder).resolve())}:
            if variant.startswith("/") and variant != "/" and variant not in roots:
                roots[variant] = name
    return sorted(roots.items(), key=lambda item: -len(item[0]))


def portable_paths(text: str, roots: list[tuple[str, str]] | None = None) -> str:
    """``text`` with the machine's absolute folders replaced (:func:`path_roots`).

    A record then reads the same on every machine: ``/home/me/curvopt/results/x`` becomes
    ``results/x``, the repository itself ``.``, ``/data/mnist`` under ``$CURVOPT_DATA_DIR``
    becomes ``$CURVOPT_DATA_DIR/mnist``. A folder is matched only as a whole path component.

    Args:
        text: Any record text (YAML, JSON, a command line, an error message).
        roots: ``(folder, replacement)`` pairs; ``None``: :func:`path_roots` of this process.

    Returns:
        The text with the folders replaced.
    """
    for folder, name in roots if roots is not None else path_roots():
        pattern = re.compile(re.escape(folder) + r"(?=/|[^A-Za-z0-9_.+-]|$)(/)?")
        text = pattern.sub(lambda m, name=name: _replace(name, bool(m.group(1))), text)
    return text


def _replace(name: str, slash: bool) -> str:
    """A root's replacement: ``name/`` before more path, the repository itself as ``.``."""
    if name:
        return name + "/" if slash else name
    return "" if slash else "."


PATH_KEYS = ("data_dir", "results_dir", "output_dir", "root_dir")


def portable_config_yaml(config_yaml: str, data_dir: str | Path | None = None) -> str:
    """A resolved config's YAML with its folder keys made portable (:func:`portable_paths`).

    Only the keys that say where a run reads and writes (:data:`PATH_KEYS`, anywhere in the
    config) change: a resume takes those from the machine it runs on (``paths.*``) or from their
    interpolation (``dataset.data_dir: ${paths.data_dir}``), so the saved value is never read
    back as a path. Other values are kept as written.

    Args:
        config_yaml: ``OmegaConf.to_yaml(cfg, resolve=True)``.
        data_dir: The run's data directory; ``None``: the config's ``paths.data_dir``, else
            ``$CURVOPT_DATA_DIR``.

    Returns:
        The YAML text.
    """
    import yaml

    data = yaml.safe_load(config_yaml)
    if data_dir is None and isinstance(data, dict) and isinstance(data.get("paths"), dict):
        data_dir = data["paths"].get("data_dir")
    roots = path_roots(data_dir)
    changed = False

    def walk(node: Any) -> None:
        nonlocal changed
        if isinstance(node, dict):
            for key, value in node.items():
                if key in PATH_KEYS and isinstance(value, str):
                    new = portable_paths(value, roots)
                    if new != value:
                        node[key], changed = new, True
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(data)
    if not changed:
        return config_yaml
    # OmegaConf.to_yaml's own dump of a plain container (its dumper quotes what OmegaConf would read
    # back as another type), without building a DictConfig: the run's config is not read here
    from omegaconf._utils import get_omega_conf_dumper

    return yaml.dump(
        data, default_flow_style=False, allow_unicode=True, sort_keys=False, Dumper=get_omega_conf_dumper()
    )


def portable_record(value: Any, roots: list[tuple[str, str]] | None = None) -> Any:
    """:func:`portable_paths` applied to every string of a JSON-like value.

    Args:
        value: A dict / list / string / number.
        roots: As in :func:`portable_paths`.

    Returns:
        The value with the machine's absolute folders replaced in its strings.
    """
    if roots is None:
        roots = path_roots()
    if isinstance(value, str):
        return portable_paths(value, roots)
    if isinstance(value, dict):
        return {key: portable_record(item, roots) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable_record(item, roots) for item in value]
    return value


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename.

    On failure (a full disk) the old file is intact and the temporary one removed.

    Args:
        path: The file to (re)write.
        text: Its new content.
    """
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def git_commit(cwd: Path | None = None) -> str | None:
    """The checked-out commit, for the run summary.

    Args:
        cwd: Directory inside the repository (default: the current one).

    Returns:
        The commit hash, with ``-dirty`` appended when tracked files are modified, or ``None``
        when git is unavailable.
    """
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
        commit = out.stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
        return (commit + ("-dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment_info(device: torch.device) -> dict[str, Any]:
    """Device and software versions, for the run summary.

    Args:
        device: The run's device.

    Returns:
        ``device``, ``device_name``, ``num_threads``, ``python``, ``torch``, ``cuda`` (the CUDA
        version torch was built with; ``None`` for a CPU build), ``float32_matmul_precision``,
        ``numpy``, ``platform``; on a CUDA device also ``cudnn`` and the TF32 switches
        ``tf32_matmul`` / ``tf32_cudnn`` as the run started (a record says whether its float32
        products ran in TF32).
    """
    import numpy

    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "numpy": numpy.__version__,
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        info.update(
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
            tf32_cudnn=bool(torch.backends.cudnn.allow_tf32),
        )
    return info


class RunRecorder:
    """Writes one run's records.

    Re-opening an existing run directory (resume) truncates the metrics file to the rows at or
    before the checkpointed step, so a resumed run's file equals an uninterrupted run's; without
    ``resume_step`` an existing metrics file is removed.

    Args:
        run_dir: The run directory (created if missing).
        resume_step: The checkpointed step when resuming, else ``None``.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_NAME
        self.summary_path = self.run_dir / "summary.json"
        if resume_step is not None:
            unpark_metrics(self.run_dir)  # a parked run's rows come back before it continues
        elif (self.run_dir / PARKED_METRICS_NAME).exists():
            (self.run_dir / PARKED_METRICS_NAME).unlink()  # a new run: as for metrics.jsonl below
        if resume_step is not None and self.metrics_path.exists():
            kept = [row for row in read_metrics(self.metrics_path) if row.get("step", 0) <= resume_step]
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        self._file = self.metrics_path.open("a")

    def write_config(self, config_yaml: str) -> None:
        """Write ``config.yaml`` atomically.

        Args:
            config_yaml: The resolved config as YAML text.
        """
        atomic_write_text(self.run_dir / "config.yaml", config_yaml)

    def log(self, row: dict[str, Any]) -> None:
        """Append one row to ``metrics.jsonl`` and flush it.

        Args:
            row: The step's scalars (non-finite floats are written as strings).
        """
        self._file.write(json.dumps(finite_json(row), allow_nan=False) + "\n")
        self._file.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Rewrite ``summary.json`` atomically.

        Args:
            summary: The run summary.
        """
        # paths under the repository or the data directory (an error naming a data file, ...) are
        # written relative to them; a file elsewhere keeps its full path, so the message still finds it
        summary = portable_record(finite_json(summary), path_roots(machine=False))
        text = json.dumps(summary, indent=2, sort_keys=True, allow_nan=False, default=str)
        atomic_write_text(self.summary_path, text + "\n")

    def close(self) -> None:
        """Close the metrics file (idempotent)."""
        if not self._file.closed:
            self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (killed mid-write) is skipped.

    Args:
        path: The ``metrics.jsonl`` file; when it is absent, its parked copy
            ``metrics.jsonl.gz`` beside it (:func:`park_metrics`) is read instead.

    Returns:
        One dict per valid line (blank and undecodable lines are skipped).
    """
    path = Path(path)
    rows = []
    with open_text(plain_or_gz(path) or path) as fh:  # neither: the plain path's FileNotFoundError
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def has_metrics(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds metrics rows, as ``metrics.jsonl`` or parked.

    Args:
        run_dir: A run directory.

    Returns:
        ``True`` when ``metrics.jsonl`` or ``metrics.jsonl.gz`` exists there.
    """
    return plain_or_gz(Path(run_dir) / METRICS_NAME) is not None


def packed_run_ids(exp_dir: Path) -> set[str]:
    """The run ids whose records an experiment directory holds packed (``runs.jsonl[.gz]``).

    A packed run's own directory keeps at most what packing does not move (a checkpoint, its
    overrides); its rows live in the experiment's ``metrics.parquet`` (:mod:`curvopt.analysis.pack`).

    Args:
        exp_dir: The experiment directory.

    Returns:
        The packed run ids; empty when the experiment is not packed.
    """
    path = packed_runs_file(exp_dir)
    if path is None:
        return set()
    ids = set()
    try:
        for i, line in enumerate(read_text_lines(path), 1):
            entry = json.loads(line)
            if not isinstance(entry, dict) or not isinstance(entry.get("run_id"), str):
                raise ValueError(f"line {i} is not a packed run (no run_id)")
            ids.add(entry["run_id"])
    except (OSError, EOFError, ValueError) as err:  # a cut file: JSONDecodeError, BadGzipFile, EOFError
        what = (
            f"line {i}: {err.msg}"
            if isinstance(err, json.JSONDecodeError)
            else f"{type(err).__name__}: {err}"
        )
        raise CorruptDataError(
            f"{path} is not a valid pack ({what}): it is truncated or half-written, so which runs of "
            f"{Path(exp_dir).name} are packed is unknown; restore it (git checkout -- {path}, or from a "
            "backup), then run again"
        ) from None
    return ids


def park_metrics(run_dir: Path) -> Path:
    """Gzip an unfinished run's ``metrics.jsonl`` into ``metrics.jsonl.gz`` (about 4.5× smaller).

    For committing a run that is paused between sessions (its checkpoint beside it): the rows
    stay readable (:func:`read_metrics`) and a resume unparks them (:class:`RunRecorder`). The
    gzip file is written in full and checked against the original before the original goes.

    Args:
        run_dir: The run directory; no live process may own it (``run.lock``).

    Returns:
        The path of ``metrics.jsonl.gz``.

    Raises:
        FileNotFoundError: No ``metrics.jsonl`` there.
        RunInUseError: A live process owns the run.
    """
    run_dir = Path(run_dir)
    src, dst = run_dir / METRICS_NAME, run_dir / PARKED_METRICS_NAME
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist (already parked, or not a run directory)")
    lock = RunLock(run_dir)
    lock.acquire()  # held until the original is gone: a resume started meanwhile is refused
    try:
        data = src.read_bytes()
        tmp = dst.with_name(dst.name + ".tmp")
        with gzip.GzipFile(tmp, "wb", mtime=0) as fh:  # mtime 0: the same rows give the same bytes
            fh.write(data)
        if gzip.decompress(tmp.read_bytes()) != data:
            tmp.unlink()
            raise OSError(f"parking {src}: the gzip copy does not read back equal; nothing changed")
        os.replace(tmp, dst)
        src.unlink()
    finally:
        lock.release()
    return dst


def unpark_metrics(run_dir: Path) -> bool:
    """Undo :func:`park_metrics`: ``metrics.jsonl.gz`` back to ``metrics.jsonl``.

    Args:
        run_dir: The run directory.

    Returns:
        ``True`` when rows were unparked, ``False`` when there was no parked file.

    Raises:
        FileExistsError: Both files exist (which rows are the run's is unclear): nothing changed.
    """
    run_dir = Path(run_dir)
    src, dst = run_dir / PARKED_METRICS_NAME, run_dir / METRICS_NAME
    if not src.exists():
        return False
    if dst.exists():
        raise FileExistsError(
            f"{run_dir} holds both {METRICS_NAME} and {PARKED_METRICS_NAME}; keep the one with the "
            "run's rows (the longer one, normally) and delete the other, then resume"
        )
    atomic_write_text(dst, gzip.decompress(src.read_bytes()).decode())
    src.unlink()
    return True


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return platform.node()


class RunLock:
    """``run.lock`` in a run directory: one process owns a run at a time.

    The owner holds an exclusive ``flock`` on the file for as long as it lives (the kernel drops
    it when the process dies, however it dies) and writes its pid and boot id into it for the
    messages. A lock file nobody holds — left by a killed process, or by another machine (a run
    directory committed mid-run) — is stale and taken over. Lock files written by older code
    (pid and boot id, no ``flock``) count as held while that pid is alive on this machine.

    Args:
        run_dir: The run directory the lock belongs to.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "run.lock"
        self.held = False
        self._fd: int | None = None

    def _owner(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            return {}

    def _busy(self, info: dict[str, Any]) -> RunInUseError:
        pid = info.get("pid", "?")
        return RunInUseError(
            f"{self.path.parent} is in use by process {pid}; wait for it to finish or stop it "
            "(Ctrl-C or SIGTERM keeps its records and writes a checkpoint), or choose another run_id"
        )

    def check(self) -> None:
        """Refuse when a live process owns the run; creates nothing.

        Raises:
            RunInUseError: If another live process holds the lock.
        """
        if not self.path.exists():
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._busy(self._owner()) from None
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        info = self._owner()
        if _legacy_owner_alive(info):
            raise self._busy(info)

    def acquire(self) -> None:
        """Take the lock, creating the run directory (idempotent for the holder).

        Raises:
            RunInUseError: If another live process holds the lock.
        """
        if self.held:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # read-only, not a directory, no space: before anything is written
            raise ConfigError(
                f"cannot write the run directory {self.path.parent} ({type(err).__name__}: "
                f"{err.strerror or err}): paths.results_dir must be a folder this user can write; "
                "choose another (paths.results_dir=<folder>) or fix its permissions"
            ) from None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._busy(self._owner()) from None
            try:  # the file may have been removed (released) between open and flock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        info = self._owner()
        if _legacy_owner_alive(info):
            os.close(fd)
            raise self._busy(info)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "boot_id": _boot_id(), "flock": True}).encode())
        self._fd = fd
        self.held = True

    def release(self) -> None:
        """Remove the lock file and drop the lock (no-op when not held)."""
        if self.held and self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still holding it: no one can take a dead inode
            os.close(self._fd)
            self._fd = None
            self.held = False


def _legacy_owner_alive(info: dict[str, Any]) -> bool:
    """A lock file from code without ``flock``: its pid alive on this boot (not this process)."""
    if info.get("flock"):
        return False  # written by a flock holder: the flock alone says whether it lives
    pid = int(info.get("pid", -1) or -1)
    return info.get("boot_id") == _boot_id() and pid != os.getpid() and _alive(pid)


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return pid == os.getpid()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
