"""Data-parallel training under ``torchrun``: process group, device, and the few collectives the
loop needs.

``torchrun --nproc_per_node N src/train.py ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`init_distributed` turns them into a process group (NCCL on GPU, gloo on
CPU) and a :class:`DistInfo`. Without those variables everything here is a no-op, so the
single-process path is the same code.

The design keeps one training semantics for any number of processes: the loop draws the *global*
batch (``trainer.batch_size``, e.g. 512 sequences) from one seeded sampler on every rank, each
rank takes its contiguous chunk (:func:`shard_slice`), and DDP averages the gradients. With
gradient accumulation over micro-batches of equal size, rank ``r``'s micro-batch ``k`` is the
single-process run's micro-batch ``r·A + k``, so an N-process run equals a 1-process run with the
same global batch up to float summation order (tested in tests/test_ddp.py).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistInfo()


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_name: str = "auto", backend: str = "auto", timeout_s: float = 1800) -> DistInfo:
    """Join the process group described by torchrun's environment (idempotent).

    ``backend=auto`` picks NCCL when the run uses CUDA and gloo otherwise. On CUDA the process is
    pinned to ``cuda:<LOCAL_RANK>``.
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
    """The device of this process: ``cuda:<local_rank>`` for CUDA runs under torchrun."""
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
    """
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world size {world_size}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def all_reduce(
    values: list[float], op: str = "sum", info: DistInfo = SINGLE, device: Any = None
) -> list[float]:
    """Reduce a few Python scalars over ranks (``sum`` or ``max``); identity when not distributed."""
    if not info.enabled:
        return list(values)
    if device is None or info.backend == "gloo":
        device = torch.device("cpu") if info.backend == "gloo" else torch.device("cuda", info.local_rank)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def broadcast_object(obj: Any, info: DistInfo = SINGLE, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank (run ids, decisions taken on rank 0)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any, info: DistInfo = SINGLE) -> list[Any]:
    """Every rank's object, in rank order, on every rank (per-rank data-stream positions)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo = SINGLE) -> None:
    if info.enabled:
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, info: DistInfo, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel around ``model``; ``broadcast_buffers=False`` because the loop
    evaluates the bare module on uneven shards (no collective may hide in a forward)."""
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


def cleanup(info: DistInfo = SINGLE) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
