"""From a composed Hydra config to a finished run: data, model, objective, algorithm, loop.

Kept apart from ``src/train.py`` so tests and drivers can run a config without the CLI.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from curvopt.errors import BadInputError, ConfigError, CorruptCheckpointError, CorruptDataError, exit_code
from curvopt.objective import Objective, mean_loss
from curvopt.training.algorithm import Algorithm, DataBundle, TorchOptimizerAlgorithm
from curvopt.training.distributed import (
    SINGLE,
    DistInfo,
    broadcast_object,
    cleanup,
    device_for,
    env_world_size,
    init_distributed,
    wrap_ddp,
)
from curvopt.training.loop import CHECKPOINT_NAME, LoopConfig, Trainer, as_bool, verify_checkpoint
from curvopt.training.records import RunLock, atomic_write_text, environment_info, git_commit
from curvopt.training.rundir import (
    CommandLine,
    _flatten,
    check_name,
    check_run_dir,
    config_edits,
    load_saved_config,
    move_records_aside,
    resume_config,
    save_command_line,
)
from curvopt.training.schema import trainer_default
from curvopt.training.tracking import make_tracker

log = logging.getLogger(__name__)

# Keys of an optimizer config that describe the run, not the constructor.
RESERVED_OPTIMIZER_KEYS = ("name", "grad_clip_value", "scheduler")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MAX_SEED = 2**32 - 1  # NumPy's seed range


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seed Python, NumPy and torch, and optionally ask torch for deterministic kernels.

    Args:
        seed: The run's seed.
        deterministic: Also call ``torch.use_deterministic_algorithms(True, warn_only=True)`` and set
            ``CUBLAS_WORKSPACE_CONFIG`` (unless already set), as ``trainer.deterministic`` asks.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def resolve_device(name: str) -> torch.device:
    """The torch device ``trainer.device`` names.

    Args:
        name: ``auto`` (CUDA when visible, else CPU), ``cpu``, ``cuda``, ``cuda:<index>`` or ``mps``.

    Returns:
        The device.

    Raises:
        ConfigError: CUDA was asked for but no CUDA device is visible.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    return device


def _to_container(cfg: DictConfig | dict) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def call_target(spec: dict[str, Any], **extra: Any) -> Any:
    """Call ``spec['_target_'](**rest, **extra)`` directly.

    Unlike ``hydra.utils.instantiate``, a loader's own exception (e.g. a missing-data message)
    reaches the user instead of Hydra's InstantiationException wrapper.

    Args:
        spec: A config dict with a ``_target_`` (dotted path of a callable) and its keyword arguments;
            ``_partial_`` is ignored.
        **extra: More keyword arguments for the call.

    Returns:
        Whatever the target returns.

    Raises:
        ValueError: ``spec`` has no ``_target_``.
    """
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if target is None:
        raise ValueError(f"config needs a `_target_`: {spec}")
    spec.pop("_partial_", None)
    return get_method(target)(**spec, **extra)


def build_data(cfg: DictConfig, dtype: torch.dtype, device: torch.device) -> DataBundle:
    """Load the ``dataset`` config's splits and move them to the run's device.

    Args:
        cfg: The run config (its ``dataset`` node names the loader in ``_target_``).
        dtype: Floating-point tensors (inputs, and regression targets) are cast to it; integer labels
            keep their dtype.
        device: Where the splits go.

    Returns:
        The loader's :class:`~curvopt.api.DataBundle` with ``train``/``val``/``test`` moved.

    Raises:
        TypeError: The loader did not return a ``DataBundle``.
    """
    data_cfg = _to_container(cfg.dataset)
    data_cfg.pop("name", None)
    data = call_target(data_cfg)
    if not isinstance(data, DataBundle):
        raise TypeError(f"dataset target must return a DataBundle, got {type(data).__name__}")

    def move(pair: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if pair is None:
            return None
        x, y = pair
        x = x.to(device=device, dtype=dtype) if x.dtype.is_floating_point else x.to(device)
        y = y.to(device=device, dtype=dtype) if y.dtype.is_floating_point else y.to(device)
        return x, y

    data.train, data.val, data.test = move(data.train), move(data.val), move(data.test)
    check_data(data, str(cfg.dataset.get("name")))
    return data


def check_data(data: DataBundle, name: str) -> None:
    """Refuse data a run cannot train on; drop evaluation splits with no rows.

    Args:
        data: The loaded splits (changed in place: an empty ``val``/``test`` becomes ``None``, so
            that it is not evaluated as a loss of 0).
        name: The dataset's name, for the messages.

    Raises:
        ConfigError: The training split has no rows.
        CorruptDataError: A split holds NaN or inf values (inputs or targets).
    """
    if data.train is not None and int(data.train[0].shape[0]) < 1:
        raise ConfigError(
            f"dataset={name}: the training split is empty (dataset.num_train=0?); give dataset.num_train >= 1"
        )
    for split in ("val", "test"):
        pair = getattr(data, split)
        if pair is not None and int(pair[0].shape[0]) == 0:
            setattr(data, split, None)
    for split in ("train", "val", "test"):
        pair = getattr(data, split)
        if pair is None:
            continue
        for what, t in zip(("inputs", "targets"), pair):
            if not t.dtype.is_floating_point or t.numel() == 0:
                continue
            rows = max(1, (1 << 24) // max(1, t[0].numel()))  # at most ~16M values at a time
            bad = sum(int((~torch.isfinite(chunk)).sum()) for chunk in t.split(rows))
            if bad:
                raise CorruptDataError(
                    f"dataset={name}: the {split} split's {what} hold {bad} NaN or inf value(s) "
                    f"(of {t.numel()}); training on them can only diverge. Check or re-create the data "
                    "files (and the loader's preprocessing) before running"
                )


def check_monitor(data: DataBundle, monitor: str, name: str) -> None:
    """Refuse a ``trainer.monitor`` whose split the data do not have.

    Args:
        data: The loaded splits (after :func:`check_data`).
        monitor: ``trainer.monitor`` (``<split>/<metric>``).
        name: The dataset's name, for the message.

    Raises:
        ConfigError: The monitored split is absent or empty: ``best`` and ``patience_evals`` would
            have nothing (or a loss of 0 over no rows) to go by.
    """
    split = monitor.split("/", 1)[0]
    if split not in ("train", "val", "test") or getattr(data, split) is not None:
        return
    if split == "train" and data.train_stream is not None:
        return
    have = [s for s in ("val", "test", "train") if getattr(data, s) is not None]
    metric = monitor.split("/", 1)[1] if "/" in monitor else "loss"
    raise ConfigError(
        f"trainer.monitor={monitor} but dataset={name} has no {split} split"
        + (" (dataset.num_val=0?)" if split == "val" else "")
        + "; give it one"
        + (" (dataset.num_val >= 1)" if split == "val" else "")
        + (f", or monitor a split it has (trainer.monitor={have[0]}/{metric})" if have else "")
    )


def check_model_fits_data(objective: Objective, data: DataBundle, model_target: str, name: str) -> None:
    """One forward pass and loss on two examples: the model must take the data's inputs and targets.

    Runs in eval mode without gradients, and leaves every module's mode and torch's RNG as they
    were, so the run is unchanged. Outputs must have the targets' shape (squared error, sigmoid
    BCE); for cross-entropy the largest label must be below the number of outputs.

    Args:
        objective: The model and its loss.
        data: The loaded splits.
        model_target: ``model._target_``, for the message.
        name: The dataset's name, for the message.

    Raises:
        ConfigError: Naming both sides and what does not fit.
    """
    pairs = [p for p in (data.train, data.val, data.test) if p is not None]
    if not pairs:
        return
    x, y = pairs[0][0][:2], pairs[0][1][:2]
    model = objective.model
    modes = [(m, m.training) for m in model.modules()]  # a frozen part may be in eval mode on purpose
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        model.eval()
        with torch.no_grad():
            out = model(x)
            if objective.loss_kind != "cross_entropy" and tuple(out.shape) != tuple(y.shape):
                raise ValueError(f"the model's outputs are {tuple(out.shape[1:])} per example")
            if objective.loss_kind == "cross_entropy" and not y.dtype.is_floating_point:
                top = max((int(p[1].max()) for p in pairs if p[1].numel()), default=-1)
                if top >= out.shape[-1] and top != objective.ignore_index:
                    raise ValueError(f"labels go up to {top} but the model has {out.shape[-1]} outputs")
            mean_loss(out, y, objective.loss_kind, objective.ignore_index)
    except (RuntimeError, ValueError, IndexError, TypeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
        raise ConfigError(
            f"model ({model_target}) does not fit dataset={name} (inputs {tuple(x.shape[1:])} "
            f"{str(x.dtype).replace('torch.', '')}, targets {tuple(y.shape[1:])} "
            f"{str(y.dtype).replace('torch.', '')}): {first}. Choose a model for this dataset, or the "
            "dataset the experiment was made for"
        ) from err
    finally:
        for module, training in modes:
            module.training = training
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def build_model(cfg: DictConfig, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, str]:
    """Build the ``model`` config's network.

    Args:
        cfg: The run config (its ``model`` node: ``_target_``, the builder's arguments and ``loss``).
        dtype: Parameter dtype.
        device: Parameter device.

    Returns:
        ``(model, loss)``, where ``loss`` is ``squared_error``, ``cross_entropy`` or ``sigmoid_bce``.

    Raises:
        ValueError: The model config has no ``loss`` key.
    """
    model_cfg = _to_container(cfg.model)
    loss = model_cfg.pop("loss", None)
    if loss is None:
        raise ValueError("model config needs a `loss:` key (squared_error | cross_entropy | sigmoid_bce)")
    model = call_target(model_cfg)
    return model.to(device=device, dtype=dtype), loss


def check_optimizer_values(opt_cfg: DictConfig | dict) -> None:
    """Check that no optimizer value is NaN and that learning rates are finite and non-negative.

    Learning rates are the keys ``lr``, ``base_lr``, ``adam_lr``, ``max_lr`` and ``min_lr`` at any
    depth; the optimizers check their own ranges when they are built.

    Args:
        opt_cfg: The ``optimizer`` config.

    Raises:
        ConfigError: Naming the offending key and value.
    """
    values = _to_container(opt_cfg)

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
            and key.rsplit(".", 1)[-1] in ("lr", "base_lr", "adam_lr", "max_lr", "min_lr")
            and not (math.isfinite(value) and value >= 0)
        ):
            raise ConfigError(f"{key}={value}: must be a finite non-negative number")

    walk(values, "optimizer")


def build_algorithm(
    opt_cfg: DictConfig | dict,
    objective: Objective,
    data: DataBundle,
    micro_batch_size: int | None = None,
    train_model: torch.nn.Module | None = None,
) -> Algorithm:
    """Instantiate ``optimizer._target_`` as an :class:`~curvopt.api.Algorithm`.

    The target is either a ``torch.optim.Optimizer`` subclass (built on the model's parameters and
    wrapped in :class:`TorchOptimizerAlgorithm` with the config's ``scheduler`` and
    ``grad_clip_value``) or a factory ``factory(objective=..., data=..., **kwargs)`` that returns an
    ``Algorithm`` (used as is) or a ``torch.optim.Optimizer`` (e.g. one with parameter groups chosen
    from the model, wrapped like an optimizer target).

    Args:
        opt_cfg: The ``optimizer`` config; ``name``, ``grad_clip_value`` and ``scheduler`` describe
            the run and are not passed to the target.
        objective: The model and its loss.
        data: The run's data (factories may read it, e.g. HF-CG's full training set).
        micro_batch_size: Gradient accumulation in micro-batches of this size (wrapped optimizers).
        train_model: The DDP-wrapped model, when distributed (wrapped optimizers only).

    Returns:
        The algorithm the loop steps with ``step(batch)``.

    Raises:
        ValueError: No ``_target_``, or a factory's ``Algorithm`` given ``scheduler`` or
            ``grad_clip_value`` (it clips and schedules itself).
        NotImplementedError: A factory's own ``Algorithm`` under DistributedDataParallel.
        TypeError: The target returned something without ``step``.
    """
    kwargs = _to_container(opt_cfg)
    target_name = kwargs.pop("_target_", None)
    if target_name is None:
        raise ValueError("optimizer config needs a `_target_`")
    clip = kwargs.pop("grad_clip_value", None)
    scheduler_cfg = kwargs.pop("scheduler", None)
    for key in RESERVED_OPTIMIZER_KEYS:
        kwargs.pop(key, None)
    kwargs.pop("_partial_", None)
    target = get_method(target_name)

    def wrap(optimizer: torch.optim.Optimizer) -> TorchOptimizerAlgorithm:
        scheduler = instantiate(scheduler_cfg, optimizer=optimizer) if scheduler_cfg else None
        return TorchOptimizerAlgorithm(
            objective,
            optimizer,
            grad_clip_value=clip,
            scheduler=scheduler,
            micro_batch_size=micro_batch_size,
            train_model=train_model,
        )

    if inspect.isclass(target) and issubclass(target, torch.optim.Optimizer):
        if "betas" in kwargs and isinstance(kwargs["betas"], list):
            kwargs["betas"] = tuple(kwargs["betas"])
        return wrap(target(objective.model.parameters(), **kwargs))
    algorithm = target(objective=objective, data=data, **kwargs)
    if isinstance(algorithm, torch.optim.Optimizer):
        return wrap(algorithm)
    if train_model is not None and train_model is not objective.model:
        raise NotImplementedError(
            f"{target_name} returns its own Algorithm, which cannot run under DistributedDataParallel; "
            "run it in one process, or have the factory return a torch.optim.Optimizer"
        )
    if scheduler_cfg:
        raise ValueError(f"{target_name} returns its own Algorithm; it cannot take a `scheduler:` key")
    if clip is not None:
        raise ValueError(
            f"{target_name} returns its own Algorithm, so the loop cannot clip its gradients: set the "
            "algorithm's own clipping option instead of `grad_clip_value` (e.g. FOSI's clip_grad_value)"
        )
    if not hasattr(algorithm, "step"):
        raise TypeError(f"{target_name} returned {type(algorithm).__name__}, which has no step(batch)")
    return algorithm


def make_run_id(cfg: DictConfig, dist: DistInfo = SINGLE) -> str:
    """The run directory's name: ``run_id`` when set, else ``<optimizer>_s<seed>_<time>_<random>``.

    Args:
        cfg: The run config.
        dist: Distributed context; rank 0's generated id is broadcast to every rank.

    Returns:
        The run id.
    """
    if cfg.get("run_id"):
        return str(cfg.run_id)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return broadcast_object(f"{cfg.optimizer.name}_s{cfg.seed}_{stamp}_{uuid.uuid4().hex[:6]}", dist)


def check_no_legacy_variants(cfg: DictConfig) -> None:
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


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys the ``trainer``, ``paths`` and ``logger`` schemas do not declare.

    Hydra's schemas reject an unknown key at compose time, except one added with ``+`` (Hydra's own
    hint for a typo: ``+trainer.max_stepz=5`` would otherwise be accepted and ignored).

    Args:
        cfg: The composed run config.

    Raises:
        ConfigError: Naming each unknown key and the closest declared one.
    """
    import dataclasses
    import difflib

    from curvopt.training.schema import LoggerSchema, PathsSchema, TrainerSchema

    problems = []
    for group, schema in (("trainer", TrainerSchema), ("paths", PathsSchema), ("logger", LoggerSchema)):
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


def check_trainer(tcfg: DictConfig) -> LoopConfig:
    """Check every trainer value (type, range, choices) before anything is loaded or created.

    Args:
        tcfg: The ``trainer`` config.

    Returns:
        The loop's :class:`~curvopt.training.loop.LoopConfig` built from it.

    Raises:
        ConfigError: Naming the bad value and the valid ones.
    """
    loop_cfg = LoopConfig.from_trainer(tcfg)
    dtype = tcfg.get("dtype", trainer_default("dtype"))
    if dtype not in DTYPES:
        raise ConfigError(f"trainer.dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    device = tcfg.get("device", trainer_default("device"))
    if not isinstance(device, str) or not (
        device == "auto" or device.split(":")[0] in ("cpu", "cuda", "mps")
    ):
        raise ConfigError(f"trainer.device={device!r}: choose auto, cpu, cuda or cuda:<index>")
    for key in ("resume", "restart", "allow_config_change", "deterministic"):
        as_bool(f"trainer.{key}", tcfg.get(key, trainer_default(key)))
    for key in ("micro_batch_size", "num_threads"):
        value = tcfg.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"trainer.{key}={value!r}: must be a positive whole number, or null")
    if tcfg.get("clock", trainer_default("clock")) == "process" and str(device).startswith("cuda"):
        raise ConfigError("trainer.clock=process counts CPU seconds only; use trainer.clock=wall on a GPU")
    return loop_cfg


def run_from_config(cfg: DictConfig, cli: CommandLine | None = None) -> dict[str, Any]:
    """Run one training job described by ``cfg`` and return its summary.

    Args:
        cfg: The composed run config (``src/train.py``'s, or a driver's composed one).
        cli: The Hydra command line. It tells a resumed run which keys the command set explicitly;
            without it every key that differs from the saved config counts as set (see
            :func:`curvopt.training.rundir.resume_config`).

    Returns:
        The run's summary (as written to ``summary.json``), with ``run_dir`` added.

    Raises:
        BadInputError: A bad config value, missing data or an unusable run directory, found before
            training starts (nothing is written then).
    """
    check_no_legacy_variants(cfg)
    check_known_keys(cfg)
    seed = cfg.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed={seed!r}: expected a non-negative whole number")
    if seed > MAX_SEED:
        raise ConfigError(f"seed={seed}: must be at most {MAX_SEED} (2**32-1, the largest seed NumPy takes)")
    check_name("experiment_name", cfg.get("experiment_name"))
    if cfg.get("run_id"):
        check_name("run_id", cfg.run_id)
    check_trainer(cfg.trainer)
    check_optimizer_values(cfg.optimizer)
    tcfg = cfg.trainer
    dist = (
        init_distributed(str(tcfg.device), str(tcfg.get("dist_backend", trainer_default("dist_backend"))))
        if env_world_size() > 1
        else SINGLE
    )
    try:
        return _run(cfg, dist, cli)
    finally:
        cleanup(dist)


def _run(cfg: DictConfig, dist: DistInfo, cli: CommandLine | None = None) -> dict[str, Any]:
    tcfg = cfg.trainer
    run_id = check_name("run_id", make_run_id(cfg, dist))  # a generated id too (optimizer.name)
    run_dir = Path(cfg.paths.results_dir) / str(cfg.experiment_name) / run_id
    # the saved config.yaml names its run, generated id included, so `run_id=<id> trainer.resume=true`
    # resumes it like a named run
    cfg.run_id = run_dir.name
    resume, restart = (
        bool(tcfg.get("resume", trainer_default("resume"))),
        bool(tcfg.get("restart", trainer_default("restart"))),
    )
    allow_change = bool(tcfg.get("allow_config_change", trainer_default("allow_config_change")))
    # the topmost directory this run creates (removed again if it stops before training)
    created = next((d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()), None)
    lock = RunLock(run_dir)
    started = False
    try:
        if dist.is_main:
            lock.acquire()  # one process per run directory, from before anything is loaded
            mode = check_run_dir(run_dir, resume, restart)
        else:
            mode = "resume" if resume else "new"
        plan = None
        recorded: str | None = None
        edits: list[tuple[str, str]] = []
        trained_with: dict[str, Any] | None = None  # the config the checkpoint was trained with
        if mode == "resume":
            if dist.is_main:  # before anything is loaded: a damaged checkpoint is refused at once
                verify_checkpoint(run_dir / CHECKPOINT_NAME)
            recorded = checkpoint_config(run_dir / CHECKPOINT_NAME)
        if mode == "resume" and (run_dir / "config.yaml").exists():
            saved = load_saved_config(run_dir / "config.yaml")
            if saved.get("run_id") is None:  # saved before run ids were recorded: the directory's name
                saved.run_id = run_dir.name
            edits = config_edits(recorded, saved, cfg)
            if edits and not allow_change:
                listed = "\n".join(f"  {line}" for _, line in edits)
                raise ConfigError(
                    f"{run_dir / 'config.yaml'} differs from the config its checkpoint was trained with "
                    f"(edited after the checkpoint was written):\n{listed}\n"
                    "Undo the edit to continue the run as it was, pass trainer.allow_config_change=true to "
                    "continue with the edited values (the records then mix two configs), or start a new run "
                    "(another run_id, or trainer.restart=true)."
                )
            trained_with = _container(OmegaConf.create(recorded) if recorded is not None else saved)
            plan = resume_config(saved, cfg, cli, _saved_choices(run_dir), allow_change=allow_change)
            cfg = plan.config
            tcfg = cfg.trainer
        loop_cfg = check_trainer(tcfg)
        device = (
            device_for(dist, str(resolve_device(tcfg.device)))
            if dist.enabled
            else resolve_device(tcfg.device)
        )
        if tcfg.get("clock", trainer_default("clock")) == "process" and device.type == "cuda":
            raise ConfigError(
                "trainer.clock=process counts CPU seconds only; use trainer.clock=wall on a GPU"
            )
        dtype = DTYPES[tcfg.dtype]
        seed_everything(int(cfg.seed), bool(tcfg.deterministic))
        if tcfg.get("num_threads"):
            torch.set_num_threads(int(tcfg.num_threads))
        parts = _build_parts(cfg, dist, device, dtype)  # data, model, algorithm: fail before training
        reapply = None
        if trained_with is not None:
            changed = changed_optimizer_keys(trained_with, _container(cfg))
            if changed:
                reapply = hyperparameter_reapplier(parts[2], changed, str(cfg.optimizer.get("name")))

        def start_records() -> None:
            """Called once everything is built and checked, right before training: the first writes."""
            nonlocal started
            started = True
            if not dist.is_main:
                return
            if mode == "restart":
                aside = move_records_aside(run_dir)
                log.warning("trainer.restart=true: the old records of %s are in %s", run_dir.name, aside)
            if plan is not None:
                for line in plan.extended:
                    log.info("resume takes the new budget / checkpointing value: %s", line)
                for line in plan.changed:
                    log.warning("resume changes the run's config (trainer.allow_config_change): %s", line)
            for _, line in edits:
                log.warning(
                    "resume continues with the edited config.yaml (trainer.allow_config_change): %s", line
                )
            atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            if mode != "resume":
                save_command_line(run_dir, cli)

        return _train_parts(
            cfg, dist, device, run_dir, loop_cfg, parts, mode == "resume", start_records, reapply
        )
    finally:
        lock.release()
        if not started and created is not None:
            _remove_empty(run_dir, created)  # a run that stopped before training leaves no directory


def _container(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out


def checkpoint_config(path: Path) -> str | None:
    """The config text a checkpoint records (``config_yaml``), read without loading its tensors.

    Args:
        path: The checkpoint.

    Returns:
        The text; ``None`` for a checkpoint written before configs were recorded.

    Raises:
        CorruptCheckpointError: The file cannot be read.
    """
    try:
        try:  # tensors mapped, not read: cheap for any size
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except Exception:  # a format mmap cannot read (torch's legacy one): read it
            state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated / not a torch file
        raise CorruptCheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {err}); it is truncated or corrupt. "
            "Restore it, or start the run again with trainer.restart=true"
        ) from err
    text = state.get("config_yaml") if isinstance(state, dict) else None
    return text if isinstance(text, str) else None


def changed_optimizer_keys(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``optimizer.*`` keys whose value differs between two configs (present in both, or removed).

    Keys only ``now`` has (added to the configs since) do not count: their default applies.

    Args:
        then: The config the checkpoint was trained with.
        now: The config the resumed run continues with.

    Returns:
        The differing keys, sorted.
    """
    old = _flatten(then.get("optimizer") or {}, "optimizer.")
    new = _flatten(now.get("optimizer") or {}, "optimizer.")
    return sorted(
        k for k in old if k != "optimizer.name" and (k not in new or not _same_value(new[k], old[k]))
    )


def _same_value(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def hyperparameter_reapplier(
    algorithm: Algorithm, keys: list[str], optimizer_name: str
) -> Callable[[], list[str]]:
    """What puts changed optimizer settings back after a resume loads the optimizer state.

    ``optimizer.load_state_dict`` restores the param groups' saved hyper-parameters (``lr``,
    ``momentum``, ``betas``, ...): a resume that changes them (``trainer.allow_config_change``, or
    an edited ``config.yaml``) would log the new values and train with the old ones. The values
    the optimizer was just built with (from the changed config) are kept here and written back
    into its param groups after the load. Changes that cannot be applied that way are refused:
    settings of an algorithm that keeps its own state (SHF, HF-CG, K-FAC, ...), settings that are
    no param-group key, and any change under an lr scheduler (whose state is restored too).

    Args:
        algorithm: The freshly built algorithm.
        keys: The changed ``optimizer.*`` keys (:func:`changed_optimizer_keys`).
        optimizer_name: ``optimizer.name``, for the message.

    Returns:
        A function that re-applies the values and returns ``"param group i: key old -> new"`` lines.

    Raises:
        ConfigError: A key cannot be applied to the resumed state; the message lists them.
    """
    if isinstance(algorithm, TorchOptimizerAlgorithm):
        optimizers, scheduler, own = [algorithm.optimizer], algorithm.scheduler, ("grad_clip_value",)
    else:  # an Algorithm of its own; a torch optimizer inside it (FOSI) is re-applied the same way
        optimizers = [v for v in vars(algorithm).values() if isinstance(v, torch.optim.Optimizer)]
        scheduler, own = None, ()
    group_keys = {k for opt in optimizers for g in opt.param_groups for k in g if k != "params"}
    whole = any(k == "optimizer._target_" for k in keys)  # another optimizer: all its settings
    leaves, refused = set(group_keys) if whole else set(), []
    for key in keys:
        leaf = key.split(".", 1)[1]
        if leaf in own or leaf == "_target_":
            continue  # an attribute of the wrapper (not in the saved state), or covered by `whole`
        if scheduler is not None or leaf.startswith("scheduler"):
            refused.append(f"{key} (the lr scheduler's state is restored from the checkpoint)")
        elif not optimizers:
            refused.append(f"{key} (optimizer={optimizer_name} restores its own state from the checkpoint)")
        elif leaf not in group_keys:
            refused.append(f"{key} (not a param-group setting the resumed optimizer can take back)")
        else:
            leaves.add(leaf)
    if refused:
        raise ConfigError(
            "this resume changes optimizer settings that the checkpoint's state would silently override "
            "(the records would show values the run does not train with): "
            + "; ".join(refused)
            + ". Drop the change to continue the run as it was, or start a new run with it (another "
            "run_id, or trainer.restart=true)."
        )
    fresh = [
        [{k: copy.deepcopy(g[k]) for k in leaves if k in g} for g in opt.param_groups] for opt in optimizers
    ]

    def reapply() -> list[str]:
        lines = []
        for opt, groups in zip(optimizers, fresh):
            for i, (group, values) in enumerate(zip(opt.param_groups, groups)):
                for k, v in values.items():
                    if group.get(k) != v:
                        lines.append(f"param group {i}: {k} {group.get(k)!r} -> {v!r}")
                        group[k] = copy.deepcopy(v)
        return lines

    return reapply


def _remove_empty(path: Path, top: Path) -> None:
    """Remove ``path`` and its parents up to ``top`` while they are empty directories."""
    for d in [path, *path.parents]:
        try:
            d.rmdir()
        except OSError:  # not empty, or gone
            return
        if d == top:
            return


def _saved_choices(run_dir: Path) -> dict[str, str] | None:
    path = run_dir / "overrides.yaml"
    if not path.exists():
        return None
    saved = OmegaConf.to_container(load_saved_config(path))
    return dict(saved.get("choices") or {}) if isinstance(saved, dict) else None


def _build_parts(
    cfg: DictConfig, dist: DistInfo, device: torch.device, dtype: torch.dtype
) -> tuple[DataBundle, Objective, Algorithm, int | None]:
    tcfg = cfg.trainer
    try:
        data = build_data(cfg, dtype, device)  # fails before training if data are missing
    except (ValueError, TypeError) as err:
        if isinstance(err, BadInputError):
            raise
        raise ConfigError(f"dataset={cfg.dataset.get('name')}: {err}") from err
    check_monitor(data, str(tcfg.get("monitor", trainer_default("monitor"))), str(cfg.dataset.get("name")))
    try:
        model, loss = build_model(cfg, dtype, device)
    except (ValueError, TypeError, RuntimeError) as err:  # RuntimeError: torch on impossible shapes
        if isinstance(err, BadInputError):
            raise
        raise ConfigError(f"model ({cfg.model.get('_target_')}): {err}") from err
    objective = Objective(model, loss)
    check_model_fits_data(objective, data, str(cfg.model.get("_target_")), str(cfg.dataset.get("name")))
    micro = tcfg.get("micro_batch_size")
    try:
        algorithm = build_algorithm(
            cfg.optimizer,
            objective,
            data,
            micro_batch_size=int(micro) if micro else None,
            train_model=wrap_ddp(model, dist, device) if dist.enabled else None,
        )
    except (ValueError, TypeError) as err:
        if isinstance(err, BadInputError):
            raise
        raise ConfigError(f"optimizer={cfg.optimizer.get('name')}: {err}") from err
    return data, objective, algorithm, int(micro) if micro else None


def _train_parts(
    cfg: DictConfig,
    dist: DistInfo,
    device: torch.device,
    run_dir: Path,
    loop_cfg: LoopConfig,
    parts: tuple[DataBundle, Objective, Algorithm, int | None],
    resume: bool,
    start_records: Callable[[], None],
    reapply: Callable[[], list[str]] | None = None,
) -> dict[str, Any]:
    tcfg = cfg.trainer
    data, objective, algorithm, micro = parts
    lcfg = cfg.logger
    tracker = make_tracker(
        lcfg.kind if dist.is_main else "none",
        **(
            {
                "project": lcfg.project,
                "entity": lcfg.entity,
                "mode": lcfg.mode,
                "dir": lcfg.dir,
                "name": run_dir.name,
                "group": str(cfg.experiment_name),
                "config": _to_container(cfg),
            }
            if lcfg.kind == "wandb"
            else {}
        ),
    )
    extra = {
        "experiment": str(cfg.experiment_name),
        "run_id": run_dir.name,
        "optimizer": str(cfg.optimizer.name),
        "dataset": data.meta.get("name", cfg.dataset.get("name")),
        "synthetic_data": bool(data.meta.get("synthetic", False)),
        "profile": str(cfg.profile),
        "seed": int(cfg.seed),
        "tag": cfg.get("tag"),
        "num_params": objective.num_params(),
        "dtype": str(tcfg.dtype),
        "micro_batch_size": int(micro) if micro else None,
        "git_commit": git_commit(Path(__file__).parent),
        **environment_info(device),
    }
    trainer = Trainer(
        objective,
        algorithm,
        data,
        loop_cfg,
        run_dir,
        device,
        int(cfg.seed),
        tracker,
        extra,
        tracker_every=int(lcfg.get("log_every", 1)),
        dist=dist,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),  # what start_records writes
    )
    trainer.reapply_hyperparameters = reapply
    summary: dict[str, Any] = {"status": "failed"}
    try:
        if resume:  # before any record is touched: a checkpoint that does not fit changes nothing
            try:
                trainer.load_checkpoint(verify=False)  # verified by _run (rank 0) already
            except BaseException:
                if trainer.stream is not None:
                    trainer.stream.close()
                raise
        start_records()
        summary = trainer.run(resume=resume)
    finally:
        tracker.finish(exit_code=exit_code(summary))
    summary["run_dir"] = str(run_dir)
    return summary
