"""`Objective`: a model plus a loss kind, with functional curvature products.

Every second-order method in this repository (SHF-LSMR, Martens HF-CG, FGN, SGN, FOSI's
Lanczos) needs the same few things: the model as a function of its parameters, per-example
losses, J·v, Jᵀ·u, the Gauss-Newton product Jᵀ H_L J v and the Hessian product H v. They are
built here once, with `torch.func`, so each method only writes its own algorithm.

Conventions
-----------
* Parameters are a ``dict[str, Tensor]`` (``torch.func.functional_call`` style). Vectors in
  parameter space are dicts with the same keys; :func:`flatten` / :func:`unflatten` convert.
* ``loss`` is the **mean over examples** of the per-example loss:
  - ``squared_error``: ``½‖out − y‖²`` summed over output coordinates (SHF's ``f_i``),
  - ``cross_entropy``: softmax cross-entropy on logits (targets are class indices; for
    sequence outputs ``(..., C)`` the targets ``(...)`` may hold ``ignore_index``),
  - ``sigmoid_bce``: binary cross-entropy on logits summed over output coordinates
    (multi-label, and Martens' autoencoder objective).
* ``ggn_vp`` is the Gauss-Newton of that mean loss: ``(1/n) Jᵀ H_out J v``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, linearize, vjp

LossKind = Literal["squared_error", "cross_entropy", "sigmoid_bce"]
Params = dict[str, Tensor]
LOSS_KINDS: tuple[str, ...] = ("squared_error", "cross_entropy", "sigmoid_bce")


def flatten(tensors: dict[str, Tensor] | list[Tensor]) -> Tensor:
    """Concatenate a dict or list of tensors into one flat vector.

    Args:
        tensors: Tensors of any shapes; a dict is read in its key order.

    Returns:
        A 1-D tensor holding every entry, tensor after tensor.
    """
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return torch.cat([t.reshape(-1) for t in values])


def unflatten(vector: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Split a flat vector into tensors shaped like ``like`` (the inverse of :func:`flatten`).

    Args:
        vector: A 1-D tensor with as many entries as all of ``like`` together.
        like: Reference tensors; their key order and shapes define the split.

    Returns:
        A dict with the keys of ``like``, each value a view of ``vector`` of the reference shape.

    Raises:
        ValueError: If ``vector`` has a different number of entries.
    """
    out, offset = {}, 0
    for name, ref in like.items():
        size = ref.numel()
        out[name] = vector[offset : offset + size].view_as(ref)
        offset += size
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} entries, parameters need {offset}")
    return out


def tree_dot(a: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
    """Euclidean inner product of two parameter-shaped dicts.

    Args:
        a: A dict of tensors.
        b: A dict with (at least) the keys of ``a`` and matching shapes.

    Returns:
        The scalar ``Σ_k ⟨a[k], b[k]⟩`` as a 0-d tensor.
    """
    return sum((x * b[k]).sum() for k, x in a.items())


def per_example_loss(outputs: Tensor, targets: Tensor, kind: str, ignore_index: int = -100) -> Tensor:
    """Per-example loss (shape ``outputs.shape[:1]`` for vector outputs).

    For sequence cross-entropy (outputs ``(B, T, C)``) the result is per token, shape ``(B, T)``,
    with ignored positions set to zero.

    Args:
        outputs: Model outputs, example index first (logits for the two cross-entropies).
        targets: Same shape as ``outputs`` for ``squared_error`` and ``sigmoid_bce``; class
            indices of shape ``outputs.shape[:-1]`` for ``cross_entropy``.
        kind: One of :data:`LOSS_KINDS`.
        ignore_index: Cross-entropy target value that contributes no loss.

    Returns:
        The per-example (per-token for sequences) losses.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    if kind == "squared_error":
        diff = (outputs - targets).flatten(1)
        return 0.5 * (diff * diff).sum(dim=1)
    if kind == "cross_entropy":
        logits = outputs.reshape(-1, outputs.shape[-1])
        flat = F.cross_entropy(logits, targets.reshape(-1), reduction="none", ignore_index=ignore_index)
        return flat.view(targets.shape)
    if kind == "sigmoid_bce":
        return (
            F.binary_cross_entropy_with_logits(outputs, targets.to(outputs.dtype), reduction="none")
            .flatten(1)
            .sum(1)
        )
    raise ValueError(f"unknown loss kind {kind!r}; choose one of {LOSS_KINDS}")


def mean_loss(outputs: Tensor, targets: Tensor, kind: str, ignore_index: int = -100) -> Tensor:
    """Mean of the per-example loss; for cross-entropy, mean over non-ignored targets.

    Args:
        outputs: Model outputs, as in :func:`per_example_loss`.
        targets: Targets, as in :func:`per_example_loss`.
        kind: One of :data:`LOSS_KINDS`.
        ignore_index: Cross-entropy target value excluded from the mean.

    Returns:
        The scalar mean loss.
    """
    if kind == "cross_entropy":
        return F.cross_entropy(
            outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), ignore_index=ignore_index
        )
    return per_example_loss(outputs, targets, kind).mean()


def output_hessian_vp(outputs: Tensor, u: Tensor, kind: str, targets: Tensor | None = None) -> Tensor:
    """``H_out · u`` for the *per-example* loss at ``outputs`` (no 1/n factor).

    squared error: identity; cross-entropy: ``diag(p) − p pᵀ``; sigmoid BCE: ``diag(p(1−p))``.
    Ignored cross-entropy positions (``targets == -100``) contribute zero curvature.

    Args:
        outputs: Model outputs (logits for the cross-entropies) at which the Hessian is taken.
        u: Output-shaped tangent.
        kind: One of :data:`LOSS_KINDS`.
        targets: Cross-entropy targets, only to zero the ignored positions; ``None`` keeps all.

    Returns:
        ``H_out u``, shaped like ``u``.

    Raises:
        ValueError: If ``kind`` is unknown.
    """
    if kind == "squared_error":
        return u
    if kind == "cross_entropy":
        p = torch.softmax(outputs, dim=-1)
        hu = p * u - p * (p * u).sum(dim=-1, keepdim=True)
        if targets is not None:
            hu = hu * (targets != -100).unsqueeze(-1).to(hu.dtype)
        return hu
    if kind == "sigmoid_bce":
        p = torch.sigmoid(outputs)
        return p * (1 - p) * u
    raise ValueError(f"unknown loss kind {kind!r}; choose one of {LOSS_KINDS}")


class Objective:
    """A model and a loss kind, with matrix-free curvature products via ``torch.func``.

    The products take explicit ``params`` so callers can evaluate at trial points (line search,
    ρ) without touching the module; :meth:`params` returns the module's live parameters.
    In every method ``params`` is a name → tensor dict of the model's trainable parameters
    (as :meth:`params` returns) and ``x`` a batch of inputs.

    Args:
        model: The network; evaluated functionally with ``torch.func.functional_call``.
        loss: The loss kind, one of :data:`LOSS_KINDS`.
        ignore_index: Cross-entropy target value that contributes neither loss nor curvature.

    Raises:
        ValueError: If ``loss`` is not a known loss kind.
    """

    def __init__(self, model: nn.Module, loss: str, ignore_index: int = -100) -> None:
        if loss not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {loss!r}; choose one of {LOSS_KINDS}")
        self.model = model
        self.loss_kind = loss
        self.ignore_index = ignore_index

    # -- parameters -------------------------------------------------------------------------
    def params(self) -> Params:
        """The trainable parameters as a detached name → tensor dict (shares storage).

        Returns:
            ``{name: parameter.detach()}`` for every parameter with ``requires_grad``.
        """
        return {k: p.detach() for k, p in self.model.named_parameters() if p.requires_grad}

    def set_params(self, params: Params) -> None:
        """Copy ``params`` into the module in place.

        Args:
            params: Name → tensor dict; each named parameter of the model is overwritten.
        """
        with torch.no_grad():
            named = dict(self.model.named_parameters())
            for k, v in params.items():
                named[k].copy_(v)

    def num_params(self) -> int:
        """Number of trainable scalars (the length of a flat parameter vector).

        Returns:
            The total number of entries of :meth:`params`.
        """
        return sum(p.numel() for p in self.params().values())

    # -- evaluation ---------------------------------------------------------------------------
    def forward(self, params: Params, x: Tensor) -> Tensor:
        """Model outputs at ``params`` (the module's own parameters are not used).

        Args:
            params: Parameters to evaluate at.
            x: Input batch.

        Returns:
            The model's output for ``x``.
        """
        return functional_call(self.model, params, (x,))

    def loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """Mean loss of the batch at ``params``.

        Args:
            params: Parameters to evaluate at.
            x: Input batch.
            y: Targets of the batch.

        Returns:
            The scalar mean loss (:func:`mean_loss`).
        """
        return mean_loss(self.forward(params, x), y, self.loss_kind, self.ignore_index)

    def per_example_losses(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """Per-example losses of the batch at ``params``.

        Args:
            params: Parameters to evaluate at.
            x: Input batch.
            y: Targets of the batch.

        Returns:
            The losses of :func:`per_example_loss` (per token for sequence outputs).
        """
        return per_example_loss(self.forward(params, x), y, self.loss_kind, self.ignore_index)

    def gradient(self, params: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Params]:
        """Mean loss and its gradient at ``params``.

        Args:
            params: Parameters to evaluate at.
            x: Input batch.
            y: Targets of the batch.

        Returns:
            ``(loss, grads)``: the detached scalar mean loss and a name → gradient dict.
        """
        value = {}

        def f(p: Params) -> Tensor:
            out = self.loss(p, x, y)
            value["loss"] = out.detach()
            return out

        g = grad(f)(params)
        return value["loss"], g

    # -- Jacobian products ----------------------------------------------------------------------
    def jvp(self, params: Params, x: Tensor, v: Params) -> Tensor:
        """``J v``: directional derivative of the outputs.

        Args:
            params: Point of linearisation.
            x: Input batch.
            v: Parameter-shaped tangent dict.

        Returns:
            ``J v``, shaped like the model output.
        """
        return jvp(lambda p: self.forward(p, x), (params,), (v,))[1]

    def vjp(self, params: Params, x: Tensor, u: Tensor) -> Params:
        """``Jᵀ u`` for an output-shaped ``u``.

        Args:
            params: Point of linearisation.
            x: Input batch.
            u: Output-shaped cotangent.

        Returns:
            ``Jᵀ u`` as a parameter-shaped dict.
        """
        _, pullback = vjp(lambda p: self.forward(p, x), params)
        return pullback(u)[0]

    def linearize(
        self, params: Params, x: Tensor
    ) -> tuple[Tensor, Callable[[Params], Tensor], Callable[[Tensor], Params]]:
        """One forward pass; returns ``(outputs, jvp_fn, vjp_fn)`` reusable across an inner solve.

        The VJP closure keeps the forward graph, so repeated ``Jᵀu`` cost one backward each;
        the JVP comes from ``torch.func.linearize`` (traced once per call of this method, which
        is once per outer iteration in the curvature solvers).

        Args:
            params: Point of linearisation.
            x: Input batch.

        Returns:
            ``(outputs, jvp_fn, vjp_fn)``: the model outputs, ``v ↦ J v`` (parameter dict to
            output-shaped tensor) and ``u ↦ Jᵀ u`` (output-shaped tensor to parameter dict).
        """
        f = lambda p: self.forward(p, x)  # noqa: E731
        outputs, pullback = vjp(f, params)
        _, linear = linearize(f, params)

        def vjp_fn(u: Tensor) -> Params:
            return pullback(u)[0]

        def jvp_fn(v: Params) -> Tensor:
            return linear(v)

        return outputs, jvp_fn, vjp_fn

    def ggn_vp(self, params: Params, x: Tensor, y: Tensor, v: Params) -> Params:
        """Gauss-Newton of the mean loss times ``v``: ``(1/n) Jᵀ H_out J v``.

        ``n`` is the number of examples (of non-ignored tokens for cross-entropy).

        Args:
            params: Point of linearisation.
            x: Input batch.
            y: Targets (they set ``n`` and mask ignored cross-entropy positions).
            v: Parameter-shaped tangent dict.

        Returns:
            The product as a parameter-shaped dict.
        """
        outputs, jv = jvp(lambda p: self.forward(p, x), (params,), (v,))
        hjv = output_hessian_vp(outputs.detach(), jv, self.loss_kind, y)
        return {k: t / self._normaliser(y) for k, t in self.vjp(params, x, hjv).items()}

    def ggn_gram(self, params: Params, x: Tensor, y: Tensor, vs: list[Params]) -> Tensor:
        """The Gauss-Newton's quadratic form on a few directions: ``M[i, j] = vᵢᵀ G vⱼ`` (float64).

        ``G = (1/n) Jᵀ H_out J``, so ``vᵢᵀ G vⱼ = (1/n) (J vᵢ)ᵀ H_out (J vⱼ)``: one JVP per
        direction and no backward pass, about half the cost of a :meth:`ggn_vp` per direction
        (kfac-jax's quadratic model is formed the same way).

        Args:
            params: As in :meth:`ggn_vp`.
            x: As in :meth:`ggn_vp`.
            y: As in :meth:`ggn_vp`.
            vs: The directions, parameter-shaped tangent dicts like :meth:`ggn_vp`'s ``v``.

        Returns:
            The symmetric ``(len(vs), len(vs))`` matrix.
        """
        jvs, outputs = [], None
        for v in vs:
            outputs, jv = jvp(lambda p: self.forward(p, x), (params,), (v,))
            jvs.append(jv)
        k = len(vs)
        gram = torch.zeros(k, k, dtype=torch.float64)
        if not vs:
            return gram
        n = self._normaliser(y)
        for j in range(k):
            hj = output_hessian_vp(outputs.detach(), jvs[j], self.loss_kind, y)
            for i in range(j + 1):
                gram[i, j] = gram[j, i] = (jvs[i] * hj).sum().double() / n
        return gram

    def hvp(self, params: Params, x: Tensor, y: Tensor, v: Params) -> Params:
        """Hessian of the mean loss times ``v`` (forward-over-reverse).

        Args:
            params: Point at which the Hessian is taken.
            x: Input batch.
            y: Targets of the batch.
            v: Parameter-shaped tangent dict.

        Returns:
            ``∇² L(params) v`` as a parameter-shaped dict.
        """
        return jvp(grad(lambda p: self.loss(p, x, y)), (params,), (v,))[1]

    def _normaliser(self, y: Tensor) -> float:
        """Number of terms the mean loss averages over (non-ignored tokens for CE)."""
        if self.loss_kind == "cross_entropy":
            return float((y != self.ignore_index).sum().item())
        return float(y.shape[0])
