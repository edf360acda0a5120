"""Martens (2010) Hessian-free optimisation with CG — the SHF-LSMR paper's baseline.

Reproduces the behaviour of Martens' public MATLAB code (``nnet_train_2.m`` with
``conjgrad_1.m``) as docs/shf.md ("Martens' HF-CG baseline") summarises it; no code is copied.
One outer iteration:

1. Gradient ``g`` of the objective ``F(w) = mean_i l_i(w) + ½·wc·‖w_weights‖²`` on the **full
   training set** (chunked passes), and in the same passes the diagonal empirical Fisher
   ``mean_i (∇l_i)²`` (per-example squared gradients, never materialised: the ``(A²)ᵀ(Δ²)``
   identity for MLPs, chunked ``vmap`` otherwise).
2. Preconditioner ``M = (diag EF + λ + wc·mask)^0.75`` (Martens' exponent).
3. Martens' CG (:func:`curvopt.curvature.cg.martens_cg`) on ``(G_c + wc·mask + λI) p = −g`` where
   ``G_c`` is the Gauss-Newton of the mean loss on one of ``numchunks`` fixed chunks of the
   (once permuted) training set, cycled in order ("hybrid mode"); warm start ``0.95 ×`` the
   previous final CG iterate; φ-progress stopping; iterates stored at ``ceil(5·1.3^j)``.
4. CG-backtracking: walk the stored iterates from last to first while ``F`` on the full
   training set keeps decreasing; take the best.
5. ρ on the curvature chunk: ``(F_c(w+p) − F_c(w)) / (gᵀp + ½pᵀ(G_c + wc·mask)p)`` (undamped
   model, full-set g), ``ρ = −∞`` if the chunk objective went up; ``ρ < 0.25`` or NaN ⇒ ``λ·3/2``,
   ``ρ > 0.75`` ⇒ ``λ·2/3``.
6. Armijo line search on the full training set: rate 1, ``c = 1e-2``, rate ×0.8, at most 60
   reductions, then the step is rejected.

The loop's batch is ignored (HF-CG reads ``data.train`` itself); :meth:`HFCG.next_batch_size`
returns the curvature-chunk size so the logged batch size is the curvature batch (Figure 3).
Martens' model is a logistic autoencoder with a *linear* code layer and logits output trained
with ``sigmoid_bce``; the reported error (squared error on ``sigmoid(logits)``) is the loop's
evaluation, not this module's business.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap

from curvopt.api import Batch, DataBundle
from curvopt.curvature.cg import MartensCGResult, martens_cg
from curvopt.curvature.mlp_gn import MLPGaussNewton, mlp_layers
from curvopt.objective import (
    Objective,
    Params,
    flatten,
    output_hessian_vp,
    per_example_loss,
    unflatten,
)
from curvopt.optim import checks

log = logging.getLogger(__name__)

PRECONDITIONERS = ("empirical_fisher", "none")
CURVATURE_PRODUCTS = ("auto", "mlp", "linearize", "jvp")


# -- pieces that are tested on their own --------------------------------------------------------
def weight_mask(params: Params) -> Tensor:
    """Flat 0/1 mask of the parameters the L2 weight cost applies to.

    Weights (``dim ≥ 2``), not biases: the weight cost this repository uses (docs/decisions.md,
    SHF-16).
    Martens' public ``nnet_train_2.m`` does *not* do this: its ``maskp`` is all ones (the line
    that zeroes the bias entries is commented out, "not masking out the weight-decay for
    biases"), so his weight cost, preconditioner and CG damping include biases.
    With wc = 2e-5 the difference is negligible next to λ; kept so the default path is unchanged.

    Args:
        params: Name → tensor dict in flat order.

    Returns:
        A flat vector, 1 on entries of tensors with ``dim ≥ 2`` and 0 elsewhere.
    """
    return torch.cat(
        [
            torch.full((p.numel(),), 1.0 if p.dim() >= 2 else 0.0, dtype=p.dtype, device=p.device)
            for p in params.values()
        ]
    )


def update_damping(
    lam: float, rho: float, boost: float = 1.5, drop: float = 2.0 / 3.0, low: float = 0.25, high: float = 0.75
) -> float:
    """Levenberg-Marquardt rule of Martens' code.

    Args:
        lam: Current damping λ.
        rho: Reduction ratio ρ (may be NaN or −inf).
        boost: Factor applied when ``ρ < low`` or ρ is NaN.
        drop: Factor applied when ``ρ > high``.
        low: Lower ρ threshold.
        high: Upper ρ threshold.

    Returns:
        The new λ (unchanged for ``low ≤ ρ ≤ high``).
    """
    if math.isnan(rho) or rho < low:
        return lam * boost
    if rho > high:
        return lam * drop
    return lam


def _sequential_linear(model: nn.Module) -> bool:
    """Whether the model is an ``nn.Sequential`` whose only parameters live in ``nn.Linear`` layers.

    Every other child is parameter-free (and elementwise in practice); then the per-example
    squared-gradient sums have the closed form used in :func:`gradient_moments`.
    """
    if not isinstance(model, nn.Sequential):
        return False
    for child in model:
        if isinstance(child, nn.Linear):
            continue
        if any(True for _ in child.parameters()):
            return False
    return True


def _moments_sequential(
    objective: Objective, params: Params, x: Tensor, y: Tensor, want_sq: bool
) -> tuple[float, dict[str, Tensor], dict[str, Tensor] | None]:
    """Sums of per-example losses, gradients and squared gradients of an ``nn.Sequential`` MLP.

    One forward and one backward.

    With ``a_i`` the input of a linear layer and ``δ_i = ∂l_i/∂z_i`` the gradient at its output
    (only example i's loss depends on ``z_i``), ``∇_W l_i = δ_i a_iᵀ``, so
    ``Σ_i ∇_W l_i = Δᵀ A`` and ``Σ_i (∇_W l_i)² = (Δ²)ᵀ (A²)``; for the bias ``Σ δ_i`` and ``Σ δ_i²``.
    """
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    inputs: dict[str, Tensor] = {}
    outs: dict[str, Tensor] = {}
    with torch.enable_grad():
        h = x
        for idx, child in enumerate(objective.model):
            if isinstance(child, nn.Linear):
                name = str(idx)
                weight = leaves[f"{name}.weight"]
                bias = leaves.get(f"{name}.bias")
                inputs[name] = h.detach()
                h = F.linear(h, weight, bias)
                outs[name] = h
            else:
                h = child(h)
        total = per_example_loss(h, y, objective.loss_kind, objective.ignore_index).sum()
        names = list(outs)
        deltas = torch.autograd.grad(total, [outs[n] for n in names])
    gsum: dict[str, Tensor] = {}
    gsq: dict[str, Tensor] | None = {} if want_sq else None
    for name, delta in zip(names, deltas):
        a = inputs[name]
        gsum[f"{name}.weight"] = delta.T @ a
        if f"{name}.bias" in leaves:
            gsum[f"{name}.bias"] = delta.sum(0)
        if gsq is not None:
            d2 = delta * delta
            gsq[f"{name}.weight"] = d2.T @ (a * a)
            if f"{name}.bias" in leaves:
                gsq[f"{name}.bias"] = d2.sum(0)
    return float(total.detach()), gsum, gsq


def _moments_vmap(
    objective: Objective, params: Params, x: Tensor, y: Tensor, want_sq: bool, max_elements: int
) -> tuple[float, dict[str, Tensor], dict[str, Tensor] | None]:
    """Generic fallback of :func:`gradient_moments`: per-example gradients by ``vmap(grad)``.

    Sub-chunks hold at most ``max_elements`` gradient entries, summed and squared-summed on the
    fly.
    """
    numel = sum(p.numel() for p in params.values())
    sub = max(1, max_elements // max(numel, 1))

    def one(p: Params, xi: Tensor, yi: Tensor) -> Tensor:
        out = objective.forward(p, xi.unsqueeze(0))
        return per_example_loss(out, yi.unsqueeze(0), objective.loss_kind, objective.ignore_index).sum()

    per_grad = vmap(grad(one), in_dims=(None, 0, 0))
    gsum = {k: torch.zeros_like(v) for k, v in params.items()}
    gsq = {k: torch.zeros_like(v) for k, v in params.items()} if want_sq else None
    total = 0.0
    with torch.no_grad():
        total = float(objective.per_example_losses(params, x, y).sum())
    for i in range(0, x.shape[0], sub):
        g = per_grad(params, x[i : i + sub], y[i : i + sub])
        for k, gk in g.items():
            gsum[k] += gk.sum(0)
            if gsq is not None:
                gsq[k] += (gk * gk).sum(0)
    return total, gsum, gsq


def gradient_moments(
    objective: Objective,
    params: Params,
    x: Tensor,
    y: Tensor,
    chunk: int = 10000,
    want_sq: bool = True,
    max_vmap_elements: int = 1 << 25,
) -> tuple[float, Tensor, Tensor | None]:
    """Sums of per-example losses, gradients and squared gradients over all rows of ``x``.

    Processed in chunks of ``chunk`` rows so the full training set never sits in one graph; the
    squared sums never materialise all per-example gradients (closed form for plain
    ``nn.Sequential`` MLPs, chunked ``vmap(grad)`` otherwise).

    Args:
        objective: The model and its loss kind.
        params: The point (name → tensor dict; fixes the flat order).
        x: Inputs, example index first (e.g. the full training set).
        y: Targets.
        chunk: Rows per forward/backward pass.
        want_sq: Also compute the squared-gradient sums (the empirical Fisher diagonal).
        max_vmap_elements: Largest number of per-example gradient entries held at once by the
            ``vmap`` fallback.

    Returns:
        ``(Σ_i l_i, Σ_i ∇l_i, Σ_i (∇l_i)²)``: a float and flat vectors in ``params`` order (the
        last ``None`` when ``want_sq`` is false).
    """
    exact = _sequential_linear(objective.model)
    loss_sum = 0.0
    gsum_flat: Tensor | None = None
    gsq_flat: Tensor | None = None
    for i in range(0, x.shape[0], chunk):
        xb, yb = x[i : i + chunk], y[i : i + chunk]
        if exact:
            ls, gs, gq = _moments_sequential(objective, params, xb, yb, want_sq)
        else:
            ls, gs, gq = _moments_vmap(objective, params, xb, yb, want_sq, max_vmap_elements)
        loss_sum += ls
        g_flat = flatten([gs[k] for k in params])
        gsum_flat = g_flat if gsum_flat is None else gsum_flat.add_(g_flat)
        if gq is not None:
            q_flat = flatten([gq[k] for k in params])
            gsq_flat = q_flat if gsq_flat is None else gsq_flat.add_(q_flat)
    assert gsum_flat is not None
    return loss_sum, gsum_flat, gsq_flat


def _case_order(num_train: int, shuffle: bool, seed: int) -> Tensor:
    """The training cases' order, fixed for the whole run: chunk c is a contiguous slice of it.

    Martens permutes once (with its own seeded generator, so the run's global RNG is untouched)
    and then cycles through the same ``numchunks`` curvature chunks in order ("hybrid mode").
    """
    if shuffle:
        return torch.randperm(num_train, generator=torch.Generator().manual_seed(int(seed)))
    return torch.arange(num_train)


#: HF-CG's hyper-parameters and what each may be (``curvopt.optim.checks``), checked at construction.
HFCG_RANGES: dict[str, checks.Range] = {
    **dict.fromkeys(
        (
            "initlambda",
            "rho_low",
            "rho_high",
            "weight_cost",
            "cg_progress_tol",
            "cg_gap_ratio",
            "precon_exponent",
        ),
        checks.NONNEG,
    ),
    **dict.fromkeys(("numchunks", "cg_maxiter", "eval_chunk"), checks.count(1)),
    **dict.fromkeys(("cg_miniter", "cg_min_gap", "ls_max_reductions"), checks.count(0)),
    "boost": checks.at_least(1.0),
    "drop": checks.real(0.0, 1.0, low_open=True),
    "cg_decay": checks.real(0.0, 1.0),
    "ls_c": checks.UNIT,
    "ls_factor": checks.real(0.0, 1.0, low_open=True, high_open=True),
    "seed": checks.INTEGER,
    "preconditioner": checks.one_of(*PRECONDITIONERS),
    "curvature_products": checks.one_of(*CURVATURE_PRODUCTS),
    **dict.fromkeys(("shuffle", "cg_backtracking", "line_search", "sync_timers"), checks.FLAG),
}


class HFCG:
    """Martens' Hessian-free optimiser with CG (an ``Algorithm``; see the module docstring).

    Defaults are the values of Martens' public demo code (conf/optimizer/hf_cg.yaml).

    Args:
        objective: The model and its loss (Martens: ``sigmoid_bce`` on a logistic autoencoder
            with a linear code layer).
        data: The run's data; ``train`` must be in memory (full-set gradient, backtracking and
            line search).
        initlambda: Initial damping λ, added to the chunk-mean Gauss-Newton.
        boost: ``ρ < rho_low`` or NaN ⇒ ``λ·boost``.
        drop: ``ρ > rho_high`` ⇒ ``λ·drop``.
        rho_low: Lower ρ threshold.
        rho_high: Upper ρ threshold.
        weight_cost: L2 weight cost wc: ``½·wc·‖w_weights‖²`` on weights, not biases (see
            :func:`weight_mask`).
        numchunks: Number of fixed curvature chunks of the once-permuted training set, cycled in
            order; the chunk size is the logged batch size.
        shuffle: Permute the training cases once (with ``seed``) before chunking.
        cg_maxiter: CG iteration cap (Martens: 250).
        cg_miniter: CG iterations before the progress test may stop it.
        cg_decay: Warm start ``x0 = cg_decay ·`` the previous final CG iterate.
        cg_progress_tol: Stop when ``(φ_i − φ_{i−k})/φ_i < k·tol``,
            ``k = max(cg_min_gap, ceil(cg_gap_ratio·i))``.
        cg_gap_ratio: Look-back window of the progress test as a fraction of i.
        cg_min_gap: Smallest look-back window.
        preconditioner: ``"empirical_fisher"``: ``M = (diag EF + λ + wc·mask)^precon_exponent``;
            ``"none"``.
        precon_exponent: Exponent of the preconditioner (Martens: 0.75).
        cg_backtracking: Walk the stored CG iterates back while the full-set objective decreases.
        line_search: Armijo line search on the full training set.
        ls_c: Armijo constant.
        ls_factor: Rate reduction factor per line-search trial.
        ls_max_reductions: At most this many trial rates, then the step is rejected (rate 0).
        eval_chunk: Rows per forward/backward in full-training-set passes.
        curvature_products: How the Gauss-Newton products are computed: ``"auto"`` (hand-written
            cached MLP products for a plain MLP, else ``"linearize"``), ``"mlp"``,
            ``"linearize"`` (``torch.func.linearize`` + a kept VJP graph) or ``"jvp"``
            (recompute the forward in every product; least memory).
        seed: Seed of the one-time permutation of the training cases.
        sync_timers: Synchronise the device at both ends of every phase timer (CUDA only; nothing
            changes on a CPU), so each ``*_time`` holds its own phase's device work instead of
            the next phase that waits for the device absorbing it. Off by default: each
            synchronisation drains the launch queue; the step's total time is the same either
            way.

    Raises:
        ValueError: On an unknown choice string, a streamed training set, or sizes below 1 /
            more chunks than examples.
    """

    def __init__(
        self,
        objective: Objective,
        data: DataBundle,
        initlambda: float = 45.0,
        boost: float = 1.5,
        drop: float = 2.0 / 3.0,
        rho_low: float = 0.25,
        rho_high: float = 0.75,
        weight_cost: float = 2e-5,
        numchunks: int = 4,
        shuffle: bool = True,
        cg_maxiter: int = 250,
        cg_miniter: int = 1,
        cg_decay: float = 0.95,
        cg_progress_tol: float = 5e-4,
        cg_gap_ratio: float = 0.1,
        cg_min_gap: int = 10,
        preconditioner: str = "empirical_fisher",
        precon_exponent: float = 0.75,
        cg_backtracking: bool = True,
        line_search: bool = True,
        ls_c: float = 1e-2,
        ls_factor: float = 0.8,
        ls_max_reductions: int = 60,
        eval_chunk: int = 10000,
        curvature_products: str = "auto",
        seed: int = 0,
        sync_timers: bool = False,
    ) -> None:
        values = locals()
        checks.check_hparams("HF-CG", HFCG_RANGES, values, ordered=[("rho_low", "rho_high")])
        if data.train is None:
            raise ValueError("HF-CG needs an in-memory training split (full-set gradient and line search)")
        checks.check_trainable("HF-CG", objective.params(), one_dtype=True)
        self.objective = objective
        self.x_train, self.y_train = data.train
        self.num_train = data.num_train
        if numchunks > self.num_train:
            raise ValueError(f"numchunks={numchunks} exceeds the {self.num_train} training examples")
        # what the step reads, in the types HFCG_RANGES declares (float, int, bool; choices as given)
        kept = [k for k in HFCG_RANGES if k not in ("initlambda", "shuffle", "seed", "sync_timers")]
        self.cfg = checks.typed(HFCG_RANGES, values, kept)
        self.perm = _case_order(self.num_train, shuffle, seed).to(self.x_train.device)
        device = self.x_train.device
        self._sync_device = device if sync_timers and device.type == "cuda" else None
        # -- state (all in state_dict) --------------------------------------------------------------
        self.lam = float(initlambda)
        self.chunk_index = 0
        self.iteration = 0
        self.prev_solution: Tensor | None = None  # final CG iterate of the last solve (undecayed)

    # -- protocol ------------------------------------------------------------------------------------
    def _chunk_indices(self, c: int) -> Tensor:
        return torch.tensor_split(self.perm, self.cfg["numchunks"])[c]

    def next_batch_size(self) -> int | None:
        """The size of the next curvature chunk (so the loop logs the curvature batch size).

        Returns:
            The number of examples in the current chunk.
        """
        return int(self._chunk_indices(self.chunk_index).numel())

    def state_dict(self) -> dict[str, Any]:
        """Damping, chunk position, iteration, the last CG solution and the permutation.

        Returns:
            A dict accepted by :meth:`load_state_dict`.
        """
        return {
            "lam": self.lam,
            "chunk_index": self.chunk_index,
            "iteration": self.iteration,
            "prev_solution": None if self.prev_solution is None else self.prev_solution.detach().clone(),
            "perm": self.perm.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (tensors moved to the data's device).

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.lam = float(state["lam"])
        self.chunk_index = int(state["chunk_index"])
        self.iteration = int(state["iteration"])
        device = self.x_train.device
        prev = state["prev_solution"]
        self.prev_solution = None if prev is None else prev.detach().clone().to(device)
        self.perm = state["perm"].clone().to(device)

    # -- objective pieces ------------------------------------------------------------------------------
    def _trial(self, params: Params, d: Tensor, s: float = 1.0) -> Params:
        dd = unflatten(d, params)
        return {k: torch.add(v, dd[k], alpha=s) for k, v in params.items()}

    def _weight_cost_term(self, w_flat: Tensor, mask: Tensor) -> float:
        wm = w_flat * mask
        return 0.5 * self.cfg["weight_cost"] * float(torch.dot(wm.double(), wm.double()))

    @torch.no_grad()
    def _data_loss(self, params: Params, x: Tensor, y: Tensor) -> float:
        """Mean per-example loss over the rows of ``x`` (chunked forward passes)."""
        total = 0.0
        chunk = self.cfg["eval_chunk"]
        for i in range(0, x.shape[0], chunk):
            total += float(
                self.objective.per_example_losses(params, x[i : i + chunk], y[i : i + chunk]).sum()
            )
        return total / x.shape[0]

    def _objective_value(self, params: Params, mask: Tensor, x: Tensor, y: Tensor) -> float:
        """``F(w) = mean loss + ½·wc·‖w_weights‖²``; +inf when not finite (a failed trial)."""
        value = self._data_loss(params, x, y) + self._weight_cost_term(flatten(params), mask)
        return value if math.isfinite(value) else math.inf

    def _ggn_operator(self, params: Params, x: Tensor, y: Tensor) -> Callable[[Tensor], Tensor]:
        """Flat ``v ↦ G v = (1/n) Jᵀ H_out J v`` for the mean loss on the chunk.

        No damping, no weight cost; built once per outer iteration and reused by every CG
        product.

        ``mlp`` (``auto`` picks it for plain ``nn.Sequential`` MLPs): the hand-written cached
        J/Jᵀ products of :class:`~curvopt.curvature.mlp_gn.MLPGaussNewton` (the network Jacobian
        does not depend on the loss; each carries 1/√n, so the pair gives the 1/n); ``linearize``:
        ``torch.func.linearize`` + a kept ``vjp`` graph (any model; pays a trace per iteration);
        ``jvp``: recompute the forward in every product (least memory).

        The ``mlp`` product returns a buffer it reuses on the next call: read (or copy) the result
        before asking for another product.
        """
        n = x.shape[0]
        kind, obj = self.objective.loss_kind, self.objective
        mode = self.cfg["curvature_products"]
        plan = mlp_layers(obj.model, params) if mode in ("auto", "mlp") else None
        if mode == "mlp" and plan is None:
            raise ValueError("curvature_products='mlp' needs an nn.Sequential of Linear + activations")
        if plan is not None:
            # the residual target is irrelevant for J; a zero target of the output's shape
            dummy = torch.zeros(n, plan[-1].shape[0], dtype=x.dtype, device=x.device)
            gn = MLPGaussNewton(Objective(obj.model, "squared_error"), params, x.reshape(n, -1), dummy)
            out_mlp = gn.output  # (n, m_out), as the module's forward returns it for flat inputs
            # both products write into buffers owned by the operator (no allocation per product);
            # a diagonal output Hessian (sigmoid BCE: p(1−p), squared error: I) is formed once
            jv_buf = torch.empty_like(out_mlp)
            gv_buf = torch.empty(gn.numel, dtype=out_mlp.dtype, device=out_mlp.device)
            h_diag: Tensor | None = None
            if kind == "sigmoid_bce":
                prob = torch.sigmoid(out_mlp)
                h_diag = prob * (1 - prob)

            def gv_mlp(v: Tensor) -> Tensor:
                jv = gn.jvp(v, out=jv_buf)
                if kind == "squared_error":
                    hjv = jv
                elif h_diag is not None:
                    hjv = jv.mul_(h_diag)
                else:
                    hjv = output_hessian_vp(out_mlp, jv, kind, y)
                return gn.vjp(hjv, out=gv_buf)

            return gv_mlp
        if mode == "jvp":
            return lambda v: flatten(obj.ggn_vp(params, x, y, unflatten(v, params)))
        with warnings.catch_warnings():
            # torch.func.linearize's constant folding warns about a get_attr node; harmless here
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
            outputs, jvp_fn, vjp_fn = obj.linearize(params, x)
        outputs = outputs.detach()

        def gv(v: Tensor) -> Tensor:
            jv = jvp_fn(unflatten(v, params))
            hjv = output_hessian_vp(outputs, jv, kind, y)
            return flatten(vjp_fn(hjv)).div_(float(n))

        return gv

    # -- one outer iteration -----------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, Any]:
        """One outer iteration (module docstring, steps 1–6); the model holds the new weights after.

        Args:
            batch: Ignored: HF-CG reads ``data.train`` (full-set gradient, its own chunks).

        Returns:
            Logged scalars: ``loss`` (full-set mean loss before the step), ``objective`` (with the
            weight cost), ``objective_after``, ``damping``, ``inner_iters``, ``inner_stop``,
            ``rho``, ``step_length``, ``accepted``, the chunk index and size, timings, ...
        """
        del batch  # HF-CG works on data.train: full-set gradient, its own curvature chunks
        cfg = self.cfg
        params = self.objective.params()
        mask = weight_mask(params)
        timers: dict[str, float] = {}
        with _timed(timers, "grad_time", self._sync_device):
            f0_data, f0, g, gsq = self._full_gradient(params, mask)  # step 1
        with _timed(timers, "precond_time", self._sync_device):
            precond = self._preconditioner(gsq, mask)  # step 2, with the λ of this iteration
        lam, chunk = self.lam, self.chunk_index
        idx = self._chunk_indices(chunk)
        with _timed(timers, "cg_time", self._sync_device):
            xc, yc = self.x_train[idx], self.y_train[idx]
            gv = self._ggn_operator(params, xc, yc)
            res = self._solve(gv, g, precond, mask, lam)  # step 3
        with _timed(timers, "backtrack_time", self._sync_device):
            pos, f_best, evals = self._backtrack(params, res.stored, mask)  # step 4
        p = res.stored[pos][1]
        with _timed(timers, "rho_time", self._sync_device):
            rho, gp = self._reduction_ratio(params, g, p, gv, mask, xc, yc)  # step 5
            self.lam = update_damping(lam, rho, cfg["boost"], cfg["drop"], cfg["rho_low"], cfg["rho_high"])
        with _timed(timers, "line_search_time", self._sync_device):
            rate, reductions, accepted, f_after = self._line_search(params, p, mask, f0, f_best, gp)  # step 6

        self.iteration += 1
        self.chunk_index = (chunk + 1) % cfg["numchunks"]
        return {
            "loss": f0_data,
            "objective": f0,
            "objective_after": f_after,
            "grad_norm": float(torch.linalg.vector_norm(g)),
            "damping": lam,
            "damping_next": self.lam,
            "inner_iters": res.iterations,
            "inner_stop": res.stop_reason,
            "cg_phi": res.phi[-1] if res.phi else math.nan,
            "cg_backtrack_index": res.stored[pos][0],
            "cg_backtrack_steps": len(res.stored) - 1 - pos,
            "full_evals": evals + reductions,
            "step_length": rate,
            "ls_reductions": reductions,
            "accepted": int(accepted),
            "rho": rho,
            "chunk_index": chunk,
            "chunk_size": int(idx.numel()),
            **timers,
        }

    # -- the phases of :meth:`step` (module docstring, steps 1–6) ----------------------------------------
    def _full_gradient(self, params: Params, mask: Tensor) -> tuple[float, float, Tensor, Tensor | None]:
        """Step 1: gradient of F on the full training set and, in the same passes, the EF diagonal.

        Returns:
            ``(mean data loss, F(w), g, Σ_i (∇l_i)² or None)``; the squared sums only for the
            empirical-Fisher preconditioner (they cost a second reduction per layer).
        """
        w_flat = flatten(params)
        want_sq = self.cfg["preconditioner"] == "empirical_fisher"
        loss_sum, gsum, gsq = gradient_moments(
            self.objective, params, self.x_train, self.y_train, chunk=self.cfg["eval_chunk"], want_sq=want_sq
        )
        f0_data = loss_sum / self.num_train
        f0 = f0_data + self._weight_cost_term(w_flat, mask)
        g = gsum.div_(self.num_train).add_(w_flat * mask, alpha=self.cfg["weight_cost"])
        return f0_data, f0, g, gsq

    def _preconditioner(self, gsq: Tensor | None, mask: Tensor) -> Tensor | None:
        """Step 2: Martens' ``M = (diag EF + λ + wc·mask)^0.75`` (``None`` without the EF sums)."""
        if gsq is None:
            return None
        cfg = self.cfg
        return (gsq.div_(self.num_train) + self.lam + cfg["weight_cost"] * mask).pow_(cfg["precon_exponent"])

    def _solve(
        self, gv: Callable[[Tensor], Tensor], g: Tensor, precond: Tensor | None, mask: Tensor, lam: float
    ) -> MartensCGResult:
        """Step 3: Martens' CG on ``(G_c + wc·mask + λI) p = −g``, warm-started from the last solve.

        The final iterate (undecayed) is kept for the next warm start, unless it is not finite.
        """
        cfg = self.cfg
        # (G + wc·mask + λI) v with the diagonal wc·mask + λ formed once per solve: one fused pass
        shift = (mask * cfg["weight_cost"]).add_(lam)

        def damped(v: Tensor) -> Tensor:
            return gv(v).addcmul_(v, shift)

        x0 = None if self.prev_solution is None else self.prev_solution * cfg["cg_decay"]
        res: MartensCGResult = martens_cg(
            damped,
            -g,
            x0=x0,
            precond=precond,
            maxiter=cfg["cg_maxiter"],
            miniter=cfg["cg_miniter"],
            progress_tol=cfg["cg_progress_tol"],
            gap_ratio=cfg["cg_gap_ratio"],
            min_gap=cfg["cg_min_gap"],
        )
        finite = bool(torch.isfinite(res.x).all())
        self.prev_solution = res.x.detach().clone() if finite else None
        return res

    def _backtrack(
        self, params: Params, stored: list[tuple[int, Tensor]], mask: Tensor
    ) -> tuple[int, float, int]:
        """Step 4: CG-backtracking over the stored iterates, on the full training set.

        Walks from the last stored iterate back while F keeps decreasing (Martens: later CG
        iterates fit the curvature chunk better but may overfit it).

        Returns:
            ``(index into stored, F there, full-set evaluations spent)``.
        """
        x_tr, y_tr = self.x_train, self.y_train
        pos = len(stored) - 1
        f_best = self._objective_value(self._trial(params, stored[pos][1]), mask, x_tr, y_tr)
        evals = 1
        if self.cfg["cg_backtracking"]:
            for j in range(len(stored) - 2, -1, -1):
                f_j = self._objective_value(self._trial(params, stored[j][1]), mask, x_tr, y_tr)
                evals += 1
                if f_j > f_best:
                    break
                f_best, pos = f_j, j
        return pos, f_best, evals

    def _reduction_ratio(
        self,
        params: Params,
        g: Tensor,
        p: Tensor,
        gv: Callable[[Tensor], Tensor],
        mask: Tensor,
        xc: Tensor,
        yc: Tensor,
    ) -> tuple[float, float]:
        """Step 5: ρ on the curvature chunk with the undamped model ``gᵀp + ½pᵀ(G_c + wc·mask)p``.

        Returns:
            ``(ρ, gᵀp)``: ρ is −∞ when the chunk objective went up and NaN when the model
            predicts no decrease (both boost λ); ``gᵀp`` is the line search's slope.
        """
        wc = self.cfg["weight_cost"]
        gp = float(torch.dot(g.double(), p.double()))
        pgp = float(torch.dot(p.double(), (gv(p) + wc * mask * p).double()))
        denom = gp + 0.5 * pgp
        fc0 = self._objective_value(params, mask, xc, yc)
        fc1 = self._objective_value(self._trial(params, p), mask, xc, yc)
        if fc1 > fc0 or not math.isfinite(fc1):
            rho = -math.inf
        elif denom < 0 and math.isfinite(denom):
            rho = (fc1 - fc0) / denom
        else:
            rho = math.nan  # model predicts no decrease: treated like Martens' NaN (λ boosted)
        return rho, gp

    def _line_search(
        self, params: Params, p: Tensor, mask: Tensor, f0: float, f_best: float, gp: float
    ) -> tuple[float, int, bool, float]:
        """Step 6: Armijo line search on the full training set; sets the new weights if accepted.

        Starts from the backtracking value (rate 1 was evaluated there), so an accepted first
        trial costs no extra pass.

        Returns:
            ``(rate, reductions, accepted, F after the step)``; rate 0 and F(w) when rejected.
        """
        cfg = self.cfg
        rate, reductions, accepted = 1.0, 0, False
        f_rate = f_best
        if not cfg["line_search"]:
            accepted = math.isfinite(f_rate)
        else:
            while True:
                if math.isfinite(f_rate) and f_rate <= f0 + cfg["ls_c"] * rate * gp:
                    accepted = True
                    break
                if reductions >= cfg["ls_max_reductions"] - 1:
                    break
                rate *= cfg["ls_factor"]
                reductions += 1
                f_rate = self._objective_value(self._trial(params, p, rate), mask, self.x_train, self.y_train)
        if accepted:
            self.objective.set_params(self._trial(params, p, rate))
            f_after = f_rate
        else:
            rate, f_after = 0.0, f0
            log.info("HF-CG iteration %d: line search failed; step rejected", self.iteration + 1)
        return rate, reductions, accepted, f_after


@contextmanager
def _timed(timers: dict[str, float], key: str, sync: torch.device | None = None) -> Iterator[None]:
    """Record the wall time of the block under ``timers[key]`` (logged per phase of :meth:`HFCG.step`).

    With a CUDA ``sync`` device the device is synchronised at both ends, so the block's kernels
    are billed to it rather than to the next phase that waits for the device.
    """
    if sync is not None:
        torch.cuda.synchronize(sync)
    t = time.perf_counter()
    yield
    if sync is not None:
        torch.cuda.synchronize(sync)
    timers[key] = time.perf_counter() - t


def build_hf_cg(objective: Objective, data: DataBundle, **cfg: Any) -> HFCG:
    """Factory the loop calls (``conf/optimizer/hf_cg.yaml``).

    Args:
        objective: The model and its loss.
        data: The run's data bundle.
        **cfg: Keyword arguments of :class:`HFCG`.

    Returns:
        The :class:`HFCG` algorithm.
    """
    return HFCG(objective, data, **cfg)
