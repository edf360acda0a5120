"""Mini-batch samplers over in-memory training sets, with resumable state.

The loop asks the sampler for ``next(batch_size)`` where the size may change every step (SHF
grows its batch). Four modes cover the papers' protocols:

* ``epoch``: reshuffle every pass, consume the permutation in order (standard SGD epochs);
* ``independent``: each batch is a fresh draw without replacement from the whole set,
  independent across steps (SHF: "never the same mini-batch");
* ``static``: one seeded permutation, consumed cyclically with wrap-around;
* ``static_padded``: one seeded permutation cut into the same ``ceil(n / batch)`` batches every
  epoch, the last one padded by wrap-around to the start of the permutation (the FGN paper's
  "static batching": 8,144 examples in batches of 128 give 64 steps per epoch, 48 examples
  repeated, and every epoch sees the identical batches).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

SAMPLING_MODES = ("epoch", "independent", "static", "static_padded")


class BatchSampler:
    """Index sampler over ``range(num_examples)`` with one of :data:`SAMPLING_MODES` (module docstring).

    Args:
        num_examples: Size of the training set.
        mode: ``"epoch"``, ``"independent"``, ``"static"`` or ``"static_padded"``.
        seed: Seed of the sampler's own generator (the permutations and draws).

    Raises:
        ValueError: If ``mode`` is unknown.
    """

    def __init__(self, num_examples: int, mode: str = "epoch", seed: int = 0) -> None:
        if mode not in SAMPLING_MODES:
            raise ValueError(f"unknown sampling mode {mode!r}; choose one of {SAMPLING_MODES}")
        self.n = num_examples
        self.mode = mode
        self.generator = torch.Generator().manual_seed(seed)
        self.examples_seen = 0
        self._perm = torch.randperm(self.n, generator=self.generator)
        self._pos = 0

    @property
    def epoch(self) -> float:
        """Passes over the training set, counted by examples drawn."""
        return self.examples_seen / self.n

    def next_indices(self, batch_size: int) -> Tensor:
        """Indices of the next batch.

        Args:
            batch_size: Requested size (> 0; capped at the training-set size).

        Returns:
            A 1-D long tensor of indices.

        Raises:
            ValueError: If ``batch_size`` is not positive.
        """
        if batch_size <= 0:
            raise ValueError(f"batch size must be positive, got {batch_size}")
        batch_size = min(batch_size, self.n)
        self.examples_seen += batch_size
        if self.mode == "independent":
            return torch.randperm(self.n, generator=self.generator)[:batch_size]
        if self.mode == "static_padded":
            if self._pos >= self.n:  # a new epoch starts the permutation again
                self._pos = 0
            head = self._perm[self._pos : self._pos + batch_size]
            self._pos += batch_size
            if head.numel() < batch_size:  # last batch of the epoch: pad from the start
                head = torch.cat([head, self._perm[: batch_size - head.numel()]])
            return head
        parts, need = [], batch_size
        while need > 0:
            if self._pos >= self.n:
                if self.mode == "epoch":
                    self._perm = torch.randperm(self.n, generator=self.generator)
                self._pos = 0
            take = min(need, self.n - self._pos)
            parts.append(self._perm[self._pos : self._pos + take])
            self._pos += take
            need -= take
        return torch.cat(parts)

    def state_dict(self) -> dict[str, Any]:
        """Generator state, examples seen, the current permutation and position (for resume).

        Returns:
            A dict accepted by :meth:`load_state_dict`.
        """
        return {
            "generator": self.generator.get_state(),
            "examples_seen": self.examples_seen,
            "perm": self._perm.clone(),
            "pos": self._pos,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict`.

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.generator.set_state(state["generator"])
        self.examples_seen = state["examples_seen"]
        self._perm = state["perm"].clone()
        self._pos = state["pos"]


def shard(indices: Tensor, rank: int = 0, world_size: int = 1) -> Tensor:
    """This rank's contiguous chunk of a global batch (data parallelism).

    Every rank draws the same global indices from an identically seeded sampler and keeps chunk
    ``rank``; the chunks are disjoint and their union is the global batch, so N processes see
    exactly the batch one process would (see ``curvopt.training.distributed``).

    Args:
        indices: The global batch's indices.
        rank: This process's rank.
        world_size: Number of processes.

    Returns:
        This rank's chunk (``indices`` itself when ``world_size == 1``).
    """
    if world_size == 1:
        return indices
    from curvopt.training.distributed import shard_slice

    return indices[shard_slice(indices.numel(), rank, world_size)]
