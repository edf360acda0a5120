"""The ``torch.optim`` adapter the loop runs gradient transforms through.

The contract types (``Batch``, ``DataBundle``, the ``Algorithm`` protocol and ``AlgorithmBase``)
live in :mod:`curvopt.api`, a leaf module that methods and data loaders import; import them from there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from curvopt.api import AlgorithmBase, Batch
from curvopt.objective import Objective

__all__ = ["TorchOptimizerAlgorithm"]


def _lbfgs_step_info(optimizer: torch.optim.LBFGS) -> dict[str, float]:
    """The last step's length and size, from where ``torch.optim.LBFGS`` keeps its state."""
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    t = state.get("t")
    if t is None:
        return {}
    t = float(t)
    info = {"ls_step": t}
    d = state.get("d")
    if isinstance(d, Tensor):
        info["step_norm"] = abs(t) * float(torch.linalg.vector_norm(d))
    return info


class TorchOptimizerAlgorithm(AlgorithmBase):
    """Runs any ``torch.optim.Optimizer`` in the loop: forward, backward, step.

    The forward/backward is a closure: ``torch.optim.LBFGS`` gets it as ``step(closure)`` (it
    re-evaluates the loss); any other optimizer sees one closure call, then ``step()``. The update's
    loss is the size-weighted mean of the micro-batch mean losses (GaLore's ``loss /
    accumulation`` for equal micro-batches), so the gradient equals the full batch's when the loss
    is a per-example mean. The logged ``lr`` is the one the update used (read before the scheduler
    steps).

    Args:
        objective: The model and its loss kind.
        optimizer: The optimizer over ``objective.model``'s parameters.
        grad_clip_value: Clip gradients element-wise to ``±value`` before the step (FOSI's AE
            task); ``None``: off.
        scheduler: Optional ``torch.optim.lr_scheduler`` stepped after every update.
        micro_batch_size: Turns one update into gradient accumulation over micro-batches of that
            many examples (LLM pretraining: 512 sequences per update, 64–256 per forward);
            ``None``: one forward per update.
        train_model: The module the forward/backward runs through — a ``DistributedDataParallel``
            wrapper of ``objective.model`` under torchrun; gradients are then all-reduced only on
            the last micro-batch (``no_sync`` before). Default: ``objective.model``.

    Raises:
        ValueError: If ``micro_batch_size`` is not positive.
    """

    def __init__(
        self,
        objective: Objective,
        optimizer: torch.optim.Optimizer,
        grad_clip_value: float | None = None,
        scheduler: Any | None = None,
        micro_batch_size: int | None = None,
        train_model: torch.nn.Module | None = None,
    ) -> None:
        self.objective = objective
        self.optimizer = optimizer
        self.grad_clip_value = grad_clip_value
        self.scheduler = scheduler
        if micro_batch_size is not None and micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.train_model = train_model if train_model is not None else objective.model

    def _micro_batches(self, x: Tensor, y: Tensor) -> list[tuple[Tensor, Tensor]]:
        n = x.shape[0]
        size = self.micro_batch_size or n
        return [(x[i : i + size], y[i : i + size]) for i in range(0, n, size)]

    def _closure(self, x: Tensor, y: Tensor) -> Callable[[], Tensor]:
        model, kind = self.train_model, self.objective.loss_kind
        from curvopt.objective import mean_loss

        chunks = self._micro_batches(x, y)
        n = x.shape[0]
        no_sync = getattr(model, "no_sync", None)

        def closure() -> Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            if len(chunks) == 1:
                loss = mean_loss(model(x), y, kind, self.objective.ignore_index)
                loss.backward()
                total = loss.detach()
            else:
                total = 0.0
                for i, (xb, yb) in enumerate(chunks):
                    weight = xb.shape[0] / n
                    last = i == len(chunks) - 1
                    ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
                    with ctx:
                        loss = mean_loss(model(xb), yb, kind, self.objective.ignore_index)
                        (loss * weight).backward()
                    total = total + loss.detach() * weight
            if self.grad_clip_value is not None:
                torch.nn.utils.clip_grad_value_(self.objective.model.parameters(), self.grad_clip_value)
            return total

        return closure

    def step(self, batch: Batch) -> dict[str, Any]:
        """One optimizer update on ``batch`` (then one scheduler step).

        Args:
            batch: ``(x, y)``.

        Returns:
            ``{"loss": mean loss before the update, "lr": lr of the first group used}``; for
            ``torch.optim.LBFGS`` (and subclasses) also ``ls_step``, the step length the line
            search took along the search direction (``state["t"]``), and ``step_norm``, the
            distance the update moved the parameters, ``ls_step`` × ‖direction‖ (when the
            optimizer keeps ``state["d"]``).
        """
        x, y = batch
        closure = self._closure(x, y)
        lr = float(self.optimizer.param_groups[0]["lr"])
        info: dict[str, Any] = {}
        if isinstance(self.optimizer, torch.optim.LBFGS):
            loss = self.optimizer.step(closure)
            info = _lbfgs_step_info(self.optimizer)
        else:
            loss = closure()
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        pending = getattr(self.optimizer, "nonfinite_pending", None)
        if isinstance(pending, Tensor) and isinstance(loss, Tensor):
            # the loss read the loop makes anyway carries the optimizer's deferred finiteness flag
            # (check_finite="deferred", curvopt.optim.MatrixOptimizer): one host read for both
            value, skipped = torch.stack([loss.detach().float().reshape(()), pending.float()]).tolist()
            if skipped:
                self.optimizer.raise_if_nonfinite()
            return {"loss": value, "lr": lr, **info}
        return {"loss": float(loss.detach()), "lr": lr, **info}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's (and the scheduler's) state dicts.

        Returns:
            ``{"optimizer": ..., "scheduler": ...}`` (no ``scheduler`` key without one).
        """
        state = {"optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizer (and scheduler) state saved by :meth:`state_dict`.

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
