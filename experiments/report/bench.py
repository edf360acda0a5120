"""Cross-paper benchmark table (``make bench``): optimizer cost relative to Adam.

Every optimizer's step time and optimizer-state memory relative to Adam on the tasks it applies
to, read from the JSON the ``benchmarks/`` scripts write (nothing is re-measured here).

    python -m experiments.report.bench run --quick   # run the benchmark scripts (quick: minutes, 1 thread)
    python -m experiments.report.bench table         # results/tables/bench_cross_paper.{md,csv}

Sources: ``bench_llm_optim.json`` (RACS/Alice/GaLore/Fira/APOLLO on the LLaMA-60M matrices, step and
state bytes), ``bench_fgn.json`` (FGN/SGN on the linear head, per number of classes C) and
``fosi.json`` (FOSI-HB/FOSI-Adam on an MLP/autoencoder, per-step and amortised with the ESE).
SHF-LSMR is not in this table: ``bench_shf.py`` times Gauss-Newton products, not optimizer steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from experiments.report.core import REPO

BENCH = REPO / "results" / "benchmarks"


def commands(quick: bool, py: str = sys.executable) -> list[list[str]]:
    """The benchmark commands, ``python -m benchmarks.<script>`` from the repository root.

    Args:
        quick: Quick mode (about 5 min on 2 shared cores), written to ``results/benchmarks/quick/``
            so it never overwrites the papers' full benchmark outputs.
        py: The Python interpreter.

    Returns:
        One argv list per benchmark.
    """
    if quick:
        out = BENCH / "quick"
        return [
            [py, "-m", "benchmarks.bench_llm_optim", "--quick", "--threads", "1", "--out-dir", str(out)],
            [py, "-m", "benchmarks.bench_fgn", "--classes", "196", "1024", "--batch-size", "256", "--dim", "512",
             "--repeats", "3", "--threads", "1", "--out", str(out)],
            [py, "-m", "benchmarks.bench_fosi", "--models", "mlp", "--bases", "heavy_ball", "adam", "--rounds", "4",
             "--clock", "cpu", "--threads", "1", "--out", str(out / "fosi.json")],
        ]  # fmt: skip
    return [
        [py, "-m", "benchmarks.bench_llm_optim", "--out-dir", str(BENCH)],
        [py, "-m", "benchmarks.bench_fgn", "--out", str(BENCH)],
        [py, "-m", "benchmarks.bench_fosi", "--out", str(BENCH / "fosi.json")],
    ]


def run(quick: bool) -> None:
    """Run the benchmark scripts of :func:`commands` one after the other, from the repository root.

    Each runs with ``OPENBLAS_NUM_THREADS=1`` and ``PYTHONPATH=<repo>/src``. A script that fails
    is reported and skipped (its row of the table shows as not run); nothing is raised.

    Args:
        quick: Quick mode (see :func:`commands`).
    """
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    for cmd in commands(quick):
        print("+", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, cwd=REPO, env=env, check=False)
        if done.returncode:
            print(f"  (exit {done.returncode}; its row shows as not run)", flush=True)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


LLM_LABELS = {
    "adamw_fused": "Adam (AdamW, fused)",
    "adamw_foreach": "Adam (AdamW, foreach)",
    "racs": "RACS",
    "racs_loop": "RACS (per-matrix loop)",
    "racs_foreach": "RACS (foreach: stacked matrices)",
    "alice": "Alice",
    "alice_loop": "Alice (per-matrix loop)",
    "alice_foreach": "Alice (foreach: stacked plain steps)",
    "alice0": "Alice-0",
    "galore": "GaLore",
    "fira": "Fira",
    "apollo": "APOLLO",
    "apollo_mini": "APOLLO-Mini",
    "kozistr_alice": "Alice (kozistr reference)",
}


def llm_rows(data: dict) -> list[dict]:
    """Table rows from ``bench_llm_optim.json`` (RACS/Alice and the low-rank baselines).

    Args:
        data: The parsed JSON: ``results`` (one entry per method with ``method``,
            ``amortised_ms`` and ``state_bytes``) and the run's ``K``, ``threads``,
            ``load_average_1m`` and ``quick``.

    Returns:
        One row per method (see :func:`table` for the columns); the reference is fused AdamW,
        else foreach AdamW. Empty when neither was measured.
    """
    res = {r["method"]: r for r in data.get("results", [])}
    ref = res.get("adamw_fused") or res.get("adamw_foreach")
    if ref is None:
        return []
    rows = []
    for key, r in res.items():
        label = LLM_LABELS.get(key, key)
        if key in ("racs", "alice", "alice0") and data.get("device") == "cuda":
            # CUDA records made before the stacked, banked path (issue 41) do not say their path
            path = r.get("step_path") or "per-matrix loop, the earlier CUDA path"
            label = f"{label} ({path})"
        rows.append(
            {
                "paper": "RACS/Alice",
                "task": "LLaMA-60M matrices (step on fixed grads)",
                "optimizer": label,
                "step ms": r["amortised_ms"],
                "step / Adam": r["amortised_ms"] / ref["amortised_ms"],
                "state MiB": r["state_bytes"] / 2**20,
                "state / Adam": r["state_bytes"] / ref["state_bytes"] if ref["state_bytes"] else math.nan,
                "notes": f"amortised over K={data.get('K')} refreshes; threads {data.get('threads')}; "
                f"load {data.get('load_average_1m', math.nan):.1f}"
                + ("; quick" if data.get("quick") else ""),
            }
        )
    return rows


FGN_OPTIMIZERS = {
    "sgn": "SGN (CG in parameter space)",
    "fgn_affine": "FGN (closed-form Gram)",
    "fgn_generic": "FGN (generic, torch.func)",
}


def fgn_rows(data: dict) -> list[dict]:
    """Table rows from ``bench_fgn.json`` (FGN and SGN on the linear head).

    Args:
        data: The parsed JSON: ``ratios_to_adam`` and ``seconds`` per number of classes C and
            method, plus ``b``, ``D``, ``clock``, ``threads`` and ``load_avg_1min``.

    Returns:
        One row per (C, method) for the methods of :data:`FGN_OPTIMIZERS` (Adam itself and the
        GGN-product micro-benchmarks are left out); memory columns are NaN (not measured).
    """
    rows = []
    for c, ratios in data.get("ratios_to_adam", {}).items():
        secs = data["seconds"][c]
        for key, ratio in ratios.items():
            if key not in FGN_OPTIMIZERS:  # adam itself and the GGN-product micro-benchmarks
                continue
            rows.append(
                {
                    "paper": "FGN",
                    "task": f"linear head b={data.get('b')}, D={data.get('D')}, C={c}",
                    "optimizer": FGN_OPTIMIZERS[key],
                    "step ms": 1e3 * secs[key],
                    "step / Adam": ratio,
                    "state MiB": math.nan,
                    "state / Adam": math.nan,
                    "notes": f"clock {data.get('clock')}; threads {data.get('threads')}; load "
                    + "-".join(f"{x:.1f}" for x in data.get("load_avg_1min", [])),
                }
            )
    return rows


def fosi_rows(data: dict) -> list[dict]:
    """Table rows from ``fosi.json`` (each base optimizer and FOSI around it).

    Args:
        data: The parsed JSON: ``results`` (one entry per model with ``model``, ``params``,
            ``batch`` and ``steps``: per base, ``base_step_s``, ``fosi_step_s`` and
            ``amortised_over_base``) and ``meta`` (``clock``).

    Returns:
        Two rows per base (the base and ``fosi_<base>``) for every model that has an Adam
        measurement, the step time relative to Adam's; a FOSI row's notes give its cost with the
        ESE amortised. Memory columns are NaN (not measured).
    """
    rows = []
    meta = data.get("meta", {})
    for model in data.get("results", []):
        steps = {s["base"]: s for s in model.get("steps", [])}
        adam = steps.get("adam")
        if adam is None:
            continue
        for base, s in steps.items():
            for label, t in ((base, s["base_step_s"]), (f"fosi_{base}", s["fosi_step_s"])):
                amort = s.get("amortised_over_base") if label.startswith("fosi") else None
                rows.append(
                    {
                        "paper": "FOSI",
                        "task": f"{model['model']} ({model.get('params', '?')} params, batch {model.get('batch')})",
                        "optimizer": label,
                        "step ms": 1e3 * t,
                        "step / Adam": t / adam["base_step_s"],
                        "state MiB": math.nan,
                        "state / Adam": math.nan,
                        "notes": (f"with ESE amortised: {amort * s['base_step_s'] / adam['base_step_s']:.2f}x Adam; " if amort else "")
                        + f"clock {meta.get('clock', '?')}",
                    }
                )  # fmt: skip
    return rows


SOURCES = {
    "bench_llm_optim.json": (llm_rows, "make bench-optim-quick"),
    "bench_fgn.json": (fgn_rows, "make bench-fgn"),
    "fosi.json": (fosi_rows, "make bench-fosi"),
}


# Where each device's outputs are, newest first: the CPU's full run, else its quick one; on CUDA the
# slices' outputs (``cuda/lean``: the bench-lean slice's measurement of the stacked, banked steps).
DEVICE_DIRS = {"cpu": ("", "quick"), "cuda": ("cuda/lean", "cuda/foreach", "cuda")}


def device_label(data: dict) -> str:
    """The device a benchmark JSON was measured on, as the table shows it ("CPU" or the GPU's name)."""
    name = data.get("device_name") or data.get("device") or "cpu"
    return "CPU" if str(name).lower() == "cpu" else str(name)


def table(bench_dir: Path = BENCH, out_dir: Path = REPO / "results" / "tables") -> pd.DataFrame:
    """Build the cross-paper table and write ``bench_cross_paper.csv`` and ``bench_cross_paper.md``.

    For each source of :data:`SOURCES` and each device of :data:`DEVICE_DIRS` the first output
    found is read (CPU: the full benchmark output in ``bench_dir``, else the quick-mode one in
    ``bench_dir/quick``; CUDA: ``bench_dir/cuda[/lean|/foreach]``); a source with no CPU output is listed
    as not run, with the command that produces it, under the Markdown table. Ratios are always
    to Adam on the same device.

    Args:
        bench_dir: Where the benchmark JSON files are (``results/benchmarks``).
        out_dir: Where the two tables are written (created if needed).

    Returns:
        One row per (paper, task, optimizer, device): columns ``paper``, ``task``, ``optimizer``,
        ``device``, ``step ms``, ``step / Adam``, ``state MiB``, ``state / Adam`` (NaN: not
        measured), ``notes`` and ``source`` (the JSON file it came from).
    """
    rows, missing = [], []
    for name, (reader, cmd) in SOURCES.items():
        for device, subdirs in DEVICE_DIRS.items():
            paths = [bench_dir / sub / name if sub else bench_dir / name for sub in subdirs]
            src = next((p for p in paths if p.exists()), None)
            data = _load(src) if src else None
            got = reader(data) if data else []
            for row in got:
                row["device"] = device_label(data)
                row["source"] = (
                    str(src.relative_to(bench_dir.parent))
                    if src.is_relative_to(bench_dir.parent)
                    else str(src)
                )
            if got:
                rows += got
            elif device == "cpu":
                missing.append(f"{name}: not run (`make bench` or `{cmd}`)")
    frame = pd.DataFrame(rows)
    if not frame.empty:
        cols = list(frame.columns)
        cols.insert(cols.index("optimizer") + 1, cols.pop(cols.index("device")))
        frame = frame[cols]
    out_dir.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out_dir / "bench_cross_paper.csv", index=False)
    lines = [
        "# Cross-paper optimizer cost relative to Adam",
        "",
        "Step time and optimizer-state memory of every optimizer on the tasks it applies to, divided by Adam's "
        "on the same task and device, read from `results/benchmarks/*.json` (`make bench`; GPU rows: "
        "`results/benchmarks/cuda/`, from the GPU slices of docs/gpu_ledger.md). CPU timings on a shared "
        "2-core machine are contended (load in the notes); '–' = not measured by that benchmark "
        "(bench_fgn and bench_fosi time steps only). SHF-LSMR has no Adam-comparable step benchmark.",
        "",
    ]
    if not frame.empty:
        show = frame.copy()
        for col in ("step ms", "step / Adam", "state MiB", "state / Adam"):
            show[col] = [("–" if not math.isfinite(v) else f"{v:.3g}") for v in show[col]]
        lines.append("| " + " | ".join(show.columns) + " |")
        lines.append("|" + "---|" * len(show.columns))
        lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in show.itertuples(index=False)]
    lines += ["", *[f"- {m}" for m in missing]]
    (out_dir / "bench_cross_paper.md").write_text("\n".join(lines) + "\n")
    return frame


def main(argv: list[str] | None = None) -> None:
    """Command line: ``run [--quick]`` runs the benchmarks, ``table`` builds and prints the table.

    Args:
        argv: The arguments (``run|table``, ``--quick``, ``--bench-dir``, ``--out-dir``);
            ``None``: ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["run", "table"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--bench-dir", type=Path, default=BENCH)
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "tables")
    args = parser.parse_args(argv)
    if args.what == "run":
        run(args.quick)
    else:
        frame = table(args.bench_dir, args.out_dir)
        print((args.out_dir / "bench_cross_paper.md").read_text())
        print(f"{len(frame)} rows -> {args.out_dir / 'bench_cross_paper.md'}")


if __name__ == "__main__":
    main()
