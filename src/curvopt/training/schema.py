"""What a run config may hold, and the one place it is checked.

:class:`TrainerConfig` is the ``trainer`` group three times over: Hydra stores it as the
``trainer/schema`` node (:func:`register_schemas`), so composing ``conf/`` types every key (a typo
such as ``trainer.max_stepz=5`` or a wrong type such as ``trainer.max_steps=ten`` fails before
anything is loaded, naming the key) and takes its defaults from the class; building it checks every
value's type, range and choices; and the training loop and the build read the checked object.
``conf/trainer/default.yaml`` repeats no value: the class docstring documents each setting.

:class:`RunSettings` checks a whole composed run config once, before anything is loaded or created
(:func:`curvopt.training.build.run_from_config` starts with it): the keys of the schema groups, the
seed, the names of the run directory, the trainer settings and the optimizer's numbers. It resolves
the config once; the build reads the checked values from it.

:class:`PathsSchema` and :class:`LoggerSchema` type the ``paths`` and ``logger`` groups the same way;
their YAML files derive the values from the environment. The schemas are registered in Hydra's
ConfigStore by :func:`register_schemas` (``src/train.py`` calls it); a script that composes ``conf/``
itself calls it first (it is idempotent).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from curvopt.errors import ConfigError
from curvopt.training.rundir import check_name
from curvopt.training.trainer_config import DTYPES, TrainerConfig, _plain

__all__ = [
    "DTYPES",
    "LoggerSchema",
    "PathsSchema",
    "RunSettings",
    "TrainerConfig",
    "check_known_keys",
    "check_no_legacy_variants",
    "check_optimizer_values",
    "register_schemas",
]

MAX_SEED = 2**32 - 1  # NumPy's seed range
# optimizer keys checked as learning rates (finite, non-negative) at any depth
LEARNING_RATE_KEYS = ("lr", "base_lr", "adam_lr", "max_lr", "min_lr")


@dataclass
class PathsSchema:
    """Where data is read from and records are written (the ``paths`` group).

    The defaults here are placeholders: ``conf/paths/default.yaml`` derives the values from
    ``CURVOPT_ROOT`` and ``CURVOPT_DATA_DIR``.

    Args:
        root_dir: The project root the other paths hang from.
        data_dir: Where the datasets are read from (never written to).
        results_dir: Where a run writes ``<experiment>/<run_id>/``: ``outputs/runs`` for ad-hoc
            runs, ``<repo>/results`` for the make targets and drivers.
        output_dir: Hydra's run folders and the wandb directory.
    """

    root_dir: str = "."
    data_dir: str = "./data"
    results_dir: str = "./outputs/runs"
    output_dir: str = "./outputs"


@dataclass
class LoggerSchema:
    """Where run records go besides the local files (the ``logger`` group).

    ``kind: none`` ignores the other fields, so an experiment may set ``logger.log_every``
    whichever logger a run picks.

    Args:
        kind: ``none`` (the local run records only) or ``wandb`` (also mirrored to Weights &
            Biases; a wandb failure only warns).
        project: The wandb project.
        entity: The wandb entity (user or team); ``None``: wandb's default.
        mode: The wandb mode, ``offline`` (no account needed) or ``online``.
        dir: The wandb directory.
        log_every: Steps between wandb rows of the per-step scalars (evaluation rows are always
            sent; the local ``metrics.jsonl`` keeps every step).
    """

    kind: str = "none"
    project: str = "curvopt"
    entity: str | None = None
    mode: str = "offline"
    dir: str = "./outputs"
    log_every: int = 10


GROUP_SCHEMAS = {"trainer": TrainerConfig, "paths": PathsSchema, "logger": LoggerSchema}


@dataclass
class RunSettings:
    """A run config, checked once: the values the build and the loop read.

    Attributes:
        trainer: The checked ``trainer`` settings.
        seed: The run's seed.
        experiment_name: The experiment (the results folder the run directory is in).
        run_id: The run directory's name; ``None``: the build generates one.
        results_dir: ``paths.results_dir``.
        optimizer_name: ``optimizer.name``.
        dataset_name: ``dataset.name`` (as text, for messages).
        model_target: ``model._target_`` (for messages).
        profile: The scale profile label (``quick`` or ``paper``).
        tag: The free-form tag stored in the summary.
        logger: The resolved ``logger`` group.
        config: The whole config, resolved to plain values: its ``dataset``, ``model`` and
            ``optimizer`` entries are what the build calls.
    """

    trainer: TrainerConfig
    seed: int
    experiment_name: str
    run_id: str | None
    results_dir: Path
    optimizer_name: str
    dataset_name: str
    model_target: str
    profile: str
    tag: Any
    logger: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def from_config(cls, cfg: DictConfig, composed: bool = True) -> RunSettings:
        """Check a run config and resolve it; nothing is loaded or created.

        Args:
            cfg: The run config.
            composed: ``cfg`` was composed from ``conf/`` by this version (Hydra's or a driver's
                composition): also refuse keys the schemas do not know and an unmerged
                ``optimizer_variants`` block. ``False`` for a resumed run's config (its saved
                ``config.yaml`` merged with the command line), which may hold what older versions
                wrote.

        Returns:
            The :class:`RunSettings`.

        Raises:
            ConfigError: Naming the first bad value.
        """
        config = _plain(cfg)
        if composed:
            check_no_legacy_variants(config)
            check_known_keys(config)
        seed = config.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed={seed!r}: expected a non-negative whole number")
        if seed > MAX_SEED:
            raise ConfigError(
                f"seed={seed}: must be at most {MAX_SEED} (2**32-1, the largest seed NumPy takes)"
            )
        experiment_name = check_name("experiment_name", config.get("experiment_name"))
        run_id = check_name("run_id", config["run_id"]) if config.get("run_id") else None
        trainer = TrainerConfig.from_config(config.get("trainer"))
        optimizer = config.get("optimizer") or {}
        check_optimizer_values(optimizer, dtype=trainer.dtype)
        dataset, model = config.get("dataset") or {}, config.get("model") or {}
        return cls(
            trainer=trainer,
            seed=seed,
            experiment_name=experiment_name,
            run_id=run_id,
            results_dir=Path((config.get("paths") or {}).get("results_dir", PathsSchema.results_dir)),
            optimizer_name=str(optimizer.get("name")),
            dataset_name=str(dataset.get("name")),
            model_target=str(model.get("_target_")),
            profile=str(config.get("profile")),
            tag=config.get("tag"),
            logger=dict(config.get("logger") or {}),
            config=config,
        )


def check_no_legacy_variants(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Refuse an ``optimizer_variants`` block in a freshly composed config.

    Per-optimizer settings of an experiment used to live in an ``optimizer_variants`` block merged
    after Hydra; they are now Hydra configs of their own, ``conf/per_optimizer/<experiment>/<optimizer>.yaml``,
    composed by the defaults list, so the block would be silently ignored. Configs saved by runs made
    before the change carry the block already merged (``_variant_applied: true``) and pass.

    Args:
        cfg: The composed (or saved) run config.

    Raises:
        ConfigError: The config holds an unmerged ``optimizer_variants`` block.
    """
    variants = cfg.get("optimizer_variants")
    if variants and not cfg.get("_variant_applied"):
        raise ConfigError(
            "optimizer_variants is no longer read: put an experiment's settings for one optimizer in "
            "conf/per_optimizer/<experiment>/<optimizer>.yaml (composed by Hydra after the experiment), "
            "or set the keys directly on the command line (e.g. optimizer.lr=0.1 instead of "
            "optimizer_variants.<name>.optimizer.lr=0.1)"
        )


def check_known_keys(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Refuse keys the ``trainer``, ``paths`` and ``logger`` schemas do not declare.

    Hydra's schemas reject an unknown key at compose time, except one added with ``+`` (Hydra's own
    hint for a typo: ``+trainer.max_stepz=5`` would otherwise be accepted and ignored).

    Args:
        cfg: The composed run config.

    Raises:
        ConfigError: Naming each unknown key and the closest declared one.
    """
    problems = []
    for group, schema in GROUP_SCHEMAS.items():
        node = cfg.get(group)
        if node is None:
            continue
        known = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {group}.{close[0]}?)" if close else ""
                problems.append(f"{group}.{key}{hint}")
    if problems:
        raise ConfigError(
            "unknown config key(s): " + ", ".join(problems) + ". The keys each group takes are in "
            "conf/<group>/*.yaml and curvopt.training.schema."
        )


def check_optimizer_values(opt_cfg: DictConfig | Mapping[str, Any], dtype: str | None = None) -> None:
    """Check that no optimizer value is NaN and that learning rates are finite and non-negative.

    Learning rates are the keys :data:`LEARNING_RATE_KEYS` at any depth; the optimizers check their
    own ranges when they are built. With ``dtype``, a learning rate must also be a number of that
    precision (``optimizer.lr=1e300`` overflows float32 inside the first step).

    Args:
        opt_cfg: The ``optimizer`` config.
        dtype: The run's ``trainer.dtype`` (``float32``, ``float64``, ``bfloat16``), or ``None``.

    Raises:
        ConfigError: Naming the offending key and value.
    """
    values = _plain(opt_cfg)

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        elif isinstance(value, float) and math.isnan(value):
            raise ConfigError(f"{key}=nan: not a number; give a value")
        elif (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and key.rsplit(".", 1)[-1] in LEARNING_RATE_KEYS
            and not (math.isfinite(value) and value >= 0)
        ):
            raise ConfigError(f"{key}={value}: must be a finite non-negative number")
        elif (
            limit is not None
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and key.rsplit(".", 1)[-1] in LEARNING_RATE_KEYS
            and value > limit
        ):
            raise ConfigError(
                f"{key}={value}: larger than the largest {dtype} number ({limit:.3g}), so the step "
                f"cannot use it; give a learning rate below it"
            )

    limit = float(torch.finfo(DTYPES[dtype]).max) if dtype in DTYPES else None
    walk(values, "optimizer")


_REGISTERED = False


def register_schemas() -> None:
    """Store the schemas in Hydra's ConfigStore as ``trainer/schema``, ``paths/schema`` and ``logger/schema``.

    Idempotent: only the first call in a process stores them.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name="schema", node=schema)
    _REGISTERED = True
