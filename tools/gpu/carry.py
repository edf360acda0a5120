"""Carry (here, before the device call): ``gpu_carry/`` with only the slice's wheels, data and the
checkpoints of its unfinished runs, within the device's 64 MiB with the tree; prints the call."""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tools.gpu.common import FINAL, MIB, REPO, Log, canon, gzip_file, mib, now_utc, run_status, sha256_file
from tools.gpu.ledger import pick

CACHE = Path(os.environ.get("GPU_SLICE_CACHE", REPO / "outputs" / "gpu_carry_cache"))
WHEEL_DIRS = (REPO / "wheelhouse", REPO / "wheelhouse" / "gpu")
TREE_LIMIT_MIB = 60.0  # refuse above this (the device tool's limit is 64 MiB)
# data folders whose loader also reads the uncompressed file (curvopt.data.mnist, curvopt.data.c4):
# their *.gz are carried as <stem>.xz (raw bytes, xz: 2 MB less for MNIST), decompressed there to <stem>
RAW_OK = ("mnist", "c4")
TEXT_SUFFIXES = (".txt", ".json", ".jsonl", ".csv", ".md")


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
        status = run_status(rdir)
        if status in FINAL or status is None or not ck.exists():
            continue
        packed = _cached(ck, f"ckpt/{run.rel_dir()}/checkpoint.pt.gz", gzip_file)
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
    pending = [r for r in sl.runs if r.kind == "module" or run_status(r.run_dir(results)) not in FINAL]
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
