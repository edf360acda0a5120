"""Load run records into pandas frames: the only source figures and tables read from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from curvopt.analysis.pack import RecordError, loose_run_dirs, packed_run_frame, read_packed_runs
from curvopt.training.records import has_metrics, read_metrics

# load_summaries' status of a run directory without summary.json (it is running, or was killed)
RUNNING_OR_KILLED = "running_or_killed"


__all__ = ["RUNNING_OR_KILLED", "RecordError", "load_runs", "load_summaries", "read_run_metrics", "run_dirs"]


def _read_record(path: Path, what: str) -> Any:
    """``summary.json`` or ``config.yaml`` of a run, parsed; an unreadable one names itself."""
    try:
        text = path.read_text()
        value = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise RecordError(
            f"{path} is not valid ({type(err).__name__}: {first}): the run directory {path.parent} holds "
            f"a truncated or half-written {path.name}, so its {what} is missing. Run it again "
            f"(trainer.resume=true or trainer.restart=true), or delete {path.name} "
            + ("to list the run as running or killed" if path.suffix == ".json" else "and rerun it")
        ) from err
    if not isinstance(value, dict):
        raise RecordError(
            f"{path} holds {type(value).__name__}, not a mapping: the run directory {path.parent} has no "
            f"{what}. Run it again (trainer.resume=true or trainer.restart=true)"
        )
    return value


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def run_dirs(results_dir: str | Path, experiment: str) -> list[Path]:
    """The loose run directories of ``experiment`` (runs in a pack have none; see ``pack``).

    Args:
        results_dir: The results root.
        experiment: The experiment's directory name.

    Returns:
        Run directories (moved-aside runs excluded).
    """
    # runs moved aside (trainer.restart=true, drivers) are kept on disk but are not runs any more
    return loose_run_dirs(Path(results_dir) / experiment)


def _runs(results_dir: str | Path, experiment: str) -> list[tuple[Path, dict[str, Any] | None]]:
    """``(run dir, packed entry or None)`` of every run, sorted by run_id.

    Packed runs (``metrics.parquet`` + ``runs.jsonl``) take precedence over loose runs of the
    same id.
    """
    root = Path(results_dir) / experiment
    packed = {r["run_id"]: r for r in read_packed_runs(root)}
    runs: dict[str, tuple[Path, dict[str, Any] | None]] = {rid: (root / rid, e) for rid, e in packed.items()}
    for run in loose_run_dirs(root):
        runs.setdefault(run.name, (run, None))
    return [runs[k] for k in sorted(runs)]


def read_run_metrics(run_dir: str | Path) -> pd.DataFrame:
    """One run's metrics rows, from the pack of its experiment when the run is packed.

    Args:
        run_dir: The run directory (it need not exist for a packed run).

    Returns:
        A frame of its ``metrics.jsonl`` rows (empty when there are none).
    """
    run_dir = Path(run_dir)
    packed = {r["run_id"]: r for r in read_packed_runs(run_dir.parent)}
    if run_dir.name in packed:
        return packed_run_frame(run_dir.parent, packed[run_dir.name])
    return pd.DataFrame(read_metrics(run_dir / "metrics.jsonl") if has_metrics(run_dir) else [])


def load_summaries(results_dir: str | Path, experiment: str) -> pd.DataFrame:
    """One row per run: summary fields plus the resolved config.

    Reads the packed layout (``runs.jsonl``) and loose run directories alike. A run without a
    summary gets ``status = "running_or_killed"`` (:data:`RUNNING_OR_KILLED`).

    Args:
        results_dir: The results root.
        experiment: The experiment's directory name.

    Returns:
        Summary fields flattened (e.g. ``best.metrics.test/E_sq``), the config flattened under
        ``cfg.`` (e.g. ``cfg.optimizer.lr``), ``run_dir`` and ``run_id``.

    Raises:
        RecordError: A ``summary.json`` or ``config.yaml`` that cannot be parsed (truncated,
            half-written); the message names the file and its run directory.
    """
    rows = []
    for run, entry in _runs(results_dir, experiment):
        row: dict[str, Any] = {"run_dir": str(run), "run_id": run.name}
        if entry is not None:
            summary, config = entry.get("summary"), entry.get("config")
        else:
            summary_path, config_path = run / "summary.json", run / "config.yaml"
            summary = (
                _read_record(summary_path, "summary (status, steps, results)")
                if summary_path.exists()
                else None
            )
            config = _read_record(config_path, "config") if config_path.exists() else None
        if summary is not None:
            _flatten("", summary, row)
        else:
            row["status"] = RUNNING_OR_KILLED
        if config is not None:
            _flatten("cfg", config, row)
        rows.append(row)
    return pd.DataFrame(rows)


def load_runs(results_dir: str | Path, experiment: str, status: str | None = None) -> pd.DataFrame:
    """Long frame of every logged row of every run of ``experiment``.

    Each row carries ``run_id``, ``optimizer``, ``seed``, ``profile``, ``status``, ``dataset``
    and a few more config/summary columns (``tag``, ``device``, ``clock``, ...).

    Columns holding non-finite values stored as strings are converted back to numbers.

    Args:
        results_dir: The results root.
        experiment: The experiment's directory name.
        status: Keep only runs with this summary status (e.g. ``"completed"``); ``None`` keeps
            all, diverged runs included, so figures can show them as such.

    Returns:
        The long frame (empty when there are no rows).
    """
    summaries = load_summaries(results_dir, experiment)
    packed = {r["run_id"]: r for r in read_packed_runs(Path(results_dir) / experiment)}
    frames = []
    for _, s in summaries.iterrows():
        if status is not None and s.get("status") != status:
            continue
        run_dir = Path(s["run_dir"])
        if s["run_id"] in packed:
            frame = packed_run_frame(run_dir.parent, packed[s["run_id"]])
        else:
            frame = pd.DataFrame(read_metrics(run_dir / "metrics.jsonl"))
        if frame.empty:
            continue
        for key, col in (
            ("run_id", "run_id"),
            ("optimizer", "cfg.optimizer.name"),
            ("seed", "cfg.seed"),
            ("profile", "cfg.profile"),
            ("status", "status"),
            ("dataset", "cfg.dataset.name"),
            ("tag", "cfg.tag"),
            ("synthetic_data", "synthetic_data"),
            ("device", "device"),
            ("clock", "cfg.trainer.clock"),
            ("num_threads", "cfg.trainer.num_threads"),
            ("num_train", "cfg.dataset.num_train"),
            ("max_algo_time_s", "cfg.trainer.max_algo_time_s"),
            ("eval_every", "cfg.trainer.eval_every"),
        ):
            frame[key] = s.get(col)
        if frame["device"].isna().all():  # a run still in progress has no summary yet
            frame["device"] = s.get("cfg.trainer.device")
        frames.append(frame)
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    for col in out.columns:  # non-finite values are stored as strings ("nan", "inf")
        if out[col].dtype == object and col not in (
            "run_id",
            "optimizer",
            "profile",
            "status",
            "dataset",
            "tag",
            "device",
            "clock",
        ):
            converted = pd.to_numeric(out[col], errors="coerce")
            if converted.notna().sum() >= out[col].notna().sum() * 0.5:
                out[col] = converted
    return out
