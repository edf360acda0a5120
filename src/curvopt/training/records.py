"""Run records: ``results/<experiment>/<run-id>/{config.yaml, metrics.jsonl, summary.json, checkpoint.pt}``.

Every figure and table in the repository is drawn from these files only. The writer appends
one JSON object per logged step and flushes it, so a crash or Ctrl-C keeps everything logged so
far; ``summary.json`` is rewritten atomically.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


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


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def git_commit(cwd: Path | None = None) -> str | None:
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
    import numpy

    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "platform": platform.platform(),
    }
    return info


class RunRecorder:
    """Writes one run's records. Re-opening an existing run directory (resume) truncates the
    metrics file to the rows at or before the checkpointed step, so a resumed run's file equals
    an uninterrupted run's."""

    def __init__(self, run_dir: Path, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.summary_path = self.run_dir / "summary.json"
        if resume_step is not None and self.metrics_path.exists():
            kept = [row for row in read_metrics(self.metrics_path) if row.get("step", 0) <= resume_step]
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        self._file = self.metrics_path.open("a")

    def write_config(self, config_yaml: str) -> None:
        atomic_write_text(self.run_dir / "config.yaml", config_yaml)

    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        clean = json.loads(json.dumps(summary, default=_jsonable))
        atomic_write_text(self.summary_path, json.dumps(clean, indent=2, sort_keys=True) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (killed mid-write) is skipped."""
    rows = []
    with Path(path).open() as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return platform.node()


class RunLock:
    """``run.lock`` in a run directory: one process owns a run at a time.

    The lock holds the owner's pid and boot id; a lock whose process is gone (killed, or left by
    another machine, e.g. a run directory committed mid-run) is stale and taken over.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "run.lock"
        self.held = False

    def check(self) -> None:
        """Refuse (RuntimeError) when a live process owns the run; creates nothing."""
        if self.path.exists():
            try:
                info = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
            if info.get("boot_id") == _boot_id() and _alive(int(info.get("pid", -1))):
                raise RuntimeError(
                    f"{self.path.parent} is in use by process {info['pid']}; wait for it to finish or "
                    "stop it (Ctrl-C keeps its records and checkpoint), or choose another run_id"
                )

    def acquire(self) -> None:
        self.check()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"pid": os.getpid(), "boot_id": _boot_id()}))
        self.held = True

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


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
