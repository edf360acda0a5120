"""The training loop shared by every optimizer.

Per step: ask the algorithm for its batch size, draw the batch, time ``algorithm.step`` (and
only that: the *algorithm time* of the papers' time axes), log its scalars. Every
``eval_every`` steps, evaluate all splits outside the timer. Stop on ``max_steps``,
``max_epochs``, an algorithm-time budget, validation patience, a non-finite loss or gradient
(``diverged``), SIGINT/SIGTERM (``interrupted``) or an error (``failed``); records written so far
are always kept and ``summary.json`` always says which.

Signals are deferred: SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop) lets the current step and
its records finish, then the loop writes a checkpoint *at that step boundary* and stops, so
``resume=True`` continues with metrics identical to an uninterrupted run. A second signal stops
at once without a new checkpoint (the last periodic one, if any, stays valid). docs/resume.md;
the handlers are :class:`~curvopt.training.signals.StopSignals`, the checkpoint file and the RNG
states :mod:`curvopt.training.checkpoint`.

The settings are a checked :class:`~curvopt.training.schema.TrainerConfig` (the ``trainer``
config group); the loop reads nothing else of the run config.

Language-model runs add, per logged step, ``tokens`` (non-ignored targets of the update),
``tokens_seen`` and ``tokens_per_s`` (tokens over the update's algorithm time, evaluation
excluded). Training data come from the in-memory ``train`` split through the sampler, or from
``DataBundle.train_stream`` when the dataset streams. Under ``torchrun`` every rank runs this
loop on its shard of each global batch (and of each evaluation split); scalars are reduced over
ranks so every rank takes the same decisions, and only rank 0 writes records and checkpoints.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from curvopt.api import Algorithm, DataBundle
from curvopt.errors import CorruptCheckpointError, NoCheckpointError
from curvopt.objective import Objective
from curvopt.profiling import tensor_bytes
from curvopt.training.checkpoint import (
    CHECKPOINT_NAME,
    CHECKSUM_NAME,
    CheckpointWriteError,
    read_checkpoint,
    rng_state,
    set_rng_state,
    verify_checkpoint,
    write_checkpoint,
    write_checksum,
)
from curvopt.training.distributed import SINGLE, DistInfo, all_reduce, gather_objects, shard_slice
from curvopt.training.evaluation import evaluate_split
from curvopt.training.records import RunRecorder
from curvopt.training.sampler import BatchSampler, shard
from curvopt.training.signals import StopSignals
from curvopt.training.tracking import NullTracker
from curvopt.training.trainer_config import TrainerConfig

log = logging.getLogger(__name__)

TIMING_FIELDS = ("algo_time_s", "wall_time_s", "step_time_s", "peak_mem_bytes", "tokens_per_s")


def is_timing_field(key: str) -> bool:
    """Whether a metrics field measures time or memory (it differs between identical runs).

    Args:
        key: A metrics field name.

    Returns:
        ``True`` for the loop's :data:`TIMING_FIELDS` and the optimizers' own timers
        (``ese_time_s``, ``lsmr_time``, …).
    """
    return key in TIMING_FIELDS or key.endswith(("_time", "_time_s"))


def comparable_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metric rows without their timing fields.

    What remains must be identical between a resumed run and an uninterrupted one
    (docs/resume.md).

    Args:
        rows: Rows of a ``metrics.jsonl``.

    Returns:
        The rows without the fields :func:`is_timing_field` accepts.
    """
    return [{k: v for k, v in row.items() if not is_timing_field(k)} for row in rows]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of the run so far.

    Args:
        device: The run's device.

    Returns:
        ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak resident set size
        (Linux ``ru_maxrss``), in bytes.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def binding_budget(cfg: TrainerConfig, step: int, epoch: float, algo_time: float) -> tuple[str, float, float]:
    """The budget that will stop the run first, at the rate so far.

    Of ``max_steps``, ``max_epochs`` and ``max_algo_time_s`` (those set), the one with the largest
    fraction used; before anything is used, the algorithm-time budget when there is one (the
    quick profiles set ``max_algo_time_s`` and a ``max_steps`` they never reach), else epochs,
    else steps. Patience is not a budget: it stops a run when it stops improving.

    Args:
        cfg: The trainer settings.
        step: Steps taken.
        epoch: Passes over the training set so far.
        algo_time: Algorithm seconds so far.

    Returns:
        ``(unit, done, total)``: ``unit`` is ``"algo-s"``, ``"epoch"`` or ``"step"``.
    """
    budgets: list[tuple[str, float, float]] = []
    if cfg.max_algo_time_s is not None:
        budgets.append(("algo-s", float(algo_time), float(cfg.max_algo_time_s)))
    if cfg.max_epochs is not None:
        budgets.append(("epoch", float(epoch), float(cfg.max_epochs)))
    budgets.append(("step", float(step), float(cfg.max_steps)))
    # the first listed wins ties (all at zero at the start)
    return max(budgets, key=lambda b: b[1] / b[2] if b[2] > 0 else math.inf)


class BudgetProgress:
    """A tqdm bar whose total is the budget that stops the run (:func:`binding_budget`).

    A time budget is counted in algorithm seconds, so the bar ends when the run does and its ETA
    (average rate over the whole run, evaluation included) is the wall time left. When another
    budget becomes the binding one, the bar switches to its unit. The step count and the loss are
    shown after the bar. Shown on a terminal only (``disable=None``): in logs and CI the loop
    writes one line per evaluation instead.

    Args:
        cfg: The trainer settings.
        desc: The bar's label (the run id).
        file: Where the bar goes (``None``: stderr).
        disable: ``None``: shown on a terminal only; ``False``: always (tests).
        start: ``(step, epoch, algorithm seconds)`` the run starts from (a resumed run's).
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        desc: str,
        file: Any = None,
        disable: bool | None = None,
        start: tuple[int, float, float] = (0, 0.0, 0.0),
    ) -> None:
        from tqdm.auto import tqdm

        self.cfg = cfg
        self.unit, done, total = binding_budget(cfg, *start)
        # smoothing=0: the rate is the run's average, which a budget in algorithm seconds needs
        # (evaluation pauses the count but not the clock)
        self.bar = tqdm(
            total=total,
            initial=min(done, total),  # a resumed run: the rate counts only this session's progress
            desc=desc,
            unit=self.unit,
            unit_scale=True,
            smoothing=0,
            leave=False,
            file=file,
            disable=disable,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} "
            "[{elapsed}<{remaining}{postfix}]",
        )

    @property
    def disabled(self) -> bool:
        """Whether the bar is hidden (no terminal)."""
        return bool(self.bar.disable)

    def update(self, step: int, epoch: float, algo_time: float, loss: Any = None) -> None:
        """Move the bar to the binding budget's count.

        Args:
            step: Steps taken.
            epoch: Passes over the training set so far.
            algo_time: Algorithm seconds so far.
            loss: The last step's loss, shown after the bar (``None``: not shown).
        """
        if self.disabled:
            return
        unit, done, total = binding_budget(self.cfg, step, epoch, algo_time)
        if unit != self.unit:
            self.unit, self.bar.unit, self.bar.total = unit, unit, total
            self.bar.initial = 0  # the rate from here on: this unit's count over the session's time
        postfix = {"step": f"{step}" if unit == "step" else f"{step}/{self.cfg.max_steps}"}
        if isinstance(loss, (int, float)):
            postfix["loss"] = f"{loss:.4g}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(min(done, total) - self.bar.n)

    def close(self) -> None:
        """Remove the bar."""
        self.bar.close()


class _NullRecorder:
    """Ranks other than 0 keep no records."""

    def log(self, row: dict[str, Any]) -> None:
        del row

    def write_summary(self, summary: dict[str, Any]) -> None:
        del summary

    def close(self) -> None:
        pass


class Trainer:
    """Runs one training run: the loop of the module docstring, records, checkpoints, resume.

    Args:
        objective: The model and its loss kind (evaluation, checkpoints).
        algorithm: The optimizer, as an :class:`~curvopt.api.Algorithm`.
        data: The run's data; ``train`` (sampled) or ``train_stream`` (streamed).
        config: The loop's settings (the checked ``trainer`` config).
        run_dir: The run directory (records and ``checkpoint.pt``).
        device: The device the batches are moved to (streams) and timed on.
        seed: Run seed; the sampler uses ``seed + 1``.
        tracker: Mirror of the records (wandb); default :class:`NullTracker`.
        summary_extra: Extra entries for ``summary.json``.
        tracker_every: Send every this many steps' rows to the tracker (evaluation rows always).
        dist: This process's place in the process group (:data:`SINGLE` without torchrun).
        config_yaml: The run's ``config.yaml`` text, recorded in every checkpoint so that a resume
            can tell a hand-edited ``config.yaml`` (:func:`curvopt.training.rundir.config_edits`).

    Attributes:
        reapply_hyperparameters: Called right after the optimizer state is loaded on resume (it
            restores the param groups' saved hyper-parameters): puts the configured ones back when
            the resume changed them (``trainer.allow_config_change``); returns what it changed.
    """

    def __init__(
        self,
        objective: Objective,
        algorithm: Algorithm,
        data: DataBundle,
        config: TrainerConfig,
        run_dir: Path,
        device: torch.device,
        seed: int = 0,
        tracker: NullTracker | None = None,
        summary_extra: dict[str, Any] | None = None,
        tracker_every: int = 1,
        dist: DistInfo = SINGLE,
        config_yaml: str | None = None,
    ) -> None:
        self.objective = objective
        self.algorithm = algorithm
        self.data = data
        self.cfg = config
        self.run_dir = Path(run_dir)
        self.device = device
        self.tracker = tracker or NullTracker()
        self.tracker_every = max(1, tracker_every)
        self.summary_extra = summary_extra or {}
        self.dist = dist
        self.stream = data.train_stream
        if self.stream is not None:
            self.stream.start(dist.rank, dist.world_size)
            self.sampler = None
        else:
            self.sampler = BatchSampler(data.num_train, config.sampling, seed=seed + 1)
        self.tokens_seen = 0
        self.step = 0
        self.algo_time = 0.0
        self.wall_offset = 0.0
        self.eval_time = 0.0
        self.overhead_time = 0.0  # data sampling + logging, for the loop-overhead figure
        self.best: dict[str, Any] = {}
        self.evals_since_best = 0
        self.last_eval: dict[str, float] = {}
        self.status = "running"
        self.checkpoint_step: int | None = None  # step of the checkpoint on disk (resumable from)
        self.checkpoint_error: str | None = None
        self.error: str | None = None
        self.config_yaml = config_yaml
        self.reapply_hyperparameters: Callable[[], list[str]] | None = None
        self._restored = False  # load_checkpoint() ran (before the records were touched)

    # -- checkpoints ----------------------------------------------------------------------------
    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "model": self.objective.model.state_dict(),
            "algorithm": self.algorithm.state_dict(),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "stream": gather_objects(self.stream.state_dict(), self.dist)
            if self.stream is not None
            else None,
            "world_size": self.dist.world_size,
            "tokens_seen": self.tokens_seen,
            "rng": rng_state(),
            "algo_time": self.algo_time,
            "wall_time": self._wall(),
            "eval_time": self.eval_time,
            "overhead_time": self.overhead_time,
            "best": self.best,
            "evals_since_best": self.evals_since_best,
            "last_eval": self.last_eval,
            "config_yaml": self.config_yaml,
        }

    def save_checkpoint(self) -> None:
        """Write ``checkpoint.pt`` atomically (a temporary file, fsync, rename), then its checksum.

        A crash or a full disk leaves the previous checkpoint intact and no partial file behind
        (:func:`~curvopt.training.checkpoint.write_checkpoint`).
        ``checkpoint.pt.sha256`` (its SHA-256, hashed while it is written) is removed before the
        rename and written atomically after it, so it never describes another file: a crash in
        between leaves a checkpoint without a checksum (accepted with a warning on resume).
        Under DDP every rank must call it (the stream positions are gathered); only rank 0
        writes.

        Raises:
            CheckpointWriteError: If the write fails; the message names the file.
        """
        state = self._checkpoint_state()  # collective under DDP (stream positions): every rank
        if not self.dist.is_main:
            return
        path = self.run_dir / CHECKPOINT_NAME
        digest = write_checkpoint(path, state, self.step)
        self._last_checkpoint = time.perf_counter()
        self.checkpoint_step = self.step
        write_checksum(path, digest)

    def _try_checkpoint(self) -> None:
        """A checkpoint whose failure is recorded (summary ``checkpoint_error``), not fatal."""
        try:
            self.save_checkpoint()
        except CheckpointWriteError as err:
            self.checkpoint_error = str(err)
            self._last_checkpoint = time.perf_counter()  # do not retry at every step
            log.error("%s", err)

    def _checkpoint_due(self) -> bool:
        cfg = self.cfg
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            return True
        return bool(cfg.checkpoint_every_s) and (
            time.perf_counter() - self._last_checkpoint >= float(cfg.checkpoint_every_s)
        )

    def _progress_line(self, metrics: dict[str, float], scalars: dict[str, Any]) -> None:
        """One log line per evaluation (throttled) when no tqdm bar is shown."""
        now = time.perf_counter()
        if now - self._last_progress_line < self.cfg.progress_log_every_s:
            return
        self._last_progress_line = now
        shown = {k: v for k, v in scalars.items() if k in ("loss", "batch_size", "damping", "inner_iters")}
        shown.update({k: v for k, v in metrics.items() if k == self.cfg.monitor or k.endswith("/E_sq")})
        text = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        log.info(
            "%s step %d  algo %.1fs  wall %.1fs  %s",
            self.run_dir.name,
            self.step,
            self.algo_time,
            self._wall(),
            text,
        )

    @property
    def epoch(self) -> float:
        """Passes over the training set so far (the sampler's or the stream's count)."""
        return self.stream.epoch if self.stream is not None else self.sampler.epoch

    def load_checkpoint(self, verify: bool = True) -> int:
        """Restore model, algorithm, sampler/stream, RNG states, timers and best from ``checkpoint.pt``.

        Args:
            verify: Check the checkpoint against ``checkpoint.pt.sha256`` first
                (:func:`verify_checkpoint`); ``False`` when the caller has just done so.

        Returns:
            The checkpointed step.

        Raises:
            NoCheckpointError: If there is no checkpoint.
            CorruptCheckpointError: If it does not match its checksum, cannot be read or does not
                fit the model/optimizer.
            ValueError: If a streaming run is resumed with a different number of ranks.
        """
        path = self.run_dir / CHECKPOINT_NAME
        if not path.exists():
            raise NoCheckpointError(
                f"trainer.resume=true but there is no checkpoint at {path}; "
                "run without resume, or set trainer.checkpoint_every > 0 so runs leave checkpoints"
            )
        if verify:
            verify_checkpoint(path)
        state = read_checkpoint(path, self.device)
        try:
            self.objective.model.load_state_dict(state["model"])
            self.algorithm.load_state_dict(state["algorithm"])
        except (KeyError, RuntimeError, ValueError, TypeError) as err:
            raise CorruptCheckpointError(
                f"{path} does not fit this run's model or optimizer ({type(err).__name__}: {err}); "
                "resume with the run's own config (the saved config.yaml), or trainer.restart=true"
            ) from err
        if self.reapply_hyperparameters is not None:
            for line in self.reapply_hyperparameters():
                log.warning("resume applies the changed optimizer setting: %s", line)
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self.stream is not None:
            streams = state["stream"]
            if len(streams) != self.dist.world_size:
                raise ValueError(
                    f"checkpoint was written by {len(streams)} data-parallel ranks, this run has "
                    f"{self.dist.world_size}; resume a streaming run with the same number of processes"
                )
            self.stream.load_state_dict(streams[self.dist.rank])
        self.tokens_seen = state.get("tokens_seen", 0)
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.algo_time = state["algo_time"]
        self.wall_offset = state["wall_time"]
        self.eval_time = state["eval_time"]
        self.overhead_time = state["overhead_time"]
        self.best = state["best"]
        self.evals_since_best = state["evals_since_best"]
        self.last_eval = state["last_eval"]
        self.checkpoint_step = self.step
        self._restored = True
        return self.step

    # -- pieces -----------------------------------------------------------------------------------
    def _wall(self) -> float:
        return self.wall_offset + (time.perf_counter() - self._t_start)

    def evaluate(self) -> dict[str, float]:
        """Evaluate every configured split outside the algorithm timer; updates the best value.

        Returns:
            ``{"<split>/<metric>": value}`` (:func:`~curvopt.training.evaluation.evaluate_split`).
        """
        _sync(self.device)
        t0 = time.perf_counter()
        metrics = {}
        reduce = None
        if self.dist.enabled:
            reduce = lambda values: all_reduce(values, "sum", self.dist, self.device)  # noqa: E731
        for split in self.cfg.eval_splits:
            pair = getattr(self.data, split, None)
            if pair is None:
                continue
            x, y = pair
            if self.dist.enabled:
                part = shard_slice(x.shape[0], self.dist.rank, self.dist.world_size)
                x, y = x[part], y[part]
            for name, value in evaluate_split(
                self.objective,
                x,
                y,
                self.cfg.eval_batch_size,
                galore_compat=self.cfg.eval_galore_compat,
                reduce=reduce,
                world_size=self.dist.world_size,
            ).items():
                metrics[f"{split}/{name}"] = value
        _sync(self.device)
        self.eval_time += time.perf_counter() - t0
        self.last_eval = metrics
        self._update_best(metrics)
        return metrics

    def _update_best(self, metrics: dict[str, float]) -> None:
        value = metrics.get(self.cfg.monitor)
        if value is None or not math.isfinite(value):
            return
        better = (
            not self.best
            or (self.cfg.monitor_mode == "min" and value < self.best["value"])
            or (self.cfg.monitor_mode == "max" and value > self.best["value"])
        )
        if better:
            self.best = {
                "value": value,
                "step": self.step,
                "algo_time_s": self.algo_time,
                "metrics": dict(metrics),
            }
            self.evals_since_best = 0
        else:
            self.evals_since_best += 1

    def _stop_reason(self) -> str | None:
        cfg = self.cfg
        if self.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs is not None and self.epoch >= cfg.max_epochs:
            return "max_epochs"
        if cfg.max_algo_time_s is not None and self.algo_time >= cfg.max_algo_time_s:
            return "max_algo_time"
        if cfg.patience_evals is not None and self.evals_since_best >= cfg.patience_evals:
            return "patience"
        return None

    def _record(self, recorder: RunRecorder, row: dict[str, Any]) -> None:
        row = {
            "step": self.step,
            "epoch": self.epoch,
            "algo_time_s": self.algo_time,
            "wall_time_s": self._wall(),
            **row,
        }
        recorder.log(row)
        if self.step % self.tracker_every == 0 or any("/" in k for k in row):  # eval rows always
            self.tracker.log(row, step=self.step)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of the next global batch, and the global batch size."""
        batch_size = self.algorithm.next_batch_size() or self.cfg.batch_size
        world = self.dist.world_size
        if self.stream is not None:
            if batch_size % world:
                raise ValueError(
                    f"batch size {batch_size} is not divisible by the {world} data-parallel ranks"
                )
            x, y = self.stream.next_batch(batch_size // world)
            return x.to(self.device), y.to(self.device), batch_size
        x_train, y_train = self.data.train
        idx = self.sampler.next_indices(batch_size)
        global_size = int(idx.numel())
        idx = shard(idx, self.dist.rank, world).to(x_train.device)
        return x_train[idx], y_train[idx], global_size

    def _count_tokens(self, y: torch.Tensor) -> int | None:
        """Scored targets of a sequence batch (language modelling); None for other tasks."""
        if y.dtype.is_floating_point or y.dim() < 2 or self.objective.loss_kind != "cross_entropy":
            return None
        return int((y != self.objective.ignore_index).sum())

    def _reduce_step(
        self, scalars: dict[str, Any], tokens: int | None, seconds: float
    ) -> tuple[int | None, float]:
        """Mean loss and total tokens over ranks; the slowest rank's step time."""
        if not self.dist.enabled:
            return tokens, seconds
        loss = scalars.get("loss")
        has_loss = isinstance(loss, (int, float))
        summed = all_reduce(
            [float(loss) if has_loss else 0.0, float(tokens or 0)], "sum", self.dist, self.device
        )
        if has_loss:
            scalars["loss"] = summed[0] / self.dist.world_size
        (seconds,) = all_reduce([seconds], "max", self.dist, self.device)
        return (int(summed[1]) if tokens is not None else None), seconds

    # -- the loop ----------------------------------------------------------------------------------
    def _stop_requested(self, signals: StopSignals) -> bool:
        """Whether a stop signal arrived (on any rank: every rank must stop at the same step)."""
        flag = float(signals.received is not None)
        if self.dist.enabled:
            (flag,) = all_reduce([flag], "max", self.dist, self.device)
        return flag > 0

    def run(self, resume: bool = False) -> dict[str, Any]:
        """Train until a stop condition; always write ``summary.json``.

        Args:
            resume: Continue from ``checkpoint.pt`` (loaded before any record is touched).

        Returns:
            The run summary (what ``summary.json`` holds).

        Raises:
            Exception: An error during training is recorded (``status: failed``) and then raised
                again; checkpoint problems on resume raise before anything is written.
        """
        self._t_start = time.perf_counter()
        self._last_checkpoint = self._t_start
        self._last_progress_line = -math.inf
        if resume and not self._restored:
            self.load_checkpoint()  # before any record is touched: a bad checkpoint changes nothing
        if self.dist.is_main:
            recorder: Any = RunRecorder(self.run_dir, resume_step=self.step if resume else None)
        else:
            recorder = _NullRecorder()
        stop_reason = None
        progress = None
        if self.cfg.progress and self.dist.is_main:
            progress = BudgetProgress(
                self.cfg, self.run_dir.name, start=(self.step, self.epoch, self.algo_time)
            )
        failure: BaseException | None = None
        signals = StopSignals()
        with signals:
            try:
                stop_reason = self._train(recorder, progress, signals, resume)
                # a second signal may still abort this write (it then leaves no partial file)
                wanted = self.status == "interrupted" or (
                    self.status == "completed" and self.cfg.keep_checkpoint
                )
                if wanted and self.checkpoint_step != self.step:
                    self._try_checkpoint()
            except KeyboardInterrupt:  # a second signal, or Ctrl-C without our handler: stop now
                if self.status in ("running", "interrupted"):
                    self.status = "interrupted"
                    stop_reason = "sigterm_forced" if signals.name == "sigterm" else "keyboard_interrupt"
                else:
                    self.checkpoint_error = "stopped while writing the final checkpoint"
                log.warning(
                    "stopped at once at step %d without a new checkpoint; %s",
                    self.step,
                    f"resume continues from step {self.checkpoint_step}"
                    if self.checkpoint_step is not None
                    else "there is no checkpoint to resume from",
                )
            except Exception as err:
                self.status, stop_reason = "failed", "error"
                self.error = f"{type(err).__name__}: {err}"
                failure = err
            finally:
                signals.shield = True  # from here on a signal cannot cut the records short
                if progress is not None:
                    progress.close()
                if self.stream is not None:
                    self.stream.close()
                if self.status == "completed" and not self.cfg.keep_checkpoint and self.dist.is_main:
                    # a finished run keeps no periodic checkpoint unless asked to (keep_checkpoint)
                    (self.run_dir / CHECKPOINT_NAME).unlink(missing_ok=True)
                    (self.run_dir / CHECKSUM_NAME).unlink(missing_ok=True)
                    self.checkpoint_step = None
                summary = self._summary(stop_reason)
                try:
                    recorder.write_summary(summary)
                finally:
                    recorder.close()
                self.tracker.summary({k: v for k, v in summary.items() if not isinstance(v, dict)})
        if failure is not None:
            raise failure
        if self.status == "interrupted":
            log.warning(
                "interrupted at step %d (%s); records kept%s",
                self.step,
                stop_reason,
                f", resume from step {self.checkpoint_step} with trainer.resume=true"
                if self.checkpoint_step is not None
                else "",
            )
        return summary

    def _train(self, recorder: Any, progress: Any, signals: StopSignals, resume: bool) -> str | None:
        """The loop proper; sets :attr:`status` and returns the stop reason."""
        if not resume:
            self._record(recorder, {**self.evaluate(), "peak_mem_bytes": peak_memory_bytes(self.device)})
        while (stop_reason := self._stop_reason()) is None:
            # the only place a stop signal takes effect: every row of this step is written and the
            # sampler / RNG have not moved yet, so a checkpoint here resumes exactly
            if self._stop_requested(signals):
                self.status = "interrupted"
                return signals.name or "signal"
            if self.cfg.pause_at_step is not None and self.step >= self.cfg.pause_at_step:
                self.status = "interrupted"  # as a signal here would: checkpoint, no evaluation
                return "paused"
            t_data = time.perf_counter()
            excluded_before = self.eval_time
            try:
                x_batch, y_batch, global_size = self._next_batch()
            except StopIteration:
                stop_reason = "data_exhausted"
                break
            tokens = self._count_tokens(y_batch)
            _sync(self.device)
            t0 = time.perf_counter()
            c0 = time.process_time()
            try:
                scalars = self.algorithm.step((x_batch, y_batch))
            except FloatingPointError as err:  # NonFiniteError: the optimizer changed nothing
                self.status, self.error = "diverged", f"{type(err).__name__}: {err}"
                log.warning("step %d diverged: %s", self.step + 1, err)
                return "non_finite_gradient"
            _sync(self.device)
            t1 = time.perf_counter()
            step_seconds = time.process_time() - c0 if self.cfg.clock == "process" else t1 - t0
            tokens, seconds = self._reduce_step(scalars, tokens, step_seconds)
            self.algo_time += seconds
            self.step += 1
            row: dict[str, Any] = {"batch_size": global_size, "step_time_s": seconds, **scalars}
            if tokens is not None:
                self.tokens_seen += tokens
                row.update(
                    tokens=tokens,
                    tokens_seen=self.tokens_seen,
                    tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
                )
            diverged = not all(_finite(v) for k, v in scalars.items() if k == "loss")
            if self.step % self.cfg.eval_every == 0 or diverged or self._stop_reason() is not None:
                metrics = self.evaluate()
                diverged = diverged or not all(
                    math.isfinite(v) for k, v in metrics.items() if k.endswith("loss")
                )
                row.update(metrics)
                row["peak_mem_bytes"] = peak_memory_bytes(self.device)
                self._record(recorder, row)
                if progress is None or progress.disabled:
                    self._progress_line(metrics, scalars)
            elif self.step % self.cfg.log_every == 0:
                self._record(recorder, row)
            if diverged:
                self.status = "diverged"
                return "non_finite_loss"
            if progress is not None:
                progress.update(self.step, self.epoch, self.algo_time, scalars.get("loss"))
            # data + logging time of this step, evaluation excluded
            self.overhead_time += (
                (t0 - t_data) + (time.perf_counter() - t1) - (self.eval_time - excluded_before)
            )
            if self._checkpoint_due():
                self._try_checkpoint()
        self.status = "completed"
        return stop_reason

    def _state_bytes(self) -> int | None:
        """Bytes of the state the algorithm keeps between steps (its optimizer's, or its state dict's).

        ``None`` when the state cannot be taken here (the summary is written anyway).
        """
        optimizer = getattr(self.algorithm, "optimizer", None)
        try:
            if isinstance(optimizer, torch.optim.Optimizer):
                return tensor_bytes(*optimizer.state.values())
            return tensor_bytes(self.algorithm.state_dict(), max_depth=8)
        except Exception:  # noqa: BLE001 - a measurement must not fail the run's summary
            log.debug("optimizer state bytes not measured", exc_info=True)
            return None

    def _summary(self, stop_reason: str | None) -> dict[str, Any]:
        wall = self._wall()
        loop_overhead = self.overhead_time / self.algo_time if self.algo_time > 0 else None
        return {
            "status": self.status,
            "stop_reason": stop_reason,
            "steps": self.step,
            "epochs": self.epoch,
            "algo_time_s": self.algo_time,
            "wall_time_s": wall,
            "eval_time_s": self.eval_time,
            "loop_overhead_s": self.overhead_time,
            "loop_overhead_fraction": loop_overhead,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "optimizer_state_bytes": self._state_bytes(),
            **(
                {"tokens_seen": self.tokens_seen, "tokens_per_s": self.tokens_seen / self.algo_time}
                if self.tokens_seen and self.algo_time > 0
                else {}
            ),
            "world_size": self.dist.world_size,
            # resume (trainer.resume=true) continues from this step; null: nothing to resume from
            "checkpoint_step": self.checkpoint_step,
            **({"error": self.error} if self.error else {}),
            **({"checkpoint_error": self.checkpoint_error} if self.checkpoint_error else {}),
            "final": self.last_eval,
            "best": self.best,
            **self.summary_extra,
        }
