"""Run (there, the device call's command): install the carried wheels, decompress the data, put the
checkpoints in place, run the slice's phases until the work deadline (SIGTERM, then SIGKILL after
``grace_s``), write the slice's report and pack ``$OUT`` (:mod:`tools.gpu.pack`)."""

from __future__ import annotations

import argparse
import glob
import gzip
import importlib.util
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tools.gpu.common import (
    FINAL,
    MIB,
    REPO,
    Log,
    Refused,
    canon,
    iso,
    mib,
    now_utc,
    run_status,
    sha256_file,
)
from tools.gpu.facts import device_facts
from tools.gpu.ledger import pick
from tools.gpu.pack import OUT_MAX_FILES, pack, snapshot
from tools.gpu.report import report_md, run_record, slice_status
from tools.gpu.slices import Run, Slice

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
        status = run_status(rdir)
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
            sys.executable, "-m", "tools.gpu", "exec", "--facts", str(job.facts_path),
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
        "started": iso(t_start),
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
