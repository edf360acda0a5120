"""The ``trainer`` settings of a run: :class:`TrainerConfig`, checked when built.

A plain dataclass with no Hydra or omegaconf import, so that the training loop
(:mod:`curvopt.training.loop`) runs from a script of one's own without the config stack;
:mod:`curvopt.training.schema` registers it as Hydra's ``trainer/schema`` node and checks whole run
configs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from curvopt.errors import ConfigError
from curvopt.training.sampler import SAMPLING_MODES

__all__ = ["DTYPES", "SPLITS", "TrainerConfig"]

# trainer.dtype: the names a config may give, and the torch dtypes they stand for
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SPLITS = ("train", "val", "test")


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
    def from_config(cls, tcfg: Mapping[str, Any] | None) -> TrainerConfig:
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


def _plain(node: Any) -> dict[str, Any]:
    """A plain dict of a mapping or of an omegaconf ``DictConfig`` (resolved, imported only then)."""
    if type(node).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

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
