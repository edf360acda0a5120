"""Argument checks shared by the optimizers: hyper-parameters declared once, parameters refused by name.

An optimizer declares what each hyper-parameter may be, once, as a mapping ``name → Range``::

    RANGES = {"lr": NONNEG, "beta": UNIT, "gamma": at_least(1.0), "n_iter": count(), "mode": one_of("a", "b")}

and checks its arguments (or a parameter group) against it with :func:`check_hparams`. A value out of
range is refused with one line that names the owner, the argument, the value and what is allowed::

    ValueError: RACS: gamma must be a finite number >= 1, got inf

Numbers may be Python numbers or 0-d tensors (a tensor ``lr``, as ``torch.optim`` allows). A tensor on
the CPU is checked by value; a tensor on an accelerator is read once (one host synchronisation) when it
is checked — at construction or ``add_param_group``, never inside ``step``; a meta or fake tensor has no
value to read and is checked for its shape only. Booleans are never numbers (``True`` is not ``1``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

_NO_VALUE = object()  # a tensor whose value cannot be read here (meta or fake)


@dataclass(frozen=True)
class Range:
    """What one hyper-parameter may be.

    Attributes:
        kind: ``"real"``, ``"int"``, ``"bool"``, ``"choice"`` or ``"tuple"`` (``size`` reals of
            ``item``'s range, e.g. Adam's betas).
        low: Lower bound (``-inf``: none).
        high: Upper bound (``inf``: none).
        low_open: ``value > low`` instead of ``>=``.
        high_open: ``value < high`` instead of ``<=``.
        finite: Refuse ``±inf`` (NaN is always refused).
        choices: The allowed values of a ``"choice"``.
        also: Literal values accepted besides the range (``None``, ``"adaptive"``, ``"auto"``).
        size: Number of entries of a ``"tuple"``.
        item: The range of each entry of a ``"tuple"``.
    """

    kind: str
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    finite: bool = True
    choices: tuple[Any, ...] = ()
    also: tuple[Any, ...] = ()
    size: int = 0
    item: Range | None = None

    def describe(self) -> str:
        """What is allowed, in words (the end of the error message)."""
        if self.kind == "bool":
            text = "True or False"
        elif self.kind == "choice":
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind == "tuple":
            assert self.item is not None
            text = f"{self.size} numbers, each {self.item.describe()}"
        else:
            noun = "an integer" if self.kind == "int" else ("a finite number" if self.finite else "a number")
            lo, hi = self.low, self.high
            if lo > -math.inf and hi < math.inf:
                text = f"{noun} in {'(' if self.low_open else '['}{_num(lo)}, {_num(hi)}{')' if self.high_open else ']'}"
            elif lo > -math.inf:
                text = f"{noun} {'>' if self.low_open else '>='} {_num(lo)}"
            elif hi < math.inf:
                text = f"{noun} {'<' if self.high_open else '<='} {_num(hi)}"
            else:
                text = noun
        if self.also:
            text = " or ".join(repr(a) for a in self.also) + " or " + text
        return text

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is allowed (a tensor without a readable value passes on its shape)."""
        if any(value is a or (type(value) is type(a) and value == a) for a in self.also):
            return True
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "choice":
            return any(type(value) is type(c) and value == c for c in self.choices)
        if self.kind == "tuple":
            assert self.item is not None
            try:
                items = tuple(value)
            except TypeError:
                return False
            return len(items) == self.size and all(self.item.accepts(x) for x in items)
        number = as_number(value)
        if number is _NO_VALUE:
            return True
        if number is None:
            return False
        if self.kind == "int" and not (math.isfinite(number) and float(number).is_integer()):
            return False
        if math.isnan(number) or (self.finite and math.isinf(number)):
            return False
        above = number > self.low if self.low_open else number >= self.low
        below = number < self.high if self.high_open else number <= self.high
        return above and below

    def check(self, owner: str, name: str, value: Any) -> None:
        """Refuse ``value`` with one line naming ``owner``, ``name``, the value and what is allowed.

        Raises:
            ValueError: If the value is out of range (or not a number where one is needed).
        """
        if not self.accepts(value):
            raise ValueError(f"{owner}: {name} must be {self.describe()}, got {_shown(value)}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        number = as_number(value)
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        if number is None or number is _NO_VALUE:
            return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}{where}"
        return f"tensor({number!r}){where}"
    return repr(value)


def as_number(value: Any) -> Any:
    """``value`` as a Python number; ``None`` if it is not one.

    A 0-d (or one-element) real tensor is read (on the CPU for free; on an accelerator with one host
    synchronisation); a meta or fake tensor gives a sentinel meaning "no value to check".
    Booleans (and bool tensors) are not numbers.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        if value.device.type == "meta" or _is_fake(value):
            return _NO_VALUE
        return float(value.detach().reshape(()).item())
    return None


def _is_fake(value: Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - older torch
        return False
    return bool(is_fake(value))


# ---------------------------------------------------------------------------- the ranges
def real(
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    also: tuple[Any, ...] = (),
) -> Range:
    """A real number in ``[low, high]`` (ends open as asked), finite unless ``finite=False``."""
    return Range("real", low, high, low_open, high_open, finite, also=also)


def at_least(low: float, **kw: Any) -> Range:
    """A finite real number ``>= low``."""
    return real(low, **kw)


def count(low: int = 1, high: float = math.inf, *, also: tuple[Any, ...] = ()) -> Range:
    """An integer (an ``int``, or an integral float as configs give it) ``>= low``."""
    return Range("int", low, high, also=also)


def one_of(*choices: Any) -> Range:
    """One of ``choices`` (compared with ``==`` and the same type: ``True`` is not ``1``)."""
    return Range("choice", choices=tuple(choices))


def tuple_of(size: int, item: Range) -> Range:
    """``size`` values, each in ``item`` (Adam's betas: ``tuple_of(2, UNIT)``)."""
    return Range("tuple", size=size, item=item)


def optional(rng: Range) -> Range:
    """``rng``, or ``None``."""
    return replace(rng, also=(None, *rng.also))


#: A finite number ``>= 0`` (learning rates, weight decay, tolerances, scales).
NONNEG = real(0.0)
#: A finite number ``> 0`` (dampings, epsilons that are floors).
POSITIVE = real(0.0, low_open=True)
#: A number in ``[0, 1)`` (EMA decays, betas).
UNIT = real(0.0, 1.0, high_open=True)
#: A number in ``(0, 1]`` (decay factors that must shrink or keep).
UNIT_OPEN_LOW = real(0.0, 1.0, low_open=True)
#: ``True`` or ``False``.
FLAG = Range("bool")
#: Any integer (seeds).
INTEGER = Range("int")


def check_hparams(
    owner: str,
    ranges: Mapping[str, Range],
    values: Mapping[str, Any],
    ordered: Iterable[tuple[str, str]] = (),
) -> None:
    """Check every value of ``values`` that ``ranges`` declares (others are not looked at).

    Args:
        owner: The optimizer's name, for the message.
        ranges: ``name → Range``, declared once per optimizer.
        values: The arguments, or a parameter group.
        ordered: Pairs ``(low, high)`` of names whose values must satisfy ``low <= high``
            (thresholds, bounds), checked after the ranges.

    Raises:
        ValueError: The first value out of its range, in ``ranges``' order, then the first pair out
            of order.
    """
    for name, rng in ranges.items():
        if name in values:
            rng.check(owner, name, values[name])
    for low, high in ordered:
        a, b = as_number(values[low]), as_number(values[high])
        if isinstance(a, float) and isinstance(b, float) and a > b:
            raise ValueError(
                f"{owner}: {low} must be <= {high}, got {low}={_shown(values[low])} > {_shown(values[high])}"
            )


def typed(ranges: Mapping[str, Range], values: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """Checked values in the types their ranges declare, for an optimizer to keep.

    A real becomes a ``float``, an integer an ``int`` (``250.0`` from a config: ``250``), a flag a
    ``bool``; a choice, a tuple and a literal of ``also`` (``None``, ``"auto"``) stay as given.

    Args:
        ranges: ``name → Range``, as for :func:`check_hparams` (run it first).
        values: The arguments.
        names: The names to keep.

    Returns:
        ``name → value`` in ``names``' order.
    """
    cast = {"real": float, "int": int, "bool": bool}
    out = {}
    for name in names:
        rng, value = ranges[name], values[name]
        literal = any(value is a or (type(value) is type(a) and value == a) for a in rng.also)
        out[name] = value if literal or rng.kind not in cast else cast[rng.kind](value)
    return out


#: The step settings the Gauss-Newton Algorithms FGN and SGN share, declared once (each adds its own).
GN_STEP_RANGES: dict[str, Range] = {
    "lr": POSITIVE,
    "damping": POSITIVE,
    "cg_tol": NONNEG,
    "cg_maxiter": count(1),
    "cg_early_exit": one_of(True, False, "auto"),
    "check_finite": one_of(None, "auto", "eager", "deferred"),
    "host_stats": FLAG,
}


def check_gn_step(
    owner: str, model: torch.nn.Module, values: Mapping[str, Any], own: Mapping[str, Range]
) -> None:
    """FGN's and SGN's one validation: :data:`GN_STEP_RANGES` and ``own``, then real floating parameters.

    Args:
        owner: ``"FGN"`` or ``"SGN"``, for the message.
        model: The model (its trainable parameters must be real floating point).
        values: The constructor's arguments.
        own: The method's own ranges.

    Raises:
        ValueError: A setting out of range.
        TypeError: A trainable parameter is complex (or not floating point).
    """
    check_hparams(owner, {**GN_STEP_RANGES, **own}, values)
    check_floating(owner, (p for p in model.parameters() if p.requires_grad))
    check_materialised(owner, model.named_parameters())


# ---------------------------------------------------------------------------- the parameters
def check_floating(owner: str, params: Iterable[Tensor]) -> None:
    """Refuse the first parameter that is not real floating point, naming its dtype and shape.

    Args:
        owner: The optimizer's name, for the message.
        params: The parameters (e.g. a model's trainable ones).

    Raises:
        TypeError: A parameter is complex or an integer tensor.
    """
    for p in params:
        if not p.is_floating_point():
            raise TypeError(
                f"{owner} supports real floating-point parameters only, got {p.dtype} (shape {tuple(p.shape)})"
            )


def check_real_floating(owner: str, params: Mapping[str, Tensor]) -> None:
    """Refuse complex or integer parameters with a clear error (the curvature products are real).

    Args:
        owner: The method's name, for the message.
        params: Named parameters.

    Raises:
        TypeError: A parameter is not a real floating-point tensor.
    """
    for name, p in params.items():
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(
                f"{owner} needs real floating-point parameters; {name} is {p.dtype} (complex is not supported)"
            )


def check_trainable(owner: str, params: Mapping[str, Tensor], one_dtype: bool = False) -> None:
    """Refuse a model with nothing to train, non-real parameters and (``one_dtype``) mixed dtypes.

    Args:
        owner: The method's name, for the message.
        params: The trainable parameters, by name.
        one_dtype: Require one dtype (methods that flatten all parameters into one vector).

    Raises:
        ValueError: No trainable parameter, or mixed dtypes where one is needed.
        TypeError: A parameter is not a real floating-point tensor.
    """
    if not params:
        raise ValueError(
            f"{owner}: the model has no trainable parameter (every parameter has requires_grad=False); "
            "unfreeze at least one"
        )
    check_real_floating(owner, params)
    check_materialised(owner, params.items())
    if one_dtype:
        dtypes = _dtypes(params.items())
        if len(dtypes) > 1:
            shown = ", ".join(f"{name} is {dt}" for dt, name in dtypes.items())
            raise ValueError(
                f"{owner} flattens all trainable parameters into one vector and needs one dtype; got {shown}. "
                "Cast the model to one dtype first (model.float() or model.double())"
            )


def check_materialised(owner: str, named: Iterable[tuple[str, Tensor]]) -> None:
    """Refuse a parameter on the meta device: an ``Algorithm`` runs its own forward on real batches.

    (A ``torch.optim.Optimizer`` may be built on meta parameters, as torch's are; an ``Algorithm``
    computes losses and curvature products, which a meta tensor has no values for.)

    Args:
        owner: The method's name, for the message.
        named: Named parameters (e.g. ``model.named_parameters()``).

    Raises:
        ValueError: A parameter is on the meta device.
    """
    for name, p in named:
        if p.device.type == "meta":
            raise ValueError(
                f"{owner}: parameter {name} is on the meta device (no values to train); materialise the "
                "model first (model.to_empty(device=...), then initialise or load its weights)"
            )


def _dtypes(named: Iterable[tuple[str, Tensor]]) -> dict[torch.dtype, str]:
    out: dict[torch.dtype, str] = {}
    for name, p in named:
        out.setdefault(p.dtype, name)
    return out
