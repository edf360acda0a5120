"""The FOSI optimizer: a ``torch.optim.Optimizer`` around an already-built base optimizer.

:class:`FOSI` is the wrapper (its options, the parameter layout, the shared ``param_groups``
and ``state``, :meth:`FOSI.step`); it is composed of the ESE schedule
(:class:`~curvopt.optim.fosi.schedule.ESESchedule`), the Newton-part update
(:class:`~curvopt.optim.fosi.newton.NewtonUpdate`) and its state
(:class:`~curvopt.optim.fosi.state.FOSIState`). The method: :mod:`curvopt.optim.fosi`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from curvopt.curvature.hvp import hvp_module, named_subset
from curvopt.curvature.lanczos import _num_iterations
from curvopt.optim.fosi.newton import NewtonUpdate
from curvopt.optim.fosi.options import LR_REF_KEY, _check_options, _resolve_lr_clip, _warn_if_weight_decay
from curvopt.optim.fosi.schedule import ESESchedule
from curvopt.optim.fosi.state import FOSIState

log = logging.getLogger("curvopt.optim.fosi")  # one logger for the package, as before the split


class FOSI(FOSIState, NewtonUpdate, ESESchedule, Optimizer):
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
        if isinstance(base, FOSI):
            raise TypeError("FOSI cannot wrap another FOSI")
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

    def _set_lr_refs(self) -> None:
        """Give every group its reference lr (key :data:`LR_REF_KEY`) if it has none yet.

        The reference is the lr a scheduler started from (``initial_lr``) when one was already
        attached, else the group's lr when FOSI first sees the group. The Newton part of a group is
        scaled by ``lr / reference`` (see :meth:`step`).
        """
        for group in self.param_groups:
            if LR_REF_KEY not in group:
                group[LR_REF_KEY] = float(group.get("initial_lr", group["lr"]))

    def _layout(self) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("the base optimizer has no parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or not params[0].is_floating_point():
            raise ValueError(
                f"FOSI needs parameters of one floating dtype, got {sorted(map(str, dtypes))}: cast the model "
                "to one dtype first (model.float() or model.double())"
            )
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
        if self.num_iters is not None:  # checked now, not at the first ESE (issue 43)
            if isinstance(self.num_iters, bool) or not float(self.num_iters).is_integer():
                raise ValueError(
                    f"num_iters must be a whole number of Lanczos iterations, got {self.num_iters!r}"
                )
            _num_iterations(self.n, self.k, self.l, self.num_iters, self.reorth)
        if self.model is not None:
            self._named = named_subset(self.model, params)
        else:
            self._named = {str(i): p for i, p in enumerate(params)}
        self._old: list[Tensor] | None = None

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
