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
    """Concatenate a dict/list of tensors into one vector (dict order)."""
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return torch.cat([t.reshape(-1) for t in values])


def unflatten(vector: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Split a flat vector into tensors shaped like ``like`` (same key order)."""
    out, offset = {}, 0
    for name, ref in like.items():
        size = ref.numel()
        out[name] = vector[offset : offset + size].view_as(ref)
        offset += size
    if offset != vector.numel():
        raise ValueError(f"vector has {vector.numel()} entries, parameters need {offset}")
    return out


def tree_dot(a: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
    """Euclidean inner product of two parameter-shaped dicts."""
    return sum((x * b[k]).sum() for k, x in a.items())


def per_example_loss(outputs: Tensor, targets: Tensor, kind: str, ignore_index: int = -100) -> Tensor:
    """Per-example loss (shape ``outputs.shape[:1]`` for vector outputs).

    For sequence cross-entropy (outputs ``(B, T, C)``) the result is per token, shape ``(B, T)``,
    with ignored positions set to zero.
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
    """Mean of the per-example loss; for cross-entropy, mean over non-ignored targets."""
    if kind == "cross_entropy":
        return F.cross_entropy(
            outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), ignore_index=ignore_index
        )
    return per_example_loss(outputs, targets, kind).mean()


def output_hessian_vp(outputs: Tensor, u: Tensor, kind: str, targets: Tensor | None = None) -> Tensor:
    """``H_out · u`` for the *per-example* loss at ``outputs`` (no 1/n factor).

    squared error: identity; cross-entropy: ``diag(p) − p pᵀ``; sigmoid BCE: ``diag(p(1−p))``.
    Ignored cross-entropy positions (``targets == -100``) contribute zero curvature.
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
    """

    def __init__(self, model: nn.Module, loss: str, ignore_index: int = -100) -> None:
        if loss not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {loss!r}; choose one of {LOSS_KINDS}")
        self.model = model
        self.loss_kind = loss
        self.ignore_index = ignore_index

    # -- parameters -------------------------------------------------------------------------
    def params(self) -> Params:
        """The trainable parameters as a detached name → tensor dict (shares storage)."""
        return {k: p.detach() for k, p in self.model.named_parameters() if p.requires_grad}

    def set_params(self, params: Params) -> None:
        """Copy ``params`` into the module in place."""
        with torch.no_grad():
            named = dict(self.model.named_parameters())
            for k, v in params.items():
                named[k].copy_(v)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.params().values())

    # -- evaluation ---------------------------------------------------------------------------
    def forward(self, params: Params, x: Tensor) -> Tensor:
        return functional_call(self.model, params, (x,))

    def loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """Mean loss of the batch at ``params``."""
        return mean_loss(self.forward(params, x), y, self.loss_kind, self.ignore_index)

    def per_example_losses(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        return per_example_loss(self.forward(params, x), y, self.loss_kind, self.ignore_index)

    def gradient(self, params: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Params]:
        """(mean loss, gradient dict) at ``params``."""
        value = {}

        def f(p: Params) -> Tensor:
            out = self.loss(p, x, y)
            value["loss"] = out.detach()
            return out

        g = grad(f)(params)
        return value["loss"], g

    # -- Jacobian products ----------------------------------------------------------------------
    def jvp(self, params: Params, x: Tensor, v: Params) -> Tensor:
        """``J v``: directional derivative of the outputs (shape of the model output)."""
        return jvp(lambda p: self.forward(p, x), (params,), (v,))[1]

    def vjp(self, params: Params, x: Tensor, u: Tensor) -> Params:
        """``Jᵀ u`` for an output-shaped ``u``."""
        _, pullback = vjp(lambda p: self.forward(p, x), params)
        return pullback(u)[0]

    def linearize(
        self, params: Params, x: Tensor
    ) -> tuple[Tensor, Callable[[Params], Tensor], Callable[[Tensor], Params]]:
        """One forward pass; returns ``(outputs, jvp_fn, vjp_fn)`` reusable across an inner solve.

        The VJP closure keeps the forward graph, so repeated ``Jᵀu`` cost one backward each;
        the JVP comes from ``torch.func.linearize`` (traced once per call of this method, which
        is once per outer iteration in the curvature solvers).
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
        """Gauss-Newton of the mean loss times ``v``: ``(1/n) Jᵀ H_out J v``."""
        outputs, jv = jvp(lambda p: self.forward(p, x), (params,), (v,))
        hjv = output_hessian_vp(outputs.detach(), jv, self.loss_kind, y)
        return {k: t / self._normaliser(y) for k, t in self.vjp(params, x, hjv).items()}

    def hvp(self, params: Params, x: Tensor, y: Tensor, v: Params) -> Params:
        """Hessian of the mean loss times ``v`` (forward-over-reverse)."""
        return jvp(grad(lambda p: self.loss(p, x, y)), (params,), (v,))[1]

    def _normaliser(self, y: Tensor) -> float:
        """Number of terms the mean loss averages over (non-ignored tokens for CE)."""
        if self.loss_kind == "cross_entropy":
            return float((y != self.ignore_index).sum().item())
        return float(y.shape[0])
