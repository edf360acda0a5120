"""Structured-config schemas for the ``trainer``, ``paths`` and ``logger`` config groups.

Each YAML file of those groups lists its schema first in its defaults list (``- schema`` in
``conf/trainer/default.yaml``), so Hydra checks every key and type when it composes: a typo such as
``trainer.max_stepz=5`` (or ``+trainer.max_stepz=5``) or a wrong type such as
``trainer.max_steps=ten`` fails before anything is loaded, naming the key. Ranges and choices
(``trainer.clock`` is ``wall`` or ``process``) are checked later by
:func:`curvopt.training.build.check_trainer`, with the valid values in the message.

The schemas are registered in Hydra's ConfigStore by :func:`register_schemas` (`src/train.py` calls it); a
script that composes ``conf/`` itself calls :func:`register_schemas` first (it is idempotent).
The class docstrings document every field; the groups' YAML files (``conf/trainer/default.yaml``,
``conf/paths/default.yaml``, ``conf/logger/*.yaml``) repeat them as comments next to the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoggerSchema", "PathsSchema", "TrainerSchema", "register_schemas", "trainer_default"]


@dataclass
class TrainerSchema:
    """The training loop's settings (the ``trainer`` group; :class:`curvopt.training.loop.LoopConfig`).

    Args:
        max_steps: Stop after this many updates.
        max_epochs: Stop after this many passes over the training set, counted by examples seen;
            ``None``: no such limit.
        max_algo_time_s: Stop when the algorithm's own time (evaluation excluded) exceeds this
            many seconds; ``None``: no budget.
        batch_size: Examples per update, unless the algorithm chooses its own (SHF).
        sampling: How batches are drawn: ``epoch`` (shuffled passes), ``independent`` (a fresh
            draw each step, SHF), ``static`` or ``static_padded``.
        eval_every: Steps between evaluations (there is also one at step 0 and one at the end).
        eval_batch_size: Rows per forward pass in evaluation.
        eval_splits: The splits evaluated, among ``train``, ``val`` and ``test``.
        log_every: Steps between metric rows of the algorithm's own scalars.
        checkpoint_every: Steps between checkpoints; 0: only at the end and on interrupt.
        checkpoint_every_s: Also checkpoint every this many wall seconds (long runs that must
            survive a restart); ``None``: off.
        keep_checkpoint: Keep ``checkpoint.pt`` after a completed run.
        resume: Continue ``<paths.results_dir>/<experiment>/<run_id>/`` from its checkpoint, with
            its saved config (docs/resume.md).
        restart: Run an existing ``run_id`` again from step 0; its old records are moved aside,
            never deleted.
        allow_config_change: Resume even though the command line changes the saved config beyond
            extending the run.
        patience_evals: Stop after this many evaluations without a new best ``monitor`` value;
            ``None``: off.
        monitor: The validation metric behind ``patience_evals`` and the summary's ``best``.
        monitor_mode: ``min`` or ``max``: which direction of ``monitor`` is better.
        device: ``auto`` (CUDA when visible, else CPU), ``cpu`` or ``cuda``.
        dtype: ``float32``, ``float64`` or ``bfloat16`` (pure bf16 weights and states, GaLore's
            LLM setup).
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
        clock: ``wall`` (the papers' computation time; CUDA-synchronised) or ``process`` (this
            process's CPU seconds, for shared CPUs).
    """

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


_TRAINER_DEFAULTS = TrainerSchema()


def trainer_default(key: str) -> Any:
    """The default of one ``trainer`` setting: the single place the loop and the checks read it from.

    ``conf/trainer/default.yaml`` repeats these values with comments; a test checks that they agree.

    Args:
        key: A field of :class:`TrainerSchema`.

    Returns:
        Its default (a fresh list for ``eval_splits``).

    Raises:
        AttributeError: If ``key`` is not a trainer setting.
    """
    value = getattr(_TRAINER_DEFAULTS, key)
    return list(value) if isinstance(value, list) else value


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
    store.store(group="trainer", name="schema", node=TrainerSchema)
    store.store(group="paths", name="schema", node=PathsSchema)
    store.store(group="logger", name="schema", node=LoggerSchema)
    _REGISTERED = True
