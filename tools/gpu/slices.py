"""The queue: ``tools/gpu/gpu_queue.yaml``'s slices, each one device call, in priority order.

A slice has phases (``parallel`` runs at once), each run either a train run of ``src/train.py``
(:class:`Run` names its experiment config, run id and folder as the paper drivers do) or a module
(``python -m ...``). Nothing here runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.gpu.common import REPO

QUEUE = REPO / "tools" / "gpu" / "gpu_queue.yaml"


@dataclass
class Run:
    id: str
    spec: dict[str, Any]

    @property
    def kind(self) -> str:
        return "module" if "module" in self.spec else "train"

    @property
    def run_id(self) -> str:
        s = self.spec
        rid = f"{s['optimizer']}_{s.get('profile', 'quick')}_s{int(s.get('seed', 0))}"
        return rid + (f"_{s['suffix']}" if s.get("suffix") else "")

    @property
    def config_name(self) -> str:
        """The experiment config (experiments.runs.experiment_config); '' for none."""
        s = self.spec
        if "config" in s:
            return str(s["config"] or "")
        profile = s.get("profile", "quick")
        return s["experiment"] if profile == "quick" else f"{s['experiment']}_{profile}"

    def run_dir(self, results: Path) -> Path:
        s = self.spec
        base = results / s["results"] if s.get("results") else results
        return base / s["experiment"] / self.run_id

    def rel_dir(self) -> str:
        """The run directory relative to the repository root (results/...)."""
        return str(self.run_dir(Path("results")))


@dataclass
class Phase:
    name: str
    parallel: int
    min_left_s: float
    runs: list[Run]


@dataclass
class Slice:
    id: str
    order: float
    title: str
    gpu_minutes: float
    wheels: list[str]
    data: list[str]
    phases: list[Phase]
    after: list[list[str]]
    auto: bool = True
    cpu: bool = False
    work_s: float = 480.0
    grace_s: float = 40.0
    checkpoint_every_s: float = 60.0

    @property
    def runs(self) -> list[Run]:
        return [r for p in self.phases for r in p.runs]


def load_queue(path: Path | None = None) -> list[Slice]:
    """The slices of ``tools/gpu/gpu_queue.yaml`` (or ``path``) in priority order (``order``)."""
    import yaml

    path = Path(path or QUEUE)
    doc = yaml.safe_load(path.read_text())
    defaults = doc.get("defaults") or {}
    slices = []
    for raw in doc["slices"]:
        get = lambda k, d=None, raw=raw: raw.get(k, defaults.get(k, d))  # noqa: E731
        phases = [
            Phase(
                name=p["name"],
                parallel=int(p.get("parallel", 1)),
                min_left_s=float(p.get("min_left_s", get("min_left_s", 45))),
                runs=[Run(r["id"], dict(r)) for r in p["runs"]],
            )
            for p in raw["phases"]
        ]
        slices.append(
            Slice(
                id=raw["id"],
                order=float(raw["order"]),
                title=" ".join(str(raw.get("title", "")).split()),
                gpu_minutes=float(raw["gpu_minutes"]),
                wheels=list(raw.get("wheels") or []),
                data=list(raw.get("data") or []),
                phases=phases,
                after=[list(map(str, c)) for c in raw.get("after") or []],
                auto=bool(raw.get("auto", True)),
                cpu=bool(raw.get("cpu", False)),
                work_s=float(get("work_s", 480)),
                grace_s=float(get("grace_s", 40)),
                checkpoint_every_s=float(get("checkpoint_every_s", 60)),
            )
        )
    ids = [s.id for s in slices]
    runs = [r.id for s in slices for r in s.runs]
    for what, names in (("slice", ids), ("run", runs)):
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"{path}: duplicate {what} ids {sorted(dup)}")
    return sorted(slices, key=lambda s: s.order)


def find_slice(slices: list[Slice], item: str) -> Slice:
    for s in slices:
        if s.id == item:
            return s
    raise SystemExit(f"no slice '{item}' in {QUEUE.name}: {', '.join(s.id for s in slices)}")
