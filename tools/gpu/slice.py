"""GPU slices: the repository's GPU work in pieces that each fit one device call (docs/cluster.md, 5).

A lent GPU machine runs ONE bash command per call (at most 10 minutes), sees only the working tree plus
up to 8 carried ignored paths (64 MiB in all), keeps nothing afterwards, and returns at most 8 files
(16 MiB each, 64 MiB together) through ``$OUT``. So the work is a queue of slices
(``tools/gpu/gpu_queue.yaml``), each one call:

    python -m tools.gpu list                        # the queue, each slice's GPU minutes and ledger status
    python -m tools.gpu carry [ITEM]                # here: gpu_carry/ (wheels, data, checkpoints) + the call
    bash tools/gpu_slice.sh [ITEM]                  # there: the one command of the device call
    python -m tools.gpu unpack FROM                 # here: verify, extract into results/, ledger, figures

(``make gpu-queue``, ``make gpu-carry ITEM=...``, ``make gpu-slice ITEM=...``, ``make gpu-unpack
FROM=...``.) Without ITEM the first slice (by ``order``) with no ``done`` row in ``docs/gpu_ledger.md``.

``run`` installs the slice's wheels that are not importable (``pip install --no-index --no-deps
--target``), decompresses the carried data, puts carried checkpoints in place, runs the slice's
phases (``parallel`` processes at once) until the work deadline (``--work-s``, default 480 s, env
``GPU_SLICE_WORK_S``), then sends SIGTERM: ``src/train.py`` finishes its step, writes its checkpoint
and exits 143; after ``grace_s`` what is left is killed. Then it packs into ``$OUT``: ``manifest.json``
(sha256 of every file and of every archive member; device, driver, torch, CUDA, cuDNN; each run's
status), ``slice.log``, ``results.tar.gz`` (every file the slice wrote under results/, checkpoints
excepted), ``checkpoints.tar`` (gzip'd ``checkpoint.pt`` of unfinished runs, in priority order while
the limits allow) and ``logs.tar.gz``; an archive over 15 MiB is split into ``.partNN`` files.

``unpack`` accepts only a manifest whose ``slice`` is a slice id of the queue (and whose ``stamp`` is a
time stamp), refusing (exit 2, nothing written) a damaged or malformed output; a run whose records
here have gone further than the output's is left as it is, the output's copy of it set aside in
``outputs/gpu_slices/<slice>/<stamp>/stale/``; the same output unpacked again adds no ledger row.
``run`` deletes its scratch folder (``GPU_SLICE_TMP``) only when it created it (it holds
``.gpu_slice_work``); another non-empty folder there is refused.

Every train run is started through ``exec`` (this file), which sets TF32 as the queue asks and
records what the process saw (device, torch, CUDA, cuDNN, TF32 and float32 matmul precision); the
run directory gets ``gpu_slice.json``, one segment per slice that ran it.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import gzip
import hashlib
import importlib.util
import json
import lzma
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
QUEUE = REPO / "tools" / "gpu" / "gpu_queue.yaml"
LEDGER = REPO / "docs" / "gpu_ledger.md"
CARRY = REPO / "gpu_carry"
CACHE = Path(os.environ.get("GPU_SLICE_CACHE", REPO / "outputs" / "gpu_carry_cache"))
WHEEL_DIRS = (REPO / "wheelhouse", REPO / "wheelhouse" / "gpu")

MIB = 2**20
TREE_LIMIT_MIB = 60.0  # refuse above this (the device tool's limit is 64 MiB)
OUT_MAX_FILES = 8
OUT_MAX_BYTES = 62 * MIB  # of the 64 MiB a call may return
PART_BYTES = 15 * MIB  # each returned file <= 16 MiB
FINAL = ("completed", "diverged")
# distribution -> the module that shows it is importable
MODULES = {
    "hydra-core": "hydra",
    "omegaconf": "omegaconf",
    "antlr4-python3-runtime": "antlr4",
    "galore-torch": "galore_torch",
    "fira": "fira",
    "apollo-torch": "apollo_torch",
    "wandb": "wandb",
    "datasets": "datasets",
    "dill": "dill",
    "multiprocess": "multiprocess",
}
# data folders whose loader also reads the uncompressed file (curvopt.data.mnist, curvopt.data.c4):
# their *.gz are carried as <stem>.xz (raw bytes, xz: 2 MB less for MNIST), decompressed there to <stem>
RAW_OK = ("mnist", "c4")
TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".md")
SKIP_PACK = ("run.lock", ".tmp")


# -- small helpers ---------------------------------------------------------------------------------


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


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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


# -- the queue -------------------------------------------------------------------------------------


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


# -- the ledger ------------------------------------------------------------------------------------

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
        raise SystemExit(f"every slice of {QUEUE.name} has a done row in {ledger}: nothing to do")
    return chosen


# -- sizes -----------------------------------------------------------------------------------------


def _git_files(root: Path, *args: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *args], capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def tree_bytes(root: Path = REPO) -> dict[str, int]:
    """What the device call sends besides the carried paths: tracked files, untracked files that git
    does not ignore, and shared/ (bytes)."""
    seen: set[str] = set()
    sizes = {}
    for key, args in (("tracked", ()), ("untracked", ("-o", "--exclude-standard"))):
        total = 0
        for rel in _git_files(root, *args):
            p = root / rel
            if rel in seen or not os.path.lexists(p):
                continue
            seen.add(rel)
            total += os.lstat(p).st_size
        sizes[key] = total
    shared = 0
    if (root / "shared").is_dir() and not (root / "shared").is_symlink():
        for p in (root / "shared").rglob("*"):
            rel = str(p.relative_to(root))
            if p.is_file() and rel not in seen:
                shared += p.stat().st_size
    sizes["shared"] = shared
    return sizes


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# -- carry (here) ----------------------------------------------------------------------------------


def _find_wheel(name: str, dirs: list[Path]) -> Path | None:
    want = canon(name).replace("-", "_")
    for d in dirs:
        for w in sorted(d.glob("*.whl")) if d.is_dir() else []:
            if canon(w.name.split("-")[0]).replace("-", "_") == want:
                return w
    return None


def carry_wheels(names: list[str], dest: Path, dirs: list[Path], fetch: bool, log: Log) -> list[str]:
    missing = [n for n in names if _find_wheel(n, dirs) is None]
    if missing and fetch:
        target = REPO / "wheelhouse" / "gpu"
        log(f"fetching {', '.join(missing)} into {target} (tools/gpu/wheelhouse.py --only)")
        done = subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "gpu" / "wheelhouse.py"),
                "--only",
                ",".join(missing),
                "--dest",
                str(target),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(
                f"tools/gpu/wheelhouse.py --only {','.join(missing)} failed:\n{done.stderr[-2000:]}"
            )
        dirs = [*dirs, target]
        missing = [n for n in names if _find_wheel(n, dirs) is None]
    if missing:
        raise SystemExit(
            f"no wheel of {', '.join(missing)} in {', '.join(map(str, dirs))}: run `make wheelhouse` "
            "(or drop --no-fetch)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for n in names:
        w = _find_wheel(n, dirs)
        assert w is not None
        shutil.copy2(w, dest / w.name)
        files.append(w.name)
    return files


def _cached(src: Path, key: str, make: Any) -> Path:
    """``make(src, out)`` once per (src, size, mtime); the result is kept in outputs/gpu_carry_cache."""
    st = src.stat()
    out = CACHE / key
    stamp = out.with_name(out.name + ".src")
    sig = f"{src.resolve()} {st.st_size} {st.st_mtime_ns}"
    if out.exists() and stamp.exists() and stamp.read_text() == sig:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    make(src, tmp)
    os.replace(tmp, out)
    stamp.write_text(sig)
    return out


def _xz(src: Path, out: Path, raw_gz: bool = False) -> None:
    data = gzip.decompress(src.read_bytes()) if raw_gz else src.read_bytes()
    out.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))


def carry_data(entries: list[str], data_dir: Path, dest: Path, log: Log) -> list[dict[str, Any]]:
    """Copy each data entry (folder or file under the data directory) into ``dest``; MNIST's *.gz as
    raw .xz, text files over 256 KiB as .xz (decompressed on the device)."""
    placed = []
    for entry in entries:
        src = data_dir / entry
        if not src.exists():
            raise SystemExit(f"data entry '{entry}' is not in {data_dir} (CURVOPT_DATA_DIR)")
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(data_dir)
            top = rel.parts[0]
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            if top in RAW_OK and f.suffix == ".gz":
                made = _cached(f, f"data/{rel.with_suffix('')}.xz", lambda s, o: _xz(s, o, raw_gz=True))
                out = out.with_suffix(".xz")
                shutil.copy2(made, out)
            elif f.suffix in TEXT_SUFFIXES and f.stat().st_size > 256 * 1024:
                made = _cached(f, f"data/{rel}.xz", _xz)
                out = out.with_name(out.name + ".xz")
                shutil.copy2(made, out)
            else:
                shutil.copy2(f, out)
            placed.append(
                {"source": str(rel), "file": str(out.relative_to(dest)), "bytes": out.stat().st_size}
            )
    log(f"data: {len(placed)} files, {mib(sum(p['bytes'] for p in placed))} ({', '.join(entries) or 'none'})")
    return placed


def _gzip_file(src: Path, out: Path) -> None:
    with open(src, "rb") as fi, gzip.open(out, "wb", compresslevel=6) as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)


def cmd_carry(args: argparse.Namespace) -> int:
    log = Log()
    sl = pick(args.item, Path(args.ledger))
    dest = Path(args.dest)
    results = Path(args.results)
    if dest.exists():
        if any(dest.iterdir()) and not (dest / "plan.json").exists():
            raise SystemExit(f"{dest} exists and is not a gpu_carry folder (no plan.json): not touching it")
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if dest.resolve().is_relative_to(REPO.resolve()):
        ignored = (
            subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", str(dest.resolve())]).returncode
            == 0
        )
        if not ignored:
            raise SystemExit(f"{dest} is not git-ignored: it would travel twice (add it to .gitignore)")
    log(f"slice {sl.id}: {sl.title}")
    wheels = carry_wheels(sl.wheels, dest / "wheels", [Path(d) for d in args.wheels_from], args.fetch, log)
    data_dir = Path(args.data_dir)
    data = carry_data(sl.data, data_dir, dest / "data", log)

    tree = tree_bytes(REPO)
    tree_total = sum(tree.values())
    limit = args.limit_mib * MIB
    base = tree_total + dir_bytes(dest)
    if base > limit:
        shutil.rmtree(dest)
        raise SystemExit(
            f"refused: the tree ({mib(tree_total)}) and the carry without checkpoints ({mib(base - tree_total)}) "
            f"already exceed {args.limit_mib:g} MiB"
        )
    # checkpoints of this slice's unfinished runs, in queue order while they fit
    ckpts, left, restart = [], [], []
    for run in sl.runs:
        if run.kind != "train":
            continue
        rdir = run.run_dir(results)
        ck = rdir / "checkpoint.pt"
        status = _status(rdir)
        if status in FINAL or status is None or not ck.exists():
            continue
        packed = _cached(ck, f"ckpt/{run.rel_dir()}/checkpoint.pt.gz", _gzip_file)
        size = packed.stat().st_size
        if base + size <= limit:
            (dest / "ckpt").mkdir(exist_ok=True)
            name = f"{len(ckpts):02d}_{run.id}.pt.gz"
            shutil.copy2(packed, dest / "ckpt" / name)
            entry = {"run": run.id, "path": f"{run.rel_dir()}/checkpoint.pt", "file": f"ckpt/{name}",
                     "sha256": sha256_file(ck), "bytes": ck.stat().st_size}  # fmt: skip
            side = ck.with_name("checkpoint.pt.sha256")
            if side.exists():  # the trainer's checksum file: it must describe this checkpoint
                shutil.copy2(side, dest / "ckpt" / f"{name}.sha256")
                entry["sidecar"] = f"ckpt/{name}.sha256"
            ckpts.append(entry)
            base += size
            log(f"checkpoint {run.id}: {mib(ck.stat().st_size)} ({mib(size)} gzip'd) carried")
        else:
            log(f"checkpoint {run.id}: {mib(size)} gzip'd does not fit ({mib(limit - base)} left)")
            (restart if args.restart_unfit else left).append(run.id)
    if left and not args.leave_behind:
        shutil.rmtree(dest)
        raise SystemExit(
            f"refused: the checkpoints of {', '.join(left)} do not fit under {args.limit_mib:g} MiB "
            f"(tree {mib(tree_total)}). Options: --leave-behind (those runs wait on the device: skipped), "
            "--restart-unfit (they start again from step 0), or make the tree smaller"
        )
    pending = [r for r in sl.runs if r.kind == "module" or _status(r.run_dir(results)) not in FINAL]
    if pending and all(r.id in left for r in pending):
        shutil.rmtree(dest)
        raise SystemExit(
            f"refused: every unfinished run of {sl.id} would be left behind: the call would do nothing"
        )
    plan = {
        "item": sl.id,
        "created": now_utc(),
        "wheels": wheels,
        "data": data,
        "checkpoints": ckpts,
        "left_behind": left,
        "restart": restart,
        "tree_bytes": tree,
        "limit_mib": args.limit_mib,
    }
    (dest / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    carry_total = dir_bytes(dest)
    plan["carry_bytes"] = carry_total
    (dest / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    total = tree_total + carry_total
    rel = (
        os.path.relpath(dest.resolve(), REPO) if dest.resolve().is_relative_to(REPO.resolve()) else str(dest)
    )
    print(
        f"\ntree: tracked {mib(tree['tracked'])} + untracked {mib(tree['untracked'])} + shared {mib(tree['shared'])}"
        f"\ncarry {rel}/: {mib(carry_total)} (wheels {mib(dir_bytes(dest / 'wheels'))}, data "
        f"{mib(dir_bytes(dest / 'data'))}, checkpoints {mib(dir_bytes(dest / 'ckpt'))})"
        f"\ntotal {mib(total)} of the {args.limit_mib:g} MiB this tool allows (the device's limit: 64 MiB)"
        f"\nestimated device time: {sl.gpu_minutes:g} min of the session's 15"
        "\n\ndevice call (the run tool):"
        f'\n  command: "bash tools/gpu_slice.sh {sl.id}"'
        f'\n  carry:   ["{rel}"]'
        "\n  timeout_s: 600"
        "\nthen, with the reply's files_at folder:"
        "\n  make gpu-unpack FROM=<files_at> GPU_MIN=<lease.held_s / 60>"
    )
    return 0


def _status(run_dir: Path) -> str | None:
    """experiments.runs.run_status without the packed-records fallback (no pandas)."""
    s = run_dir / "summary.json"
    if s.exists():
        try:
            return json.loads(s.read_text()).get("status")
        except json.JSONDecodeError:
            return "killed"
    return "killed" if run_dir.is_dir() and any(run_dir.iterdir()) else None


# -- run (on the device) ---------------------------------------------------------------------------


def install_wheels(names: list[str], wheel_dir: Path, site: Path, log: Log) -> list[str]:
    """pip install --no-index --no-deps the named wheels that are not importable; returns them."""
    todo = [
        n
        for n in names
        if importlib.util.find_spec(MODULES.get(canon(n), canon(n).replace("-", "_"))) is None
    ]
    if not todo:
        log(f"wheels: all importable ({', '.join(names) or 'none needed'})")
        return []
    if not wheel_dir.is_dir():
        raise SystemExit(
            f"{', '.join(todo)} not importable and no {wheel_dir}: carry gpu_carry (make gpu-carry)"
        )
    cmd = [
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), "--find-links", str(wheel_dir), *todo,
    ]  # fmt: skip
    log("pip install " + " ".join(todo))
    subprocess.run(cmd, check=True)
    sys.path.insert(0, str(site))
    return todo


def unpack_data(data_dir: Path, log: Log) -> None:
    n = 0
    for xz in sorted(data_dir.rglob("*.xz")):
        out = xz.with_suffix("")
        if not out.exists():
            out.write_bytes(lzma.decompress(xz.read_bytes()))
            n += 1
    if n:
        log(f"data: decompressed {n} .xz files in {data_dir}")


@dataclass
class Job:
    run: Run
    proc: subprocess.Popen | None = None
    start: float = 0.0
    end: float = 0.0
    action: str = ""  # new | resume | restart | kept | skipped | not-started | module
    code: int | None = None
    signalled: float | None = None
    killed: bool = False
    log_path: Path | None = None
    facts_path: Path | None = None
    steps_before: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Runner:
    def __init__(self, sl: Slice, args: argparse.Namespace, log: Log) -> None:
        self.sl, self.args, self.log = sl, args, log
        self.results = Path(args.results).resolve()
        self.work = Path(args.work).resolve()
        self.jobs: list[Job] = []
        self.stop_now = False
        self.plan: dict[str, Any] = {}

    # environment of every job
    def env(self, parallel: int) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(self.work / "site"), str(REPO / "src"), str(REPO)]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.update(
            PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        )  # fmt: skip
        env.setdefault("WANDB_MODE", "disabled")
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // max(1, parallel)))
        if self.sl.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def fill(self, text: str) -> str:
        return text.replace("{results}", str(self.results)).replace("{work}", str(self.work))

    def prepare(self, job: Job) -> list[str] | None:
        """The job's command, or None (kept / skipped: job.action says which)."""
        run, s = job.run, job.run.spec
        job.log_path = self.work / "logs" / f"{run.id}.log"
        if run.kind == "module":
            done = [p for pat in s.get("done_if", []) for p in glob.glob(str(REPO / pat))]
            if done and not self.args.force:
                job.action, job.info["reason"] = "kept", f"done already: {os.path.relpath(done[0], REPO)}"
                return None
            job.action = "module"
            return [sys.executable, "-m", s["module"], *(self.fill(str(a)) for a in s.get("args", []))]
        rdir = run.run_dir(self.results)
        status = _status(rdir)
        job.steps_before = _steps(rdir)
        extra: list[str] = []
        if status in FINAL:
            job.action, job.info["reason"] = "kept", f"{status} already"
            return None
        if run.id in self.plan.get("left_behind", []):
            job.action, job.info["reason"] = (
                "skipped",
                "its checkpoint was left behind (make gpu-carry: no room)",
            )
            return None
        if (
            status is not None
            and (rdir / "checkpoint.pt").exists()
            and run.id not in self.plan.get("restart", [])
        ):
            job.action, extra = "resume", ["trainer.resume=true"]
        elif status is not None:
            job.action, extra = "restart", ["trainer.restart=true"]
        else:
            job.action = "new"
        job.facts_path = self.work / "facts" / f"{run.id}.json"
        job.facts_path.parent.mkdir(parents=True, exist_ok=True)
        tf32 = s.get("tf32")
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "exec", "--facts", str(job.facts_path),
            "--tf32", "default" if tf32 is None else ("on" if tf32 else "off"), "--",
            str(REPO / "src" / "train.py"),
            *([f"experiment={run.config_name}"] if run.config_name else []),
            f"optimizer={s['optimizer']}", f"seed={int(s.get('seed', 0))}", f"run_id={run.run_id}",
            f"paths.results_dir={rdir.parent.parent}", f"hydra.run.dir={self.work}/hydra/{run.id}",
            "logger=none", "trainer.progress=false",
            *([f"trainer.checkpoint_every_s={self.sl.checkpoint_every_s:g}"] if s.get("checkpoint") else []),
            *map(str, s.get("overrides", [])), *extra,
        ]  # fmt: skip
        return cmd

    def start(self, job: Job, parallel: int) -> None:
        cmd = self.prepare(job)
        if cmd is None:
            self.log(f"{job.run.id}: {job.action} ({job.info.get('reason', '')})")
            return
        assert job.log_path is not None
        job.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"{job.run.id}: {job.action}: " + " ".join(c.replace(str(REPO) + "/", "") for c in cmd[1:]))
        with open(job.log_path, "w") as out:
            job.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=self.env(parallel),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        job.start = time.time()

    def signal_job(self, job: Job, sig: int) -> None:
        if job.proc is None or job.proc.poll() is not None:
            return
        try:
            if sig == signal.SIGKILL or job.run.kind == "module":
                os.killpg(job.proc.pid, sig)
            else:  # train: the process itself, once (a second SIGTERM would skip the checkpoint)
                job.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def run(self, deadline: float) -> None:
        grace = self.sl.grace_s
        for phase in self.sl.phases:
            pending = [Job(r) for r in phase.runs]
            self.jobs += pending
            running: list[Job] = []
            while pending or running:
                now = time.time()
                if self.stop_now:
                    deadline = min(deadline, now)
                while pending and len(running) < phase.parallel:
                    if deadline - now < phase.min_left_s:
                        for j in pending:
                            j.action = j.action or "not-started"
                            j.info["reason"] = f"less than {phase.min_left_s:g} s of work left"
                        self.log(f"phase {phase.name}: {len(pending)} runs not started (deadline)")
                        pending = []
                        break
                    job = pending.pop(0)
                    self.start(job, phase.parallel)
                    if job.proc is not None:
                        running.append(job)
                for job in list(running):
                    timeout = job.run.spec.get("timeout_s")
                    if job.proc.poll() is not None:
                        job.code, job.end = job.proc.returncode, time.time()
                        running.remove(job)
                        self.log(f"{job.run.id}: exit {job.code} after {job.end - job.start:.0f} s")
                        continue
                    over = now >= deadline or (timeout and now - job.start >= float(timeout))
                    if over and job.signalled is None:
                        self.log(f"{job.run.id}: SIGTERM ({'deadline' if now >= deadline else 'timeout'})")
                        self.signal_job(job, signal.SIGTERM)
                        job.signalled = now
                    elif job.signalled is not None and now - job.signalled >= grace and not job.killed:
                        self.log(f"{job.run.id}: SIGKILL ({grace:g} s after SIGTERM)")
                        self.signal_job(job, signal.SIGKILL)
                        job.killed = True
                time.sleep(0.2)
            if time.time() >= deadline and phase is not self.sl.phases[-1]:
                rest = self.sl.phases[self.sl.phases.index(phase) + 1 :]
                for p in rest:
                    for r in p.runs:
                        self.jobs.append(Job(r, action="not-started", info={"reason": "deadline"}))
                self.log(f"deadline: phases {', '.join(p.name for p in rest)} not started")
                break


def _steps(run_dir: Path) -> int | None:
    s = run_dir / "summary.json"
    try:
        return int(json.loads(s.read_text()).get("steps")) if s.exists() else None
    except (ValueError, TypeError, json.JSONDecodeError):
        return None


def device_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    try:
        import torch

        facts.update(
            torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available()
        )
        facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            facts.update(
                device_name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                multiprocessors=p.multi_processor_count, device_count=torch.cuda.device_count(),
            )  # fmt: skip
        else:
            facts["device_name"] = (
                f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
            )
    except ImportError:
        facts["torch"] = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        if out.returncode == 0:
            facts["nvidia_smi"] = out.stdout.strip()
            facts["driver"] = out.stdout.split(",")[1].strip() if "," in out.stdout else None
    except (OSError, subprocess.SubprocessError):
        pass
    return facts


def run_record(job: Job, results: Path, sl: Slice, overlap: list[str]) -> dict[str, Any]:
    run = job.run
    rec: dict[str, Any] = {
        "id": run.id, "kind": run.kind, "action": job.action, "exit_code": job.code,
        "seconds": round(job.end - job.start, 1) if job.start and job.end else None,
        "sigterm": job.signalled is not None, "sigkill": job.killed, "concurrent_with": overlap, **job.info,
    }  # fmt: skip
    if run.kind == "module":
        rec["command"] = f"python -m {run.spec['module']} " + " ".join(map(str, run.spec.get("args", [])))
        ok = job.code in run.spec.get("ok_codes", [0])
        # a module that the work deadline stopped did not fail: it ran out of slice ("stopped")
        bad = "stopped" if job.signalled is not None else "failed"
        rec["status"] = (
            "kept" if job.action == "kept" else ("ok" if ok else job.action if job.code is None else bad)
        )
        return rec
    rdir = run.run_dir(results)
    rec["run_dir"] = run.rel_dir()
    facts = json.loads(job.facts_path.read_text()) if job.facts_path and job.facts_path.exists() else {}
    summary = json.loads((rdir / "summary.json").read_text()) if (rdir / "summary.json").exists() else {}
    rec.update(
        status=summary.get("status", job.action if job.action in ("kept", "skipped", "not-started") else "no-summary"),
        stop_reason=summary.get("stop_reason"), steps_before=job.steps_before, steps=summary.get("steps"),
        checkpoint_step=summary.get("checkpoint_step"), dtype=summary.get("dtype"), tf32=run.spec.get("tf32"),
    )  # fmt: skip
    if job.action == "kept":
        rec["status"] = summary.get("status", "kept")
    rows = _metric_rows(rdir / "metrics.jsonl") if job.proc is not None else []
    times = [r["step_time_s"] for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    if times:
        inner = [r["inner_iters"] for r in rows if isinstance(r.get("inner_iters"), (int, float))]
        solve = [r.get("cg_time", r.get("lsmr_time")) for r in rows if "inner_iters" in r]
        per = [t / n for t, n in zip(solve, inner) if isinstance(t, (int, float)) and n]
        rec["step_time_s_median"] = _median(times)
        rec["inner_iters_median"] = _median(inner) if inner else None
        rec["inner_iter_ms_median"] = round(1e3 * _median(per), 3) if per else None
        rec["steps_timed"] = len(times)
    if job.proc is not None and rdir.is_dir():
        segment = {
            "slice": sl.id, "run": run.id, "started": _iso(job.start), "ended": _iso(job.end),
            "action": job.action, "exit_code": job.code, "steps_before": job.steps_before,
            "steps_after": summary.get("steps"), "status": summary.get("status"), "dtype": summary.get("dtype"),
            "tf32_requested": run.spec.get("tf32"), "concurrent_with": overlap, **facts,
        }  # fmt: skip
        side = rdir / "gpu_slice.json"
        old = json.loads(side.read_text()) if side.exists() else {"segments": []}
        old["segments"].append(segment)
        side.write_text(json.dumps(old, indent=2) + "\n")
        rec["facts"] = facts
    return rec


def _metric_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _iso(t: float) -> str | None:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if t else None


def slice_status(records: list[dict[str, Any]]) -> str:
    good = ("completed", "diverged", "ok", "kept")
    if all(r["status"] in good for r in records):
        return "done"
    progressed = any(
        (r["status"] in good and r["action"] != "kept")
        or (r.get("steps") or 0) > (r.get("steps_before") or 0)
        for r in records
    )
    return "partial" if progressed else "failed"


def report_md(man: dict[str, Any]) -> str:
    d = man["device"]
    lines = [
        f"# GPU slice {man['slice']} — {man['status']}",
        "",
        f"{man['title']}",
        "",
        f"Device: {d.get('device_name')} (driver {d.get('driver')}), torch {d.get('torch')}, CUDA {d.get('cuda')}, "
        f"cuDNN {d.get('cudnn')}; {man['started']} to {man['ended']}, {man['elapsed_s']:.0f} s "
        f"(work deadline {man['work_s']:g} s{', reached' if man['deadline_hit'] else ''}); commit {man.get('git_commit')}.",
        "",
        "| run | action | status | steps | step time (median) | inner iteration | dtype | TF32 | ran with |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in man["runs"]:
        steps = r.get("steps")
        if r.get("steps_before") is not None and steps is not None:
            steps = f"{r['steps_before']} → {steps}"
        st = r.get("step_time_s_median")
        it = r.get("inner_iter_ms_median")
        lines.append(
            f"| {r['id']} | {r['action']} | {r['status']} | {steps if steps is not None else '–'} "
            f"| {f'{st * 1e3:.1f} ms' if st is not None else '–'} | {f'{it:.2f} ms' if it is not None else '–'} "
            f"| {r.get('dtype') or '–'} | {_tf32(r)} "
            f"| {', '.join(r.get('concurrent_with') or []) or '–'} |"
        )
    if man.get("checkpoints_left_out"):
        lines += ["", "Checkpoints not returned (OUT limits): " + ", ".join(man["checkpoints_left_out"])]
    return "\n".join(lines) + "\n"


def _tf32(r: dict[str, Any]) -> str:
    if r["kind"] == "module":
        return "–"
    return {None: "torch default", True: "on", False: "off"}.get(r.get("tf32"), str(r.get("tf32")))


# -- packing ---------------------------------------------------------------------------------------


def _split(path: Path, out_dir: Path) -> list[Path]:
    """``path`` into ``out_dir`` as one file, or as ``<name>.partNN`` pieces of PART_BYTES."""
    size = path.stat().st_size
    if size <= PART_BYTES:
        dest = out_dir / path.name
        shutil.move(str(path), dest)
        return [dest]
    parts = []
    with open(path, "rb") as fh:
        i = 0
        while block := fh.read(PART_BYTES):
            dest = out_dir / f"{path.name}.part{i:02d}"
            dest.write_bytes(block)
            parts.append(dest)
            i += 1
    path.unlink()
    return parts


def _tar(members: list[tuple[Path, str]], path: Path, compress: bool) -> dict[str, dict[str, Any]]:
    listing = {}
    with tarfile.open(path, "w:gz", compresslevel=6) if compress else tarfile.open(path, "w") as tar:
        for src, arc in members:
            info = tar.gettarinfo(str(src), arcname=arc)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(src, "rb") as fh:
                tar.addfile(info, fh)
            listing[arc] = {"sha256": sha256_file(src), "bytes": src.stat().st_size}
    return listing


def snapshot(results: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under ``results``: what the slice found there."""
    if not results.exists():
        return {}
    return {
        str(p): (st.st_size, st.st_mtime_ns) for p in results.rglob("*") if p.is_file() for st in [p.stat()]
    }


def _written(p: Path, before: dict[str, tuple[int, int]]) -> bool:
    st = p.stat()
    return before.get(str(p)) != (st.st_size, st.st_mtime_ns)


def pack(
    runner: Runner, out: Path, before: dict[str, tuple[int, int]], man: dict[str, Any], log: Log
) -> dict[str, Any]:
    """Write the slice's records, checkpoints and logs into ``out`` within the device's limits.
    ``before``: :func:`snapshot` of results/ at the start; new or changed files are the slice's."""
    out.mkdir(parents=True, exist_ok=True)
    stage = runner.work / "pack"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    results = runner.results
    # 1. records: every file the slice wrote under results/, no checkpoints, locks, smoke run dirs
    members = []
    for p in sorted(results.rglob("*")):
        rel = p.relative_to(results)
        if (
            not p.is_file()
            or not _written(p, before)
            or p.suffix in (".pt", ".ckpt", ".tmp")
            or p.name.endswith(".pt.sha256")  # travels with its checkpoint (below), or not at all
            or p.name in SKIP_PACK
            or "wandb" in rel.parts
            or fnmatch.fnmatch(str(rel), "gpu_smoke/*/runs/*")
        ):
            continue
        members.append((p, "results/" + str(rel)))
    archives: dict[str, Any] = {}
    files: list[Path] = []
    rec_tar = stage / "results.tar.gz"
    archives["results"] = {"members": _tar(members, rec_tar, compress=True)}
    parts = _split(rec_tar, out)
    archives["results"]["parts"] = [p.name for p in parts]
    files += parts
    # 2. logs (each run's log, its last MiB)
    logs = []
    for job in runner.jobs:
        if job.log_path and job.log_path.exists():
            src = job.log_path
            if src.stat().st_size > MIB:
                cut = stage / "cut" / src.name
                cut.parent.mkdir(exist_ok=True)
                with open(src, "rb") as fh:
                    fh.seek(-MIB, os.SEEK_END)
                    cut.write_bytes(b"[... cut ...]\n" + fh.read())
                src = cut
            logs.append((src, f"logs/{job.run.id}.log"))
    log_tar = stage / "logs.tar.gz"
    archives["logs"] = {"members": _tar(logs, log_tar, compress=True)}
    parts = _split(log_tar, out)
    archives["logs"]["parts"] = [p.name for p in parts]
    files += parts
    # 3. checkpoints of unfinished runs written by this slice, in queue order, while they fit
    room = OUT_MAX_BYTES - sum(f.stat().st_size for f in files) - 4 * MIB  # manifest + slice.log
    slots = OUT_MAX_FILES - len(files) - 2
    chosen, left = [], []
    for job in runner.jobs:
        if job.run.kind != "train" or job.proc is None:
            continue
        rdir = job.run.run_dir(results)
        ck = rdir / "checkpoint.pt"
        if not ck.exists() or not _written(ck, before) or _status(rdir) in FINAL:
            continue
        gz = stage / "ckpt" / f"{job.run.id}.pt.gz"
        gz.parent.mkdir(exist_ok=True)
        _gzip_file(ck, gz)
        size = gz.stat().st_size
        total = sum(g.stat().st_size for g, _, _ in chosen) + size
        if total <= room and -(-total // PART_BYTES) <= slots:
            chosen.append((gz, ck, job.run))
        else:
            left.append(job.run.id)
            gz.unlink()
    man["checkpoints_left_out"] = left
    if chosen:
        tar_path = stage / "checkpoints.tar"
        items = []
        for gz, ck, _ in chosen:
            items.append((gz, f"results/{ck.relative_to(results)}.gz"))
            side = ck.with_name(ck.name + ".sha256")  # the trainer's checksum file, when it writes one
            if side.exists():
                items.append((side, f"results/{side.relative_to(results)}"))
        listing = _tar(items, tar_path, False)
        for _gz, ck, run in chosen:
            arc = f"results/{ck.relative_to(results)}.gz"
            listing[arc].update(raw_sha256=sha256_file(ck), raw_bytes=ck.stat().st_size, run=run.id)
        parts = _split(tar_path, out)
        archives["checkpoints"] = {"members": listing, "parts": [p.name for p in parts]}
        files += parts
    for run_id in left:
        log(f"checkpoint of {run_id} not returned: over the OUT limits")
    man["archives"] = archives
    return {"files": files}


WORK_MARK = ".gpu_slice_work"  # in a work folder the slice created: the only kind it deletes


def prepare_work(work: Path) -> None:
    """Empty the scratch folder ``work`` (``GPU_SLICE_TMP``) for a new slice, or create it.

    Only a folder this script created (it holds :data:`WORK_MARK`) is deleted; an existing folder
    without the mark is used only when it is empty, else refused: ``GPU_SLICE_TMP`` set to a
    folder of one's own by mistake must not lose its contents.
    """
    if work.is_symlink() or (work.exists() and not work.is_dir()):
        raise Refused(f"refused: GPU_SLICE_TMP={work} is not a folder; point it at a new or empty folder")
    if work.exists():
        if (work / WORK_MARK).is_file():
            shutil.rmtree(work)
        elif any(work.iterdir()):
            raise Refused(
                f"refused: GPU_SLICE_TMP={work} is a folder this script did not create and it is not empty; "
                "nothing was deleted. Point GPU_SLICE_TMP at a new or empty folder (default /tmp/gpu_slice)"
            )
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARK).write_text("scratch of python -m tools.gpu run: deleted by the next slice\n")


def cmd_run(args: argparse.Namespace) -> int:
    t_start = time.time()
    work = Path(args.work)
    carry = Path(args.carry)
    plan = json.loads((carry / "plan.json").read_text()) if (carry / "plan.json").exists() else {}
    item = args.item or os.environ.get("GPU_SLICE_ITEM") or plan.get("item")
    try:
        sl = pick(item, Path(args.ledger))  # an unknown ITEM stops here, before anything is touched
        prepare_work(work)
    except SystemExit as err:  # Refused too: a message that names what to do
        if not isinstance(err.code, str):
            raise
        print(err.code, file=sys.stderr)
        return 2
    log = Log(work / "slice.log")
    if plan and plan.get("item") != sl.id:
        log(f"WARNING: {carry}/ was made for {plan.get('item')}, not {sl.id}: its data may be missing")
        plan = {}
    out = Path(args.out or os.environ.get("OUT") or REPO / "outputs" / "gpu_slice_out")
    if out.exists() and any(out.iterdir()) and not args.out_overwrite:
        raise SystemExit(f"{out} is not empty")
    work_s = float(args.work_s or os.environ.get("GPU_SLICE_WORK_S") or sl.work_s)
    log(
        f"slice {sl.id} ({sl.title}); work deadline {work_s:g} s, grace {sl.grace_s:g} s; results {args.results}"
    )
    if not sl.cpu and not args.allow_cpu:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            raise SystemExit(f"no CUDA device visible: slice {sl.id} is GPU work (only cpu slices run here)")
    install_wheels(sl.wheels, carry / "wheels", work / "site", log)
    data = carry / "data"
    if data.is_dir():
        unpack_data(data, log)
        os.environ["CURVOPT_DATA_DIR"] = str(data.resolve())
    log(f"data directory: {os.environ.get('CURVOPT_DATA_DIR', '(default)')}")
    if sl.cpu and args.results == str(REPO / "results"):  # a CPU self-test never writes the tracked records
        args.results = str(REPO / "outputs" / "gpu_slice_cpu" / "results")
    results = Path(args.results)
    for ck in plan.get("checkpoints", []):
        dest = results / Path(ck["path"]).relative_to("results")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(carry / ck["file"], "rb") as fi, open(dest, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
        if sha256_file(dest) != ck["sha256"]:
            dest.unlink()
            raise SystemExit(f"carried checkpoint {ck['file']} does not match its sha256: not used")
        if ck.get("sidecar"):
            shutil.copy2(carry / ck["sidecar"], dest.with_name("checkpoint.pt.sha256"))
        log(f"checkpoint in place: {ck['path']}")
    before = snapshot(results.resolve())
    t0 = time.time()
    deadline = t0 + work_s
    runner = Runner(sl, args, log)
    runner.plan = plan

    def stop(signum: int, frame: Any) -> None:
        del frame
        log(f"signal {signum}: stopping the runs, then packing")
        runner.stop_now = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        runner.run(deadline)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    t_end = time.time()
    spans = {j.run.id: (j.start, j.end or t_end) for j in runner.jobs if j.proc is not None}
    records = []
    for job in runner.jobs:
        if job.proc is not None and not job.end:
            job.end = t_end
        a = spans.get(job.run.id)
        overlap = [k for k, b in spans.items() if a and k != job.run.id and b[0] < a[1] and a[0] < b[1]]
        records.append(run_record(job, runner.results, sl, overlap))
    man: dict[str, Any] = {
        "format": 1,
        "slice": sl.id,
        "title": sl.title,
        "started": _iso(t_start),
        "ended": None,
        "work_s": work_s,
        "deadline_hit": t_end >= deadline - 0.5 or runner.stop_now,
        "device": device_facts(),
        "git_commit": _git_commit(),
        "runs": records,
    }
    man["status"] = slice_status(records)
    stamp = datetime.fromtimestamp(t_start, timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    man["stamp"] = stamp
    rep = runner.results / "gpu_slices" / sl.id
    rep.mkdir(parents=True, exist_ok=True)
    man["ended"] = now_utc()
    man["elapsed_s"] = round(time.time() - t_start, 1)
    (rep / f"{stamp}.md").write_text(report_md(man))
    (rep / f"{stamp}.json").write_text(
        json.dumps({k: v for k, v in man.items() if k != "archives"}, indent=2) + "\n"
    )
    packed = pack(runner, out, before, man, log)
    log(f"slice {sl.id}: {man['status']}; {len(records)} runs; packing into {out}")
    log_copy = out / "slice.log"
    shutil.copy2(work / "slice.log", log_copy)
    if log_copy.stat().st_size > 2 * MIB:
        data_ = log_copy.read_bytes()[-2 * MIB :]
        log_copy.write_bytes(b"[... cut ...]\n" + data_)
    man["elapsed_s"] = round(time.time() - t_start, 1)
    man["files"] = {
        f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size} for f in [*packed["files"], log_copy]
    }
    (out / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")
    names = sorted(p.name for p in out.iterdir())
    total = sum(p.stat().st_size for p in out.iterdir())
    print(report_md(man))
    print(f"$OUT ({out}): {len(names)} files, {mib(total)}: {', '.join(names)}")
    if len(names) > OUT_MAX_FILES or total > 64 * MIB:
        print("WARNING: over the device's return limits", file=sys.stderr)
    print(f"elapsed {man['elapsed_s']:.0f} s; next here: make gpu-unpack FROM=<files_at>")
    return 0


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or None
    except OSError:
        return None


# -- exec: one train run with TF32 set and its facts recorded ----------------------------------------


def cmd_exec(argv: list[str]) -> None:
    facts_path, tf32 = None, "default"
    while argv and argv[0] != "--":
        key, value, argv = argv[0], argv[1], argv[2:]
        if key == "--facts":
            facts_path = Path(value)
        elif key == "--tf32":
            tf32 = value
    script, rest = argv[1], argv[2:]
    import runpy

    import torch

    if tf32 in ("on", "off"):
        torch.set_float32_matmul_precision("high" if tf32 == "on" else "highest")
        torch.backends.cudnn.allow_tf32 = tf32 == "on"
    sys.argv = [script, *rest]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if facts_path is not None:
            facts_path.write_text(json.dumps(process_facts(torch, tf32), indent=2))


def process_facts(torch: Any, tf32: str) -> dict[str, Any]:
    f: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "tf32_setting": tf32}
    f["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    for key, get in (
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("tf32_matmul", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("tf32_cudnn", lambda: torch.backends.cudnn.allow_tf32),
    ):
        try:
            f[key] = get()
        except Exception as err:  # noqa: BLE001 - torch versions differ in what they allow
            f[key] = f"unreadable: {err}"
    f["NVIDIA_TF32_OVERRIDE"] = os.environ.get("NVIDIA_TF32_OVERRIDE")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        f["device_name"] = torch.cuda.get_device_name()
        f["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
    else:
        f["device_name"] = "cpu"
    return f


# -- unpack (here) ---------------------------------------------------------------------------------


class Refused(SystemExit):
    pass


def _safe(name: str, prefixes: tuple[str, ...]) -> bool:
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts and name.startswith(prefixes)


STAMP = re.compile(r"\d{8}T\d{6}Z")


def _safe_file_name(name: Any) -> bool:
    """A file of ``$OUT``: a plain name (no folder, no leading dot)."""
    return isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name) is not None


def read_manifest(path: Path) -> dict[str, Any]:
    """A slice output's ``manifest.json``: ``files`` and ``archives`` in the shape :func:`pack` writes.

    Raises:
        Refused: Naming the file and what is wrong with it (not JSON, a truncated transfer).
    """
    try:
        man = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise Refused(
            f"refused: {path} is not valid JSON ({type(err).__name__}: {first}): a truncated or damaged "
            "transfer; fetch the slice's output again (files_fetch), nothing was written"
        ) from None
    try:
        if not isinstance(man, dict):
            raise TypeError("not a JSON object")
        for meta in man["files"].values():
            int(meta["bytes"]), str(meta["sha256"])
        for arch in man.get("archives", {}).values():
            list(arch["parts"]), dict(arch["members"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise Refused(
            f"refused: {path} is not a slice manifest (missing or malformed {err}); fetch the slice's "
            "output again, nothing was written"
        ) from None
    return man


def check_identity(man: dict[str, Any], path: Path, queue: list[Slice] | None = None) -> None:
    """The manifest's ``slice`` is a slice id of the queue and its ``stamp`` a time stamp.

    Both name the logs folder (``outputs/gpu_slices/<slice>/<stamp>/``) and the ledger row: a
    ``..`` or an absolute path there would write outside the repository.

    Raises:
        Refused: Naming the value and the rule.
    """
    slices = queue if queue is not None else load_queue()
    ids = [s.id for s in slices]
    if not isinstance(man.get("slice"), str) or man["slice"] not in ids:
        raise Refused(
            f"refused: {path} names slice {man.get('slice')!r}, which is not a slice of {QUEUE.name} "
            f"({', '.join(ids)}); nothing was written"
        )
    if not isinstance(man.get("stamp", "run"), str) or not (
        man.get("stamp", "run") == "run" or STAMP.fullmatch(man["stamp"])
    ):
        raise Refused(
            f"refused: {path} has stamp {man.get('stamp')!r}, not a time stamp like 20260101T000000Z; "
            "nothing was written"
        )


def verify_and_stage(src: Path, stage: Path) -> dict[str, Any]:
    """Check every file's and every member's sha256 against manifest.json and extract the archives
    into ``stage``; raises Refused on the first mismatch (nothing is written outside ``stage``)."""
    mpath = src / "manifest.json"
    if not mpath.exists():
        raise Refused(f"refused: no manifest.json in {src}")
    man = read_manifest(mpath)
    for name, meta in man["files"].items():
        f = src / name
        if not _safe_file_name(name):
            raise Refused(f"refused: manifest.json lists {name!r}, not a file name of a slice output")
        if not f.is_file():
            raise Refused(f"refused: {name} is missing from {src}")
        if f.stat().st_size != meta["bytes"] or sha256_file(f) != meta["sha256"]:
            raise Refused(f"refused: {name} does not match its sha256 in manifest.json (damaged or changed)")
    prefixes = {"results": ("results/",), "checkpoints": ("results/",), "logs": ("logs/",)}
    for key, arch in man.get("archives", {}).items():
        joined = stage / f"{key}.archive"
        with open(joined, "wb") as fo:
            for part in arch["parts"]:
                if part not in man.get("files", {}):
                    raise Refused(f"refused: {part} is not listed in manifest.json's files")
                with open(src / part, "rb") as fi:
                    shutil.copyfileobj(fi, fo)
        want = arch["members"]
        seen = set()
        with tarfile.open(joined, "r:*") as tar:
            for m in tar:
                if not m.isfile() or not _safe(m.name, prefixes[key]) or m.name not in want:
                    raise Refused(f"refused: unexpected member {m.name!r} in the {key} archive")
                data = tar.extractfile(m).read()  # type: ignore[union-attr]
                if hashlib.sha256(data).hexdigest() != want[m.name]["sha256"]:
                    raise Refused(f"refused: {m.name} does not match its sha256 in manifest.json")
                dest = stage / key / m.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
                seen.add(m.name)
        if seen != set(want):
            raise Refused(f"refused: the {key} archive lacks {sorted(set(want) - seen)[:5]}")
        joined.unlink()
    return man


def _run_progress(run_dir: Path) -> int | None:
    """How far the run in ``run_dir`` has gone: its last logged step, or its summary's steps."""
    steps: list[int] = []
    for name in ("metrics.jsonl", "metrics.jsonl.gz"):
        path = run_dir / name
        if not path.is_file():
            continue
        try:
            text = gzip.decompress(path.read_bytes()).decode() if name.endswith(".gz") else path.read_text()
        except (OSError, ValueError, EOFError):
            continue
        for line in text.splitlines():
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                steps.append(step)
        break
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        steps += [v for k in ("steps", "checkpoint_step") if isinstance(v := summary.get(k), int)]
    except (OSError, ValueError, AttributeError):
        pass
    packed = _packed_entry(run_dir)
    if packed is not None:
        steps += [v for k in ("steps",) if isinstance(v := (packed.get("summary") or {}).get(k), int)]
    return max(steps) if steps else None


def _packed_entry(run_dir: Path) -> dict[str, Any] | None:
    """The run's line in its experiment's ``runs.jsonl[.gz]`` (curvopt.analysis.pack), if packed."""
    for name in ("runs.jsonl", "runs.jsonl.gz"):
        path = run_dir.parent / name
        if not path.is_file():
            continue
        try:
            text = gzip.decompress(path.read_bytes()).decode() if name.endswith(".gz") else path.read_text()
            for line in text.splitlines():
                if line.strip() and (entry := json.loads(line)).get("run_id") == run_dir.name:
                    return entry
        except (OSError, ValueError, EOFError, AttributeError):
            return None
    return None


RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoint.pt.gz", "checkpoint.pt")


def stale_runs(stage: Path, root: Path) -> dict[str, tuple[int | None, int]]:
    """Run folders of the staged output that are behind the same runs under ``root``.

    A slice output unpacked after the run went further here (a later slice, a resume on the CPU)
    would put its metrics, summary and checkpoint back to where the slice left them.

    Returns:
        ``results/<...>/<run_id>`` -> (the output's step, the step already here), for each run
        whose records here have gone further than the output's.
    """
    incoming: dict[str, Path] = {}
    for key in ("results", "checkpoints"):
        base = stage / key
        for f in base.rglob("*") if base.exists() else []:
            if f.is_file() and f.name in RUN_FILES:
                rel = str(f.parent.relative_to(base))
                incoming.setdefault(rel, stage / "results" / rel)
    stale = {}
    for rel, staged in sorted(incoming.items()):
        here = _run_progress(root / rel)
        if here is None:
            continue
        theirs = _run_progress(staged)
        if theirs is None or here > theirs:
            stale[rel] = (theirs, here)
    return stale


def _under(arc: str, run_rels: set[str]) -> bool:
    return any(arc.startswith(rel + "/") for rel in run_rels)


def cmd_unpack(args: argparse.Namespace) -> int:
    src = Path(args.src)
    root = Path(args.root).resolve()
    with tempfile.TemporaryDirectory(prefix="gpu_unpack_") as tmp:
        stage = Path(tmp)
        try:
            man = verify_and_stage(src, stage)
            check_identity(man, src / "manifest.json")
        except Refused as err:
            print(err, file=sys.stderr)
            return 2
        logs_dir = root / "outputs" / "gpu_slices" / man["slice"] / man.get("stamp", "run")
        # runs that went further here since the slice ran keep their records; the output's go aside
        stale = stale_runs(stage, root)
        aside = logs_dir / "stale"
        for rel, (theirs, here) in stale.items():
            print(
                f"  {rel}: the output stops at step {theirs}, the run here is at step {here}: kept as it is; "
                f"the output's files of it are set aside in {aside / rel}",
                file=sys.stderr,
            )
        stale_rels = set(stale)

        def dest_of(arc: str) -> Path:
            return (aside if _under(arc, stale_rels) else root) / arc

        written = 0
        for f in sorted((stage / "results").rglob("*")) if (stage / "results").exists() else []:
            if f.is_file():
                arc = str(f.relative_to(stage / "results"))
                dest = dest_of(arc)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest)
                written += dest.is_relative_to(root / "results")
        members = man.get("archives", {}).get("checkpoints", {}).get("members", {})
        ck_meta = {a: m for a, m in members.items() if a.endswith(".gz")}
        for arc in set(members) - set(ck_meta):  # checksum files beside the checkpoints
            dest = dest_of(arc)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(stage / "checkpoints" / arc, dest)
        for arc, meta in ck_meta.items():
            gz = stage / "checkpoints" / arc
            dest = dest_of(arc[: -len(".gz")])
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp_ck = dest.with_suffix(".unpack")
            with gzip.open(gz, "rb") as fi, open(tmp_ck, "wb") as fo:
                shutil.copyfileobj(fi, fo, 1 << 20)
            if sha256_file(tmp_ck) != meta["raw_sha256"]:
                tmp_ck.unlink()
                print(
                    f"refused: {arc} decompresses to a file that does not match its sha256", file=sys.stderr
                )
                return 2
            os.replace(tmp_ck, dest)
        if (stage / "logs" / "logs").exists():
            shutil.copytree(stage / "logs" / "logs", logs_dir / "logs", dirs_exist_ok=True)
        logs_dir.mkdir(parents=True, exist_ok=True)
        for name in ("slice.log", "manifest.json"):
            if (src / name).exists():
                shutil.copy2(src / name, logs_dir / name)
    runs = man.get("runs", [])
    left = man.get("checkpoints_left_out", [])
    n_ck = sum(1 for a in ck_meta if not _under(a[: -len(".gz")], stale_rels))
    print(f"unpacked {written} record files and {n_ck} checkpoints into {root}/results; logs: {logs_dir}")
    if stale:
        print(
            f"{len(stale)} runs of this output were behind the records here and were not unpacked "
            f"(set aside in {aside})",
            file=sys.stderr,
        )
    for r in runs:
        if r["kind"] == "train" and r["status"] not in FINAL + ("kept", "skipped", "not-started"):
            note = (
                " (its checkpoint did not come back: the next slice restarts it)" if r["id"] in left else ""
            )
            print(f"  {r['id']}: {r['status']} at step {r.get('steps')}{note}")
    d = man.get("device", {})
    minutes = args.gpu_minutes if args.gpu_minutes is not None else man.get("elapsed_s", 0) / 60
    counts: dict[str, int] = {}
    for r in runs:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    report = f"results/gpu_slices/{man['slice']}/{man.get('stamp')}.md"
    produced = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + (
        f"; checkpoints returned {len(ck_meta)}" + (f", left out {len(left)}" if left else "")
    )
    produced += f"; {report}"
    ledger = Path(args.ledger) if Path(args.ledger).is_absolute() else root / args.ledger
    if any(r["slice"] == man["slice"] and report in r["produced"] for r in read_ledger(ledger)):
        print(
            f"ledger: {man['slice']} {man.get('stamp')} is in {ledger} already (unpacked before): no new row"
        )
    else:
        append_ledger(
            ledger,
            {
                "slice": man["slice"],
                "status": str(man.get("status")),
                "date": (man.get("ended") or now_utc())[:16].replace("T", " "),
                "gpu_min": f"{minutes:.1f}" + ("" if args.gpu_minutes is not None else " (command)"),
                "device": f"{d.get('device_name')}, torch {d.get('torch')}, CUDA {d.get('cuda')}",
                "produced": produced,
            },
        )
        print(f"ledger: {man['slice']} {man.get('status')} -> {ledger}")
    if args.no_after:
        return 0
    try:
        sl = find_slice(load_queue(), man["slice"])
        after = sl.after
    except SystemExit:
        after = []
    py = args.python or sys.executable
    failures = 0
    for cmd in [*after, ["make", "report", f"PY={py}"]]:
        argv = [c.replace("{py}", py) for c in cmd]
        print("$ " + " ".join(argv), flush=True)
        failures += subprocess.run(argv, cwd=root).returncode != 0
    if failures:
        print(f"{failures} regeneration commands failed (the records are in place)", file=sys.stderr)
    return 0


# -- list ------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    slices = load_queue()
    rows = read_ledger(Path(args.ledger))
    nxt = next_slice(slices, Path(args.ledger))
    for s in slices:
        mine = [r for r in rows if r["slice"] == s.id]
        state = mine[-1]["status"] if mine else "-"
        mark = "->" if nxt is not None and s.id == nxt.id else "  "
        runs = ", ".join(r.id for r in s.runs)
        print(
            f"{mark} {s.order:>4g} {s.id:16s} {s.gpu_minutes:5.1f} min  {state:8s} {s.title}\n{'':29s}runs: {runs}"
        )
    print(f"\nnext: {nxt.id if nxt else 'nothing'}; total estimate of the auto slices: "
          f"{sum(s.gpu_minutes for s in slices if s.auto):g} GPU min (one call each)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    global QUEUE
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["exec"]:
        cmd_exec(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ledger", default=os.environ.get("GPU_SLICE_LEDGER", str(LEDGER)))
    p.add_argument("--queue", default=os.environ.get("GPU_SLICE_QUEUE", str(QUEUE)))
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("list", help="the queue with the ledger's status")
    sp.set_defaults(fn=cmd_list)
    sp = sub.add_parser("carry", help="prepare gpu_carry/ for a slice and print the device call")
    sp.add_argument("item", nargs="?")
    sp.add_argument("--dest", default=str(CARRY))
    sp.add_argument("--results", default=str(REPO / "results"))
    sp.add_argument("--data-dir", default=os.environ.get("CURVOPT_DATA_DIR", str(REPO / "data")))
    sp.add_argument("--wheels-from", nargs="+", default=[str(d) for d in WHEEL_DIRS])
    sp.add_argument("--no-fetch", dest="fetch", action="store_false", help="never download missing wheels")
    sp.add_argument("--limit-mib", type=float, default=TREE_LIMIT_MIB)
    sp.add_argument(
        "--leave-behind", action="store_true", help="carry the checkpoints that fit; skip the others' runs"
    )
    sp.add_argument(
        "--restart-unfit", action="store_true", help="runs whose checkpoint does not fit start again"
    )
    sp.set_defaults(fn=cmd_carry)
    sp = sub.add_parser("run", help="run a slice (the device call's command)")
    sp.add_argument("item", nargs="?")
    sp.add_argument("--out", default=None, help="default $OUT")
    sp.add_argument("--out-overwrite", action="store_true")
    sp.add_argument("--carry", default=os.environ.get("GPU_SLICE_CARRY", str(CARRY)))
    sp.add_argument("--results", default=os.environ.get("GPU_SLICE_RESULTS", str(REPO / "results")))
    sp.add_argument("--work", default=os.environ.get("GPU_SLICE_TMP", "/tmp/gpu_slice"))
    sp.add_argument("--work-s", type=float, default=None, help="seconds of work (default: the queue's, 480)")
    sp.add_argument("--force", action="store_true", help="run module runs even when their done_if exists")
    sp.add_argument("--allow-cpu", action="store_true", help="run a GPU slice without CUDA (tests)")
    sp.set_defaults(fn=cmd_run)
    sp = sub.add_parser("unpack", help="verify a slice's $OUT, extract it into results/, ledger, figures")
    sp.add_argument("src")
    sp.add_argument("--root", default=str(REPO), help="repository root to extract into")
    sp.add_argument("--gpu-minutes", type=float, default=None, help="the call's device minutes (lease)")
    sp.add_argument("--no-after", action="store_true", help="no figure/report regeneration")
    sp.add_argument("--python", default=None)
    sp.set_defaults(fn=cmd_unpack)
    args = p.parse_args(argv)
    saved, QUEUE = QUEUE, Path(args.queue)
    try:
        return int(args.fn(args) or 0)
    finally:
        QUEUE = saved


if __name__ == "__main__":
    sys.exit(main())
