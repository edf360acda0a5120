"""Structured-config schemas for the ``trainer``, ``paths`` and ``logger`` config groups.

Each YAML file of those groups lists its schema first in its defaults list (``- schema`` in
``conf/trainer/default.yaml``), so Hydra checks every key and type when it composes: a typo such as
``trainer.max_stepz=5`` (or ``+trainer.max_stepz=5``) or a wrong type such as
``trainer.max_steps=ten`` fails before anything is loaded, naming the key. Ranges and choices
(``trainer.clock`` is ``wall`` or ``process``) are checked later by
:func:`curvopt.training.build.check_trainer`, with the valid values in the message.

The schemas are registered in Hydra's ConfigStore when :mod:`curvopt.training` is imported; a
script that composes ``conf/`` itself calls :func:`register_schemas` first (it is idempotent).
The field comments are the user documentation; ``conf/trainer/default.yaml`` repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoggerSchema", "PathsSchema", "TrainerSchema", "register_schemas"]


@dataclass
class TrainerSchema:
    """The training loop's settings (``trainer`` group; documented in ``conf/trainer/default.yaml``)."""

    max_steps: int = 1000
    max_epochs: float | None = None
    max_algo_time_s: float | None = None
    batch_size: int = 128
    sampling: str = "epoch"
    eval_every: int = 100
    eval_batch_size: int = 2000
    eval_splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    log_every: int = 1
    checkpoint_every: int = 0
    checkpoint_every_s: float | None = None
    keep_checkpoint: bool = True
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


@dataclass
class PathsSchema:
    """Where data is read from and records are written (``paths`` group)."""

    root_dir: str = "."
    data_dir: str = "./data"
    results_dir: str = "./outputs/runs"
    output_dir: str = "./outputs"


@dataclass
class LoggerSchema:
    """The ``logger`` group: ``kind: none`` writes the local run records only; ``kind: wandb``
    also mirrors them to Weights & Biases with the other fields (which ``none`` ignores, so an
    experiment may set ``logger.log_every`` whichever logger a run picks)."""

    kind: str = "none"
    project: str = "curvopt"
    entity: str | None = None
    mode: str = "offline"
    dir: str = "./outputs"
    log_every: int = 10


_REGISTERED = False


def register_schemas() -> None:
    """Store the schemas in Hydra's ConfigStore as ``trainer/schema``, ``paths/schema``,
    and ``logger/schema`` (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="trainer", name="schema", node=TrainerSchema)
    store.store(group="paths", name="schema", node=PathsSchema)
    store.store(group="logger", name="schema", node=LoggerSchema)
    _REGISTERED = True
