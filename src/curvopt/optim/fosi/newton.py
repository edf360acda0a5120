"""FOSI's Newton part and the update of a step between two ESEs.

:class:`NewtonUpdate` is the part of :class:`~curvopt.optim.fosi.FOSI` that installs a basis
(V̂, u = 1/max(|λ̂|, ε), the scale s; the only host read), keeps the Newton velocity in V̂
coefficients, and applies ``θ ← θ + d₁ + s·d₂``: the generic path (the base sees g₂) or the SGD
fast path (the base fed g, corrected inside span(V̂)); see :mod:`curvopt.optim.fosi`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from curvopt.curvature.lanczos import LanczosResult
from curvopt.optim.fosi.options import _ADAM_FAMILY, LR_REF_KEY, _flat, _momentum_coefficients

log = logging.getLogger("curvopt.optim.fosi")  # one logger for the package, as before the split


class NewtonUpdate:
    """The Newton part and the step update of :class:`~curvopt.optim.fosi.FOSI` (a mixin).

    Reads the base optimizer (``base``, ``param_groups``, ``state``), the options (``k``, ``l``,
    ``alpha``, ``eps``, ``lr_clip``, ``fast_path_enabled``) and the layout (``_params``,
    ``_sizes``, ``_dtype``, ``_device``); owns the basis (``V``, ``_blocks``, ``u``,
    ``eigenvalues``, ``lambda_min``, ``scale``), the velocity coefficients and the fast path's
    momentum projections.
    """

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
