"""Fast Gauss-Newton (FGN) for multiclass cross-entropy (Korbit & Zanon 2026, Algorithm 1).

One step on a batch of ``b`` examples:

1. logits ``z``, margins ``s_i = logsumexp_{j≠y_i} z_ij − z_{i,y_i}``, weights
   ``√q_i = √(p_* p_†)`` and ``r̃_i = √(p_†/p_*)`` (from the margin, never from ``p``);
2. CG from ``u = 0`` on the whitened row-space system ``(K + bλI) u = r̃`` with
   ``K = Q^{1/2} J Jᵀ Q^{1/2}`` (``J``: Jacobian of the batched margin map, no 1/b), relative
   tolerance and an iteration cap, no warm start;
3. back-projection ``d = −Jᵀ Q^{1/2} u``, the exact solution of ``(H_FGN + λI) d = −g`` when the
   solve is exact (Lemma D.1), and the update ``w ← w + α d``.

Two implementations of the same step:

* **generic** (any model with ``(b, C)`` logits): one linearisation of the logits map through
  ``torch.func``; the margin map's JVP/VJP are the logit ones contracted with
  ``a_i = ∇_z s_i = ρ_full,i − e_{y_i}``, and the closures are reused by every CG iteration;
* **affine** (closed form, Appendix F.2): for ``z = W h + b`` the Gram is
  ``K = √q√qᵀ ∘ (H Hᵀ + 1) ∘ (A Aᵀ)``, CG runs on that b×b matrix, and the back-projection is
  fused into the update (``W −= α (c ∘ A)ᵀ H`` with ``c = √q ∘ u``): no autograd, no d×d or
  b×d object. ``implementation="auto"`` picks it whenever the model is a linear head.

Logged per step: ``loss`` (mean CE of the batch before the step, ``= mean softplus(s)``),
``cg_iters``, ``cg_residual`` (CG's recursively updated ``‖(K+bλI)u − r̃‖/‖r̃‖``), ``cg_breakdown``, ``xi_mean`` (mean
dispersion ``ξ = 1 − ‖ρ‖²``), ``dropped_trace_mean`` (mean ``p_† ξ``, the trace of the logit-space
curvature FGN drops), ``step_norm`` (``‖d‖``), ``lr``, ``damping`` and ``implementation``.

Host reads (a GPU step waits for each): on the CPU the defaults keep the eager checks and CG's early
exit; on an accelerator (``"auto"``) a step runs CG to its cap with masked no-op iterations, checks
the batch on the device (``check_finite="deferred"``) and reads the host once, at the end, for the
logged scalars; ``host_stats=False`` leaves even that read to the caller (:meth:`FGN.read_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvopt.api import AlgorithmBase, Batch, DataBundle
from curvopt.curvature.fgn_ops import (
    MARGIN_CLAMP,
    affine_gram,
    batch_flags,
    batch_ok,
    check_classification_batch,
    dispersion_from_gradient,
    fgn_weights,
    keep_first_failure,
    linear_maps,
    log_breakdown,
    margin_terms,
    raise_batch_errors,
    resolve_check_finite,
    row_space_cg,
)
from curvopt.objective import Objective
from curvopt.optim.checks import FLAG, POSITIVE, Range, check_gn_step, count, one_of

IMPLEMENTATIONS = ("auto", "generic", "affine")


@dataclass
class AffineHead:
    """The parameters of a model that is one affine map of its (flattened) input.

    The tensors share storage with the module's parameters.

    Attributes:
        weight: ``(C, D)`` weight (``nn.Linear`` layout).
        bias: ``(C,)`` bias, or ``None`` when the layer has none (or it is frozen).
    """

    weight: Tensor
    bias: Tensor | None


def find_affine_head(model: nn.Module) -> AffineHead | None:
    """Find the model's ``nn.Linear`` when the model is nothing but that layer.

    The layer may sit inside an ``nn.Sequential`` with ``Flatten``/``Identity`` around it. Any
    other trainable parameter means the model is not a linear head, so the generic path is used.
    ``LinearHead`` (``curvopt.models.linear_head``) is an ``nn.Linear``.

    Args:
        model: The network.

    Returns:
        The layer's trainable weight and bias, or ``None`` when the model is not a linear head.
    """
    linear: nn.Linear | None = None
    if isinstance(model, nn.Linear):
        linear = model
    elif isinstance(model, nn.Sequential):
        layers = [m for m in model if not isinstance(m, (nn.Identity, nn.Flatten))]
        if len(layers) == 1 and isinstance(layers[0], nn.Linear) and isinstance(model[-1], nn.Linear):
            linear = layers[0]
    if linear is None:
        return None
    trainable = [p for p in model.parameters() if p.requires_grad]
    owned = [p for p in (linear.weight, linear.bias) if p is not None and p.requires_grad]
    if len(trainable) != len(owned) or not linear.weight.requires_grad:
        return None
    bias = linear.bias if (linear.bias is not None and linear.bias.requires_grad) else None
    return AffineHead(weight=linear.weight, bias=bias)


def _step_stats(s: Tensor, a: Tensor, info: dict[str, Tensor], step_norm: Tensor) -> dict[str, Tensor]:
    """The logged scalars of a step (module docstring), the same for both paths.

    From the margins ``s``, their gradient ``a`` (before the closed form consumes it), the row-space
    CG's ``info`` and ``‖d‖``.
    """
    xi = dispersion_from_gradient(a)
    return {
        "loss": F.softplus(s).mean(),
        "cg_iters": info["iters"],
        "cg_residual": info["rel_residual"],
        "cg_breakdown": info["breakdown"],
        "xi_mean": xi.mean(),
        "dropped_trace_mean": (torch.sigmoid(s) * xi).mean(),
        "step_norm": step_norm,
    }


def affine_fgn_direction(
    weight: Tensor,
    bias: Tensor | None,
    h: Tensor,
    z: Tensor,
    y: Tensor,
    damping: float,
    tol: float,
    maxiter: int,
    early_exit: bool = True,
    clamp: float = MARGIN_CLAMP,
    gram_blocks: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Closed-form FGN row-space solve for ``z = h Wᵀ + b`` (Appendix F.2).

    Returns ``(cA, stats)`` where ``cA = (√q ∘ u)[:, None] ∘ A`` (shape ``(b, C)``) gives the
    direction ``d_W = −cAᵀ h`` (``nn.Linear`` layout ``(C, D)``) and ``d_b = −Σ_i cA_i``. The
    caller applies it fused into the update. ``z`` (the logits) is overwritten (it becomes ``cA``:
    no b×C temporaries). Pure tensor code (no host sync when ``early_exit=False``), so it can be
    compiled.

    Args:
        weight: ``(C, D)`` head weight (unused: the Gram needs only features and logit-space
            vectors; kept for a uniform signature).
        bias: The head bias or ``None`` (decides the ``+1`` bias term of the Gram).
        h: ``(b, D)`` features.
        z: ``(b, C)`` logits ``h Wᵀ + b``; consumed.
        y: ``(b,)`` integer labels.
        damping: λ (the row system is ``(K + bλI) u = r̃``).
        tol: Relative tolerance of the row-space CG.
        maxiter: CG iteration cap.
        early_exit: As in :func:`~curvopt.curvature.fgn_ops.row_space_cg`.
        clamp: Margin clamp for ``√q`` and ``r̃``.
        gram_blocks: Row blocks of the symmetric Gram product.

    Returns:
        ``(cA, stats)``: the ``(b, C)`` tensor above and 0-d tensors ``loss``, ``cg_iters``,
        ``cg_residual``, ``cg_breakdown``, ``xi_mean``, ``dropped_trace_mean``, ``step_norm``.
    """
    del weight  # the Gram needs only features and logit-space vectors
    b = h.shape[0]
    with torch.no_grad():
        s, a = margin_terms(z, y, inplace=True)  # z is consumed: it becomes a = ∇_z s
        sqrt_q, r_tilde = fgn_weights(s, clamp)
        gram = affine_gram(h, a, sqrt_q, bias=bias is not None, blocks=gram_blocks)
        shift = b * damping

        def operator(v: Tensor) -> Tensor:
            return torch.addmv(v, gram, v, beta=shift)

        u, info = row_space_cg(operator, r_tilde, tol=tol, maxiter=maxiter, early_exit=early_exit)
        ku = gram @ u
        stats = _step_stats(s, a, info, torch.sqrt(torch.dot(u, ku).clamp_min(0)))  # ‖d‖² = uᵀKu
        ca = a.mul_((sqrt_q * u).unsqueeze(1))  # c ∘ A, in place: A is not needed any more
    return ca, stats


#: FGN's own settings (besides :data:`~curvopt.optim.checks.GN_STEP_RANGES`, shared with SGN).
FGN_RANGES: dict[str, Range] = {
    "implementation": one_of(*IMPLEMENTATIONS),
    "margin_clamp": POSITIVE,
    "compile": FLAG,
    "gram_blocks": count(1, also=("auto",)),
}


class GaussNewtonChecks:
    """The checks FGN and SGN share, as a mixin of both Algorithms (one place, not two).

    Their common arguments (:data:`~curvopt.optim.checks.GN_STEP_RANGES`, :meth:`_init_step`), and
    their batch checks (finite logits, labels in ``[0, C)``), eager or deferred, with the deferred
    error raised at the one read of a step's logged scalars (:meth:`read_stats`) or by
    :meth:`raise_if_nonfinite`.

    Subclasses name themselves in :attr:`log_name` and say from the read scalars whether CG broke
    down (:meth:`_cg_breakdown`).
    """

    log_name = "FGN"

    def _init_step(self, objective: Objective, values: dict[str, Any], own: dict[str, Range]) -> torch.device:
        """Check and keep the settings FGN and SGN share (``values``: the constructor's arguments).

        Returns:
            The parameters' device.

        Raises:
            ValueError: If the loss is not cross-entropy or a setting is out of range.
            TypeError: If a trainable parameter is complex (or not floating point).
        """
        if objective.loss_kind != "cross_entropy":
            raise ValueError(
                f"{self.log_name} is defined for softmax cross-entropy; the objective's loss is "
                f"{objective.loss_kind!r}"
            )
        check_gn_step(self.log_name, objective.model, values, own)
        self.objective = objective
        self.lr = float(values["lr"])
        self.damping = float(values["damping"])
        self.cg_tol = float(values["cg_tol"])
        self.cg_maxiter = int(values["cg_maxiter"])
        device = next(objective.model.parameters()).device
        early = values["cg_early_exit"]
        self.cg_early_exit = device.type == "cpu" if early == "auto" else early
        self.check_finite = resolve_check_finite(values["check_finite"], device)
        self.host_stats = bool(values["host_stats"])
        return device

    def _defer_checks(self, flags: Tensor | None, num_classes: int) -> None:
        """Keep a deferred step's check flags (the first failure since the last read) for later."""
        if flags is not None:
            self._pending = (keep_first_failure(getattr(self, "_pending", (None,))[0], flags), num_classes)

    def raise_if_nonfinite(self) -> None:
        """Read the deferred checks of the steps since the last call (one host read) and raise.

        Only ``check_finite="deferred"`` with ``host_stats=False`` leaves checks pending (with
        ``host_stats=True`` each step raises its own error); a refused step changed nothing.

        Raises:
            ValueError: If a batch had labels outside ``[0, C)``.
            FloatingPointError: If a batch's logits were not finite.
        """
        pending = self.__dict__.pop("_pending", None)
        if pending is not None:
            raise_batch_errors(pending[0].tolist(), pending[1])

    def read_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Read the scalars of a ``host_stats=False`` step (one host read) and raise its error.

        Args:
            stats: What :meth:`step` returned with ``host_stats=False``.

        Returns:
            The logged scalars as Python numbers (what ``host_stats=True`` returns).

        Raises:
            ValueError: If the step's batch had labels outside ``[0, C)`` (it made no update).
            FloatingPointError: If the step's logits were not finite (it made no update).
        """
        flags, num_classes, step = stats["_checks"]
        keys = [k for k, v in stats.items() if isinstance(v, Tensor)]
        parts = [stats[k].to(torch.float64).reshape(1) for k in keys]
        if flags is not None:
            parts.append(flags)
        values = torch.cat(parts).tolist()  # one host read
        if flags is not None:
            raise_batch_errors(values[len(keys) :], num_classes)
        out = {k: v for k, v in stats.items() if k != "_checks"}
        out.update(zip(keys, values))
        out["cg_iters"] = int(out["cg_iters"])
        out["cg_breakdown"] = int(self._cg_breakdown(out))
        if out["cg_breakdown"]:
            log_breakdown(self.log_name, step, {"iters": out["cg_iters"]})
        return out

    def _cg_breakdown(self, out: dict[str, Any]) -> bool:
        """Whether the step's CG broke down, from its read scalars (subclasses)."""
        raise NotImplementedError


class FGN(GaussNewtonChecks, AlgorithmBase):
    """Fast Gauss-Newton step (see module docstring), an ``Algorithm``.

    Paper defaults: ``lr`` (α) 0.1, constant ``damping`` (λ) 1.0, ``cg_maxiter`` 5, ``cg_tol``
    1e-5, same batch for gradient and curvature.

    Args:
        objective: A ``cross_entropy`` objective whose model returns ``(b, C)`` logits.
        lr: Step size α (> 0).
        damping: Constant damping λ (> 0); enters the row system as ``bλ``.
        cg_tol: Relative tolerance ``‖r‖ ≤ tol·‖r̃‖`` of the row-space CG (``atol = 0``).
        cg_maxiter: CG iteration cap (≥ 1); CG starts from ``u = 0`` (no warm start).
        implementation: ``"auto"`` (closed form for a linear head, generic otherwise),
            ``"generic"``, ``"affine"`` (error if the model is not a linear head).
        cg_early_exit: ``True`` stops CG once converged (one host read per iteration);
            ``False`` runs all ``cg_maxiter`` iterations, the converged ones as masked no-ops
            (the same result; compile-friendly, no host read); ``"auto"``: ``True`` on the CPU,
            ``False`` on an accelerator.
        margin_clamp: ``|s|`` clamp for ``√q`` and ``r̃`` only.
        compile: Wrap the closed-form solve in ``torch.compile`` (the paper timed JIT-compiled
            steps).
        gram_blocks: Symmetric blocked Gram (see :func:`~curvopt.curvature.fgn_ops.affine_gram`);
            ``"auto"`` = 4 on CPU, 1 on GPU.
        check_finite: How a batch that cannot define a margin (non-finite logits, labels outside
            ``[0, C)``) is refused; the error and the untouched parameters are the same either way.
            ``"eager"``: checked with a host read before the update; ``"deferred"``: checked on
            the device, the update gated on the result (``torch.where``: a refused step adds 0)
            and the error raised at the step's read of its logged scalars; with
            ``host_stats=False`` by :meth:`read_stats` of that step's scalars or by
            :meth:`raise_if_nonfinite` (every deferred step since its last call: what RACS's
            deferred mode offers); ``None`` (default) or ``"auto"``: eager on the CPU, deferred
            on an accelerator.
        host_stats: ``True``: :meth:`step` returns the logged scalars as Python numbers (one
            stacked host read at the end of the step). ``False``: it returns them as 0-d
            device tensors and makes no host read; :meth:`read_stats` turns them into numbers
            (and raises a deferred error) when the caller logs.

    Raises:
        ValueError: If the loss is not cross-entropy, ``lr``/``damping`` are not finite positive
            numbers (NaN and inf included), the CG settings or ``check_finite`` are out of range,
            or ``implementation`` is unknown or ``"affine"`` for a model that is not a linear head.
        TypeError: If a trainable parameter is complex (or not floating point).

    Example:
        FGN is an :class:`~curvopt.api.Algorithm`: ``step(batch)`` computes the logits, the
        curvature and the update itself (no ``zero_grad``/``backward`` for the caller):

        >>> import torch
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import FGN
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> fgn = FGN(Objective(model, "cross_entropy"), lr=0.1, damping=1.0)
        >>> for _ in range(3):
        ...     info = fgn.step((x, y))
        >>> fgn.steps, info["implementation"]
        (3, 'generic')
    """

    def __init__(
        self,
        objective: Objective,
        lr: float = 0.1,
        damping: float = 1.0,
        cg_tol: float = 1e-5,
        cg_maxiter: int = 5,
        implementation: str = "auto",
        cg_early_exit: bool | str = "auto",
        margin_clamp: float = MARGIN_CLAMP,
        compile: bool = False,
        gram_blocks: int | str = "auto",
        check_finite: str | None = None,
        host_stats: bool = True,
    ) -> None:
        device = self._init_step(objective, locals(), FGN_RANGES)
        self.margin_clamp = float(margin_clamp)
        self.head = find_affine_head(objective.model) if implementation in ("auto", "affine") else None
        if implementation == "affine" and self.head is None:
            raise ValueError(
                "implementation='affine' needs a model that is a single nn.Linear (a linear head); "
                f"got {type(objective.model).__name__}. Use implementation='generic' or 'auto'."
            )
        self.implementation = "affine" if self.head is not None else "generic"
        self._direction = affine_fgn_direction
        if compile and self.head is not None:
            self._direction = torch.compile(affine_fgn_direction, dynamic=False)
        if gram_blocks == "auto":
            gram_blocks = 4 if device.type == "cpu" else 1
        self.gram_blocks = int(gram_blocks)
        self.steps = 0

    # -- the step ---------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, Any]:
        """One FGN update ``w ← w + α d`` on ``batch`` (gradient and curvature on the same batch).

        Args:
            batch: ``(x, y)`` with integer labels in ``[0, C)``.

        Returns:
            The logged scalars of the module docstring (``loss``, ``cg_iters``, ``cg_residual``,
            ``cg_breakdown``, ``xi_mean``, ``dropped_trace_mean``, ``step_norm``, ``lr``,
            ``damping``, ``implementation``): Python numbers, or with ``host_stats=False`` 0-d
            tensors (and the pending checks) for :meth:`read_stats`.

        Raises:
            ValueError: If the batch cannot define a margin (no update is made).
            FloatingPointError: If the logits are not finite (no update is made).
        """
        x, y = batch
        if self.head is not None:
            stats = self._affine_step(x, y)
        else:
            stats = self._generic_step(x, y)
        self.steps += 1
        return stats

    def _check(self, z: Tensor, y: Tensor) -> tuple[Tensor, Tensor | None]:
        """The batch checks: eager (raise now) or deferred (labels made safe, flags returned)."""
        if self.check_finite == "eager":
            check_classification_batch(z, y)
            return y, None
        flags = batch_flags(z, y)
        return y.clamp(0, z.shape[1] - 1), flags  # out-of-range labels must not index on the device

    def _finish(self, stats: dict[str, Tensor], flags: Tensor | None, num_classes: int) -> dict[str, Any]:
        out: dict[str, Any] = dict(stats)
        out["_checks"] = (flags, num_classes, self.steps)
        out.update(lr=self.lr, damping=self.damping, implementation=self.implementation)
        if self.host_stats:
            return self.read_stats(out)
        self._defer_checks(flags, num_classes)
        return out

    def _cg_breakdown(self, out: dict[str, Any]) -> bool:
        return bool(int(out["cg_breakdown"]))

    def _affine_step(self, x: Tensor, y: Tensor) -> dict[str, Any]:
        head = self.head
        assert head is not None
        h = x.reshape(x.shape[0], -1)
        with torch.no_grad():
            z = F.linear(h, head.weight, head.bias)
            num_classes = z.shape[1]
            y, flags = self._check(z, y)
            ca, stats = self._direction(
                head.weight,
                head.bias,
                h,
                z,
                y,
                self.damping,
                self.cg_tol,
                self.cg_maxiter,
                self.cg_early_exit,
                self.margin_clamp,
                self.gram_blocks,
            )
            if flags is not None:  # a refused batch adds exactly 0 (cA and h zeroed, nan included)
                ok = batch_ok(flags)
                ca = torch.where(ok, ca, 0.0)
                h = torch.where(ok, h, 0.0)
            # w ← w + α d with d_W = −cAᵀh, d_b = −Σ cA: back-projection fused into the update
            head.weight.addmm_(ca.T, h, alpha=-self.lr)
            if head.bias is not None:
                head.bias.add_(ca.sum(dim=0), alpha=-self.lr)
        return self._finish(stats, flags, num_classes)

    def _generic_step(self, x: Tensor, y: Tensor) -> dict[str, Any]:
        objective = self.objective
        params = objective.params()
        z, vjp_z, jvp_z, _ = linear_maps(lambda p: objective.forward(p, x), params)
        z = z.detach()
        num_classes = z.shape[1]
        y, flags = self._check(z, y)
        b = z.shape[0]
        with torch.no_grad():
            s, a = margin_terms(z, y)  # a = ∇_z s: the margin map's JVP/VJP are a·(logit JVP/VJP)
            sqrt_q, r_tilde = fgn_weights(s, self.margin_clamp)
        shift = b * self.damping

        def margin_vjp(v: Tensor) -> dict[str, Tensor]:  # Jᵀ v for the margin map
            return vjp_z(v.unsqueeze(1) * a)

        def margin_jvp(t: dict[str, Tensor]) -> Tensor:  # J t
            return (a * jvp_z(t)).sum(dim=1)

        def operator(v: Tensor) -> Tensor:  # (K + bλI) v = √q ∘ J Jᵀ (√q ∘ v) + bλ v
            return sqrt_q * margin_jvp(margin_vjp(sqrt_q * v)) + shift * v

        u, info = row_space_cg(
            operator, r_tilde, tol=self.cg_tol, maxiter=self.cg_maxiter, early_exit=self.cg_early_exit
        )
        with torch.no_grad():
            back = margin_vjp(sqrt_q * u)  # −d = J̃ᵀu
            if flags is not None:  # a refused batch adds exactly 0 (nan included)
                ok = batch_ok(flags)
                back = {name: torch.where(ok, t, 0.0) for name, t in back.items()}
            for name, p in params.items():
                p.add_(back[name], alpha=-self.lr)
            step_norm = torch.sqrt(sum(torch.vdot(t.reshape(-1), t.reshape(-1)) for t in back.values()))
            stats = _step_stats(s, a, info, step_norm)
        return self._finish(stats, flags, num_classes)

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step counter (FGN carries no other state across steps).

        Returns:
            ``{"steps": int}``.
        """
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step counter.

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.steps = int(state.get("steps", 0))


def build_fgn(objective: Objective, data: DataBundle | None = None, **cfg: Any) -> FGN:
    """Factory for the loop (``conf/optimizer/fgn.yaml``).

    Args:
        objective: The model and its cross-entropy loss.
        data: The run's data (unused: FGN uses only the mini-batch it is given).
        **cfg: Keyword arguments of :class:`FGN`.

    Returns:
        The :class:`FGN` algorithm.

    Example:
        >>> import torch
        >>> from curvopt.api import DataBundle
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import build_fgn
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> alg = build_fgn(Objective(model, "cross_entropy"), DataBundle(train=(x, y)), lr=0.1)
        >>> for _ in range(2):
        ...     info = alg.step((x, y))
        >>> type(alg).__name__, "loss" in info
        ('FGN', True)
    """
    del data  # FGN uses only the mini-batch it is given
    return FGN(objective, **cfg)
