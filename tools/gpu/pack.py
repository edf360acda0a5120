"""Pack (there, after the runs): what the slice wrote into ``$OUT`` within the device's return limits
(8 files, 16 MiB each, 64 MiB together): records, checkpoints of unfinished runs, logs; archives
over 15 MiB split into ``.partNN`` pieces."""

from __future__ import annotations

import fnmatch
import os
import shutil
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tools.gpu.common import FINAL, MIB, Log, gzip_file, run_status, sha256_file

if TYPE_CHECKING:
    from tools.gpu.run import Runner


OUT_MAX_FILES = 8
OUT_MAX_BYTES = 62 * MIB  # of the 64 MiB a call may return
PART_BYTES = 15 * MIB  # each returned file <= 16 MiB
SKIP_PACK = ("run.lock", ".tmp")


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
        if not ck.exists() or not _written(ck, before) or run_status(rdir) in FINAL:
            continue
        gz = stage / "ckpt" / f"{job.run.id}.pt.gz"
        gz.parent.mkdir(exist_ok=True)
        gzip_file(ck, gz)
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
