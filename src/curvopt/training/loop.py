"""The training loop shared by every optimizer.

Per step: ask the algorithm for its batch size, draw the batch, time ``algorithm.step`` (and
only that: the *algorithm time* of the papers' time axes), log its scalars. Every
``eval_every`` steps, evaluate all splits outside the timer. Stop on ``max_steps``,
``max_epochs``, an algorithm-time budget, validation patience, a non-finite loss
(``diverged``) or Ctrl-C (``interrupted``); records written so far are always kept, and a
checkpoint lets ``resume=True`` continue with identical metrics.

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
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curvopt.objective import Objective
from curvopt.training.algorithm import Algorithm, DataBundle
from curvopt.training.distributed import SINGLE, DistInfo, all_reduce, gather_objects, shard_slice
from curvopt.training.evaluation import evaluate_split
from curvopt.training.records import RunRecorder
from curvopt.training.sampler import BatchSampler, shard
from curvopt.training.tracking import NullTracker

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
TIMING_FIELDS = ("algo_time_s", "wall_time_s", "step_time_s", "peak_mem_bytes", "tokens_per_s")


@dataclass
class LoopConfig:
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
    # also checkpoint when this many wall seconds have passed since the last one (long CPU runs
    # that must survive a restart on another machine; null = off)
    checkpoint_every_s: float | None = None
    keep_checkpoint: bool = True
    # without a terminal (tqdm is silent), log one progress line per evaluation, at most this often
    progress_log_every_s: float = 30.0
    patience_evals: int | None = None
    monitor: str = "val/loss"
    monitor_mode: str = "min"
    progress: bool = True
    eval_galore_compat: bool = False  # also log GaLore's off-by-one eval loss/ppl (LM tasks)
    # wall: time.perf_counter (+ CUDA sync), the papers' "computation time". process: this process's
    # CPU seconds (time.process_time), which other jobs on a shared CPU cannot inflate; it equals
    # uncontended wall time only with one torch thread (trainer.num_threads=1) and never on a GPU.
    clock: str = "wall"

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "process"):
            raise ValueError(f"trainer.clock must be 'wall' or 'process', got {self.clock!r}")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


class _NullRecorder:
    """Ranks other than 0 keep no records."""

    def log(self, row: dict[str, Any]) -> None:
        del row

    def write_summary(self, summary: dict[str, Any]) -> None:
        del summary

    def close(self) -> None:
        pass


class Trainer:
    def __init__(
        self,
        objective: Objective,
        algorithm: Algorithm,
        data: DataBundle,
        config: LoopConfig,
        run_dir: Path,
        device: torch.device,
        seed: int = 0,
        tracker: NullTracker | None = None,
        summary_extra: dict[str, Any] | None = None,
        tracker_every: int = 1,
        dist: DistInfo = SINGLE,
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
        }

    def save_checkpoint(self) -> None:
        state = self._checkpoint_state()  # collective under DDP (stream positions): every rank
        if not self.dist.is_main:
            return
        path = self.run_dir / CHECKPOINT_NAME
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        self._last_checkpoint = time.perf_counter()

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
        return self.stream.epoch if self.stream is not None else self.sampler.epoch

    def load_checkpoint(self) -> int:
        path = self.run_dir / CHECKPOINT_NAME
        if not path.exists():
            raise FileNotFoundError(
                f"trainer.resume=true but there is no checkpoint at {path}; "
                "run without resume, or set trainer.checkpoint_every > 0 so runs leave checkpoints"
            )
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.objective.model.load_state_dict(state["model"])
        self.algorithm.load_state_dict(state["algorithm"])
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
        return self.step

    # -- pieces -----------------------------------------------------------------------------------
    def _wall(self) -> float:
        return self.wall_offset + (time.perf_counter() - self._t_start)

    def evaluate(self) -> dict[str, float]:
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
    def run(self, resume: bool = False) -> dict[str, Any]:
        self._t_start = time.perf_counter()
        self._last_checkpoint = self._t_start
        self._last_progress_line = -math.inf
        if resume:
            self.load_checkpoint()
        if self.dist.is_main:
            recorder: Any = RunRecorder(self.run_dir, resume_step=self.step if resume else None)
        else:
            recorder = _NullRecorder()
        stop_reason = None
        progress = None
        if self.cfg.progress and self.dist.is_main:
            from tqdm.auto import tqdm

            # disable=None: shown on a terminal, silent in logs and CI
            progress = tqdm(
                total=self.cfg.max_steps, initial=self.step, desc=self.run_dir.name, leave=False, disable=None
            )
        try:
            if not resume:
                self._record(recorder, {**self.evaluate(), "peak_mem_bytes": peak_memory_bytes(self.device)})
            while (stop_reason := self._stop_reason()) is None:
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
                scalars = self.algorithm.step((x_batch, y_batch))
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
                    if progress is None or progress.disable:
                        self._progress_line(metrics, scalars)
                elif self.step % self.cfg.log_every == 0:
                    self._record(recorder, row)
                if diverged:
                    stop_reason = "non_finite_loss"
                    self.status = "diverged"
                    break
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(
                        {k: f"{v:.4g}" for k, v in scalars.items() if k == "loss"}, refresh=False
                    )
                # data + logging time of this step, evaluation excluded
                self.overhead_time += (
                    (t0 - t_data) + (time.perf_counter() - t1) - (self.eval_time - excluded_before)
                )
                if self._checkpoint_due():
                    self.save_checkpoint()
            if self.status == "running":
                self.status = "completed"
        except KeyboardInterrupt:
            self.status, stop_reason = "interrupted", "keyboard_interrupt"
            log.warning("interrupted at step %d; records kept, resume with trainer.resume=true", self.step)
        finally:
            if progress is not None:
                progress.close()
            if self.stream is not None:
                self.stream.close()
            if self.status in ("completed", "interrupted") and (
                self.cfg.keep_checkpoint or self.status == "interrupted"
            ):
                self.save_checkpoint()
            elif self.status == "completed" and not self.cfg.keep_checkpoint and self.dist.is_main:
                # a finished run keeps no periodic checkpoint unless asked to (keep_checkpoint)
                (self.run_dir / CHECKPOINT_NAME).unlink(missing_ok=True)
            summary = self._summary(stop_reason)
            recorder.write_summary(summary)
            recorder.close()
            self.tracker.summary({k: v for k, v in summary.items() if not isinstance(v, dict)})
        return summary

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
            **(
                {"tokens_seen": self.tokens_seen, "tokens_per_s": self.tokens_seen / self.algo_time}
                if self.tokens_seen and self.algo_time > 0
                else {}
            ),
            "world_size": self.dist.world_size,
            "final": self.last_eval,
            "best": self.best,
            **self.summary_extra,
        }
