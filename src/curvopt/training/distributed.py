"""Data-parallel training under ``torchrun``: process group, device, and the loop's few collectives.

``torchrun --nproc_per_node N src/train.py ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`init_distributed` turns them into a process group (NCCL on GPU, gloo on
CPU) and a :class:`DistInfo`. Without those variables everything here is a no-op, so the
single-process path is the same code.

The design keeps one training semantics for any number of processes: the loop draws the *global*
batch (``trainer.batch_size``, e.g. 512 sequences) from one seeded sampler on every rank, each
rank takes its contiguous chunk (:func:`shard_slice`), and DDP averages the gradients. With
gradient accumulation over micro-batches of equal size, rank ``r``'s micro-batch ``k`` is the
single-process run's micro-batch ``r·A + k``, so an N-process run equals a 1-process run with the
same global batch up to float summation order (tested in tests/training/test_ddp.py).

A run joins the process group once, before its run directory is chosen (:func:`init_distributed`:
rank 0's generated run id is broadcast), and wraps its parts once they are built
(:func:`distribute`); the loop shards batches and reduces scalars with the helpers below.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from curvopt.api import Algorithm
from curvopt.training.algorithm import TorchOptimizerAlgorithm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the process group (:data:`SINGLE` without torchrun).

    Attributes:
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node (selects the GPU).
        backend: ``"nccl"``, ``"gloo"`` or ``None`` (single process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether more than one process takes part."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that writes records)."""
        return self.rank == 0


SINGLE = DistInfo()


def env_world_size() -> int:
    """The world size torchrun announced.

    Returns:
        ``$WORLD_SIZE``, or 1 when unset.
    """
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_name: str = "auto", backend: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the process group described by torchrun's environment (idempotent).

    On CUDA the process is pinned to ``cuda:<LOCAL_RANK>``.

    Args:
        device_name: The run's device (``"auto"``, ``"cpu"``, ``"cuda"``, ...).
        backend: ``"auto"`` picks NCCL when the run uses CUDA and gloo otherwise; or a
            ``torch.distributed`` backend name.
        timeout_s: Timeout of collectives, in seconds.

    Returns:
        The :class:`DistInfo` (:data:`SINGLE` without torchrun's environment).
    """
    world = env_world_size()
    if world <= 1:
        return SINGLE
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    log.info("rank %d/%d (local %d) joined the %s process group", rank, world, local_rank, backend)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, backend=backend)


def device_for(info: DistInfo, device_name: str) -> torch.device:
    """The device of this process: ``cuda:<local_rank>`` for CUDA runs under torchrun.

    Args:
        info: This process's :class:`DistInfo`.
        device_name: The configured device; ``"auto"`` is CUDA when available, else CPU.

    Returns:
        The ``torch.device``.
    """
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if device.type == "cuda" and info.enabled:
        return torch.device("cuda", info.local_rank)
    return device


def shard_slice(n: int, rank: int, world_size: int) -> slice:
    """Contiguous chunk ``rank`` of ``range(n)`` split into ``world_size`` near-equal parts.

    Chunks are disjoint and cover ``range(n)``; the first ``n % world_size`` chunks get one more
    element. The loop shards the global batch with this, evaluation the validation set.

    Args:
        n: Length of the range.
        rank: The chunk's index.
        world_size: Number of chunks.

    Returns:
        The chunk as a ``slice``.

    Raises:
        ValueError: If ``rank`` is not in ``[0, world_size)``.
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world size {world_size}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def all_reduce(
    values: list[float], op: str = "sum", info: DistInfo = SINGLE, device: Any = None
) -> list[float]:
    """Reduce a few Python scalars over ranks; identity when not distributed.

    Args:
        values: This rank's scalars.
        op: ``"sum"`` or ``"max"``.
        info: This process's :class:`DistInfo`.
        device: Device of the float64 buffer (CPU for gloo; default ``cuda:<local_rank>`` for
            NCCL).

    Returns:
        The reduced scalars, the same on every rank.
    """
    if not info.enabled:
        return list(values)
    if device is None or info.backend == "gloo":
        device = torch.device("cpu") if info.backend == "gloo" else torch.device("cuda", info.local_rank)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def broadcast_object(obj: Any, info: DistInfo = SINGLE, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (run ids, decisions taken on rank 0).

    Args:
        obj: A picklable object (only rank ``src``'s value matters).
        info: This process's :class:`DistInfo`.
        src: The sending rank.

    Returns:
        Rank ``src``'s object.
    """
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any, info: DistInfo = SINGLE) -> list[Any]:
    """Every rank's object, in rank order, on every rank (per-rank data-stream positions).

    Args:
        obj: This rank's picklable object.
        info: This process's :class:`DistInfo`.

    Returns:
        The list of ``world_size`` objects.
    """
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo = SINGLE) -> None:
    """Wait for every rank (no-op for one process).

    Args:
        info: This process's :class:`DistInfo`.
    """
    if info.enabled:
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, info: DistInfo, device: torch.device) -> torch.nn.Module:
    """Wrap ``model`` in DistributedDataParallel (identity for one process).

    Buffers are not broadcast in the forward (``broadcast_buffers=False``, or
    ``forward_sync_buffers=False`` on newer torch) because the loop evaluates the bare module on
    uneven shards (no collective may hide in a forward).

    Args:
        model: The module.
        info: This process's :class:`DistInfo`.
        device: The process's device.

    Returns:
        The DDP wrapper, or ``model`` itself.
    """
    if not info.enabled:
        return model
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        sync = {"forward_sync_buffers": False}  # newer torch; broadcast_buffers is deprecated there
    else:
        sync = {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=device_ids, **sync)


def distribute(
    algorithm: Algorithm, model: torch.nn.Module, info: DistInfo, device: torch.device, target: str
) -> None:
    """Make the finished parts data-parallel, once (a no-op for one process).

    The model a wrapped ``torch.optim`` optimizer trains through
    (:attr:`~curvopt.training.algorithm.TorchOptimizerAlgorithm.train_model`) becomes a
    DistributedDataParallel wrapper of ``model`` (:func:`wrap_ddp`); the optimizer, its state and
    every record keep the bare model.

    Args:
        algorithm: The built algorithm.
        model: The built model (``objective.model``).
        info: This process's :class:`DistInfo`.
        device: The process's device.
        target: ``optimizer._target_``, for the message.

    Raises:
        NotImplementedError: Under torchrun, an algorithm of its own (not a wrapped optimizer):
            its steps would not be synchronised.
    """
    if not info.enabled:
        return
    if not isinstance(algorithm, TorchOptimizerAlgorithm):
        raise NotImplementedError(
            f"{target} returns its own Algorithm, which cannot run under DistributedDataParallel; "
            "run it in one process, or have the factory return a torch.optim.Optimizer"
        )
    algorithm.train_model = wrap_ddp(model, info, device)


def cleanup(info: DistInfo = SINGLE) -> None:
    """Leave the process group (no-op for one process).

    Args:
        info: This process's :class:`DistInfo`.
    """
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
