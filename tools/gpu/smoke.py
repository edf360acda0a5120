"""GPU smoke test: every paper experiment runs a few steps; one JSON + one Markdown table.

    python -m tools.gpu.smoke                 # CUDA when present, else the same list on the CPU
    python -m tools.gpu.smoke --quick         # the short list (tests/tools/test_gpu_smoke.py runs it)
    python -m tools.gpu.smoke --only 'llama60m_*' --steps 20
    python -m tools.gpu.smoke --list          # the entries and their commands; runs nothing

``make gpu-smoke`` / ``make gpu-smoke-quick`` call this. ``ENTRIES`` is the one list: per paper the
runs that matter on a GPU node (SHF-LSMR and HF-CG on USPS, MNIST and CURVES; FGN Figure 2a with
``torch.compile`` and Figure 3's Adam/SGN/FGN on Cars196 and on the synthetic stand-in; FOSI LR, AE, LM
(and TL, AC when their data exist); LLaMA-60M with Adam, RACS, Alice, Alice-0, GaLore, Fira and
APOLLO in bf16, the larger LLaMA configs, one ``torchrun --nproc_per_node 1`` DDP run). Each entry is
a subprocess: ``src/train.py`` with the experiment's Hydra overrides plus ``run_id=<entry>
logger=none trainer.max_steps=<steps> trainer.eval_every=<steps>`` (evaluation at step 0 and at the
end), no checkpoints, run directories under ``<out>/<device>/runs/`` (git-ignored). The test
``tests/tools/test_gpu_smoke.py`` checks that the list covers every ``conf/experiment/*_paper.yaml``.

Per entry: ``pass`` / ``fail`` (with the traceback's tail) / ``skipped`` (the run stopped before
training because its data are missing: exit code 2 of ``src/train.py``, e.g. Cars196 features,
ResNet-18 weights, AudioSet, or C4 on a node without the files and without internet); the median
step time over the steps after the first (the first one, with compilation and warm-up, separately),
peak memory (CUDA: ``max_memory_allocated``; CPU: the process's max RSS), device and dtype, from the
run's ``summary.json`` / ``metrics.jsonl``. Written to ``<out>/<device>/smoke.json`` and ``smoke.md``
(``smoke_quick.*`` for ``--quick`` / ``--only``).

Without CUDA (or with ``--cpu``) the same list runs on the CPU: 2 steps, ``trainer.device=cpu``,
float32 instead of bf16, and each entry's ``cpu`` overrides shrink what a CPU cannot do in seconds
(data subsets, one LLaMA layer, short sequences, fewer LSMR/CG/Lanczos iterations). CPU step times
and memory say nothing about a GPU; the CPU run checks that every entry still starts, steps and
writes its records.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
TRAIN = "src/train.py"

# -- the list ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One smoke run. ``overrides`` apply everywhere; ``gpu`` / ``cpu`` only in that mode.

    ``script`` replaces ``src/train.py`` by a driver (its arguments are the overrides), given as its
    file (``experiments/fgn/fig2.py``) and run as its module (``python -m experiments.fgn.fig2``);
    ``launcher`` ``torchrun`` runs ``python -m torch.distributed.run --standalone --nproc_per_node 1``."""

    name: str
    paper: str
    experiment: str  # conf/experiment/<experiment>.yaml, or the driver's record name
    overrides: tuple[str, ...] = ()
    gpu: tuple[str, ...] = ()
    cpu: tuple[str, ...] = ()
    launcher: str = "python"  # python | torchrun
    script: str | None = None
    note: str = ""


# What shrinks a paper experiment for a CPU smoke run (never used on a GPU).
_SHF_CPU = (
    "dataset.num_train=1000",
    "dataset.num_val=250",
    "dataset.num_test=250",
    "trainer.eval_batch_size=1000",
)
_LLM_CPU = (
    "+model.num_hidden_layers=1",
    "dataset.max_length=64",
    "dataset.val_tokens=512",
    "dataset.prefetch=16",
    "trainer.batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.eval_batch_size=4",
    "trainer.dtype=float32",
)
# On a GPU: the paper's model, batch and dtype; only the 10M-token evaluation is cut (it runs twice).
_LLM_GPU = ("dataset.val_tokens=65536",)
# FOSI: the first ESE (Lanczos) after one step, then every 5, so a few steps exercise the Newton part.
_FOSI = ("optimizer.ese_warmup=1", "optimizer.ese_period=5")


def _shf(dataset: str, method: str) -> Entry:
    iters = (
        ("optimizer.maxiter=10", "optimizer.batch_size=100")
        if method == "shf_lsmr"
        else ("optimizer.cg_maxiter=10",)
    )
    # CURVES (CURVES-like without Martens' file): generated in memory, no cache written next to the data
    extra = ("dataset.cache=false",) if dataset == "curves" else ()
    return Entry(
        name=f"shf_{dataset}_{method}",
        paper="SHF",
        experiment=f"shf_fig2_{dataset}_paper",
        overrides=(f"optimizer={method}", *extra),
        cpu=(*_SHF_CPU, *iters),
    )


def _fgn_fig3(method: str, synthetic: bool) -> Entry:
    return Entry(
        name=f"fgn_fig3_{method}" + ("_synthetic" if synthetic else ""),
        paper="FGN",
        experiment="fgn_cars196_paper",
        overrides=(f"optimizer={method}", *(("dataset=cars196_synthetic",) if synthetic else ())),
        cpu=(
            ("dataset.num_train=1024", "dataset.num_test=1024", "trainer.eval_batch_size=1024")
            if synthetic
            else ("trainer.eval_batch_size=1024",)
        ),
        note="" if synthetic else "needs Cars196 ResNet-50 features (docs/fgn.md)",
    )


def _fosi(task: str, method: str, cpu: tuple[str, ...], note: str = "") -> Entry:
    short = {"fosi_heavy_ball": "fosi_hb", "fosi_adam": "fosi_adam"}[method]
    return Entry(
        name=f"fosi_{task}_{short}",
        paper="FOSI",
        experiment=f"fosi_{task}_paper",
        overrides=(f"optimizer={method}", *_FOSI),
        cpu=cpu,
        note=note,
    )


def _llama(name: str, experiment: str, optimizer: str, launcher: str = "python", note: str = "") -> Entry:
    return Entry(
        name=name,
        paper="RACS/Alice",
        experiment=experiment,
        overrides=(f"optimizer={optimizer}",),
        gpu=_LLM_GPU,
        cpu=_LLM_CPU,
        launcher=launcher,
        note=note,
    )


# an ESE with k = 2 and 6 Lanczos iterations: still the whole Newton path, minutes less on a CPU
_FOSI_ESE_CPU = ("optimizer.k=2", "optimizer.num_iters=6")
_FOSI_AE_CPU = (
    "dataset.num_train=512",
    "dataset.num_val=128",
    "trainer.eval_batch_size=128",
    "optimizer.ese_batch_size=16",
    *_FOSI_ESE_CPU,
)
_FOSI_LM_CPU = (
    "dataset.sequence_length=16",
    "dataset.num_val=64",
    "trainer.batch_size=8",
    "trainer.eval_batch_size=64",
    "optimizer.ese_batch_size=8",
    *_FOSI_ESE_CPU,
)
_FOSI_TL_CPU = (
    "dataset.num_train=256",
    "dataset.num_val=128",
    "model.image_size=32",
    "trainer.eval_batch_size=128",
    *_FOSI_ESE_CPU,
)
_FOSI_AC_CPU = ("dataset.max_files=8", "trainer.batch_size=8", "trainer.eval_batch_size=8", *_FOSI_ESE_CPU)

ENTRIES: tuple[Entry, ...] = (
    # SHF-LSMR paper, Figure 2: both methods on the three datasets
    *(_shf(d, m) for d in ("usps", "mnist", "curves") for m in ("shf_lsmr", "hf_cg")),
    # FGN paper, Figure 2a: time per update vs C, the closed form compiled (experiments/fgn/fig2.py)
    Entry(
        name="fgn_fig2a_compile",
        paper="FGN",
        experiment="fgn_fig2",
        script="experiments/fgn/fig2.py",
        overrides=(
            "timing",
            "--profile",
            "paper",
            "--set",
            "timing.compile=true",
            "--set",
            "timing.repeats=1",
        ),
        gpu=(
            "--set",
            "timing.device=cuda",
            "--set",
            "timing.classes=[2,512,4096]",
            "--set",
            "timing.num_examples=8192",
            "--set",
            "timing.warmup_steps=5",
            "--set",
            "timing.timed_steps=20",
        ),
        cpu=(
            "--set",
            "timing.device=cpu",
            "--set",
            "timing.classes=[8]",
            "--set",
            "timing.methods=[adam,fgn_affine]",
            "--set",
            "timing.num_examples=1024",
            "--set",
            "timing.warmup_steps=2",
            "--set",
            "timing.timed_steps=2",
        ),
        note="torch.compile of the closed-form FGN solve; step time = fgn_affine at the largest C",
    ),
    # FGN paper, Figure 3: the Cars196 head (real features when present; the synthetic stand-in always)
    *(_fgn_fig3(m, synthetic=False) for m in ("adam", "sgn", "fgn")),
    *(_fgn_fig3(m, synthetic=True) for m in ("adam", "sgn", "fgn")),
    # FOSI paper: LR, AE, LM with both FOSI variants; TL and AC need user data
    _fosi("lr", "fosi_heavy_ball", ()),
    _fosi("lr", "fosi_adam", ()),
    _fosi("ae", "fosi_heavy_ball", _FOSI_AE_CPU),
    _fosi("ae", "fosi_adam", _FOSI_AE_CPU),
    _fosi("lm", "fosi_heavy_ball", _FOSI_LM_CPU),
    _fosi("lm", "fosi_adam", _FOSI_LM_CPU),
    _fosi(
        "tl", "fosi_heavy_ball", _FOSI_TL_CPU, note="needs ImageNet ResNet-18 weights (docs/fosi_tasks.md)"
    ),
    _fosi("ac", "fosi_heavy_ball", _FOSI_AC_CPU, note="needs AudioSet wav files (docs/fosi_tasks.md)"),
    # the MNIST autoencoder demo at paper scale
    Entry(
        name="mnist_ae_adam",
        paper="demo",
        experiment="mnist_autoencoder_paper",
        overrides=("optimizer=adam",),
        cpu=_SHF_CPU,
    ),
    # RACS/Alice paper: LLaMA-60M on C4 with every method, bf16 (CPU: float32, one layer)
    *(
        _llama(f"llama60m_{opt}", "alice_c4_60m_paper", opt)
        for opt in ("adam", "racs", "alice", "alice0", "galore", "fira", "apollo")
    ),
    # the cross-paper grid's paper-like profiles (docs/cross.md): each task once, with Adam
    *(
        Entry(
            name=f"cross_{task}_adam",
            paper="cross",
            experiment=f"cross_{task}_paper",
            overrides=("optimizer=adam", "cross.trial=t0"),
            cpu=("trainer.max_steps=2",),
        )
        for task in ("usps", "lr", "lm", "llm")
    ),
    _llama("llama130m_adam", "alice_c4_130m_paper", "adam"),
    _llama("llama350m_adam", "alice_c4_350m_paper", "adam"),
    _llama("llama1b_adam", "alice_c4_1b_paper", "adam"),
    _llama("llama130m_ablation_alice", "alice_c4_130m_ablation_paper", "alice"),
    _llama(
        "ddp_llama60m_racs",
        "alice_c4_paper",
        "racs",
        launcher="torchrun",
        note="torchrun --standalone --nproc_per_node 1 (DDP code path, one rank)",
    ),
)

# The short list (tests/tools/test_gpu_smoke.py, make gpu-smoke-quick): one entry per paper, cheap on a CPU.
QUICK = ("shf_usps_shf_lsmr", "fgn_fig3_fgn_synthetic", "fosi_lr_fosi_hb", "llama60m_adam")


def paper_experiments() -> list[str]:
    """Every ``conf/experiment/*_paper.yaml`` (the list must cover them all)."""
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*_paper.yaml"))


def select(entries: tuple[Entry, ...], quick: bool = False, only: list[str] | None = None) -> list[Entry]:
    chosen = [e for e in entries if e.name in QUICK] if quick else list(entries)
    if only:
        chosen = [e for e in chosen if any(fnmatch.fnmatch(e.name, pat) for pat in only)]
        if not chosen:
            raise SystemExit(f"--only {only}: no entry matches; names: {[e.name for e in entries]}")
    return chosen


# -- running -------------------------------------------------------------------------------------------


def entry_args(entry: Entry, mode: str) -> list[str]:
    """The entry's own arguments in this mode (no run-specific ones)."""
    head = [] if entry.script else [f"experiment={entry.experiment}"]
    return [*head, *entry.overrides, *(entry.gpu if mode == "cuda" else entry.cpu)]


def driver_module(script: str) -> str | None:
    """The module of a driver of the ``experiments`` package (``experiments/fgn/fig2.py`` ->
    ``experiments.fgn.fig2``), which runs as ``python -m``; ``None`` for a plain script
    (``src/train.py``)."""
    path = Path(script)
    if path.parts[:1] == ("experiments",) and path.suffix == ".py":
        return ".".join(path.with_suffix("").parts)
    return None


def command(entry: Entry, mode: str, steps: int, work: Path) -> list[str]:
    """The subprocess command line of one entry (run from the repository root).

    The script (``src/train.py`` or a driver) runs under this file's ``--wrap``, which records
    whether the run stopped on missing data (a ``DataNotFoundError``: skipped, not failed) and the
    peak memory; ``shown()`` prints the command without it."""
    py = sys.executable
    wrap = ["-m", "tools.gpu.smoke", "--wrap", str(work / "wrap.json")]
    if entry.script:
        return [py, *wrap, entry.script, *entry_args(entry, mode), "--results-dir", str(work / "records")]
    run = [
        *entry_args(entry, mode),
        f"run_id={entry.name}",
        f"paths.results_dir={work}",
        f"hydra.run.dir={work}/hydra",
        "logger=none",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.checkpoint_every=0",
        "trainer.checkpoint_every_s=null",
        "trainer.keep_checkpoint=false",
        "trainer.resume=false",
        "trainer.progress=false",
        f"trainer.device={mode}",
    ]
    if entry.launcher == "torchrun":
        torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
        return [py, *torchrun, *wrap, TRAIN, *run]
    return [py, *wrap, TRAIN, *run]


def shown(cmd: list[str]) -> str:
    """A copy-pasteable form of the command: without the ``--wrap`` recorder, ``python -m
    torch.distributed.run`` shown as ``torchrun``."""
    root = str(REPO_ROOT) + os.sep
    parts = ["python" if c == sys.executable else c.replace(root, "") for c in cmd]
    if "--wrap" in parts:  # [..., -m, tools.gpu.smoke, --wrap, OUT, SCRIPT, ...]
        i = parts.index("--wrap")
        script = parts[i + 2]
        module = driver_module(script)
        parts = [*parts[: i - 2], *(["-m", module] if module else [script]), *parts[i + 3 :]]
    if parts[:3] == ["python", "-m", "torch.distributed.run"]:
        parts = ["torchrun", *parts[3:]]
    return " ".join(f"'{p}'" if re.search(r"[\[\]*?\s]", p) else p for p in parts)


def subprocess_env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    if "CURVOPT_DATA_DIR" not in env and (REPO_ROOT.parent / "shared" / "data").is_dir():
        env["CURVOPT_DATA_DIR"] = str(REPO_ROOT.parent / "shared" / "data")  # as the Makefile does
    src = str(REPO_ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # a smoke run never waits on the network (cluster nodes have none); override in the environment
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["HYDRA_FULL_ERROR"] = "1"
    if mode == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        # one intra-op thread: spinning torch threads on a shared small CPU cost far more than they give
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> tuple[int | None, float]:
    """Run ``cmd`` in its own process group, output to ``log``; on timeout kill that group."""
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = None
    return rc, time.perf_counter() - t0


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b")


def error_tail(text: str, lines: int = 25) -> str:
    """The end of the last traceback of a log: a few frames, the exception line and what follows
    it (Hydra lists the valid choices there); without a traceback, the log's last lines."""
    rows = [r[:500] for r in text.splitlines() if r.strip()]
    starts = [i for i, r in enumerate(rows) if r.startswith("Traceback")]
    if not starts:
        return "\n".join(rows[-lines:])
    block = rows[starts[-1] :]
    exc = [i for i, r in enumerate(block) if _EXCEPTION_LINE.match(r)]
    if not exc:
        return "\n".join(block[-lines:])
    i = exc[-1]
    return "\n".join(block[max(0, i - 8) : i + lines - 8])


def error_message(text: str) -> str:
    """The message of the last ERROR log line (``src/train.py`` logs a bad input that way, then
    exits with code 2) and the line after it."""
    rows = text.splitlines()
    for i in range(len(rows) - 1, -1, -1):
        if "[ERROR]" in rows[i]:
            msg = rows[i].split("[ERROR] - ", 1)[-1].strip()
            nxt = rows[i + 1].strip() if i + 1 < len(rows) else ""
            return f"{msg} {nxt}".strip()[:400]
    return ""


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_metrics(work: Path, name: str) -> dict[str, Any]:
    """Step time, memory, device, dtype and status from the run's records."""
    summaries = sorted(work.glob(f"*/{name}/summary.json"))
    if not summaries:
        return {}
    run_dir = summaries[0].parent
    summary = json.loads(summaries[0].read_text())
    steps = [r for r in _rows(run_dir / "metrics.jsonl") if "step_time_s" in r]
    times = [float(r["step_time_s"]) for r in steps]
    later = times[1:] or times
    tokens = [float(r["tokens_per_s"]) for r in steps[1:] if r.get("tokens_per_s") is not None]
    peak = summary.get("peak_mem_bytes") or max(
        (r.get("peak_mem_bytes") or 0 for r in _rows(run_dir / "metrics.jsonl")), default=None
    )
    return {
        "run_status": summary.get("status"),
        "stop_reason": summary.get("stop_reason"),
        "steps": summary.get("steps"),
        "first_step_s": times[0] if times else None,
        "step_time_s": statistics.median(later) if later else None,
        "tokens_per_s": statistics.median(tokens) if tokens else None,
        "peak_mem_bytes": peak,
        "device": summary.get("device_name") or summary.get("device"),
        "dtype": summary.get("dtype"),
        "world_size": summary.get("world_size"),
        "final_loss": next((r["loss"] for r in reversed(steps) if "loss" in r), None),
        "run_dir": str(run_dir),
    }


def fig2_metrics(work: Path) -> dict[str, Any]:
    """FGN Figure 2a: per-cell status and ms per update from timing.jsonl, memory from the wrapper."""
    rows = [r for p in sorted(work.glob("records/fgn_fig2/*/timing.jsonl")) for r in _rows(p)]
    wrap = json.loads((work / "wrap.json").read_text()) if (work / "wrap.json").exists() else {}
    ok = [r for r in rows if r.get("status") == "ok"]
    failed = [r for r in rows if r.get("status") != "ok"]
    main = [r for r in ok if r["method"] == "fgn_affine"] or ok
    top = max(main, key=lambda r: r["C"]) if main else None
    return {
        "cells": len(rows),
        "failed_cells": [f"{r['method']} C={r['C']}: {r.get('error', r.get('status'))}" for r in failed],
        "ms_per_update": {f"{r['method']}@C={r['C']}": round(r["ms_mean"], 3) for r in ok},
        "compiled": any(r.get("compiled") for r in ok),
        "step_time_s": top["ms_mean"] / 1e3 if top else None,
        "first_step_s": None,
        "peak_mem_bytes": wrap.get("peak_mem_bytes"),
        "device": (top or {}).get("device") or wrap.get("device"),
        "dtype": "float32",
    }


def run_entry(entry: Entry, mode: str, steps: int, work_root: Path, timeout: float) -> dict[str, Any]:
    work = work_root / entry.name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cmd = command(entry, mode, steps, work)
    log = work / "output.log"
    rc, wall = _run(cmd, subprocess_env(mode), log, timeout)
    text = log.read_text(errors="replace")
    result: dict[str, Any] = {
        "name": entry.name,
        "paper": entry.paper,
        "experiment": entry.experiment,
        "launcher": "torchrun --nproc_per_node 1" if entry.launcher == "torchrun" else "python",
        "command": shown(cmd),
        "returncode": rc,
        "wall_s": round(wall, 2),
        "log": str(log),
        "note": entry.note,
    }
    metrics = fig2_metrics(work) if entry.script else train_metrics(work, entry.name)
    wrap = json.loads((work / "wrap.json").read_text()) if (work / "wrap.json").exists() else {}
    result.update(metrics)
    if rc is None:
        result.update(status="fail", error=f"timeout after {timeout:.0f} s\n" + error_tail(text, 10))
    elif rc == 2 and wrap.get("data_missing"):
        msg = " ".join(wrap["data_missing"].split())
        result.update(status="skipped", reason="data missing: " + msg[:400])
    elif rc == 2:
        result.update(
            status="fail", error=f"bad input (exit code 2): {error_message(text)}\n{error_tail(text, 10)}"
        )
    elif rc != 0:
        result.update(status="fail", error=error_tail(text))
    elif entry.script and (metrics.get("failed_cells") or not metrics.get("cells")):
        result.update(status="fail", error="\n".join(metrics.get("failed_cells") or ["no timing records"]))
    elif not entry.script and metrics.get("run_status") != "completed":
        why = f"run status {metrics.get('run_status')!r} ({metrics.get('stop_reason')})"
        result.update(status="fail", error=why if metrics else "no summary.json\n" + error_tail(text))
    else:
        result["status"] = "pass"
    return result


# -- report --------------------------------------------------------------------------------------------


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _fmt_bytes(x: float | None) -> str:
    return "–" if not x else f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.0f} MiB"


def markdown(report: dict[str, Any]) -> str:
    c = report["counts"]
    lines = [
        f"# GPU smoke test — {report['device']} ({report['mode']} mode)",
        "",
        f"{c['pass']} pass, {c['fail']} fail, {c['skipped']} skipped of {c['total']} entries; "
        f"{report['steps']} steps each; {report['created']}; torch {report['torch']}, Python {report['python']}, "
        f"commit {report['git_commit']}. Made by `{report['invocation']}`.",
        "",
        "Step time: median over the steps after the first (the first, with compilation/warm-up, separately). "
        "Peak memory: "
        + ("CUDA max allocated." if report["mode"] == "cuda" else "process max RSS (CPU mode)."),
    ]
    if report["mode"] == "cpu":
        lines.append(
            "CPU mode: 2-step runs with the entries' `cpu` overrides (data subsets, one LLaMA layer, "
            "float32, fewer inner iterations); times and memory are not the GPU's."
        )
    lines += [
        "",
        "| entry | paper | experiment | status | step time | first step | peak memory | device | dtype | wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["entries"]:
        status = {"pass": "pass", "fail": "**FAIL**", "skipped": "skipped"}[r["status"]]
        lines.append(
            f"| {r['name']} | {r['paper']} | {r['experiment']} | {status} | {_fmt_s(r.get('step_time_s'))} "
            f"| {_fmt_s(r.get('first_step_s'))} | {_fmt_bytes(r.get('peak_mem_bytes'))} | {r.get('device') or '–'} "
            f"| {r.get('dtype') or '–'} | {r['wall_s']:.0f} s |"
        )
    notes = [r for r in report["entries"] if r["status"] != "pass"]
    if notes:
        lines += ["", "## Failures and skips", ""]
        for r in notes:
            if r["status"] == "skipped":
                reason = r["reason"] if len(r["reason"]) <= 250 else r["reason"][:250] + " …"
                lines.append(f"* **{r['name']}** skipped: {reason}")
            else:
                lines += [
                    f"* **{r['name']}** failed (exit code {r['returncode']}):",
                    "",
                    "```",
                    r["error"],
                    "```",
                    "",
                ]
    lines += ["", "## Commands", ""]
    lines += [f"* `{r['name']}`: `{r['command']}`" for r in report["entries"]]
    return "\n".join(lines) + "\n"


def device_info(mode: str) -> tuple[str, str]:
    """(device name, folder slug)."""
    if mode == "cpu":
        name = platform.machine() or "cpu"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"cpu: {name}, {os.cpu_count()} cores", "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    return name, re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _wrap(argv: list[str]) -> None:
    """``--wrap OUT.json SCRIPT ARGS...``: run a script in this process as ``python SCRIPT ARGS``
    would (a driver of the ``experiments`` package as ``python -m MODULE ARGS``), then write to
    OUT.json its peak memory (CUDA max allocated, else max RSS) and the message of the last
    ``DataNotFoundError`` raised (``src/train.py`` logs it and exits with code 2, the code of every
    bad input; the message tells missing data from a bad config value)."""
    import resource
    import runpy

    out, script, rest = Path(argv[0]), argv[1], argv[2:]
    sys.argv = [script, *rest]
    module = driver_module(script)
    data_missing: list[str] = []
    try:
        from curvopt.errors import DataNotFoundError

        original = DataNotFoundError.__init__

        def init(self: Exception, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            data_missing.append(str(self))

        DataNotFoundError.__init__ = init  # type: ignore[method-assign]
    except ImportError:
        pass
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    finally:
        info: dict[str, Any] = {"peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            info = {
                "peak_mem_bytes": int(torch.cuda.max_memory_allocated()),
                "device": torch.cuda.get_device_name(),
            }
        info["data_missing"] = data_missing[-1] if data_missing else None
        out.write_text(json.dumps(info))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--wrap"]:
        _wrap(argv[1:])
        return {}
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="CPU mode even when CUDA is available")
    parser.add_argument("--quick", action="store_true", help=f"only the short list: {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="+", metavar="PATTERN", help="entries whose name matches (fnmatch)")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run (default: 10 on CUDA, 2 on CPU)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per entry (default: 900 on CUDA, 600 on CPU)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="entries run at once (default 1; timings need 1)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "results" / "gpu_smoke"))
    parser.add_argument("--work-dir", default=None, help="run directories (default <out-dir>/<device>/runs)")
    parser.add_argument(
        "--name", default=None, help="report file stem (default smoke, smoke_quick for subsets)"
    )
    parser.add_argument("--list", action="store_true", help="print the entries and commands, run nothing")
    args = parser.parse_args(argv)

    if args.cpu:
        mode = "cpu"
    else:
        import torch

        mode = "cuda" if torch.cuda.is_available() else "cpu"
    steps = args.steps or (10 if mode == "cuda" else 2)
    timeout = args.timeout or (900.0 if mode == "cuda" else 600.0)
    entries = select(ENTRIES, args.quick, args.only)
    if args.list:
        for e in entries:
            print(f"{e.name:28s} {shown(command(e, mode, steps, Path('<work>') / e.name))}")
        return {"entries": [asdict(e) for e in entries]}

    device, slug = device_info(mode)
    out = Path(args.out_dir) / slug
    work = Path(args.work_dir) if args.work_dir else out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    print(f"gpu smoke: {len(entries)} entries, {mode} mode ({device}), {steps} steps each, runs in {work}")

    def one(entry: Entry) -> dict[str, Any]:
        result = run_entry(entry, mode, steps, work, timeout)
        extra = result.get("reason") or (result.get("error") or "").splitlines()[-1:] or ""
        if isinstance(extra, list):
            extra = extra[0] if extra else ""
        print(
            f"  {entry.name:28s} {result['status']:8s} step {_fmt_s(result.get('step_time_s')):>9s}  "
            f"mem {_fmt_bytes(result.get('peak_mem_bytes')):>9s}  {result['wall_s']:6.1f} s  "
            + (extra[:150] if result["status"] != "pass" else ""),
            flush=True,
        )
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, entries))

    import torch

    counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "skipped")}
    counts["total"] = len(results)
    report = {
        "device": device,
        "mode": mode,
        "steps": steps,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "git_commit": _git_commit(),
        "invocation": " ".join(["python -m tools.gpu.smoke", *argv]),
        "counts": counts,
        "entries": results,
    }
    name = args.name or ("smoke_quick" if (args.quick or args.only) else "smoke")
    from curvopt.training.records import portable_record

    report = portable_record(report)  # no absolute folder of this machine in the tables
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(report))
    print(
        f"{counts['pass']} pass, {counts['fail']} fail, {counts['skipped']} skipped -> {out / name}.json, .md"
    )
    return report


if __name__ == "__main__":
    report = main()
    sys.exit(1 if report.get("counts", {}).get("fail") else 0)
