"""Load run records into pandas frames: the only source figures and tables read from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from curvopt.training.records import read_metrics
from curvopt.training.rundir import is_set_aside


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def run_dirs(results_dir: str | Path, experiment: str) -> list[Path]:
    root = Path(results_dir) / experiment
    if not root.is_dir():
        return []
    # runs moved aside (trainer.restart=true, drivers) are kept on disk but are not runs any more
    return sorted(p for p in root.iterdir() if (p / "metrics.jsonl").exists() and not is_set_aside(p.name))


def load_summaries(results_dir: str | Path, experiment: str) -> pd.DataFrame:
    """One row per run: summary fields (flattened, e.g. ``best.metrics.test/E_sq``) plus the
    resolved config flattened under ``cfg.`` (e.g. ``cfg.optimizer.lr``)."""
    rows = []
    for run in run_dirs(results_dir, experiment):
        row: dict[str, Any] = {"run_dir": str(run), "run_id": run.name}
        summary_path = run / "summary.json"
        if summary_path.exists():
            _flatten("", json.loads(summary_path.read_text()), row)
        else:
            row["status"] = "running_or_killed"
        config_path = run / "config.yaml"
        if config_path.exists():
            _flatten("cfg", yaml.safe_load(config_path.read_text()), row)
        rows.append(row)
    return pd.DataFrame(rows)


def load_runs(results_dir: str | Path, experiment: str, status: str | None = None) -> pd.DataFrame:
    """Long frame of every logged row of every run of ``experiment``, with ``run_id``,
    ``optimizer``, ``seed``, ``profile``, ``status`` and ``dataset`` columns attached.

    ``status`` filters on the summary status (e.g. ``"completed"``); diverged runs are kept by
    default so figures can show them as such.
    """
    summaries = load_summaries(results_dir, experiment)
    frames = []
    for _, s in summaries.iterrows():
        if status is not None and s.get("status") != status:
            continue
        rows = read_metrics(Path(s["run_dir"]) / "metrics.jsonl")
        if not rows:
            continue
        frame = pd.DataFrame(rows)
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
