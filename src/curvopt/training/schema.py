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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from curvopt.errors import ConfigError
from curvopt.training.rundir import check_name
from curvopt.training.sampler import SAMPLING_MODES

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

# trainer.dtype: the names a config may give, and the torch dtypes they stand for
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MAX_SEED = 2**32 - 1  # NumPy's seed range
SPLITS = ("train", "val", "test")
# optimizer keys checked as learning rates (finite, non-negative) at any depth
LEARNING_RATE_KEYS = ("lr", "base_lr", "adam_lr", "max_lr", "min_lr")


@dataclass
class TrainerConfig:
    """The training loop's settings: the ``trainer`` config group, its schema and its checks.

    Hydra composes the group onto this class (unknown keys and wrong types fail at compose time;
    the defaults are the values below). :meth:`from_config` builds it from the composed group (or
    any mapping; a missing key takes its default, as in configs saved by older versions), and the
    constructor checks every value, so an instance always holds valid settings: whole numbers
    given as ``12.0`` become ``12``, numbers become floats where a float is expected, and
    anything else out of type, range or choice raises.

    Args:
        max_steps: Stop after this many updates (>= 0).
        max_epochs: Stop after this many passes over the training set, counted by examples seen;
            ``None``: no such limit.
        max_algo_time_s: Stop when the algorithm's own time (evaluation excluded) reaches this
            many seconds; ``None``: no budget.
        batch_size: Examples per update, unless the algorithm chooses its own (SHF).
        sampling: How batches are drawn: ``epoch`` (shuffled passes), ``independent`` (a fresh
            draw each step, SHF), ``static`` or ``static_padded``
            (:data:`~curvopt.training.sampler.SAMPLING_MODES`).
        eval_every: Steps between evaluations (there is also one at step 0 and one at the end).
        eval_batch_size: Rows per forward pass in evaluation.
        eval_splits: The splits evaluated, among ``train``, ``val`` and ``test``.
        log_every: Steps between metric rows of the algorithm's own scalars.
        checkpoint_every: Steps between checkpoints; 0: only at the end and on interrupt.
        checkpoint_every_s: Also checkpoint when this many wall seconds have passed since the
            last one (long runs that must survive a restart on another machine); ``None`` or 0:
            off.
        keep_checkpoint: Keep ``checkpoint.pt`` after a completed run.
        pause_at_step: Stop at this step as a stop signal would (a checkpoint there, status
            ``interrupted``, stop reason ``paused``, exit code 0), so that a run longer than one
            session is split without changing its records: ``trainer.resume=true`` continues it
            as if it had never stopped (no extra evaluation where it paused, unlike a raised
            ``max_steps``). Not part of the run's config: each command line sets its own.
            ``None``: off.
        resume: Continue ``<paths.results_dir>/<experiment>/<run_id>/`` from its checkpoint, with
            its saved config (docs/resume.md).
        restart: Run an existing ``run_id`` again from step 0; its old records are moved aside,
            never deleted.
        allow_config_change: Resume even though the command line changes the saved config beyond
            extending the run.
        patience_evals: Stop after this many evaluations without a new best ``monitor`` value;
            ``None``: off.
        monitor: The metric (``<split>/<metric>``) behind ``patience_evals`` and the summary's
            ``best``.
        monitor_mode: ``min`` or ``max``: which direction of ``monitor`` is better.
        device: ``auto`` (CUDA when visible, else CPU), ``cpu``, ``cuda``, ``cuda:<index>`` or
            ``mps``.
        dtype: ``float32``, ``float64`` or ``bfloat16`` (pure bf16 weights and states, GaLore's
            LLM setup); :data:`DTYPES`.
        deterministic: Ask torch for deterministic algorithms
            (``torch.use_deterministic_algorithms``, warning rather than failing where an op has
            none); the seeds are set either way.
        progress: Show a tqdm progress bar; without a terminal, one log line per evaluation
            instead.
        progress_log_every_s: Those log lines at most this often, in seconds.
        micro_batch_size: Gradient accumulation: split each update's (per-rank) batch into
            micro-batches of this size; ``None``: no accumulation.
        eval_galore_compat: LM evaluation: also log GaLore's off-by-one loss and perplexity
            (``loss_galore``, ``ppl_galore``).
        dist_backend: The ``torch.distributed`` backend of torchrun runs; ``auto``: nccl on
            CUDA, gloo on CPU.
        num_threads: torch intra-op threads; ``None``: torch's default. 1 makes
            ``clock=process`` meaningful.
        clock: ``wall``: ``time.perf_counter`` (CUDA-synchronised), the papers' computation
            time; ``process``: this process's CPU seconds (``time.process_time``), which other
            jobs on a shared CPU cannot inflate; it equals uncontended wall time only with one
            torch thread (``num_threads=1``) and never on a GPU.

    Raises:
        ConfigError: Naming the first bad value (``trainer.<key>=<value>``) and the valid ones.
    """

    max_steps: int = 1000
    max_epochs: float | None = None
    max_algo_time_s: float | None = None
    batch_size: int = 128
    sampling: str = "epoch"
    eval_every: int = 100
    eval_batch_size: int = 2000
    eval_splits: list[str] = field(default_factory=lambda: list(SPLITS))
    log_every: int = 1
    checkpoint_every: int = 0
    checkpoint_every_s: float | None = None
    keep_checkpoint: bool = True
    pause_at_step: int | None = None
    resume: bool = False
    restart: bool = False
    allow_config_change: bool = False
    patience_evals: int | None = None
    monitor: str = "val/loss"
    monitor_mode: str = "min"
    device: str = "auto"
    dtype: str = "float32"
    deterministic: bool = True
    progress: bool = True
    progress_log_every_s: float = 30.0
    micro_batch_size: int | None = None
    eval_galore_compat: bool = False
    dist_backend: str = "auto"
    num_threads: int | None = None
    clock: str = "wall"

    def __post_init__(self) -> None:
        # types first (a plain mapping, e.g. a saved config, is not typed by Hydra), then ranges
        splits = self.eval_splits
        if not isinstance(splits, (list, tuple)) or not all(isinstance(x, str) for x in splits):
            raise ConfigError(f"trainer.eval_splits={splits!r}: expected a list such as [train, val, test]")
        self.eval_splits = list(splits)
        for key in ("max_steps", "batch_size", "eval_every", "eval_batch_size", "log_every"):
            setattr(self, key, _whole(key, getattr(self, key), none_ok=False))
        self.checkpoint_every = _whole("checkpoint_every", self.checkpoint_every, none_ok=False)
        self.patience_evals = _whole("patience_evals", self.patience_evals, none_ok=True)
        self.pause_at_step = _whole("pause_at_step", self.pause_at_step, none_ok=True)
        for key in ("max_epochs", "max_algo_time_s", "checkpoint_every_s", "progress_log_every_s"):
            setattr(self, key, _number(key, getattr(self, key)))
        for key in ("sampling", "monitor", "monitor_mode", "clock", "dist_backend"):
            setattr(self, key, str(getattr(self, key)))
        for key in (
            "keep_checkpoint",
            "progress",
            "eval_galore_compat",
            "resume",
            "restart",
            "allow_config_change",
            "deterministic",
        ):
            _flag(key, getattr(self, key))

        if self.clock not in ("wall", "process"):
            raise ConfigError(f"trainer.clock must be 'wall' or 'process', got {self.clock!r}")
        for key, minimum in (
            ("max_steps", 0),
            ("batch_size", 1),
            ("eval_every", 1),
            ("eval_batch_size", 1),
            ("log_every", 1),
            ("checkpoint_every", 0),
            ("patience_evals", 1),
            ("pause_at_step", 1),
        ):
            _at_least(key, getattr(self, key), minimum, none_ok=key in ("patience_evals", "pause_at_step"))
        _in_range("max_epochs", self.max_epochs, positive=True, none_ok=True)
        _in_range("max_algo_time_s", self.max_algo_time_s, positive=True, none_ok=True)
        _in_range("checkpoint_every_s", self.checkpoint_every_s, positive=False, none_ok=True)  # 0 = off
        _in_range("progress_log_every_s", self.progress_log_every_s, positive=False, none_ok=False)
        if self.sampling not in SAMPLING_MODES:
            raise ConfigError(
                f"trainer.sampling={self.sampling!r}: choose one of {', '.join(SAMPLING_MODES)}"
            )
        if self.monitor_mode not in ("min", "max"):
            raise ConfigError(f"trainer.monitor_mode={self.monitor_mode!r}: choose min or max")
        unknown = [s for s in self.eval_splits if s not in SPLITS]
        if unknown:
            raise ConfigError(f"trainer.eval_splits has {unknown}: the splits are train, val and test")
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"trainer.dtype={self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}"
            )
        device = self.device
        if not isinstance(device, str) or not (
            device == "auto" or device.split(":")[0] in ("cpu", "cuda", "mps")
        ):
            raise ConfigError(f"trainer.device={device!r}: choose auto, cpu, cuda or cuda:<index>")
        for key in ("micro_batch_size", "num_threads"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"trainer.{key}={value!r}: must be a positive whole number, or null")
        if self.clock == "process" and device.startswith("cuda"):
            raise ConfigError(
                "trainer.clock=process counts CPU seconds only; use trainer.clock=wall on a GPU"
            )

    @classmethod
    def from_config(cls, tcfg: DictConfig | Mapping[str, Any] | None) -> TrainerConfig:
        """The checked settings of a ``trainer`` config.

        Args:
            tcfg: The ``trainer`` node of a composed or saved config, or a plain mapping; keys it
                lacks take their defaults (configs saved by older versions lack newer keys), keys
                that are no setting are ignored (a composed config has none: Hydra and
                :func:`check_known_keys` refuse them).

        Returns:
            The :class:`TrainerConfig`.

        Raises:
            ConfigError: Naming the first bad value.
        """
        given = _plain(tcfg) if tcfg is not None else {}
        return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})


def _plain(node: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        out = OmegaConf.to_container(node, resolve=True)
        assert isinstance(out, dict)
        return out
    return dict(node)


def _flag(key: str, value: Any) -> None:
    """A boolean setting: ``true`` or ``false``, no truthy strings or numbers."""
    if not isinstance(value, bool):
        raise ConfigError(f"trainer.{key}={value!r}: expected true or false")


def _whole(key: str, value: Any, none_ok: bool) -> int | None:
    """A whole-number setting; ``12.0`` or ``1e4`` are accepted as whole numbers."""
    if value is None:
        if none_ok:
            return None
        raise ConfigError(f"trainer.{key}={value!r}: expected a whole number")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"trainer.{key}={value!r}: expected a whole number, e.g. trainer.{key}=100")


def _number(key: str, value: Any) -> float | None:
    """A float setting (``None`` passes; the range check decides whether it may be ``None``)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"trainer.{key}={value!r}: expected a number (or null), e.g. trainer.{key}=60")


def _at_least(key: str, value: int | None, minimum: int, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if value is not None and value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        off = " (or null: off)" if none_ok else ""
        raise ConfigError(f"trainer.{key}={value}: must be {what}{off}")


def _in_range(key: str, value: float | None, positive: bool, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if value is None or math.isnan(value) or (positive and not value > 0) or (not positive and value < 0):
        off = " (or null: off)" if none_ok else ""
        raise ConfigError(
            f"trainer.{key}={value!r}: must be a {'positive' if positive else 'non-negative'} number{off}"
        )


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
