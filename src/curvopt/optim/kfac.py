"""K-FAC (Martens & Grosse 2015; KFC for convolutions, Grosse & Martens 2016).

The second-order baseline of the FOSI paper, modelled on the behaviour of ``kfac_jax.Optimizer``
that the authors ran.

Why our own: no maintained PyTorch package offers kfac-jax's update (adaptive learning rate and
momentum from a quadratic model, Levenberg–Marquardt damping); see docs/fosi_tasks.md.

Curvature blocks (one per layer, factors from :mod:`curvopt.curvature.kfac_factors`; parameters
outside them per ``uncovered``):

* ``nn.Linear``: F ≈ A ⊗ G with A = E[ā āᵀ] (ā = input with a homogeneous 1 for the bias) and
  G = E[g gᵀ] of the per-example output derivatives (inputs with extra leading dims, e.g. sequences,
  count every row as an example);
* ``nn.Conv2d`` (groups 1, zero padding): KFC — A over the unfolded input patches averaged over
  positions, G summed over positions;
* ``nn.ConvTranspose2d`` (groups 1, dilation 1): the equivalent stride-1 convolution of the
  zero-dilated, padded input with the flipped, transposed kernel (how XLA implements it), then KFC;
* ``uncovered='diagonal'``: a diagonal Fisher for every other trainable parameter (BatchNorm,
  depthwise convolutions); ``'error'`` (default) refuses, as kfac-jax's "parameter not assigned a
  block" did for the LSTM of the LM task.

G uses gradients of the loss at targets **sampled from the model's predictive distribution**
(``estimation='fisher_gradients'``, kfac-jax's default: categorical for cross-entropy, Bernoulli for
sigmoid BCE, N(out, I) for ½‖·‖²); ``'empirical'`` uses the true targets. Factors are exponential
moving averages (``curvature_ema``, debiased by their total weight). Every ``inverse_update_period``
steps the factors are inverted with factored Tikhonov damping: (A + π√λ I)⁻¹ and (G + √λ/π I)⁻¹,
π = √((tr A / dim A)/(tr G / dim G)).

Update: Δ = −F̂⁻¹g, δ = α Δ + μ δ_prev. A fixed ``lr``/``momentum`` gives α/μ; ``'adaptive'`` solves
for them by minimising the quadratic model q(δ) = gᵀδ + ½ δᵀ(C + λI)δ with C the exact Gauss–Newton
(= Fisher for these losses) of the mini-batch, via ``Objective.ggn_vp``. ``adaptive_damping``
re-fits λ every ``damping_adaptation_interval`` steps from ρ = (f(θ+δ) − f(θ)) / q(δ) on the same
batch (λ ← λ/ω if ρ < ¼, λ·ω if ρ > ¾, ω = decay^interval); q excludes the damping term unless
``include_damping_in_quad_change``.

GGN products use a copy of the model whose BatchNorm normalises with batch statistics without
tracking them (the training-mode function); the running statistics are restored after the extra
forward for ρ, so only the training forward updates them.

Host reads (a GPU step waits for each): a step between two inversions and two damping updates
reads nothing but its logged scalars, once, at the end (``host_stats=False``: not even those; see
:meth:`KFAC.read_stats`): the quadratic model, its 2×2 solve and the coefficients stay on the
device. An inversion step reads the factors' traces (π), a damping-update step reads ρ.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp

from curvopt.api import AlgorithmBase, Batch, DataBundle
from curvopt.curvature.hvp import hvp_module
from curvopt.curvature.kfac_factors import (
    block_kind,
    convT_equivalent_weight,
    input_factor,
    mirror_upper,
    output_rows,
)
from curvopt.objective import Objective, mean_loss, output_hessian_vp
from curvopt.optim.checks import (
    FLAG,
    INTEGER,
    NONNEG,
    POSITIVE,
    UNIT,
    UNIT_OPEN_LOW,
    Range,
    check_floating,
    check_hparams,
    check_materialised,
    count,
    one_of,
    optional,
    real,
)

ESTIMATIONS = ("fisher_gradients", "empirical")
UNCOVERED = ("error", "diagonal")


@dataclass
class _Block:
    name: str
    kind: str  # linear | conv | convT | diag
    module: nn.Module | None
    params: list[nn.Parameter]
    has_bias: bool = False
    A: Tensor | None = None  # raw EMA sums (divide by weight)
    G: Tensor | None = None
    weight: float = 0.0
    A_inv: Tensor | None = None
    G_inv: Tensor | None = None
    inputs: Tensor | None = None  # captured during the K-FAC forward
    outputs: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _CaptureHook:
    """Forward hook of one K-FAC block: keeps the layer's input and output while K-FAC captures.

    A module-level callable rather than a closure, so that a model carrying it (and K-FAC with
    it) can be pickled, and ``copy.deepcopy`` of a K-FAC binds the copied model's hook to the
    copied K-FAC. A copy of the model alone shares the hook, as it would share a function.
    """

    def __init__(self, owner: KFAC, block: _Block) -> None:
        self.owner = owner
        self.block = block

    def __call__(self, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if self.owner._capturing:
            self.block.inputs = inputs[0].detach()
            self.block.outputs = output

    def __deepcopy__(self, memo: dict[int, Any]) -> _CaptureHook:
        if id(self.owner) not in memo:  # the model is copied, not its K-FAC
            return self
        return _CaptureHook(copy.deepcopy(self.owner, memo), copy.deepcopy(self.block, memo))


def _pack_sym(m: Tensor | None) -> Tensor | None:
    """The upper triangle (diagonal included) of an exactly symmetric matrix, row by row."""
    if m is None:
        return None
    i, j = torch.triu_indices(m.shape[0], m.shape[0], device=m.device)
    return m[i, j]


def _unpack_sym(v: Tensor | None) -> Tensor | None:
    """Inverse of :func:`_pack_sym`; a 2-D tensor (an older, unpacked checkpoint) passes unchanged."""
    if v is None or v.dim() == 2:
        return v
    n = int((math.isqrt(8 * v.numel() + 1) - 1) // 2)
    i, j = torch.triu_indices(n, n, device=v.device)
    m = v.new_zeros(n, n)
    m[i, j] = v
    m[j, i] = v
    return m


def _snapshot_buffers(model: nn.Module) -> dict[str, Tensor]:
    return {k: b.detach().clone() for k, b in model.named_buffers()}


def _restore_buffers(model: nn.Module, saved: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for k, b in model.named_buffers():
            b.copy_(saved[k])


def sample_targets(outputs: Tensor, kind: str, targets: Tensor, generator: torch.Generator | None) -> Tensor:
    """Targets drawn from the model's predictive distribution at ``outputs``.

    Categorical for cross-entropy, Bernoulli for sigmoid BCE, ``N(out, I)`` for squared error.

    Args:
        outputs: Model outputs (logits for the cross-entropies).
        kind: The loss kind.
        targets: The true targets; ignored cross-entropy positions (``-100``) are kept.
        generator: Random generator for the draws.

    Returns:
        Sampled targets of the loss kind's target shape.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    out = outputs.detach()
    if kind == "cross_entropy":
        probs = torch.softmax(out.reshape(-1, out.shape[-1]).float(), dim=-1)
        y = torch.multinomial(probs, 1, generator=generator).view(out.shape[:-1])
        if targets.shape == y.shape:
            y = torch.where(targets == -100, targets, y)
        return y
    if kind == "sigmoid_bce":
        return torch.bernoulli(torch.sigmoid(out), generator=generator).to(out.dtype)
    if kind == "squared_error":  # ½‖out − y‖² is the NLL of N(out, I)
        noise = torch.randn(out.shape, generator=generator, dtype=out.dtype, device=out.device)
        return out + noise
    raise ValueError(f"K-FAC cannot sample targets for loss kind {kind!r}")


def _small_lstsq(A: Tensor, b: Tensor) -> Tensor:
    """The least-squares solution of a symmetric ``A x = b`` of size 1 or 2 (the quadratic model's).

    On the CPU ``torch.linalg.lstsq`` (rank-revealing ``gelsy``) as before. Elsewhere a closed form
    with no host read (CUDA's ``lstsq`` assumes full rank and checks for errors on the host): the
    inverse when ``A`` is well conditioned, else the pseudo-inverse of its rank-one part (``x = 0``
    for ``A = 0``), which is the minimum-norm solution ``gelsy`` returns for a PSD ``A``.

    Args:
        A: ``(k, k)`` symmetric positive semi-definite matrix, ``k`` in ``{1, 2}``.
        b: ``(k,)`` right-hand side.

    Returns:
        ``x``, shape ``(k,)``.
    """
    if A.device.type == "cpu" or A.shape[0] > 2:
        return torch.linalg.lstsq(A, b.unsqueeze(1)).solution.squeeze(1)
    return _closed_form_lstsq(A, b)


def _closed_form_lstsq(A: Tensor, b: Tensor) -> Tensor:
    """:func:`_small_lstsq` off the CPU: a closed form for ``k ≤ 2`` without host reads."""
    eps = torch.finfo(A.dtype).eps
    if A.shape[0] == 1:
        a = A.reshape(())
        nonzero = a.abs() > 0
        return torch.where(nonzero, b / torch.where(nonzero, a, 1.0), 0.0)
    a, c, d = A[0, 0], A[0, 1], A[1, 1]
    det = a * d - c * c
    trace = a + d
    full = det > 4 * eps * trace * trace  # condition number below ~1/(4 eps)
    safe_det = torch.where(full, det, 1.0)
    inverse = torch.stack([d * b[0] - c * b[1], a * b[1] - c * b[0]]) / safe_det
    # rank one: A ≈ trace · u uᵀ with u ∝ the larger of A's columns
    u = torch.where(a >= d, torch.stack([a, c]), torch.stack([c, d]))
    u = u / torch.linalg.vector_norm(u).clamp_min(torch.finfo(A.dtype).tiny)
    positive = trace > 0
    rank_one = torch.where(positive, (u @ b) / torch.where(positive, trace, 1.0), 0.0) * u
    return torch.where(full, inverse, rank_one)


#: K-FAC's settings and what each may be (``curvopt.optim.checks``), checked at construction.
KFAC_RANGES: dict[str, Range] = {
    "lr": real(0.0, low_open=True, also=("adaptive",)),
    "momentum": real(0.0, also=("adaptive",)),
    **dict.fromkeys(("damping", "min_damping"), POSITIVE),
    "max_damping": real(0.0, low_open=True, finite=False),
    **dict.fromkeys(("damping_lower_threshold", "damping_upper_threshold", "l2_reg"), NONNEG),
    "damping_adaptation_decay": UNIT_OPEN_LOW,
    "curvature_ema": UNIT,
    **dict.fromkeys(
        ("damping_adaptation_interval", "curvature_update_period", "inverse_update_period"), count(1)
    ),
    "clip_grad_value": optional(POSITIVE),
    "seed": INTEGER,
    "estimation": one_of(*ESTIMATIONS),
    "uncovered": one_of(*UNCOVERED),
    **dict.fromkeys(("adaptive_damping", "include_damping_in_quad_change", "host_stats"), FLAG),
}


class KFAC(AlgorithmBase):
    """K-FAC with kfac-jax's adaptive learning rate, momentum and damping (an ``Algorithm``).

    See the module docstring for the blocks, the factor estimation and the update.

    Args:
        objective: The model and its loss kind.
        lr: Fixed coefficient α of the preconditioned direction, or ``"adaptive"`` (chosen by
            minimising the quadratic model).
        momentum: Fixed coefficient μ of the previous update, or ``"adaptive"``.
        damping: Initial damping λ (> 0), used for the factored Tikhonov damping and the
            quadratic model.
        adaptive_damping: Re-fit λ from ρ every ``damping_adaptation_interval`` steps.
        damping_adaptation_interval: Steps between damping updates.
        damping_adaptation_decay: Per-step decay; λ is multiplied or divided by
            ``ω = decay^interval``.
        damping_lower_threshold: ρ below which λ is raised (``λ/ω``).
        damping_upper_threshold: ρ above which λ is lowered (``λ·ω``).
        min_damping: Lower bound on λ.
        max_damping: Upper bound on λ.
        include_damping_in_quad_change: Include the damping term in the model change q(δ) used
            for ρ.
        curvature_ema: EMA decay of the Kronecker factors, in ``[0, 1)``.
        curvature_update_period: Steps between factor updates.
        inverse_update_period: Steps between factor inversions.
        estimation: ``"fisher_gradients"`` (targets sampled from the model) or ``"empirical"``
            (true targets).
        l2_reg: L2 regularisation added to the gradient (and to the damping).
        uncovered: What to do with parameters outside Linear/Conv2d/ConvTranspose2d layers:
            ``"error"`` or ``"diagonal"`` (a diagonal Fisher).
        clip_grad_value: Element-wise gradient clipping before preconditioning (``None``: off).
        seed: Seed of the target sampling (a generator on the parameters' device off the CPU).
        host_stats: ``True``: :meth:`step` returns the logged scalars as Python numbers (one
            stacked host read at the end of the step); ``False``: as 0-d device tensors, with no
            host read in a step between inversions and damping updates; :meth:`read_stats`
            turns them into numbers when the caller logs.

    Raises:
        ValueError: On an unknown ``estimation``/``uncovered``, an ``lr`` that is neither
            ``"adaptive"`` nor a finite positive number, a ``momentum`` that is neither
            ``"adaptive"`` nor finite and non-negative, a damping (or its bounds) that is not a
            finite positive number (NaN included), a decay outside ``(0, 1]``, a period below 1,
            or an EMA outside ``[0, 1)``.
        TypeError: If a trainable parameter is complex (or not floating point).
        NotImplementedError: If ``uncovered="error"`` and some parameter has no block.

    Example:
        K-FAC is an :class:`~curvopt.api.Algorithm`: ``step(batch)`` runs the forward, the
        backward and the update itself (there is no ``zero_grad``/``backward`` for the caller):

        >>> import torch
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import KFAC
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> kfac = KFAC(Objective(model, "cross_entropy"), lr=0.1, momentum=0.5)
        >>> for _ in range(3):
        ...     info = kfac.step((x, y))
        >>> kfac.step_count, sorted(info)[:3]
        (3, ['damping', 'loss', 'lr_coeff'])

        ``copy.deepcopy`` and ``pickle`` copy the model with it (hooks included), and
        :meth:`state_dict` loads with ``torch.load(..., weights_only=True)``.
    """

    def __init__(
        self,
        objective: Objective,
        lr: float | str = "adaptive",
        momentum: float | str = "adaptive",
        damping: float = 1.0,
        adaptive_damping: bool = True,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.9,
        damping_lower_threshold: float = 0.25,
        damping_upper_threshold: float = 0.75,
        min_damping: float = 1e-8,
        max_damping: float = math.inf,
        include_damping_in_quad_change: bool = False,
        curvature_ema: float = 0.95,
        curvature_update_period: int = 1,
        inverse_update_period: int = 5,
        estimation: str = "fisher_gradients",
        l2_reg: float = 0.0,
        uncovered: str = "error",
        clip_grad_value: float | None = None,
        seed: int = 0,
        host_stats: bool = True,
    ) -> None:
        check_hparams(
            "K-FAC",
            KFAC_RANGES,
            locals(),
            ordered=[("min_damping", "max_damping"), ("damping_lower_threshold", "damping_upper_threshold")],
        )
        check_floating("K-FAC", (p for p in objective.model.parameters() if p.requires_grad))
        check_materialised("K-FAC", objective.model.named_parameters())
        self.objective = objective
        self.lr, self.momentum = lr, momentum
        self.damping = float(damping)
        self.adaptive_damping = bool(adaptive_damping)
        self.interval = int(damping_adaptation_interval)
        self.omega = float(damping_adaptation_decay) ** self.interval
        self.lower, self.upper = float(damping_lower_threshold), float(damping_upper_threshold)
        self.min_damping, self.max_damping = float(min_damping), float(max_damping)
        self.include_damping_in_quad_change = bool(include_damping_in_quad_change)
        self.ema = float(curvature_ema)
        self.curvature_update_period = int(curvature_update_period)
        self.inverse_update_period = int(inverse_update_period)
        self.estimation = estimation
        self.l2_reg = float(l2_reg)
        self.clip_grad_value = clip_grad_value
        self.host_stats = bool(host_stats)
        device = next((p.device for p in objective.model.parameters()), torch.device("cpu"))
        # torch.multinomial needs a generator on the probabilities' device (the CPU's for meta)
        gen_device = device if device.type not in ("cpu", "meta") else torch.device("cpu")
        self.generator = torch.Generator(device=gen_device).manual_seed(int(seed))
        self.step_count = 0
        self.velocity: list[Tensor] | None = None
        self.names = [n for n, p in objective.model.named_parameters() if p.requires_grad]
        self.params = [p for p in objective.model.parameters() if p.requires_grad]
        self.blocks = self._make_blocks(uncovered)
        # GGN products run under torch.func, where BatchNorm may not update running statistics: use
        # a copy with batch-statistics BN (the training-mode function) for them.
        curv_model = hvp_module(objective.model)
        self._curv_objective = (
            objective if curv_model is objective.model else Objective(curv_model, objective.loss_kind)
        )
        self._capturing = False
        self._hooks = [
            b.module.register_forward_hook(_CaptureHook(self, b)) for b in self.blocks if b.kind != "diag"
        ]

    # -- setup ---------------------------------------------------------------------------------------
    def _make_blocks(self, uncovered: str) -> list[_Block]:
        covered: set[int] = set()
        blocks = []
        for name, m in self.objective.model.named_modules():
            w = getattr(m, "weight", None)
            if not isinstance(w, nn.Parameter) or not w.requires_grad:
                continue
            kind = block_kind(m)
            if kind is None:
                continue
            bias = getattr(m, "bias", None)
            has_bias = isinstance(bias, nn.Parameter) and bias.requires_grad
            params = [w] + ([bias] if has_bias else [])
            blocks.append(_Block(name, kind, m, params, has_bias))
            covered.update(id(p) for p in params)
        rest = [(n, p) for n, p in zip(self.names, self.params, strict=True) if id(p) not in covered]
        if rest and uncovered == "error":
            listed = ", ".join(n for n, _ in rest[:6]) + (" …" if len(rest) > 6 else "")
            raise NotImplementedError(
                f"K-FAC has no Kronecker block for {len(rest)} parameter tensors ({listed}): only "
                "nn.Linear, nn.Conv2d and nn.ConvTranspose2d layers are supported. kfac-jax fails the "
                "same way on the LM task's LSTM (the FOSI paper omits K-FAC there). Set "
                "optimizer.uncovered=diagonal to give them a diagonal Fisher instead."
            )
        blocks += [_Block(n, "diag", None, [p]) for n, p in rest]
        return blocks

    # -- factors -----------------------------------------------------------------------------------------
    def _update_factors(self, ds_list: list[Tensor], diag_grads: list[Tensor], normaliser: float) -> None:
        old, new = self.ema, 1.0 - self.ema
        kron = [b for b in self.blocks if b.kind != "diag"]
        for b, ds in zip(kron, ds_list, strict=True):
            A_hat = mirror_upper(input_factor(b.kind, b.module, b.inputs, b.has_bias))
            g = output_rows(b.kind, ds)
            G_hat = mirror_upper(normaliser * (g.t() @ g))
            # debiased EMA (kfac-jax's WeightedMovingAverage): value = raw / weight
            b.A = new * A_hat if b.A is None else old * b.A + new * A_hat
            b.G = new * G_hat if b.G is None else old * b.G + new * G_hat
            b.weight = old * b.weight + new
        diag = [b for b in self.blocks if b.kind == "diag"]
        for b, g in zip(diag, diag_grads, strict=True):
            f_hat = normaliser * g.detach() ** 2
            b.A = new * f_hat if b.A is None else old * b.A + new * f_hat
            b.weight = old * b.weight + new

    def _update_inverses(self) -> None:
        lam = self.damping + self.l2_reg
        for b in self.blocks:
            if b.kind == "diag" or b.A is None:
                continue
            A = (b.A / b.weight).double()
            G = (b.G / b.weight).double()
            # π on the device (float64, the same arithmetic as Python floats): no host read
            tr_a, tr_g = torch.trace(A) / A.shape[0], torch.trace(G) / G.shape[0]
            pi = torch.where((tr_a > 0) & (tr_g > 0), torch.sqrt(tr_a / tr_g), 1.0)
            eye_a = torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
            eye_g = torch.eye(G.shape[0], dtype=G.dtype, device=G.device)
            b.A_inv = torch.linalg.inv(A + pi * math.sqrt(lam) * eye_a).to(b.A.dtype)
            b.G_inv = torch.linalg.inv(G + math.sqrt(lam) / pi * eye_g).to(b.G.dtype)

    # -- gradient <-> block matrices ---------------------------------------------------------------------
    @staticmethod
    def _grad_matrix(b: _Block, grads: list[Tensor]) -> Tensor:
        w = grads[0]
        if b.kind == "convT":
            w = convT_equivalent_weight(w)
        mat = w.reshape(w.shape[0], -1)
        if b.has_bias:
            mat = torch.cat([mat, grads[1].reshape(-1, 1)], dim=1)
        return mat

    @staticmethod
    def _split_matrix(b: _Block, mat: Tensor) -> list[Tensor]:
        w_shape = b.params[0].shape
        w_mat = mat[:, :-1] if b.has_bias else mat
        if b.kind == "convT":  # inverse of convT_equivalent_weight
            w = w_mat.reshape(w_shape[1], w_shape[0], *w_shape[2:]).transpose(0, 1).flip(2, 3)
        else:
            w = w_mat.reshape(w_shape)
        return [w] + ([mat[:, -1].reshape(b.params[1].shape)] if b.has_bias else [])

    def precondition(self, grads: list[Tensor]) -> list[Tensor]:
        """Apply the damped block-diagonal inverse ``F̂⁻¹`` to a gradient.

        Args:
            grads: Gradients listed in ``self.params`` order.

        Returns:
            ``F̂⁻¹ g`` in the same order and shapes.
        """
        index = {id(p): i for i, p in enumerate(self.params)}
        out: list[Tensor | None] = [None] * len(self.params)
        lam = self.damping + self.l2_reg
        for b in self.blocks:
            idx = [index[id(p)] for p in b.params]
            if b.kind == "diag":
                f = b.A / b.weight if b.A is not None else torch.zeros_like(grads[idx[0]])
                out[idx[0]] = grads[idx[0]] / (f + lam)
                continue
            mat = self._grad_matrix(b, [grads[i] for i in idx])
            pre = b.G_inv @ mat @ b.A_inv
            for i, t in zip(idx, self._split_matrix(b, pre), strict=True):
                out[i] = t
        return out  # type: ignore[return-value]

    # -- quadratic model --------------------------------------------------------------------------------
    def _normaliser(self, y: Tensor) -> Tensor | float:
        """:meth:`Objective._normaliser` without its host read: a device count for cross-entropy."""
        obj = self.objective
        if obj.loss_kind == "cross_entropy":
            return (y != obj.ignore_index).sum()
        return float(y.shape[0])

    def _ggn_gram(self, x: Tensor, y: Tensor, vectors: list[list[Tensor]]) -> Tensor:
        """``vᵢᵀ C vⱼ`` for the update directions, float64 on the device (JVPs only).

        :meth:`Objective.ggn_gram`'s arithmetic entry by entry (the same values), without its host
        reads (the normaliser, a CPU matrix filled entry by entry).
        """
        params = dict(zip(self.names, [p.detach() for p in self.params], strict=True))
        vs = [dict(zip(self.names, vec, strict=True)) for vec in vectors]
        obj = self._curv_objective
        jvs, outputs = [], None
        for v in vs:
            outputs, jv = jvp(lambda p: obj.forward(p, x), (params,), (v,))
            jvs.append(jv)
        k = len(vs)
        n = self._normaliser(y)
        if isinstance(n, Tensor):
            n = n.to(torch.float64)
        entries: list[list[Tensor | None]] = [[None] * k for _ in range(k)]
        for j in range(k):
            hj = output_hessian_vp(outputs.detach(), jvs[j], obj.loss_kind, y)
            for i in range(j + 1):
                entries[i][j] = entries[j][i] = (jvs[i] * hj).sum().double() / n
        return torch.stack([torch.stack(row) for row in entries])  # type: ignore[misc]

    @staticmethod
    def _dot(a: list[Tensor], b: list[Tensor]) -> Tensor:
        return sum((u * w).sum() for u, w in zip(a, b, strict=True)).double()

    def _coefficients(
        self, grads: list[Tensor], vectors: list[list[Tensor]], M: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Coefficients of ``vectors`` and the model change q(δ) used for ρ, on the device.

        ``M[i, j] = vᵢᵀ C vⱼ`` (:meth:`_ggn_gram`). Fixed coefficients come from lr/momentum; the
        rest minimise the damped quadratic model. Returns float64 tensors (no host read).
        """
        n = len(vectors)
        lam = self.damping + self.l2_reg
        rows: list[list[Tensor | None]] = [[None] * n for _ in range(n)]
        for i in range(n):
            for j in range(i, n):
                rows[i][j] = rows[j][i] = self._dot(vectors[i], vectors[j])
        gram = torch.stack([torch.stack(row) for row in rows])  # type: ignore[misc]
        bvec = torch.stack([self._dot(grads, vectors[i]) for i in range(n)])
        fixed = [self.lr, self.momentum][:n]
        coeff = torch.zeros(n, dtype=torch.float64, device=gram.device)
        free = [i for i, c in enumerate(fixed) if c == "adaptive"]
        known = [i for i, c in enumerate(fixed) if c != "adaptive"]
        for i in known:
            coeff[i] = float(fixed[i])
        if free:
            Md = M + lam * gram
            rhs = bvec[free] + (Md[free][:, known] @ coeff[known] if known else 0.0)
            sol = _small_lstsq(Md[free][:, free], -rhs)
            coeff[free] = sol
        quad = M + (lam * gram if self.include_damping_in_quad_change else 0.0)
        change = bvec @ coeff + 0.5 * coeff @ quad @ coeff
        return coeff, change

    # -- the step --------------------------------------------------------------------------------------------
    def step(self, batch: Batch) -> dict[str, Any]:
        """One K-FAC update on ``batch`` (factors, inverses, coefficients, damping as scheduled).

        Args:
            batch: ``(x, y)``.

        Returns:
            ``loss`` (before the step), ``damping`` (used), ``lr_coeff``, ``momentum_coeff``,
            ``qmodel`` (q(δ); NaN with fixed coefficients) and, on damping-update steps, ``rho``:
            Python numbers, or with ``host_stats=False`` tensors for :meth:`read_stats`.
        """
        x, y = batch
        obj, model = self.objective, self.objective.model
        kind = obj.loss_kind
        update_curv = self.step_count % self.curvature_update_period == 0
        kron = [b for b in self.blocks if b.kind != "diag"]
        diag_params = [b.params[0] for b in self.blocks if b.kind == "diag"]
        self._capturing = update_curv
        try:
            with torch.enable_grad():
                out = model(x)
                loss = mean_loss(out, y, kind, obj.ignore_index)
                outputs = [b.outputs for b in kron] if update_curv else []
                if update_curv and self.estimation == "empirical":
                    res = torch.autograd.grad(loss, self.params + outputs)
                    grads = list(res[: len(self.params)])
                    ds = list(res[len(self.params) :])
                    pos = {id(p): i for i, p in enumerate(self.params)}
                    diag_g = [grads[pos[id(p)]] for p in diag_params]
                elif update_curv:
                    grads = list(torch.autograd.grad(loss, self.params, retain_graph=True))
                    y_s = sample_targets(out, kind, y, self.generator)
                    loss_s = mean_loss(out, y_s, kind, obj.ignore_index)
                    res = torch.autograd.grad(loss_s, outputs + diag_params)
                    ds, diag_g = list(res[: len(outputs)]), list(res[len(outputs) :])
                else:
                    grads = list(torch.autograd.grad(loss, self.params))
        finally:
            self._capturing = False
            for b in kron:
                b.outputs = None
        if update_curv:
            self._update_factors(ds, diag_g, self._normaliser(y))
            for b in kron:
                b.inputs = None
        if self.step_count % self.inverse_update_period == 0 or any(b.A_inv is None for b in kron):
            self._update_inverses()
        if self.clip_grad_value is not None:
            grads = [g.clamp(-self.clip_grad_value, self.clip_grad_value) for g in grads]
        if self.l2_reg:
            grads = [g + self.l2_reg * p.detach() for g, p in zip(grads, self.params, strict=True)]

        nat = [-t for t in self.precondition(grads)]
        vectors = [nat] + ([self.velocity] if self.velocity is not None else [])
        adaptive = "adaptive" in (self.lr, self.momentum)
        adapt_damping = self.adaptive_damping and (self.step_count + 1) % self.interval == 0
        scalars: dict[str, Any] = {"loss": loss.detach(), "damping": self.damping}
        saved = _snapshot_buffers(model) if (adaptive or adapt_damping) else None
        if adaptive or adapt_damping:
            coeff_t, change = self._coefficients(grads, vectors, self._ggn_gram(x, y, vectors))
            coeff: list[Any] = list(coeff_t.unbind(0))
        else:
            coeff = [float(self.lr), float(self.momentum)][: len(vectors)]
            change = float("nan")
        delta = [sum(c * v[i] for c, v in zip(coeff, vectors, strict=True)) for i in range(len(self.params))]
        with torch.no_grad():
            for p, d in zip(self.params, delta, strict=True):
                p.add_(d)
        self.velocity = [d.detach() for d in delta]
        if adapt_damping:  # a damping-update step: ρ is read on the host (one read)
            with torch.no_grad():
                new_loss_t = mean_loss(model(x), y, kind, obj.ignore_index)
            parts = [new_loss_t.double(), scalars["loss"].double(), torch.as_tensor(change).double()]
            new_loss, old_loss, change = (float(v) for v in torch.stack(parts).tolist())
            rho = (new_loss - old_loss) / change if change < 0 else -math.inf
            if not math.isfinite(rho) or rho < self.lower:
                self.damping = min(self.damping / self.omega, self.max_damping)
            elif rho > self.upper:
                self.damping = max(self.damping * self.omega, self.min_damping)
            scalars["rho"] = rho
        if saved is not None:
            _restore_buffers(model, saved)
        scalars.update(lr_coeff=coeff[0], momentum_coeff=coeff[1] if len(coeff) > 1 else 0.0, qmodel=change)
        self.step_count += 1
        return self.read_stats(scalars) if self.host_stats else scalars

    @staticmethod
    def read_stats(stats: dict[str, Any]) -> dict[str, Any]:
        """The scalars of a step as Python numbers (one stacked host read for the tensors).

        Args:
            stats: What :meth:`step` returned (with ``host_stats=False`` some values are tensors).

        Returns:
            The same keys with Python floats.
        """
        keys = [k for k, v in stats.items() if isinstance(v, Tensor)]
        out = dict(stats)
        if keys:
            values = torch.stack([stats[k].detach().to(torch.float64).reshape(()) for k in keys]).tolist()
            out.update(zip(keys, values))
        return out

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step count, damping, velocity, RNG state and every block's factors and inverses.

        The Kronecker factors, exactly symmetric, are stored as their upper triangles, and the
        inverses are left out (``None``) when the next step recomputes them anyway (``step_count`` a
        multiple of ``inverse_update_period``): a checkpoint taken there holds about a quarter of
        the factor data, and loading it restores the factors exactly.

        Returns:
            A dict accepted by :meth:`load_state_dict`.
        """
        stale = self.step_count % self.inverse_update_period == 0
        return {
            "step_count": self.step_count,
            "damping": self.damping,
            "velocity": self.velocity,
            "generator": self.generator.get_state(),
            "blocks": [
                {
                    "A": b.A if b.kind == "diag" else _pack_sym(b.A),
                    "G": _pack_sym(b.G),
                    "weight": b.weight,
                    "A_inv": None if stale else b.A_inv,
                    "G_inv": None if stale else b.G_inv,
                }
                for b in self.blocks
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (same model, same blocks).

        Args:
            state: A dict returned by :meth:`state_dict`.
        """
        self.step_count = state["step_count"]
        self.damping = state["damping"]
        self.velocity = state["velocity"]
        self.generator.set_state(state["generator"])
        for b, s in zip(self.blocks, state["blocks"], strict=True):
            b.A = s["A"] if b.kind == "diag" else _unpack_sym(s["A"])
            b.G, b.weight, b.A_inv, b.G_inv = _unpack_sym(s["G"]), s["weight"], s["A_inv"], s["G_inv"]


def build_kfac(objective: Objective, data: DataBundle, **options: Any) -> KFAC:
    """Factory for ``conf/optimizer/kfac.yaml`` (the loop passes the objective and data).

    Args:
        objective: The model and its loss kind.
        data: The run's data (unused).
        **options: Keyword arguments of :class:`KFAC`.

    Returns:
        The :class:`KFAC` algorithm.

    Example:
        >>> import torch
        >>> from curvopt.api import DataBundle
        >>> from curvopt.objective import Objective
        >>> from curvopt.optim import build_kfac
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> alg = build_kfac(Objective(model, "cross_entropy"), DataBundle(train=(x, y)), lr=0.1, momentum=0.5)
        >>> for _ in range(2):
        ...     info = alg.step((x, y))
        >>> type(alg).__name__, "loss" in info
        ('KFAC', True)
    """
    del data
    return KFAC(objective, **options)
