"""Offline wheelhouse: the wheels of this project's requirements that a target machine lacks.

Many cluster GPU nodes have no internet. Run this where PyPI is reachable, copy the folder over,
and install from it with no index (docs/cluster.md):

    python tools/gpu/wheelhouse.py                                   # Python 3.12, manylinux x86-64
    python tools/gpu/wheelhouse.py --python-version 3.11 --platform manylinux_2_17_x86_64 --dest wh311
    python tools/gpu/wheelhouse.py --with wandb --with submitit      # optional extras
    python tools/gpu/wheelhouse.py --have bitsandbytes --dry-run     # the target already has it
    python tools/gpu/wheelhouse.py --only hydra-core,omegaconf --dest wheelhouse/gpu   # just these (+ deps)
    # on the node:
    pip install --no-index --no-deps --find-links wheelhouse -r wheelhouse/requirements.txt

What goes in: the names of ``requirements.txt`` minus torch, minus ``USUALLY_PRESENT`` (what a CUDA
PyTorch image with transformers ships; ``--no-assume-present`` keeps them), minus the optional
heavy packages in ``OPTIONAL`` unless ``--with <group>`` asks for them, minus ``--have``/``--exclude``;
then, transitively, their dependencies as the downloaded wheels declare them for the target Python
and platform, with the same exclusions. Versions are the ones installed in this environment
(``importlib.metadata``), so the target gets the versions the tests ran with; a package not
installed here is taken at PyPI's newest version that has a wheel for the target.

Downloads are ``pip download --no-deps --only-binary=:all: --python-version X --implementation cp
--platform ...`` per package. A package that exists only as an sdist (antlr4-python3-runtime 4.9.3,
which hydra-core and omegaconf need) is downloaded as source and built here with ``pip wheel
--no-deps``; a pure-Python build gives a ``py3-none-any`` wheel that installs anywhere. A
``manylinux_2_Y`` platform is expanded to every older ``manylinux_2_X`` (X >= 17) and the legacy
manylinux2014/2010/1 aliases, which pip does not do by itself for ``--platform``.

Outputs in ``--dest`` (default ``wheelhouse/``, git-ignored): the wheels, ``requirements.txt``
(pinned names, the install list) and ``manifest.json`` (file, version, size, sha256, why it is there).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pragma: no cover - pip always vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[2]

# Never downloaded: the target installs the CUDA build of torch itself (and its CUDA libraries).
NEVER = {"torch", "triton", "torchvision", "torchaudio"}
NEVER_PREFIXES = ("nvidia-",)

# What a CUDA PyTorch image with the HF stack usually has (NGC PyTorch containers, the common
# cluster "pytorch + transformers" modules). Skipped by default; --no-assume-present keeps them.
USUALLY_PRESENT = {
    # our requirements.txt
    "numpy", "scipy", "pandas", "matplotlib", "tqdm", "pyyaml", "tabulate", "h5py",
    "transformers", "tokenizers", "sentencepiece",
    # what those pull in
    "huggingface-hub", "safetensors", "regex", "requests", "urllib3", "certifi", "idna",
    "charset-normalizer", "filelock", "fsspec", "packaging", "typing-extensions", "jinja2",
    "markupsafe", "networkx", "sympy", "mpmath", "pillow", "python-dateutil", "pytz", "tzdata",
    "six", "setuptools", "wheel", "pip", "psutil", "pyarrow", "contourpy", "cycler", "fonttools",
    "kiwisolver", "pyparsing", "hf-xet", "typer", "click", "rich", "shellingham", "markdown-it-py",
    "mdurl", "pygments", "annotated-doc",
}  # fmt: skip

# Large and not needed for our runs: `logger=none` avoids wandb (local records only), and the
# datasets package is only the fallback downloader for MNIST/CIFAR-10 and the C4 hub stream.
OPTIONAL = {
    "wandb": ["wandb"],
    "datasets": ["datasets"],
    "submitit": ["hydra-submitit-launcher"],  # Hydra's SLURM launcher (docs/cluster.md)
    # galore-torch, fira and apollo-torch declare these, but the optimizers we run import neither:
    # curvopt.optim.lowrank loads GaLore's and APOLLO's own modules when bitsandbytes is missing
    # (41 MiB of the 49 MiB the two would add). Left out, the install needs pip's --no-deps.
    "8bit": ["bitsandbytes", "tensorly"],
}

DEFAULT_PLATFORMS = ["manylinux_2_28_x86_64"]


def _canon(name: str) -> str:
    return str(canonicalize_name(name))


def requirement_names(path: Path) -> list[str]:
    """Project names listed in a requirements file (comments, options and -r lines skipped)."""
    names = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        names.append(_canon(Requirement(line).name))
    return names


def expand_platforms(platforms: list[str]) -> list[str]:
    """``manylinux_2_Y_<arch>`` -> every ``manylinux_2_X_<arch>`` for 17 <= X <= Y, plus the legacy
    aliases manylinux2014 (= 2_17), manylinux2010 (= 2_12) and manylinux1 (= 2_5)."""
    out: list[str] = []
    for plat in platforms:
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", plat)
        legacy = re.fullmatch(r"manylinux(2014|2010|1)_(\w+)", plat)
        if m:
            glibc, arch = int(m.group(1)), m.group(2)
            tags = [f"manylinux_2_{x}_{arch}" for x in range(glibc, 16, -1)]
            if glibc >= 17:
                tags += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
        elif legacy:
            arch = legacy.group(2)
            order = ["2014", "2010", "1"]
            tags = [f"manylinux{v}_{arch}" for v in order[order.index(legacy.group(1)) :]]
        else:
            tags = [plat]
        out += [t for t in tags if t not in out]
    return out


def marker_environment(python_version: str, platforms: list[str]) -> dict[str, str]:
    """PEP 508 marker values of the target (from --python-version and the first --platform)."""
    plat = platforms[0] if platforms else ""
    if plat.startswith(("manylinux", "musllinux", "linux")):
        sys_platform, system = "linux", "Linux"
    elif plat.startswith("macosx"):
        sys_platform, system = "darwin", "Darwin"
    elif plat.startswith("win"):
        sys_platform, system = "win32", "Windows"
    else:
        sys_platform, system = sys.platform, ""
    machine = "x86_64"
    for arch in ("x86_64", "aarch64", "arm64", "ppc64le", "s390x", "i686"):
        if plat.endswith(arch):
            machine = arch
    full = python_version if python_version.count(".") >= 2 else python_version + ".0"
    return {
        "python_version": ".".join(python_version.split(".")[:2]),
        "python_full_version": full,
        "implementation_name": "cpython",
        "implementation_version": full,
        "platform_python_implementation": "CPython",
        "sys_platform": sys_platform,
        "platform_system": system,
        "platform_machine": machine,
        "os_name": "nt" if sys_platform == "win32" else "posix",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def wheel_requirements(wheel: Path, env: dict[str, str]) -> list[str]:
    """Dependencies a wheel declares (``Requires-Dist``) that apply to the target environment."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode("utf-8", "replace"))
    out = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        out.append(_canon(req.name))
    return out


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    )


def download_one(
    name: str, version: str | None, dest: Path, python_version: str, platforms: list[str]
) -> tuple[Path, str]:
    """One package's wheel into ``dest``; returns (wheel path, how: wheel | built-from-sdist)."""
    spec = f"{name}=={version}" if version else name
    before = set(dest.glob("*.whl"))
    plat_args = [a for p in platforms for a in ("--platform", p)]
    done = _pip(
        "download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
        "--implementation", "cp", *plat_args, "-d", str(dest), spec,
    )  # fmt: skip
    if done.returncode == 0:
        new = set(dest.glob("*.whl")) - before
        return (new.pop() if new else _find_wheel(dest, name, version)), "wheel"
    if "No matching distribution" not in done.stderr and "from versions: none" not in done.stderr:
        raise RuntimeError(f"pip download {spec} failed:\n{done.stderr.strip()[-2000:]}")
    # no wheel for the target: fetch the sdist and build a wheel here (fine for pure Python)
    with tempfile.TemporaryDirectory() as tmp:
        got = _pip("download", "--no-deps", "--no-binary=:all:", "-d", tmp, spec)
        if got.returncode != 0:
            raise RuntimeError(
                f"{spec}: no wheel for Python {python_version} / {platforms[0]} and no sdist:\n"
                + got.stderr.strip()[-2000:]
            )
        sdist = next(p for p in Path(tmp).iterdir() if p.is_file())
        built = _pip("wheel", "--no-deps", "-w", str(dest), str(sdist))
        if built.returncode != 0:
            raise RuntimeError(f"pip wheel {sdist.name} failed:\n{built.stderr.strip()[-2000:]}")
    wheel = _find_wheel(dest, name, version)
    if not wheel.name.endswith("-none-any.whl"):
        print(
            f"  WARNING: {wheel.name} was built for THIS machine's Python ({sys.version.split()[0]}); "
            f"it may not install on the target",
            file=sys.stderr,
        )
    return wheel, "built-from-sdist"


def _find_wheel(dest: Path, name: str, version: str | None) -> Path:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    hits = [
        p
        for p in dest.glob("*.whl")
        if re.sub(r"[-_.]+", "_", p.name.split("-")[0]).lower() == stem
        and (version is None or p.name.split("-")[1] == version)
    ]
    if not hits:
        raise RuntimeError(f"no wheel of {name} {version or ''} in {dest}")
    return max(hits, key=lambda p: p.stat().st_mtime)


def plan_roots(args: argparse.Namespace) -> tuple[list[tuple[str, str]], set[str]]:
    """([(package to start from, why)], packages never to download)."""
    skip = set(NEVER)
    if args.assume_present:
        skip |= USUALLY_PRESENT
    for item in args.have + args.exclude:
        skip |= {_canon(n) for n in item.split(",") if n.strip()}
    optional = {_canon(n) for group in OPTIONAL.values() for n in group}
    wanted = {_canon(n) for g in args.with_ for n in OPTIONAL[g]}
    skip |= optional - wanted  # also as dependencies of what is downloaded
    only = [_canon(n) for item in getattr(args, "only", []) for n in item.split(",") if n.strip()]
    if only:  # just these (and what they need): tools/gpu (make gpu-carry) carries a slice's few wheels
        return [(n, "--only") for n in only], skip - set(only)
    listed = requirement_names(Path(args.requirements))
    roots = [
        (n, "requirements.txt" if n in listed else "--with")
        for n in listed + sorted(wanted - set(listed))
        if n not in skip and not n.startswith(NEVER_PREFIXES) and (n not in optional or n in wanted)
    ]
    roots += [(_canon(n), "--add") for n in args.add]
    return roots, skip


def build(args: argparse.Namespace) -> dict:
    platforms = expand_platforms(args.platform or DEFAULT_PLATFORMS)
    env = marker_environment(args.python_version, platforms)
    roots, skip = plan_roots(args)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    queue = list(roots)
    done: dict[str, dict] = {}
    while queue:
        name, why = queue.pop(0)
        if name in done:
            continue
        version = installed_version(name)
        if args.dry_run:
            print(f"  {name}=={version or '(newest)'}  [{why}]")
            done[name] = {"name": name, "version": version, "why": why}
            # without downloading, follow the dependencies of the installed copy (this Python)
            reqs = []
            try:
                for line in md.requires(name) or []:
                    req = Requirement(line)
                    if req.marker is None or req.marker.evaluate(env):
                        reqs.append(_canon(req.name))
            except md.PackageNotFoundError:
                pass
        else:
            wheel, how = download_one(name, version, dest, args.python_version, platforms)
            version = version or wheel.name.split("-")[1]
            size = wheel.stat().st_size
            done[name] = {
                "name": name,
                "version": version,
                "file": wheel.name,
                "bytes": size,
                "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
                "how": how,
                "why": why,
            }
            print(f"  {wheel.name:70s} {size / 2**20:8.2f} MiB  [{why}]")
            reqs = wheel_requirements(wheel, env)
        for dep in reqs:
            if dep in skip or dep.startswith(NEVER_PREFIXES) or dep in done:
                continue
            queue.append((dep, f"needed by {name}"))
    total = sum(item.get("bytes", 0) for item in done.values())
    left_out = {_canon(n) for g, names in OPTIONAL.items() if g not in args.with_ for n in names}
    manifest = {
        "python_version": args.python_version,
        "platforms": platforms,
        "skipped_as_present": sorted(skip - left_out),
        "packages": sorted(done.values(), key=lambda d: d["name"]),
        "total_bytes": total,
        "optional_left_out": sorted(left_out),
        # --no-deps: requirements.txt pins the whole closure minus what the target has and the
        # optional groups left out (which some packages declare but our runs never import)
        "install": f"pip install --no-index --no-deps --find-links {dest} -r {dest}/requirements.txt",
    }
    if not args.dry_run:
        (dest / "requirements.txt").write_text(
            "# pip install --no-index --no-deps --find-links <this folder> -r requirements.txt\n"
            + "".join(f"{d['name']}=={d['version']}\n" for d in manifest["packages"])
        )
        (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"{len(done)} wheels, {total / 2**20:.1f} MiB in {dest}/")
        print(f"install on the target: {manifest['install']}")
    return manifest


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python-version", default="3.12", help="target Python (default 3.12)")
    parser.add_argument(
        "--platform",
        action="append",
        default=[],
        help="target platform tag, repeatable (default manylinux_2_28_x86_64, expanded to older glibc tags)",
    )
    parser.add_argument(
        "--dest", default="wheelhouse", help="output folder (default wheelhouse/, git-ignored)"
    )
    parser.add_argument("--requirements", default=str(REPO_ROOT / "requirements.txt"))
    parser.add_argument(
        "--have",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help="the target already has these: skip them (repeatable, comma-separated)",
    )
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="NAME[,NAME]", help="same as --have"
    )
    parser.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        choices=sorted(OPTIONAL),
        help="also include an optional group: "
        + ", ".join(f"{k} ({', '.join(v)})" for k, v in OPTIONAL.items()),
    )
    parser.add_argument("--add", action="append", default=[], metavar="NAME", help="an extra package")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help="only these packages and their dependencies (same exclusions), not requirements.txt "
        "(make gpu-carry: a GPU slice's wheels)",
    )
    parser.add_argument(
        "--no-assume-present",
        dest="assume_present",
        action="store_false",
        help="do not skip the packages CUDA images usually have (tools/gpu/wheelhouse.py USUALLY_PRESENT)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan from local metadata, download nothing"
    )
    args = parser.parse_args(argv)
    return build(args)


if __name__ == "__main__":
    main()
