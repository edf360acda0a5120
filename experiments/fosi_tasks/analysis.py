"""FOSI DNN tasks: curves, Tables 1–2 and run selection from run records (no re-running).

Conventions (docs/fosi_tasks.md):

* Time axis: the loop's ``algo_time_s`` (optimizer steps only) by default, ``wall_time_s``
  (evaluation included, as the paper's clock) with ``clock='wall'``. Compare runs only on the
  same machine kind; on a shared CPU the absolute seconds are noisy, the ratios less so.
* Training loss: the mean of the logged mini-batch losses over each epoch (the authors' per-epoch
  mean), or over each evaluation window for the LM task (the authors evaluate every 100 steps).
* Paper units: the AE loss is reported as Σ_pixels (x̂ − x)² (2 × the repo's ½‖·‖², = ``E_sq``);
  the AC loss as the mean over the 527 labels (the repo's sum / 527).
* Table 1: the base optimizer's best validation metric is the target; the base time is when it
  first attains it, the FOSI time the first logged time at which FOSI reaches it (``inf`` if never),
  at the resolution of the logged points (as ``generate_result_summary.py``). Table 2: the same
  on the training loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from curvopt.analysis.records import load_runs

HERE = Path(__file__).resolve().parent
PAIRS = (("heavy_ball", "fosi_heavy_ball"), ("adam", "fosi_adam"))
MAIN_OPTIMIZERS = ("heavy_ball", "fosi_heavy_ball", "adam", "fosi_adam")
LBFGS_HISTORIES = (10, 20, 40, 80, 100)
KFAC_LRS = ("adaptive", "1e-3", "1e-2", "1e-1")
KFAC_MOMENTA = ("adaptive", "0.1", "0.5", "0.9")
LABELS = {
    "heavy_ball": "HB",
    "fosi_heavy_ball": "FOSI-HB",
    "adam": "Adam",
    "fosi_adam": "FOSI-Adam",
    "kfac": "K-FAC",
    "lbfgs": "L-BFGS",
}


@dataclass(frozen=True)
class Task:
    key: str
    experiment: str
    title: str
    val_metric: str  # Table 1 metric column
    val_mode: str  # max (accuracy) | min (loss)
    val_loss: str  # Figures 5/6 validation-loss column
    train_scale: float = 1.0  # mini-batch loss -> paper units
    val_loss_scale: float = 1.0  # validation-loss column -> paper units
    train_window: str = "epoch"  # epoch | eval
    fig5_ymax: float | None = None
    data_note: str = ""


TASKS: dict[str, Task] = {
    "ac": Task(
        "ac",
        "fosi_ac",
        "AC: MobileNetV1 on AudioSet",
        "val/hit_rate",
        "max",
        "val/loss",
        1 / 527,
        1 / 527,
        "epoch",
        None,
        "needs the user's AudioSet wav files",
    ),
    "lm": Task(
        "lm",
        "fosi_lm",
        "LM: char-LSTM on Tiny Shakespeare",
        "val/loss",
        "min",
        "val/loss",
        1.0,
        1.0,
        "eval",
        2.7,
    ),
    "ae": Task(
        "ae",
        "fosi_ae",
        "AE: conv autoencoder on CIFAR-10",
        "val/E_sq",
        "min",
        "val/E_sq",
        2.0,
        1.0,
        "epoch",
        60.0,
    ),
    "tl": Task(
        "tl",
        "fosi_tl",
        "TL: ResNet-18 head on CIFAR-10",
        "val/accuracy",
        "max",
        "val/loss",
        1.0,
        1.0,
        "epoch",
        0.8,
        "needs the ImageNet ResNet-18 weights",
    ),
    "lr": Task(
        "lr",
        "fosi_lr",
        "LR: logistic regression on MNIST",
        "test/accuracy",
        "max",
        "test/loss",
        1.0,
        1.0,
        "epoch",
        0.3,
    ),
}


def run_key(run_id: str, profile: str, seed: int = 0) -> str:
    """``heavy_ball_paper_s0`` → ``heavy_ball``; ``lbfgs_paper_s0_L10`` → ``lbfgs_L10``."""
    marker = f"_{profile}_s{seed}"
    if marker not in run_id:
        return ""
    head, tail = run_id.split(marker, 1)
    return head + tail


def load_task(results: str | Path, task: Task, profile: str, seed: int = 0) -> dict[str, pd.DataFrame]:
    """Records of one task at one profile, keyed by optimizer (plus sweep suffix)."""
    frame = load_runs(results, task.experiment)
    if frame.empty:
        return {}
    out = {}
    for run_id, rows in frame.groupby("run_id"):
        key = run_key(str(run_id), profile, seed)
        if key and (rows["profile"] == profile).all():
            out[key] = rows.sort_values("step").reset_index(drop=True)
    return out


def _clock(clock: str) -> str:
    if clock not in ("algo", "wall"):
        raise ValueError(f"clock must be 'algo' or 'wall', got {clock!r}")
    return "algo_time_s" if clock == "algo" else "wall_time_s"


def _finite(values: pd.Series) -> pd.Series:
    return pd.to_numeric(values, errors="coerce")


def train_curve(rows: pd.DataFrame, task: Task, clock: str = "algo") -> pd.DataFrame:
    """Mean mini-batch training loss per epoch (or per evaluation window), in paper units, with
    the step, epoch and clock time at the end of each window. Incomplete trailing windows are
    kept (a run that diverged or stopped early)."""
    col = _clock(clock)
    steps = rows[(rows["step"] > 0) & rows.get("loss", pd.Series(dtype=float)).notna()].copy()
    if steps.empty:
        return pd.DataFrame(columns=["step", "epoch", "time", "loss"])
    steps["loss"] = _finite(steps["loss"])
    if task.train_window == "epoch":
        # the epoch a step belongs to: the logged epoch is examples seen *after* the step / n
        per_step = steps["epoch"].to_numpy(dtype=float)
        window = np.maximum(np.ceil(per_step - 1e-9) - 1, 0).astype(int)
    else:
        evals = rows[scheduled_evaluations(rows, task.val_loss)]["step"].to_numpy()
        edges = np.unique(np.r_[0, evals])
        window = np.searchsorted(edges, steps["step"].to_numpy(), side="left")
    steps["window"] = window
    grouped = steps.groupby("window")
    out = pd.DataFrame(
        {
            "step": grouped["step"].max(),
            "epoch": grouped["epoch"].max(),
            "time": grouped[col].max(),
            "loss": grouped["loss"].mean() * task.train_scale,
        }
    ).reset_index(drop=True)
    return out


def scheduled_evaluations(rows: pd.DataFrame, column: str) -> pd.Series:
    """Rows holding an evaluation of ``column`` made on the run's schedule: at a multiple of its
    ``trainer.eval_every``, or at its last step.

    A run continued in segments by raising ``trainer.max_steps`` at each resume (as the AE FOSI-HB
    paper run's first four were; ``trainer.pause_at_step`` adds no evaluation) also evaluates where
    each segment ended. Those extra points would give it
    a finer grid than a run made in one go, so times to a target would favour it: they are left out.
    Runs without a recorded ``eval_every`` keep every evaluation.
    """
    has = rows[column].notna() if column in rows else pd.Series(False, index=rows.index)
    every = pd.to_numeric(rows["eval_every"], errors="coerce").dropna() if "eval_every" in rows else []
    if len(every) == 0 or every.iloc[0] <= 0:
        return has
    step = rows["step"].astype(int)
    return has & ((step % int(every.iloc[0]) == 0) | (step == step.max()))


def eval_curve(rows: pd.DataFrame, column: str, clock: str = "algo", scale: float = 1.0) -> pd.DataFrame:
    """Scheduled evaluation points of ``column`` (step 0 included; :func:`scheduled_evaluations`),
    non-finite values dropped."""
    col = _clock(clock)
    if column not in rows:
        return pd.DataFrame(columns=["step", "epoch", "time", "value"])
    pts = rows[scheduled_evaluations(rows, column)][["step", "epoch", col, column]].copy()
    pts[column] = _finite(pts[column])
    pts = pts[np.isfinite(pts[column].to_numpy(dtype=float))]
    return pd.DataFrame(
        {"step": pts["step"], "epoch": pts["epoch"], "time": pts[col], "value": pts[column] * scale}
    ).reset_index(drop=True)


def best_point(
    curve: pd.DataFrame, mode: str, column: str = "value", at: str = "time"
) -> tuple[float, float]:
    """(best value, first time it is attained); (nan, nan) for an empty curve. ``at="step"``: the
    first step instead of the time."""
    if curve.empty:
        return math.nan, math.nan
    values = curve[column].to_numpy(dtype=float)
    ok = np.isfinite(values)
    if not ok.any():
        return math.nan, math.nan
    idx = int(
        np.nanargmax(np.where(ok, values, -np.inf))
        if mode == "max"
        else np.nanargmin(np.where(ok, values, np.inf))
    )
    return float(values[idx]), float(curve[at].iloc[idx])


def first_time_reaching(
    curve: pd.DataFrame, target: float, mode: str, column: str = "value", at: str = "time"
) -> float:
    """First logged time at which the curve reaches ``target`` (≥ for max, ≤ for min); inf if never.
    ``at="step"``: the first step instead."""
    if curve.empty or not math.isfinite(target):
        return math.inf
    values = curve[column].to_numpy(dtype=float)
    hit = values >= target if mode == "max" else values <= target
    hit &= np.isfinite(values)
    return float(curve[at].iloc[int(np.argmax(hit))]) if hit.any() else math.inf


def status_of(rows: pd.DataFrame | None) -> str:
    if rows is None or rows.empty:
        return "missing"
    return str(rows["status"].iloc[0])


def time_table(
    runs: dict[str, dict[str, pd.DataFrame]], which: str = "val", clock: str = "algo"
) -> pd.DataFrame:
    """Table 1 (``which='val'``) or Table 2 (``'train'``): one row per (task, optimizer).

    ``seconds``/``ratio`` are on ``clock``; ``steps``/``step_ratio`` are the same first hits counted
    in optimizer steps (equal work per step for the base and FOSI between ESEs): the two ratios
    apart say how much of a time ratio is FOSI's extra cost per step and ESEs."""
    rows = []
    for key, task in TASKS.items():
        task_runs = runs.get(key, {})
        for base, fosi in PAIRS:
            curves = {}
            for opt in (base, fosi):
                r = task_runs.get(opt)
                if r is None:
                    curves[opt] = None
                elif which == "val":
                    scale = task.val_loss_scale if task.val_metric == task.val_loss else 1.0
                    curves[opt] = eval_curve(r, task.val_metric, clock, scale)
                else:
                    curves[opt] = train_curve(r, task, clock).rename(columns={"loss": "value"})
            mode = task.val_mode if which == "val" else "min"
            if curves[base] is None or curves[base].empty:
                target, t_base, s_base = math.nan, math.nan, math.nan
            else:
                target, t_base = best_point(curves[base], mode)
                s_base = best_point(curves[base], mode, at="step")[1]
            if curves[fosi] is None:
                t_fosi = s_fosi = math.nan
            else:
                t_fosi = first_time_reaching(curves[fosi], target, mode)
                s_fosi = first_time_reaching(curves[fosi], target, mode, at="step")
            for opt, t, st in ((base, t_base, s_base), (fosi, t_fosi, s_fosi)):
                rows.append(
                    {
                        "task": key,
                        "optimizer": opt,
                        "seconds": t,
                        "steps": st,
                        "target": target,
                        "ratio": (t_fosi / t_base)
                        if opt == fosi and t_base and math.isfinite(t_base)
                        else math.nan,
                        "step_ratio": (s_fosi / s_base)
                        if opt == fosi and s_base and math.isfinite(s_base)
                        else math.nan,
                        "status": status_of(task_runs.get(opt)),
                    }
                )
    return pd.DataFrame(rows)


def paper_numbers() -> pd.DataFrame:
    return pd.read_csv(HERE / "paper_numbers.csv", comment="#")


def with_paper(table: pd.DataFrame, which: str) -> pd.DataFrame:
    paper = paper_numbers()
    paper = paper[paper["table"] == ("table1" if which == "val" else "table2")]
    merged = table.merge(
        paper[["task", "optimizer", "seconds", "target"]].rename(
            columns={"seconds": "paper_seconds", "target": "paper_target"}
        ),
        on=["task", "optimizer"],
        how="left",
    )
    ratios = {}
    for key in TASKS:
        for base, fosi in PAIRS:
            p = paper[(paper["task"] == key) & (paper["optimizer"].isin([base, fosi]))].set_index("optimizer")
            if base in p.index and fosi in p.index:
                ratios[(key, fosi)] = float(p.loc[fosi, "seconds"] / p.loc[base, "seconds"])
    merged["paper_ratio"] = [
        ratios.get((t, o), math.nan) for t, o in zip(merged["task"], merged["optimizer"])
    ]
    return merged


def _fmt(value: float, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "never"
    return f"{value:.{digits}f}"


def _fmt_target(task: Task, value: float, which: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if which == "val" and task.val_mode == "max":
        return f"{100 * value:.1f}%"
    return f"{value:.4g}"


def markdown_table(table: pd.DataFrame, which: str, profile: str, clock: str) -> str:
    """Paper layout: one row per task, HB | FOSI-HB (target) | Adam | FOSI-Adam (target), ours next
    to the paper's, plus the FOSI/base ratios."""
    metric = "validation metric" if which == "val" else "training loss"
    title = "Table 1" if which == "val" else "Table 2"
    lines = [
        f"### FOSI {title}: seconds to reach the base optimizer's best {metric} "
        f"(profile `{profile}`, clock `{clock}`; paper: A40 GPU, JAX)",
        "",
        "Clock `algo`: the loop's optimizer-step time without evaluation (CPU runs of the driver: process"
        " CPU seconds, one thread); `wall`: elapsed time with evaluation, as the paper's.",
        "",
        "| Task | HB | FOSI-HB (target) | ratio | Adam | FOSI-Adam (target) | ratio | paper HB | paper FOSI-HB "
        "| paper ratio | paper Adam | paper FOSI-Adam | paper ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for key, task in TASKS.items():
        if key not in set(table["task"]):
            continue
        sub = table[table["task"] == key].set_index("optimizer")
        cells = []
        for base, fosi in PAIRS:
            b, f = sub.loc[base], sub.loc[fosi]
            b_cell = _fmt(b["seconds"]) if b["status"] != "missing" else "missing"
            if b["status"] == "diverged":
                b_cell += " (diverged)"
            f_cell = _fmt(f["seconds"]) if f["status"] != "missing" else "missing"
            if f["status"] == "diverged":
                f_cell += " (diverged)"
            f_cell += f" ({_fmt_target(task, b['target'], which)})"
            cells += [b_cell, f_cell, _fmt(f["ratio"], 2)]
        paper_cells = []
        for base, fosi in PAIRS:
            b, f = sub.loc[base], sub.loc[fosi]
            paper_cells += [
                _fmt(b["paper_seconds"], 0),
                _fmt(f["paper_seconds"], 0),
                _fmt(f["paper_ratio"], 2),
            ]
        lines.append(f"| {key.upper()} | " + " | ".join(cells + paper_cells) + " |")
        if (sub["status"] == "missing").all() and task.data_note:
            notes.append(f"{key.upper()}: no runs ({task.data_note}).")
    ours = table[table["ratio"].notna() & np.isfinite(table["ratio"])]["ratio"]
    shown = table.drop_duplicates(["task", "optimizer"])["paper_ratio"].dropna()
    paper = paper_numbers()
    paper = paper[paper["table"] == ("table1" if which == "val" else "table2")].set_index(
        ["task", "optimizer"]
    )
    all_ratios = [
        paper.loc[(t, f), "seconds"] / paper.loc[(t, b), "seconds"] for t in TASKS for b, f in PAIRS
    ]
    lines.append("")
    lines.append(
        f"Mean FOSI/base ratio: ours {_fmt(float(ours.mean()) if len(ours) else math.nan, 3)} over {len(ours)} "
        f"pairs reached; paper {_fmt(float(shown.mean()) if len(shown) else math.nan, 3)} over the same "
        f"{len(shown)} pairs ({_fmt(float(np.mean(all_ratios)), 4)} over all 10). `never`: FOSI did not "
        "reach the target within the run; ratio `never` = inf."
    )
    unfinished = table[~table["status"].isin(["completed", "diverged", "missing"])]
    for _, r in unfinished.iterrows():
        notes.append(
            f"{r['task'].upper()} {LABELS[r['optimizer']]}: run status {r['status']} (partial record)."
        )
    lines += notes
    return "\n".join(lines) + "\n"


def best_lbfgs(task_runs: dict[str, pd.DataFrame], task: Task) -> str | None:
    """The L-BFGS history with the lowest validation loss over training (the paper's selection);
    diverged runs count with the value they reached before diverging."""
    best, best_key = math.inf, None
    for key, rows in task_runs.items():
        if not key.startswith("lbfgs"):
            continue
        value, _ = best_point(eval_curve(rows, task.val_loss, scale=task.val_loss_scale), "min")
        if math.isfinite(value) and value < best:
            best, best_key = value, key
    if best_key is None:
        keys = sorted(k for k in task_runs if k.startswith("lbfgs"))
        return keys[0] if keys else None
    return best_key


def best_kfac(task_runs: dict[str, pd.DataFrame], task: Task) -> str | None:
    """The K-FAC configuration with the lowest validation loss over training."""
    best, best_key = math.inf, None
    for key, rows in task_runs.items():
        if not key.startswith("kfac"):
            continue
        value, _ = best_point(eval_curve(rows, task.val_loss, scale=task.val_loss_scale), "min")
        if math.isfinite(value) and value < best:
            best, best_key = value, key
    return best_key or next((k for k in sorted(task_runs) if k.startswith("kfac")), None)
