"""Alice and Alice-0 (Gong et al., Algorithms 2–4 and 10; docs/alice.md).

Alice is a low-rank Eigen-Adam: Adam run in the rotated space of the leading eigenvectors ``U`` of
``E[G Gᵀ]``, made cheap and made to work at low rank by three steps (paper Section 5):

1. **tracking** — keep only the projected covariance ``Q̃ = EMA_β3(σ σᵀ)`` (r×r, ``σ = UᵀG``) and
   reconstruct ``Q ≈ U Q̃ Uᵀ`` when the basis is refreshed (every ``K`` steps);
2. **switching** (Alg. 2) — at a refresh, one subspace-iteration step with Rayleigh–Ritz (Alg. 10)
   gives the new leading basis ``U'``; keep its top ``l`` columns and fill the other ``r − l`` with
   directions sampled uniformly from the orthonormal complement of ``U'``, so the basis cannot get
   stuck in the old leading subspace (Prop. 4);
3. **optimal compensation** (Alg. 3, Thm 5.1) — the discarded part of the full-rank step is
   approximated by column-scaling the residual ``G − UUᵀG`` with ``√(m−r)/√p``, ``p`` = EMA (β1)
   of the per-column squared residual norms, under Fira's norm-growth limiter.

The step is ``W ← W − λ α (U ω + α_c Δ_c)`` with ``ω = m/(√v + ε)`` (no bias correction).
**Alice-0** is ``beta3 = 0``: no ``Q̃`` is stored and the refresh uses ``G Gᵀ`` alone.

Choices the paper leaves open (docs/alice.md, "Flags and choices where the paper is
silent", and docs/decisions.md, RACS-9 to RACS-18), each a constructor flag:

* ``init="evd"``: at t = 1 (``U_0 = 0``) the exact top-r eigenvectors of ``G₁G₁ᵀ``, then Switch;
* ``reproject_qtilde=True``: at a switch re-express ``Q̃`` in the new basis, ``Q̃ ← R Q̃ Rᵀ`` with
  ``R = UᵀU_old`` (``False`` = Alg. 4 literally, keeps it in the old coordinates);
* ``moments_on_switch="keep"`` (GaLore behaviour) or ``"reset"`` for ``m``, ``v`` at a switch;
* ``eps=1e-8`` in ``ω`` and in ``1/√p``; ``bias_correction=False`` (literal);
* ``project_side="smaller"``: ``U`` spans the smaller side of the weight (gate/up/lm_head are
  transposed), the paper's ``m ≤ n``; ``"rows"`` always projects the output side;
* ``switch``: ``"complement"`` (Alg. 2) or the Fig. 5b ablations ``"none"`` (top-r of the
  Rayleigh–Ritz basis), ``"gaussian"``, ``"gaussian_mix"``, ``"full_basis"``;
* ``compensation``: ``"optimal"`` (Alg. 3) or the Fig. 5c ablations ``"none"``, ``"fira"``,
  ``"fira_plus"``;
* ``fused_compensation=True`` forms the update as ``U(ω − c σD) + c G D`` and the norm of the
  compensation from ``‖g_j‖² − ‖σ_j‖²``, i.e. without materialising the residual — algebraically the
  same as Alg. 3 for orthonormal ``U``; the non-orthonormal Gaussian ablations always use the
  explicit residual;
* the complement draw uses a generator seeded by ``(seed, param index, switch count)`` stored in
  the state, so a resumed run samples the same directions on any device.

Degenerate shapes: a rank above a weight's projected side ``m`` is refused unless
``clamp_rank=True``, which uses ``r = m`` there. With ``r = m`` the projection is full rank (``U`` is the complete
eigenbasis, no switching, zero compensation); if the complement has fewer than ``r − l``
directions all of them are used and the remaining slots keep the next leading vectors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from curvopt.optim import checks
from curvopt.optim.alice_basis import (
    SEED_STRIDE,
    SWITCH_MODES,
    canonical_signs,
    sample_indices,
    subspace_iteration,
    switch_basis,
    switch_generator,
    top_eigvecs,
)
from curvopt.optim.matrix import (
    MatrixOptimizer,
    bank_slice,
    chunk_slices,
    compute_dtype,
    ema_update,
    foreach_add_scaled,
    limiter_eta,
)

COMPENSATION_MODES = ("optimal", "none", "fira", "fira_plus")
DEFAULT_LEADING = 40  # l of Table 11 (at most the rank)


# ----------------------------------------------------------------------------- optimizer


class Alice(MatrixOptimizer):
    """Alice (Algorithm 4); ``beta3=0`` gives Alice-0. See the module docstring for all flags.

    State per matrix (oriented so that ``m ≤ n``): ``U`` (m×r), ``Qt`` (r×r, omitted for
    Alice-0, stored in ``qtilde_dtype``), ``exp_avg``/``exp_avg_sq`` (r×n), ``p`` (n), ``phi``,
    ``step``, ``seed``, ``n_switch``.

    Args:
        params: Parameters or parameter groups; non-Adam groups must hold 2-D matrices only.
        lr: Scheduled learning rate λ (Table 11: 0.02).
        alpha: Update scale α (0.3; 0.25 at 1.3B).
        alpha_c: Compensation scale α_c (0.4; 0.2 at 1.3B).
        betas: ``(β1, β2, β3)`` = (0.9, 0.9, 0.999): first and second moments of ``σ = UᵀG`` and
            the tracking EMA of ``Q̃``. β1 also decays the compensation norm ``p``; β3 = 0 is
            Alice-0.
        rank: r (128 at 60M, 256 at 130M/350M, 512 at 1.3B); at most the projected side of every
            method weight unless ``clamp_rank=True`` (then full rank where it does not fit).
        leading: l (40; 160 at 1.3B), leading vectors kept at a switch; ``None`` =
            min(40, rank); at most ``rank``.
        update_interval: K (200). Refreshes at t = 1 and every t ≡ 0 (mod K).
        gamma: Limiter threshold γ (1.01) of the compensation.
        eps: ε in ``ω = m/(√v + ε)`` and in ``1/(√p + ε)``.
        bias_correction: Bias-correct the moments (``False``: the paper's literal update).
        switch: Switch rule: ``"complement"`` (Alg. 2) or the Fig. 5b ablations ``"none"``,
            ``"gaussian"``, ``"gaussian_mix"``, ``"full_basis"``.
        compensation: ``"optimal"`` (Alg. 3) or the Fig. 5c ablations ``"none"``, ``"fira"``,
            ``"fira_plus"``.
        reproject_qtilde: At a switch, ``Q̃ ← R Q̃ Rᵀ`` with ``R = UᵀU_old`` (``False``: Alg. 4
            literally).
        moments_on_switch: ``"keep"`` (GaLore behaviour) or ``"reset"`` the moments at a switch.
        init: Basis at t = 1: ``"evd"`` (exact top-r EVD of ``G₁G₁ᵀ``; the only option).
        project_side: ``"smaller"``: U spans the smaller side of the weight; ``"rows"``: always
            the output side.
        subspace_steps: QR steps of the subspace iteration at a refresh.
        fused_compensation: Form the update as ``U(ω − cσD) + cGD`` without materialising the
            residual (orthonormal switch modes only).
        seed: Base seed of the switch draws.
        qtilde_dtype: Dtype of ``Q̃`` (fp32 by default; ``None``: the state dtype).
        adam_betas: Adam betas of groups with ``adam=True``.
        adam_eps: Adam ε of groups with ``adam=True``.
        weight_decay: Decoupled weight decay (the paper uses none).
        state_dtype: Dtype of the other state tensors (default: the parameter's).
        clamp_rank: Use full rank (no projection) for weights whose projected side is below
            ``rank`` instead of refusing them.
        foreach: Run the plain (non-refresh) steps of same-shape matrices together (stacked,
            batched products) instead of one by one; ``None`` (default): on when every parameter
            of the group is on CUDA, where the loop is bound by kernel launches. Refresh steps, the
            first step and the Fira-style compensation ablations always loop. The two agree to rounding.
            The stacked state lives in one bank per shape; each matrix's ``state`` entries are its
            slices.
        check_finite: How a NaN/inf gradient is caught. ``"eager"``: one host read per step, and the
            step raises :class:`~curvopt.errors.NonFiniteError` before anything changes;
            ``"deferred"``: no host read — the step computes a device flag, writes nothing where it
            is set, and :meth:`raise_if_nonfinite` (which the training loop calls with its loss
            read) raises; ``None`` (default): deferred when every gradient is on CUDA and the step
            is stacked (``foreach``) (a plain step; the first step and refreshes check eagerly), eager otherwise.
        compile: Run the stacked plain step of each shape bucket under ``torch.compile(fullgraph=True,
            dynamic=False)``, with the hyper-parameters as 0-d tensors (a scheduled lr does not
            recompile); implies the stacked path. Opt-in: the first step compiles (tens of seconds).

    Raises:
        ValueError: On an out-of-range hyperparameter, an unknown mode, a rank above a weight's
            projected side without ``clamp_rank``, or a non-2-D parameter in a method group.
        TypeError: On a complex parameter.

    Example:
        Alice on the hidden matrix (rank 2 of its smaller side 4), Adam on the rest:

        >>> import torch
        >>> from curvopt.optim import Alice
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> others = [model[0].bias, *model[2].parameters()]
        >>> opt = Alice([{"params": [model[0].weight]}, {"params": others, "adam": True}], lr=0.02, rank=2)
        >>> warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        >>> x, y = torch.randn(16, 4), torch.randn(16, 2)
        >>> for step in range(3):
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     opt.zero_grad()
        ...     loss.backward()
        ...     opt.step()
        ...     warmup.step()  # a scheduler scales both groups' lr
        >>> opt.state[model[0].weight]["U"].shape
        torch.Size([4, 2])
    """

    method_name = "alice"

    RANGES: dict[str, checks.Range] = {
        **dict.fromkeys(("alpha", "alpha_c"), checks.NONNEG),
        "betas": checks.tuple_of(3, checks.UNIT),
        **dict.fromkeys(("rank", "update_interval", "subspace_steps"), checks.count(1)),
        **dict.fromkeys(("leading", "seed"), checks.count(0)),
        "gamma": checks.at_least(1.0),
        "eps": checks.POSITIVE,
        "switch": checks.one_of(*SWITCH_MODES),
        "compensation": checks.one_of(*COMPENSATION_MODES),
        "moments_on_switch": checks.one_of("keep", "reset"),
        "init": checks.one_of("evd"),
        "project_side": checks.one_of("smaller", "rows"),
        **dict.fromkeys(
            ("bias_correction", "reproject_qtilde", "fused_compensation", "clamp_rank"), checks.FLAG
        ),
    }

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        alpha: float = 0.3,
        alpha_c: float = 0.4,
        betas: tuple[float, float, float] = (0.9, 0.9, 0.999),
        rank: int = 128,
        leading: int | None = None,
        update_interval: int = 200,
        gamma: float = 1.01,
        eps: float = 1e-8,
        bias_correction: bool = False,
        switch: str = "complement",
        compensation: str = "optimal",
        reproject_qtilde: bool = True,
        moments_on_switch: str = "keep",
        init: str = "evd",
        project_side: str = "smaller",
        subspace_steps: int = 1,
        fused_compensation: bool = True,
        seed: int = 0,
        qtilde_dtype: str | torch.dtype | None = "float32",
        adam_betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: str | torch.dtype | None = None,
        clamp_rank: bool = False,
        foreach: bool | None = None,
        check_finite: str | None = None,
        compile: bool = False,
    ) -> None:
        if leading is None:
            leading = min(DEFAULT_LEADING, int(rank))
        defaults = {
            "lr": lr,
            "alpha": alpha,
            "alpha_c": alpha_c,
            "betas": tuple(betas),
            "rank": rank,
            "leading": leading,
            "update_interval": update_interval,
            "gamma": gamma,
            "eps": eps,
            "bias_correction": bias_correction,
            "switch": switch,
            "compensation": compensation,
            "reproject_qtilde": reproject_qtilde,
            "moments_on_switch": moments_on_switch,
            "init": init,
            "project_side": project_side,
            "subspace_steps": subspace_steps,
            "fused_compensation": fused_compensation,
            "seed": seed,
            "qtilde_dtype": qtilde_dtype,
            "adam_betas": tuple(adam_betas),
            "adam_eps": adam_eps,
            "weight_decay": weight_decay,
            "state_dtype": state_dtype,
            "clamp_rank": clamp_rank,
            "foreach": foreach,
            "check_finite": check_finite,
            "compile": compile,
        }
        super().__init__(params, defaults)

    def _param_index(self, p: Tensor) -> int:
        """Position of ``p`` among all parameters, in ``param_groups`` order (its switch seed).

        Looked up when a matrix's state is created rather than cached by ``id``: a cache keyed by
        object identity would not survive ``copy.deepcopy``, ``pickle`` or a new process.
        """
        i = 0
        for group in self.param_groups:
            for q in group["params"]:
                if q is p:
                    return i
                i += 1
        return 0

    def _validate_group(self, group: dict[str, Any]) -> None:
        from curvopt.optim.matrix import as_dtype

        checks.check_hparams("Alice", self.RANGES, group)
        if int(group["leading"]) > int(group["rank"]):
            raise ValueError(
                f"leading={group['leading']} exceeds rank={group['rank']}: the leading directions kept at a "
                "switch are part of the rank; choose leading <= rank"
            )
        if not group.get("clamp_rank", False):
            for p in group["params"]:
                m, _n, _t = self.oriented_shape(tuple(p.shape), group.get("project_side", "smaller"))
                if int(group["rank"]) > m:
                    raise ValueError(
                        f"Alice: rank={group['rank']} exceeds the projected side ({m}) of a weight of shape "
                        f"{tuple(p.shape)}; lower rank to at most {m}, keep that weight out of the method "
                        "group, or set clamp_rank=True (optimizer.clamp_rank=true) to use full rank (no projection) there"
                    )
        group["qtilde_dtype"] = as_dtype(group["qtilde_dtype"])

    def _matrix_grad_limit(self, p: Tensor, group: dict[str, Any], big: float) -> float:
        """``√(big / (64 m n))``: ``G Gᵀ``, ``Q̃`` and the Rayleigh–Ritz matrix reach ``m·n·max|g|²``."""
        m, n = p.shape
        return math.sqrt(big / (64.0 * m * n))

    # ------------------------------------------------------------------ shapes

    @staticmethod
    def oriented_shape(shape: tuple[int, int], project_side: str = "smaller") -> tuple[int, int, bool]:
        """Orient a weight shape for the projection.

        Args:
            shape: The weight's ``(rows, cols)``.
            project_side: ``"smaller"`` or ``"rows"``.

        Returns:
            ``(m, n, transposed)``: the projected side ``m`` (U is m×r), the other side ``n``,
            and whether the weight is used transposed.
        """
        rows, cols = shape
        transposed = project_side == "smaller" and rows > cols
        return (cols, rows, True) if transposed else (rows, cols, False)

    @staticmethod
    def state_numel(
        shape: tuple[int, int],
        rank: int = 128,
        betas: tuple[float, ...] = (0.9, 0.9, 0.999),
        project_side: str = "smaller",
        **_: Any,
    ) -> dict[str, int]:
        """Elements of each state tensor for one weight matrix (Table 6: mr + 2nr + n + r²).

        Args:
            shape: The weight's shape.
            rank: r (capped at the projected side).
            betas: ``(β1, β2, β3)``; ``Qt`` is counted only when β3 > 0.
            project_side: As in :meth:`oriented_shape`.
            **_: Ignored.

        Returns:
            ``name -> elements`` for ``U``, ``exp_avg``, ``exp_avg_sq``, ``p``, ``phi`` (and
            ``Qt``).
        """
        m, n, _t = Alice.oriented_shape(shape, project_side)
        r = min(int(rank), m)
        out = {"U": m * r, "exp_avg": r * n, "exp_avg_sq": r * n, "p": n, "phi": 1}
        if betas[2] > 0:
            out["Qt"] = r * r
        return out

    # ------------------------------------------------------------------ step

    def _matrix_update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        cdt = compute_dtype(p)
        m, n, transposed = self.oriented_shape(tuple(p.shape), group["project_side"])
        r = min(int(group["rank"]), m)
        lead = min(int(group["leading"]), r)
        b1, b2, b3 = group["betas"]
        K = int(group["update_interval"])
        eps = group["eps"]
        G = grad.T.to(cdt) if transposed else grad.to(cdt)

        if not state:
            sd = self._state_dtype(p, group)
            state["step"] = 0
            state["seed"] = int(group["seed"]) * SEED_STRIDE + self._param_index(p)
            state["n_switch"] = 0
            state["U"] = torch.zeros(m, r, dtype=sd, device=p.device)
            if b3 > 0:
                state["Qt"] = torch.zeros(r, r, dtype=group["qtilde_dtype"] or sd, device=p.device)
            state["exp_avg"] = torch.zeros(r, n, dtype=sd, device=p.device)
            state["exp_avg_sq"] = torch.zeros(r, n, dtype=sd, device=p.device)
            state["p"] = torch.zeros(n, dtype=sd, device=p.device)
            state["phi"] = torch.zeros(
                (), dtype=torch.float32 if cdt != torch.float64 else cdt, device=p.device
            )
        state["step"] += 1
        t = state["step"]
        Qt = state["Qt"].to(cdt) if "Qt" in state else None

        if t == 1 or t % K == 0:
            U_old = state["U"].to(cdt)
            if t == 1:
                # U_0 = 0 cannot seed a subspace iteration: exact EVD of Q_1 = (1−β3) G Gᵀ (RACS-9)
                Up = top_eigvecs(G @ G.T, r)[1]
            else:

                def matvec(X: Tensor) -> Tensor:
                    out = (G @ (G.T @ X)).mul_(1 - b3)
                    if Qt is not None and b3 > 0:
                        out.add_(U_old @ (Qt @ (U_old.T @ X)), alpha=b3)
                    return out

                Up = subspace_iteration(matvec, U_old, int(group["subspace_steps"]))[0]
            gen = switch_generator(state["seed"], state["n_switch"])
            U = switch_basis(Up, r, lead, gen, group["switch"])
            state["n_switch"] += 1
            if Qt is not None and t > 1 and group["reproject_qtilde"]:
                R = U.T @ U_old
                Qt = R @ Qt @ R.T
            if t > 1 and group["moments_on_switch"] == "reset":
                state["exp_avg"].zero_()
                state["exp_avg_sq"].zero_()
            state["U"].copy_(U)
        else:
            U = state["U"].to(cdt)

        sigma = U.T @ G  # r×n
        if Qt is not None:
            Qt.mul_(b3).addmm_(sigma, sigma.T, alpha=1 - b3)
            _store(state, "Qt", Qt)
        m1 = _in_state_dtype(state["exp_avg"], cdt).mul_(b1).add_(sigma, alpha=1 - b1)
        v = _in_state_dtype(state["exp_avg_sq"], cdt).mul_(b2).addcmul_(sigma, sigma, value=1 - b2)
        _store(state, "exp_avg", m1)
        _store(state, "exp_avg_sq", v)
        if group["bias_correction"]:
            omega = (m1 / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt_().add_(eps))
        else:
            omega = torch.div(m1, v.sqrt().add_(eps))

        inner, colscale, dense = self._with_compensation(G, U, sigma, omega, state, group, m, r, b1, eps)
        scale = -group["lr"] * group["alpha"]
        target = p.T if transposed else p  # m×n view of the parameter
        if p.dtype == cdt:
            # Accumulate straight into the weights: no m×n update temporaries (they cost a DRAM
            # round trip each, as much as the low-rank arithmetic on a CPU).
            target.addmm_(U, inner, alpha=scale)
            if colscale is not None:
                target.addcmul_(G, colscale[None, :], value=scale)
            if dense is not None:
                target.add_(dense, alpha=scale)
            return
        if colscale is not None:
            upd = torch.addmm(G * colscale[None, :], U, inner)
        else:
            upd = U @ inner
        if dense is not None:
            upd.add_(dense)
        target.add_(upd.to(p.dtype), alpha=scale)

    def _stacked_plain_step(self, group: dict[str, Any]) -> bool:
        """Whether the group's compensation has a stacked form (``"none"`` or the fused optimal one)."""
        mode = group["compensation"]
        return mode == "none" or (mode == "optimal" and group["fused_compensation"] and _orthonormal(group))

    def _is_plain(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p``'s next step is a plain one (neither its first nor a refresh)."""
        state = self.state[p]
        t = state.get("step", 0) + 1
        return bool(state) and t != 1 and t % int(group["update_interval"]) != 0

    def _defers(self, group: dict[str, Any], params: list[Tensor]) -> bool:
        """Deferred finiteness needs the stacked path for every matrix: plain steps only.

        A refresh (every ``update_interval`` steps), the first step and the Fira-style ablations run
        the per-matrix loop, which checks eagerly (one host read, as a refresh makes anyway).
        """
        if not self._use_foreach(group, params):
            return False
        if group["adam"]:
            return True
        return self._stacked_plain_step(group) and all(self._is_plain(p, group) for p in params)

    def _matrix_update_foreach(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """Plain steps of same-shape matrices stacked, in place on the state banks; the rest loops.

        A step batches when it is neither the first nor a refresh (``t % K != 0``) and the
        compensation is ``"none"`` or the fused ``"optimal"`` one (orthonormal switch modes): the
        paper's default, 199 of every 200 steps. Each batched step is :meth:`_matrix_update`'s
        arithmetic on a ``(k, m, n)`` stack (tested against it); the batched sums may round
        differently.
        """
        fused = self._stacked_plain_step(group)
        batched_refresh = fused and group["switch"] in ("complement", "none")
        buckets: dict[tuple[Any, ...], list[Tensor]] = {}
        for p in params:
            state = self.state[p]
            plain = fused and self._is_plain(p, group)
            refresh = batched_refresh and bool(state) and state["step"] > 0 and not plain
            if not (plain or refresh):
                self._matrix_update(p, p.grad, state, group)
                continue
            m, n, transposed = self.oriented_shape(tuple(p.shape), group["project_side"])
            qt = state.get("Qt")
            key = (m, n, transposed, p.dtype, p.device, state["step"] + 1, state["U"].dtype,
                   state["exp_avg"].dtype, None if qt is None else qt.dtype, refresh)  # fmt: skip
            buckets.setdefault(key, []).append(p)
        for (m, n, transposed, _pdt, device, *_, refresh), bucket in buckets.items():
            keys = ("U", "exp_avg", "exp_avg_sq", "p", "phi") + (
                ("Qt",) if "Qt" in self.state[bucket[0]] else ()
            )
            full = self._bank(bucket, keys)
            for part in chunk_slices(len(bucket), m * n, device):
                bank = bank_slice(full, part, len(bucket))
                fresh = self._refresh_stacked(bucket[part], bank, group, m, transposed) if refresh else {}
                self._plain_steps_stacked(bucket[part], bank, group, m, n, transposed, fresh)

    def _refresh_stacked(
        self, ps: list[Tensor], bank: dict[str, Tensor], group: dict[str, Any], m: int, transposed: bool
    ) -> dict[str, Tensor]:
        """The basis refresh of :meth:`_matrix_update` (t ≡ 0 mod K) for k same-shape matrices at once.

        Subspace iteration with Rayleigh–Ritz, the Switch (``"complement"`` or ``"none"``), the
        ``Q̃`` re-projection and the moment reset, on ``(k, ·, ·)`` stacks: batched ``bmm``/``qr``/
        ``eigh``; each matrix keeps its own seeded complement draw (drawn on the CPU, moved in one
        copy). Writes ``U`` (and resets the moments) in ``bank``; returns the new ``U`` and ``Q̃`` in the
        compute dtype, which the plain step that follows uses (as the loop does, unrounded).
        """
        cdt = compute_dtype(ps[0])
        r = min(int(group["rank"]), m)
        lead = min(int(group["leading"]), r)
        b3 = group["betas"][2]
        G = torch.stack([p.grad for p in ps]).to(cdt)
        G = G.mT if transposed else G  # k×m×n
        U_old = bank["U"].to(cdt)
        Qt = bank["Qt"].to(cdt) if "Qt" in bank else None

        def matvec(X: Tensor) -> Tensor:
            out = torch.bmm(G, torch.bmm(G.mT, X)).mul_(1 - b3)
            if Qt is not None and b3 > 0:
                out.baddbmm_(U_old, torch.bmm(Qt, torch.bmm(U_old.mT, X)), alpha=b3)
            return out

        U = U_old
        for _ in range(int(group["subspace_steps"])):
            U, _ = torch.linalg.qr(matvec(U))
        V = torch.bmm(U.mT, matvec(U))
        evals, evecs = torch.linalg.eigh(0.5 * (V + V.mT))
        order = torch.argsort(evals, dim=-1, descending=True)
        evecs = torch.gather(evecs, -1, order.unsqueeze(-2).expand_as(evecs))
        Up = canonical_signs(torch.bmm(U, evecs))
        states = [self.state[p] for p in ps]
        if group["switch"] == "complement" and r < m:
            k_draw = min(r - lead, m - r)  # complement directions actually available
            Qfull, _ = torch.linalg.qr(Up, mode="complete")
            draws = [
                sample_indices(switch_generator(st["seed"], st["n_switch"]), m - r, k_draw) for st in states
            ]
            idx = torch.stack(draws).to(Up.device)  # k × k_draw
            picked = torch.gather(Qfull[..., r:], -1, idx.unsqueeze(-2).expand(-1, m, -1))
            U = torch.cat([Up[..., : r - k_draw], picked], dim=-1)
        else:
            U = Up
        for st in states:
            st["n_switch"] += 1
        fresh = {"U": U}
        if Qt is not None and group["reproject_qtilde"]:
            R = torch.bmm(U.mT, U_old)
            fresh["Qt"] = torch.bmm(torch.bmm(R, Qt), R.mT)
        if group["moments_on_switch"] == "reset":
            bank["exp_avg"].zero_()
            bank["exp_avg_sq"].zero_()
        bank["U"].copy_(U)
        return fresh

    def _plain_steps_stacked(
        self,
        ps: list[Tensor],
        bank: dict[str, Tensor],
        group: dict[str, Any],
        m: int,
        n: int,
        transposed: bool,
        fresh: dict[str, Tensor] | None = None,
    ) -> None:
        """One plain step of :meth:`_matrix_update` for k same-shape matrices, on their state ``bank``.

        ``fresh`` holds the ``U`` (and ``Q̃``) a refresh has just made, in the compute dtype.

        With ``check_finite="deferred"`` a skipped step zeroes ``G``, keeps every state tensor and
        moves no weight.
        """
        for p in ps:
            self.state[p]["step"] += 1
        t = self.state[ps[0]]["step"]
        cdt = compute_dtype(ps[0])
        r = min(int(group["rank"]), m)
        b1, b2, b3 = group["betas"]
        fresh = fresh or {}
        hyper: dict[str, Any] = {
            "b1": b1,
            "b2": b2,
            "b3": b3,
            "eps": group["eps"],
            "gamma": group["gamma"],
            "alpha_c": group["alpha_c"],
            "bc1": 1 - b1**t if group["bias_correction"] else None,
            "bc2": 1 - b2**t if group["bias_correction"] else None,
        }
        update = alice_bank_update
        scale = self._gated_scale(-group["lr"] * group["alpha"])
        optimal = group["compensation"] == "optimal" and m != r
        if group.get("compile"):
            device = ps[0].device
            key = (m, n, len(ps), transposed, cdt, device, "Qt" in bank, optimal, group["bias_correction"])
            update = self._compiled(alice_bank_update, (*key, self.__dict__.get("_step_ok") is None))
            hyper = {
                k: None if v is None else self._hyper_tensor(group, k, v, device) for k, v in hyper.items()
            }
            if not isinstance(scale, Tensor):
                scale = self._hyper_tensor(group, "scale", scale, device)
        upd = update(
            torch.stack([p.grad for p in ps]),
            fresh.get("U", bank["U"]),
            fresh.get("Qt", bank.get("Qt")),
            bank.get("Qt"),
            bank["exp_avg"],
            bank["exp_avg_sq"],
            bank["p"],
            bank["phi"],
            self.__dict__.get("_step_ok"),
            cdt=cdt,
            transposed=transposed,
            optimal=optimal,
            root=math.sqrt(max(m - r, 0)),
            **hyper,
        )
        pdt = ps[0].dtype
        upd_list = list(upd.unbind(0)) if pdt == cdt else list(upd.to(pdt).unbind(0))
        foreach_add_scaled(ps, upd_list, scale)

    def _with_compensation(
        self,
        G: Tensor,
        U: Tensor,
        sigma: Tensor,
        omega: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        m: int,
        r: int,
        b1: float,
        eps: float,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The bracket of Alg. 4 line 17, ``U ω + α_c Δ_c``, in factored form.

        Returned as ``(inner, colscale, dense)`` with bracket = ``U·inner + G·Diag(colscale) +
        dense`` (absent terms are ``None``), so that the caller can add it to the weights without
        forming it.
        """
        mode = group["compensation"]
        gamma, alpha_c = group["gamma"], group["alpha_c"]
        phi = state["phi"]
        if mode == "none" or m == r:
            return omega, None, None
        if mode == "optimal":
            col_g2 = _col_sq_norms(G)
            res_sq = (col_g2 - sigma.square().sum(0)).clamp_min_(0)  # ‖g_j‖² − ‖Uᵀg_j‖² ≥ 0 (RACS-18)
            pvec = _in_state_dtype(state["p"], G.dtype).mul_(b1).add_(res_sq, alpha=1 - b1)
            _store(state, "p", pvec)
            d = pvec.sqrt().add_(eps).reciprocal_()  # Diag(p)^{-1/2}
            root = math.sqrt(m - r)
            if group["fused_compensation"] and _orthonormal(group):
                c_norm = root * torch.sqrt((res_sq * d.square()).sum())  # ‖√(m−r) R D‖_F, R ⟂ U
                eta = limiter_eta(c_norm.to(phi.dtype), phi, gamma)
                phi.copy_(eta * c_norm)
                coef_d = d.mul_((alpha_c * root) * eta.to(G.dtype))
                # U(ω − c σ D) + c G D = Uω + c (G − Uσ) D
                return omega.sub_(sigma * coef_d[None, :]), coef_d, None
            C = root * (G - U @ sigma) * d[None, :]
            c_norm = torch.linalg.vector_norm(C)
            eta = limiter_eta(c_norm.to(phi.dtype), phi, gamma)
            phi.copy_(eta * c_norm)
            return omega, None, C.mul_(alpha_c * eta.to(G.dtype))
        # Fira-style compensations (Fig. 5c): per column φ_j = ‖ω_j‖ / ‖σ_j‖ on the residual
        R = G - U @ sigma
        scale = torch.linalg.vector_norm(omega, dim=0) / (torch.linalg.vector_norm(sigma, dim=0) + 1e-8)
        C = R * scale[None, :]
        c_norm = torch.linalg.vector_norm(C)
        if mode == "fira":
            # Fira's rule: limiter on C, added at scale λ (not λα): bracket = Uω + C/α
            eta = limiter_eta(c_norm.to(phi.dtype), phi, gamma)
            phi.copy_(eta * c_norm)
            return omega, None, C.mul_(eta.to(G.dtype) / group["alpha"])
        # fira_plus: Fira's compensation rescaled to ‖Uω‖, times α_c
        target = torch.linalg.vector_norm(U @ omega)
        return omega, None, C.mul_(alpha_c * target / c_norm.clamp_min(1e-30))


def _ema_outer(old: Tensor, a: Tensor, b: Tensor, beta: float | Tensor) -> Tensor:
    """``β·old + (1−β)·a b`` for stacks (``baddbmm`` for a float β)."""
    if isinstance(beta, Tensor):
        return old * beta + torch.bmm(a, b) * (1 - beta)
    return torch.baddbmm(old, a, b, beta=beta, alpha=1 - beta)


def _ema_square(old: Tensor, x: Tensor, beta: float | Tensor) -> Tensor:
    """``β·old + (1−β)·x⊙x``."""
    if isinstance(beta, Tensor):
        return old * beta + x * x * (1 - beta)
    return old.mul(beta).addcmul_(x, x, value=1 - beta)


def alice_bank_update(
    G: Tensor,
    U: Tensor,
    Qt: Tensor | None,
    Qt_bank: Tensor | None,
    M: Tensor,
    V: Tensor,
    Pv: Tensor,
    PHI: Tensor,
    ok: Tensor | None,
    *,
    cdt: torch.dtype,
    transposed: bool,
    optimal: bool,
    root: float,
    b1: float | Tensor,
    b2: float | Tensor,
    b3: float | Tensor,
    eps: float | Tensor,
    gamma: float | Tensor,
    alpha_c: float | Tensor,
    bc1: float | Tensor | None,
    bc2: float | Tensor | None,
) -> Tensor:
    """One plain Alice step of ``k`` same-shape matrices, in place on their state bank.

    Pure tensor code (no host read), run eagerly or under ``torch.compile(fullgraph=True)`` with the
    hyper-parameters as 0-d tensors (``Alice(compile=True)``). The arithmetic of
    :meth:`Alice._matrix_update` (fused optimal compensation) on ``(k, ·, ·)`` stacks.

    Args:
        G: ``(k, rows, cols)`` gradients as stored.
        U: ``(k, m, r)`` projection (the bank, or a refresh's new basis).
        Qt: ``(k, r, r)`` tracked covariance to update (``None`` for Alice-0).
        Qt_bank: Where ``Q̃`` is stored (``None`` for Alice-0).
        M: ``(k, r, n)`` first moments (in place).
        V: ``(k, r, n)`` second moments (in place).
        Pv: ``(k, n)`` compensation norms ``p`` (in place).
        PHI: ``(k,)`` limiter norms (in place).
        ok: ``None``, or the deferred finiteness flag: where it is false nothing is written.
        cdt: Compute dtype.
        transposed: The weights are used transposed (``m`` is their column count).
        optimal: Apply the optimal compensation (``m > r``).
        root: ``√(m − r)``.
        b1: β1.
        b2: β2.
        b3: β3.
        eps: ε.
        gamma: Limiter threshold.
        alpha_c: Compensation scale.
        bc1: ``1 − β1ᵗ`` with bias correction, else ``None``.
        bc2: ``1 − β2ᵗ`` with bias correction, else ``None``.

    Returns:
        The bracket ``U(ω − cσD) + cGD`` in the weights' orientation, ``(k, rows, cols)``; the caller
        adds ``−λα`` times it.
    """

    def write(dst: Tensor, new: Tensor, old: Tensor) -> None:
        dst.copy_(new if ok is None else torch.where(ok, new, old))

    G = G.to(cdt)
    G = G.mT if transposed else G  # k×m×n
    if ok is not None:
        G = torch.where(ok, G, 0.0)
    U = U.to(cdt)
    sigma = torch.bmm(U.mT, G)  # k×r×n
    if Qt is not None and Qt_bank is not None:
        Qt = Qt.to(cdt)
        write(Qt_bank, _ema_outer(Qt, sigma, sigma.mT, b3), Qt)
    m_old, v_old = M.to(cdt), V.to(cdt)
    m1 = ema_update(m_old, sigma, b1)
    v = _ema_square(v_old, sigma, b2)
    write(M, m1, m_old)
    write(V, v, v_old)
    if ok is not None:  # a skipped step: ω from the kept moments
        m1, v = M.to(cdt), V.to(cdt)
    if bc1 is not None and bc2 is not None:
        omega = (m1 / bc1) / ((v / bc2).sqrt_().add_(eps))
    else:
        omega = torch.div(m1, v.sqrt().add_(eps))
    colscale = None
    if optimal:
        res_sq = (G.square().sum(1) - sigma.square().sum(1)).clamp_min_(0)  # k×n
        p_old = Pv.to(cdt)
        write(Pv, ema_update(p_old, res_sq, b1), p_old)
        d = Pv.to(cdt).sqrt().add_(eps).reciprocal_()
        c_norm = root * torch.sqrt((res_sq * d.square()).sum(-1))  # k
        eta = limiter_eta(c_norm.to(PHI.dtype), PHI, gamma)
        write(PHI, eta * c_norm, PHI)
        colscale = d * ((alpha_c * root) * eta.to(cdt).unsqueeze(1))
        omega = omega.sub_(sigma * colscale.unsqueeze(1))
    # U(ω − cσD) + cGD, as the loop's bracket
    upd = torch.bmm(U, omega) if colscale is None else torch.baddbmm(G * colscale.unsqueeze(1), U, omega)
    return upd.mT if transposed else upd


def _orthonormal(group: dict[str, Any]) -> bool:
    """Whether the group's switch rule keeps ``U`` orthonormal (the Gaussian ablations do not)."""
    return group["switch"] not in ("gaussian", "gaussian_mix")


def _in_state_dtype(buf: Tensor, dtype: torch.dtype) -> Tensor:
    """The state tensor itself when it already has the compute dtype, else a compute-dtype copy.

    The first is updated in place; the copy (bf16 states) is written back with :func:`_store`.
    """
    return buf if buf.dtype == dtype else buf.to(dtype)


def _store(state: dict[str, Any], key: str, value: Tensor) -> None:
    if value is not state[key]:
        state[key].copy_(value)


def _col_sq_norms(G: Tensor) -> Tensor:
    """``‖g_j‖²`` for every column, reduced along the memory-contiguous axis.

    ``G`` is often the transposed view of a weight; a strided reduction is several times slower
    on a CPU.
    """
    if G.stride(0) == 1 and G.stride(1) != 1:
        return torch.linalg.vector_norm(G.T, dim=1).square_()
    return G.square().sum(0)  # torch's vector_norm over dim 0 of a row-major matrix is ~6× slower


def alice0(params: Iterable[Any], **kwargs: Any) -> Alice:
    """Alice-0: Alice without tracking (β3 = 0, no ``Q̃`` stored).

    Args:
        params: Parameters or parameter groups.
        **kwargs: Keyword arguments of :class:`Alice`; ``betas`` gives (β1, β2) — a third value
            is accepted and ignored (set to 0).

    Returns:
        The :class:`Alice` optimizer.

    Raises:
        ValueError: If ``betas`` does not hold two (or three) numbers, or as :class:`Alice`.

    Example:
        >>> import torch
        >>> from curvopt.optim import alice0
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        >>> others = [model[0].bias, *model[2].parameters()]
        >>> groups = [{"params": [model[0].weight]}, {"params": others, "adam": True}]
        >>> opt = alice0(groups, lr=0.02, rank=2, betas=(0.9, 0.9))
        >>> opt.zero_grad()
        >>> model(torch.randn(16, 4)).square().mean().backward()
        >>> opt.step()  # the first step: the exact top-r eigenvectors of G Gᵀ
        >>> opt.defaults["betas"], "Qt" in opt.state[model[0].weight]
        ((0.9, 0.9, 0.0), False)
    """
    betas = tuple(kwargs.pop("betas", (0.9, 0.9)))
    if len(betas) not in (2, 3):
        raise ValueError(f"alice0: betas must be (beta1, beta2) (a third value is ignored), got {betas}")
    b1, b2 = betas[:2]
    return Alice(params, betas=(b1, b2, 0.0), **kwargs)
