"""What every step of a GPU slice shares: the repository's paths, sizes, file checksums, the run
status read from ``summary.json``, the time-stamped log and the refusal that names what to do."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CARRY = REPO / "gpu_carry"
MIB = 2**20
FINAL = ("completed", "diverged")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso(t: float) -> str | None:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if t else None


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gzip_file(src: Path, out: Path) -> None:
    with open(src, "rb") as fi, gzip.open(out, "wb", compresslevel=6) as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)


def run_status(run_dir: Path) -> str | None:
    """experiments.runs.run_status without the packed-records fallback (no pandas)."""
    s = run_dir / "summary.json"
    if s.exists():
        try:
            return json.loads(s.read_text()).get("status")
        except json.JSONDecodeError:
            return "killed"
    return "killed" if run_dir.is_dir() and any(run_dir.iterdir()) else None


class Log:
    """Prints with a time stamp and keeps a copy for ``slice.log``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.t0 = time.time()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def __call__(self, msg: str) -> None:
        line = f"[gpu_slice {time.time() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(line + "\n")


class Refused(SystemExit):
    pass
