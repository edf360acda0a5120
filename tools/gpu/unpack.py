"""Unpack (here, after the device call): verify ``$OUT`` against its manifest, extract the records and
checkpoints into ``results/`` (a run that went further here keeps its records), append the ledger
row, regenerate the slice's figures and the report."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from tools.gpu import slices as gpu_queue
from tools.gpu.common import FINAL, Refused, now_utc, sha256_file
from tools.gpu.ledger import append_ledger, read_ledger
from tools.gpu.slices import Slice, find_slice, load_queue

STAMP = re.compile(r"\d{8}T\d{6}Z")


def _safe(name: str, prefixes: tuple[str, ...]) -> bool:
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts and name.startswith(prefixes)


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
            f"refused: {path} names slice {man.get('slice')!r}, which is not a slice of {gpu_queue.QUEUE.name} "
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
