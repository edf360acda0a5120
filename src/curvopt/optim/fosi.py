"""FOSI: any first-order optimizer plus a Newton step on the extreme Hessian eigenspace.

Sivan, Gabel & Schuster, ICLR 2024; usage and flags in docs/fosi.md, the choices the paper leaves
open in docs/decisions.md, FOSI.

Every ``ese_period`` steps, Lanczos on Hessian-vector products (the ESE) estimates the k largest
and ℓ smallest eigenpairs (λ̂, V̂) of the loss Hessian on an ESE batch. Each step then splits the
gradient g into g₁ = V̂V̂ᵀg and g₂ = g − g₁ and updates

    θ ← θ + d₁ + s·d₂,   d₁ = −α V̂ diag(u) V̂ᵀ v̄,   d₂ = d_b − V̂V̂ᵀ d_b,

where v̄ is g₁ under the base optimizer's momentum form (HB: g₁ + βv̄, Adam: EMA, GD: g₁),
u = 1/max(|λ̂|, ε), d_b is the base optimizer's step on g₂ (the base only ever sees g₂), and
s = clip(|λ̂₁|/|λ̂_k|, 1, c) scales the base step (c = 1 for Adam). Before the first ESE, FOSI *is*
its base optimizer: ``step`` calls ``base.step()`` and nothing else.

Two entry points:

* :class:`FOSI` — a ``torch.optim.Optimizer`` wrapping an already-built base optimizer, for use
  from plain Python: ``loss.backward(); fosi.step()``. It shares the base's ``param_groups``
  (schedulers and manual lr changes reach the base) and ``state``; ``state_dict`` round-trips
  both. Ready-made: :func:`fosi_heavy_ball`, :func:`fosi_adam`, :func:`fosi_gd`.
* :func:`~curvopt.optim.fosi_adapter.build_fosi` — the factory the training loop calls
  (``conf/optimizer/fosi_*.yaml``): an :class:`~curvopt.api.Algorithm` over an ``Objective`` with
  an ESE batch drawn (seeded) from ``data.train``. It and :class:`~curvopt.optim.fosi_adapter.FOSIAlgorithm`
  live in :mod:`curvopt.optim.fosi_adapter` (the adapter to the training loop, which imports this
  module; this module, the optimizer alone, imports nothing of it).

Implementation choices that matter for speed (benchmarks/bench_fosi.py):

* **No flat copies.** V̂ is one ``(k+ℓ, n)`` tensor; each parameter uses the column block that
  belongs to it as a strided view, so V̂ᵀg, the projection written back into ``p.grad`` and the
  final update are gemv calls on the parameters and gradients in place. A non-ESE step reads V̂
  four times (V̂g, g − V̂ᵀc, V̂d_b, the update), three for SGD-type bases (below).
* **Velocity in coefficients.** Only V̂v̄ enters d₁. Between two ESEs V̂ is fixed, so v̄ is kept as
  ``ρ·r + V̂ᵀa`` (a residual vector r from before the last ESE with a decaying scalar ρ, plus k+ℓ
  coefficients a): updating it costs O(k+ℓ) per step instead of two passes over n. It is
  materialised once per ESE, so — as in the authors' code — v̄ is not reset when V̂ changes.
* **SGD fast path: two passes over V̂ per step.** For ``torch.optim.SGD`` (GD, heavy ball or
  Nesterov; no weight decay; one lr/momentum for all groups) the base step is linear in its
  input, so the base is fed the full g and the difference is corrected inside span(V̂): its
  buffer m′ = m + V̂ᵀz differs from the true buffer m (built from g₂) by known coefficients. With
  w = V̂m′ and y = V̂m (y ← βy since V̂g₂ = 0, w ← βw + (1−δ)c) the whole FOSI update is one
  final ``θ += V̂ᵀ(coefficients)``: a step reads V̂ twice (V̂g and the update) instead of four times
  and needs no copy of θ. The buffers are corrected to m (one pass) whenever V̂ changes, the path
  is left, or :meth:`state_dict` is called. The scale s is applied by scaling the group lr for the
  base step (identical for HB/GD, as in the paper). ``fast_path=False`` forces the generic path
  (tests check both against a step-by-step reference of the paper's Algorithm 2 with the
  authors' Newton-part momentum).
* **No host read between ESEs.** The eigenvalues are read on the host once, when a basis is
  installed (an ESE, :meth:`FOSI.set_basis`, a load): the scale s and the logged λ̂ are Python floats
  from then on, so a step between two ESEs (either path, any base that reads nothing itself, e.g.
  SGD or fused Adam) makes no host read and a GPU never waits on the host for it.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from curvopt.curvature.hvp import HVP_MODES, flat_hvp, hvp_module, make_flat_hvp, named_subset
from curvopt.curvature.lanczos import REORTH_MODES, LanczosError, LanczosResult, lanczos

log = logging.getLogger(__name__)

NEWTON_MOMENTUM = ("auto", "none", "heavy_ball", "ema", "nesterov")
ESE_SCHEDULES = ("paper", "released")
ESE_BATCH_MODES = ("fixed", "current")
FAILURE_MODES = ("base", "keep", "raise")
BASES = ("heavy_ball", "adam", "gd")
# Named variants: option presets. "quadratic" is the update rule of the authors' quadratic
# experiments (paper §4.3, B.2; docs/decisions.md FOSI-E, FOSI-F): EMA momentum on the Newton
# part with α = 1 and unclipped lr scaling.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "quadratic": {"newton_momentum": "ema", "alpha": 1.0, "lr_clip": math.inf},
}
_ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)
LR_REF_KEY = "fosi_lr_ref"  # per group: the lr at which the Newton part has its full size α


def _momentum_coefficients(form: str, beta: float, dampening: float = 0.0) -> tuple[float, float]:
    """(a_g, a_v) of the linear velocity update v̄ ← a_g·g₁ + a_v·v̄ for each momentum form."""
    if form == "none":
        return 1.0, 0.0
    if form == "heavy_ball":
        return 1.0 - dampening, beta
    if form == "ema":
        return 1.0 - beta, beta
    if form == "nesterov":  # the authors' fosi_nesterov: (1+β)g₁ + β²v̄
        return 1.0 + beta, beta * beta
    raise ValueError(f"newton_momentum must be one of {NEWTON_MOMENTUM}, got {form!r}")


def _flat(t: Tensor) -> Tensor:
    if not t.is_contiguous():
        raise ValueError("FOSI needs contiguous parameters and gradients")
    return t.view(-1)


def _check_options(
    base: Optimizer,
    ese_batch: Any,
    *,
    k: int,
    l: int,  # noqa: E741
    alpha: float,
    eps: float,
    ese_period: int | None,
    ese_warmup: int | None,
    ese_schedule: str,
    ese_batch_mode: str,
    newton_momentum: str,
    on_ese_failure: str,
    reorth: str,
    hvp_mode: str,
) -> None:
    """Reject FOSI options outside their allowed values before anything is built (see :class:`FOSI`)."""
    if not isinstance(base, Optimizer):
        raise TypeError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")
    if isinstance(base, FOSI):
        raise TypeError("FOSI cannot wrap another FOSI")
    for name, value, allowed in (
        ("newton_momentum", newton_momentum, NEWTON_MOMENTUM),
        ("ese_schedule", ese_schedule, ESE_SCHEDULES),
        ("ese_batch_mode", ese_batch_mode, ESE_BATCH_MODES),
        ("on_ese_failure", on_ese_failure, FAILURE_MODES),
        ("reorth", reorth, REORTH_MODES),
        ("hvp_mode", hvp_mode, HVP_MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if k < 0 or l < 0 or k + l == 0:
        raise ValueError(f"need k ≥ 0, ℓ ≥ 0 and k + ℓ ≥ 1, got k={k}, ℓ={l}")
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite non-negative number, got {alpha}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps (the floor on |λ̂|) must be a finite positive number, got {eps}")
    if ese_period is not None and (
        isinstance(ese_period, bool) or int(ese_period) != ese_period or ese_period <= 0
    ):
        raise ValueError(
            f"ese_period must be a positive number of steps (or None for a single ESE), got {ese_period}"
        )
    if ese_warmup is not None and ese_warmup < 0:
        raise ValueError(f"ese_warmup must be >= 0 steps (or None: = ese_period), got {ese_warmup}")
    for group in base.param_groups:
        lr = group.get("lr")
        if isinstance(lr, float | int) and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"the base optimizer's lr must be a finite non-negative number, got {lr}")
    if ese_schedule == "released" and ese_period is None:
        raise ValueError("ese_schedule='released' needs a finite ese_period")
    if ese_batch_mode == "fixed" and ese_batch is None:
        raise ValueError("ese_batch_mode='fixed' needs an ese_batch")


def _resolve_lr_clip(base: Optimizer, lr_clip: float | None) -> float:
    """c, the cap of ``s = clip(|λ̂₁|/|λ̂_k|, 1, c)``: 3 by default, and 1 for Adam/AdamW.

    Adam's learning rate is never scaled (c = 1, as in the paper); another cap given for
    Adam/AdamW is overridden, with a warning.
    """
    is_adam = isinstance(base, _ADAM_FAMILY)
    if lr_clip is None:
        lr_clip = 1.0 if is_adam else 3.0
    if not lr_clip >= 1.0:  # NaN fails too
        raise ValueError(f"lr_clip (c) must be ≥ 1, got {lr_clip}")
    if is_adam and lr_clip != 1.0:
        log.warning(
            "FOSI: lr_clip=%s ignored for %s: Adam's learning rate is never scaled (c = 1)",
            lr_clip,
            type(base).__name__,
        )
        lr_clip = 1.0
    return float(lr_clip)


def _warn_if_weight_decay(base: Optimizer) -> None:
    """Coupled weight decay in the base changes the function optimised, which the ESE never sees."""
    if any(float(g.get("weight_decay", 0.0) or 0.0) != 0.0 for g in base.param_groups):
        log.warning(
            "FOSI: the base optimizer has weight_decay; put weight decay into the loss "
            "instead, or the ESE sees a different function than the one optimised "
            "(docs/decisions.md FOSI-S)"
        )


class FOSI(Optimizer):
    """FOSI around ``base`` (any ``torch.optim.Optimizer`` already built on the parameters).

    Hessian products: with ``model`` given, the ESE differentiates
    ``loss_fn(model(x), y)`` over ``ese_batch = (x, y)`` with respect to the base's parameters
    (which must be parameters of ``model``; other model parameters are held fixed). Without
    ``model``, ``loss_fn(params, batch)`` must be a functional loss of the list of the base's
    parameters (in ``param_groups`` order).

    The options are the flags of docs/fosi.md ("Flags"); their defaults are the paper's DNN
    settings, and docs/decisions.md (FOSI) gives the reasons where the paper is silent.

    Args:
        base: The base optimizer. FOSI shares its ``param_groups`` and ``state``; all its
            parameters must be contiguous, of one floating dtype and on one device.
        loss_fn: ``loss_fn(outputs, targets)`` with ``model``, else ``loss_fn(params, batch)``
            (see above); a scalar tensor.
        ese_batch: The batch the ESE differentiates on (``(x, y)`` with ``model``); required
            with ``ese_batch_mode='fixed'``.
        model: The module whose outputs ``loss_fn`` scores. With BatchNorm or dropout the ESE
            differentiates a copy whose BatchNorm uses batch statistics (no running statistics)
            and whose dropout is off; the live model is untouched (docs/decisions.md FOSI-N).
        k: Number of largest eigenpairs.
        l: Number of smallest eigenpairs (the paper's ℓ); ``k + l`` must be at least 1 and less
            than the number of parameters n.
        alpha: α, the learning rate of the Newton part (finite, ≥ 0).
        ese_period: T, the number of steps between ESEs; ``None``: a single ESE.
        ese_warmup: W, the step of the first ESE; ``None``: T (0 when T is ``None``).
        ese_schedule: ``paper`` (ESE before steps t = W, W+T, …) or ``released`` (the authors'
            DNN scripts: t = W+T−1, W+2T−1, …; needs a finite T).
        ese_batch_mode: ``fixed`` (always ``ese_batch``) or ``current`` (the ``batch`` passed to
            :meth:`step`).
        lr_clip: c, the cap of the base-step scale ``s = clip(|λ̂₁|/|λ̂_k|, 1, c)``, ≥ 1;
            ``None``: 1 for Adam/AdamW, else 3. Forced to 1 (with a warning) for Adam/AdamW.
        eps: ε, the floor on |λ̂| in ``u = 1/max(|λ̂|, ε)`` (finite, > 0).
        newton_momentum: Momentum form of the Newton part's velocity v̄: ``none`` (g₁),
            ``heavy_ball`` (g₁ + βv̄), ``ema`` ((1−β)g₁ + βv̄), ``nesterov`` ((1+β)g₁ + β²v̄), or
            ``auto``: the base's form (SGD: none, heavy ball or Nesterov from its settings;
            Adam/AdamW: ema; other bases: none).
        newton_beta: β of the Newton momentum, in [0, 1]; ``None``: the base's (Adam's β₁,
            SGD's momentum; 0.9 if the base has neither).
        num_iters: Lanczos iterations m; ``None``: ``max(4(k+ℓ), ⌈2 ln n⌉)`` capped at n.
        seed: Seed of the Lanczos start vector.
        fresh_start: ``False``: the same seeded start vector at every ESE (as the authors' JAX
            code); ``True``: a new vector from a generator seeded once with ``seed``.
        reorth: Lanczos re-orthogonalisation, ``partial``, ``dgks`` or ``twice`` (see
            :mod:`curvopt.curvature.lanczos`).
        hvp_mode: ``forward_over_reverse`` (``jvp(grad)``, the authors' mode) or
            ``reverse_over_reverse`` (double backward).
        hvp_reuse: Do the primal work once per ESE instead of once per Hessian-vector product.
        on_ese_failure: What a failed ESE (Lanczos error, non-finite eigenpairs) does: ``base``
            drops V̂ so FOSI runs the base optimizer until the next ESE, ``keep`` keeps the
            previous V̂, ``raise`` re-raises.
        debug: Check the symmetry of the Hessian operator at every ESE (2 extra products).
        fast_path: Allow the SGD fast path (module docstring); ``False`` forces the generic path.

    Attributes:
        base: The wrapped optimizer.
        t: Number of steps taken.
        ese_count: Number of successful ESEs.
        V: The eigenbasis V̂, a ``(k+ℓ, n)`` tensor whose rows are eigenvectors, or ``None``
            before the first ESE (and after a dropped one).
        eigenvalues: λ̂ in float64 on the CPU, ``[ℓ smallest ascending, k largest ascending]``,
            or ``None``.
        lambda_min: Lanczos' estimate of the smallest eigenvalue, or ``None``.
        scale: The current base-step scale s (1 while there is no V̂).
        last_info: The scalars describing the last step (see :meth:`step`).
        last_ese_error: Why the last ESE failed, or ``None``.

    Raises:
        TypeError: ``base`` is not a ``torch.optim.Optimizer``, or is a FOSI.
        ValueError: An option outside its allowed values or range, a base learning rate that is
            negative or not finite, no parameters, parameters of several dtypes or devices,
            complex parameters, or ``k + l`` not smaller than the number of parameters.

    Example:
        FOSI around heavy ball on a small classifier; the ESE runs before step ``ese_warmup``
        (= ``ese_period`` by default) and every ``ese_period`` steps after it:

        >>> import torch
        >>> from curvopt.optim import FOSI
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> opt = FOSI(base, loss_fn, (x, y), model=model, k=2, ese_period=2)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> opt.ese_count, opt.V.shape[0]
        (1, 2)

        Pickling FOSI (``copy.deepcopy`` always works) needs a ``loss_fn`` that pickle can
        import, e.g. a module-level function.
    """

    def __init__(
        self,
        base: Optimizer,
        loss_fn: Callable[..., Tensor],
        ese_batch: Any = None,
        *,
        model: nn.Module | None = None,
        k: int = 10,
        l: int = 0,  # noqa: E741
        alpha: float = 0.01,
        ese_period: int | None = 800,
        ese_warmup: int | None = None,
        ese_schedule: str = "paper",
        ese_batch_mode: str = "fixed",
        lr_clip: float | None = None,
        eps: float = 1e-8,
        newton_momentum: str = "auto",
        newton_beta: float | None = None,
        num_iters: int | None = None,
        seed: int = 0,
        fresh_start: bool = False,
        reorth: str = "partial",
        hvp_mode: str = "forward_over_reverse",
        hvp_reuse: bool = True,
        on_ese_failure: str = "base",
        debug: bool = False,
        fast_path: bool = True,
    ) -> None:
        _check_options(
            base,
            ese_batch,
            k=k,
            l=l,
            alpha=alpha,
            eps=eps,
            ese_period=ese_period,
            ese_warmup=ese_warmup,
            ese_schedule=ese_schedule,
            ese_batch_mode=ese_batch_mode,
            newton_momentum=newton_momentum,
            on_ese_failure=on_ese_failure,
            reorth=reorth,
            hvp_mode=hvp_mode,
        )
        self._initialising = True
        self.base = base
        super().__init__(base.param_groups, {})
        self._initialising = False
        # share the base's groups (lr schedulers, manual lr changes) and state (introspection)
        self.param_groups = base.param_groups
        self.state = base.state

        self.k, self.l, self.alpha, self.eps = int(k), int(l), float(alpha), float(eps)
        self.ese_period = ese_period
        self.ese_warmup = (ese_period or 0) if ese_warmup is None else int(ese_warmup)
        self.ese_schedule, self.ese_batch_mode = ese_schedule, ese_batch_mode
        self.num_iters, self.seed, self.fresh_start = num_iters, int(seed), bool(fresh_start)
        self.reorth, self.hvp_mode, self.hvp_reuse = reorth, hvp_mode, bool(hvp_reuse)
        self.on_ese_failure, self.debug, self.fast_path_enabled = on_ese_failure, bool(debug), bool(fast_path)
        self.ese_batch = ese_batch
        self.loss_fn = loss_fn
        self.model = model
        self._hvp_model = hvp_module(model) if model is not None else None

        self.lr_clip = _resolve_lr_clip(base, lr_clip)
        self._set_newton_momentum(newton_momentum, newton_beta)
        _warn_if_weight_decay(base)

        self._generator = torch.Generator(device="cpu").manual_seed(self.seed) if self.fresh_start else None
        self._forward_mode_checked = False
        self._set_lr_refs()
        self._layout()
        self.t = 0
        self.ese_count = 0
        self.last_ese_error: str | None = None
        self.last_info: dict[str, Any] = {}
        self._reset_basis_state()

    # -- setup -------------------------------------------------------------------------------------
    def _set_newton_momentum(self, form: str, beta: float | None) -> None:
        """The Newton velocity's form and β, and the coefficients of its update v̄ ← a_g·g₁ + a_v·v̄.

        Only the coefficients enter the step: between two ESEs the velocity is kept as V̂
        coefficients (module docstring), so its update must be linear with fixed (a_g, a_v).
        """
        self.newton_momentum, self.newton_beta = self._resolve_momentum(form, beta)
        group0 = self.base.param_groups[0]
        self._mom_ag, self._mom_av = _momentum_coefficients(
            self.newton_momentum,
            self.newton_beta,
            float(group0.get("dampening", 0.0)) if self.newton_momentum == "heavy_ball" else 0.0,
        )

    def _resolve_momentum(self, form: str, beta: float | None) -> tuple[str, float]:
        group = self.base.param_groups[0]
        if form == "auto":
            if isinstance(self.base, torch.optim.SGD):
                mom = float(group.get("momentum", 0.0))
                form = "none" if mom == 0.0 else ("nesterov" if group.get("nesterov") else "heavy_ball")
            elif isinstance(self.base, _ADAM_FAMILY):
                form = "ema"
            else:
                log.info(
                    "FOSI: no known momentum form for %s; Newton part without momentum",
                    type(self.base).__name__,
                )
                form = "none"
        if beta is None:
            if "betas" in group:
                beta = float(group["betas"][0])
            elif "momentum" in group:
                beta = float(group["momentum"])
            else:
                beta = 0.9
        if form != "none" and not 0.0 <= beta < 1.0 + 1e-12:
            raise ValueError(f"newton_beta must lie in [0, 1], got {beta}")
        return form, float(beta)

    def _set_lr_refs(self) -> None:
        """Give every group its reference lr (key :data:`LR_REF_KEY`) if it has none yet.

        The reference is the lr a scheduler started from (``initial_lr``) when one was already
        attached, else the group's lr when FOSI first sees the group. The Newton part of a group is
        scaled by ``lr / reference`` (see :meth:`step`).
        """
        for group in self.param_groups:
            if LR_REF_KEY not in group:
                group[LR_REF_KEY] = float(group.get("initial_lr", group["lr"]))

    def _lr_ratios(self) -> list[float]:
        """Per parameter (``_params`` order): ``lr / reference lr`` of its group (see :meth:`step`)."""
        ratios: list[float] = []
        for group in self.param_groups:
            lr = float(group["lr"])
            ref = float(group.get(LR_REF_KEY, lr))
            if lr == 0.0:
                ratio = 0.0
            elif ref == 0.0 or lr == ref:
                ratio = 1.0
            else:
                ratio = lr / ref
            ratios.extend([ratio] * len(group["params"]))
        return ratios

    def __getstate__(self) -> dict[str, Any]:
        """Everything FOSI holds (``copy.deepcopy`` and ``pickle``).

        ``torch.optim.Optimizer`` pickles only ``defaults``, ``state`` and ``param_groups``; FOSI
        also needs its base, step counter, eigenbasis, velocity and loss. Pickling needs a loss
        function (and a model) that pickle can import, e.g. defined at module level.
        """
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)

    def _layout(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("the base optimizer has no parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or not params[0].is_floating_point():
            raise ValueError(f"FOSI needs parameters of one floating dtype, got {sorted(map(str, dtypes))}")
        if len(devices) != 1:
            raise ValueError(f"FOSI needs all parameters on one device, got {sorted(map(str, devices))}")
        self._params = params
        self._dtype, self._device = params[0].dtype, params[0].device
        self._sizes = [p.numel() for p in params]
        self.n = sum(self._sizes)
        if self.k + self.l >= self.n:
            raise ValueError(
                f"k + ℓ = {self.k + self.l} must be smaller than the number of parameters n = {self.n}"
            )
        if self.model is not None:
            self._named = named_subset(self.model, params)
        else:
            self._named = {str(i): p for i, p in enumerate(params)}
        self._old: list[Tensor] | None = None

    def _reset_basis_state(self) -> None:
        r = self.k + self.l
        self.V: Tensor | None = None
        self._blocks: list[Tensor] = []
        self.u: Tensor | None = None
        self.eigenvalues: Tensor | None = None  # float64, [ℓ smallest asc, k largest asc]
        self.lambda_min: float | None = None
        self.scale = 1.0
        self._vel_res: Tensor | None = None
        self._vel_res_scale = 0.0
        self._vel_res_proj = torch.zeros(r, dtype=self._dtype, device=self._device)
        self._vel_coef = torch.zeros(r, dtype=self._dtype, device=self._device)
        self._mom_proj = torch.zeros(r, dtype=self._dtype, device=self._device)  # y = V̂m (true buffer)
        self._mom_proj_fed = torch.zeros(r, dtype=self._dtype, device=self._device)  # w = V̂m′ (base's)
        self._buffers_offset = False  # the base's buffers hold m′ = m + V̂ᵀ(w − y)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the base optimizer (``torch.optim.Optimizer`` semantics).

        The eigenbasis no longer covers every parameter, so it is dropped (with a warning) and
        FOSI runs the base optimizer until the next ESE.

        Args:
            param_group: The group, as for ``torch.optim.Optimizer.add_param_group``.

        Raises:
            ValueError: The parameters no longer share one dtype and device, or ``k + ℓ`` is no
                longer smaller than their number.
        """
        if getattr(self, "_initialising", True):
            super().add_param_group(param_group)
            return
        self.base.add_param_group(param_group)
        self.param_groups = self.base.param_groups
        self._set_lr_refs()
        log.warning("FOSI: parameter group added; the eigenbasis is dropped until the next ESE")
        self._layout()
        self._reset_basis_state()

    # -- schedule ----------------------------------------------------------------------------------
    def ese_due(self, t: int | None = None) -> bool:
        """Whether an ESE runs before the update of step ``t``.

        Args:
            t: The 0-based step index; ``None``: the next step (:attr:`t`).

        Returns:
            ``True`` on the schedule's ESE steps (see ``ese_schedule``).
        """
        t = self.t if t is None else t
        T, W = self.ese_period, self.ese_warmup
        if self.ese_schedule == "released":
            return max(1, t + 1 - W) % T == 0
        if t < W:
            return False
        return t == W if T is None else (t - W) % T == 0

    # -- ESE ---------------------------------------------------------------------------------------
    def _hvp(
        self, batch: Any, mode: str | None = None, reuse: bool | None = None
    ) -> Callable[[Tensor], Tensor]:
        mode = self.hvp_mode if mode is None else mode
        reuse = self.hvp_reuse if reuse is None else reuse
        if self.model is not None:
            return make_flat_hvp(self._hvp_model, self.loss_fn, self._named, batch, mode, reuse)
        names, loss_fn = list(self._named), self.loss_fn

        def loss_of(p: dict[str, Tensor]) -> Tensor:
            return loss_fn([p[nm] for nm in names], batch)

        return flat_hvp(loss_of, self._named, mode, reuse)

    def _check_forward_mode(self, batch: Any) -> None:
        """Before the first forward-over-reverse ESE, try one plain ``jvp(grad)`` product.

        Some losses have no working forward-mode derivative of their backward in torch:
        ``F.mse_loss`` raises "ZeroTensors are immutable" under ``jvp(grad)``, and under
        ``torch.func.linearize`` (the ``hvp_reuse`` path) the same bug kills the process with a
        segmentation fault, which no ``except`` can catch. One eager product, which raises instead,
        tells the two apart; on failure FOSI switches to ``reverse_over_reverse`` (double backward:
        the same Hessian) for good, with a warning. The probe runs once per optimizer and is left
        out of the ESE's time; its product is discarded, so the Lanczos run is unchanged.
        """
        if self._forward_mode_checked or self.hvp_mode != "forward_over_reverse" or batch is None:
            return
        probe = torch.ones(self.n, dtype=self._dtype, device=self._device)
        try:
            self._hvp(batch, "forward_over_reverse", reuse=False)(probe)
        except (RuntimeError, NotImplementedError) as err:
            log.warning(
                "FOSI: forward-mode Hessian products fail for this loss, a known torch gap (e.g. "
                "F.mse_loss) [%s: %s]; using hvp_mode='reverse_over_reverse' (double backward) instead",
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )
            self.hvp_mode = "reverse_over_reverse"
        self._forward_mode_checked = True

    @torch.compiler.disable
    def run_ese(self, batch: Any = None) -> LanczosResult | None:
        """Estimate the extreme eigenpairs at the current parameters and install them.

        Never traced by ``torch.compile`` (Lanczos is host-synchronising Python control flow; a
        compiled :meth:`step` runs it eagerly).

        Args:
            batch: The batch to differentiate on with ``ese_batch_mode='current'``; ignored in
                ``fixed`` mode (``ese_batch`` is used).

        Returns:
            The Lanczos result, or ``None`` when the ESE failed and ``on_ese_failure`` is
            ``base`` or ``keep`` (the reason is in :attr:`last_ese_error`).

        Raises:
            ValueError: ``ese_batch_mode='current'`` and no ``batch``.
            LanczosError: The ESE failed and ``on_ese_failure='raise'``.
        """
        ese_batch = self.ese_batch if self.ese_batch_mode == "fixed" else batch
        if ese_batch is None:
            raise ValueError("ese_batch_mode='current' needs the batch: call step(batch=...)")
        self._check_forward_mode(ese_batch)
        try:
            result = lanczos(
                self._hvp(ese_batch),
                self.n,
                self.k,
                self.l,
                num_iters=self.num_iters,
                operator_dtype=self._dtype,
                device=self._device,
                seed=self.seed,
                generator=self._generator,
                reorth=self.reorth,
                symmetry_check=self.debug,
            )
            if not (torch.isfinite(result.eigenvalues).all() and torch.isfinite(result.eigenvectors).all()):
                raise LanczosError("ESE produced non-finite eigenvalues or eigenvectors")
        except LanczosError as err:
            self.last_ese_error = str(err)
            action = {
                "base": "falling back to the base optimizer until the next ESE",
                "keep": "keeping the previous eigenbasis",
                "raise": "raising",
            }[self.on_ese_failure]
            log.warning("FOSI: ESE before step %d failed: %s; %s", self.t, err, action)
            if self.on_ese_failure == "raise":
                raise
            if self.on_ese_failure == "base":
                self._install(None, None, None)
            return None
        self.last_ese_error = None
        self._install(result.eigenvectors.to(self._dtype).contiguous(), result.eigenvalues, result)
        self.ese_count += 1
        return result

    def set_basis(self, eigenvectors: Tensor, eigenvalues: Tensor) -> None:
        """Install a given eigenbasis instead of running Lanczos.

        For tests, and quadratics where the eigenpairs are known. The Newton velocity carries
        over as at an ESE.

        Args:
            eigenvectors: ``(k+ℓ, n)``; row i is the eigenvector of ``eigenvalues[i]`` (copied).
            eigenvalues: ``(k+ℓ,)`` tensor or sequence of floats, ordered ``[ℓ smallest
                ascending, k largest ascending]`` (read on the host once, as at an ESE).

        Raises:
            ValueError: The shapes are not ``(k+ℓ, n)`` and ``(k+ℓ,)``.
        """
        r = self.k + self.l
        lam_shape = tuple(eigenvalues.shape) if isinstance(eigenvalues, Tensor) else (len(eigenvalues),)
        if eigenvectors.shape != (r, self.n) or lam_shape != (r,):
            raise ValueError(f"expected eigenvectors ({r}, {self.n}) and eigenvalues ({r},)")
        self._install(eigenvectors.detach().clone().to(self._dtype).contiguous(), eigenvalues, None)

    @torch.no_grad()
    def _sync_base_buffers(self) -> None:
        """Turn the SGD fast path's buffers m′ = m + V̂ᵀ(w − y) back into the true m (one pass)."""
        if not self._buffers_offset:
            return
        z = self._mom_proj_fed - self._mom_proj
        if self.V is not None and bool(z.any()):
            for b, p in zip(self._blocks, self._params):
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    _flat(buf).addmv_(b.T, z, alpha=-1.0)
        self._mom_proj_fed = self._mom_proj.clone()
        self._buffers_offset = False

    @torch.no_grad()
    def _install(self, V: Tensor | None, lam: Any, result: LanczosResult | None) -> None:
        """Install a basis (at an ESE, a load or :meth:`set_basis`: the only host reads of FOSI).

        ``lam`` (a tensor or a sequence of floats) is read on the host here, once: the scale s and
        the logged eigenvalues are Python floats from then on, so the steps between two ESEs
        read nothing.
        """
        self._sync_base_buffers()
        # materialise the velocity v̄ = ρ r + V_oldᵀ a before the basis changes
        vel = None
        if self._mom_av != 0.0 and self.V is not None:
            vel = self.V.T @ self._vel_coef
            if self._vel_res is not None and self._vel_res_scale != 0.0:
                vel.add_(self._vel_res, alpha=self._vel_res_scale)
        elif self._mom_av != 0.0 and self._vel_res is not None:
            vel = self._vel_res * self._vel_res_scale
        r = self.k + self.l
        zeros = torch.zeros(r, dtype=self._dtype, device=self._device)
        self._vel_res, self._vel_res_scale = vel, (1.0 if vel is not None else 0.0)
        self._vel_coef = zeros.clone()
        if V is None:
            self.V, self._blocks, self.u, self.scale = None, [], None, 1.0
            self.eigenvalues, self.lambda_min = None, None
            self._vel_res_proj = zeros.clone()
            self._mom_proj = zeros.clone()
            self._mom_proj_fed = zeros.clone()
            return
        self.V = V
        self._blocks = list(torch.split(V, self._sizes, dim=1))
        values = [float(v) for v in (lam.tolist() if isinstance(lam, Tensor) else lam)]  # one host read
        self._lam_values = values
        self.eigenvalues = torch.tensor(values, dtype=torch.float64)
        # u = 1/max(|λ̂|, ε) in float64, then the parameters' dtype (the same rounding as on a tensor)
        self.u = torch.tensor(
            [1.0 / max(abs(v), self.eps) for v in values], dtype=self._dtype, device=self._device
        )
        if self.k > 0:
            ratio = abs(values[-1]) / max(abs(values[self.l]), 1e-300)
            self.scale = float(min(max(ratio, 1.0), self.lr_clip))
        else:
            self.scale = 1.0
        self.lambda_min = float(result.lambda_min) if result is not None else min(values)
        self._vel_res_proj = self._project(vel) if vel is not None else zeros.clone()
        self._mom_proj = zeros.clone()
        if self._fast_path_kind() in ("heavy_ball", "nesterov"):
            bufs = [self.state.get(p, {}).get("momentum_buffer") for p in self._params]
            for b, buf in zip(self._blocks, bufs):
                if buf is not None:
                    self._mom_proj.addmv_(b, _flat(buf))
        self._mom_proj_fed = self._mom_proj.clone()

    def _project(self, vec: Tensor) -> Tensor:
        return self.V @ vec

    # -- the update --------------------------------------------------------------------------------
    def _fast_path_kind(self) -> str | None:
        """``gd`` / ``heavy_ball`` / ``nesterov`` when the SGD fast path applies, else ``None``."""
        if not self.fast_path_enabled or type(self.base) is not torch.optim.SGD:
            return None
        keys = ("lr", "momentum", "dampening", "nesterov")
        g0 = self.param_groups[0]
        for g in self.param_groups:
            if isinstance(g["lr"], Tensor) or any(g.get(key) != g0.get(key) for key in keys):
                return None
            if float(g.get("weight_decay", 0.0) or 0.0) != 0.0 or g.get("maximize", False):
                return None
        if float(g0.get("momentum", 0.0)) == 0.0:
            return "gd"
        return "nesterov" if g0.get("nesterov") else "heavy_ball"

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None, *, batch: Any = None) -> Tensor | None:  # type: ignore[override]
        """One FOSI step on the gradients in ``p.grad``; an ESE first when one is due.

        Before the first ESE (or after a dropped one) this is ``base.step()`` and nothing else.
        After a FOSI update ``p.grad`` holds g₂ (generic path) or g (SGD fast path).

        As for any ``torch.optim`` optimizer:

        * a parameter whose ``.grad`` is ``None`` (frozen, or unused by the loss) counts as
          g = 0 in V̂g, is not moved and gets no ``.grad``;
        * a group whose lr is 0 is not moved (the base does not move it, and neither the Newton
          part nor the projection of the other groups' steps is applied to it);
        * the whole step is linear in the lr: the Newton part of a group, α·V̂ diag(u) V̂ᵀv̄ in
          the paper (where α is a constant of its own), is multiplied by ``lr / lr_ref``, with
          ``lr_ref`` the group's reference lr (kept in the group under ``"fosi_lr_ref"``: the
          ``initial_lr`` of a scheduler attached before FOSI, else the group's lr when FOSI
          first saw it). With a constant lr the factor is 1 and the update is the paper's; a
          scheduler (warm-up, decay, StepLR) scales the base step and the Newton step alike, so
          α keeps its meaning as the Newton step at the reference lr. A group whose reference
          lr is 0 keeps α unscaled once its lr becomes positive.

        Args:
            closure: Recomputes the loss and the gradients (run with gradients enabled), as for
                any ``torch.optim`` optimizer; ``None``: the gradients are already in ``p.grad``.
            batch: The current mini-batch, needed only with ``ese_batch_mode='current'``.

        Returns:
            The closure's loss, or ``None`` without a closure. The scalars describing the step
            are left in :attr:`last_info`: ``lr``, ``lr_scale`` (s), ``ese_ran``, ``ese_failed``,
            ``ese_time_s``, ``ese_count``, ``fosi_active``, ``lanczos_iters`` (when an ESE ran),
            ``lambda_max``, ``lambda_k``, ``lambda_min`` (once there are eigenvalues) and
            ``loss`` (with a closure).

        Raises:
            ValueError: A parameter or gradient is not contiguous, or ``batch`` is missing in
                ``current`` mode when an ESE is due.
            RuntimeError: A gradient is sparse (nothing is changed).
            LanczosError: An ESE failed and ``on_ese_failure='raise'``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(p.grad is not None and p.grad.is_sparse for p in self._params):
            raise RuntimeError(
                "FOSI does not support sparse gradients (V̂g and the projections are dense); nothing "
                "was changed"
            )
        ese = self._ese_if_due(batch)
        if self.V is None:
            self.base.step()
        else:
            self._fosi_update()
        self.t += 1
        self.last_info = self._step_info(ese, loss)
        return loss

    def _ese_if_due(self, batch: Any) -> dict[str, Any]:
        """The ESE before this step's update, when the schedule (Algorithm 2) has one due.

        The one-time forward-mode probe runs first and is left out of the ESE's time.

        Returns:
            ``ese_ran``, ``ese_failed``, ``ese_time_s`` and, when an ESE ran, ``lanczos_iters``.
        """
        if not self.ese_due():
            return {"ese_ran": 0, "ese_failed": 0, "ese_time_s": 0.0}
        if not self._forward_mode_checked and self.hvp_mode == "forward_over_reverse":
            self._check_forward_mode(self.ese_batch if self.ese_batch_mode == "fixed" else batch)
        t0 = time.perf_counter()
        result = self.run_ese(batch)
        ese_time = time.perf_counter() - t0
        return {
            "ese_ran": 1,
            "ese_failed": int(result is None),
            "ese_time_s": ese_time,
            "lanczos_iters": result.iterations if result is not None else 0,
        }

    def _step_info(self, ese: dict[str, Any], loss: Tensor | None) -> dict[str, Any]:
        """The scalars :attr:`last_info` describes (see :meth:`step`), after the update."""
        info: dict[str, Any] = {
            "lr": float(self.param_groups[0]["lr"]),
            "lr_scale": self.scale,
            "ese_ran": ese["ese_ran"],
            "ese_failed": ese["ese_failed"],
            "ese_time_s": ese["ese_time_s"],
            "ese_count": self.ese_count,
            "fosi_active": int(self.V is not None),
        }
        if ese["ese_ran"]:
            info["lanczos_iters"] = ese["lanczos_iters"]
        if self.eigenvalues is not None:  # host floats, read once at the ESE (_install)
            values = getattr(self, "_lam_values", None) or self.eigenvalues.tolist()
            info["lambda_max"] = values[-1] if self.k > 0 else float("nan")
            info["lambda_k"] = values[self.l] if self.k > 0 else float("nan")
            info["lambda_min"] = float(self.lambda_min)
        if loss is not None:
            info["loss"] = float(loss)
        return info

    def _fosi_update(self) -> None:
        params, blocks = self._params, self._blocks
        # a parameter without a gradient (frozen, or unused by the loss) counts as g = 0 and is
        # not moved; nor is a parameter of a group with lr 0 (see step)
        grads = [None if p.grad is None else _flat(p.grad) for p in params]
        ratios = self._lr_ratios()
        moved = [g is not None and r != 0.0 for g, r in zip(grads, ratios)]
        c = torch.zeros(self.k + self.l, dtype=self._dtype, device=self._device)
        for b, g in zip(blocks, grads):  # c = V̂g
            if g is not None:
                c.addmv_(b, g)
        # Newton part on the velocity's coefficients: V̂v̄ = a + ρ·V̂r
        self._vel_coef.mul_(self._mom_av).add_(c, alpha=self._mom_ag)
        self._vel_res_scale *= self._mom_av
        vproj = self._vel_coef.clone()
        if self._vel_res is not None and self._vel_res_scale != 0.0:
            vproj.add_(self._vel_res_proj, alpha=self._vel_res_scale)
        coef = vproj.mul_(self.u).mul_(-self.alpha)  # V̂ coefficients of d₁
        # the Newton part follows the lr schedule: lr / (reference lr) per group (step docstring)
        newton = coef.clone() if any(r not in (0.0, 1.0) for r in ratios) else None
        s = self.scale
        # the SGD fast path feeds the base every gradient; without one for some parameter the
        # base would skip it and the coefficient bookkeeping would not hold: generic path
        kind = self._fast_path_kind() if all(g is not None for g in grads) else None
        if kind is not None:
            self._fast_sgd_step(kind, c, coef, s)
        else:
            self._sync_base_buffers()
            for b, g in zip(blocks, grads):  # g₂ = g − V̂ᵀc in place: the base sees g₂ only
                if g is not None:
                    g.addmv_(b.T, c, alpha=-1.0)
            old = self._old  # a local: torch.compile (2.13) can read a just-set attribute as stale
            if old is None:
                old = [torch.empty_like(p) for p in params]
                self._old = old
            torch._foreach_copy_(old, [p.detach() for p in params])
            self.base.step()
            torch._foreach_sub_(old, [p.detach() for p in params])  # old = −d_b
            e_neg = torch.zeros_like(c)
            for b, d in zip(blocks, old):
                e_neg.addmv_(b, _flat(d))
            if s != 1.0:
                torch._foreach_add_([p.detach() for p in params], old, alpha=-(s - 1.0))
            coef.add_(e_neg, alpha=s)  # s·d₂ = s·d_b − s·V̂ᵀV̂d_b
        scaled: dict[float, Tensor] = {1.0: coef}
        for b, p, r, move in zip(blocks, params, ratios, moved):
            if not move:
                continue
            if r not in scaled:  # coef + (r − 1)·d₁-coefficients: the Newton part at r·α
                assert newton is not None
                scaled[r] = coef.add(newton, alpha=r - 1.0)
            _flat(p.detach()).addmv_(b.T, scaled[r])

    def _fast_sgd_step(self, kind: str, c: Tensor, coef: Tensor, s: float) -> None:
        """``torch.optim.SGD`` fed the full g, corrected inside span(V̂) (see the module docstring).

        ``coef`` gets the V̂-coefficients that turn the base's step into s·(d_b − V̂V̂ᵀd_b) for
        the step on g₂.
        """
        group = self.param_groups[0]
        lr = float(group["lr"])
        first_step = self.state.get(self._params[0], {}).get("momentum_buffer") is None
        lrs = [g["lr"] for g in self.param_groups]
        try:
            if s != 1.0:
                for g in self.param_groups:
                    g["lr"] = g["lr"] * s
            self.base.step()
        finally:
            for g, old_lr in zip(self.param_groups, lrs):
                g["lr"] = old_lr
        if kind == "gd":  # θ′ = θ − s·lr·g; true step −s·lr·g₂ ⟂ V̂
            coef.add_(c, alpha=s * lr)
            return
        beta, damp = float(group["momentum"]), float(group.get("dampening", 0.0))
        y, w = self._mom_proj, self._mom_proj_fed
        if first_step:  # torch starts the buffer at the gradient itself
            y.zero_()
            w.copy_(c)
        else:
            y.mul_(beta)  # V̂m ← βV̂m + (1−δ)V̂g₂, V̂g₂ = 0
            w.mul_(beta).add_(c, alpha=1.0 - damp)
        self._buffers_offset = True
        if kind == "heavy_ball":  # θ′ = θ − s·lr·m′; wanted θ − s·lr·(m − V̂ᵀy)
            coef.add_(w, alpha=s * lr)
        else:  # Nesterov: θ′ = θ − s·lr·(g + βm′); wanted θ − s·lr·(g₂ + βm − βV̂ᵀy)
            coef.add_(c, alpha=s * lr).add_(w, alpha=s * lr * beta)

    # -- (de)serialisation -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The base's state (holding the *true* momentum buffers m) and FOSI's.

        Taking it changes nothing: on the SGD fast path the base's live buffers
        m′ = m + V̂ᵀ(w − y) stay as they are; the saved base state gets corrected copies (what the
        generic path would hold), and the live m′ and w are saved beside them so that a load
        continues bit for bit.

        Returns:
            ``torch.optim``'s layout, the base's ``{"state": ..., "param_groups": ...}``, with one
            extra key ``"fosi"`` holding the step counter, ESE count, V̂, λ̂, the Newton velocity,
            the fast path's projections, the HVP mode in use and the start vector generator's
            state. Just before an ESE step that replaces V̂ (``on_ese_failure`` not ``keep``), V̂
            is left out and the Newton velocity saved materialised (``basis_dropped_before_ese``):
            a run stopped at an ESE boundary has a (k+ℓ)× smaller FOSI checkpoint. Only tensors
            and plain Python values: it loads with ``torch.load(..., weights_only=True)``.
        """
        base = self.base.state_dict()
        fed: dict[int, Tensor] = {}
        if self._buffers_offset and self.V is not None:
            z = self._mom_proj_fed - self._mom_proj
            state = dict(base["state"])
            for i, (b, p) in enumerate(zip(self._blocks, self._params)):  # packed ids: _params order
                entry = state.get(i)
                buf = entry.get("momentum_buffer") if entry is not None else None
                if buf is None or buf is not self.state.get(p, {}).get("momentum_buffer"):
                    continue
                fed[i] = buf.clone()
                true = buf.clone()
                if bool(z.any()):
                    _flat(true).addmv_(b.T, z, alpha=-1.0)  # exactly what _sync_base_buffers does
                state[i] = {**entry, "momentum_buffer": true}
            base = {**base, "state": state}
        if self._basis_replaced_next_step():  # the true buffers suffice: no fed buffers, no V̂
            return {**base, "fosi": self._state_before_ese()}
        fosi = {
            "t": self.t,
            "ese_count": self.ese_count,
            "V": self.V,
            "eigenvalues": self.eigenvalues,
            "lambda_min": self.lambda_min,
            "vel_res": self._vel_res,
            "vel_res_scale": self._vel_res_scale,
            "vel_res_proj": self._vel_res_proj,
            "vel_coef": self._vel_coef,
            "mom_proj": self._mom_proj,
            "generator": self._generator.get_state() if self._generator is not None else None,
            "hvp_mode": self.hvp_mode,
            "forward_mode_checked": self._forward_mode_checked,
        }
        if fed:
            fosi["fed_buffers"] = fed
            fosi["mom_proj_fed"] = self._mom_proj_fed.clone()
        return {**base, "fosi": fosi}

    def _basis_replaced_next_step(self) -> bool:
        """Whether the next step's ESE replaces V̂ before anything reads it.

        Then a state dict need not hold V̂ (k+ℓ parameter-sized vectors), only what the ESE
        carries over.
        """
        return self.V is not None and self.on_ese_failure != "keep" and self.ese_due()

    def _state_before_ese(self) -> dict[str, Any]:
        """FOSI's part of a state dict taken just before an ESE step, without V̂.

        The next step's ESE (:meth:`_install`) reads the old basis only to materialise the Newton
        velocity v̄ = ρ·r + V̂ᵀa and to turn the base's buffers back into the true momentum m.
        This state holds v̄ itself (one parameter-sized vector instead of k+ℓ) and the base's part
        of the state dict holds the true buffers, so a load continues bit for bit (tested), and the checkpoint of a
        run stopped at an ESE boundary is (k+ℓ)× smaller in its FOSI part.
        """
        vel = None
        if self._mom_av != 0.0:  # the same expression as _install's, in the same order
            vel = self.V.T @ self._vel_coef
            if self._vel_res is not None and self._vel_res_scale != 0.0:
                vel.add_(self._vel_res, alpha=self._vel_res_scale)
        zeros = torch.zeros(self.k + self.l, dtype=self._dtype, device=self._device)
        return {
            "t": self.t,
            "ese_count": self.ese_count,
            "V": None,
            "eigenvalues": None,
            "lambda_min": None,
            "vel_res": vel,
            "vel_res_scale": 1.0 if vel is not None else 0.0,
            "vel_res_proj": zeros,
            "vel_coef": zeros.clone(),
            "mom_proj": zeros.clone(),
            "generator": self._generator.get_state() if self._generator is not None else None,
            "hvp_mode": self.hvp_mode,
            "forward_mode_checked": self._forward_mode_checked,
            "basis_dropped_before_ese": True,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore the base's and FOSI's state from :meth:`state_dict`'s output.

        Tensors are moved to the parameters' device and dtype; the run continues bit for bit.

        Args:
            state_dict: A dict as returned by :meth:`state_dict` (of a FOSI over the same
                parameters and options); the layout of earlier versions,
                ``{"base": base.state_dict(), "fosi": {...}}``, is accepted too.

        Raises:
            ValueError: ``state_dict`` lacks the base optimizer's part or the ``fosi`` part.
        """
        if "fosi" in state_dict and "base" in state_dict:  # the layout before torch's
            base_sd = state_dict["base"]
        elif "fosi" in state_dict and "state" in state_dict and "param_groups" in state_dict:
            base_sd = {k: v for k, v in state_dict.items() if k != "fosi"}
        else:
            raise ValueError("not a FOSI state dict (needs 'state', 'param_groups' and 'fosi')")
        self.base.load_state_dict(base_sd)
        # torch rebuilds the group dicts on load: re-link them
        self.param_groups = self.base.param_groups
        self.state = self.base.state
        self._set_lr_refs()
        fs = state_dict["fosi"]
        if fs.get("forward_mode_checked") and self.hvp_mode == "forward_over_reverse":
            # the saved run already probed forward mode (and fell back if it failed)
            self.hvp_mode = str(fs.get("hvp_mode", self.hvp_mode))
            self._forward_mode_checked = True
        self.t, self.ese_count = int(fs["t"]), int(fs["ese_count"])
        dev, dt = self._device, self._dtype

        def to(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.to(device=dev, dtype=dt)

        self._reset_basis_state()
        V = to(fs["V"])
        if V is not None:
            lam = fs["eigenvalues"].double()
            self._install(V.contiguous(), lam, None)
            self.lambda_min = fs.get("lambda_min", self.lambda_min)
        self._vel_res = to(fs["vel_res"])
        self._vel_res_scale = float(fs["vel_res_scale"])
        self._vel_res_proj = to(fs["vel_res_proj"])
        self._vel_coef = to(fs["vel_coef"])
        self._mom_proj = to(fs["mom_proj"])
        self._mom_proj_fed = self._mom_proj.clone()  # the base state holds true buffers (w = y)
        if self._generator is not None and fs.get("generator") is not None:
            self._generator.set_state(fs["generator"])
        if fs.get("fed_buffers") and self.V is not None:  # the fast path's live buffers m′, exactly
            for i, buf in fs["fed_buffers"].items():
                live = self.state.get(self._params[int(i)], {}).get("momentum_buffer")
                if live is not None:
                    live.copy_(buf)
            self._mom_proj_fed = to(fs["mom_proj_fed"])
            self._buffers_offset = True


# -- ready-made FOSI variants -----------------------------------------------------------------------
# The three factories share one signature, FOSI's own order: (params, loss_fn, ese_batch, lr, <the
# base's options>, **FOSI options); everything after ``params`` can be given by keyword. FOSI-HB and
# FOSI-GD used to take ``lr`` second, ``(params, lr, loss_fn, ese_batch, momentum)``: a number in the
# ``loss_fn`` slot is read in that old order (with a DeprecationWarning).


def _is_lr(value: Any) -> bool:
    return isinstance(value, int | float | Tensor) and not isinstance(value, bool) and not callable(value)


def _old_order(
    name: str, loss_fn: Any, ese_batch: Any, lr: Any
) -> tuple[Callable[..., Tensor], Any, float | None]:
    """Map a call in the old order ``(params, lr, loss_fn, ese_batch, ...)`` to the new slots.

    In the new signature the old arguments land one slot off: ``loss_fn`` holds the lr,
    ``ese_batch`` the loss and ``lr`` the ESE batch (``None`` when it was not given).
    """
    if not _is_lr(loss_fn):
        return loss_fn, ese_batch, lr
    warnings.warn(
        f"{name}(params, lr, loss_fn, ese_batch, ...) is the old argument order; use "
        f"{name}(params, loss_fn, ese_batch, lr=...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return ese_batch, lr, loss_fn


def _check_loss_fn(name: str, loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"{name}: loss_fn must be callable, got {type(loss_fn).__name__}")


def fosi_heavy_ball(
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any = None,
    lr: float | None = None,
    momentum: float = 0.9,
    **kwargs: Any,
) -> FOSI:
    """FOSI-HB: heavy ball (``torch.optim.SGD(momentum=β)``) as the base, HB-form Newton momentum.

    Args:
        params: The parameters (or parameter groups) to optimize.
        loss_fn: The loss (see :class:`FOSI`).
        ese_batch: The ESE batch (see :class:`FOSI`).
        lr: The heavy-ball learning rate η (``None``: 0.01, the config default).
        momentum: Heavy-ball momentum β.
        **kwargs: Further :class:`FOSI` options (``model``, ``k``, ``alpha``, ...).

    Returns:
        The FOSI optimizer.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: As :class:`FOSI` and ``torch.optim.SGD`` (a negative or non-finite lr, ...).

    Example:
        >>> import torch
        >>> from curvopt.optim import fosi_heavy_ball
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> opt = fosi_heavy_ball(model.parameters(), loss_fn, (x, y), lr=0.1, model=model, k=2, ese_period=2)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> opt.ese_count
        1
    """
    loss_fn, ese_batch, lr = _old_order("fosi_heavy_ball", loss_fn, ese_batch, lr)
    _check_loss_fn("fosi_heavy_ball", loss_fn)
    lr = 0.01 if lr is None else lr
    return FOSI(torch.optim.SGD(params, lr=lr, momentum=momentum), loss_fn, ese_batch, **kwargs)


def fosi_adam(
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    **kwargs: Any,
) -> FOSI:
    """FOSI-Adam: ``torch.optim.Adam`` as the base, EMA Newton momentum, c = 1.

    Args:
        params: The parameters (or parameter groups) to optimize.
        loss_fn: The loss (see :class:`FOSI`).
        ese_batch: The ESE batch (see :class:`FOSI`).
        lr: Adam's learning rate.
        betas: Adam's (β₁, β₂); β₁ is also the Newton momentum's β.
        eps: Adam's ε (not FOSI's ``eps``, which goes in ``kwargs``).
        **kwargs: Further :class:`FOSI` options (``model``, ``k``, ``alpha``, ...).

    Returns:
        The FOSI optimizer.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: As :class:`FOSI` and ``torch.optim.Adam`` (lr, betas or eps out of range).

    Example:
        >>> import torch
        >>> from curvopt.optim import fosi_adam
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> opt = fosi_adam(model.parameters(), loss_fn, (x, y), lr=1e-2, model=model, k=2, ese_period=2)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> opt.ese_count
        1
    """
    _check_loss_fn("fosi_adam", loss_fn)
    return FOSI(torch.optim.Adam(params, lr=lr, betas=tuple(betas), eps=eps), loss_fn, ese_batch, **kwargs)


def fosi_gd(
    params: Iterable[Any],
    loss_fn: Callable[..., Tensor],
    ese_batch: Any = None,
    lr: float | None = None,
    **kwargs: Any,
) -> FOSI:
    """FOSI-GD: plain gradient descent (``torch.optim.SGD``) as the base, no Newton momentum.

    Args:
        params: The parameters (or parameter groups) to optimize.
        loss_fn: The loss (see :class:`FOSI`).
        ese_batch: The ESE batch (see :class:`FOSI`).
        lr: The gradient-descent learning rate η (``None``: 0.01, the config default).
        **kwargs: Further :class:`FOSI` options (``model``, ``k``, ``alpha``, ...).

    Returns:
        The FOSI optimizer.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: As :class:`FOSI` and ``torch.optim.SGD``.

    Example:
        >>> import torch
        >>> from curvopt.optim import fosi_gd
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> loss_fn = torch.nn.functional.cross_entropy
        >>> opt = fosi_gd(model.parameters(), loss_fn, (x, y), lr=0.1, model=model, k=2, ese_period=2)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     loss = loss_fn(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> opt.ese_count
        1
    """
    loss_fn, ese_batch, lr = _old_order("fosi_gd", loss_fn, ese_batch, lr)
    _check_loss_fn("fosi_gd", loss_fn)
    lr = 0.01 if lr is None else lr
    return FOSI(torch.optim.SGD(params, lr=lr), loss_fn, ese_batch, **kwargs)


def make_base_optimizer(
    name: str,
    params: Iterable[Any],
    lr: float,
    momentum: float = 0.9,
    betas: Sequence[float] = (0.9, 0.999),
    adam_eps: float = 1e-8,
    weight_decay: float = 0.0,
    fused: bool | None = True,
) -> Optimizer:
    """One of the paper's base optimizers, by name.

    Adam is the fused kernel by default, as the repo's ``optimizer=adam`` baseline, so FOSI-Adam
    and Adam are timed with the same implementation.

    Args:
        name: ``heavy_ball`` (``torch.optim.SGD`` with momentum), ``adam`` (``torch.optim.Adam``)
            or ``gd`` (``torch.optim.SGD`` without momentum); see :data:`BASES`.
        params: The parameters (or parameter groups) to optimize.
        lr: The learning rate.
        momentum: Heavy-ball momentum (``heavy_ball`` only).
        betas: Adam's (β₁, β₂) (``adam`` only).
        adam_eps: Adam's ε (``adam`` only).
        weight_decay: The optimizer's (coupled) weight decay; FOSI warns, since the ESE does not
            see it (docs/decisions.md FOSI-S).
        fused: Adam's ``fused`` flag; ``None`` lets torch choose.

    Returns:
        The optimizer.

    Raises:
        ValueError: ``name`` is not one of :data:`BASES`.

    Example:
        >>> import torch
        >>> from curvopt.optim import make_base_optimizer
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = make_base_optimizer("heavy_ball", model.parameters(), lr=0.1)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> type(opt).__name__
        'SGD'
    """
    if name == "heavy_ball":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(
            params, lr=lr, betas=tuple(betas), eps=adam_eps, weight_decay=weight_decay, fused=fused
        )
    if name == "gd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"base must be one of {BASES}, got {name!r}")
