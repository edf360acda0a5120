"""From a composed Hydra config to a finished run, one way through.

:func:`run_from_config` takes four steps, each once:

1. check: the whole config is checked and resolved (:class:`~curvopt.training.schema.RunSettings`,
   with the trainer settings as a :class:`~curvopt.training.schema.TrainerConfig`) before anything
   is loaded or created; a bad value is a :class:`~curvopt.errors.ConfigError` naming it;
2. the run directory: what this command may do with it (:func:`~curvopt.training.rundir.check_run_dir`);
   a resumed run continues with its saved config, checked the same way
   (:func:`~curvopt.training.rundir.plan_resume`);
3. the parts, from the checked values: data -> model -> objective -> algorithm
   (:func:`build_parts`), then wrapped for data parallelism (:func:`~curvopt.training.distributed.distribute`);
   a part that cannot be built stops the run before anything is written;
4. the loop (:class:`~curvopt.training.loop.Trainer`), which reads the checked trainer settings.

Kept apart from ``src/train.py`` so tests and drivers can run a config without the CLI.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from curvopt.api import Algorithm, DataBundle
from curvopt.errors import BadInputError, ConfigError, CorruptDataError, exit_code
from curvopt.objective import Objective, mean_loss
from curvopt.training.algorithm import TorchOptimizerAlgorithm
from curvopt.training.distributed import (
    SINGLE,
    DistInfo,
    broadcast_object,
    cleanup,
    device_for,
    distribute,
    env_world_size,
    init_distributed,
)
from curvopt.training.loop import Trainer
from curvopt.training.records import (
    RunLock,
    atomic_write_text,
    environment_info,
    git_commit,
    portable_config_yaml,
)
from curvopt.training.rundir import (
    CommandLine,
    ResumePlan,
    check_name,
    check_run_dir,
    move_records_aside,
    plan_resume,
    save_command_line,
)
from curvopt.training.schema import DTYPES, RunSettings, TrainerConfig
from curvopt.training.tracking import make_tracker

log = logging.getLogger(__name__)

# Keys of an optimizer config that describe the run, not the constructor.
RESERVED_OPTIMIZER_KEYS = ("name", "grad_clip_value", "scheduler")


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


def _to_container(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A config node as a fresh plain dict (resolved); a plain mapping is copied."""
    if isinstance(cfg, DictConfig):
        out = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(out, dict)
        return out
    return copy.deepcopy(dict(cfg))


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


def build_data(cfg: DictConfig | Mapping[str, Any], dtype: torch.dtype, device: torch.device) -> DataBundle:
    """Load the ``dataset`` config's splits and move them to the run's device.

    Args:
        cfg: The run config, or its resolved form (:attr:`RunSettings.config`): its ``dataset``
            entry names the loader in ``_target_``.
        dtype: Floating-point tensors (inputs, and regression targets) are cast to it; integer labels
            keep their dtype.
        device: Where the splits go.

    Returns:
        The loader's :class:`~curvopt.api.DataBundle` with ``train``/``val``/``test`` moved.

    Raises:
        TypeError: The loader did not return a ``DataBundle``.
    """
    data_cfg = _to_container(cfg["dataset"])
    name = data_cfg.pop("name", None)
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
    check_data(data, str(name))
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


def build_model(
    cfg: DictConfig | Mapping[str, Any], dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, str]:
    """Build the ``model`` config's network.

    Args:
        cfg: The run config, or its resolved form (:attr:`RunSettings.config`): its ``model``
            entry holds ``_target_``, the builder's arguments and ``loss``.
        dtype: Parameter dtype.
        device: Parameter device.

    Returns:
        ``(model, loss)``, where ``loss`` is ``squared_error``, ``cross_entropy`` or ``sigmoid_bce``.

    Raises:
        ValueError: The model config has no ``loss`` key.
    """
    model_cfg = _to_container(cfg["model"])
    loss = model_cfg.pop("loss", None)
    if loss is None:
        raise ValueError("model config needs a `loss:` key (squared_error | cross_entropy | sigmoid_bce)")
    model = call_target(model_cfg)
    return model.to(device=device, dtype=dtype), loss


def build_algorithm(
    opt_cfg: DictConfig | Mapping[str, Any],
    objective: Objective,
    data: DataBundle,
    micro_batch_size: int | None = None,
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

    Returns:
        The algorithm the loop steps with ``step(batch)``.

    Raises:
        ValueError: No ``_target_``, or a factory's ``Algorithm`` given ``scheduler`` or
            ``grad_clip_value`` (it clips and schedules itself).
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
        )

    if inspect.isclass(target) and issubclass(target, torch.optim.Optimizer):
        if "betas" in kwargs and isinstance(kwargs["betas"], list):
            kwargs["betas"] = tuple(kwargs["betas"])
        return wrap(target(objective.model.parameters(), **kwargs))
    algorithm = target(objective=objective, data=data, **kwargs)
    if isinstance(algorithm, torch.optim.Optimizer):
        return wrap(algorithm)
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


def make_run_id(settings: RunSettings, dist: DistInfo = SINGLE) -> str:
    """The run directory's name: ``run_id`` when set, else ``<optimizer>_s<seed>_<time>_<random>``.

    Args:
        settings: The checked run config.
        dist: Distributed context; rank 0's generated id is broadcast to every rank.

    Returns:
        The run id.
    """
    if settings.run_id:
        return settings.run_id
    stamp = time.strftime("%Y%m%d-%H%M%S")
    generated = f"{settings.optimizer_name}_s{settings.seed}_{stamp}_{uuid.uuid4().hex[:6]}"
    return check_name("run_id", broadcast_object(generated, dist))


def run_from_config(cfg: DictConfig, cli: CommandLine | None = None) -> dict[str, Any]:
    """Run one training job described by ``cfg`` and return its summary (the module's four steps).

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
    settings = RunSettings.from_config(cfg)  # 1. every value checked, before anything is created
    trainer = settings.trainer
    dist = init_distributed(trainer.device, trainer.dist_backend) if env_world_size() > 1 else SINGLE
    try:
        return _run(cfg, settings, dist, cli)
    finally:
        cleanup(dist)


def _run(cfg: DictConfig, settings: RunSettings, dist: DistInfo, cli: CommandLine | None) -> dict[str, Any]:
    run_dir = settings.results_dir / settings.experiment_name / make_run_id(settings, dist)
    # the saved config.yaml names its run, generated id included, so `run_id=<id> trainer.resume=true`
    # resumes it like a named run
    cfg.run_id = run_dir.name
    resume, restart = settings.trainer.resume, settings.trainer.restart
    # the topmost directory this run creates (removed again if it stops before training)
    created = next((d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()), None)
    lock = RunLock(run_dir)
    started = False
    try:
        # 2. the run directory (one process per directory, from before anything is loaded)
        if dist.is_main:
            lock.acquire()
            mode = check_run_dir(run_dir, resume, restart)
        else:
            mode = "resume" if resume else "new"
        plan = None
        if mode == "resume":
            allow_change = settings.trainer.allow_config_change
            plan = plan_resume(run_dir, cfg, cli, allow_change, verify=dist.is_main)
            if plan is not None:  # the run's saved config, with what the command line may change
                cfg = plan.config
                settings = RunSettings.from_config(cfg, composed=False)
        # 3. the parts, from the checked values
        device = run_device(settings.trainer, dist)
        seed_everything(settings.seed, settings.trainer.deterministic)
        if settings.trainer.num_threads:
            torch.set_num_threads(settings.trainer.num_threads)
        data, objective, algorithm = build_parts(settings, device)  # fail before training
        distribute(
            algorithm, objective.model, dist, device, str(settings.config["optimizer"].get("_target_"))
        )
        reapply = None
        if plan is not None and plan.optimizer_changes:
            reapply = hyperparameter_reapplier(algorithm, plan.optimizer_changes, settings.optimizer_name)
        config_yaml = OmegaConf.to_yaml(cfg, resolve=True)  # config.yaml, and every checkpoint's copy

        def start_records() -> None:
            """Called once everything is built and checked, right before training: the first writes."""
            nonlocal started
            started = True
            if dist.is_main:
                _first_records(run_dir, mode, plan, config_yaml, cli)

        # 4. the loop
        return _train(
            settings,
            run_dir,
            dist,
            device,
            (data, objective, algorithm),
            config_yaml,
            start_records,
            resume=mode == "resume",
            reapply=reapply,
        )
    finally:
        lock.release()
        if not started and created is not None:
            _remove_empty(run_dir, created)  # a run that stopped before training leaves no directory


def run_device(trainer: TrainerConfig, dist: DistInfo) -> torch.device:
    """The device this process trains on.

    Args:
        trainer: The checked trainer settings (``device``, ``clock``).
        dist: This process's place in the process group (CUDA runs under torchrun use
            ``cuda:<local_rank>``).

    Returns:
        The device.

    Raises:
        ConfigError: CUDA was asked for but none is visible, or ``trainer.clock=process`` would
            time a GPU.
    """
    device = resolve_device(trainer.device)
    if dist.enabled:
        device = device_for(dist, str(device))
    if trainer.clock == "process" and device.type == "cuda":
        raise ConfigError("trainer.clock=process counts CPU seconds only; use trainer.clock=wall on a GPU")
    return device


def build_parts(settings: RunSettings, device: torch.device) -> tuple[DataBundle, Objective, Algorithm]:
    """Data -> model -> objective -> algorithm, from a checked run config.

    Each part is checked against the previous ones (the monitored split exists; the model takes
    the data), so a run that cannot train stops here, before anything is written.

    Args:
        settings: The checked run config.
        device: Where the data and the model go.

    Returns:
        ``(data, objective, algorithm)``.

    Raises:
        ConfigError: A part cannot be built from its config; the message names the part.
        BadInputError: Missing or corrupt data files (the loaders' own errors).
    """
    dtype = DTYPES[settings.trainer.dtype]
    try:
        data = build_data(settings.config, dtype, device)  # fails before training if data are missing
    except (ValueError, TypeError) as err:
        if isinstance(err, BadInputError):
            raise
        raise ConfigError(f"dataset={settings.dataset_name}: {err}") from err
    check_monitor(data, settings.trainer.monitor, settings.dataset_name)
    try:
        model, loss = build_model(settings.config, dtype, device)
    except (ValueError, TypeError, RuntimeError) as err:  # RuntimeError: torch on impossible shapes
        if isinstance(err, BadInputError):
            raise
        raise ConfigError(f"model ({settings.model_target}): {err}") from err
    objective = Objective(model, loss)
    check_model_fits_data(objective, data, settings.model_target, settings.dataset_name)
    try:
        algorithm = build_algorithm(
            settings.config["optimizer"], objective, data, micro_batch_size=settings.trainer.micro_batch_size
        )
    except (ValueError, TypeError) as err:
        if isinstance(err, BadInputError):
            raise
        raise ConfigError(f"optimizer={settings.optimizer_name}: {err}") from err
    return data, objective, algorithm


def _first_records(
    run_dir: Path, mode: str, plan: ResumePlan | None, config_yaml: str, cli: CommandLine | None
) -> None:
    """What rank 0 writes once everything is built, right before training."""
    if mode == "restart":
        aside = move_records_aside(run_dir)
        log.warning("trainer.restart=true: the old records of %s are in %s", run_dir.name, aside)
    if plan is not None:
        for line in plan.extended:
            log.info("resume takes the new budget / checkpointing value: %s", line)
        for line in plan.changed:
            log.warning("resume changes the run's config (trainer.allow_config_change): %s", line)
        for _, line in plan.edits:
            log.warning(
                "resume continues with the edited config.yaml (trainer.allow_config_change): %s", line
            )
    # the folders the run reads and writes, relative to the data directory / the repository
    atomic_write_text(run_dir / "config.yaml", portable_config_yaml(config_yaml))
    if mode != "resume":
        save_command_line(run_dir, cli)


def _train(
    settings: RunSettings,
    run_dir: Path,
    dist: DistInfo,
    device: torch.device,
    parts: tuple[DataBundle, Objective, Algorithm],
    config_yaml: str,
    start_records: Callable[[], None],
    resume: bool,
    reapply: Callable[[], list[str]] | None,
) -> dict[str, Any]:
    data, objective, algorithm = parts
    trainer_cfg, logger = settings.trainer, settings.logger
    kind = str(logger.get("kind")) if dist.is_main else "none"
    tracker = make_tracker(
        kind,
        **(
            {
                "project": logger.get("project"),
                "entity": logger.get("entity"),
                "mode": logger.get("mode"),
                "dir": logger.get("dir"),
                "name": run_dir.name,
                "group": settings.experiment_name,
                "config": {**settings.config, "run_id": run_dir.name},
            }
            if kind == "wandb"
            else {}
        ),
    )
    extra = {
        "experiment": settings.experiment_name,
        "run_id": run_dir.name,
        "optimizer": settings.optimizer_name,
        "dataset": data.meta.get("name", settings.config["dataset"].get("name")),
        "synthetic_data": bool(data.meta.get("synthetic", False)),
        "profile": settings.profile,
        "seed": settings.seed,
        "tag": settings.tag,
        "num_params": objective.num_params(),
        "dtype": trainer_cfg.dtype,
        "micro_batch_size": trainer_cfg.micro_batch_size,
        "git_commit": git_commit(Path(__file__).parent),
        **environment_info(device),
    }
    trainer = Trainer(
        objective,
        algorithm,
        data,
        trainer_cfg,
        run_dir,
        device,
        settings.seed,
        tracker,
        extra,
        tracker_every=int(logger.get("log_every", 1)),
        dist=dist,
        config_yaml=config_yaml,
    )
    trainer.reapply_hyperparameters = reapply
    summary: dict[str, Any] = {"status": "failed"}
    try:
        if resume:  # before any record is touched: a checkpoint that does not fit changes nothing
            try:
                trainer.load_checkpoint(verify=False)  # verified by plan_resume (rank 0) already
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
        keys: The changed ``optimizer.*`` keys (``ResumePlan.optimizer_changes``).
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
