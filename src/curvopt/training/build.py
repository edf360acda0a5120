"""From a composed Hydra config to a finished run: data, model, objective, algorithm, loop.

Kept apart from ``src/train.py`` so tests and drivers can run a config without the CLI.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from curvopt.objective import Objective
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
from curvopt.training.loop import LoopConfig, Trainer
from curvopt.training.records import RunLock, environment_info, git_commit
from curvopt.training.tracking import make_tracker

log = logging.getLogger(__name__)

# Keys of an optimizer config that describe the run, not the constructor.
RESERVED_OPTIMIZER_KEYS = ("name", "grad_clip_value", "scheduler")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def seed_everything(seed: int, deterministic: bool = True) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu")
    return device


def _to_container(cfg: DictConfig | dict) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def call_target(spec: dict[str, Any], **extra: Any) -> Any:
    """Call ``spec['_target_'](**rest, **extra)`` directly, so a loader's own exception (e.g. a
    missing-data message) reaches the user instead of Hydra's InstantiationException wrapper."""
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if target is None:
        raise ValueError(f"config needs a `_target_`: {spec}")
    spec.pop("_partial_", None)
    return get_method(target)(**spec, **extra)


def build_data(cfg: DictConfig, dtype: torch.dtype, device: torch.device) -> DataBundle:
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
    return data


def build_model(cfg: DictConfig, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, str]:
    model_cfg = _to_container(cfg.model)
    loss = model_cfg.pop("loss", None)
    if loss is None:
        raise ValueError("model config needs a `loss:` key (squared_error | cross_entropy | sigmoid_bce)")
    model = call_target(model_cfg)
    return model.to(device=device, dtype=dtype), loss


def build_algorithm(
    opt_cfg: DictConfig | dict,
    objective: Objective,
    data: DataBundle,
    micro_batch_size: int | None = None,
    train_model: torch.nn.Module | None = None,
) -> Algorithm:
    """Instantiate ``optimizer._target_``: a ``torch.optim.Optimizer`` subclass (wrapped) or a
    factory ``factory(objective=..., data=..., **kwargs)`` returning an ``Algorithm`` — or a
    ``torch.optim.Optimizer`` (e.g. one with parameter groups chosen from the model), which is
    wrapped exactly like an optimizer target, with the config's ``scheduler`` and clipping.

    ``micro_batch_size`` (gradient accumulation) and ``train_model`` (the DDP wrapper) apply to
    wrapped optimizers only; an ``Algorithm`` from a factory handles its own batches.
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
    if cfg.get("run_id"):
        return str(cfg.run_id)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return broadcast_object(f"{cfg.optimizer.name}_s{cfg.seed}_{stamp}_{uuid.uuid4().hex[:6]}", dist)


def apply_optimizer_variant(cfg: DictConfig, cli_overrides: Sequence[tuple[str, Any]] = ()) -> DictConfig:
    """Merge ``optimizer_variants[<optimizer.name>]`` into the config.

    Some papers define a method together with its model or protocol (Martens' HF uses a linear
    code layer and a cross-entropy objective; SHF a logistic code layer and squared error), so an
    experiment can hold per-optimizer deltas. Hydra has already applied the command line when this
    merge runs, so the command line's value overrides (``cli_overrides``: ``(key, value)`` pairs,
    :func:`cli_value_overrides` in ``src/train.py``) are applied again on top: an explicit
    ``optimizer.k=7`` wins over the experiment's variant, as a user expects. Merging twice is a
    no-op (``_variant_applied``).
    """
    if cfg.get("_variant_applied"):
        return cfg
    variants = cfg.get("optimizer_variants")
    name = cfg.optimizer.get("name")
    if not variants or name not in variants:
        return cfg
    merged = OmegaConf.merge(cfg, variants[name])
    assert isinstance(merged, DictConfig)
    for key, value in cli_overrides:
        OmegaConf.update(merged, key, value, merge=True, force_add=True)
    with open_dict(merged):
        merged._variant_applied = True
    return merged


def cli_value_overrides(task_overrides: Sequence[str], group_keys: Iterable[str]) -> list[tuple[str, Any]]:
    """The ``key=value`` overrides of a Hydra command line (not config-group choices such as
    ``optimizer=adam``, not deletions), parsed by Hydra's own override grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = set(group_keys)
    out = []
    for ov in OverridesParser.create().parse_overrides(list(task_overrides)):
        key = ov.key_or_group
        if ov.is_delete() or ov.is_sweep_override() or key in groups or key.startswith("hydra"):
            continue
        out.append((key, ov.value()))
    return out


def run_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Run one training job described by ``cfg``; return its summary (with ``run_dir``)."""
    cfg = apply_optimizer_variant(cfg)
    tcfg = cfg.trainer
    dist = (
        init_distributed(str(tcfg.device), str(tcfg.get("dist_backend", "auto")))
        if env_world_size() > 1
        else SINGLE
    )
    try:
        return _run(cfg, dist)
    finally:
        cleanup(dist)


def _run(cfg: DictConfig, dist: DistInfo) -> dict[str, Any]:
    tcfg = cfg.trainer
    device = (
        device_for(dist, str(resolve_device(tcfg.device))) if dist.enabled else resolve_device(tcfg.device)
    )
    dtype = DTYPES[tcfg.dtype]
    seed_everything(int(cfg.seed), bool(tcfg.deterministic))
    if tcfg.get("num_threads"):
        torch.set_num_threads(int(tcfg.num_threads))
    if tcfg.get("clock", "wall") == "process" and device.type == "cuda":
        raise ValueError("trainer.clock=process counts CPU seconds only; use trainer.clock=wall on a GPU")

    run_dir = Path(cfg.paths.results_dir) / str(cfg.experiment_name) / make_run_id(cfg, dist)
    if tcfg.resume and not (run_dir / "checkpoint.pt").exists():
        raise FileNotFoundError(
            f"trainer.resume=true needs run_id=<existing run> with a checkpoint; none at {run_dir}"
        )
    if not tcfg.resume and (run_dir / "summary.json").exists():
        raise FileExistsError(
            f"{run_dir} already holds a finished run; choose another run_id, delete it, or pass "
            "trainer.resume=true to continue it"
        )

    lock = RunLock(run_dir)
    if dist.is_main:
        lock.check()  # a second process on the same run refuses before loading anything
    try:
        return _run_locked(cfg, dist, device, dtype, run_dir, lock)
    finally:
        lock.release()


def _run_locked(
    cfg: DictConfig, dist: DistInfo, device: torch.device, dtype: torch.dtype, run_dir: Path, lock: RunLock
) -> dict[str, Any]:
    tcfg = cfg.trainer
    data = build_data(cfg, dtype, device)  # fails before training if data are missing
    model, loss = build_model(cfg, dtype, device)
    objective = Objective(model, loss)
    micro = tcfg.get("micro_batch_size")
    algorithm = build_algorithm(
        cfg.optimizer,
        objective,
        data,
        micro_batch_size=int(micro) if micro else None,
        train_model=wrap_ddp(model, dist, device) if dist.enabled else None,
    )

    if dist.is_main:
        lock.acquire()  # owns the run directory from here until the run returns
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    loop_cfg = LoopConfig(
        max_steps=int(tcfg.max_steps),
        max_epochs=tcfg.max_epochs,
        max_algo_time_s=tcfg.max_algo_time_s,
        batch_size=int(tcfg.batch_size),
        sampling=str(tcfg.get("sampling", "epoch")),
        eval_every=int(tcfg.eval_every),
        eval_batch_size=int(tcfg.eval_batch_size),
        eval_splits=list(tcfg.eval_splits),
        log_every=int(tcfg.log_every),
        checkpoint_every=int(tcfg.checkpoint_every),
        checkpoint_every_s=tcfg.get("checkpoint_every_s"),
        keep_checkpoint=bool(tcfg.keep_checkpoint),
        patience_evals=tcfg.patience_evals,
        monitor=str(tcfg.get("monitor", "val/loss")),
        monitor_mode=str(tcfg.get("monitor_mode", "min")),
        progress=bool(tcfg.progress),
        progress_log_every_s=float(tcfg.get("progress_log_every_s", 30.0)),
        eval_galore_compat=bool(tcfg.get("eval_galore_compat", False)),
        clock=str(tcfg.get("clock", "wall")),
    )
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
    )
    summary = trainer.run(resume=bool(tcfg.resume))
    tracker.finish(exit_code=0 if summary["status"] == "completed" else 1)
    summary["run_dir"] = str(run_dir)
    return summary
