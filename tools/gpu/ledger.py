"""The ledger: ``docs/gpu_ledger.md``, one row per slice run on a lent GPU; which slice is next."""

from __future__ import annotations

from pathlib import Path

from tools.gpu import slices as gpu_queue
from tools.gpu.common import REPO
from tools.gpu.slices import Slice, find_slice, load_queue

LEDGER = REPO / "docs" / "gpu_ledger.md"
LEDGER_HEAD = """# GPU ledger

One row per slice of `tools/gpu/gpu_queue.yaml` run on a lent GPU, appended by `make gpu-unpack`
(docs/cluster.md, section 5). `bash tools/gpu_slice.sh` without an ITEM runs the first slice of the
queue with no `done` row; write a row with status `skip` by hand to pass a slice over. GPU minutes:
the device call's lease when `make gpu-unpack GPU_MIN=...` gave it, else the command's own time.

| slice | status | date (UTC) | GPU min | device | produced |
|---|---|---|---|---|---|
"""


def read_ledger(path: Path = LEDGER) -> list[dict[str, str]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 6 or cells[0] in ("slice", "") or set(cells[0]) <= {"-"}:
            continue
        rows.append(dict(zip(("slice", "status", "date", "gpu_min", "device", "produced"), cells)))
    return rows


def done_slices(path: Path = LEDGER) -> set[str]:
    return {r["slice"] for r in read_ledger(path) if r["status"] in ("done", "skip")}


def next_slice(slices: list[Slice], ledger: Path = LEDGER) -> Slice | None:
    done = done_slices(ledger)
    return next((s for s in slices if s.auto and s.id not in done), None)


def append_ledger(path: Path, row: dict[str, str]) -> None:
    text = path.read_text() if path.exists() else LEDGER_HEAD
    if not text.endswith("\n"):
        text += "\n"
    cells = [
        row[k].replace("|", "/").replace("\n", " ")
        for k in ("slice", "status", "date", "gpu_min", "device", "produced")
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "| " + " | ".join(cells) + " |\n")


def pick(item: str | None, ledger: Path) -> Slice:
    slices = load_queue()
    if item:
        return find_slice(slices, item)
    chosen = next_slice(slices, ledger)
    if chosen is None:
        raise SystemExit(f"every slice of {gpu_queue.QUEUE.name} has a done row in {ledger}: nothing to do")
    return chosen
