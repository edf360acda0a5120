"""RACS — Row-And-Column-Scaled SGD (Gong et al., Algorithm 1; docs/alice.md).

RACS fits the structured Fisher ``S ⊗ Q`` (both positive diagonal) to ``E[g gᵀ]``. The optimum
(Prop. 3) is the principal singular-vector pair of ``P = E[G ⊙ G]``, reached by the fixed point
``s = Pᵀq / ‖q‖²``, ``q = P s / ‖s‖²`` — a power iteration. The step is then the square-root NGD
direction ``Q^{-1/2} G S^{-1/2}``: every entry of ``G`` divided by ``√(q_i s_j)``, so when ``G⊙G`` is
near rank one the entries are ≈ ±1 (Adam-like) at the cost of only ``m + n + 1`` floats of state.

What the paper fixes (and this file follows literally):

* 5 fixed-point iterations per step on the 1-sample estimate ``P = G_t ⊙ G_t``, ``q`` started at 1
  every step (``warm_start=False``, a choice the paper leaves open, docs/decisions.md, RACS-8 — ``True``
  starts from the previous EMA of q);
* EMAs of ``s`` and ``q`` with ``β`` from zero, **no bias correction** (the first update is ≈10×
  the steady-state size; it falls in warmup, where the lr is ≈ 0);
* Fira's norm-growth limiter on the scaled gradient (``γ = 1.01``, Frobenius norm);
* a scale ``α`` on top of the scheduled lr, no momentum;
* only on 2-D matrices: embeddings, norms and (by default) ``lm_head`` use Adam.

The shared base, :class:`~curvopt.optim.matrix.MatrixOptimizer` (Adam fallback group, finiteness
checks, state banks, the compiled path), lives in :mod:`curvopt.optim.matrix`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from curvopt.optim.checks import FLAG, NONNEG, POSITIVE, UNIT, Range, at_least, count
from curvopt.optim.matrix import (
    MatrixOptimizer,
    bank_slice,
    chunk_slices,
    compute_dtype,
    ema_update,
    limiter_eta,
)


def racs_fixed_point(P: Tensor, n_iter: int = 5, q0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The RACS fixed point (the paper's Eq. 16) on ``P = E[G⊙G]``.

    ``s = Pᵀq/‖q‖²``, then ``q = P s/‖s‖²``, ``n_iter`` times. This is alternating power
    iteration, so ``s``, ``q`` tend to the right/left principal singular vectors of ``P`` (up to
    scale); for a rank-one ``P = a bᵀ`` one iteration is exact.

    Args:
        P: Non-negative m×n matrix, or a ``(k, m, n)`` stack of them (each solved on its own, with
            batched products).
        n_iter: Number of iterations.
        q0: Starting m-vector, or ``(k, m)`` for a stack (default all ones).

    Returns:
        ``(s, q)``, an n- and an m-vector (``(k, n)`` and ``(k, m)`` for a stack).
    """
    *batch, m, n = P.shape
    q = torch.ones(*batch, m, dtype=P.dtype, device=P.device) if q0 is None else q0.to(P.dtype)
    tiny = torch.finfo(P.dtype).tiny
    s = torch.zeros(*batch, n, dtype=P.dtype, device=P.device)
    if not batch:
        for _ in range(n_iter):
            s = torch.mv(P.T, q).div_(torch.dot(q, q).clamp_min(tiny))
            q = torch.mv(P, s).div_(torch.dot(s, s).clamp_min(tiny))
        return s, q
    # A stack: column vectors (k, ·, 1) and P's transposed view made once, so that no vector is
    # reshaped per iteration (10 ops an iteration, for any k).
    PT = P.mT
    q_col = q.unsqueeze(2)
    s_col = s.unsqueeze(2)
    for _ in range(n_iter):
        s_col = torch.bmm(PT, q_col).div_((q_col * q_col).sum(1, keepdim=True).clamp_min_(tiny))
        q_col = torch.bmm(P, s_col).div_((s_col * s_col).sum(1, keepdim=True).clamp_min_(tiny))
    return s_col.squeeze(2), q_col.squeeze(2)


def racs_bank_update(
    G: Tensor,
    S: Tensor,
    Q: Tensor,
    PHI: Tensor,
    ok: Tensor | None,
    *,
    cdt: torch.dtype,
    n_iter: int,
    warm: bool,
    limiter: bool,
    beta: float | Tensor,
    eps: float | Tensor,
    gamma: float | Tensor,
    scale: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """One RACS step of ``k`` same-shape matrices, in place on their state bank.

    Pure tensor code (no host read), run eagerly or under ``torch.compile(fullgraph=True)`` with the
    hyper-parameters as 0-d tensors (``RACS(compile=True)``).

    Args:
        G: ``(k, m, n)`` gradients.
        S: ``(k, n)`` bank of ``s`` (updated in place).
        Q: ``(k, m)`` bank of ``q`` (updated in place).
        PHI: ``(k,)`` bank of the limiter norms (updated in place).
        ok: ``None``, or the deferred finiteness flag: where it is false the step writes nothing.
        cdt: Compute dtype.
        n_iter: Fixed-point iterations.
        warm: Start the fixed point from the stored ``q``.
        limiter: Apply the norm-growth limiter.
        beta: EMA decay of ``s``, ``q``.
        eps: Floor on ``s``, ``q``.
        gamma: Limiter threshold.
        scale: ``−lr·α``.

    Returns:
        ``(G, step)``: the weights move by ``G ⊙ step`` (``G`` zeroed in a skipped step).
    """
    G = G.to(cdt)
    if ok is not None:
        G = torch.where(ok, G, 0.0)
    P = G * G
    s_old, q_old = S.to(cdt), Q.to(cdt)
    s_fp, q_fp = racs_fixed_point(P, n_iter, q_old if warm else None)
    s = ema_update(s_old, s_fp, beta)
    q = ema_update(q_old, q_fp, beta)
    S.copy_(s if ok is None else torch.where(ok, s, s_old))
    Q.copy_(q if ok is None else torch.where(ok, q, q_old))
    a = Q.to(cdt).clamp_min(eps).rsqrt_()  # the kept q in a skipped step: finite
    b = S.to(cdt).clamp_min(eps).rsqrt_()
    # ‖G̃‖²_F = (q⁻¹)ᵀ P s⁻¹ per matrix, as in the loop
    norm = torch.bmm(torch.bmm((a * a).unsqueeze(1), P), (b * b).unsqueeze(2))
    norm = norm.view(G.shape[0]).clamp_min_(0).sqrt_()
    if limiter:
        eta = limiter_eta(norm.to(PHI.dtype), PHI, gamma)
        new_phi = eta * norm
    else:
        eta = torch.ones_like(PHI)
        new_phi = norm.to(PHI.dtype)
    PHI.copy_(new_phi if ok is None else torch.where(ok, new_phi, PHI))
    a = a * (eta.to(cdt) * scale).unsqueeze(1)
    return G, torch.mul(a.unsqueeze(2), b.unsqueeze(1), out=P)  # P is no longer needed


class RACS(MatrixOptimizer):
    """Row-and-column-scaled SGD (Algorithm 1). See the module docstring.

    State per matrix: ``s`` (n), ``q`` (m), ``phi`` (1) and the step count.

    Args:
        params: Parameters or parameter groups; non-Adam groups must hold 2-D matrices only.
        lr: The scheduled learning rate λ (Table 9: 0.02).
        beta: EMA decay of ``s`` and ``q`` (0.9); ``beta=0`` is the "RACS without EMA" ablation.
        alpha: Update scale α (0.05; 0.02 at 1.3B). The step is ``λ·α·η·G̃``.
        gamma: Limiter threshold γ (1.01).
        n_iter: Fixed-point iterations per step (5).
        warm_start: Start the fixed point from the previous EMA of ``q`` instead of ones.
        limiter: Apply Fira's norm-growth limiter (``False`` switches it off).
        eps: Floor on ``s`` and ``q`` before the square root (1e-30, fp32).
        adam_betas: Adam betas of groups with ``adam=True``.
        adam_eps: Adam ε of groups with ``adam=True``.
        weight_decay: Decoupled weight decay (the paper uses none).
        state_dtype: Dtype of ``s``, ``q`` (default: the parameter's).
        foreach: Update same-shape matrices together (stacked, batched products) instead of one by
            one; ``None`` (default): on when every parameter of the group is on CUDA, where the
            per-matrix loop is bound by kernel launches. The two agree to rounding. The stacked
            state lives in one bank per shape; each matrix's ``state`` entries are its slices.
        check_finite: How a NaN/inf gradient is caught. ``"eager"``: one host read per step, and the
            step raises :class:`~curvopt.errors.NonFiniteError` before anything changes;
            ``"deferred"``: no host read — the step computes a device flag, writes nothing where it
            is set, and :meth:`raise_if_nonfinite` (which the training loop calls with its loss
            read) raises; ``None`` (default): deferred when every gradient is on CUDA and the step
            is stacked (``foreach``), eager otherwise.
        compile: Run the stacked update of each shape bucket under ``torch.compile(fullgraph=True,
            dynamic=False)``, with the hyper-parameters as 0-d tensors (a scheduled lr does not
            recompile); implies the stacked path. Opt-in: the first step compiles (tens of seconds).

    Raises:
        ValueError: On an out-of-range hyperparameter or a non-2-D parameter in a method group.
        TypeError: On a complex parameter.

    Example:
        RACS on the hidden matrix, Adam on the rest (what :func:`~curvopt.optim.build_optimizer`
        sets up for a whole model):

        >>> import torch
        >>> from curvopt.optim import RACS
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> others = [model[0].bias, *model[2].parameters()]
        >>> groups = [{"params": [model[0].weight]}, {"params": others, "adam": True}]
        >>> opt = RACS(groups, lr=0.02, foreach=True, check_finite="deferred")
        >>> batches = [(torch.randn(16, 4), torch.randn(16, 2)) for _ in range(3)]
        >>> for x, y in batches:
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()  # stacked, and no host read: a NaN gradient would skip the step
        >>> opt.raise_if_nonfinite()  # one read for all three steps (raises if one was skipped)
        >>> sorted(opt.state[model[0].weight])
        ['phi', 'q', 's', 'step']
    """

    method_name = "racs"

    RANGES: dict[str, Range] = {
        "beta": UNIT,
        "alpha": NONNEG,
        "gamma": at_least(1.0),
        "eps": POSITIVE,
        "n_iter": count(1),
        "warm_start": FLAG,
        "limiter": FLAG,
    }

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        beta: float = 0.9,
        alpha: float = 0.05,
        gamma: float = 1.01,
        n_iter: int = 5,
        warm_start: bool = False,
        limiter: bool = True,
        eps: float = 1e-30,
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: str | torch.dtype | None = None,
        foreach: bool | None = None,
        check_finite: str | None = None,
        compile: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "beta": beta,
            "alpha": alpha,
            "gamma": gamma,
            "n_iter": n_iter,
            "warm_start": warm_start,
            "limiter": limiter,
            "eps": eps,
            "adam_betas": tuple(adam_betas),
            "adam_eps": adam_eps,
            "weight_decay": weight_decay,
            "state_dtype": state_dtype,
            "foreach": foreach,
            "check_finite": check_finite,
            "compile": compile,
        }
        super().__init__(params, defaults)

    def _matrix_grad_limit(self, p: Tensor, group: dict[str, Any], big: float) -> float:
        """``(big / (16 m n))^(1/4)``: the fixed point's ``‖s‖²`` is up to ``n·max|g|⁴`` (and ``q`` up to m)."""
        m, n = p.shape
        return (big / (16.0 * m * n)) ** 0.25

    @staticmethod
    def state_numel(shape: tuple[int, int], **hparams: Any) -> dict[str, int]:
        """Elements of each state tensor for one weight matrix.

        Args:
            shape: The weight's ``(m, n)`` shape.
            **hparams: Ignored (uniform signature with Alice).

        Returns:
            ``{"s": n, "q": m, "phi": 1}`` (``phi`` is one fp32 scalar).
        """
        del hparams
        m, n = shape
        return {"s": n, "q": m, "phi": 1}

    def _matrix_update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        cdt = compute_dtype(p)
        m, n = p.shape
        self._init_state(p, state, group)
        state["step"] += 1
        beta, eps = group["beta"], group["eps"]
        # Scratch matrices (P = G⊙G and the outer product of the scalings) live in one reused
        # workspace: fresh m×n temporaries per matrix cost page faults and a trip to DRAM each, and
        # on a CPU those elementwise passes cost as much as the fixed point itself. One workspace
        # per matrix size keeps P hot in cache for the 2·n_iter matrix–vector products.
        G = grad if grad.dtype == cdt else self._scratch("G", m, n, cdt, p.device).copy_(grad)
        P = torch.mul(G, G, out=self._scratch("P", m, n, cdt, p.device))
        q0 = state["q"].to(cdt) if (group["warm_start"] and state["step"] > 1) else None
        s_fp, q_fp = racs_fixed_point(P, int(group["n_iter"]), q0)
        s = state["s"].to(cdt).mul_(beta).add_(s_fp, alpha=1 - beta)
        q = state["q"].to(cdt).mul_(beta).add_(q_fp, alpha=1 - beta)
        state["s"].copy_(s)
        state["q"].copy_(q)
        # G̃ = Diag(q)^{-1/2} G Diag(s)^{-1/2}, never formed: ‖G̃‖²_F = (q⁻¹)ᵀ P s⁻¹ is one more
        # product with the cached P, and the update p += c·G⊙(a bᵀ) is one fused pass over G and p.
        a = q.clamp_min(eps).rsqrt_()
        b = s.clamp_min(eps).rsqrt_()
        norm = torch.dot(a * a, torch.mv(P, b * b)).clamp_min_(0).sqrt_()
        phi = state["phi"]
        if group["limiter"]:
            eta = limiter_eta(norm.to(phi.dtype), phi, group["gamma"])
            phi.copy_(eta * norm)
        else:
            eta = torch.ones((), dtype=phi.dtype, device=phi.device)
            phi.copy_(norm)
        a.mul_(eta.to(cdt) * (-group["lr"] * group["alpha"]))
        step = torch.outer(a, b, out=self._scratch("O", m, n, cdt, p.device))
        p.addcmul_(G, step)  # computed in cdt, rounded once into a bf16 p

    def _init_state(self, p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """A matrix's state before its first step: ``s`` (n), ``q`` (m), the fp32 limiter norm ``phi``."""
        if state:
            return
        m, n = p.shape
        sd = self._state_dtype(p, group)
        state["step"] = 0
        state["s"] = torch.zeros(n, dtype=sd, device=p.device)
        state["q"] = torch.zeros(m, dtype=sd, device=p.device)
        phi_dtype = torch.float64 if compute_dtype(p) == torch.float64 else torch.float32
        state["phi"] = torch.zeros((), dtype=phi_dtype, device=p.device)

    def _matrix_update_foreach(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """:meth:`_matrix_update` on stacks of same-shape matrices, in place on the state banks.

        The same algorithm as the loop (tested against it and the float64 reference); the sums
        inside the batched products may run in another order, so results agree to rounding. With
        ``check_finite="deferred"`` a skipped step zeroes ``G`` (so the weights move by ``0·step``)
        and keeps every state tensor.
        """
        beta, eps = group["beta"], group["eps"]
        buckets: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in params:
            state = self.state[p]
            m, n = p.shape
            self._init_state(p, state, group)
            state["step"] += 1
            warm = bool(group["warm_start"] and state["step"] > 1)
            key = (m, n, p.dtype, state["s"].dtype, state["phi"].dtype, p.device, warm)
            buckets.setdefault(key, []).append(p)
        scale = -group["lr"] * group["alpha"]
        ok = self.__dict__.get("_step_ok")
        hyper: dict[str, Any] = {"beta": beta, "eps": eps, "gamma": group["gamma"], "scale": scale}
        for (m, n, *_, device, warm), bucket in buckets.items():
            cdt = compute_dtype(bucket[0])
            full = self._bank(bucket, ("s", "q", "phi"))
            if group.get("compile"):
                hyper = {k: self._hyper_tensor(group, k, v, device) for k, v in hyper.items()}
            for part in chunk_slices(len(bucket), m * n, device):
                ps = bucket[part]
                bank = bank_slice(full, part, len(bucket))
                G = torch.stack([p.grad for p in ps])
                update = racs_bank_update
                if group.get("compile"):
                    update = self._compiled(racs_bank_update, (m, n, len(ps), cdt, device, warm, ok is None))
                G, step = update(
                    G, bank["s"], bank["q"], bank["phi"], ok, cdt=cdt, n_iter=int(group["n_iter"]),
                    warm=warm, limiter=bool(group["limiter"]), **hyper,
                )  # fmt: skip
                torch._foreach_addcmul_(ps, list(G.unbind(0)), list(step.unbind(0)))

    def _scratch(self, name: str, m: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """An m×n view into a reusable buffer (grown to the largest matrix seen, never saved)."""
        key = (name, dtype, device)
        workspace: dict[Any, Tensor] = self.__dict__.setdefault("_workspace", {})
        buf = workspace.get(key)
        if buf is None or buf.numel() < m * n:
            buf = torch.empty(m * n, dtype=dtype, device=device)
            workspace[key] = buf
        return buf[: m * n].view(m, n)
