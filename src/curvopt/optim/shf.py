"""SHF-LSMR: stochastic Hessian-free optimisation with LSMR inner solves (Emirahmetoglu & Stewart).

One outer iteration (paper Algorithm 1; docs/shf.md, "One outer iteration"):

1. On a fresh random batch X of size n (drawn by the loop at :meth:`SHF.next_batch_size`), cache
   the forward pass and build ``A = J = ∇R(w;X)``, ``b = −R`` with ``R = (net(w;X) − X)/√n``.
2. Chapelle–Erhan's randomized diagonal preconditioner ``c = 1/(1 + sqrt(diag Ĝ))`` (Algorithm 3).
3. LSMR (Algorithm 6) on ``min ‖A(c∘y) − b‖² + λ²‖y − y0‖²``, warm started at ``y0`` and stopped by
   the validation merit ``φ(d) = f(w + d; X_val)``; the step is ``d = c∘y``.
4. LM damping from ρ on the same batch, Armijo backtracking on the same batch, update.
5. Warm start decay ``d ← γd``, ``γ ← min(1.002γ, 0.95)``.
6. Validation loss, Byrd et al.'s variance test n̂ (Algorithm 2) at the new w on the old batch,
   and the batch-size rule (n̂ average over 5, validation-stall growth ×1.005, n never shrinks,
   capped at n_max); LSMR's maxiter scales with n.

Per-dataset settings (paper Table 1) are listed in conf/optimizer/shf_lsmr.yaml; the choices the
paper leaves open are in docs/shf.md ("Choices taken where the paper is silent or inconsistent")
and docs/decisions.md (SHF-1 to SHF-26).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import Tensor

from curvopt.api import Batch, DataBundle
from curvopt.curvature.lsmr import lsmr
from curvopt.curvature.mlp_gn import GaussNewtonBase, residual_gauss_newton, supports_hand_written
from curvopt.objective import (
    Objective,
    Params,
    unflatten,
)
from curvopt.optim.checks import (
    FLAG,
    INTEGER,
    NONNEG,
    UNIT,
    Range,
    at_least,
    check_hparams,
    check_trainable,
    count,
    one_of,
    optional,
    real,
)

log = logging.getLogger(__name__)

STEP_SPACES = ("scaled", "literal")
WARM_STARTS = ("param", "y")
PRECONDITIONERS = ("chapelle_erhan", "none")
DAMPING_CENTERS = ("warm_start", "zero")
VARIANCE_GRADIENTS = ("example", "summand", "batch_mean")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chapelle_erhan_precond(diag_estimate: Tensor, sqrt: bool = True) -> Tensor:
    """The vector ``c`` of right preconditioning from an estimate of ``diag(JᵀJ)``.

    Args:
        diag_estimate: Flat estimate of ``diag(JᵀJ)`` (negative entries are clamped to 0).
        sqrt: ``True`` (paper Algorithm 3, default): ``c = 1/(1 + sqrt(diag))``, i.e. one over
            one plus the estimated column norm of J — the natural column scaling for LSMR.
            ``False`` (Section 4.4's text): ``c = 1/(1 + diag)``.

    Returns:
        ``c``, shaped like ``diag_estimate``, entries in ``(0, 1]``.
    """
    d = diag_estimate.clamp_min(0)
    return 1.0 / (1.0 + (d.sqrt() if sqrt else d))


def variance_batch_size(
    grad_sum: Tensor,
    grad_sq_sum: Tensor,
    n: int,
    num_train: int,
    theta: float,
    power: int = 1,
    gradients: str = "example",
) -> tuple[int, float, float]:
    """Byrd et al.'s variance test, the paper's Algorithm 2 (BatchSize).

    ``g = (1/n)Σ∇f_i``; ``V = ‖n/(n−1)[(1/n)Σ(∇f_i)² − g²]‖_1`` (sample variance, clamped at 0,
    summed over all parameters); ``n̂ = ceil(N·V / (V + θ²(N−1)‖g‖^power))``.

    ``gradients`` picks what enters the formula in place of ``V`` and ``‖g‖``:

    - ``"example"``: the per-example gradients ``∇f_i`` as printed (``V``, ``‖g‖``);
    - ``"summand"``: the gradients of ``f_S``'s summands, ``h_i = (1/n)∇f_i`` (``f_S = Σ_i f_i/n``;
      what per-row gradients of ``½‖R‖²`` with ``R = (net − X)/√n`` are): ``V/n²`` and ``‖g‖/n``,
      so ``n̂ = ceil(N·V / (V + θ²(N−1)·n·‖g‖^power / n^(power−1)))``; for ``power=2`` this is
      ``"example"`` again (the scale cancels);
    - ``"batch_mean"``: Algorithm 2's ``Var(∇f_S)`` read as its name says, the variance of the
      batch-mean gradient ``V/n`` (Eq. (12) without the finite-population factor), next to ``‖g‖``.
      For ``power=1`` this equals ``"summand"``.

    Args:
        grad_sum: ``Σ_i ∇f_i`` over the batch (flat).
        grad_sq_sum: ``Σ_i (∇f_i)²`` over the batch (flat, elementwise squares).
        n: Batch size.
        num_train: Training-set size N.
        theta: Tolerance θ of the test.
        power: ``1`` is the paper's literal (unsquared) norm, ``2`` Byrd et al.'s dimensionally
            consistent one.
        gradients: ``"example"``, ``"summand"`` or ``"batch_mean"`` (above).

    Returns:
        ``(n̂, V, ‖g‖)`` with ``V`` and ``‖g‖`` in per-example units whatever ``gradients`` is;
        ``n̂ = n`` when ``n < 2`` or the denominator is not positive and finite.

    Example:
        >>> import torch
        >>> gsum, gsq = torch.tensor([2.0, 0.0]), torch.tensor([2.0, 2.0])  # ∇f_1=(1,1), ∇f_2=(1,-1)
        >>> variance_batch_size(gsum, gsq, n=2, num_train=10, theta=0.5)  # V=2, ‖g‖=1
        (5, 2.0, 1.0)
        >>> variance_batch_size(gsum, gsq, n=2, num_train=10, theta=0.5, gradients="summand")[0]
        4
    """
    if gradients not in VARIANCE_GRADIENTS:
        raise ValueError(f"gradients must be one of {VARIANCE_GRADIENTS}, got {gradients!r}")
    if n < 2:
        return n, 0.0, float(torch.linalg.vector_norm(grad_sum))
    g = grad_sum / n
    var = (grad_sq_sum / n - g * g).clamp_min_(0).mul_(n / (n - 1))
    v = float(var.sum())
    gnorm = float(torch.linalg.vector_norm(g))
    if gradients == "summand":  # h_i = ∇f_i/n: V_h = V/n², ‖mean h‖ = ‖g‖/n
        v_s, g_s = v / n**2, gnorm / n
    elif gradients == "batch_mean":  # Var(∇f_S) = V/n next to ‖g‖
        v_s, g_s = v / n, gnorm
    else:
        v_s, g_s = v, gnorm
    denom = v_s + theta * theta * (num_train - 1) * g_s**power
    if denom <= 0 or not math.isfinite(denom):
        return n, v, gnorm
    return int(math.ceil(num_train * v_s / denom)), v, gnorm


def next_batch_size_rule(
    n: int,
    maxiter: int,
    nhat_window: list[int],
    fval_lagged: float,
    fval_now: float,
    n_max: int,
    stall_threshold: float = 0.005,
    growth: float = 1.005,
) -> tuple[int, int, str]:
    """Algorithm 1's batch-size update (applied when i > 5): ``(n_next, maxiter_next, reason)``.

    ``n̂_avg = ceil(mean of the last 5 n̂)``; if ``n̂_avg > n`` jump to it, else if the validation
    loss fell by less than ``stall_threshold`` (relative, over 5 iterations) grow by ``growth``;
    never shrink, cap at ``n_max``. ``maxiter ← ceil(n_next/n · maxiter)``. The ceilings are done
    in exact integer/rational arithmetic (1.005·200 is 200.99999999999997 in floats).

    Args:
        n: Current batch size.
        maxiter: Current LSMR iteration cap.
        nhat_window: The last n̂ of the variance test (the paper averages 5).
        fval_lagged: Validation loss ``stall_window`` iterations ago.
        fval_now: Current validation loss.
        n_max: Largest batch size.
        stall_threshold: Relative validation decrease below which the batch grows.
        growth: Growth factor of a stall.

    Returns:
        ``(n_next, maxiter_next, reason)`` with ``reason`` one of ``"variance"``, ``"stall"``,
        ``"keep"``.
    """
    navg = _ceil_div(sum(nhat_window), len(nhat_window))
    r_rel = (fval_lagged - fval_now) / fval_now if fval_now != 0 else math.inf
    if navg > n:
        n_next, reason = min(navg, n_max), "variance"
    elif r_rel < stall_threshold:
        num, den = (growth).as_integer_ratio()
        n_next, reason = min(_ceil_div(n * num, den), n_max), "stall"
    else:
        n_next, reason = n, "keep"
    n_next = max(n_next, n)
    maxiter_next = _ceil_div(n_next * maxiter, n)
    return n_next, maxiter_next, reason


#: SHF's hyper-parameters and what each may be (``curvopt.optim.checks``), checked at construction.
SHF_RANGES: dict[str, Range] = {
    **dict.fromkeys(("damping", "atol", "ftol", "theta", "rho_low", "rho_high", "stall_threshold"), NONNEG),
    **dict.fromkeys(("maxiter", "batch_size", "max_batch_size", "stall_window", "eval_chunk"), count(1)),
    **dict.fromkeys(("miniter", "recover", "max_halvings"), count(0)),
    **dict.fromkeys(("gamma", "gamma_max"), real(0.0, 1.0)),
    "drop": real(0.0, 1.0, low_open=True),
    "gamma_growth": real(0.0, low_open=True),
    "armijo": UNIT,
    "batch_growth": at_least(1.0),
    "val_max_examples": optional(count(1)),
    "seed": INTEGER,
    "variance_norm_power": one_of(1, 2),
    "preconditioner": one_of(*PRECONDITIONERS),
    "step_space": one_of(*STEP_SPACES),
    "warm_start": one_of(*WARM_STARTS),
    "damping_center": one_of(*DAMPING_CENTERS),
    "variance_gradients": one_of(*VARIANCE_GRADIENTS),
    **dict.fromkeys(("precon_sqrt", "return_best", "use_hand_written_gn", "merit", "sync_timers"), FLAG),
}


class SHF:
    """Stochastic Hessian-free optimisation with preconditioned LSMR (an ``Algorithm``).

    Each :meth:`step` is one outer iteration of the paper's Algorithm 1 (module docstring) on the
    batch the loop drew with the size :meth:`next_batch_size` asked for. Defaults are the paper's
    MNIST settings (Table 1); conf/optimizer/shf_lsmr.yaml lists CURVES and USPS, docs/shf.md
    ("Flags") the alternatives.

    Args:
        objective: A squared-error objective (the autoencoder; ``R = (net(w;X) − Y)/√n``).
        data: The run's data; ``train`` must be in memory (its size N enters the variance test),
            ``val`` supplies the validation merit and the stall rule.
        damping: Initial LM damping λ₁ (LSMR's ``damp``; λ² is added to the batch-averaged
            Gauss-Newton in LSMR's preconditioned variable).
        drop: LM factor: ``ρ < rho_low ⇒ λ ← λ/drop``, ``ρ > rho_high ⇒ λ ← λ·drop``.
        gamma: Initial warm-start decay γ₁: the next solve starts at γ·(this LSMR solution).
        gamma_growth: Per-iteration growth of γ (Algorithm 1: ``γ ← min(1.002γ, 0.95)``).
        gamma_max: Cap on γ.
        maxiter: Initial LSMR iteration cap; scaled by ``ceil(n_next/n · maxiter)`` when the batch
            grows.
        atol: LSMR's ``test2 = ‖Āᵀr̄‖/(‖Ā‖‖r̄‖) ≤ atol`` (the only SciPy test kept with a merit).
        ftol: Relative-progress tolerance of the validation merit inside LSMR (Algorithm 6).
        miniter: LSMR iterations before the merit rules may stop the solve.
        recover: LSMR stops when the merit stays above its minimum for more than ``recover``
            iterations.
        theta: Tolerance θ of Byrd et al.'s variance test (Algorithm 2).
        armijo: Armijo constant α of the backtracking line search on the batch.
        max_halvings: Cap on step halvings; then the step is rejected (s = 0) (docs/decisions.md,
            SHF-15).
        rho_low: ρ below which λ is raised.
        rho_high: ρ above which λ is lowered.
        batch_size: Initial batch size n₁ (capped at ``max_batch_size``).
        max_batch_size: Batch-size cap n_max (also capped at the training-set size).
        stall_window: n̂ smoothing window and validation lag (Algorithm 1: i−5); the batch-size
            rule applies from iteration ``stall_window + 1``.
        stall_threshold: Relative validation decrease over the window below which n grows.
        batch_growth: Growth factor of n on a stall (×1.005).
        preconditioner: ``"chapelle_erhan"`` (Algorithm 3, recomputed every iteration) or
            ``"none"``.
        precon_sqrt: ``c = 1/(1 + sqrt(diag Ĝ))`` (Algorithm 3); ``False``: ``1/(1 + diag Ĝ)``
            (Section 4.4's text).
        step_space: ``"scaled"``: the step is ``d = c∘y`` and the merit is evaluated at ``c∘y``;
            ``"literal"``: ``d = y``, as Algorithm 1 is printed.
        warm_start: ``"param"``: ``y0 = γ·d_prev / c_new`` (the previous solution in parameter
            space, re-expressed with the new preconditioner); ``"y"``: ``y0 = γ·y_prev``.
        damping_center: ``"zero"`` (default): LSMR damps ``λ²‖y‖²`` (Algorithm 1's normal
            equations; the warm start ``y0`` is only where LSMR starts, as Section 4.5 and Martens &
            Sutskever describe it); ``"warm_start"``: ``λ²‖y − y0‖²`` (Eq. (19), Algorithm 6, SciPy's
            ``x0``). docs/decisions.md SHF-4 has the runs of both.
        return_best: LSMR returns its best-merit iterate instead of the last one.
        variance_norm_power: 1: the paper's unsquared ``‖∇f_S‖`` in the variance test; 2: Byrd et
            al.'s squared norm. Both n̂ are logged; this picks the one that drives n.
        variance_gradients: What Algorithm 2 is applied to: ``"example"`` (the per-example
            gradients ``∇f_i``, as printed), ``"summand"`` (``f_S``'s summands ``(1/n)∇f_i``) or
            ``"batch_mean"`` (``Var(∇f_S) = V/n``, as Algorithm 2 names it); see
            :func:`variance_batch_size`. ``n_hat`` (example, power 1), ``n_hat_sq`` (example,
            power 2), ``n_hat_summand`` (power 1), ``n_hat_batch_mean_sq`` and the one used,
            ``n_hat_used``, are logged every iteration.
        use_hand_written_gn: Use the cached Algorithms 4/5
            (:class:`~curvopt.curvature.mlp_gn.MLPGaussNewton`) when the model is a plain MLP;
            otherwise ``torch.func``.
        merit: Stop LSMR on the validation merit (needs a validation split; off: atol/maxiter
            only).
        val_max_examples: Evaluate the merit and f_val on the first rows of the validation split
            only (``None`` = all, the paper).
        eval_chunk: Rows per forward pass when evaluating the validation loss.
        seed: Seed of the Rademacher draws of the preconditioner.
        sync_timers: Synchronise the device before every phase timer reads the clock (CUDA only;
            nothing changes on a CPU), so each ``*_time`` holds its own phase's device work:
            without it a phase's kernels run on after its timer stops and are billed to the next
            phase that waits for the device (LSMR's first host read: ``lsmr_time`` absorbs
            ``precond_time``). Off by default: each synchronisation drains the launch queue
            (about a dozen per step); the step's total time is the same either way.

    Raises:
        ValueError: On an unknown choice string, a non-squared-error objective, or a streamed
            training set.
    """

    def __init__(
        self,
        objective: Objective,
        data: DataBundle,
        damping: float = 12.0,
        drop: float = 0.98,
        gamma: float = 0.7,
        gamma_growth: float = 1.002,
        gamma_max: float = 0.95,
        maxiter: int = 150,
        atol: float = 1e-8,
        ftol: float = 1e-5,
        miniter: int = 50,
        recover: int = 100,
        theta: float = 0.2,
        armijo: float = 1e-4,
        max_halvings: int = 60,
        rho_low: float = 0.25,
        rho_high: float = 0.75,
        batch_size: int = 300,
        max_batch_size: int = 6000,
        stall_window: int = 5,
        stall_threshold: float = 0.005,
        batch_growth: float = 1.005,
        preconditioner: str = "chapelle_erhan",
        precon_sqrt: bool = True,
        step_space: str = "scaled",
        warm_start: str = "param",
        damping_center: str = "zero",
        return_best: bool = False,
        variance_norm_power: int = 1,
        variance_gradients: str = "example",
        use_hand_written_gn: bool = True,
        merit: bool = True,
        val_max_examples: int | None = None,
        eval_chunk: int = 10000,
        seed: int = 0,
        sync_timers: bool = False,
    ) -> None:
        check_hparams("SHF", SHF_RANGES, locals(), ordered=[("rho_low", "rho_high")])
        check_trainable("SHF", objective.params(), one_dtype=True)
        if objective.loss_kind != "squared_error":
            raise ValueError("SHF-LSMR is a least-squares method: the model's loss must be squared_error")
        if data.train is None:
            raise ValueError("SHF needs an in-memory training split (its size N enters the variance test)")
        self.objective = objective
        self.num_train = data.num_train
        self.val: tuple[Tensor, Tensor] | None = None
        if data.val is not None:
            xv, yv = data.val
            if val_max_examples is not None:
                xv, yv = xv[:val_max_examples], yv[:val_max_examples]
            self.val = (xv, yv)
        elif merit:
            log.warning(
                "SHF: no validation split; LSMR runs without the validation merit and the stall rule is off"
            )
        self.cfg = dict(
            drop=drop,
            gamma_growth=gamma_growth,
            gamma_max=gamma_max,
            atol=atol,
            ftol=ftol,
            miniter=miniter,
            recover=recover,
            theta=theta,
            armijo=armijo,
            max_halvings=max_halvings,
            rho_low=rho_low,
            rho_high=rho_high,
            n_max=min(max_batch_size, self.num_train),
            stall_window=stall_window,
            stall_threshold=stall_threshold,
            batch_growth=batch_growth,
            preconditioner=preconditioner,
            precon_sqrt=precon_sqrt,
            step_space=step_space,
            warm_start=warm_start,
            damping_center=damping_center,
            return_best=return_best,
            variance_norm_power=variance_norm_power,
            variance_gradients=variance_gradients,
            merit=merit and self.val is not None,
            eval_chunk=eval_chunk,
        )
        self.hand_written = bool(use_hand_written_gn) and supports_hand_written(objective)
        if use_hand_written_gn and not self.hand_written:
            log.info("SHF: model is not a plain MLP; using torch.func Gauss-Newton products")
        # -- state (everything here is in state_dict) ------------------------------------------------
        self.lam = float(damping)
        self.gamma = float(gamma)
        self.n = min(int(batch_size), self.cfg["n_max"])
        self.maxiter = int(maxiter)
        self.iteration = 0
        self.warm_d: Tensor | None = None  # γ·(previous LSMR solution) in parameter space
        self.warm_y: Tensor | None = None  # γ·(previous LSMR solution) in LSMR's variable
        self.nhat_hist: list[int] = []
        self.fval_hist: list[float] = []
        self.fval_current: float | None = None  # f(w; X_val) at the current w, if known
        p0 = next(iter(objective.params().values()))
        self.generator = torch.Generator(device=p0.device).manual_seed(int(seed))
        self._sync_device = p0.device if sync_timers and p0.device.type == "cuda" else None

    def _clock(self) -> float:
        """``time.perf_counter()``, after a device synchronisation with ``sync_timers`` on CUDA."""
        if self._sync_device is not None:
            torch.cuda.synchronize(self._sync_device)
        return time.perf_counter()

    # -- protocol ---------------------------------------------------------------------------------
    def next_batch_size(self) -> int | None:
        """The batch size n the next outer iteration wants (Algorithm 1's batch-size rule).

        Returns:
            The current n.
        """
        return self.n

    def state_dict(self) -> dict[str, Any]:
        """Damping, γ, batch size, maxiter, warm starts, histories and the RNG state.

        Returns:
            A dict accepted by :meth:`load_state_dict`.
        """
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {
            "lam": self.lam,
            "gamma": self.gamma,
            "n": self.n,
            "maxiter": self.maxiter,
            "iteration": self.iteration,
            "warm_d": clone(self.warm_d),
            # y0 = γ·d_prev/c_new needs only warm_d unless warm_start="y" or the step is literal
            # (a third less checkpoint; committed checkpoints resume on other machines)
            "warm_y": clone(self.warm_y) if self._uses_warm_y() else None,
            "nhat_hist": list(self.nhat_hist),
            "fval_hist": list(self.fval_hist),
            "fval_current": self.fval_current,
            "generator": self.generator.get_state(),
        }

    def _uses_warm_y(self) -> bool:
        """Whether the next warm start reads ``warm_y`` (else ``warm_d / c``)."""
        scaled = self.cfg["step_space"] == "scaled" and self.cfg["preconditioner"] != "none"
        return not (scaled and self.cfg["warm_start"] == "param")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (warm starts moved to the model's device).

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.lam = float(state["lam"])
        self.gamma = float(state["gamma"])
        self.n = int(state["n"])
        self.maxiter = int(state["maxiter"])
        self.iteration = int(state["iteration"])
        device = next(iter(self.objective.params().values())).device
        self.warm_d = None if state["warm_d"] is None else state["warm_d"].clone().to(device)
        self.warm_y = None if state["warm_y"] is None else state["warm_y"].clone().to(device)
        self.nhat_hist = list(state["nhat_hist"])
        self.fval_hist = list(state["fval_hist"])
        self.fval_current = state["fval_current"]
        self.generator.set_state(
            state["generator"].cpu() if hasattr(state["generator"], "cpu") else state["generator"]
        )

    # -- pieces -----------------------------------------------------------------------------------
    def _trial(self, params: Params, d: Tensor, s: float = 1.0) -> Params:
        dd = unflatten(d, params)
        return {k: torch.add(v, dd[k], alpha=s) for k, v in params.items()}

    @torch.no_grad()
    def _loss(self, params: Params, x: Tensor, y: Tensor) -> float:
        """Mean ½‖out − y‖² over the rows of x, in chunks (validation set)."""
        chunk = self.cfg["eval_chunk"]
        n = x.shape[0]
        if n <= chunk:
            return float(self.objective.loss(params, x, y))
        total = 0.0
        for i in range(0, n, chunk):
            xb, yb = x[i : i + chunk], y[i : i + chunk]
            total += float(self.objective.loss(params, xb, yb)) * xb.shape[0]
        return total / n

    def _val_loss(self, params: Params, d: Tensor | None = None) -> float:
        assert self.val is not None
        p = params if d is None else self._trial(params, d)
        return self._loss(p, *self.val)

    def _precond(self, gn: GaussNewtonBase) -> Tensor | None:
        if self.cfg["preconditioner"] == "none":
            return None
        return chapelle_erhan_precond(gn.gn_diag_estimate(self.generator), self.cfg["precon_sqrt"])

    # -- one outer iteration ---------------------------------------------------------------------
    def _solve(
        self, gn: GaussNewtonBase, params: Params, g: Tensor, n: int, timers: dict[str, float]
    ) -> tuple[Any, Tensor, Tensor]:
        """Precondition (Algorithm 3), then solve with LSMR (Algorithm 6, Eq. (19)).

        LSMR minimises ``‖A(c∘y) − b‖² + λ²‖y − y0‖²`` and is stopped by the validation merit φ.

        Returns:
            ``(LSMR result, y, d)`` with the step ``d = c∘y`` (``y`` with ``step_space="literal"``).
        """
        cfg = self.cfg
        t = self._clock()
        c = self._precond(gn)
        timers["precond_time"] = self._clock() - t

        # LSMR on A·diag(c), warm start in its variable y
        scaled = cfg["step_space"] == "scaled" and c is not None
        if self.warm_d is None:
            y0 = None
        elif scaled and cfg["warm_start"] == "param":
            y0 = self.warm_d / c
        else:
            y0 = self.warm_y
        m = gn.residual.numel()
        # LSMR runs on A·diag(c): the operator applies c layer by layer (cache-friendly), and LSMR
        # reads each product before asking for the next, so both write into reused buffers
        jv_buf = torch.empty_like(gn.residual)
        jv_flat = jv_buf.view(-1)
        vj_buf = torch.empty_like(g)
        u_views: dict[tuple, Tensor] = {}  # LSMR passes the same u storage every time: one view

        def matvec(v: Tensor) -> Tensor:
            gn.jvp(v, out=jv_buf, col_scale=c)
            return jv_flat

        def rmatvec(u: Tensor) -> Tensor:
            key = (u.data_ptr(), u.stride())
            if key not in u_views:
                u_views.clear()
                u_views[key] = u.view(n, -1)
            return gn.vjp(u_views[key], out=vj_buf, col_scale=c)

        op = (matvec, rmatvec, (m, gn.numel))
        b = -gn.residual.reshape(-1)
        merit_time = [0.0]
        # the merit's trial point w + c∘y: c∘y into one buffer whose per-parameter views are built
        # once per solve, and one multi-tensor add (the same sums as _trial's per-tensor adds)
        step_buf = torch.empty_like(g)
        step_views = list(unflatten(step_buf, params).values())
        keys, base = list(params), list(params.values())

        def merit(yk: Tensor) -> float:
            t_m = self._clock()
            if scaled:
                torch.mul(c, yk, out=step_buf)
                assert self.val is not None
                value = self._loss(dict(zip(keys, torch._foreach_add(base, step_views))), *self.val)
            else:
                value = self._val_loss(params, yk)
            merit_time[0] += self._clock() - t_m
            return value

        t = self._clock()
        res = lsmr(
            op,
            b,
            damp=self.lam,
            atol=cfg["atol"],
            btol=0.0,
            conlim=0.0,
            maxiter=self.maxiter,
            x0=y0,
            merit=merit if cfg["merit"] else None,
            ftol=cfg["ftol"],
            miniter=cfg["miniter"],
            recover=cfg["recover"],
            return_best=cfg["return_best"],
            damp_center="x0" if cfg["damping_center"] == "warm_start" else "zero",
        )
        timers["lsmr_time"] = self._clock() - t
        timers["merit_time"] = merit_time[0]
        ysol = res.x
        d = c * ysol if scaled else ysol
        return res, ysol, d

    def _damping_and_line_search(
        self,
        gn: GaussNewtonBase,
        params: Params,
        x: Tensor,
        y: Tensor,
        f0: float,
        g: Tensor,
        d: Tensor,
        timers: dict[str, float],
    ) -> dict[str, Any]:
        """ρ and the Levenberg-Marquardt rule (Section 4.2), then Armijo backtracking on the batch.

        ρ uses the undamped GN model on the batch; the model holds the accepted weights after.

        Returns:
            ``rho``, ``pred``, ``f1``, ``s``, ``evals``, ``accepted``, ``nonfinite``, ``lam_used`` and
            ``new_params``.
        """
        cfg = self.cfg
        t = self._clock()
        lam_used = self.lam
        nonfinite = not bool(torch.isfinite(d).all())
        gd = float(torch.dot(g, d)) if not nonfinite else math.nan
        f1 = math.nan
        pred = math.nan
        if not nonfinite:
            ad = gn.jvp(d)
            pred = 0.5 * float((ad * ad).sum()) + gd
            f1 = self._loss(self._trial(params, d), x, y)
        if math.isfinite(f1) and math.isfinite(pred) and pred < 0:
            rho = (f1 - f0) / pred
        else:
            rho = -math.inf
        nonfinite = nonfinite or not math.isfinite(f1)
        if rho < cfg["rho_low"]:
            self.lam = self.lam / cfg["drop"]
        elif rho > cfg["rho_high"]:
            self.lam = self.lam * cfg["drop"]
        lam_raised = self.lam > lam_used

        # Armijo backtracking on the batch (cap on halvings; non-descent or non-finite rejects)
        s, evals, accepted = 1.0, 1, False
        if not nonfinite and gd < 0:
            f_s = f1
            for _ in range(cfg["max_halvings"] + 1):
                if not math.isfinite(f_s):
                    nonfinite = True
                    break
                if f_s <= f0 + cfg["armijo"] * s * gd:
                    accepted = True
                    break
                s *= 0.5
                if s < 0.5 ** cfg["max_halvings"]:
                    break
                f_s = self._loss(self._trial(params, d, s), x, y)
                evals += 1
        if not accepted:
            s = 0.0
            if nonfinite and not lam_raised:
                self.lam = self.lam / cfg["drop"]
            if nonfinite:
                log.warning(
                    "SHF iteration %d: non-finite value; step rejected, λ → %.4g", self.iteration, self.lam
                )
        new_params = self._trial(params, d, s) if accepted else params
        if accepted:
            self.objective.set_params(new_params)
            new_params = self.objective.params()
        timers["line_search_time"] = self._clock() - t
        return {
            "rho": rho,
            "pred": pred,
            "f1": f1,
            "s": s,
            "evals": evals,
            "accepted": accepted,
            "nonfinite": nonfinite,
            "lam_used": lam_used,
            "new_params": new_params,
        }

    def _batch_rule(
        self,
        gn: GaussNewtonBase,
        new_params: Params,
        accepted: bool,
        x: Tensor,
        y: Tensor,
        n: int,
        timers: dict[str, float],
    ) -> dict[str, Any]:
        """f_val, Algorithm 2's n̂ and Algorithm 1's batch-size update (Section 4.3).

        f_val is taken at the new weights, n̂ on the old batch; sets the next ``n`` and ``maxiter``.

        Returns:
            Every n̂ (``nhat1``, ``nhat2``, ``nhat_s``, ``nhat_m2``, the one used ``nhat``), ``v_sum``,
            ``gnorm``, the rule that fired (``reason``) and the ``n``/``maxiter`` this step used.
        """
        cfg = self.cfg
        # validation loss and the variance test at the new w on the old batch
        t = self._clock()
        if self.val is not None:
            if accepted or self.fval_current is None:
                self.fval_current = self._val_loss(new_params)
            self.fval_hist.append(self.fval_current)
        timers["val_time"] = self._clock() - t
        t = self._clock()
        gn_new = (
            residual_gauss_newton(self.objective, new_params, x, y, self.hand_written) if accepted else gn
        )
        gsum, gsq = gn_new.batch_gradient_moments()
        nhat1, v_sum, gnorm = variance_batch_size(gsum, gsq, n, self.num_train, cfg["theta"], 1)
        nhat2, _, _ = variance_batch_size(gsum, gsq, n, self.num_train, cfg["theta"], 2)
        nhat_s, _, _ = variance_batch_size(gsum, gsq, n, self.num_train, cfg["theta"], 1, "summand")
        nhat_m2, _, _ = variance_batch_size(gsum, gsq, n, self.num_train, cfg["theta"], 2, "batch_mean")
        nhat = variance_batch_size(
            gsum, gsq, n, self.num_train, cfg["theta"], cfg["variance_norm_power"], cfg["variance_gradients"]
        )[0]
        self.nhat_hist.append(nhat)
        timers["variance_time"] = self._clock() - t

        n_used, maxiter_used = self.n, self.maxiter
        reason = "warmup"
        w = cfg["stall_window"]
        if self.iteration > w:
            window = self.nhat_hist[-w:]
            if len(self.fval_hist) > w:
                lagged, now = self.fval_hist[-w - 1], self.fval_hist[-1]
            else:  # no validation split: the stall rule never fires
                lagged, now = math.inf, 1.0
            self.n, self.maxiter, reason = next_batch_size_rule(
                self.n,
                self.maxiter,
                window,
                lagged,
                now,
                cfg["n_max"],
                cfg["stall_threshold"],
                cfg["batch_growth"],
            )
        self.nhat_hist = self.nhat_hist[-w:]
        self.fval_hist = self.fval_hist[-(w + 1) :]
        return {
            "nhat1": nhat1,
            "nhat2": nhat2,
            "nhat_s": nhat_s,
            "nhat_m2": nhat_m2,
            "nhat": nhat,
            "v_sum": v_sum,
            "gnorm": gnorm,
            "reason": reason,
            "n_used": n_used,
            "maxiter_used": maxiter_used,
        }

    def step(self, batch: Batch) -> dict[str, Any]:
        """One outer iteration of Algorithm 1 on ``batch``; the model holds the new weights after.

        The phases, in the paper's order: the batch's residual, gradient and Gauss-Newton operator;
        :meth:`_solve` (Algorithm 3's preconditioner, LSMR with the validation merit, Algorithm 6 /
        Eq. (19)); :meth:`_damping_and_line_search` (ρ and the Levenberg-Marquardt rule, Section 4.2;
        Armijo backtracking); the warm start's decay (Section 4.5); :meth:`_batch_rule` (f_val,
        Algorithm 2's n̂ and the batch-size update, Section 4.3).

        Args:
            batch: ``(x, y)``, a fresh random batch of the size :meth:`next_batch_size` returned.

        Returns:
            The logged scalars listed in docs/shf.md ("Logged scalars"): ``loss``, ``batch_size``,
            ``damping``, ``inner_iters``, ``inner_stop``, ``rho``, ``step_length``, ``n_hat``,
            ``f_val``, timings, ...
        """
        cfg = self.cfg
        x, y = batch
        n = int(x.shape[0])
        self.iteration += 1
        params = self.objective.params()
        timers: dict[str, float] = {}
        t = self._clock()
        gn = residual_gauss_newton(self.objective, params, x, y, self.hand_written)
        f0 = gn.loss()
        g = gn.gradient()
        timers["setup_time"] = self._clock() - t

        res, ysol, d = self._solve(gn, params, g, n, timers)
        ls = self._damping_and_line_search(gn, params, x, y, f0, g, d, timers)

        # warm start for the next solve: the LSMR solution (not s·d), decayed
        if torch.isfinite(ysol).all():
            self.warm_d = d.mul(self.gamma)
            self.warm_y = ysol.mul(self.gamma)
        else:
            self.warm_d = self.warm_y = None
        gamma_used = self.gamma
        self.gamma = min(cfg["gamma_growth"] * self.gamma, cfg["gamma_max"])

        br = self._batch_rule(gn, ls["new_params"], ls["accepted"], x, y, n, timers)

        out: dict[str, Any] = {
            "loss": f0,
            "batch_size": n,
            "damping": ls["lam_used"],
            "damping_next": self.lam,
            "inner_iters": res.itn,
            "inner_stop": res.stop_reason,
            "lsmr_normr": res.normr,
            "lsmr_normar": res.normar,
            "merit_evals": len(res.merit_history),
            "merit_best_itn": res.best_itn if res.best_itn is not None else -1,
            "step_length": ls["s"],
            "rho": ls["rho"],
            "pred_reduction": ls["pred"],
            "loss_trial": ls["f1"],
            "line_search_evals": ls["evals"],
            "rejected": not ls["accepted"],
            "nonfinite": ls["nonfinite"],
            "grad_norm": float(torch.linalg.vector_norm(g)),
            "n_hat": br["nhat1"],
            "n_hat_sq": br["nhat2"],
            "n_hat_summand": br["nhat_s"],
            "n_hat_batch_mean_sq": br["nhat_m2"],
            "n_hat_used": br["nhat"],
            "variance": br["v_sum"],
            "grad_norm_new": br["gnorm"],
            "batch_rule": br["reason"],
            "next_batch_size": self.n,
            "gamma": gamma_used,
            "maxiter": br["maxiter_used"],
            "maxiter_next": self.maxiter,
            "batch_size_requested": br["n_used"],
        }
        if self.fval_current is not None:
            out["f_val"] = self.fval_current
        out.update(timers)
        return out


def build_shf(objective: Objective, data: DataBundle, **cfg: Any) -> SHF:
    """Factory for the loop (``_target_: curvopt.optim.shf.build_shf``).

    Args:
        objective: The model and its (squared-error) loss.
        data: The run's data bundle.
        **cfg: Keyword arguments of :class:`SHF`.

    Returns:
        The :class:`SHF` algorithm.
    """
    return SHF(objective, data, **cfg)


__all__ = [
    "SHF",
    "build_shf",
    "chapelle_erhan_precond",
    "variance_batch_size",
    "next_batch_size_rule",
]
