"""Pack an experiment's run records into two files, so large sweeps stay small in git.

The command line is ``python -m experiments.pack`` (:mod:`experiments.pack`); this module is the
library it calls: :func:`pack_experiment`, :func:`unpack_run`, :func:`move_run` and the readers
(parking is :func:`curvopt.training.records.park_metrics`).

The loose layout is one directory per run, ``<exp>/<run_id>/{config.yaml, metrics.jsonl,
summary.json}``. The packed layout of the same experiment is

* ``<exp>/metrics.parquet``: every metrics row of every run, one column per logged key plus
  ``run_id`` (first column), rows grouped by run in ``run_id`` order, zstd-compressed. Non-finite
  numbers (written as the strings ``"nan"``/``"inf"`` in metrics.jsonl) are stored as float
  NaN/±inf; a column mixing numbers with other strings, or holding lists/dicts, is stored as JSON
  text and decoded on reading.
* ``<exp>/runs.jsonl``: text, one line per run: ``run_id``, ``summary`` (summary.json),
  ``config`` (config.yaml, parsed) and ``columns`` (the run's metrics keys in logged order).
  Above :data:`GZIP_RUNS_ABOVE_BYTES` it is written gzipped instead, as ``runs.jsonl.gz``.

The readers (:func:`curvopt.analysis.records.load_runs`, ``load_summaries``,
``read_run_metrics``) read both layouts and prefer the pack; a run directory not in the pack
(a run added later) is still read from its own files, and packing again folds it in. Packing
checks that the pack reads back equal to every run's files before it deletes them; runs without
a summary (running or killed), runs whose summary says ``running`` or ``interrupted`` (stopped by a
signal, to be resumed) and runs moved aside are left as they are.

A packed run is finished as far as the pack knows, but a run that kept its checkpoint can still be
extended (``trainer.resume=true`` with a larger budget). ``train.py`` refuses a run id whose rows
are packed, whatever the flags: a run continued there would write only its new rows, and packing
again would replace the packed run with them. ``--unpack`` (:func:`unpack_run`) first puts the
run's records back into its directory and takes it out of the pack.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from curvopt.errors import RunInUseError
from curvopt.training.records import (
    PACKED_RUNS_GZ_NAME,
    PACKED_RUNS_NAME,
    PARKED_METRICS_NAME,
    RunLock,
    atomic_write_text,
    has_metrics,
    packed_runs_file,
    read_metrics,
    read_text_lines,
)
from curvopt.training.rundir import is_set_aside

PACKED_METRICS = "metrics.parquet"
PACKED_RUNS = PACKED_RUNS_NAME
PACKED_RUNS_GZ = PACKED_RUNS_GZ_NAME
# runs.jsonl text above this size is written gzipped (runs.jsonl.gz): the FOSI quadratic grids'
# 500-3,000 runs repeat their summaries and configs line after line (3.8 MB -> 0.1 MB)
GZIP_RUNS_ABOVE_BYTES = 256 * 1024
RECORD_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
UNFINISHED = ("running", "interrupted")  # summary statuses of a run that is not over: never packed
JSON_COLUMNS_KEY = b"curvopt:json_columns"
NONFINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "Infinity": math.inf,
    "-Infinity": -math.inf,
}


class RecordError(ValueError):
    """A run's record file exists but cannot be read (truncated, half-written, edited, or missing its pair)."""


def is_packed(exp_dir: str | Path) -> bool:
    """Whether an experiment directory holds a pack.

    Args:
        exp_dir: The experiment directory.

    Returns:
        ``True`` when its ``runs.jsonl`` (or ``runs.jsonl.gz``) exists.
    """
    return packed_runs_file(exp_dir) is not None


def loose_run_dirs(exp_dir: str | Path) -> list[Path]:
    """Run directories with their own metrics.jsonl, or its parked copy (not moved aside), sorted.

    Args:
        exp_dir: The experiment directory.

    Returns:
        The run directories (empty when ``exp_dir`` does not exist).
    """
    root = Path(exp_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if has_metrics(p) and not is_set_aside(p.name))


# ---------------------------------------------------------------------------------------------- reading
def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def _damaged(path: str | Path, what: str) -> RecordError:
    return RecordError(
        f"{path} {what}: the experiment's pack is truncated or half-written (a copy or checkout cut "
        f"short); restore it (git checkout -- {path}, or from a backup) and read or pack again"
    )


@functools.lru_cache(maxsize=16)
def _runs_cached(path: str, stamp: tuple[int, int]) -> tuple[dict[str, Any], ...]:
    try:
        lines = read_text_lines(path)
    except (OSError, EOFError, UnicodeDecodeError) as err:  # a cut runs.jsonl.gz
        raise _damaged(path, f"cannot be read ({type(err).__name__}: {err})") from None
    entries = []
    for i, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise _damaged(path, f"line {i} is not valid JSON ({err.msg})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("run_id"), str):
            raise _damaged(path, f"line {i} is not a packed run (no run_id)")
        entries.append(entry)
    return tuple(entries)


def read_packed_runs(exp_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of an experiment's ``runs.jsonl`` or ``runs.jsonl.gz`` (cached while unchanged).

    Args:
        exp_dir: The experiment directory.

    Returns:
        One dict per packed run (``run_id``, ``summary``, ``config``, ``columns``); ``[]`` if
        the experiment is not packed.
    """
    path = packed_runs_file(exp_dir)
    if path is None:
        return []
    return list(_runs_cached(str(path), _stamp(path)))


@dataclass(frozen=True)
class _Metrics:
    table: pa.Table
    json_columns: frozenset[str]
    spans: dict[str, tuple[int, int]]  # run_id -> (first row, number of rows)


@functools.lru_cache(maxsize=8)
def _metrics_cached(path: str, stamp: tuple[int, int]) -> _Metrics:
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise _damaged(path, f"cannot be read ({type(err).__name__}: {err})") from None
    meta = table.schema.metadata or {}
    json_columns = frozenset(json.loads(meta.get(JSON_COLUMNS_KEY, b"[]")))
    ids = table.column("run_id").to_pylist()
    spans: dict[str, tuple[int, int]] = {}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            spans[ids[start]] = (start, i - start)
            start = i
    return _Metrics(table, json_columns, spans)


def _packed_metrics(exp_dir: Path) -> _Metrics | None:
    path = exp_dir / PACKED_METRICS
    if not path.exists():
        runs = packed_runs_file(exp_dir)
        if runs is None:
            return None
        raise RecordError(
            f"{runs} lists {len(read_packed_runs(exp_dir))} packed runs but {path} is missing: their "
            f"metrics rows are not in this checkout. Restore it (git checkout -- {path}, or from a backup); "
            "the runs would otherwise read as finished with no rows"
        )
    return _metrics_cached(str(path), _stamp(path))


def packed_run_frame(exp_dir: str | Path, run: dict[str, Any] | str) -> pd.DataFrame:
    """One packed run's metrics rows, as ``pd.DataFrame(read_metrics(...))`` gives the loose layout.

    Args:
        exp_dir: The experiment directory.
        run: The run's ``runs.jsonl`` entry, or its run_id.

    Returns:
        Its own columns in logged order, non-finite numbers as float NaN/±inf, JSON columns
        decoded; empty when the run is not in the pack.
    """
    exp_dir = Path(exp_dir)
    if isinstance(run, str):
        (run,) = [r for r in read_packed_runs(exp_dir) if r["run_id"] == run] or [{"run_id": run}]
    m = _packed_metrics(exp_dir)
    if m is None or run["run_id"] not in m.spans:
        return pd.DataFrame()
    start, length = m.spans[run["run_id"]]
    columns = [c for c in run.get("columns") or m.table.column_names if c != "run_id"]
    frame = m.table.select(columns).slice(start, length).to_pandas()
    for col in m.json_columns.intersection(columns):
        frame[col] = [json.loads(v) if isinstance(v, str) else None for v in frame[col]]  # NaN: not logged
    return frame


# ---------------------------------------------------------------------------------------------- packing
def _column_array(values: list[Any]) -> tuple[pa.Array, bool]:
    """``(arrow array, stored as JSON text)`` for one column's values (None = not logged in that row)."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.array(values, type=pa.bool_()), False
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        try:
            return pa.array(values, type=pa.int64()), False
        except (OverflowError, pa.ArrowInvalid):
            pass
    numeric = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in present]
    if any(numeric) and all(n or (isinstance(v, str) and v in NONFINITE) for n, v in zip(numeric, present)):
        return pa.array(
            [None if v is None else float(NONFINITE.get(v, v)) for v in values], pa.float64()
        ), False
    if all(isinstance(v, str) for v in present):
        return pa.array(values, type=pa.string()), False
    return pa.array([None if v is None else json.dumps(v) for v in values], pa.string()), True


def _yaml_load(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.exists() else None


def _json_load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _same(a: Any, b: Any) -> bool:
    """A value from the run's files equals its packed value (non-finite strings are floats there)."""
    if isinstance(a, str) and a in NONFINITE and isinstance(b, float):
        a = NONFINITE[a]
    if a is None:  # a logged null reads back as missing
        return b is None or (isinstance(b, float) and math.isnan(b))
    return _nan_equal(a, b)


def _nan_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_nan_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_nan_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(b, str) and not isinstance(a, (str, int, float, bool, type(None), dict, list)):
        return str(a) == b  # YAML dates and the like are stored as text
    return a == b


@dataclass
class PackResult:
    """What :func:`pack_experiment` did.

    Attributes:
        experiment: The experiment directory.
        runs: Runs in the pack.
        rows: Metrics rows in the pack.
        removed_files: Record files deleted after the check.
        skipped: Run ids left unpacked (no summary, locked by a live run, or not over).
        bytes_before: Size of the packed runs' record files.
        bytes_after: Size of ``metrics.parquet`` + ``runs.jsonl``.
    """

    experiment: Path
    runs: int
    rows: int
    removed_files: int
    skipped: list[str]
    bytes_before: int
    bytes_after: int


def pack_experiment(
    exp_dir: str | Path, remove: bool = True, compression: str = "zstd", drop: Collection[str] = ()
) -> PackResult:
    """Fold the loose runs of ``exp_dir`` (and an existing pack) into ``metrics.parquet`` + ``runs.jsonl``.

    The pack is checked against the files before the packed runs' files are deleted. A loose
    run with a run_id already in the pack replaces the packed one; runs without a summary, locked
    by a live process (``run.lock``), or whose summary says they are not over (:data:`UNFINISHED`)
    are skipped. Each packed run's lock is held from the moment it is read until its files are
    deleted, so a resume of it started meanwhile is refused instead of losing its rows.

    Args:
        exp_dir: The experiment directory.
        remove: Delete the packed runs' record files (and then-empty run directories).
        compression: Parquet compression (``"zstd"``, ``"snappy"``, ``"gzip"``, ``"none"``).
        drop: Run ids to leave out of the new pack (packed runs only; :func:`move_run` uses it).

    Returns:
        A :class:`PackResult`.

    Raises:
        ValueError: If a metrics key is named ``run_id``.
        AssertionError: If the pack does not read back equal to the files (nothing is deleted).
        RecordError: The existing pack is damaged (a half-written ``runs.jsonl``, a missing
            ``metrics.parquet``): nothing is written.
    """
    exp_dir = Path(exp_dir)
    runs: dict[str, dict[str, Any]] = {}
    rows_of: dict[str, list[dict[str, Any]]] = {}
    for old in read_packed_runs(exp_dir):
        if old["run_id"] in drop:
            continue
        runs[old["run_id"]] = old
        # the rows as their metrics.jsonl held them: arrow keeps an int column's ints (a pandas
        # frame makes them floats wherever a row lacks the key); a logged NaN reads as missing
        rows_of[old["run_id"]] = _loose_rows(exp_dir, old)
    skipped, packed_dirs, bytes_before = [], [], 0
    locks: list[RunLock] = []
    try:
        for run_dir in loose_run_dirs(exp_dir):
            if not (run_dir / "summary.json").exists():
                skipped.append(run_dir.name)  # running or killed: left for the run (or a rerun) to finish
                continue
            # each packed run's lock is held from here until its files are deleted: a resume (or a
            # rerun) of it started meanwhile is refused instead of writing rows the delete would lose
            lock = RunLock(run_dir)
            try:
                lock.acquire()
            except RunInUseError:
                skipped.append(run_dir.name)  # a live process owns it
                continue
            locks.append(lock)
            if (_json_load(run_dir / "summary.json") or {}).get("status") in UNFINISHED:
                skipped.append(run_dir.name)  # stopped by a signal: left for trainer.resume=true
                lock.release()
                locks.remove(lock)
                continue
            rows = read_metrics(run_dir / "metrics.jsonl")
            columns: list[str] = []
            for r in rows:
                columns += [k for k in r if k not in columns]
            if "run_id" in columns:
                raise ValueError(
                    f"{run_dir}: a metrics key named run_id clashes with the pack's run_id column"
                )
            runs[run_dir.name] = {
                "run_id": run_dir.name,
                "columns": columns,
                "summary": _json_load(run_dir / "summary.json"),
                "config": _yaml_load(run_dir / "config.yaml"),
            }
            rows_of[run_dir.name] = rows
            packed_dirs.append(run_dir)
            bytes_before += sum(
                (run_dir / f).stat().st_size
                for f in (*RECORD_FILES, PARKED_METRICS_NAME)
                if (run_dir / f).exists()
            )
        if not runs:
            for f in (PACKED_METRICS, PACKED_RUNS, PACKED_RUNS_GZ):  # every packed run was dropped
                if drop and (exp_dir / f).exists():
                    (exp_dir / f).unlink()
            return PackResult(exp_dir, 0, 0, 0, skipped, 0, 0)
        order = sorted(runs)
        all_columns: list[str] = []
        for rid in order:
            all_columns += [c for c in runs[rid]["columns"] if c not in all_columns]
        ids, cols = [], {c: [] for c in all_columns}
        for rid in order:
            for r in rows_of[rid]:
                ids.append(rid)
                for c in all_columns:
                    cols[c].append(r.get(c))
        arrays, json_columns = [pa.array(ids, pa.string())], []
        for c in all_columns:
            arr, as_json = _column_array(cols[c])
            arrays.append(arr)
            if as_json:
                json_columns.append(c)
        table = pa.Table.from_arrays(arrays, names=["run_id", *all_columns])
        table = table.replace_schema_metadata({JSON_COLUMNS_KEY: json.dumps(json_columns).encode()})
        _write_pack(exp_dir, table, [runs[rid] for rid in order], compression)
        _verify(exp_dir, packed_dirs)
        removed = 0
        if remove:
            for run_dir in packed_dirs:
                # a parked copy of the rows goes too: left behind, it would make the packed run
                # look loose (and let a resume of it past the packed-id refusal)
                for f in (*RECORD_FILES, PARKED_METRICS_NAME):
                    if (run_dir / f).exists():
                        (run_dir / f).unlink()
                        removed += 1
        for lock in locks:  # the records are gone (or kept): a run may take the directory now
            lock.release()
        locks = []
        if remove:
            for run_dir in packed_dirs:
                if not run_dir.is_dir():
                    continue
                if not any(run_dir.iterdir()):
                    run_dir.rmdir()
                elif {p.name for p in run_dir.iterdir()} <= {"wandb"}:  # mirrors are not records
                    shutil.rmtree(run_dir)
        after = sum(
            (exp_dir / f).stat().st_size
            for f in (PACKED_METRICS, PACKED_RUNS, PACKED_RUNS_GZ)
            if (exp_dir / f).exists()
        )
        return PackResult(exp_dir, len(order), len(ids), removed, skipped, bytes_before, after)
    finally:
        for lock in locks:
            lock.release()


def _write_pack(
    exp_dir: Path,
    table: pa.Table,
    entries: list[dict[str, Any]],
    compression: str = "zstd",
    runs_first: bool = False,
) -> None:
    """Write ``metrics.parquet`` and ``runs.jsonl`` (one line per entry, in the table's run order).

    ``runs.jsonl`` is written gzipped, as ``runs.jsonl.gz``, when its text would be larger than
    :data:`GZIP_RUNS_ABOVE_BYTES` (the other name is removed). Each file goes through a temporary
    file that replaces it in one step.
    """
    text = "".join(
        json.dumps(
            {"run_id": r["run_id"], "columns": r["columns"], "summary": r["summary"], "config": r["config"]},
            ensure_ascii=False,
            separators=(",", ":"),
            default=str,
        )
        + "\n"
        for r in entries
    ).encode()
    name, stale = (PACKED_RUNS, PACKED_RUNS_GZ)
    if len(text) > GZIP_RUNS_ABOVE_BYTES:
        name, stale = stale, name
        text = gzip.compress(text, mtime=0)  # mtime 0: the same pack gives the same bytes
    tmp_metrics, tmp_runs = exp_dir / f".{PACKED_METRICS}.tmp", exp_dir / f".{name}.tmp"
    pq.write_table(table, tmp_metrics, compression=compression, use_dictionary=["run_id"])
    tmp_runs.write_bytes(text)
    # a kill between the two renames leaves runs.jsonl naming only runs metrics.parquet holds:
    # adding runs, metrics.parquet goes first; taking one out (runs_first), runs.jsonl does
    first, second = (tmp_runs, exp_dir / name), (tmp_metrics, exp_dir / PACKED_METRICS)
    for tmp, dest in (first, second) if runs_first else (second, first):
        tmp.replace(dest)
    (exp_dir / stale).unlink(missing_ok=True)


def _record_texts(summary: Any, config: Any, rows: list[dict[str, Any]]) -> dict[str, str]:
    """A loose run's three record files' text, as the run logger writes them."""
    return {
        "summary.json": json.dumps(summary, indent=2, sort_keys=True, allow_nan=False, default=str) + "\n",
        "config.yaml": yaml.safe_dump(config, sort_keys=False),
        "metrics.jsonl": "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows),
    }


def _write_records(run_dir: Path, summary: Any, config: Any, rows: list[dict[str, Any]]) -> None:
    """A loose run's three record files, as the run logger writes them (each atomically)."""
    for name, text in _record_texts(summary, config, rows).items():
        atomic_write_text(run_dir / name, text)


def _verify(exp_dir: Path, run_dirs: list[Path]) -> None:
    """The pack reads back equal to each run's own files (values, columns, summary, config)."""
    packed = {r["run_id"]: r for r in read_packed_runs(exp_dir)}
    for run_dir in run_dirs:
        entry = packed[run_dir.name]
        if not _nan_equal(entry["summary"], _json_load(run_dir / "summary.json")):
            raise AssertionError(f"{run_dir}: summary differs in the pack")
        if not _nan_equal(entry["config"], _yaml_load(run_dir / "config.yaml")):
            raise AssertionError(f"{run_dir}: config differs in the pack")
        rows = read_metrics(run_dir / "metrics.jsonl")
        frame = packed_run_frame(exp_dir, entry)
        if len(frame) != len(rows):
            raise AssertionError(f"{run_dir}: {len(frame)} packed rows, {len(rows)} in metrics.jsonl")
        for i, r in enumerate(rows):
            for k, v in r.items():
                got = frame[k].iloc[i]
                got = got.item() if hasattr(got, "item") else got
                if not _same(v, got):
                    raise AssertionError(f"{run_dir} row {i} {k}: {v!r} in metrics.jsonl, {got!r} packed")


def _loose_rows(exp_dir: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A packed run's metrics rows as its metrics.jsonl held them (missing keys left out)."""
    m = _packed_metrics(exp_dir)
    if m is None or entry["run_id"] not in m.spans:
        return []
    start, length = m.spans[entry["run_id"]]
    columns = [c for c in entry.get("columns") or m.table.column_names if c != "run_id"]
    rows = []
    for r in m.table.select(columns).slice(start, length).to_pylist():  # arrow keeps ints as ints
        row = {}
        for k in columns:  # the run's own key order
            v = r[k]
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue  # the pack stores a logged NaN as missing (pack_experiment)
            if k in m.json_columns:
                v = json.loads(v)
            elif isinstance(v, float) and math.isinf(v):
                v = "inf" if v > 0 else "-inf"  # as the run logger writes non-finite numbers
            row[k] = v
        rows.append(row)
    return rows


def move_run(src: str | Path, dst: str | Path) -> Path:
    """Move one run's records to another experiment directory and/or run id (loose or packed).

    For curating records when a default changes: the run that used to be a reading becomes the
    default's record, or the other way round. The records are written as a loose run directory at
    ``dst`` with ``run_id`` set to the new name in ``summary.json`` and ``config.yaml``, and
    ``summary.json`` gains ``moved_from`` (the old ``<experiment>/<run_id>``); every other file of
    the run directory (``overrides.yaml``, the command line as run, included) moves unchanged. The
    source pack is rewritten without the run. Pack the destination afterwards if it is packed.

    Args:
        src: ``<experiment dir>/<run_id>`` of the run (a loose run directory or a packed run).
        dst: ``<experiment dir>/<new run_id>``; it must not exist, loose or packed.

    Returns:
        The new run directory.

    Raises:
        FileNotFoundError: ``src`` is neither a finished loose run nor a packed run.
        FileExistsError: ``dst`` already exists (as a directory or in the destination's pack).
        RunInUseError: A live process owns ``src`` (its ``run.lock``); the run's lock is held from
            the check until ``src`` is deleted.
    """
    src, dst = Path(src), Path(dst)
    src_exp, old_id, new_id = src.parent, src.name, dst.name
    if dst.exists() or any(r["run_id"] == new_id for r in read_packed_runs(dst.parent)):
        raise FileExistsError(f"{dst} already exists: choose another run id or move that run first")
    packed = {r["run_id"]: r for r in read_packed_runs(src_exp)}
    loose = (src / "metrics.jsonl").exists() and (src / "summary.json").exists()
    if not loose and old_id not in packed:
        raise FileNotFoundError(f"{src}: no finished run there (no summary.json and not in {PACKED_RUNS})")
    # the run's lock is held from here until its directory is deleted: a resume (or a rerun) started
    # meanwhile is refused instead of writing rows the delete would lose (a lock file left by a
    # killed process is stale and taken over)
    existed = src.is_dir()
    lock = RunLock(src)
    lock.acquire()  # RunInUseError: a live process owns the run
    try:
        return _move_locked(src, dst, loose, packed)
    finally:
        lock.release()
        if not existed and src.is_dir() and not any(src.iterdir()):
            src.rmdir()  # made only to hold the lock of a packed run


def _move_locked(src: Path, dst: Path, loose: bool, packed: dict[str, dict[str, Any]]) -> Path:
    """:func:`move_run`'s work, with the source run's lock held."""
    src_exp, old_id, new_id = src.parent, src.name, dst.name
    if loose:
        summary, config = _json_load(src / "summary.json"), _yaml_load(src / "config.yaml")
        rows = read_metrics(src / "metrics.jsonl")
    else:
        entry = packed[old_id]
        summary, config, rows = (
            dict(entry["summary"]),
            dict(entry["config"] or {}),
            _loose_rows(src_exp, entry),
        )
    summary["run_id"] = new_id
    summary["moved_from"] = f"{src_exp.name}/{old_id}"
    if isinstance(config, dict) and "run_id" in config:
        config["run_id"] = new_id
    if isinstance(config, dict) and "experiment_name" in config:  # the directory it now lives in
        config["experiment_name"] = dst.parent.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{new_id}.moving")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("run.lock"))  # the lock stays with src
    _write_records(tmp, summary, config, rows)
    tmp.rename(dst)
    if not loose:
        pack_experiment(src_exp, drop=(old_id,))
    shutil.rmtree(src)  # the lock file with it, still held: a run that starts after finds no records
    return dst


def unpack_run(run_dir: str | Path) -> int:
    r"""Put a packed run's records back into its directory and take it out of the pack.

    ``config.yaml``, ``summary.json`` and ``metrics.jsonl`` are written into ``run_dir`` (which
    may hold the run's checkpoint and ``overrides.yaml``, left as they are); then the pack is
    rewritten without the run. Its other runs are not touched. An unpack killed part-way leaves
    some of these files, each as this function writes it: unpacking again recognises them and
    finishes. The run's lock is held meanwhile.

    Args:
        run_dir: ``<experiment dir>/<run_id>`` of a packed run.

    Returns:
        The number of metrics rows written.

    Raises:
        FileNotFoundError: The run is not in its experiment's pack.
        FileExistsError: ``run_dir`` already holds loose records (config, summary or metrics)
            other than the packed run's.
        RunInUseError: A live process owns ``run_dir``.
        RecordError: The pack is damaged (half-written ``runs.jsonl``, no ``metrics.parquet``).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> run = root / "exp" / "r"
        >>> run.mkdir(parents=True)
        >>> _ = (run / "config.yaml").write_text("seed: 0\n")
        >>> _ = (run / "summary.json").write_text('{"status": "completed"}')
        >>> _ = (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1.5}\n')
        >>> pack_experiment(root / "exp").runs
        1
        >>> unpack_run(run)
        1
        >>> (run / "metrics.jsonl").read_text()
        '{"step": 0, "loss": 1.5}\n'
        >>> is_packed(root / "exp")
        False
    """
    run_dir = Path(run_dir)
    exp_dir, run_id = run_dir.parent, run_dir.name
    entry = next((r for r in read_packed_runs(exp_dir) if r["run_id"] == run_id), None)
    if entry is None:
        raise FileNotFoundError(f"{run_id} is not in the pack of {exp_dir} (no {PACKED_RUNS} entry)")
    rows = _loose_rows(exp_dir, entry)
    texts = _record_texts(entry["summary"], entry["config"], rows)
    # files an unpack of this run wrote before it was killed are its own: the unpack goes on
    parked = run_dir / PARKED_METRICS_NAME
    if parked.exists() and _read_or_none(parked) == texts["metrics.jsonl"]:
        texts[PARKED_METRICS_NAME] = texts["metrics.jsonl"]  # the packed rows, parked: left by older packs
    loose = [
        f
        for f in (*RECORD_FILES, PARKED_METRICS_NAME)
        if (run_dir / f).exists() and _read_or_none(run_dir / f) != texts.get(f)
    ]
    if loose:
        complete = all((run_dir / f).exists() for f in ("summary.json", "metrics.jsonl"))
        raise FileExistsError(
            f"{run_dir} already holds {', '.join(loose)} that differ from the packed run: a run there has "
            "records of its own. "
            + (
                f"Pack the experiment (python -m experiments.pack {exp_dir}: the loose run replaces the "
                "packed one) or move the files elsewhere, then unpack again"
                if complete
                else f"Move {', '.join(loose)} out of {run_dir} (they are not a whole run), then unpack again"
            )
        )
    lock = RunLock(run_dir)
    lock.acquire()  # no run may start in the directory while its records come back
    try:
        _write_records(run_dir, entry["summary"], entry["config"], rows)
        parked.unlink(missing_ok=True)  # equal to metrics.jsonl (checked above)
        _drop_from_pack(exp_dir, run_id)
    finally:
        lock.release()
    return len(rows)


def _read_or_none(path: Path) -> str | None:
    try:
        return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    except (OSError, EOFError, UnicodeDecodeError):
        return None


def _drop_from_pack(exp_dir: Path, run_id: str) -> None:
    """Rewrite the pack of ``exp_dir`` without ``run_id`` (both files; removed when it was the last run)."""
    entries = [r for r in read_packed_runs(exp_dir) if r["run_id"] != run_id]
    metrics, runs = exp_dir / PACKED_METRICS, packed_runs_file(exp_dir)
    if not entries:  # runs.jsonl first: a kill in between leaves no pack, not runs without rows
        if runs is not None:
            runs.unlink()
        metrics.unlink(missing_ok=True)
        return
    packed = _packed_metrics(exp_dir)
    assert packed is not None
    table = packed.table
    meta = table.schema.metadata
    kept_columns = ["run_id"]
    for r in entries:
        kept_columns += [c for c in r["columns"] if c not in kept_columns and c in table.column_names]
    table = table.filter(pc.not_equal(table["run_id"], run_id)).select(kept_columns)
    _write_pack(exp_dir, table.replace_schema_metadata(meta), entries, runs_first=True)


def experiments_under(path: str | Path) -> list[Path]:
    """The experiment directories at or directly below ``path``.

    Args:
        path: An experiment directory or a folder of them.

    Returns:
        ``[path]`` if it holds runs (loose or packed), else its subdirectories that do.
    """
    path = Path(path)
    if is_packed(path) or loose_run_dirs(path):
        return [path]
    if not path.is_dir():
        return []
    return [p for p in sorted(path.iterdir()) if p.is_dir() and (is_packed(p) or loose_run_dirs(p))]
