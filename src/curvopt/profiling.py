"""Count what a piece of torch code asks of an accelerator, on any machine (a CPU included).

A GPU step that launches thousands of tiny kernels, or reads a value back to the host, waits on the
host instead of computing: on an H200 our per-matrix optimizer steps cost ≈ 9.75 µs per dispatched op
(docs/lean_steps.md). Both numbers depend only on the code, not on the device, so they are measured
here on the CPU:

* :class:`DispatchCounter` — a ``TorchDispatchMode`` that counts every ATen op dispatched inside it:
  views (no kernel), allocations (no kernel), kernels (the rest) and **host reads** (an op whose
  result the host must wait for: ``.item()``, ``float()``/``bool()``/``int()`` of a tensor, boolean-
  mask indexing, ``nonzero``, ``masked_select``, ``unique``, a copy to the CPU).
* :func:`fake_cuda` — a ``FakeTensorMode`` in which tensors made with ``device="cuda"`` exist on a
  CPU-only torch (shapes and dtypes, no data); any host read of such a tensor raises. Code that runs
  under it makes no host read.

Neither runs the code faster or slower; they only observe it. ``torch.Tensor.tolist()`` of a CPU
tensor dispatches no op; the counter sees it through a ``TorchFunctionMode`` and counts each call as
a host read (on a device it is one).

Example:
    >>> import torch
    >>> from curvopt.profiling import DispatchCounter
    >>> x = torch.randn(8)
    >>> with DispatchCounter() as c:
    ...     y = (x * 2).sum()
    ...     _ = float(y)
    >>> c.ops, c.kernels, c.host_reads
    (3, 3, 1)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: Mean H200 wall time per dispatched op of our per-matrix optimizer steps (LLaMA-60M matrices, four
#: optimizers, r = 0.992; docs/lean_steps.md): the launch-bound prediction is ``ops × this``.
US_PER_OP_H200 = 9.75

# Ops that allocate without launching a kernel.
_ALLOCATIONS = {
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.empty_like.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
}
# Ops whose result the host must wait for, whatever their arguments.
_HOST_READS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
    "aten.equal.default",
    "aten.is_nonzero.default",
}


def _bool_index(args: tuple[Any, ...]) -> bool:
    """Whether an ``index``/``index_put`` call indexes with a boolean mask (a hidden ``nonzero``)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _to_cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a copy moves an accelerator tensor to the CPU."""
    name = str(func)
    if name not in ("aten._to_copy.default", "aten.copy_.default"):
        return False
    if name == "aten._to_copy.default":
        src, dev = args[0], kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and src.device.type != "cpu"
    dst, src = args[0], args[1]
    return dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type != "cpu"


class _TolistCounter(TorchFunctionMode):
    """Counts ``Tensor.tolist()`` calls for a :class:`DispatchCounter` (they dispatch no ATen op)."""

    def __init__(self, counter: DispatchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.tolist:
            self.counter.host_reads += 1
            self.counter.reads_by_name["Tensor.tolist"] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class DispatchCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside a ``with`` block (see the module docstring).

    Attributes:
        ops: Every dispatched op.
        views: Ops that return a view (no kernel, but a host-side dispatch each).
        allocations: ``empty``-like ops (no kernel).
        kernels: The rest: ops that launch work on the device (host reads included).
        host_reads: Ops the host has to wait for, and ``Tensor.tolist()`` calls.
        by_name: ``op name -> count``.
        reads_by_name: ``op name -> count`` of the host reads (``Tensor.tolist`` among them).

    Example:
        >>> import torch
        >>> from curvopt.profiling import DispatchCounter
        >>> x = torch.randn(4, 4)
        >>> with DispatchCounter() as c:
        ...     _ = x[x > 0]
        >>> c.host_reads, c.reads_by_name
        (1, Counter({'aten.index.Tensor': 1}))
    """

    ops: int = 0
    views: int = 0
    allocations: int = 0
    kernels: int = 0
    host_reads: int = 0
    by_name: Counter = field(default_factory=Counter)
    reads_by_name: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        super().__init__()
        self._tolist_modes: list[_TolistCounter] = []

    def __enter__(self) -> DispatchCounter:
        mode = _TolistCounter(self)
        mode.__enter__()
        self._tolist_modes.append(mode)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._tolist_modes.pop().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        self.ops += 1
        self.by_name[name] += 1
        if name.startswith(("prim.", "profiler.")):  # metadata queries and profiler marks: no kernel
            self.ops -= 1
            self.by_name[name] -= 1
            return func(*args, **kwargs)
        if getattr(func, "is_view", False):
            self.views += 1
        elif name in _ALLOCATIONS:
            self.allocations += 1
        else:
            self.kernels += 1
        read = name in _HOST_READS
        if name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"):
            read = _bool_index(args)
        elif not read:
            read = _to_cpu(func, args, kwargs)
        if read:
            self.host_reads += 1
            self.reads_by_name[name] += 1
        return func(*args, **kwargs)

    def summary(self) -> dict[str, int]:
        """The counts as a plain dict (for JSON records)."""
        return {
            "ops": self.ops,
            "views": self.views,
            "allocations": self.allocations,
            "kernels": self.kernels,
            "host_reads": self.host_reads,
        }


def tensor_bytes(*objs: Any, max_depth: int = 4) -> int:
    """Bytes of every tensor reachable from ``objs``; memory shared by several tensors counts once.

    Walks dicts, lists, tuples and objects' attributes (up to ``max_depth`` levels: the official
    GaLore/Fira/APOLLO projector objects hold tensors). Views of one storage (the slices of a
    stacked state bank, a tensor referenced twice) count the union of the bytes they cover.

    Args:
        *objs: Anything: an optimizer's state values, a state dict.
        max_depth: How many containers/attributes deep to look.

    Returns:
        The number of bytes.

    Example:
        >>> import torch
        >>> from curvopt.profiling import tensor_bytes
        >>> bank = torch.zeros(4, 3)
        >>> tensor_bytes({"a": bank[0], "b": bank[1]}, [bank], torch.zeros(2, dtype=torch.float64))
        64
    """
    spans: dict[int, list[tuple[int, int]]] = {}  # storage -> byte intervals its tensors cover

    def walk(obj: Any, depth: int) -> int:
        if depth > max_depth:
            return 0
        if isinstance(obj, torch.Tensor):
            size = obj.numel() * obj.element_size()
            if obj.device.type == "meta":
                return size
            start = obj.storage_offset() * obj.element_size()
            spans.setdefault(obj.untyped_storage().data_ptr(), []).append((start, start + size))
            return 0
        if isinstance(obj, dict):
            return sum(walk(v, depth + 1) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v, depth + 1) for v in obj)
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            return sum(walk(v, depth + 1) for v in vars(obj).values())
        return 0

    total = sum(walk(obj, 0) for obj in objs)
    for intervals in spans.values():  # the union of the intervals per storage
        end = -1
        for lo, hi in sorted(intervals):
            lo = max(lo, end)
            if hi > lo:
                total += hi - lo
                end = hi
    return total


def count_dispatch(fn: Callable[[], Any]) -> DispatchCounter:
    """Run ``fn()`` once under a fresh :class:`DispatchCounter` and return the counter.

    Args:
        fn: A callable without arguments.

    Returns:
        The counter after the call.

    Example:
        >>> import torch
        >>> from curvopt.profiling import count_dispatch
        >>> count_dispatch(lambda: torch.ones(3).add_(1)).summary()
        {'ops': 2, 'views': 0, 'allocations': 0, 'kernels': 2, 'host_reads': 0}
    """
    with DispatchCounter() as counter:
        fn()
    return counter


class HostReadError(RuntimeError):
    """A copy of a (fake) CUDA tensor to the CPU under :func:`fake_cuda`: a host read."""


def _basic_view(tensor: torch.Tensor, index: Any) -> tuple[torch.Tensor, list[Any]]:
    """``tensor[index]`` through ATen view ops; returns the view and the advanced (tensor) indices.

    Supports ints, slices, ``None``, ``Ellipsis`` and integer tensors (``aten.index``); a boolean
    mask is a host read (its size depends on the data) and raises :class:`HostReadError`.
    """
    aten = torch.ops.aten
    items = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, dim, advanced = tensor, 0, []
    for item in items:
        if item is Ellipsis:
            dim += tensor.dim() - consumed
        elif item is None:
            out = aten.unsqueeze.default(out, dim)
            dim += 1
        elif isinstance(item, bool):
            raise NotImplementedError("fake_cuda: indexing with a Python bool")
        elif isinstance(item, int):
            out = aten.select.int(out, dim, item)
        elif isinstance(item, slice):
            out = aten.slice.Tensor(out, dim, item.start, item.stop, item.step or 1)
            dim += 1
        else:
            idx = item if isinstance(item, torch.Tensor) else torch.tensor(item, device=tensor.device)
            if idx.dtype == torch.bool:
                raise HostReadError("boolean-mask indexing (its result size is read on the host)")
            advanced.append((dim, idx))
            dim += 1
    return out, advanced


def _getitem(tensor: torch.Tensor, index: Any) -> torch.Tensor:
    out, advanced = _basic_view(tensor, index)
    if not advanced:
        return out
    indices: list[Any] = [None] * out.dim()
    for dim, idx in advanced:
        indices[dim] = idx
    while indices and indices[-1] is None:
        indices.pop()
    return torch.ops.aten.index.Tensor(out, indices)


def _setitem(tensor: torch.Tensor, index: Any, value: Any) -> None:
    out, advanced = _basic_view(tensor, index)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=tensor.dtype, device=tensor.device)
    if not advanced:
        torch.ops.aten.copy_.default(out, value)
        return
    indices: list[Any] = [None] * out.dim()
    for dim, idx in advanced:
        indices[dim] = idx
    torch.ops.aten.index_put_.default(out, indices, value)


class _FakeCudaBindings(TorchFunctionMode):
    """Routes the ``Tensor`` methods whose Python bindings refuse CUDA on a CPU-only torch.

    ``Tensor.copy_``, ``Tensor.to(device)`` and indexing initialise CUDA before they dispatch, which
    a CPU build cannot; their ATen ops (``aten.copy_``, ``aten._to_copy``, ``aten.slice``/``select``/
    ``index``) work on fake tensors. A copy from CUDA to the CPU and a boolean mask are host reads and
    raise :class:`HostReadError`.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            return _getitem(args[0], args[1])
        if func is torch.Tensor.__setitem__:
            return _setitem(args[0], args[1], args[2])
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and isinstance(src, torch.Tensor) and src.device.type == "cuda":
                raise HostReadError("copy of a CUDA tensor into a CPU tensor (a host read)")
            return torch.ops.aten.copy_.default(dst, src, kwargs.get("non_blocking", False))
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            tensor = args[0]
            copy = bool(kwargs.get("copy", False))
            if func is torch.Tensor.cpu:
                device, dtype = torch.device("cpu"), None
            elif func is torch.Tensor.cuda:
                device, dtype = torch.device("cuda"), None
            else:
                parse_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to knows no copy=
                device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **parse_kwargs)
            device = tensor.device if device is None else torch.device(device)
            dtype = dtype or tensor.dtype
            if device.type == tensor.device.type and dtype == tensor.dtype and not copy:
                return tensor  # .to() of a tensor that already fits is the tensor itself
            if device.type == "cpu" and tensor.device.type != "cpu":
                raise HostReadError("copy of a CUDA tensor to the CPU (a host read)")
            return torch.ops.aten._to_copy.default(tensor, dtype=dtype, device=device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[Any]:
    """A ``FakeTensorMode`` for building ``device="cuda"`` tensors on a CPU-only torch.

    Inside it, ``torch.zeros(..., device="cuda")`` and every op on such tensors run on metadata only;
    reading a value on the host (``.item()``, ``float()``, ``bool()``, ``.tolist()``, a boolean mask,
    ``nonzero``, a copy to the CPU) raises. Parameters and optimizers created inside it are fake as
    well. ``Tensor.copy_`` and ``Tensor.to``, whose bindings would try to initialise CUDA, are routed
    to their ATen ops.

    Yields:
        The ``FakeTensorMode``.

    Example:
        >>> import torch
        >>> from curvopt.profiling import fake_cuda
        >>> with fake_cuda():
        ...     p = torch.nn.Parameter(torch.zeros(3, 2, device="cuda"))
        ...     p.grad = torch.ones_like(p)
        ...     opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        ...     opt.step()
        ...     print(p.device, type(p.data).__name__)
        cuda:0 FakeTensor
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode, _FakeCudaBindings():
        yield mode
