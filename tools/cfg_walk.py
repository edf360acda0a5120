"""Follow the run config through one tiny run: which source files read it, and in what order.

Issue 29, item 4 ("one way through the build") measures how often the config ``cfg`` enters and
leaves the files of the build. This tool composes ``conf/`` with Hydra's compose API (after
``curvopt.training.schema.register_schemas()``), calls ``run_from_config(cfg)`` for a tiny run and
records every *access* to the config while it runs:

* any method call on a ``DictConfig`` / ``ListConfig`` (attribute and item reads and writes,
  ``get``, ``in``, iteration, ``items``/``keys``/``values``, ``len``, ``pop``) and any ``OmegaConf.*``
  static function called with one (``to_container``, ``to_yaml``, ``select``, ``update``, ...);
* unless ``--untyped``: also reads of the fields of the config's typed forms, the dataclasses of
  ``curvopt.training.schema`` (the trainer settings the loop consumes, their defaults) and, in
  older code, ``curvopt.training.loop.LoopConfig``: the same settings, in another form.

An access is charged to the innermost caller outside OmegaConf, Hydra, the standard library and
this tool (the line of curvopt code that asked). The sequence of charged files is then cut into
*stays* (maximal runs of consecutive accesses in one file); a *return* is a stay in a file the
walk had already left once. The numbers printed: stays, files, returns, and per file its visits
(stays) and accesses.

Which code is measured is whichever ``curvopt`` is imported, and ``conf/`` is taken from the same
checkout (``<checkout>/src/curvopt`` -> ``<checkout>/conf``), so the same tool measures another
checkout with ``PYTHONPATH=<checkout>/src:<checkout>``.

Usage (2-core machine: nice it)::

    PYTHONPATH=src:. CURVOPT_DATA_DIR=/work/shared/data nice -n 15 .venv/bin/python tools/cfg_walk.py \\
        experiment=shf_fig2_usps optimizer=shf_lsmr trainer.max_steps=2

    --untyped     count DictConfig accesses only (not the typed trainer object)
    --events      also print every stay with its first and last line
    --json PATH   write the numbers and the stays as JSON
    --resume      measure a resumed run instead: the tiny run first runs unmeasured (keeping its
                  checkpoint), then ``trainer.resume=true`` extends it by one step, measured

The tool adds ``logger=none``, ``trainer.progress=false`` and a temporary ``paths.results_dir``
(removed afterwards) to the overrides; what the run writes is not kept.

Measured for issue 29 (the command above; stays / files / returns):

* before (``check_trainer`` in build.py, ``LoopConfig`` in loop.py, ``trainer_default`` reads of
  ``TrainerSchema``): 118 / 3 / 115 (DictConfig only: 5 / 2 / 3); resumed: 124 / 4 / 120 (11 / 3 / 8);
* after (``RunSettings`` / ``TrainerConfig`` checked once in schema.py, the build reads them, the loop
  reads ``TrainerConfig``): 3 / 3 / 0 (DictConfig only: 2 / 2 / 0); resumed: 6 / 4 / 2 (5 / 3 / 2:
  the saved config is taken and checked after the run directory is claimed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import sysconfig
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOOL = str(Path(__file__).resolve())
STDLIB = tuple(
    str(Path(p).resolve()) + "/"
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)
SKIPPED_PACKAGES = ("/omegaconf/", "/hydra/")
# DictConfig / ListConfig methods that read or write the config
CONTAINER_METHODS = (
    "__getattr__",
    "__getitem__",
    "__setattr__",
    "__setitem__",
    "__delattr__",
    "__delitem__",
    "__contains__",
    "__iter__",
    "__len__",
    "get",
    "pop",
    "items",
    "keys",
    "values",
    "setdefault",
    "append",
)


_MISSING = object()


class Walk:
    """The recorded accesses: ``(file, line, what)`` in order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.events: list[tuple[str, int, str]] = []
        self.local = threading.local()
        self.on = False

    def caller(self) -> tuple[str, int]:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            resolved = name if name.startswith("<") else str(Path(name).resolve())
            if not (
                resolved == TOOL
                or resolved.startswith("<")
                or any(p in resolved for p in SKIPPED_PACKAGES)
                or (resolved.startswith(STDLIB) and "site-packages" not in resolved)
            ):
                return self.short(resolved), frame.f_lineno
            frame = frame.f_back
        return "<unknown>", 0

    def short(self, path: str) -> str:
        p = Path(path)
        try:
            return str(p.relative_to(self.root))
        except ValueError:
            return str(p)

    def guarded(self, fn: Any, what: str, applies: Any = None) -> Any:
        """``fn`` recording one access per outermost call (nested config calls are part of it)."""

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self.local, "depth", 0)
            if not self.on or depth or (applies is not None and not applies(args, kwargs)):
                return fn(*args, **kwargs)
            self.local.depth = depth + 1
            try:
                file, line = self.caller()
                self.events.append((file, line, what))
                return fn(*args, **kwargs)
            finally:
                self.local.depth = depth

        return inner


def install(walk: Walk, typed: bool) -> Callable[[], None]:
    """Patch OmegaConf's containers (and the config's typed forms) to report to ``walk``.

    Returns:
        What undoes every patch.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.basecontainer import BaseContainer

    saved: list[tuple[type, str, Any]] = []  # (owner, name, own attribute before, or _MISSING)

    def patch(owner: type, name: str, value: Any) -> None:
        saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    for cls in (DictConfig, ListConfig, BaseContainer):
        for name in CONTAINER_METHODS:
            if name in vars(cls):
                patch(cls, name, walk.guarded(vars(cls)[name], f"{cls.__name__}.{name}"))

    def has_container(args: tuple, kwargs: dict) -> bool:
        return any(isinstance(a, BaseContainer) for a in (*args, *kwargs.values()))

    for name, member in list(vars(OmegaConf).items()):
        if isinstance(member, staticmethod) and not name.startswith("_"):
            fn = walk.guarded(member.__func__, f"OmegaConf.{name}", has_container)
            patch(OmegaConf, name, staticmethod(fn))
    if typed:
        for cls in typed_classes():
            fields = frozenset(f.name for f in dataclasses.fields(cls))
            original = cls.__getattribute__

            def read(obj: Any, name: str, _orig: Any = original) -> Any:
                return _orig(obj, name)

            guarded = walk.guarded(read, f"{cls.__name__}.field", lambda a, k, f=fields: a[1] in f)
            patch(cls, "__getattribute__", lambda obj, name, g=guarded: g(obj, name))

    def uninstall() -> None:
        for owner, name, before in reversed(saved):
            if before is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

    return uninstall


def typed_classes() -> list[type]:
    """The config's typed forms in the imported code: the dataclasses of ``curvopt.training.schema``
    and ``curvopt.training.trainer_config`` (and the older ``curvopt.training.loop.LoopConfig``)."""
    from curvopt.training import loop, schema, trainer_config

    found = [
        v
        for module in (schema, trainer_config)
        for v in vars(module).values()
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == module.__name__
    ]
    if dataclasses.is_dataclass(getattr(loop, "LoopConfig", None)):
        found.append(loop.LoopConfig)
    return found


def stays(events: list[tuple[str, int, str]]) -> list[dict[str, Any]]:
    """Maximal runs of consecutive accesses in one file."""
    out: list[dict[str, Any]] = []
    for file, line, what in events:
        if out and out[-1]["file"] == file:
            out[-1]["accesses"] += 1
            out[-1]["last_line"] = line
        else:
            out.append({"file": file, "accesses": 1, "first_line": line, "last_line": line, "first": what})
    left: set[str] = set()
    for i, stay in enumerate(out):
        stay["return"] = stay["file"] in left
        if i:
            left.add(out[i - 1]["file"])
    return out


def summarise(walk: Walk) -> dict[str, Any]:
    runs = stays(walk.events)
    visits = Counter(s["file"] for s in runs)
    accesses = Counter(f for f, _, _ in walk.events)
    return {
        "accesses": len(walk.events),
        "stays": len(runs),
        "files": len(visits),
        "returns": sum(s["return"] for s in runs),
        "per_file": {f: {"visits": visits[f], "accesses": accesses[f]} for f in visits},
        "walk": runs,
    }


def measure(overrides: list[str], typed: bool = True, resume: bool = False) -> dict[str, Any]:
    """Run the tiny run of ``overrides`` with the hooks installed; the walk's numbers.

    Args:
        overrides: Hydra overrides (``logger=none``, ``trainer.progress=false`` and a temporary
            ``paths.results_dir`` are added).
        typed: Also count reads of the config's typed forms.
        resume: Measure a resumed run (``--resume``).

    Returns:
        :func:`summarise`'s dict, plus ``checkout`` and the run's ``summary``.
    """
    from hydra import compose, initialize_config_dir

    import curvopt
    from curvopt.training.build import run_from_config
    from curvopt.training.schema import register_schemas

    checkout = Path(curvopt.__file__).resolve().parents[2]
    register_schemas()
    walk = Walk(checkout)
    with tempfile.TemporaryDirectory(prefix="cfg_walk_") as tmp:
        given = ["logger=none", "trainer.progress=false", *overrides, f"paths.results_dir={tmp}"]
        with initialize_config_dir(config_dir=str(checkout / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=given)
            if resume:  # the run to resume, unmeasured
                given += ["run_id=cfg_walk", "trainer.keep_checkpoint=true"]
                first = compose(config_name="config", overrides=given)
                run_from_config(first)
                more = f"trainer.max_steps={int(first.trainer.max_steps) + 1}"
                cfg = compose(config_name="config", overrides=[*given, "trainer.resume=true", more])
        uninstall = install(walk, typed=typed)
        walk.on = True
        try:
            summary = run_from_config(cfg)
        finally:
            walk.on = False
            uninstall()
    return {**summarise(walk), "checkout": str(checkout), "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the tiny run")
    parser.add_argument("--untyped", action="store_true", help="DictConfig accesses only")
    parser.add_argument("--events", action="store_true", help="print every stay")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    parser.add_argument("--resume", action="store_true", help="measure a resumed run")
    args = parser.parse_args(argv)

    result = measure(args.overrides, typed=not args.untyped, resume=args.resume)
    summary = result.pop("summary")
    print(f"code: {result['checkout']}  run: {summary['status']} after {summary['steps']} steps")
    what = "DictConfig only" if args.untyped else "typed too"
    print(f"overrides: {' '.join(args.overrides)}  ({what}{', resumed' if args.resume else ''})")
    if args.events:
        for i, stay in enumerate(result["walk"], 1):
            mark = "  (return)" if stay["return"] else ""
            print(
                f"  {i:3d}. {stay['file']}:{stay['first_line']}-{stay['last_line']}  "
                f"{stay['accesses']} access(es){mark}"
            )
    print(
        f"stays: {result['stays']}  files: {result['files']}  returns: {result['returns']}  "
        f"accesses: {result['accesses']}"
    )
    for file, n in sorted(result["per_file"].items(), key=lambda kv: -kv[1]["visits"]):
        print(f"  {file}: {n['visits']} visit(s), {n['accesses']} access(es)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
