"""The one entrypoint: compose a Hydra config, run it, write the run records.

python src/train.py experiment=mnist_autoencoder optimizer=adam trainer.max_steps=200
python src/train.py -m experiment=mnist_autoencoder optimizer=adam,heavy_ball optimizer.lr=1e-3,3e-3

Exit codes (docs/resume.md): 0 completed, 1 failed (an error during the run), 2 bad input
(stopped before training and before anything is written: config value such as run_id or seed, data
file or content, a model that does not fit the data, checkpoint, run directory), 3 diverged, 130 / 143
interrupted by SIGINT / SIGTERM (checkpoint written; resume with trainer.resume=true). A sweep
(-m) stops at the first interrupted job; otherwise it runs every job and exits with the most
severe code among them (failed, bad input, diverged).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

# `curvopt` without an install. `python src/train.py` has src/ first on sys.path already; this line is for
# tools/gpu/smoke.py, which runs this file in-process (runpy.run_path), where nothing else adds it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from curvopt.errors import (  # noqa: E402
    EXIT_BAD_INPUT,
    EXIT_COMPLETED,
    EXIT_DIVERGED,
    EXIT_FAILED,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    BadInputError,
    exit_code,
)
from curvopt.training.build import run_from_config  # noqa: E402
from curvopt.training.rundir import CommandLine  # noqa: E402
from curvopt.training.schema import register_schemas  # noqa: E402

register_schemas()  # trainer/paths/logger schemas, checked when Hydra composes conf/

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # hydra.main's config_path below

log = logging.getLogger("train")
# exit codes of the jobs run by this process (one, or a sweep's)
_CODES: list[int] = []
_SEVERITY = (EXIT_FAILED, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_COMPLETED)


def help_groups(conf_dir: Path = CONF_DIR, width: int = 100) -> str:
    """The config groups for ``--help`` (conf/hydra/help/curvopt.yaml), read from ``conf_dir``.

    The groups a user chooses are the ones conf/config.yaml's defaults list picks by name (``optimizer:
    adam``); the entries it fills in itself (``optional per_optimizer: ${...}``, ``override hydra/...``)
    are not choices and are left out. Each group lists its files (conf/<group>/*.yaml) and its default;
    experiment and optimizer come first.
    """
    import textwrap

    import yaml

    entries = yaml.safe_load((conf_dir / "config.yaml").read_text()).get("defaults", [])
    chosen: dict[str, str | None] = {}
    for entry in entries:
        if not isinstance(entry, dict) or len(entry) != 1:
            continue  # _self_, or a config path
        ((group, default),) = entry.items()
        if " " in group or "@" in group or (isinstance(default, str) and "${" in default):
            continue  # optional / override / a package / an interpolated choice: not the user's
        chosen[str(group)] = default
    first = ("experiment", "optimizer")
    order = [g for g in first if g in chosen] + [g for g in chosen if g not in first]
    lines = []
    for group in order:
        options = ", ".join(sorted(p.stem for p in (conf_dir / group).glob("*.yaml")))
        head = f"{group} (default: {chosen[group] or 'none'}): "
        lines.append(
            textwrap.fill(head + options, width=width, subsequent_indent="    ", break_on_hyphens=False)
        )
    return "\n".join(lines)


# `python src/train.py --help` resolves ${curvopt.help_groups:} in conf/hydra/help/curvopt.yaml
OmegaConf.register_new_resolver("curvopt.help_groups", help_groups, replace=True)


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM outside the training loop (loading data, between sweep jobs): stop cleanly."""
    del frame
    raise SystemExit(128 + signum)


def final_code(codes: list[int]) -> int:
    """The most severe of the jobs' exit codes (failed > bad input > diverged > completed)."""
    if not codes:
        return EXIT_COMPLETED
    return min(codes, key=lambda c: _SEVERITY.index(c) if c in _SEVERITY else -1)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    cli = CommandLine(
        list(hc.overrides.task),
        {k: str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra")},
    )
    try:
        summary = run_from_config(cfg, cli)
    except BadInputError as err:
        log.error("%s", err)
        _CODES.append(EXIT_BAD_INPUT)
        if not sweep:
            raise SystemExit(EXIT_BAD_INPUT) from None
        return None
    except KeyboardInterrupt:
        log.warning("interrupted before training started; nothing was recorded")
        raise SystemExit(EXIT_SIGINT) from None
    except Exception:
        _CODES.append(EXIT_FAILED)
        raise  # Hydra prints it (a single run exits 1; a sweep goes on to the next job)
    code = exit_code(summary)
    _CODES.append(code)
    log.info(
        "run %s: %s after %d steps -> %s (exit code %d)",
        summary["run_id"],
        summary["status"],
        summary["steps"],
        summary["run_dir"],
        code,
    )
    if code in (EXIT_SIGINT, EXIT_SIGTERM):
        raise SystemExit(code)  # also stops a sweep: the user asked to stop
    best = summary.get("best") or {}
    return best.get("value")  # Hydra sweepers (e.g. Optuna) can minimise this


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main()
    except SystemExit as stop:
        # Hydra prints an error it caught and exits 1. Before any job has run that error is the
        # command line or the configs themselves (an unknown key or group option, a value of the
        # wrong type: the schemas in curvopt.training.schema): bad input, like a bad value.
        if stop.code == 1 and not _CODES:
            raise SystemExit(EXIT_BAD_INPUT) from None
        raise
    sys.exit(final_code(_CODES))
