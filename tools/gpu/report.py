"""A slice's records: each run's line of the manifest (steps before and after, median step and
inner-iteration times, what shared the GPU), the run's ``gpu_slice.json`` segment, the slice's
status and its Markdown report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.gpu.common import iso
from tools.gpu.slices import Slice

if TYPE_CHECKING:
    from tools.gpu.run import Job


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
            "slice": sl.id, "run": run.id, "started": iso(job.start), "ended": iso(job.end),
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
