"""The contract between methods, data and the training loop (a leaf: torch and stdlib only).

Like ``algoperf/spec.py``, this module only defines types; it imports nothing from ``curvopt``,
so :mod:`curvopt.optim` and :mod:`curvopt.data` depend on it and never on
:mod:`curvopt.training`.

Four shapes of optimizer share the loop (README.md, "Use it in your own loop"):

* gradient transforms (Adam, HB, RACS, Alice, GaLore, …) are ``torch.optim.Optimizer``
  subclasses; the loop wraps them in
  :class:`~curvopt.training.algorithm.TorchOptimizerAlgorithm`;
* meta-optimizers (FOSI) and curvature solvers (SHF-LSMR, HF-CG, FGN, SGN) implement
  :class:`Algorithm` directly, using the :class:`~curvopt.objective.Objective` for J·v, Jᵀ·u,
  GGN·v and H·v;
* data-selecting methods (SHF) also answer :meth:`Algorithm.next_batch_size`.

An algorithm is built by a factory ``factory(objective=..., data=..., **cfg)`` (Hydra
``_target_`` with ``_partial_: true``), where ``data`` is the :class:`DataBundle` of the run, so
methods that need the validation set (SHF's merit) or the full training set (Martens' gradient)
get it once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["Algorithm", "AlgorithmBase", "Batch", "DataBundle"]

Batch = tuple[Tensor, Tensor]
"""One batch: ``(inputs, targets)``, both with the example index as the first dimension."""


@dataclass
class DataBundle:
    """In-memory splits of a dataset; ``None`` for a split the task does not have.

    Args:
        train: the training split ``(x, y)``, or ``None`` when ``train_stream`` supplies it.
        val: the validation split, if any.
        test: the test split, if any.
        meta: facts for figures and records (dataset name, whether it is a synthetic stand-in,
            the source files).
        train_stream: replaces ``train`` for training sets too large for memory (C4 at paper
            scale): an object with ``start(rank, world_size)``, ``next_batch(batch_size) -> (x, y)``
            (this rank's share), ``epoch``, ``state_dict()`` and ``load_state_dict()`` (its
            position, for resume). When it is set the loop draws from it instead of sampling
            ``train``.
    """

    train: Batch | None
    val: Batch | None = None
    test: Batch | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    train_stream: Any | None = None

    @property
    def num_train(self) -> int:
        """Number of training examples (an error for a streamed training set)."""
        if self.train is None:
            raise ValueError("this dataset streams its training data (train_stream); it has no num_train")
        return int(self.train[0].shape[0])


@runtime_checkable
class Algorithm(Protocol):
    """What the loop needs from an optimizer.

    ``step`` performs one update on ``batch`` and returns method-specific scalars to log
    (e.g. ``loss``, ``lr``, ``damping``, ``inner_iters``, ``stop_reason``). It must leave the
    objective's model holding the new parameters.
    """

    def step(self, batch: Batch) -> dict[str, Any]:
        """Perform one update on ``batch``.

        Args:
            batch: The ``(x, y)`` batch to update on.

        Returns:
            Method-specific scalars to log (``loss``, ``lr``, ``damping``, ``inner_iters``, ...).
        """
        ...

    def next_batch_size(self) -> int | None:
        """Batch size the algorithm wants next.

        Returns:
            The number of examples for the next :meth:`step`, or ``None`` for the configured one.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint, so that a resumed run continues exactly.

        Returns:
            A dict of tensors and plain Python values accepted by :meth:`load_state_dict`.
        """
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict`.

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        ...


class AlgorithmBase:
    """Convenience base: fixed batch size and no extra state.

    Subclasses implement ``step(batch)`` and override :meth:`state_dict` /
    :meth:`load_state_dict` when they carry state across steps. It takes no constructor
    arguments.
    """

    def next_batch_size(self) -> int | None:
        """Ask for the configured batch size.

        Returns:
            Always ``None`` (the loop's configured batch size).
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """Return no state.

        Returns:
            An empty dict.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accept and ignore a state dict (there is no state to restore).

        Args:
            state: A dict returned by :meth:`state_dict` (ignored).
        """
        del state
