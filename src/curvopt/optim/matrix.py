"""The base of the matrix optimizers (RACS, Alice, Alice-0): :class:`MatrixOptimizer`.

One ``torch.optim.Optimizer`` whose groups either run the matrix method or, with ``adam=True``,
plain bias-corrected Adam (GaLore's one-optimizer convention; docs/alice.md, "Parameter grouping").
Non-2-D parameters in a method group are rejected with a message — never silently reshaped.

What the base provides to every matrix method (docs/lean_steps.md):

* validation of the shared settings (declared ranges, tensor values included);
* the finiteness check, ``check_finite="eager"`` (one host read) or ``"deferred"`` (a device flag
  that gates the step's writes, read later by :meth:`MatrixOptimizer.raise_if_nonfinite`);
* state banks: same-shape matrices keep their state in one stacked tensor whose slices are the
  per-parameter state, for the stacked (``foreach``) update;
* the opt-in ``torch.compile`` of a bucket's update (:meth:`MatrixOptimizer._compiled`);
* the stacked helpers shared by the methods (:func:`chunk_slices`, :func:`ema_update`, …).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from curvopt.errors import NonFiniteError
from curvopt.optim.checks import (
    FLAG,
    NONNEG,
    UNIT,
    Range,
    check_hparams,
    one_of,
    optional,
    tuple_of,
)

#: ``check_finite`` settings: ``None`` (automatic: deferred when every gradient is on CUDA), ``"eager"``
#: (one host read per step, raise before anything changes) or ``"deferred"`` (no host read; a step
#: with a NaN/inf gradient writes nothing and :meth:`MatrixOptimizer.raise_if_nonfinite` raises).
CHECK_FINITE_MODES = (None, "eager", "deferred")

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def as_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Resolve a dtype given by name (configs) or as a ``torch.dtype``.

    Args:
        value: ``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``, a ``torch.dtype`` or
            ``None``.

    Returns:
        The ``torch.dtype`` (``None`` stays ``None``).

    Raises:
        ValueError: If the name is unknown.
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[value]


def compute_dtype(param: Tensor) -> torch.dtype:
    """The dtype the matrix algebra (QR, EVD, fixed point) of a parameter runs in.

    fp32 for bf16/fp16/fp32 params (``torch.linalg`` has no bf16), fp64 for fp64 params (the
    dense reference tests).

    Args:
        param: The parameter.

    Returns:
        ``torch.float64`` or ``torch.float32``.
    """
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def gate_scalar(ok: Tensor, value: float | Tensor, other: float) -> Tensor:
    """``value`` where ``ok`` else ``other``, as a 0-d float64 tensor on ``ok``'s device.

    float64 so that a Python hyper-parameter keeps its exact value: in a product with a float32
    tensor a 0-d tensor acts as a scalar, cast to the tensor's compute type as the float would be.
    """
    if not isinstance(value, Tensor):
        value = torch.scalar_tensor(value, dtype=torch.float64, device=ok.device)
    return torch.where(ok, value, other)


def limiter_eta(norm: Tensor, phi: Tensor, gamma: float) -> Tensor:
    """Fira's norm-growth limiter factor ``η = γ / max(‖X‖/φ, γ)``.

    Applies when a previous norm ``φ > 0`` exists, else η = 1. Kept on-device (no host sync).
    ``φ = 0`` happens only before the first update or after an all-zero gradient; the literal
    formula would then give η = 0, we take η = 1.

    Args:
        norm: ``‖X‖`` of the current update (0-d tensor).
        phi: The previous limited norm φ (0-d tensor).
        gamma: Growth threshold γ (≥ 1).

    Returns:
        η as a 0-d tensor; the limited update is ``η·X``.
    """
    ratio = norm / phi.clamp_min(torch.finfo(phi.dtype).tiny)
    eta = gamma / torch.clamp(ratio, min=gamma)
    return torch.where(phi > 0, eta, torch.ones_like(eta))


class MatrixOptimizer(torch.optim.Optimizer):
    """Base for optimizers that act on 2-D weight matrices, with an Adam fallback group.

    A parameter group with ``adam=True`` gets Adam (bias-corrected, ``adam_betas``, ``adam_eps``);
    any other group runs :meth:`_matrix_update` on each of its (2-D) parameters. ``weight_decay``
    is decoupled (``p ← p − lr·wd·p``) and 0 by default (the paper uses none).

    Args:
        params: Parameters or parameter groups, as for any ``torch.optim.Optimizer``.
        defaults: The subclass's group defaults; ``adam`` (False), ``adam_betas``
            ((0.9, 0.999)), ``adam_eps`` (1e-8), ``weight_decay`` (0) and ``state_dtype``
            (``None``: the parameter's dtype) are filled in when missing.

    Raises:
        ValueError: If a group has an invalid lr/weight decay/Adam setting, or a non-Adam group
            holds a parameter that is not 2-D.
        TypeError: If a parameter is complex (or not floating point).

    Example:
        The base class alone runs only ``adam=True`` groups (a subclass supplies the matrix
        update), in the usual loop:

        >>> import torch
        >>> from curvopt.optim import MatrixOptimizer
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = MatrixOptimizer([{"params": model.parameters(), "adam": True}], {"lr": 1e-2})
        >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
        >>> def closure():  # step(closure) re-evaluates the loss, as torch.optim.LBFGS users write it
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     loss.backward()
        ...     return loss
        >>> losses = [opt.step(closure).item() for _ in range(3)]
        >>> opt.state[model.weight]["step"], losses[-1] < losses[0]
        (3, True)
    """

    method_name = "matrix"

    #: The ranges of every group's settings (the Adam fallback's and the step's), checked on each
    #: group added (``curvopt.optim.checks``). A 0-d tensor ``lr`` is checked by value.
    BASE_RANGES: dict[str, Range] = {
        "lr": NONNEG,
        "weight_decay": NONNEG,
        "adam_eps": NONNEG,
        "adam_betas": tuple_of(2, UNIT),
        "foreach": optional(FLAG),
        "check_finite": one_of(*CHECK_FINITE_MODES),
        "compile": FLAG,
    }
    #: The method's own ranges, checked on method (non-Adam) groups (subclasses extend it).
    RANGES: dict[str, Range] = {}

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        defaults = {
            "adam": False,
            "adam_betas": (0.9, 0.999),
            "adam_eps": 1e-8,
            "weight_decay": 0.0,
            "state_dtype": None,
            "foreach": None,
            "check_finite": None,
            "compile": False,
            **defaults,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, validating its settings (and, for method groups, that every parameter is 2-D).

        Args:
            param_group: A dict with ``params`` and optional per-group settings.

        Raises:
            ValueError: On an invalid setting or a non-2-D parameter in a method group.
            TypeError: On a complex (or non-floating) parameter, in any group.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        name = type(self).__name__
        for flag in ("maximize", "differentiable", "capturable", "fused"):
            if group.get(flag):
                raise ValueError(
                    f"{name}: {flag}=True is not supported (the update is a descent step on the gradient as "
                    f"given); negate the loss to maximise, and leave {flag} unset"
                )
        check_hparams(name, self.BASE_RANGES, group)
        group["state_dtype"] = as_dtype(group.get("state_dtype"))
        for p in group["params"]:
            if p.is_complex() or not p.is_floating_point():
                raise TypeError(
                    f"{name} supports real floating-point parameters only, got a parameter of dtype "
                    f"{p.dtype} and shape {tuple(p.shape)}; optimise complex parameters as a real view "
                    "(torch.view_as_real) with another optimizer"
                )
        if not group["adam"]:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"{type(self).__name__} applies only to 2-D weight matrices, got a parameter of shape "
                        f"{tuple(p.shape)}. Put 1-D (norms, biases) and >2-D parameters in a group with "
                        "adam=True (curvopt.optim.grouping.build_grouped does this); they are never reshaped."
                    )
            self._validate_group(group)

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check the method's hyperparameters: :attr:`RANGES`, then what a range cannot say (subclasses)."""
        check_hparams(type(self).__name__, self.RANGES, group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping the saved dtypes of the state tensors.

        ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its
        parameter's dtype; this keeps the dtypes that were saved instead (Alice's fp32 ``Q̃`` and the
        fp32 limiter norms of bf16 parameters), so a resumed run takes exactly the same next step.

        Args:
            state_dict: A dict returned by :meth:`state_dict`.
        """
        self._check_loaded_groups(state_dict)
        saved = {
            pid: {k: v for k, v in st.items() if isinstance(v, Tensor)}
            for pid, st in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            if pid not in saved or p not in self.state:
                continue
            st = self.state[p]
            for key, value in saved[pid].items():
                if isinstance(st.get(key), Tensor) and st[key].dtype != value.dtype:
                    st[key] = value.to(device=p.device, copy=True)  # the saved values, not a round trip

    def _check_loaded_groups(self, state_dict: dict[str, Any]) -> None:
        """Refuse a state dict whose groups do not fit this optimizer's, before anything is loaded.

        ``torch.optim`` matches saved groups to the optimizer's by position and checks only their
        sizes: an optimizer built with its groups in another order would give one group's state to
        another's parameters (a matrix's ``s``/``q`` to a bias). Here each saved group must have the
        same ``adam`` flag, and each saved state tensor the size its parameter needs.

        Raises:
            ValueError: Naming the group (or parameter) that does not fit.
        """
        name = type(self).__name__
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            return  # torch.optim's own check names this
        order = 0
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if "adam" in saved and bool(saved["adam"]) != bool(group["adam"]):
                raise ValueError(
                    f"{name}: parameter group #{i} was saved with adam={saved['adam']} but is adam={group['adam']} "
                    "here; the state dict's groups are in another order than this optimizer's (torch.optim "
                    "matches groups by position): build the optimizer with its groups in the saved order"
                )
            for pid, p in zip(saved.get("params", []), group["params"]):
                st = state_dict.get("state", {}).get(pid, {})
                expected = self._state_sizes(p, group)
                for key, numel in expected.items():
                    value = st.get(key)
                    if isinstance(value, Tensor) and value.numel() != numel:
                        raise ValueError(
                            f"{name}: the saved {key!r} of parameter #{order} (group #{i}) has {value.numel()} "
                            f"elements where its parameter of shape {tuple(p.shape)} needs {numel}; the state "
                            "dict's groups or parameters are in another order than this optimizer's"
                        )
                order += 1

    def _state_sizes(self, p: Tensor, group: dict[str, Any]) -> dict[str, int]:
        """Elements of each state tensor of ``p`` (the Adam moments, or the method's :meth:`state_numel`)."""
        if group["adam"]:
            return {"exp_avg": p.numel(), "exp_avg_sq": p.numel()}
        numel = getattr(self, "state_numel", None)
        if numel is None or p.dim() != 2:
            return {}
        hyper = {k: v for k, v in group.items() if k != "params"}
        return numel(tuple(p.shape), **hyper)

    def _state_dtype(self, p: Tensor, group: dict[str, Any]) -> torch.dtype:
        """Dtype of the stored state: the parameter's (the paper keeps BF16 states) or ``state_dtype``."""
        return group["state_dtype"] or p.dtype

    def _check_sparse(self, params: list[Tensor]) -> None:
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients; no parameter or optimizer "
                "state was changed (use a dense gradient, e.g. nn.Embedding(sparse=False))"
            )

    def _grad_limit(self, p: Tensor, group: dict[str, Any]) -> float:
        """The largest gradient magnitude (max |entry|) ``p``'s step can take without overflow.

        The Adam fallback squares the gradient (``v``); a method group asks :meth:`_matrix_grad_limit`.
        A larger (or NaN/inf) gradient is refused as a NaN is: before anything changes, or by the
        deferred flag.
        """
        big = torch.finfo(compute_dtype(p)).max
        if group["adam"]:
            return math.sqrt(big) / 4
        return self._matrix_grad_limit(p, group, big)

    def _matrix_grad_limit(self, p: Tensor, group: dict[str, Any], big: float) -> float:
        """:meth:`_grad_limit` of a method group, ``big`` being the compute dtype's largest value (subclasses)."""
        return math.sqrt(big) / 4

    def _grad_limits(self, params: list[Tensor]) -> list[float]:
        """:meth:`_grad_limit` of each of ``params`` (in their groups)."""
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        return [self._grad_limit(p, group_of[id(p)]) for p in params]

    def _nonfinite_error(self, params: list[Tensor]) -> NonFiniteError | None:
        """The error naming the first parameter whose gradient holds NaN/inf or overflows the step (exact)."""
        order = [p for group in self.param_groups for p in group["params"]]
        name = type(self).__name__
        for p, limit in zip(params, self._grad_limits(params)):
            index = next(i for i, q in enumerate(order) if q is p)
            where = f"the gradient of parameter #{index} (shape {tuple(p.shape)})"
            if not bool(p.grad.isfinite().all()):
                return NonFiniteError(
                    f"{name}: {where} holds NaN or inf values; no parameter or optimizer state was changed. "
                    "The loss or its backward overflowed: lower the learning rate, clip gradients, or use a "
                    "wider dtype"
                )
            largest = float(p.grad.abs().max()) if p.grad.numel() else 0.0
            if largest > limit:
                return NonFiniteError(
                    f"{name}: {where} reaches |g| = {largest:.3g}, beyond the {limit:.3g} its step can square "
                    f"in {compute_dtype(p)} without overflow; no parameter or optimizer state was changed. "
                    "Scale the loss down, clip gradients (torch.nn.utils.clip_grad_norm_), or use float64 "
                    "parameters"
                )
        return None

    def _finite_flag(self, params: list[Tensor]) -> Tensor:
        """A 0-d bool tensor on the gradients' device: every gradient entry is finite and within its limit.

        One ``torch._foreach_norm(·, inf)`` over all gradients (NaN and inf survive a max; a max
        cannot overflow), scaled by the inverse of each gradient's :meth:`_grad_limit`, then one
        comparison and one reduction: five ops, no host read.
        """
        norms = torch._foreach_norm([p.grad for p in params], float("inf"))
        torch._foreach_mul_(norms, [1.0 / limit for limit in self._grad_limits(params)])
        return torch.stack(norms).le(1.0).all()

    def _check_finite_gradients(self, params: list[Tensor]) -> None:
        """Raise before anything changes when a gradient holds a NaN or an inf, or overflows (one host read).

        Raises:
            NonFiniteError: Naming the first such parameter; nothing has changed.
        """
        if not params or bool(self._finite_flag(params)):
            return
        error = self._nonfinite_error(params)
        if error is not None:
            raise error

    def _resolve_check_finite(self, work: list[tuple[dict[str, Any], list[Tensor]]]) -> str:
        """``"eager"`` or ``"deferred"`` for this step (see :attr:`nonfinite_pending`).

        ``deferred`` needs every group of the step on the stacked path (:meth:`_defers`) and one
        device for all gradients; ``None`` picks it when every gradient is on CUDA.
        """
        modes = {g.get("check_finite") for g, _ in work}
        if "eager" in modes:
            return "eager"
        devices = {p.grad.device for _, ps in work for p in ps}
        if len(devices) != 1:
            return "eager"
        if "deferred" not in modes and next(iter(devices)).type != "cuda":
            return "eager"
        return "deferred" if all(self._defers(g, ps) for g, ps in work) else "eager"

    def _defers(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        """Whether this step of ``group`` can gate its writes on a device flag (the stacked path)."""
        return self._use_foreach(group, params)

    @property
    def nonfinite_pending(self) -> Tensor | None:
        """Device flag of the ``check_finite="deferred"`` mode: a skipped step since the last check.

        In that mode (the default when every parameter is on CUDA) a step does not read its
        gradients' finiteness on the host: it computes a 0-d bool on the device and, where a
        gradient holds NaN or inf, writes nothing (every parameter and state tensor keeps its value;
        only the integer step counters advance). The flag stays set until :meth:`raise_if_nonfinite`
        reads it. ``None`` when no deferred step has run since the last check.
        """
        return self.__dict__.get("_nonfinite_pending")

    def raise_if_nonfinite(self) -> None:
        """Read the deferred flag (one host read) and raise if a step was skipped since the last call.

        The training loop calls it with the loss it reads anyway; a loop of your own calls it as
        often as it can afford a host read (every step, or when it logs).

        Raises:
            NonFiniteError: If a deferred step met a NaN/inf gradient (that step changed nothing).
        """
        flag = self.__dict__.pop("_nonfinite_pending", None)
        if flag is not None and bool(flag):
            raise NonFiniteError(
                f"{type(self).__name__}: a gradient held NaN or inf values (or entries too large for the step "
                "to square without overflow) in a step since the last check (check_finite='deferred'); that "
                "step changed no parameter or optimizer state. The loss or its backward overflowed: lower the "
                "learning rate, clip gradients, or use a wider dtype"
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One update of every parameter that has a gradient.

        Args:
            closure: Optional callable that re-evaluates the loss (with gradients enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            NonFiniteError: If a gradient holds NaN/inf (nothing is changed); with
                ``check_finite="deferred"`` the step is skipped instead and
                :meth:`raise_if_nonfinite` raises.
            RuntimeError: On a sparse gradient (nothing is changed).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        work = [(g, ps) for g, ps in work if ps]
        every = [p for _, ps in work for p in ps]
        self._check_sparse(every)
        ok = None
        if every:
            if self._resolve_check_finite(work) == "deferred":
                ok = self._finite_flag(every)
                pending = self.__dict__.get("_nonfinite_pending")
                bad = ok.logical_not()
                self._nonfinite_pending = bad if pending is None else pending.logical_or_(bad)
            else:
                self._check_finite_gradients(every)
        self._step_ok = ok  # read by the stacked updates, which gate their writes on it
        try:
            for group, params in work:
                if self._use_foreach(group, params):
                    if group["weight_decay"] != 0:
                        factor = 1 - group["lr"] * group["weight_decay"]
                        if ok is not None:
                            factor = gate_scalar(ok, factor, 1.0)
                        torch._foreach_mul_(params, factor)
                    if group["adam"]:
                        self._adam_update_foreach(params, group)
                    else:
                        self._matrix_update_foreach(params, group)
                    continue
                for p in params:
                    if group["weight_decay"] != 0:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    if group["adam"]:
                        self._adam_update(p, p.grad, self.state[p], group)
                    else:
                        self._matrix_update(p, p.grad, self.state[p], group)
        finally:
            self._step_ok = None
        return loss

    def _gated(self, new: Tensor, old: Tensor) -> Tensor:
        """``new``, or ``old`` where this step is skipped (``check_finite="deferred"``)."""
        ok = self.__dict__.get("_step_ok")
        return new if ok is None else torch.where(ok, new, old)

    def _sanitized(self, G: Tensor) -> Tensor:
        """``G``, or zeros in a skipped deferred step (so that nothing computed from it is NaN)."""
        ok = self.__dict__.get("_step_ok")
        return G if ok is None else torch.where(ok, G, 0.0)

    def _gated_scale(self, scale: float | Tensor) -> float | Tensor:
        """A step size, or 0 where this step is skipped (``check_finite="deferred"``)."""
        ok = self.__dict__.get("_step_ok")
        return scale if ok is None else gate_scalar(ok, scale, 0.0)

    def _bank(self, params: list[Tensor], keys: tuple[str, ...]) -> dict[str, Tensor]:
        """The state ``keys`` of same-shape ``params`` as stacked ``(k, ...)`` tensors (state banks).

        Each parameter's ``state[key]`` is the ``i``-th slice of the bank, so the per-parameter
        state (and ``state_dict``) keeps ``torch.optim``'s layout while the stacked update reads and
        writes the bank in place: no ``torch.stack`` of the state and no copy back per step. A bank
        is rebuilt (by stacking) when a state tensor is no longer its slice — after
        ``load_state_dict``, ``copy.deepcopy`` or a change of the parameters that have gradients.
        Banks are never saved: ``state_dict`` holds the slices.
        """
        cache: dict[tuple[int, ...], dict[str, Any]] = self.__dict__.setdefault("_banks", {})
        ident = tuple(id(p) for p in params)
        bank = cache.get(ident)
        if bank is not None and all(
            self.state[p].get(k) is v for k in keys for p, v in zip(params, bank["views"][k])
        ):
            return bank["stacked"]
        members = set(ident)
        for other in [key for key in cache if members.intersection(key)]:
            del cache[other]  # a parameter belongs to one bank at a time
        stacked = {k: torch.stack([self.state[p][k] for p in params]) for k in keys}
        views = {k: list(stacked[k].unbind(0)) for k in keys}
        for k in keys:
            for p, v in zip(params, views[k]):
                self.state[p][k] = v
        cache[ident] = {"stacked": stacked, "views": views}
        return stacked

    def _compiled(self, fn: Callable[..., Any], key: tuple[Any, ...]) -> Callable[..., Any]:
        """``torch.compile(fn, fullgraph=True, dynamic=False)`` for one shape bucket ``key`` (never saved).

        Each bucket compiles a copy of ``fn``'s code object: torch keeps compiled graphs per code
        object and stops recompiling one after ``cache_size_limit`` (8) shapes, so a model with many
        weight shapes would fall back to eager; per bucket, each copy holds one graph.
        """
        cache: dict[Any, Any] = self.__dict__.setdefault("_compiled_fns", {})
        full_key = (fn, *key)
        if full_key not in cache:
            clone = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
            clone.__kwdefaults__ = fn.__kwdefaults__
            cache[full_key] = torch.compile(clone, fullgraph=True, dynamic=False)
        return cache[full_key]

    def _hyper_tensor(
        self, group: dict[str, Any], name: str, value: float | Tensor, device: torch.device
    ) -> Tensor:
        """A hyper-parameter as a 0-d float64 tensor on ``device`` for the compiled update.

        Kept per group and refilled (one op) only when the value changes, so a scheduled lr neither
        recompiles the update nor allocates a tensor per step.
        """
        if isinstance(value, Tensor):
            return value.to(device=device, dtype=torch.float64)
        cache: dict[Any, list[Any]] = self.__dict__.setdefault("_hyper", {})
        key = (id(group), name, device)
        entry = cache.get(key)
        if entry is None:
            entry = cache[key] = [value, torch.full((), value, dtype=torch.float64, device=device)]
        elif entry[0] != value:
            entry[0] = value
            entry[1].fill_(value)
        return entry[1]

    @staticmethod
    def _use_foreach(group: dict[str, Any], params: list[Tensor]) -> bool:
        """The group's ``foreach`` setting; ``None`` (the default) means on when every parameter is on CUDA.

        The per-parameter loop launches a few dozen small kernels per matrix, which on a GPU costs
        more than the arithmetic (RACS on the 56 LLaMA-60M matrices: 43 ms a step vs 0.4 ms for
        fused AdamW on an H200, ``results/benchmarks/cuda/bench_llm_optim.md``); the ``foreach``
        path updates same-shape matrices together from stacked state banks, with batched products and
        ``torch._foreach_*`` calls. On a CPU the loop is as fast and uses less memory, so it stays the
        default there.
        """
        if group.get("compile"):
            return True  # the compiled update is the stacked one
        foreach = group.get("foreach")
        if foreach is None:
            return all(p.device.type == "cuda" for p in params)
        return bool(foreach)

    def _adam_update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        b1, b2 = group["adam_betas"]
        self._init_adam_state(p, state, group)
        state["step"] += 1
        t = state["step"]
        cdt = compute_dtype(p)
        g = grad.to(cdt)
        m = state["exp_avg"].to(cdt).mul_(b1).add_(g, alpha=1 - b1)
        v = state["exp_avg_sq"].to(cdt).mul_(b2).addcmul_(g, g, value=1 - b2)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        # torch.optim.Adam's arithmetic: m̂ / (√v̂ + ε)
        denom = v.sqrt().div_(math.sqrt(1 - b2**t)).add_(group["adam_eps"])
        upd = m / denom
        p.add_(upd.to(p.dtype), alpha=-group["lr"] / (1 - b1**t))

    def _init_adam_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """An Adam-group parameter's state before its first step (moments in the state dtype)."""
        if state:
            return
        sd = self._state_dtype(p, group)
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=sd)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=sd)

    def _adam_update_foreach(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """:meth:`_adam_update` on many parameters at once, with the same arithmetic, element for element.

        Parameters are bucketed by (dtype, state dtype, device, step count), so each bucket is a
        few ``torch._foreach_*`` calls instead of a dozen kernels per parameter.
        """
        b1, b2 = group["adam_betas"]
        buckets: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in params:
            state = self.state[p]
            self._init_adam_state(p, state, group)
            state["step"] += 1
            key = (p.dtype, state["exp_avg"].dtype, p.device, state["step"])
            buckets.setdefault(key, []).append(p)
        ok = self.__dict__.get("_step_ok")
        for (pdt, sdt, _, t), ps in buckets.items():
            cdt = compute_dtype(ps[0])
            grads = [p.grad if p.grad.dtype == cdt else p.grad.to(cdt) for p in ps]
            m_state = [self.state[p]["exp_avg"] for p in ps]
            v_state = [self.state[p]["exp_avg_sq"] for p in ps]
            m = m_state if sdt == cdt else [x.to(cdt) for x in m_state]
            v = v_state if sdt == cdt else [x.to(cdt) for x in v_state]
            scale = -group["lr"] / (1 - b1**t)
            if ok is None:
                torch._foreach_mul_(m, b1)
                torch._foreach_add_(m, grads, alpha=1 - b1)
                torch._foreach_mul_(v, b2)
                torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            else:  # a skipped step: zero gradients, undecayed moments, no move
                grads = [torch.where(ok, g, 0.0) for g in grads]
                torch._foreach_mul_(m, gate_scalar(ok, b1, 1.0))
                torch._foreach_add_(m, grads, alpha=1 - b1)
                torch._foreach_mul_(v, gate_scalar(ok, b2, 1.0))
                torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
                scale = self._gated_scale(scale)
            if sdt != cdt:
                torch._foreach_copy_(m_state, m)
                torch._foreach_copy_(v_state, v)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(1 - b2**t))
            torch._foreach_add_(denom, group["adam_eps"])
            upd = torch._foreach_div(m, denom)
            if pdt != cdt:
                upd = [u.to(pdt) for u in upd]
            foreach_add_scaled(ps, upd, scale)

    def _matrix_update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _matrix_update_foreach(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """The matrix update of many parameters (subclasses batch it; this default loops)."""
        for p in params:
            self._matrix_update(p, p.grad, self.state[p], group)


def ema_update(old: Tensor, new: Tensor, beta: float | Tensor) -> Tensor:
    """``β·old + (1−β)·new``: as the per-matrix loop computes it for a float β, in plain ops for a tensor."""
    if isinstance(beta, Tensor):
        return old * beta + new * (1 - beta)
    return old.mul(beta).add_(new, alpha=1 - beta)


# Elements of one stacked chunk of the foreach path on a CPU: its three k×m×n fp32 temporaries (G,
# P = G⊙G, the scaled step) then take at most 3 × 32 MiB beside the model (all 32 512×512 attention
# matrices of LLaMA-60M in one chunk). On CUDA a bucket is never chunked: every chunk costs its own
# few dozen kernel launches, and the temporaries are small beside an accelerator's memory.
FOREACH_CHUNK_NUMEL = 1 << 23


def chunk_slices(k: int, numel: int, device: torch.device) -> list[slice]:
    """Consecutive slices of a bucket of ``k`` same-shape matrices of ``numel`` elements each.

    On CUDA one slice (the whole bucket); elsewhere slices that stack into at most
    :data:`FOREACH_CHUNK_NUMEL` elements (one matrix at least).
    """
    if device.type == "cuda":
        return [slice(0, k)]
    per_chunk = max(1, FOREACH_CHUNK_NUMEL // numel)
    return [slice(i, min(i + per_chunk, k)) for i in range(0, k, per_chunk)]


def bank_slice(bank: dict[str, Tensor], part: slice, k: int) -> dict[str, Tensor]:
    """The ``part`` of every stacked state tensor (the bank itself when ``part`` covers all ``k``)."""
    if part.start == 0 and part.stop == k:
        return bank
    return {key: value[part] for key, value in bank.items()}


def foreach_add_scaled(params: list[Tensor], updates: list[Tensor], scale: float | Tensor) -> None:
    """``p += scale · u`` for every pair; ``scale`` may be a tensor (a tensor learning rate)."""
    if isinstance(scale, Tensor):
        torch._foreach_mul_(updates, scale.to(updates[0].dtype))
        torch._foreach_add_(params, updates)
    else:
        torch._foreach_add_(params, updates, alpha=scale)
